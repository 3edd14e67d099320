// Publisher and Subscriber driven directly through their C++ API (as a
// training loop and an inference server would), one thread each, over UCX:
// push_async, the on_begin/on_end hooks, version(), and the params equal to
// materialize of the checkpoint afterwards.
#include "e2e/e2e_helpers.h"

#include <weightsync/backend/transport.h>
#include <weightsync/control.h>
#include <weightsync/publisher.h>
#include <weightsync/subscriber.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
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
    config_ = EngineConfig::load(m_.engine);
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
  std::unique_ptr<Publisher> publisher() {
    PublisherOptions po;
    po.coordinator = coordinator_.address();
    po.layout = layout_;
    po.engine = config_;
    po.plan.bucket_bytes = 4096;
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

}  // namespace
}  // namespace weightsync::e2e
