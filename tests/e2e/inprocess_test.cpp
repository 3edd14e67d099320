// Publisher and Subscriber driven directly through their C++ API (as a
// training loop and an inference server would), one thread each, over UCX:
// push_async, the on_begin/on_end hooks, version(), and the params equal to
// materialize of the checkpoint afterwards.
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
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <thread>

namespace weightsync::e2e {
namespace {

// One trainer rank and one engine rank of tiny-llama over UCX, in threads of
// this process; the engine's params start at zero.
class InProcess : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto names = transport_names();
    if (std::find(names.begin(), names.end(), "ucx") == names.end())
      GTEST_SKIP() << "weightsync was built without UCX";
    m_ = make_model("tiny-llama", "fsdp=1", 1, 1);
    ckpt_.emplace(Checkpoint::open(m_.checkpoint));
    layout_ = TrainerLayout::load(m_.trainer);
    config_ = load_engine_config(m_.engine);
    engine_layout_ = make_engine_layout(config_);
    for (const auto& p : rank_layout().params)
      params_.emplace_back(static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype), '\0');
  }
  const EngineRankLayout& rank_layout() const { return engine_layout_.rank_layout(0); }

  // The engine rank, on its own thread: `setup` adds hooks, then steps run
  // until version `last` or `max_steps` outcomes.
  std::thread engine(const std::function<void(Subscriber&)>& setup, int64_t last, int max_steps) {
    return std::thread([=, this] {
      try {
        SubscriberOptions so;
        so.coordinator = coordinator_.address();
        so.engine = config_;
        Subscriber sub(so);
        for (size_t i = 0; i < params_.size(); ++i)
          sub.register_param(rank_layout().params[i].name, params_[i].data(),
                             rank_layout().params[i].dtype, rank_layout().params[i].shape);
        setup(sub);
        for (int i = 0; i < 200 && sub.version() < last && int(outcomes_.size()) < max_steps; ++i)
          if (auto out = sub.run_step(std::chrono::milliseconds(200))) outcomes_.push_back(*out);
        final_version_ = sub.version();
      } catch (const Error& e) {
        engine_error_ = e.what();
      }
    });
  }

  // The trainer's (only) rank, its shards filled from the checkpoint.
  std::unique_ptr<Publisher> publisher(const std::function<void(PublisherOptions&)>& tweak = {}) {
    PublisherOptions po;
    po.coordinator = coordinator_.address();
    po.layout = layout_;
    po.engine = config_;
    po.plan.bucket_bytes = 4096;
    po.plan.mode = mode_;
    if (tweak) tweak(po);
    auto pub = std::make_unique<Publisher>(po);
    for (const LoadSpec& spec : layout_.params) {
      const Shape shape = local_shape(spec, layout_.mesh, 0);
      shards_.emplace_back(static_cast<size_t>(numel(shape)) * itemsize(spec.dtype), '\0');
      const TensorView v = host_view(shards_.back().data(), spec.dtype, shape);
      fill_local_tensor(*ckpt_, spec, layout_.mesh, 0, v);
      pub->register_tensor(spec.name, v);
    }
    return pub;
  }

  void expect_params_match_checkpoint() {
    for (size_t i = 0; i < params_.size(); ++i) {
      std::vector<char> expected(params_[i].size());
      fill_param(*ckpt_, rank_layout().params[i], expected.data());
      EXPECT_EQ(params_[i], expected) << rank_layout().params[i].name;
    }
  }

  // The params of version `step` of a delta run: the checkpoint's, each
  // element's lowest bit flipped where delta_flips says.
  std::vector<std::vector<char>> expected_params(int64_t step, int64_t last) {
    std::vector<std::vector<char>> out;
    for (const auto& p : rank_layout().params) {
      out.emplace_back(static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype));
      fill_param(*ckpt_, p, out.back().data());
      delta_version(out.back().data(), out.back().size(), itemsize(p.dtype), step, last,
                    percent_(step));
    }
    return out;
  }
  // The trainer's shards at version `step` (pristine: the checkpoint's).
  void set_shards(const std::vector<std::vector<char>>& pristine, int64_t step, int64_t last) {
    for (size_t i = 0; i < shards_.size(); ++i) {
      shards_[i] = pristine[i];
      delta_version(shards_[i].data(), shards_[i].size(), itemsize(layout_.params[i].dtype), step,
                    last, percent_(step));
    }
  }
  // Pushes versions first..to of a delta run whose last is `last`, each
  // committed by engine rank 0 unless `expect_commit` is false.
  void push_versions(Publisher& pub, const std::vector<std::vector<char>>& pristine, int64_t first,
                     int64_t to, int64_t last, std::vector<PushResult>& results,
                     bool expect_commit = true) {
    for (int64_t step = first; step <= to; ++step) {
      set_shards(pristine, step, last);
      results.push_back(pub.push(step));
      if (expect_commit) {
        EXPECT_EQ(results.back().committed, (std::vector<int>{0})) << "step " << step;
      }
    }
  }
  using Versions = std::map<int64_t, std::vector<std::vector<char>>>;
  // A delta run: the engine keeps the params of every version it commits
  // (`held`); a publisher with delta on (and `tweak`) pushes versions
  // 1..last, which it returns once the engine is done.
  std::unique_ptr<Publisher> push_delta_run(int64_t last, Versions& held,
                                            std::vector<PushResult>& results,
                                            const std::function<void(PublisherOptions&)>& tweak) {
    std::thread engine = this->engine(
        [&](Subscriber& sub) {
          sub.on_end([&](int64_t s) {
            if (sub.version() == s) held[s] = params_;
          });
        },
        last, std::max(10, static_cast<int>(last)));
    auto pub = publisher([&](PublisherOptions& o) {
      o.delta = DeltaMode::automatic;
      if (tweak) tweak(o);
    });
    const auto pristine = shards_;
    push_versions(*pub, pristine, 1, last, last, results);
    engine.join();
    return pub;
  }
  // Every version 1..last committed, bit-exact.
  void expect_versions_held(const Versions& held, int64_t last) {
    for (int64_t step = 1; step <= last; ++step) {
      ASSERT_TRUE(held.count(step)) << "step " << step << " did not commit";
      const auto expected = expected_params(step, last);
      for (size_t i = 0; i < expected.size(); ++i)
        ASSERT_EQ(held.at(step)[i], expected[i])
            << "step " << step << ", " << rank_layout().params[i].name;
    }
  }
  // Version `step` of a delta run from the checkpoint's bytes: about
  // `percent` % of the elements (1 unless a test says otherwise) have their
  // lowest bit flipped, chosen by their own value (so that the trainer's
  // shards and the engine's params, laid out differently, agree), a new
  // choice each step; version `last` is the checkpoint.
  static void delta_version(char* data, size_t bytes, size_t item, int64_t step, int64_t last,
                            int percent) {
    if (step == last) return;
    if (percent >= 100) {
      // Every element but zeros (the engine's padding, which no checkpoint
      // element lands on, stays zero).
      for (size_t at = 0; at + item <= bytes; at += item)
        if (std::any_of(data + at, data + at + item, [](char c) { return c != 0; }))
          data[at] = static_cast<char>(data[at] ^ (step % 2 ? 1 : 2));
      return;
    }
    for (size_t at = 0; at + item <= bytes; at += item) {
      uint64_t v = 0;
      std::memcpy(&v, data + at, std::min<size_t>(item, 8));
      v = (v & ~uint64_t{1}) * 0x9E3779B97F4A7C15ULL +
          static_cast<uint64_t>(step) * 0xBF58476D1CE4E5B9ULL;
      v ^= v >> 31;
      v *= 0x94D049BB133111EBULL;
      if ((v >> 40) % 100 < static_cast<uint64_t>(percent))
        data[at] = static_cast<char>(data[at] ^ 1);
    }
  }

  PlanMode mode_ = PlanMode::p2p;
  std::function<int(int64_t step)> percent_ = [](int64_t) { return 1; };
  Model m_;
  std::optional<Checkpoint> ckpt_;
  TrainerLayout layout_;
  EngineConfig config_;
  EngineLayout engine_layout_;
  control::Coordinator coordinator_{control::CoordinatorOptions{}};
  std::vector<std::vector<char>> params_, shards_;
  std::vector<StepOutcome> outcomes_;
  int64_t final_version_ = -1;
  std::string engine_error_;
};

