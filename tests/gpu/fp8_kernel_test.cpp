// The FP8 quantize kernel (gpu::DeviceQuant) against the host quantizer:
// random and adversarial BF16/F16/F32 tensors, ragged edges, tiles assembled
// from several parts, relative addresses; every FP8 byte and every scale
// compared. (The host quantizer is checked against numpy/ml_dtypes in
// tests/pycheck/fp8_check.py.)
#include "gpu/gpu_test_util.h"

#include "core/cuda/gpu.h"
#include "core/fp8.h"

#include <cstring>
#include <random>
#include <vector>

namespace weightsync::gpu_test {
namespace {

int64_t addr(const void* p) {
  return static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(p));
}

struct Case {
  int64_t rows, cols;
  DType dtype;
  ScaleFormat format;
};

TEST(Fp8Kernel, MatchesTheHostQuantizer) {
  REQUIRE_GPU();
  std::mt19937 rng(17);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_int_distribution<int> bits(0, 0xFFFF);
  for (const Case& c : {Case{128, 128, DType::BF16, ScaleFormat::fp32},
                        Case{300, 200, DType::BF16, ScaleFormat::ue8m0},
                        Case{129, 1000, DType::F16, ScaleFormat::fp32},
                        Case{64, 130, DType::F32, ScaleFormat::fp32}}) {
    const size_t item = itemsize(c.dtype);
    const auto count = static_cast<size_t>(c.rows * c.cols);
    std::vector<unsigned char> src(count * item);
    for (size_t i = 0; i < count; ++i) {
      if (c.dtype == DType::F32) {
        const float v = n(rng) * (i % 97 == 0 ? 1e4f : 1.0f);
        std::memcpy(&src[i * 4], &v, 4);
      } else {
        // Any bits but NaN and infinity patterns of BF16 / F16 are values.
        uint16_t h = static_cast<uint16_t>(bits(rng));
        if (c.dtype == DType::BF16 && (h & 0x7F80) == 0x7F80) h &= 0xBFFF;
        if (c.dtype == DType::F16 && (h & 0x7C00) == 0x7C00) h &= 0xBFFF;
        std::memcpy(&src[i * 2], &h, 2);
      }
    }
    const int64_t nscales = ((c.rows + 127) / 128) * ((c.cols + 127) / 128);
    std::vector<uint8_t> want_q(count);
    std::vector<float> want_s(static_cast<size_t>(nscales));
    fp8::quantize_tensor(src.data(), c.dtype, c.rows, c.cols, c.format, want_q.data(),
                         want_s.data());

    gpu::Memory d_src(src.size(), gpu::MemoryPlace::device, 0);
    gpu::Memory d_q(count, gpu::MemoryPlace::device, 0);
    gpu::Memory d_s(want_s.size() * 4, gpu::MemoryPlace::device, 0);
    gpu::copy_to_device(d_src.data(), src.data(), src.size());
    // Source relative to a base, destinations absolute; each tile in two
    // parts split at a column that is no block boundary where it can be.
    fp8::QuantProgram program;
    for (int64_t r0 = 0; r0 < c.rows; r0 += 128) {
      fp8::QuantTile t;
      t.rows = static_cast<int32_t>(std::min<int64_t>(128, c.rows - r0));
      t.cols = static_cast<int32_t>(c.cols);
      t.dst = addr(d_q.data()) + r0 * c.cols;
      t.dst_row_stride = c.cols;
      t.scale = addr(d_s.data()) + (r0 / 128) * ((c.cols + 127) / 128) * 4;
      t.src_dtype = c.dtype;
      t.format = c.format;
      const int32_t split = c.cols > 1 ? static_cast<int32_t>(c.cols / 3 + 1) : 1;
      std::vector<fp8::QuantPart> parts;
      for (auto [c0, nc] :
           {std::pair<int32_t, int32_t>{0, split}, {split, static_cast<int32_t>(c.cols) - split}}) {
        if (nc <= 0) continue;
        fp8::QuantPart p;
        p.src = (r0 * c.cols + c0) * static_cast<int64_t>(item);
        p.row_stride = c.cols;
        p.col0 = c0;
        p.cols = nc;
        p.rows = t.rows;
        p.relative = true;
        parts.push_back(p);
      }
      program.add(t, parts);
    }
    const gpu::DeviceQuant table(program, 0);
    const gpu::Stream stream(0);
    table.launch(stream, reinterpret_cast<std::uintptr_t>(d_src.data()), 0);
    stream.synchronize();
    std::vector<uint8_t> got_q(count);
    std::vector<float> got_s(want_s.size());
    gpu::copy_to_host(got_q.data(), d_q.data(), count);
    gpu::copy_to_host(got_s.data(), d_s.data(), got_s.size() * 4);
    EXPECT_EQ(got_q, want_q) << c.rows << " x " << c.cols << " " << dtype_name(c.dtype);
    EXPECT_EQ(std::memcmp(got_s.data(), want_s.data(), got_s.size() * 4), 0)
        << c.rows << " x " << c.cols << " " << dtype_name(c.dtype);
  }
}

}  // namespace
}  // namespace weightsync::gpu_test
