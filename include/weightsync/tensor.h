// A non-owning view of a tensor in host or CUDA memory.
#pragma once

#include <weightsync/dtype.h>

#include <cstdint>
#include <string>
#include <vector>

namespace weightsync {

using Shape = std::vector<int64_t>;

enum class MemoryKind : uint8_t { host, cuda };

// Product of the dims (1 for a scalar, 0 if any dim is 0).
int64_t numel(const Shape& shape) noexcept;
// Row-major strides, in elements.
Shape contiguous_strides(const Shape& shape);

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::U8;
  Shape shape;
  Shape strides;  // in elements; empty means contiguous row-major
  MemoryKind memory = MemoryKind::host;
  int device = -1;  // CUDA ordinal when memory == cuda

  int64_t numel() const noexcept { return weightsync::numel(shape); }
  // Bytes spanned by the elements (numel * itemsize); meaningful for contiguous views.
  std::size_t nbytes() const noexcept {
    return static_cast<std::size_t>(numel()) * itemsize(dtype);
  }
  Shape effective_strides() const { return strides.empty() ? contiguous_strides(shape) : strides; }
  bool is_contiguous() const;
  // True when no two elements share memory (no zero or negative strides, no
  // dims interleaved into one another): a view that may be written.
  bool is_non_overlapping() const;
};

// A view of `data` as a contiguous host tensor.
TensorView host_view(void* data, DType dtype, Shape shape);
// A view of `data` as a contiguous tensor in `memory` (CUDA ordinal `device`).
TensorView tensor_view(void* data, DType dtype, Shape shape, MemoryKind memory, int device);
// The same memory with dims d0 and d1 swapped (shape and strides), no copy.
TensorView transposed(const TensorView& view, int d0, int d1);

}  // namespace weightsync