TEST_F(InProcess, PushAsyncHooksAndVersion) {
  std::vector<int64_t> begins, ends;
  std::thread engine = this->engine(
      [&](Subscriber& sub) {
        sub.on_begin([&](int64_t s) { begins.push_back(s); });
        sub.on_end([&](int64_t s) { ends.push_back(s); });
      },
      2, 10);
  auto pub = publisher();
  for (int64_t step = 1; step <= 2; ++step) {
    auto result = pub->push_async(step).get();
    EXPECT_EQ(result.committed, (std::vector<int>{0})) << "step " << step;
    EXPECT_GT(result.bytes_sent, 0u);
  }
  EXPECT_LE(pub->staging_bytes(), 2 * (4096 + 8)) << "two bucket slots, nothing more";
  engine.join();
  ASSERT_EQ(engine_error_, "");
  EXPECT_EQ(final_version_, 2);
  EXPECT_EQ(begins, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ends, (std::vector<int64_t>{1, 2}));
  expect_params_match_checkpoint();
}

// A hook that throws fails that step on that rank, never the process: on_begin
// fails step 1 (the trainer sees the engine failed, naming the hook); step 2
// commits; on_end's failure after a commit is reported, the step stays
// committed.
TEST_F(InProcess, AHookThatThrowsFailsOnlyItsStep) {
  std::thread engine = this->engine(
      [](Subscriber& sub) {
        sub.on_begin([](int64_t s) {
          if (s == 1) throw std::runtime_error("cannot pause generation");
        });
        sub.on_end([](int64_t s) {
          if (s == 2) throw std::runtime_error("post-load processing failed");
        });
      },
      2, 2);
  auto pub = publisher();
  const PushResult first = pub->push(1);
  EXPECT_TRUE(first.committed.empty());
  ASSERT_EQ(first.failed.size(), 1u);
  EXPECT_NE(first.failed[0].second.find("on_begin hook of step 1 failed: cannot pause"),
            std::string::npos)
      << first.failed[0].second;
  EXPECT_EQ(pub->push(2).committed, (std::vector<int>{0}));
  engine.join();
  ASSERT_EQ(engine_error_, "");
  ASSERT_EQ(outcomes_.size(), 2u);
  EXPECT_FALSE(outcomes_[0].committed);
  EXPECT_TRUE(outcomes_[1].committed);
  EXPECT_NE(outcomes_[1].reason.find("on_end hook of step 2 failed: post-load"), std::string::npos)
      << outcomes_[1].reason;
  EXPECT_EQ(final_version_, 2);
  expect_params_match_checkpoint();
}

