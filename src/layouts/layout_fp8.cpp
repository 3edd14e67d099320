// FP8 engines: a quantized weight and its scale param (DESIGN.md "FP8
// engines"). A block of the engine param must be a block of one HF tensor,
// quantized exactly as an FP8 checkpoint stores it: so every part starts on a
// block boundary in both the HF tensor and the param, and ends on one or at
// the end of both (the one ragged edge block). vLLM's checks are the same
// facts: validate_fp8_block_shape (an output partition, and every merged part
// but the last, a multiple of block_n; a row-parallel input partition a
// multiple of block_k) and Fp8MoEMethod (intermediate_size_per_partition a
// multiple of the block size).
#include "layout_rules.h"

#include <weightsync/error.h>

namespace weightsync::engine {
namespace {

const char* dim_name(size_t d) {
  return d == 0 ? "rows" : "columns";
}

// HF dim d of `s` (2-D) against param dim (rank - 2 + d).
void check_block_edges(const EngineParam& p, const Segment& s, const Shape& hf_shape, size_t d,
                       const BlockQuant& q, int rank, int tp) {
  const int64_t block = d == 0 ? q.block_rows : q.block_cols;
  const size_t pd = p.shape.size() - 2 + d;
  const int64_t hf_lo = s.hf_box.offsets[d], hf_hi = s.hf_box.end(d);
  const int64_t p_lo = s.param_box.offsets[pd], p_hi = s.param_box.end(pd);
  const bool starts = hf_lo % block == 0 && p_lo % block == 0;
  const bool ends =
      (hf_hi % block == 0 && p_hi % block == 0) || (hf_hi == hf_shape[d] && p_hi == p.shape[pd]);
  if (starts && ends) return;
  fail(Errc::invalid_layout, "engine rank ", rank, " param '", p.name, "' (FP8, blocks of ",
       q.block_rows, " x ", q.block_cols, ", tp=", tp, "): ", dim_name(d), " [", hf_lo, ", ", hf_hi,
       ") of HF tensor '", s.hf_key, "' ", shape_str(hf_shape), " land at ", dim_name(d), " [",
       p_lo, ", ", p_hi, ") of the param ", shape_str(p.shape),
       "; every part must start on a block boundary in both and end on one or at the end of "
       "both, as vLLM requires too (a tensor-parallel slice of ",
       hf_hi - hf_lo, " is not a multiple of ", block, ")");
}

}  // namespace

EngineParam make_quantized(EngineParam& weight, const BlockQuant& quant, const HfShapes& shapes,
                           int rank, int tp, int32_t index) {
  if (weight.shape.size() < 2)
    fail(Errc::internal, "engine param '", weight.name, "': FP8 needs a matrix, shape ",
         shape_str(weight.shape));
  for (const Segment& s : weight.segments) {
    auto it = shapes.find(s.hf_key);
    if (it == shapes.end() || it->second.size() != 2 || s.hf_box.rank() != 2 || s.transpose)
      fail(Errc::internal, "engine param '", weight.name, "': FP8 segment of '", s.hf_key,
           "' is not a 2-D HF box without transpose");
    for (size_t d = 0; d < 2; ++d) check_block_edges(weight, s, it->second, d, quant, rank, tp);
  }
  weight.dtype = DType::F8_E4M3;
  weight.quant = quant;
  weight.scale_param = index + 1;
  EngineParam scale;
  scale.name = scale_param_name(weight.name);
  scale.dtype = DType::F32;
  scale.shape = weight.shape;
  const size_t n = scale.shape.size();
  scale.shape[n - 2] = (scale.shape[n - 2] + quant.block_rows - 1) / quant.block_rows;
  scale.shape[n - 1] = (scale.shape[n - 1] + quant.block_cols - 1) / quant.block_cols;
  scale.scale_of = index;
  return scale;
}

}  // namespace weightsync::engine
