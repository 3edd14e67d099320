// A send that fails on the trainer fails the step at once, everywhere
// (issue 52): the trainer reports it to the coordinator, which aborts the
// step on the engine rank it was for; that rank stops receiving. An engine
// rank without staging whose params the failed step partly wrote says so
// (torn) until its next commit, and its version stays the one it committed.
//
// One trainer rank and one engine rank of tiny-llama in threads of this
// process over UCX. Each step has its own Publisher (a trainer process that
// rejoins with another transport): step 1 over plain UCX, step 2 through
// "fault:ucx?fail_after=3" on the trainer only, step 3 over UCX again.
#include "e2e/e2e_helpers.h"

#include <weightsync/backend/transport.h>
#include <weightsync/control.h>
#include <weightsync/layouts.h>
#include <weightsync/materialize.h>
#include <weightsync/publisher.h>
#include <weightsync/subscriber.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <thread>

namespace weightsync::engine {
namespace {

using e2e::Model;
using Params = std::vector<std::vector<char>>;

constexpr int64_t kLast = 3;  // version 3 is the checkpoint

// Version `step`'s bytes from the checkpoint's: every element but zeros
// (the engine's padding) has a low bit flipped, another one each step, so
// that versions 1 and 2 differ in every element; version kLast is the
// checkpoint. Element-wise, so trainer shards and engine params agree.
void make_version(std::vector<char>& data, size_t item, int64_t step) {
  if (step == kLast) return;
  for (size_t at = 0; at + item <= data.size(); at += item)
    if (std::any_of(data.begin() + at, data.begin() + at + item, [](char c) { return c != 0; }))
      data[at] = static_cast<char>(data[at] ^ (step % 2 ? 1 : 2));
}

// What the engine rank saw after one step.
struct Seen {
  StepOutcome outcome;
  int64_t version = -1;
  bool torn = false;
  Params params;
};

class FailFast : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto names = transport_names();
    if (std::find(names.begin(), names.end(), "ucx") == names.end())
      GTEST_SKIP() << "weightsync was built without UCX";
    m_ = e2e::make_model("tiny-llama", "fsdp=1", 1, 1);
    ckpt_.emplace(Checkpoint::open(m_.checkpoint));
    layout_ = TrainerLayout::load(m_.trainer);
    config_ = load_engine_config(m_.engine);
    engine_layout_ = make_engine_layout(config_);
    for (const auto& p : rank_layout().params)
      params_.emplace_back(static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype), '\0');
    for (const LoadSpec& spec : layout_.params) {
      const Shape shape = local_shape(spec, layout_.mesh, 0);
      pristine_.emplace_back(static_cast<size_t>(numel(shape)) * itemsize(spec.dtype), '\0');
      fill_local_tensor(*ckpt_, spec, layout_.mesh, 0,
                        host_view(pristine_.back().data(), spec.dtype, shape));
    }
  }
  const EngineRankLayout& rank_layout() const { return engine_layout_.rank_layout(0); }

  // The engine rank's params at version `step`.
  Params expected(int64_t step) const {
    Params out;
    for (const auto& p : rank_layout().params) {
      out.emplace_back(static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype));
      fill_param(*ckpt_, p, out.back().data());
      make_version(out.back(), itemsize(p.dtype), step);
    }
    return out;
  }

  // The engine rank (no staging) over `transport`, on its own thread, until
  // version kLast or `max_steps` outcomes; each outcome is recorded with
  // what it left.
  std::thread engine(int max_steps, const std::string& transport = "ucx") {
    return std::thread([=, this] {
      try {
        SubscriberOptions so;
        so.coordinator = coordinator_.address();
        so.engine = config_;
        so.transport = transport;
        so.step_timeout = std::chrono::seconds(30);
        Subscriber sub(so);
        for (size_t i = 0; i < params_.size(); ++i)
          sub.register_param(rank_layout().params[i].name, params_[i].data(),
                             rank_layout().params[i].dtype, rank_layout().params[i].shape);
        for (int i = 0; i < 600 && sub.version() < kLast && int(seen_.size()) < max_steps; ++i)
          if (auto out = sub.run_step(std::chrono::milliseconds(200)))
            seen_.push_back(Seen{*out, sub.version(), sub.torn(), params_});
      } catch (const Error& e) {
        engine_error_ = e.what();
      }
    });
  }

  // A trainer process for one step: pushes version `step` over `transport`.
  PushResult push(int64_t step, const std::string& transport, PlanMode mode = PlanMode::p2p) {
    PublisherOptions po;
    po.plan.mode = mode;
    po.coordinator = coordinator_.address();
    po.layout = layout_;
    po.engine = config_;
    po.transport = transport;
    po.plan.bucket_bytes = 4096;
    po.step_timeout = std::chrono::seconds(30);
    Publisher pub(po);
    shards_ = pristine_;
    for (size_t i = 0; i < layout_.params.size(); ++i) {
      const LoadSpec& spec = layout_.params[i];
      make_version(shards_[i], itemsize(spec.dtype), step);
      pub.register_tensor(
          spec.name, host_view(shards_[i].data(), spec.dtype, local_shape(spec, layout_.mesh, 0)));
    }
    pub.prepare();
    return pub.push(step);
  }

  // A push that may fail, timed from the call to its return.
  struct Timed {
    std::optional<PushResult> result;  // none: it threw
    std::string thrown;                // then what
    double seconds = 0;
  };
  Timed timed_push(int64_t step, const std::string& transport, PlanMode mode = PlanMode::p2p) {
    Timed t;
    const auto start = std::chrono::steady_clock::now();
    try {
      t.result = push(step, transport, mode);
    } catch (const Error& e) {
      t.thrown = e.what();
    }
    t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return t;
  }

  Model m_;
  std::optional<Checkpoint> ckpt_;
  TrainerLayout layout_;
  EngineConfig config_;
  EngineLayout engine_layout_;
  control::Coordinator coordinator_{control::CoordinatorOptions{}};
  Params params_, pristine_, shards_;
  std::vector<Seen> seen_;
  std::string engine_error_;
};

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// The run: step 2's sends fail on the trainer after its first three
// operations. push(2) returns long before the step timeout (30 s), its
// failure names the trainer's failed send (not an engine's receive timeout)
// and bytes_sent counts only what went out. The engine rank keeps version
// 1 and either still holds it bit for bit or says it is torn (which of the
// two depends on whether the abort came before the first buckets were
// applied); step 3 over a
// working transport commits it whole and it is no longer torn.
TEST_F(FailFast, TrainerSendFailureAbortsTheStepAtOnceAndTheEngineSaysItIsTorn) {
  std::thread engine = this->engine(3);
  const PushResult first = push(1, "ucx");
  ASSERT_EQ(first.committed, (std::vector<int>{0}));

  const Timed second = timed_push(2, "fault:ucx?fail_after=3");
  std::printf("push(2) with a failed send returned after %.3f s (bytes_sent %llu, step 1: %llu)\n",
              second.seconds,
              second.result ? static_cast<unsigned long long>(second.result->bytes_sent) : 0ULL,
              static_cast<unsigned long long>(first.bytes_sent));
  EXPECT_LT(second.seconds, 5.0) << "a failed send must not wait out the 30 s step timeout";
  ASSERT_TRUE(second.result) << "push(2) threw: " << second.thrown;
  EXPECT_TRUE(second.result->committed.empty());
  ASSERT_EQ(second.result->failed.size(), 1u);
  const std::string& why = second.result->failed[0].second;
  EXPECT_TRUE(has(why, "trainer rank 0")) << why;
  EXPECT_TRUE(has(why, "injected failure")) << "names the trainer's failed send: " << why;
  EXPECT_FALSE(has(why, "step timeout")) << why;
  // fail_after=3: three messages went out, none above a bucket (4096).
  EXPECT_LE(second.result->bytes_sent, 3u * 4096) << "counts only the sends that completed";

  const PushResult third = push(3, "ucx");
  EXPECT_EQ(third.committed, (std::vector<int>{0}));
  engine.join();
  ASSERT_EQ(engine_error_, "");
  ASSERT_EQ(seen_.size(), 3u);
  const Params v1 = expected(1);
  EXPECT_TRUE(seen_[0].outcome.committed);
  EXPECT_EQ(seen_[0].params, v1);
  EXPECT_FALSE(seen_[0].torn);

  const Seen& failed = seen_[1];
  std::printf("engine rank 0 after step 2: torn %d, holds version 1 whole %d, %.3f s\n",
              failed.torn, failed.params == v1, failed.outcome.seconds);
  EXPECT_FALSE(failed.outcome.committed);
  EXPECT_EQ(failed.version, 1);
  EXPECT_TRUE(failed.torn || failed.params == v1)
      << "the params hold part of step 2 and the rank does not say it is torn";
  EXPECT_TRUE(has(failed.outcome.reason, "injected failure")) << failed.outcome.reason;
  EXPECT_LT(failed.outcome.seconds, 5.0) << failed.outcome.reason;

  EXPECT_TRUE(seen_[2].outcome.committed);
  EXPECT_EQ(seen_[2].version, 3);
  EXPECT_FALSE(seen_[2].torn);
  EXPECT_EQ(seen_[2].params, expected(3));
}

