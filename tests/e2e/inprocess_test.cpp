// Publisher and Subscriber driven directly through their C++ API (as a
// training loop and an inference server would), one thread each, over UCX:
// push_async, the on_begin/on_end hooks, version(), and the params equal to
// materialize of the checkpoint afterwards.
#include "e2e/e2e_helpers.h"

#include <weightsync/control.h>
#include <weightsync/publisher.h>
#include <weightsync/subscriber.h>
#include <weightsync/transport.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <thread>

namespace weightsync::e2e {
namespace {

TEST(InProcess, PushAsyncHooksAndVersion) {
  const auto names = transport_names();
  if (std::find(names.begin(), names.end(), "ucx") == names.end())
    GTEST_SKIP() << "weightsync was built without UCX";
  const Model m = make_model("tiny-llama", "fsdp=1", 1, 1);
  const Checkpoint ckpt = Checkpoint::open(m.checkpoint);
  const TrainerLayout layout = TrainerLayout::load(m.trainer);
  const EngineConfig config = EngineConfig::load(m.engine);
  control::Coordinator coordinator(control::CoordinatorOptions{});

  // The engine: params start at zero, hooks record what they saw.
  const EngineLayout engine_layout = make_engine_layout(config);
  const EngineRankLayout& rl = engine_layout.rank_layout(0);
  std::vector<std::vector<char>> params;
  for (const auto& p : rl.params)
    params.emplace_back(static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype), '\0');
  std::vector<int64_t> begins, ends;
  int64_t final_version = -1;
  std::string engine_error;
  std::thread engine([&] {
    try {
      SubscriberOptions so;
      so.coordinator = coordinator.address();
      so.engine = config;
      Subscriber sub(so);
      for (size_t i = 0; i < params.size(); ++i)
        sub.register_param(rl.params[i].name, params[i].data(), rl.params[i].dtype,
                           rl.params[i].shape);
      sub.on_begin([&](int64_t s) { begins.push_back(s); });
      sub.on_end([&](int64_t s) { ends.push_back(s); });
      for (int i = 0; i < 200 && sub.version() < 2; ++i)
        sub.run_step(std::chrono::milliseconds(200));
      final_version = sub.version();
    } catch (const Error& e) {
      engine_error = e.what();
    }
  });

  // The trainer: its (only) rank's shards, pushed twice.
  std::vector<std::vector<char>> shards;
  PublisherOptions po;
  po.coordinator = coordinator.address();
  po.layout = layout;
  po.engine = config;
  po.bucket_bytes = 4096;
  Publisher pub(po);
  for (const LoadSpec& spec : layout.params) {
    const Shape shape = local_shape(spec, layout.mesh, 0);
    shards.emplace_back(static_cast<size_t>(numel(shape)) * itemsize(spec.dtype), '\0');
    const TensorView v = host_view(shards.back().data(), spec.dtype, shape);
    fill_local_tensor(ckpt, spec, layout.mesh, 0, v);
    pub.register_tensor(spec.name, v);
  }
  for (int64_t step = 1; step <= 2; ++step) {
    auto result = pub.push_async(step).get();
    EXPECT_EQ(result.committed, (std::vector<int>{0})) << "step " << step;
    EXPECT_GT(result.bytes_sent, 0u);
  }
  EXPECT_LE(pub.staging_bytes(), 2 * (4096 + 8)) << "two bucket slots, nothing more";
  engine.join();
  ASSERT_EQ(engine_error, "");
  EXPECT_EQ(final_version, 2);
  EXPECT_EQ(begins, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(ends, (std::vector<int64_t>{1, 2}));
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<char> expected(params[i].size());
    fill_param(ckpt, rl.params[i], expected.data());
    EXPECT_EQ(params[i], expected) << rl.params[i].name;
  }
}

}  // namespace
}  // namespace weightsync::e2e
