// The host quantizer: a band of up to 128 rows at a time, straight from the
// source where one part covers the tile with unit column strides, else block
// by block, gathered first.
#include "core/fp8.h"

#include <weightsync/error.h>

#include "core/fp8_math.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace weightsync::fp8 {
namespace {

template <class T>
T load(std::uintptr_t at) {
  T v;
  std::memcpy(&v, reinterpret_cast<const void*>(at), sizeof v);
  return v;
}

float load_float(DType dtype, std::uintptr_t at) {
  switch (dtype) {
    case DType::BF16:
      return bf16_to_f32(load<uint16_t>(at));
    case DType::F16:
      return f16_to_f32(load<uint16_t>(at));
    default:
      return load<float>(at);
  }
}

void store_scale(std::uintptr_t at, float s) {
  std::memcpy(reinterpret_cast<void*>(at), &s, sizeof s);
}

// On x86-64 with GCC the row loops are also built for x86-64-v4 (AVX-512:
// 16 floats a step) and AVX2 (8) and chosen at load time (SSE2 does 4). Same operations, same bits:
// no fused multiply-add is enabled (and none could change a result, fp8_math.h). Not under
// ThreadSanitizer: the clones' ifunc resolver runs during dynamic relocation, before TSan's runtime
// is up, and its instrumentation crashes every binary at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define WS_FP8_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define WS_FP8_CLONES
#endif

// Contiguous source rows, processed as a band (the tile's up to 128 rows
// across all its blocks): one pass over the rows takes every block's maximum
// at once, on the bits with the sign cleared (for BF16, F16 and F32 alike the
// same order as |x|), then a second pass quantizes each row with its blocks'
// scales. Rows are read front to back (the band stays in L2 for the second
// pass, where a 128 x 128 block read column block by column block would hit
// one L1 set per row); the inner loops are ones the compiler vectorizes.
// (16-bit bits with the sign cleared compare alike as signed: SSE2 has a
// signed max.)
WS_FP8_CLONES void row_block_amax(const uint16_t* row, int64_t n, uint32_t* m) {
  for (int64_t c0 = 0, j = 0; c0 < n; c0 += kBlock, ++j) {
    const int64_t bc = std::min<int64_t>(kBlock, n - c0);
    int16_t x = static_cast<int16_t>(m[j]);
    for (int64_t c = 0; c < bc; ++c)
      x = std::max<int16_t>(x, static_cast<int16_t>(row[c0 + c] & 0x7FFFu));
    m[j] = static_cast<uint32_t>(x);
  }
}
WS_FP8_CLONES void row_block_amax(const uint32_t* row, int64_t n, uint32_t* m) {
  for (int64_t c0 = 0, j = 0; c0 < n; c0 += kBlock, ++j) {
    const int64_t bc = std::min<int64_t>(kBlock, n - c0);
    uint32_t x = m[j];
    for (int64_t c = 0; c < bc; ++c) x = std::max(x, row[c0 + c] & 0x7FFFFFFFu);
    m[j] = x;
  }
}

float from_bits(uint32_t bits, DType dtype) {
  if (dtype == DType::F32) return bits_f32(bits);
  const auto h = static_cast<uint16_t>(bits);
  return dtype == DType::F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

WS_FP8_CLONES void quantize_row_bf16(const uint16_t* row, int64_t n, const float* inv,
                                     uint8_t* out) {
  for (int64_t c0 = 0, j = 0; c0 < n; c0 += kBlock, ++j) {
    const int64_t bc = std::min<int64_t>(kBlock, n - c0);
    const float v = inv[j];
    for (int64_t c = 0; c < bc; ++c) out[c0 + c] = e4m3_from_f32(bf16_to_f32(row[c0 + c]) * v);
  }
}
WS_FP8_CLONES void quantize_row_f16(const uint16_t* row, int64_t n, const float* inv,
                                    uint8_t* out) {
  for (int64_t c0 = 0, j = 0; c0 < n; c0 += kBlock, ++j) {
    const int64_t bc = std::min<int64_t>(kBlock, n - c0);
    const float v = inv[j];
    for (int64_t c = 0; c < bc; ++c) out[c0 + c] = e4m3_from_f32(f16_to_f32(row[c0 + c]) * v);
  }
}
WS_FP8_CLONES void quantize_row_f32(const uint32_t* row, int64_t n, const float* inv,
                                    uint8_t* out) {
  for (int64_t c0 = 0, j = 0; c0 < n; c0 += kBlock, ++j) {
    const int64_t bc = std::min<int64_t>(kBlock, n - c0);
    const float v = inv[j];
    for (int64_t c = 0; c < bc; ++c) out[c0 + c] = e4m3_from_f32(bits_f32(row[c0 + c]) * v);
  }
}

// A tile whose one part covers it with unit column strides on both sides.
// The next dense tile's source rows (the next block row, usually), touched
// while this band is quantized so that its first pass reads cache, not memory.
struct Prefetch {
  std::uintptr_t src = 0;
  int64_t row_bytes = 0, row_stride_bytes = 0, rows = 0;
};

template <class Bits>
void dense_tile(const QuantTile& t, const QuantPart& p, std::uintptr_t src, std::uintptr_t dst,
                std::uintptr_t scale, const Prefetch& next) {
  const auto row = [&](int64_t r) {
    return reinterpret_cast<const Bits*>(
        src + static_cast<std::uintptr_t>(r * p.row_stride * static_cast<int64_t>(sizeof(Bits))));
  };
  const int64_t nb = t.blocks();
  thread_local std::vector<uint32_t> amax;
  thread_local std::vector<float> inv;
  amax.assign(static_cast<size_t>(nb), 0);
  inv.resize(static_cast<size_t>(nb));
  for (int64_t r = 0; r < t.rows; ++r) row_block_amax(row(r), t.cols, amax.data());
  for (int64_t j = 0; j < nb; ++j) {
    const float s = block_scale(from_bits(amax[j], t.src_dtype), t.format == ScaleFormat::ue8m0);
    inv[j] = 1.0f / s;
    store_scale(scale + static_cast<std::uintptr_t>(j * t.scale_stride * 4), s);
  }
  for (int64_t r = 0; r < t.rows; ++r) {
    if (r < next.rows) {
      const auto* at = reinterpret_cast<const char*>(
          next.src + static_cast<std::uintptr_t>(r * next.row_stride_bytes));
      for (int64_t o = 0; o < next.row_bytes; o += 64) __builtin_prefetch(at + o);
    }
    auto* out = reinterpret_cast<uint8_t*>(dst + static_cast<std::uintptr_t>(r * t.dst_row_stride));
    if constexpr (sizeof(Bits) == 4)
      quantize_row_f32(row(r), t.cols, inv.data(), out);
    else if (t.src_dtype == DType::F16)
      quantize_row_f16(row(r), t.cols, inv.data(), out);
    else
      quantize_row_bf16(row(r), t.cols, inv.data(), out);
  }
}

// Any block: its elements gathered from the parts into FP32 first.
void gathered_block(const QuantProgram& prog, const QuantTile& t, std::uintptr_t src_base,
                    std::uintptr_t dst, std::uintptr_t scale, int64_t c0, int64_t bc) {
  // On the heap: a thread_local array would be static TLS of 64 KiB, which
  // glibc carves out of every thread's stack in a process that links this
  // library statically (the `weightsync` command), leaving too little of a
  // 100 KiB stack (civetweb's, serving /metrics) for the thread itself.
  thread_local std::vector<float> block;
  block.resize(kBlock * kBlock);
  float* buf = block.data();
  const size_t item = itemsize(t.src_dtype);
  for (uint32_t i = t.first_part; i < t.first_part + t.num_parts; ++i) {
    const QuantPart& p = prog.parts()[i];
    const int64_t lo = std::max<int64_t>(c0, p.col0),
                  hi = std::min<int64_t>(c0 + bc, p.col0 + p.cols);
    if (lo >= hi) continue;
    const std::uintptr_t base = (p.relative ? src_base : 0) + static_cast<std::uintptr_t>(p.src);
    for (int64_t r = p.row0; r < p.row0 + p.rows; ++r)
      for (int64_t c = lo; c < hi; ++c)
        buf[r * kBlock + (c - c0)] = load_float(
            t.src_dtype, base + static_cast<std::uintptr_t>(
                                    ((r - p.row0) * p.row_stride + (c - p.col0) * p.col_stride) *
                                    static_cast<int64_t>(item)));
  }
  uint32_t m = 0;
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < bc; ++c) m = std::max(m, abs_bits_f32(buf[r * kBlock + c]));
  const float s = block_scale(bits_f32(m), t.format == ScaleFormat::ue8m0);
  const float inv = 1.0f / s;
  for (int64_t r = 0; r < t.rows; ++r)
    for (int64_t c = 0; c < bc; ++c)
      *reinterpret_cast<uint8_t*>(
          dst + static_cast<std::uintptr_t>(r * t.dst_row_stride + (c0 + c) * t.dst_col_stride)) =
          e4m3_from_f32(buf[r * kBlock + c] * inv);
  store_scale(scale, s);
}

bool is_dense(const QuantProgram& prog, const QuantTile& t) {
  const QuantPart& first = prog.parts()[t.first_part];
  return t.num_parts == 1 && first.col_stride == 1 && t.dst_col_stride == 1;
}

std::uintptr_t part_src(const QuantPart& p, std::uintptr_t src_base) {
  return (p.relative ? src_base : 0) + static_cast<std::uintptr_t>(p.src);
}

void run_tile(const QuantProgram& prog, const QuantTile& t, const QuantTile* next,
              std::uintptr_t src_base, std::uintptr_t dst_base) {
  const std::uintptr_t dst = (t.relative ? dst_base : 0) + static_cast<std::uintptr_t>(t.dst);
  const std::uintptr_t scale = (t.relative ? dst_base : 0) + static_cast<std::uintptr_t>(t.scale);
  const QuantPart& first = prog.parts()[t.first_part];
  if (is_dense(prog, t)) {
    Prefetch pf;
    if (next != nullptr && is_dense(prog, *next)) {
      const QuantPart& np = prog.parts()[next->first_part];
      const auto item = static_cast<int64_t>(itemsize(next->src_dtype));
      pf = {part_src(np, src_base), next->cols * item, np.row_stride * item, next->rows};
    }
    const std::uintptr_t src = part_src(first, src_base);
    if (t.src_dtype == DType::F32) return dense_tile<uint32_t>(t, first, src, dst, scale, pf);
    return dense_tile<uint16_t>(t, first, src, dst, scale, pf);
  }
  for (int64_t j = 0; j < t.blocks(); ++j) {
    const int64_t c0 = j * kBlock, bc = std::min<int64_t>(kBlock, t.cols - c0);
    gathered_block(prog, t, src_base, dst,
                   scale + static_cast<std::uintptr_t>(j * t.scale_stride * 4), c0, bc);
  }
}

}  // namespace

