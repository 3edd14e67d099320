// Block FP8 quantization as a program (DESIGN.md "FP8 engines"): a table of
// tiles built once per plan on the CPU and run every step, beside a bucket's
// copy program, by one executor: loops on the host (execute_quant_host), the
// same launch as the copy program on the GPU (cuda/gpu.h). The arithmetic is
// fp8_math.h's, the same on both.
//
// A tile is up to kBlock rows of one weight (one block row), quantized in
// blocks of kBlock columns from the tile's column 0: block j covers columns
// [j * kBlock, min((j + 1) * kBlock, cols)) (edge blocks smaller) and writes
// its scale at scale + j * scale_stride. Its source is a set of parts, each a
// rectangle of the tile read from its own place: one part where the tile lies
// inside one packed item, several where the tile's rows or columns came from
// several trainer ranks (assembled on the engine) or several buckets.
//
// Addresses are integers: absolute, or (`relative`) offsets from a base given
// at execution, as in copy programs. Parts read from the source base (the
// receive slot, for an engine's apply), tiles write from the destination base
// (the send slot, for a trainer's pack).
#pragma once

#include <weightsync/dtype.h>
#include <weightsync/engine_layout.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

namespace weightsync::fp8 {

inline constexpr int64_t kBlock = 128;

// The source dtypes the quantizer takes (the trainer's weights).
bool quantizable_source(DType dtype) noexcept;

struct QuantPart {
  int64_t src = 0;         // byte address of the part's element (0, 0)
  int64_t row_stride = 0;  // in elements of the source dtype
  int64_t col_stride = 1;
  int32_t row0 = 0, rows = 0;  // where the part lies in its tile
  int32_t col0 = 0, cols = 0;
  bool relative = false;  // src is an offset from the source base
};

struct QuantTile {
  int64_t dst = 0;                                 // FP8 byte address of the tile's element (0, 0)
  int64_t dst_row_stride = 0, dst_col_stride = 1;  // bytes
  int64_t scale = 0;                               // F32 byte address of block 0's scale
  int64_t scale_stride = 1;  // F32 elements from one block's scale to the next's
  int32_t rows = 0, cols = 0;
  uint32_t first_part = 0, num_parts = 0;  // into QuantProgram::parts()
  DType src_dtype = DType::BF16;
  ScaleFormat format = ScaleFormat::fp32;
  bool relative = false;  // dst and scale are offsets from the destination base

  int64_t blocks() const noexcept { return (cols + kBlock - 1) / kBlock; }
};

class QuantProgram {
 public:
  // Appends a tile and its parts (copied; first_part/num_parts are set here).
  // Errc::invalid_argument unless 1 <= rows <= kBlock, cols >= 1, the source
  // dtype is quantizable, and the parts lie inside the tile and add up to it.
  void add(QuantTile tile, std::span<const QuantPart> parts);

  const std::vector<QuantTile>& tiles() const noexcept { return tiles_; }
  const std::vector<QuantPart>& parts() const noexcept { return parts_; }
  bool empty() const noexcept { return tiles_.empty(); }
  int64_t blocks() const noexcept { return blocks_; }
  int64_t elements() const noexcept { return elements_; }

 private:
  std::vector<QuantTile> tiles_;
  std::vector<QuantPart> parts_;
  int64_t blocks_ = 0, elements_ = 0;
};

// Runs tiles [first, first + count) on the host.
void execute_quant_host(const QuantProgram& program, std::uintptr_t src_base,
                        std::uintptr_t dst_base, std::size_t first = 0,
                        std::size_t count = std::numeric_limits<std::size_t>::max());

// Quantizes a whole row-major 2-D tensor [rows, cols] of `dtype` at `src` into
// `q` (rows * cols bytes, row-major) and `scales` ([ceil(rows/128),
// ceil(cols/128)] F32, row-major): the reference form, an HF tensor as an FP8
// checkpoint stores it.
void quantize_tensor(const void* src, DType dtype, int64_t rows, int64_t cols, ScaleFormat format,
                     uint8_t* q, float* scales);

// Appends to `program` the tiles quantizing the 2-D region [rows, cols] at
// `src` (element strides src_rs, src_cs; `src_relative` as QuantPart::relative)
// into FP8 at `dst` (byte strides dst_rs, dst_cs) and its scales at `scale`
// (F32, scale_rs / scale_cs elements between block rows / columns): one tile
// per block row, each one part. The region starts on a block boundary.
struct Region {
  int64_t src = 0, src_rs = 0, src_cs = 1;
  bool src_relative = false;
  int64_t dst = 0, dst_rs = 0, dst_cs = 1;
  int64_t scale = 0, scale_rs = 0, scale_cs = 1;
  bool dst_relative = false;
  int64_t rows = 0, cols = 0;
};
void add_region(QuantProgram& program, const Region& region, DType src_dtype, ScaleFormat format);

}  // namespace weightsync::fp8
