// The copies a plan item turns into, written once for every pipeline: the
// pack of a sender's box into its bucket (Publisher, save_hf), the apply of a
// received item into a param (Subscriber) or into an HF key (save_hf), and
// the two boxes' addressing both need. The copy programs (core/copy_program.h)
// then run them on the host or the GPU.
#pragma once

#include <weightsync/box.h>
#include <weightsync/plan.h>
#include <weightsync/tensor.h>

#include "core/copy_program.h"

#include <cstdint>
#include <cstring>

namespace weightsync::pipeline {

inline std::uintptr_t addr(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

// Byte address of element `offsets` of `tensor`.
int64_t element_address(const TensorView& tensor, const Shape& offsets);

// Appends a copy of `box` of `tensor` into a dense row-major block of the
// box's lengths at `dst` (an offset from the destination base).
void add_gather(CopyProgram& program, const TensorView& tensor, const Box& box, int64_t dst);

// Appends the pack of one plan item: `c.src_box` of `tensor` into the bucket,
// row-major at bucket offset c.offset - base. Errc::internal naming the
// trainer param when the source and HF boxes differ in size.
void add_pack(CopyProgram& program, const Copy& c, const TensorView& tensor, int64_t base);

// Appends the apply of one plan item: from the packed view at bucket offset
// c.offset (+ `shift` where a slot compacts packed fragments) into
// c.dst_box of `target`, through a transposed view when c.transpose.
// Errc::internal naming the engine param when the boxes do not match.
void add_apply(CopyProgram& program, const Copy& c, const TensorView& target, int64_t shift);

// Appends the pack and the apply of one plan item as one copy: `c.src_box`
// of the trainer's `tensor` straight into c.dst_box of `target` (the engine
// param where the trainer reaches it: a lent param), transposed when
// c.transpose. The item must be packed as its HF box (c.view_box ==
// c.hf_box, no FP8); Errc::internal naming the params otherwise, or when the
// boxes or dtypes do not match.
void add_pack_apply(CopyProgram& program, const Copy& c, const TensorView& tensor,
                    const TensorView& target);

// True when the packed item is c.dst_box in row-major order (no transpose,
// no sub-box of a wider view, at most leading length-1 dims added), so that
// it may be received straight into the param.
bool packed_as_dst_box(const Copy& c);

// Appends the apply of an item its sender quantized (Copy::fp8): its codes
// into the FP8 param, then its block scales into the scale param.
void add_apply_fp8(CopyProgram& program, const Copy& c, const TensorView& codes,
                   const TensorView& scales, int64_t shift);

}  // namespace weightsync::pipeline
