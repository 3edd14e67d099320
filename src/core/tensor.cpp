#include <weightsync/error.h>
#include <weightsync/tensor.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace weightsync {

int64_t numel(const Shape& shape) noexcept {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= shape[i];
  }
  return strides;
}

bool TensorView::is_contiguous() const {
  if (strides.empty()) return true;
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && strides[i] != s) return false;
    s *= shape[i];
  }
  return true;
}

bool TensorView::is_non_overlapping() const {
  if (strides.empty() || numel() <= 1) return true;
  // Dims of more than one element, by stride: each must step past everything
  // the smaller ones span (a sufficient test, exact for permuted, sliced and
  // padded views).
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, extent)
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] > 1) dims.emplace_back(strides[i], shape[i]);
  std::sort(dims.begin(), dims.end());
  int64_t span = 1;  // elements the smaller dims cover, one past the last
  for (const auto& [stride, extent] : dims) {
    if (stride < span) return false;
    span = stride * (extent - 1) + span;
  }
  return true;
}

TensorView host_view(void* data, DType dtype, Shape shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.shape = std::move(shape);
  return v;
}

TensorView tensor_view(void* data, DType dtype, Shape shape, MemoryKind memory, int device) {
  TensorView v = host_view(data, dtype, std::move(shape));
  v.memory = memory;
  v.device = device;
  return v;
}

TensorView transposed(const TensorView& view, int d0, int d1) {
  const int rank = static_cast<int>(view.shape.size());
  if (d0 < 0 || d1 < 0 || d0 >= rank || d1 >= rank)
    fail(Errc::invalid_argument, "transposed: dims ", d0, ", ", d1, " out of range for shape ",
         shape_str(view.shape));
  TensorView out = view;
  out.strides = view.effective_strides();
  std::swap(out.shape[d0], out.shape[d1]);
  std::swap(out.strides[d0], out.strides[d1]);
  return out;
}

}  // namespace weightsync