// The same failed send in broadcast mode (the trainer rank is the root of
// every bucket): the step fails at once too, and bytes_sent counts only the
// buckets that went out, not the ones packed for an engine rank that had
// already failed.
TEST_F(FailFast, BroadcastSendFailureCountsOnlyTheBucketsThatWentOut) {
  std::thread engine = this->engine(2);
  const PushResult first = push(1, "ucx", PlanMode::broadcast);
  ASSERT_EQ(first.committed, (std::vector<int>{0}));
  const Timed second = timed_push(2, "fault:ucx?fail_after=3", PlanMode::broadcast);
  std::printf("broadcast push(2) with a failed send: %.3f s, bytes_sent %llu (step 1: %llu)\n",
              second.seconds,
              second.result ? static_cast<unsigned long long>(second.result->bytes_sent) : 0ULL,
              static_cast<unsigned long long>(first.bytes_sent));
  engine.join();
  EXPECT_LT(second.seconds, 5.0) << "a failed send must not wait out the 30 s step timeout";
  ASSERT_TRUE(second.result) << "push(2) threw: " << second.thrown;
  EXPECT_TRUE(second.result->committed.empty());
  ASSERT_EQ(second.result->failed.size(), 1u);
  EXPECT_TRUE(has(second.result->failed[0].second, "injected failure"))
      << second.result->failed[0].second;
  ASSERT_GT(first.bytes_sent, 8u * 4096) << "the model must take more buckets than the failure";
  EXPECT_LE(second.result->bytes_sent, 3u * 4096) << "counts only the sends that completed";
  ASSERT_EQ(engine_error_, "");
  ASSERT_EQ(seen_.size(), 2u);
  EXPECT_TRUE(seen_[0].outcome.committed);
  EXPECT_FALSE(seen_[1].outcome.committed);
  EXPECT_EQ(seen_[1].version, 1);
}