bool quantizable_source(DType dtype) noexcept {
  return dtype == DType::BF16 || dtype == DType::F16 || dtype == DType::F32;
}

void QuantProgram::add(QuantTile tile, std::span<const QuantPart> parts) {
  if (tile.rows < 1 || tile.rows > kBlock || tile.cols < 1)
    fail(Errc::invalid_argument, "quantize program: a tile of ", tile.rows, " x ", tile.cols,
         " (1..", kBlock, " rows, at least one column)");
  if (!quantizable_source(tile.src_dtype))
    fail(Errc::invalid_argument, "quantize program: source dtype ", dtype_name(tile.src_dtype),
         " (FP8 quantization takes BF16, F16 or F32)");
  int64_t area = 0;
  for (const QuantPart& p : parts) {
    if (p.rows < 1 || p.cols < 1 || p.row0 < 0 || p.col0 < 0 || p.row0 + p.rows > tile.rows ||
        p.col0 + p.cols > tile.cols)
      fail(Errc::invalid_argument, "quantize program: part [", p.row0, "+", p.rows, ", ", p.col0,
           "+", p.cols, "] outside its ", tile.rows, " x ", tile.cols, " tile");
    area += int64_t{p.rows} * p.cols;
  }
  if (area != int64_t{tile.rows} * tile.cols)
    fail(Errc::invalid_argument, "quantize program: the parts of a ", tile.rows, " x ", tile.cols,
         " tile cover ", area, " elements");
  tile.first_part = static_cast<uint32_t>(parts_.size());
  tile.num_parts = static_cast<uint32_t>(parts.size());
  parts_.insert(parts_.end(), parts.begin(), parts.end());
  blocks_ += tile.blocks();
  elements_ += int64_t{tile.rows} * tile.cols;
  tiles_.push_back(tile);
}

