// The FP8 quantize kernel (gpu::DeviceQuant) against the host quantizer:
// random and adversarial BF16/F16/F32 tensors, ragged edges, tiles assembled
// from several parts, relative addresses; every FP8 byte and every scale
// compared. Whole regions (add_region: one part per tile) take the kernel's
// vector path where their rows are aligned, its general path elsewhere; both
// are compared here, and the fused copy-and-quantize launch too. (The host
// quantizer is checked against numpy/ml_dtypes in tests/pycheck/fp8_check.py.)
#include "gpu/gpu_test_util.h"

#include <weightsync/error.h>

#include "core/copy_program.h"
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

// Adversarial 16-bit values: every 11th element +-448, so that most blocks
// have scale 1 and their values reach the codes as they are (E4M3 rounding
// ties, subnormal codes, underflow to zero); zeros of either sign; the rest
// random magnitudes from 2^-14 to 2^9 of either sign. Never infinity or NaN
// (whose codes follow the platform's NaN sign: docs/fp8.md).
std::vector<uint16_t> adversarial(size_t n, DType dtype, std::mt19937& rng) {
  std::uniform_int_distribution<int> bits(0, 0xFFFF);
  const bool bf = dtype == DType::BF16;
  const int bias = bf ? 127 : 15, man = bf ? 7 : 10;
  std::uniform_int_distribution<int> exps(bias - 14, bias + 8);
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) {
    const auto r = static_cast<uint16_t>(bits(rng));
    uint16_t h = static_cast<uint16_t>((r & 0x8000) | (exps(rng) << man) | (r & ((1 << man) - 1)));
    if (i % 11 == 0) h = bf ? 0x43E0 : 0x5F00;  // 448
    if (i % 11 == 1) h = bf ? 0xC3E0 : 0xDF00;  // -448
    if (i % 11 == 2) h = r & 0x8000;            // +-0
    v[i] = h;
  }
  return v;
}

struct RegionCase {
  int64_t rows, cols, src_cols;  // src_cols > cols: a column slice of a wider tensor
  DType dtype;
  ScaleFormat format;
  int64_t src_shift;  // elements: a source base off 16-byte alignment (general path)
};

// The host quantizer's codes and scales of the region [rows, cols] of the
// row-major [rows, src_cols] source.
void host_region(const std::vector<uint16_t>& src, const RegionCase& c, std::vector<uint8_t>& q,
                 std::vector<float>& s) {
  std::vector<uint16_t> dense(static_cast<size_t>(c.rows * c.cols));
  for (int64_t r = 0; r < c.rows; ++r)
    std::memcpy(&dense[static_cast<size_t>(r * c.cols)],
                &src[static_cast<size_t>(c.src_shift + r * c.src_cols)],
                static_cast<size_t>(c.cols) * 2);
  q.resize(dense.size());
  s.resize(static_cast<size_t>(((c.rows + 127) / 128) * ((c.cols + 127) / 128)));
  fp8::quantize_tensor(dense.data(), c.dtype, c.rows, c.cols, c.format, q.data(), s.data());
}

TEST(Fp8Kernel, WholeRegionsOnTheVectorAndGeneralPathsMatchTheHostQuantizer) {
  REQUIRE_GPU();
  std::mt19937 rng(23);
  for (const RegionCase& c : {RegionCase{512, 1024, 1024, DType::BF16, ScaleFormat::fp32, 0},
                              RegionCase{300, 640, 1280, DType::BF16, ScaleFormat::ue8m0, 0},
                              RegionCase{257, 1000, 1000, DType::BF16, ScaleFormat::fp32, 0},
                              RegionCase{200, 384, 512, DType::F16, ScaleFormat::fp32, 0},
                              RegionCase{130, 256, 256, DType::BF16, ScaleFormat::fp32, 3}}) {
    const int64_t src_elems = c.src_shift + c.rows * c.src_cols;
    const std::vector<uint16_t> src = adversarial(static_cast<size_t>(src_elems), c.dtype, rng);
    std::vector<uint8_t> want_q;
    std::vector<float> want_s;
    host_region(src, c, want_q, want_s);
    gpu::Memory d_src(src.size() * 2, gpu::MemoryPlace::device, 0);
    gpu::Memory d_q(want_q.size(), gpu::MemoryPlace::device, 0);
    gpu::Memory d_s(want_s.size() * 4, gpu::MemoryPlace::device, 0);
    gpu::copy_to_device(d_src.data(), src.data(), src.size() * 2);
    fp8::QuantProgram program;
    fp8::Region g;
    g.src = c.src_shift * 2;  // relative to the source base
    g.src_relative = true;
    g.src_rs = c.src_cols;
    g.dst = addr(d_q.data());
    g.dst_rs = c.cols;
    g.scale = addr(d_s.data());
    g.scale_rs = (c.cols + 127) / 128;
    g.rows = c.rows;
    g.cols = c.cols;
    fp8::add_region(program, g, c.dtype, c.format);
    const gpu::DeviceQuant table(program, 0);
    const gpu::Stream stream(0);
    table.launch(stream, reinterpret_cast<std::uintptr_t>(d_src.data()), 0);
    stream.synchronize();
    std::vector<uint8_t> got_q(want_q.size());
    std::vector<float> got_s(want_s.size());
    gpu::copy_to_host(got_q.data(), d_q.data(), got_q.size());
    gpu::copy_to_host(got_s.data(), d_s.data(), got_s.size() * 4);
    const std::string what = cat(c.rows, " x ", c.cols, " of ", c.src_cols, " ",
                                 dtype_name(c.dtype), " shift ", c.src_shift);
    size_t bad = 0;
    for (size_t i = 0; i < got_q.size(); ++i) bad += got_q[i] != want_q[i];
    EXPECT_EQ(bad, 0u) << what << ": first differing code at "
                       << (std::mismatch(got_q.begin(), got_q.end(), want_q.begin()).first -
                           got_q.begin());
    EXPECT_EQ(std::memcmp(got_s.data(), want_s.data(), got_s.size() * 4), 0) << what;
  }
}

