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

// The common part of two boxes of equal rank; nullopt when it holds no element.
std::optional<Box> intersect(const Box& a, const Box& b);

// "[0:4, 2:6]" (half-open ranges per dim).
std::string box_str(const Box& box);

// Copies the elements of `src_box` of `src` into `dst_box` of `dst`. The boxes
// must have equal lengths and dtypes must match (Errc::mismatch otherwise).
// Dims that are contiguous in both views are merged so that contiguous runs
// move at memcpy speed. Host memory always; CUDA memory when built with CUDA
// (`cuda_stream` is a cudaStream_t, nullptr for the default stream; the copy
// is asynchronous on that stream then).
void copy_box(const TensorView& src, const Box& src_box, const TensorView& dst, const Box& dst_box,
              void* cuda_stream = nullptr);

// The raw strided copy behind copy_box, for host memory: `rank` dims of
// `lengths`, strides in elements.
void copy_strided(void* dst, const int64_t* dst_strides, const void* src,
                  const int64_t* src_strides, const int64_t* lengths, int rank,
                  std::size_t itemsize);

}  // namespace weightsync
