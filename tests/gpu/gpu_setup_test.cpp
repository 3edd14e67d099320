// A rank's CUDA device comes from its registered tensors (src/pipeline/setup.h):
// all on one device, else an error naming two params and where each lives.
#include "gpu/gpu_test_util.h"

#include <weightsync/error.h>

#include "pipeline/setup.h"

#include <vector>

namespace weightsync::gpu_test {
namespace {

std::function<std::string(size_t)> names() {
  return [](size_t i) { return "p" + std::to_string(i); };
}

std::string refusal(const std::vector<TensorView>& tensors) {
  try {
    pipeline::rank_memory(tensors, names(), "trainer rank 2");
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "accepted";
  return "";
}

TEST(GpuSetup, CudaTensorsGiveTheRankItsDevice) {
  REQUIRE_GPU();
  gpu::Memory a(64, gpu::MemoryPlace::device, 0), b(64, gpu::MemoryPlace::device, 0);
  const auto m = pipeline::rank_memory(
      {tensor_view(a.data(), DType::U8, {64}, MemoryKind::cuda, 0),
       tensor_view(b.data(), DType::U8, {64}, MemoryKind::cuda, -1)},  // device from CUDA
      names(), "trainer rank 2");
  EXPECT_EQ(m.memory, MemoryKind::cuda);
  EXPECT_EQ(m.device, 0);
}

TEST(GpuSetup, HostAndCudaTensorsOnOneRankAreRefusedNamingBoth) {
  REQUIRE_GPU();
  gpu::Memory a(64, gpu::MemoryPlace::device, 0);
  std::vector<char> h(64);
  const std::string what = refusal({tensor_view(a.data(), DType::U8, {64}, MemoryKind::cuda, 0),
                                    host_view(h.data(), DType::U8, {64})});
  EXPECT_NE(what.find("'p0' (CUDA device 0)"), std::string::npos) << what;
  EXPECT_NE(what.find("'p1' (host memory)"), std::string::npos) << what;
}

TEST(GpuSetup, HostMemoryRegisteredAsCudaIsRefused) {
  REQUIRE_GPU();
  std::vector<char> h(64);
  const std::string what = refusal({tensor_view(h.data(), DType::U8, {64}, MemoryKind::cuda, 0)});
  EXPECT_NE(what.find("does not know its address"), std::string::npos) << what;
}

TEST(GpuSetup, TensorsOnTwoDevicesAreRefusedNamingBoth) {
  REQUIRE_GPU();
  if (gpu::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs, this machine has 1";
  gpu::Memory a(64, gpu::MemoryPlace::device, 0), b(64, gpu::MemoryPlace::device, 1);
  const std::string what = refusal({tensor_view(a.data(), DType::U8, {64}, MemoryKind::cuda, 0),
                                    tensor_view(b.data(), DType::U8, {64}, MemoryKind::cuda, 1)});
  EXPECT_NE(what.find("CUDA device 0"), std::string::npos) << what;
  EXPECT_NE(what.find("CUDA device 1"), std::string::npos) << what;
}

}  // namespace
}  // namespace weightsync::gpu_test
