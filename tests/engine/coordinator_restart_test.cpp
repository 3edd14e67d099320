// The coordinator can die (issue 52): a `weightsync coordinator` process is
// SIGKILLed during a step and restarted on its address. The engine rank
// keeps serving its committed version throughout (its serve loop never
// fails), the step in flight is aborted on both sides at once and leaves
// the engine's params as they were (staging), the ranks come back to the
// new coordinator as the same members with their versions, and the next
// step commits.
//
// One trainer rank and one engine rank of tiny-llama in threads of this
// process over UCX; the trainer's sends are slowed (fault:ucx?delay_ms) so
// that step 2 is still moving when the coordinator dies.
#include "control/coordinator_process.h"
#include "e2e/e2e_helpers.h"

#include <weightsync/backend/transport.h>
#include <weightsync/control.h>
#include <weightsync/layouts.h>
#include <weightsync/materialize.h>
#include <weightsync/publisher.h>
#include <weightsync/subscriber.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <thread>

namespace weightsync::engine {
namespace {

using namespace std::chrono_literals;
using control::testing::CoordinatorProcess;
using Params = std::vector<std::vector<char>>;

// Version `step` of the checkpoint's bytes: every nonzero element has a low
// bit flipped, another one each step, so that versions differ everywhere.
void make_version(std::vector<char>& data, size_t item, int64_t step) {
  for (size_t at = 0; at + item <= data.size(); at += item)
    if (std::any_of(data.begin() + at, data.begin() + at + item, [](char c) { return c != 0; }))
      data[at] = static_cast<char>(data[at] ^ (step % 2 ? 1 : 2));
}

class CoordinatorRestart : public ::testing::Test {
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
      shards_.emplace_back(static_cast<size_t>(numel(shape)) * itemsize(spec.dtype), '\0');
      fill_local_tensor(*ckpt_, spec, layout_.mesh, 0,
                        host_view(shards_.back().data(), spec.dtype, shape));
    }
    pristine_ = shards_;
  }
  const EngineRankLayout& rank_layout() const { return engine_layout_.rank_layout(0); }

  Params expected(int64_t step) const {
    Params out;
    for (const auto& p : rank_layout().params) {
      out.emplace_back(static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype));
      fill_param(*ckpt_, p, out.back().data());
      make_version(out.back(), itemsize(p.dtype), step);
    }
    return out;
  }
  void set_version(int64_t step) {
    shards_ = pristine_;
    for (size_t i = 0; i < layout_.params.size(); ++i)
      make_version(shards_[i], itemsize(layout_.params[i].dtype), step);
  }

  e2e::Model m_;
  std::optional<Checkpoint> ckpt_;
  TrainerLayout layout_;
  EngineConfig config_;
  EngineLayout engine_layout_;
  Params params_, pristine_, shards_;
  std::mutex mu_;  // what the engine thread records
};