// The delta tests that run in both plan modes (broadcast: one frame for
// every engine rank, each checking the digest of what it reads).
class InProcessDelta : public InProcess, public ::testing::WithParamInterface<PlanMode> {
 protected:
  void SetUp() override {
    InProcess::SetUp();
    mode_ = GetParam();
  }
};

INSTANTIATE_TEST_SUITE_P(Modes, InProcessDelta,
                         ::testing::Values(PlanMode::p2p, PlanMode::broadcast),
                         [](const ::testing::TestParamInfo<PlanMode>& info) {
                           return std::string(plan_mode_name(info.param));
                         });

// Delta sync (docs/delta.md): version 1 goes whole (nothing to diff
// against), versions 2..4 as deltas of about 1 % of the elements, a small
// fraction of the bytes; every step bit-exact, the last the checkpoint.
TEST_P(InProcessDelta, StepsAreBitExactAndMoveOnlyTheChanges) {
  const int64_t last = 4;
  Versions held;
  std::vector<PushResult> results;
  auto pub = push_delta_run(last, held, results, {});
  ASSERT_EQ(engine_error_, "");
  ASSERT_EQ(pub->plan().mode(), mode_);
  EXPECT_EQ(results[0].delta_buckets, 0u) << "version 1 has no base to diff against";
  const uint64_t buckets = pub->plan().buckets().size();
  for (int64_t step = 2; step <= last; ++step) {
    const PushResult& r = results[static_cast<size_t>(step - 1)];
    EXPECT_GT(r.delta_buckets, buckets / 2) << "step " << step;
    EXPECT_LT(r.bytes_sent * 4, results[0].bytes_sent)
        << "step " << step << ": " << r.bytes_sent << " bytes, whole " << results[0].bytes_sent;
  }
  expect_versions_held(held, last);
  expect_params_match_checkpoint();
}

