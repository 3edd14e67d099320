// Boxes: per-dimension offsets and lengths inside a tensor. Every byte
// weightsync moves is named by (hf_key, Box) in Hugging Face coordinates.
#pragma once

#include <weightsync/tensor.h>

#include <optional>
#include <string>

namespace weightsync {

struct Box {
  Shape offsets;
  Shape lengths;

  std::size_t rank() const noexcept { return lengths.size(); }
  int64_t numel() const noexcept { return weightsync::numel(lengths); }
  bool empty() const noexcept { return numel() == 0; }
  int64_t end(std::size_t dim) const { return offsets[dim] + lengths[dim]; }
  // True when `inner` lies inside this box (same rank).
  bool contains(const Box& inner) const;
  // True when the box lies inside a tensor of `shape`.
  bool fits(const Shape& shape) const;
  // The box moved by -origin.offsets: coordinates relative to `origin`.
  Box relative_to(const Box& origin) const;

  static Box full(const Shape& shape);
  friend bool operator==(const Box&, const Box&) = default;
};

// True when `a` and `b` are equal once leading 1s are dropped (a box of a
// stacked trainer tensor, load_spec.h, or of an expert slot of an engine
// param has leading length-1 dims its HF box lacks).
bool same_lengths_but_leading_ones(const Shape& a, const Shape& b);

// The common part of two boxes of equal rank; nullopt when it holds no element.
std::optional<Box> intersect(const Box& a, const Box& b);

// "[0:4, 2:6]" (half-open ranges per dim).
std::string box_str(const Box& box);

// Copies the elements of `src_box` of `src` into `dst_box` of `dst`. The boxes
// must have equal lengths, up to leading dims of length 1 that one side lacks
// (same_lengths_but_leading_ones), and dtypes must match (Errc::mismatch
// otherwise).
// Dims that are contiguous in both views are merged so that contiguous runs
// move at memcpy speed. Host memory always; CUDA memory on either side when
// built with CUDA: one launch of the copy kernel (transposes included), after
// the work queued on `cuda_stream` (a cudaStream_t; nullptr: the legacy
// default stream), returning when the copy is done. A one-off copy: the data
// path runs copy programs instead (src/core/copy_program.h).
void copy_box(const TensorView& src, const Box& src_box, const TensorView& dst, const Box& dst_box,
              void* cuda_stream = nullptr);

// The raw strided copy behind copy_box, for host memory: `rank` dims of
// `lengths`, strides in elements.
void copy_strided(void* dst, const int64_t* dst_strides, const void* src,
                  const int64_t* src_strides, const int64_t* lengths, int rank,
                  std::size_t itemsize);

}  // namespace weightsync