TEST(Fp8Kernel, OneLaunchPacksAndQuantizesABucket) {
  REQUIRE_GPU();
  // A slot holding a packed column slice (copy program) and, after it, the
  // codes and scales of a quantized [384, 512] BF16 tensor: both in one launch.
  std::mt19937 rng(29);
  const RegionCase c{384, 512, 512, DType::BF16, ScaleFormat::fp32, 0};
  const std::vector<uint16_t> weights = adversarial(384 * 512, DType::BF16, rng);
  std::vector<unsigned char> other(1 << 20);
  for (auto& b : other) b = static_cast<unsigned char>(rng());
  std::vector<uint8_t> want_q;
  std::vector<float> want_s;
  host_region(weights, c, want_q, want_s);
  const int64_t packed = 512 * 512;  // bytes
  const int64_t q_at = (packed + 255) / 256 * 256, s_at = q_at + 384 * 512;
  const size_t slot_bytes = static_cast<size_t>(s_at) + want_s.size() * 4;
  gpu::Memory d_w(weights.size() * 2, gpu::MemoryPlace::device, 0);
  gpu::Memory d_other(other.size(), gpu::MemoryPlace::device, 0);
  gpu::Memory d_slot(slot_bytes, gpu::MemoryPlace::device, 0);
  gpu::copy_to_device(d_w.data(), weights.data(), weights.size() * 2);
  gpu::copy_to_device(d_other.data(), other.data(), other.size());
  CopyProgram pack;  // column slice [0:512, 256:768) of a [512, 2048] byte tensor
  pack.add(256, Shape{2048, 1}, 0, Shape{512, 1}, Shape{512, 512}, 1);
  fp8::QuantProgram quant;
  fp8::Region g;
  g.src = addr(d_w.data());
  g.src_rs = 512;
  g.dst = q_at;
  g.dst_rs = 512;
  g.scale = s_at;
  g.scale_rs = 4;
  g.dst_relative = true;
  g.rows = 384;
  g.cols = 512;
  fp8::add_region(quant, g, DType::BF16, ScaleFormat::fp32);
  const gpu::DevicePrograms programs({&pack}, 0);
  const gpu::DeviceQuant kernel(quant, 0);
  const gpu::Stream stream(0);
  const auto slot = reinterpret_cast<std::uintptr_t>(d_slot.data());
  programs.launch_with_quant(0, stream, reinterpret_cast<std::uintptr_t>(d_other.data()), slot,
                             kernel, 0, slot);
  stream.synchronize();
  std::vector<unsigned char> got(slot_bytes);
  gpu::copy_to_host(got.data(), d_slot.data(), slot_bytes);
  std::vector<unsigned char> want_pack(static_cast<size_t>(packed));
  execute_host(pack, reinterpret_cast<std::uintptr_t>(other.data()),
               reinterpret_cast<std::uintptr_t>(want_pack.data()));
  EXPECT_TRUE(std::equal(want_pack.begin(), want_pack.end(), got.begin())) << "the packed bytes";
  EXPECT_TRUE(std::equal(want_q.begin(), want_q.end(), got.begin() + q_at)) << "the codes";
  EXPECT_EQ(std::memcmp(got.data() + s_at, want_s.data(), want_s.size() * 4), 0) << "the scales";
}

}  // namespace
}  // namespace weightsync::gpu_test
