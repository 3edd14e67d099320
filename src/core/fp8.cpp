// The host quantizer: block by block (a 128 x 128 block of BF16 is 32 KiB,
// so its second pass reads L1), straight from the source where one part
// covers the tile with unit column strides, else gathered first.
#include "core/fp8.h"

#include <weightsync/error.h>

#include "core/fp8_math.h"

#include <algorithm>
#include <cstring>

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

// On x86-64 with GCC the row loops are also built for AVX2 and chosen at load
// time (8 floats a step instead of SSE2's 4). Same operations, same bits: no
// fused multiply-add is enabled (and none could change a result, fp8_math.h).
// Not under ThreadSanitizer: the clones' ifunc resolver runs during dynamic
// relocation, before TSan's runtime is up, and its instrumentation crashes
// every binary at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_THREAD__)
#define WS_FP8_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define WS_FP8_CLONES
#endif

// Contiguous source rows: the block maximum is taken on the bits with the
// sign cleared (for BF16, F16 and F32 alike the same order as |x|), then
// each row is quantized; both are loops the compiler vectorizes. (16-bit
// bits with the sign cleared compare alike as signed: SSE2 has a signed max.)
WS_FP8_CLONES uint32_t row_amax_bits(const uint16_t* row, int64_t n) {
  int16_t m = 0;
  for (int64_t c = 0; c < n; ++c) m = std::max<int16_t>(m, static_cast<int16_t>(row[c] & 0x7FFFu));
  return static_cast<uint32_t>(m);
}
WS_FP8_CLONES uint32_t row_amax_bits(const uint32_t* row, int64_t n) {
  uint32_t m = 0;
  for (int64_t c = 0; c < n; ++c) m = std::max(m, row[c] & 0x7FFFFFFFu);
  return m;
}

float from_bits(uint32_t bits, DType dtype) {
  if (dtype == DType::F32) return bits_f32(bits);
  const auto h = static_cast<uint16_t>(bits);
  return dtype == DType::F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

WS_FP8_CLONES void quantize_row_bf16(const uint16_t* row, int64_t n, float inv, uint8_t* out) {
  for (int64_t c = 0; c < n; ++c) out[c] = e4m3_from_f32(bf16_to_f32(row[c]) * inv);
}
WS_FP8_CLONES void quantize_row_f16(const uint16_t* row, int64_t n, float inv, uint8_t* out) {
  for (int64_t c = 0; c < n; ++c) out[c] = e4m3_from_f32(f16_to_f32(row[c]) * inv);
}
WS_FP8_CLONES void quantize_row_f32(const uint32_t* row, int64_t n, float inv, uint8_t* out) {
  for (int64_t c = 0; c < n; ++c) out[c] = e4m3_from_f32(bits_f32(row[c]) * inv);
}

// Block j of a tile whose one part covers it with unit column strides on
// both sides.
template <class Bits>
void dense_block(const QuantTile& t, const QuantPart& p, std::uintptr_t src, std::uintptr_t dst,
                 std::uintptr_t scale, int64_t c0, int64_t bc) {
  const auto row = [&](int64_t r) {
    return reinterpret_cast<const Bits*>(
        src +
        static_cast<std::uintptr_t>((r * p.row_stride + c0) * static_cast<int64_t>(sizeof(Bits))));
  };
  uint32_t m = 0;
  for (int64_t r = 0; r < t.rows; ++r) m = std::max(m, row_amax_bits(row(r), bc));
  const float s = block_scale(from_bits(m, t.src_dtype), t.format == ScaleFormat::ue8m0);
  const float inv = 1.0f / s;
  for (int64_t r = 0; r < t.rows; ++r) {
    auto* out =
        reinterpret_cast<uint8_t*>(dst + static_cast<std::uintptr_t>(r * t.dst_row_stride + c0));
    if constexpr (sizeof(Bits) == 4)
      quantize_row_f32(row(r), bc, inv, out);
    else if (t.src_dtype == DType::F16)
      quantize_row_f16(row(r), bc, inv, out);
    else
      quantize_row_bf16(row(r), bc, inv, out);
  }
  store_scale(scale, s);
}

// Any block: its elements gathered from the parts into FP32 first.
void gathered_block(const QuantProgram& prog, const QuantTile& t, std::uintptr_t src_base,
                    std::uintptr_t dst, std::uintptr_t scale, int64_t c0, int64_t bc) {
  thread_local float buf[kBlock * kBlock];
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

void run_tile(const QuantProgram& prog, const QuantTile& t, std::uintptr_t src_base,
              std::uintptr_t dst_base) {
  const std::uintptr_t dst = (t.relative ? dst_base : 0) + static_cast<std::uintptr_t>(t.dst);
  const std::uintptr_t scale = (t.relative ? dst_base : 0) + static_cast<std::uintptr_t>(t.scale);
  const QuantPart& first = prog.parts()[t.first_part];
  const bool dense = t.num_parts == 1 && first.col_stride == 1 && t.dst_col_stride == 1;
  const std::uintptr_t src =
      (first.relative ? src_base : 0) + static_cast<std::uintptr_t>(first.src);
  for (int64_t j = 0; j < t.blocks(); ++j) {
    const int64_t c0 = j * kBlock, bc = std::min<int64_t>(kBlock, t.cols - c0);
    const std::uintptr_t sj = scale + static_cast<std::uintptr_t>(j * t.scale_stride * 4);
    if (!dense)
      gathered_block(prog, t, src_base, dst, sj, c0, bc);
    else if (t.src_dtype == DType::F32)
      dense_block<uint32_t>(t, first, src, dst, sj, c0, bc);
    else
      dense_block<uint16_t>(t, first, src, dst, sj, c0, bc);
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
    run_tile(program, program.tiles()[i], src_base, dst_base);
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
