#include "item_copies.h"

#include <weightsync/error.h>

#include "core/fp8.h"

#include <utility>

namespace weightsync::pipeline {
namespace {

// Swaps the last two entries (a transposed param seen in HF orientation).
Shape swap_last_two(Shape s) {
  if (s.size() >= 2) std::swap(s[s.size() - 1], s[s.size() - 2]);
  return s;
}

int64_t dot(const Shape& a, const Shape& b) {
  int64_t out = 0;
  for (size_t d = 0; d < a.size(); ++d) out += a[d] * b[d];
  return out;
}

// Prepends `n` entries of `value` (a param may have leading length-1 expert
// dims that the HF tensor lacks; engine_layout.h).
Shape lead(Shape s, size_t n, int64_t value) {
  s.insert(s.begin(), n, value);
  return s;
}

// Errc::internal unless c.src_box has the HF box's lengths (leading ones
// aside): the item's source and its packed bytes differ in size.
void check_src_box(const Copy& c) {
  if (!same_lengths_but_leading_ones(c.src_box.lengths, c.hf_box.lengths))
    fail(Errc::internal, "plan item of trainer param ", c.src_param, ": source box ",
         box_str(c.src_box), " and HF box ", box_str(c.hf_box), " differ in size");
}

// c.dst_box of `target` seen in HF orientation: the address of its first
// element, the param's strides (the last two swapped when c.transpose), and
// how many leading length-1 dims it has beyond the HF box. Errc::internal
// naming the engine param when the boxes do not match.
struct DstBox {
  int64_t address = 0;
  Shape strides;
  size_t extra = 0;
};

DstBox dst_box_of(const Copy& c, const TensorView& target) {
  if (c.dst_box.rank() < c.hf_box.rank())
    fail(Errc::internal, "plan copy into engine param ", c.dst_param, ": box ", box_str(c.dst_box),
         " has fewer dims than HF box ", box_str(c.hf_box));
  DstBox d;
  d.extra = c.dst_box.rank() - c.hf_box.rank();
  const Shape offsets = c.transpose ? swap_last_two(c.dst_box.offsets) : c.dst_box.offsets;
  const Shape lengths = c.transpose ? swap_last_two(c.dst_box.lengths) : c.dst_box.lengths;
  if (lengths != lead(c.hf_box.lengths, d.extra, 1))
    fail(Errc::internal, "plan copy into engine param ", c.dst_param, ": box ", box_str(c.dst_box),
         " does not match HF box ", box_str(c.hf_box), c.transpose ? " transposed" : "");
  d.address = element_address(target, offsets);
  d.strides = c.transpose ? swap_last_two(target.effective_strides()) : target.effective_strides();
  return d;
}

}  // namespace

int64_t element_address(const TensorView& tensor, const Shape& offsets) {
  return static_cast<int64_t>(addr(tensor.data)) +
         dot(offsets, tensor.effective_strides()) * static_cast<int64_t>(itemsize(tensor.dtype));
}

void add_gather(CopyProgram& program, const TensorView& tensor, const Box& box, int64_t dst) {
  program.add(element_address(tensor, box.offsets), tensor.effective_strides(), dst,
              contiguous_strides(box.lengths), box.lengths, itemsize(tensor.dtype));
}

void add_pack(CopyProgram& program, const Copy& c, const TensorView& tensor, int64_t base) {
  check_src_box(c);
  add_gather(program, tensor, c.src_box, c.offset - base);
}

void add_apply(CopyProgram& program, const Copy& c, const TensorView& target, int64_t shift) {
  const DstBox dst = dst_box_of(c, target);
  const auto item = static_cast<int64_t>(itemsize(target.dtype));
  const Box src = c.hf_box.relative_to(c.view_box);
  const Shape packed_strides = contiguous_strides(c.view_box.lengths);
  // Seen through a transposed view, the param box has the HF box's lengths.
  program.add(c.offset + shift + dot(src.offsets, packed_strides) * item,
              lead(packed_strides, dst.extra, 0), dst.address, dst.strides,
              lead(c.hf_box.lengths, dst.extra, 1), itemsize(target.dtype));
}

void add_pack_apply(CopyProgram& program, const Copy& c, const TensorView& tensor,
                    const TensorView& target) {
  check_src_box(c);
  if (c.fp8 || c.view_box != c.hf_box)
    fail(Errc::internal, "plan item of trainer param ", c.src_param, " into engine param ",
         c.dst_param, ": not packed as its HF box, so not written in one copy");
  if (tensor.dtype != target.dtype)
    fail(Errc::internal, "plan item of trainer param ", c.src_param, " (", dtype_name(tensor.dtype),
         ") into engine param ", c.dst_param, " (", dtype_name(target.dtype), ")");
  const DstBox dst = dst_box_of(c, target);
  // Both sides' strides over the HF box's dims: dims a side has beyond them
  // are leading ones, and leading HF dims the source lacks are ones too
  // (stride 0).
  const Shape& lengths = c.hf_box.lengths;
  const auto h = static_cast<std::ptrdiff_t>(lengths.size());
  const Shape dst_strides(dst.strides.end() - h, dst.strides.end());
  const Shape src_all = tensor.effective_strides();
  const auto n = static_cast<std::ptrdiff_t>(src_all.size());
  const Shape src_strides = n >= h ? Shape(src_all.end() - h, src_all.end())
                                   : lead(src_all, static_cast<size_t>(h - n), 0);
  program.add(element_address(tensor, c.src_box.offsets), src_strides, dst.address, dst_strides,
              lengths, itemsize(tensor.dtype));
}

bool packed_as_dst_box(const Copy& c) {
  return !c.transpose && c.view_box == c.hf_box && c.dst_box.rank() >= c.hf_box.rank() &&
         c.dst_box.lengths == lead(c.hf_box.lengths, c.dst_box.rank() - c.hf_box.rank(), 1);
}

void add_apply_fp8(CopyProgram& program, const Copy& c, const TensorView& codes,
                   const TensorView& scales, int64_t shift) {
  if (codes.dtype != DType::F8_E4M3 || scales.dtype != DType::F32)
    fail(Errc::internal, "plan copy into engine param ", c.dst_param, ": quantized by its sender, ",
         "but the param is ", dtype_name(codes.dtype), " and its scale param ",
         dtype_name(scales.dtype));
  add_apply(program, c, codes, shift);
  const size_t n = c.hf_box.rank();
  Copy s = c;
  s.offset = c.offset + c.hf_box.numel();
  s.hf_box = Box::full(Shape{(c.hf_box.lengths[n - 2] + fp8::kBlock - 1) / fp8::kBlock,
                             (c.hf_box.lengths[n - 1] + fp8::kBlock - 1) / fp8::kBlock});
  s.view_box = s.hf_box;
  s.dst_box = c.scale_box;
  s.dst_param = c.scale_param;
  add_apply(program, s, scales, shift);
}

}  // namespace weightsync::pipeline