void execute_quant_host(const QuantProgram& program, std::uintptr_t src_base,
                        std::uintptr_t dst_base, std::size_t first, std::size_t count) {
  const std::size_t end =
      std::min(program.tiles().size(), first + std::min(count, program.tiles().size()));
  for (std::size_t i = first; i < end; ++i)
    run_tile(program, program.tiles()[i], i + 1 < end ? &program.tiles()[i + 1] : nullptr, src_base,
             dst_base);
}

void add_region(QuantProgram& program, const Region& g, DType src_dtype, ScaleFormat format) {
  const int64_t item = static_cast<int64_t>(itemsize(src_dtype));
  for (int64_t r0 = 0, i = 0; r0 < g.rows; r0 += kBlock, ++i) {
    QuantTile t;
    t.rows = static_cast<int32_t>(std::min(kBlock, g.rows - r0));
    t.cols = static_cast<int32_t>(g.cols);
    t.dst = g.dst + r0 * g.dst_rs;
    t.dst_row_stride = g.dst_rs;
    t.dst_col_stride = g.dst_cs;
    t.scale = g.scale + i * g.scale_rs * 4;
    t.scale_stride = g.scale_cs;
    t.src_dtype = src_dtype;
    t.format = format;
    t.relative = g.dst_relative;
    QuantPart p;
    p.src = g.src + r0 * g.src_rs * item;
    p.row_stride = g.src_rs;
    p.col_stride = g.src_cs;
    p.rows = t.rows;
    p.cols = t.cols;
    p.relative = g.src_relative;
    program.add(t, {&p, 1});
  }
}

void quantize_tensor(const void* src, DType dtype, int64_t rows, int64_t cols, ScaleFormat format,
                     uint8_t* q, float* scales) {
  if (rows == 0 || cols == 0) return;
  QuantProgram program;
  Region g;
  g.src = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(src));
  g.src_rs = cols;
  g.dst = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(q));
  g.dst_rs = cols;
  g.scale = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(scales));
  g.scale_rs = (cols + kBlock - 1) / kBlock;
  g.rows = rows;
  g.cols = cols;
  add_region(program, g, dtype, format);
  execute_quant_host(program, 0, 0);
}

}  // namespace weightsync::fp8