// delta_verify off: delta frames without their digest (broadcast: without
// the digest table), every step bit-exact all the same.
TEST_P(InProcessDelta, StepsWithoutTheDigestAreBitExact) {
  const int64_t last = 4;
  Versions held;
  std::vector<PushResult> results;
  auto pub =
      push_delta_run(last, held, results, [](PublisherOptions& o) { o.delta_verify = false; });
  ASSERT_EQ(engine_error_, "");
  for (int64_t step = 2; step <= last; ++step)
    EXPECT_GT(results[static_cast<size_t>(step - 1)].delta_buckets, 0u) << "step " << step;
  expect_versions_held(held, last);
  expect_params_match_checkpoint();
}

// The engine's params are not the version a delta applies to (changed
// behind the sync's back after step 2): step 3's digest catches it before a
// byte is written, the step fails on that rank, and step 4 goes whole and
// is bit-exact.
TEST_P(InProcessDelta, OntoParamsThatDifferFailsItsDigestAndTheNextStepGoesWhole) {
  const int64_t last = 4;
  // A byte that step 3's delta leaves alone (it would overwrite it).
  size_t at = 0;
  const auto v2 = expected_params(2, last), v3 = expected_params(3, last);
  while (at < v2[0].size() && (v2[0][at] != v3[0][at] || v2[0][at ^ 1] != v3[0][at ^ 1])) ++at;
  ASSERT_LT(at, v2[0].size());
  std::thread engine = this->engine(
      [&](Subscriber& sub) {
        sub.on_end([&](int64_t s) {
          if (s == 2) params_[0][at] = static_cast<char>(params_[0][at] ^ 0x40);
        });
      },
      last, 4);
  auto pub = publisher([](PublisherOptions& o) { o.delta = DeltaMode::automatic; });
  const auto pristine = shards_;
  std::vector<PushResult> results;
  push_versions(*pub, pristine, 1, last, last, results, /*expect_commit=*/false);
  engine.join();
  ASSERT_EQ(engine_error_, "");
  ASSERT_EQ(outcomes_.size(), 4u);
  EXPECT_TRUE(outcomes_[1].committed);
  EXPECT_GT(results[2].delta_buckets, 0u);
  EXPECT_FALSE(outcomes_[2].committed)
      << "delta buckets " << results[2].delta_buckets << " of " << pub->plan().buckets().size()
      << ", " << rank_layout().params[0].name;
  ASSERT_EQ(results[2].failed.size(), 1u);
  EXPECT_NE(results[2].failed[0].second.find("after its delta the bucket hashes to"),
            std::string::npos)
      << results[2].failed[0].second;
  EXPECT_EQ(results[3].delta_buckets, 0u) << "the rank failed step 3: step 4 goes whole";
  EXPECT_TRUE(outcomes_[3].committed) << outcomes_[3].reason;
  EXPECT_EQ(final_version_, 4);
  expect_params_match_checkpoint();
}