// The engine rank's own receives fail (after its first three operations):
// it stops receiving and says so at once, and the coordinator tells the
// trainer to stop sending to it. The trainer's sends are rendezvous ones
// (UCX_RNDV_THRESH below the bucket), which complete only when the engine
// receives them: without that word the push would wait out the step
// timeout. The rank never committed, so it is torn (its receives had begun
// landing in the params).
TEST_F(FailFast, EngineReceiveFailureStopsTheTrainersSendsAtOnce) {
  std::thread engine = this->engine(1, "fault:ucx?fail_after=3");
  const Timed result = timed_push(1, "ucx?UCX_RNDV_THRESH=1024");
  std::printf("push(1) to an engine whose receive failed returned after %.3f s\n", result.seconds);
  engine.join();
  EXPECT_LT(result.seconds, 5.0) << "the trainer must not wait out the 30 s step timeout";
  ASSERT_TRUE(result.result) << "push(1) threw: " << result.thrown;
  EXPECT_TRUE(result.result->committed.empty());
  ASSERT_EQ(result.result->failed.size(), 1u);
  EXPECT_TRUE(has(result.result->failed[0].second, "injected failure"))
      << result.result->failed[0].second;
  ASSERT_EQ(engine_error_, "");
  ASSERT_EQ(seen_.size(), 1u);
  EXPECT_FALSE(seen_[0].outcome.committed);
  EXPECT_EQ(seen_[0].version, -1);
  EXPECT_TRUE(seen_[0].torn);
}

}  // namespace
}  // namespace weightsync::engine