TEST_F(CoordinatorRestart, KilledAndRestartedMidStepTheEnginesServeOnAndTheNextStepCommits) {
  auto coordinator = std::make_unique<CoordinatorProcess>(std::vector<std::string>{});
  const std::string address = "127.0.0.1:" + std::to_string(coordinator->port());
  ASSERT_NE(coordinator->port(), 0) << coordinator->first_line();

  // The engine rank: staging on (a step that does not commit leaves the
  // params untouched), serving until version 3 or `stop`.
  std::atomic<bool> stop{false};
  std::vector<StepOutcome> outcomes;
  std::vector<int64_t> versions_while_down;
  std::atomic<bool> down{false};
  std::string engine_error;
  std::atomic<int64_t> version{-1};
  std::atomic<bool> began2{false};  // the engine began receiving step 2
  const auto seen = [&] {
    std::lock_guard lock(mu_);
    return outcomes;
  };
  const auto error = [&] {
    std::lock_guard lock(mu_);
    return engine_error;
  };
  // Joined however the test ends (a failed assertion returns early).
  struct Joiner {
    std::atomic<bool>& stop;
    std::thread thread;
    ~Joiner() {
      stop = true;
      if (thread.joinable()) thread.join();
    }
  } engine{stop, {}};
  engine.thread = std::thread([&] {
    try {
      SubscriberOptions so;
      so.coordinator = address;
      so.engine = config_;
      so.staging = true;
      so.step_timeout = 60s;
      so.coordinator_reconnect = 60s;
      Subscriber sub(so);
      sub.on_begin([&](int64_t step) {
        if (step == 2) began2 = true;
      });
      for (size_t i = 0; i < params_.size(); ++i)
        sub.register_param(rank_layout().params[i].name, params_[i].data(),
                           rank_layout().params[i].dtype, rank_layout().params[i].shape);
      while (!stop && sub.version() < 3) {
        auto out = sub.run_step(100ms);  // never throws while the coordinator is away
        std::lock_guard lock(mu_);
        if (down) versions_while_down.push_back(sub.version());
        if (out) outcomes.push_back(*out);
        version = sub.version();
      }
    } catch (const Error& e) {
      std::lock_guard lock(mu_);
      engine_error = e.what();
    }
  });

  // The trainer's part; what it throws fails the test (the threads are joined).
  const auto trainer = [&] {
    PublisherOptions po;
    po.coordinator = address;
    po.layout = layout_;
    po.engine = config_;
    // Slow sends: step 2 is still moving when the coordinator is killed.
    po.transport = "fault:ucx?delay_ms=40";
    po.plan.bucket_bytes = 8192;
    po.step_timeout = 60s;
    po.coordinator_reconnect = 60s;
    Publisher pub(po);
    for (size_t i = 0; i < layout_.params.size(); ++i) {
      const LoadSpec& spec = layout_.params[i];
      pub.register_tensor(
          spec.name, host_view(shards_[i].data(), spec.dtype, local_shape(spec, layout_.mesh, 0)));
    }
    set_version(1);
    const PushResult first = pub.push(1);
    ASSERT_EQ(first.committed, std::vector<int>{0});
    for (int i = 0; i < 100 && version < 1; ++i) std::this_thread::sleep_for(20ms);
    ASSERT_EQ(version, 1) << error();
    std::vector<uint64_t> ids;
    {
      control::ClientOptions o;
      o.address = address;
      control::Client observer(o);
      for (const auto& m : observer.members())
        if (m.role != control::Role::observer) ids.push_back(m.id);
    }
    ASSERT_EQ(ids.size(), 2u);

    // Step 2, killed under it.
    set_version(2);
    std::optional<Error> push_error;
    std::chrono::steady_clock::time_point push_ended;
    std::thread pusher([&] {
      try {
        pub.push(2);
      } catch (const Error& e) {
        push_error = e;
      }
      push_ended = std::chrono::steady_clock::now();
    });
    // Killed while step 2's data moves: once the engine began it.
    for (int i = 0; i < 3000 && !began2; ++i) std::this_thread::sleep_for(1ms);
    EXPECT_TRUE(began2) << "step 2 never began on the engine";
    std::this_thread::sleep_for(30ms);
    const auto killed = std::chrono::steady_clock::now();
    coordinator->kill();
    down = true;
    pusher.join();
    ASSERT_TRUE(push_error) << "step 2 committed although its coordinator died during it";
    EXPECT_EQ(push_error->code(), Errc::peer_failure) << push_error->what();
    EXPECT_NE(std::string(push_error->what()).find("lost the coordinator"), std::string::npos)
        << push_error->what();
    EXPECT_LT(push_ended - killed, 2s) << "the push did not fail at once: " << push_error->what();
    // The engine aborted step 2 and kept version 1, whole.
    for (int i = 0; i < 200 && seen().size() < 2; ++i) std::this_thread::sleep_for(20ms);
    std::this_thread::sleep_for(1s);  // down a while: the engine keeps serving
    {
      std::lock_guard lock(mu_);
      ASSERT_EQ(outcomes.size(), 2u) << engine_error;
      EXPECT_EQ(outcomes[1].step, 2);
      EXPECT_FALSE(outcomes[1].committed);
      EXPECT_FALSE(outcomes[1].torn);
      EXPECT_NE(outcomes[1].reason.find("lost the coordinator"), std::string::npos)
          << outcomes[1].reason;
      EXPECT_EQ(version, 1);
      EXPECT_TRUE(params_ == expected(1)) << "the aborted step left a mix in the engine's params";
      EXPECT_TRUE(engine_error.empty()) << engine_error;
      EXPECT_FALSE(versions_while_down.empty()) << "the engine's loop stopped while it was down";
      EXPECT_TRUE(std::all_of(versions_while_down.begin(), versions_while_down.end(),
                              [](int64_t v) { return v == 1; }));
    }

    // Restarted on the same address: the ranks come back as the same members.
    coordinator = std::make_unique<CoordinatorProcess>(std::vector<std::string>{}, address);
    ASSERT_EQ("127.0.0.1:" + std::to_string(coordinator->port()), address)
        << coordinator->first_line();
    down = false;
    {
      control::ClientOptions o;
      o.address = address;
      control::Client observer(o);
      const auto members = observer.wait_members(1, 1, 30s);
      std::vector<uint64_t> back;
      for (const auto& m : members)
        if (m.role != control::Role::observer) back.push_back(m.id);
      std::sort(back.begin(), back.end());
      std::sort(ids.begin(), ids.end());
      EXPECT_EQ(back, ids) << "the ranks came back under new member ids";
      EXPECT_EQ(observer.committed_version(0), 1) << "the engine's version was not rebuilt";
    }
    set_version(3);
    const PushResult third = pub.push(3);
    EXPECT_EQ(third.committed, std::vector<int>{0});
  };
  try {
    trainer();
  } catch (const Error& e) {
    ADD_FAILURE() << "the trainer side threw: " << e.what();
    return;
  }
  if (HasFailure()) stop = true;  // the engine would wait for version 3
  engine.thread.join();
  EXPECT_TRUE(engine_error.empty()) << engine_error;
  ASSERT_EQ(outcomes.size(), 3u);
  EXPECT_TRUE(outcomes[2].committed) << outcomes[2].reason;
  EXPECT_EQ(version, 3);
  EXPECT_TRUE(params_ == expected(3)) << "version 3 did not land whole";
}

}  // namespace
}  // namespace weightsync::engine