// A version that changes every element goes whole, without an encoding:
// the header, then the bucket's fragments as without delta, the dense runs
// straight into the params. A few whole steps later (the base brought up to
// date on the step before) deltas are tried again, and go. After small
// deltas a total change is encoded (no look first), comes out nearly whole,
// and goes whole all the same.
TEST_P(InProcessDelta, AVersionThatChangesEverythingGoesWholeAndDeltasComeBack) {
  const int64_t last = 9;
  percent_ = [](int64_t step) { return step == 2 || step == 3 || step == 8 ? 100 : 1; };
  Versions held;
  std::vector<PushResult> results;
  auto pub = push_delta_run(last, held, results, [](PublisherOptions& o) {
    o.wire.direct_min_bytes = 64;  // the tiny model's runs go straight too
  });
  ASSERT_EQ(engine_error_, "");
  ASSERT_EQ(outcomes_.size(), static_cast<size_t>(last));
  const uint64_t buckets = pub->plan().buckets().size();
  // Step 2 tries (every element changed: whole), steps 3-5 go whole untried,
  // steps 6 and 7 try again: 1 % changed, deltas; step 8 (every element)
  // goes whole, and step 9 untried.
  for (int64_t step : {1, 2, 3, 4, 5, 8, 9}) {
    const size_t i = static_cast<size_t>(step - 1);
    EXPECT_EQ(results[i].delta_buckets, 0u) << "step " << step;
    if (mode_ == PlanMode::p2p) {  // a broadcast bucket lands in a slot
      EXPECT_GT(outcomes_[i].bytes_direct, outcomes_[i].bytes / 2)
          << "step " << step << ": whole bytes land straight in the params";
    }
  }
  for (int64_t step : {6, 7})
    EXPECT_GT(results[static_cast<size_t>(step - 1)].delta_buckets, buckets / 2) << "step " << step;
  expect_versions_held(held, last);
  expect_params_match_checkpoint();
}

// A bucket whose tries keep coming out whole is tried less often: after the
// first such try 3 steps go whole untried, after the second 6. Steps 2 and
// 6 change every element; the steps between change 1 % and would go as
// deltas if they were tried: 3-5 and 7-12 go whole untried, 13 tries again
// and goes as a delta, and the count of tries starts over (step 15 changes
// everything, 16-18 go whole untried, 19 as a delta).
TEST_P(InProcessDelta, TriesThatKeepComingOutWholeAreMadeLessOften) {
  const int64_t last = 19;
  percent_ = [](int64_t step) { return step == 2 || step == 6 || step == 15 ? 100 : 1; };
  Versions held;
  std::vector<PushResult> results;
  auto pub = push_delta_run(last, held, results,
                            [](PublisherOptions& o) { o.wire.direct_min_bytes = 64; });
  ASSERT_EQ(engine_error_, "");
  ASSERT_EQ(outcomes_.size(), static_cast<size_t>(last));
  const uint64_t buckets = pub->plan().buckets().size();
  for (int64_t step = 1; step <= last; ++step) {
    const bool delta = step == 13 || step == 14 || step == 19;
    const uint64_t got = results[static_cast<size_t>(step - 1)].delta_buckets;
    if (delta) {
      EXPECT_GT(got, buckets / 2) << "step " << step;
    } else {
      EXPECT_EQ(got, 0u) << "step " << step;
    }
  }
  expect_versions_held(held, last);
  expect_params_match_checkpoint();
}

// An engine rank restarted mid-run (a new process, its params zero) gets
// the whole bytes at its first step, from a publisher that sends the other
// steps as deltas, and is bit-exact.
TEST_P(InProcessDelta, ARestartedEngineRankGetsTheWholeVersion) {
  const int64_t last = 4;
  auto pub = publisher([](PublisherOptions& o) { o.delta = DeltaMode::automatic; });
  const auto pristine = shards_;
  std::vector<PushResult> results;
  {
    std::thread first = this->engine([](Subscriber&) {}, 2, 10);
    push_versions(*pub, pristine, 1, 2, last, results);
    first.join();
    ASSERT_EQ(engine_error_, "");
    ASSERT_EQ(final_version_, 2);
  }
  EXPECT_GT(results[1].delta_buckets, 0u);
  for (auto& p : params_) std::fill(p.begin(), p.end(), '\0');
  std::atomic<bool> prepared{false};
  std::thread second = this->engine(
      [&](Subscriber& sub) {
        sub.prepare();
        prepared = true;
      },
      last, 10);
  while (!prepared && engine_error_.empty())
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  push_versions(*pub, pristine, 3, last, last, results);
  second.join();
  ASSERT_EQ(engine_error_, "");
  EXPECT_EQ(results[2].delta_buckets, 0u) << "a new process holds nothing to diff against";
  EXPECT_GT(results[3].delta_buckets, 0u);
  EXPECT_EQ(final_version_, last);
  expect_params_match_checkpoint();
}

}  // namespace
}  // namespace weightsync::e2e
