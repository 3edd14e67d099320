// Random strided copies for the copy-program tests (CPU here, the kernel in
// tests/gpu): tensors with padded and permuted (transposed) storage, random
// boxes inside them, every dtype size.
#pragma once

#include <weightsync/box.h>
#include <weightsync/tensor.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

namespace weightsync::test {

// A tensor view over its own random bytes: shape `shape`, dims stored in the
// order `perm` (perm.back() innermost), each dim padded by a few elements.
struct RandomTensor {
  std::vector<unsigned char> storage;
  TensorView view;
};

inline RandomTensor random_tensor(std::mt19937_64& rng, const Shape& shape, DType dtype,
                                  bool permute) {
  const size_t rank = shape.size();
  std::vector<size_t> perm(rank);
  std::iota(perm.begin(), perm.end(), 0);
  if (permute) std::shuffle(perm.begin(), perm.end(), rng);
  Shape strides(rank);
  int64_t step = 1;
  for (size_t k = rank; k-- > 0;) {
    const size_t d = perm[k];
    strides[d] = step;
    step *= shape[d] + static_cast<int64_t>(rng() % 3);  // padding: up to 2 elements
  }
  RandomTensor t;
  t.storage.resize(static_cast<size_t>(step) * itemsize(dtype) + 16);
  for (auto& b : t.storage) b = static_cast<unsigned char>(rng());
  t.view = host_view(t.storage.data(), dtype, shape);
  t.view.strides = strides;
  return t;
}

// One random copy: a box of `src` into an equally long box of `dst`.
struct RandomCopy {
  RandomTensor src, dst;
  Box src_box, dst_box;
};

inline Box random_box(std::mt19937_64& rng, const Shape& shape, const Shape& lengths) {
  Box b{Shape(shape.size()), lengths};
  for (size_t d = 0; d < shape.size(); ++d)
    b.offsets[d] = static_cast<int64_t>(rng() % static_cast<uint64_t>(shape[d] - lengths[d] + 1));
  return b;
}

inline RandomCopy random_copy(std::mt19937_64& rng) {
  static const DType kTypes[] = {DType::U8, DType::BF16, DType::F32, DType::F64};
  const DType dtype = kTypes[rng() % 4];
  const size_t rank = 1 + rng() % 5;
  Shape lengths(rank);
  for (auto& n : lengths) n = 1 + static_cast<int64_t>(rng() % 5);
  // Now and then a long dim, so that runs span many bytes.
  if (rng() % 2) lengths[rng() % rank] = 16 + static_cast<int64_t>(rng() % 300);
  auto around = [&](const Shape& l) {
    Shape s = l;
    for (auto& n : s) n += static_cast<int64_t>(rng() % 3);
    return s;
  };
  RandomCopy c;
  c.src = random_tensor(rng, around(lengths), dtype, rng() % 3 == 0);
  c.dst = random_tensor(rng, around(lengths), dtype, rng() % 3 == 0);
  c.src_box = random_box(rng, c.src.view.shape, lengths);
  c.dst_box = random_box(rng, c.dst.view.shape, lengths);
  return c;
}

// Byte offset of a box's first element in a view.
inline int64_t box_byte_offset(const TensorView& v, const Box& b) {
  const Shape s = v.effective_strides();
  int64_t off = 0;
  for (size_t d = 0; d < b.rank(); ++d) off += b.offsets[d] * s[d];
  return off * static_cast<int64_t>(itemsize(v.dtype));
}

}  // namespace weightsync::test
