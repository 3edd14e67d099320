// The copy kernel against the host executor on random tables (every byte of
// the destination compared), one launch mixing many small runs and a few
// huge ones, pinned host memory on either side, and copy_box in CUDA memory.
#include "core/copy_random_layout.h"
#include "gpu/gpu_test_util.h"

#include <weightsync/box.h>

#include "core/copy_program.h"
#include "core/cuda/gpu.h"

#include <cstring>
#include <random>

namespace weightsync::gpu_test {
namespace {

std::uintptr_t addr(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

// A host buffer's twin in GPU memory.
struct Twin {
  std::vector<unsigned char>* host;
  gpu::Memory device;
  explicit Twin(std::vector<unsigned char>& h)
      : host(&h), device(h.size(), gpu::MemoryPlace::device, 0) {
    gpu::copy_to_device(device.data(), h.data(), h.size());
  }
  std::vector<unsigned char> read() const {
    std::vector<unsigned char> out(host->size());
    gpu::copy_to_host(out.data(), device.data(), out.size());
    return out;
  }
};

TEST(CopyKernel, MatchesTheHostExecutorOnRandomTables) {
  REQUIRE_GPU();
  std::mt19937_64 rng(11);
  const gpu::Stream stream(0);
  for (int trial = 0; trial < 300; ++trial) {
    test::RandomCopy c = test::random_copy(rng);
    Twin src(c.src.storage), dst(c.dst.storage);
    CopyProgram p;
    p.add(test::box_byte_offset(c.src.view, c.src_box), c.src.view.effective_strides(),
          test::box_byte_offset(c.dst.view, c.dst_box), c.dst.view.effective_strides(),
          c.src_box.lengths, itemsize(c.src.view.dtype));
    const int64_t chunk = 16 * (1 + static_cast<int64_t>(rng() % 64));
    const gpu::DevicePrograms table({&p}, 0, chunk);
    table.launch(0, stream, addr(src.device.data()), addr(dst.device.data()));
    stream.synchronize();
    execute_host(p, addr(c.src.storage.data()), addr(c.dst.storage.data()));
    ASSERT_EQ(dst.read(), c.dst.storage) << "trial " << trial << ", chunk " << chunk;
  }
}

TEST(CopyKernel, OneLaunchRunsManySmallAndAFewHugeRuns) {
  REQUIRE_GPU();
  std::mt19937_64 rng(12);
  std::vector<unsigned char> src(size_t{96} << 20), dst(src.size());
  for (auto& b : src) b = static_cast<unsigned char>(rng());
  for (auto& b : dst) b = static_cast<unsigned char>(rng());
  Twin dsrc(src), ddst(dst);
  CopyProgram p;
  // Two huge dense blocks, then thousands of small strided ones, disjoint targets.
  p.add(0, {1}, 0, {1}, {int64_t{32} << 20}, 1);
  p.add(int64_t{32} << 20, {1}, (int64_t{32} << 20) + 16, {1}, {(int64_t{16} << 20) - 7}, 1);
  int64_t at = int64_t{50} << 20;
  for (int i = 0; i < 5000; ++i) {
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 8), cols = 1 + rng() % 64;
    const int64_t from = (int64_t{60} << 20) + static_cast<int64_t>(rng() % (int64_t{30} << 20));
    p.add(from, {cols + 3, 1}, at, {cols, 1}, {rows, cols}, 2);
    at += rows * cols * 2;
  }
  ASSERT_LT(at, static_cast<int64_t>(dst.size()));
  const gpu::Stream stream(0);
  const gpu::DevicePrograms table({&p}, 0);
  table.launch(0, stream, addr(dsrc.device.data()), addr(ddst.device.data()));
  stream.synchronize();
  execute_host(p, addr(src.data()), addr(dst.data()));
  EXPECT_EQ(ddst.read(), dst);
}

TEST(CopyKernel, ReachesPinnedHostMemoryOnEitherSide) {
  REQUIRE_GPU();
  const size_t n = size_t{8} << 20;
  gpu::Memory pinned(n, gpu::MemoryPlace::pinned, 0), device(n, gpu::MemoryPlace::device, 0);
  gpu::Memory back(n, gpu::MemoryPlace::pinned, 0);
  for (size_t i = 0; i < n; ++i) pinned.data()[i] = static_cast<char>(i * 31 + 7);
  // A strided pack from pinned memory into the device, then back out.
  CopyProgram in, out;
  in.add(0, {4096, 1}, 0, {2048, 1}, {2048, 2048}, 1);
  out.add(0, {2048, 1}, 0, {4096, 1}, {2048, 2048}, 1);
  const gpu::Stream stream(0);
  const gpu::DevicePrograms table({&in, &out}, 0);
  table.launch(0, stream, addr(pinned.data()), addr(device.data()));
  table.launch(1, stream, addr(device.data()), addr(back.data()));
  stream.synchronize();
  for (size_t r = 0; r < 2048; ++r)
    ASSERT_EQ(std::memcmp(back.data() + r * 4096, pinned.data() + r * 4096, 2048), 0) << r;
}

TEST(CopyKernel, CopyBoxInCudaMemoryTransposesToo) {
  REQUIRE_GPU();
  std::vector<uint16_t> host(64 * 48), expected(48 * 64, 0), got(48 * 64, 0);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<uint16_t>(i * 3 + 1);
  gpu::Memory a(host.size() * 2, gpu::MemoryPlace::device, 0);
  gpu::Memory b(expected.size() * 2, gpu::MemoryPlace::device, 0);
  gpu::copy_to_device(a.data(), host.data(), host.size() * 2);
  const TensorView src = tensor_view(a.data(), DType::BF16, {64, 48}, MemoryKind::cuda, 0);
  const TensorView dst = tensor_view(b.data(), DType::BF16, {48, 64}, MemoryKind::cuda, 0);
  copy_box(src, Box{{0, 8}, {64, 32}}, transposed(dst, 0, 1), Box{{0, 8}, {64, 32}});
  gpu::copy_to_host(got.data(), b.data(), got.size() * 2);
  copy_box(host_view(host.data(), DType::BF16, {64, 48}), Box{{0, 8}, {64, 32}},
           transposed(host_view(expected.data(), DType::BF16, {48, 64}), 0, 1),
           Box{{0, 8}, {64, 32}});
  EXPECT_EQ(got, expected);
  // Host to device and back through copy_box.
  std::vector<uint16_t> round(host.size(), 0);
  copy_box(host_view(host.data(), DType::BF16, {64, 48}), Box{{0, 0}, {64, 48}}, src,
           Box{{0, 0}, {64, 48}});
  copy_box(src, Box{{3, 5}, {10, 20}}, host_view(round.data(), DType::BF16, {64, 48}),
           Box{{3, 5}, {10, 20}});
  for (int r = 3; r < 13; ++r)
    for (int c = 5; c < 25; ++c) EXPECT_EQ(round[r * 48 + c], host[r * 48 + c]);
}

}  // namespace
}  // namespace weightsync::gpu_test
