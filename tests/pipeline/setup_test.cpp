// The setup both ends of the data path share (src/pipeline/setup.h): where a
// rank's tensors live, and malformed JSON in the store surfacing as a
// weightsync::Error that names the key (never a foreign exception, so that
// callers' cleanup on Error always runs).
#include "e2e/e2e_helpers.h"

#include <weightsync/control.h>
#include <weightsync/layouts.h>
#include <weightsync/subscriber.h>

#include "core/cuda/gpu.h"
#include "pipeline/setup.h"

#include <gtest/gtest.h>

namespace weightsync::e2e {
namespace {

std::function<std::string(size_t)> names() {
  return [](size_t i) { return "p" + std::to_string(i); };
}

TEST(Setup, RankMemoryOfHostTensorsAndOfNone) {
  std::vector<char> a(16), b(16);
  const std::vector<TensorView> host{host_view(a.data(), DType::U8, {16}),
                                     host_view(b.data(), DType::U8, {4, 4})};
  const auto m = pipeline::rank_memory(host, names(), "trainer rank 0");
  EXPECT_TRUE(m.any);
  EXPECT_EQ(m.memory, MemoryKind::host);
  // Empty tensors hold no bytes: they do not decide where a rank lives.
  TensorView empty = host_view(nullptr, DType::U8, {0});
  empty.memory = MemoryKind::cuda;
  EXPECT_FALSE(pipeline::rank_memory({empty}, names(), "trainer rank 0").any);
  EXPECT_EQ(pipeline::memory_str(MemoryKind::cuda, 1), "CUDA device 1");
}

TEST(Setup, CudaTensorWithoutAGpuIsUnsupportedNamingTheParam) {
  if (gpu::device_count() > 0)
    GTEST_SKIP() << "a GPU is usable here; the no-GPU path cannot be observed";
  std::vector<char> a(16);
  TensorView v = host_view(a.data(), DType::U8, {16});
  v.memory = MemoryKind::cuda;
  v.device = 0;
  try {
    pipeline::rank_memory({v}, names(), "engine rank 3");
    FAIL() << "a CUDA tensor was accepted without a GPU";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::unsupported) << e.what();
    EXPECT_NE(std::string(e.what()).find("engine rank 3: param 'p0'"), std::string::npos)
        << e.what();
  }
}

TEST(Setup, MalformedStoreJsonIsAWeightsyncErrorNamingTheKey) {
  const Model m = make_model("tiny-llama", "fsdp=1", 1, 1);
  control::Coordinator coordinator{control::CoordinatorOptions{}};
  control::ClientOptions co;
  co.address = coordinator.address();
  co.role = control::Role::observer;
  control::Client store(co);
  SubscriberOptions so;
  so.coordinator = coordinator.address();
  so.engine = load_engine_config(m.engine);
  so.trainer = TrainerLayout::load(m.trainer);
  so.connect_timeout = std::chrono::milliseconds(5000);
  Subscriber sub(so);
  const EngineLayout layout = make_engine_layout(so.engine);
  std::vector<std::vector<char>> params;
  for (const auto& p : layout.rank_layout(0).params) {
    params.emplace_back(static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype), '\0');
    sub.register_param(p.name, params.back().data(), p.dtype, p.shape);
  }
  auto expect_format = [&](const std::string& value, const std::string& part) {
    store.set("weightsync/plan_options", std::vector<uint8_t>(value.begin(), value.end()));
    try {
      sub.prepare();
      ADD_FAILURE() << "prepare accepted plan_options " << value;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::format) << e.what();
      const std::string what = e.what();
      EXPECT_NE(what.find("engine rank 0"), std::string::npos) << what;
      EXPECT_NE(what.find(part), std::string::npos) << what;
    }
  };
  expect_format("{not json", "weightsync/plan_options' is not JSON");
  expect_format(R"({"mode": 3, "bucket_bytes": 4096})", "lacks a string \"mode\"");
  expect_format(R"({"mode": "p2p", "bucket_bytes": "big"})", "integer \"bucket_bytes\"");
}

}  // namespace
}  // namespace weightsync::e2e
