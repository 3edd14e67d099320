#include <weightsync/box.h>
#include <weightsync/error.h>

#include "core/copy_program.h"
#include "core/cuda/gpu.h"

#include <algorithm>
#include <cstring>

namespace weightsync {

bool Box::contains(const Box& inner) const {
  if (inner.rank() != rank()) return false;
  for (size_t d = 0; d < rank(); ++d)
    if (inner.offsets[d] < offsets[d] || inner.end(d) > end(d)) return false;
  return true;
}

bool Box::fits(const Shape& shape) const {
  if (shape.size() != rank()) return false;
  for (size_t d = 0; d < rank(); ++d)
    if (offsets[d] < 0 || lengths[d] < 0 || end(d) > shape[d]) return false;
  return true;
}

Box Box::relative_to(const Box& origin) const {
  Box out = *this;
  for (size_t d = 0; d < rank(); ++d) out.offsets[d] -= origin.offsets[d];
  return out;
}

Box Box::full(const Shape& shape) {
  return Box{Shape(shape.size(), 0), shape};
}

bool same_lengths_but_leading_ones(const Shape& a, const Shape& b) {
  const Shape& longer = a.size() >= b.size() ? a : b;
  const Shape& shorter = a.size() >= b.size() ? b : a;
  const size_t lead = longer.size() - shorter.size();
  for (size_t d = 0; d < lead; ++d)
    if (longer[d] != 1) return false;
  return std::equal(shorter.begin(), shorter.end(), longer.begin() + static_cast<ptrdiff_t>(lead));
}

std::optional<Box> intersect(const Box& a, const Box& b) {
  if (a.rank() != b.rank())
    fail(Errc::internal, "intersect: boxes of rank ", a.rank(), " and ", b.rank());
  Box out;
  out.offsets.resize(a.rank());
  out.lengths.resize(a.rank());
  for (size_t d = 0; d < a.rank(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.end(d), b.end(d));
    if (hi <= lo) return std::nullopt;
    out.offsets[d] = lo;
    out.lengths[d] = hi - lo;
  }
  return out;
}

std::string box_str(const Box& box) {
  std::string s = "[";
  for (size_t d = 0; d < box.rank(); ++d) {
    if (d) s += ", ";
    s += std::to_string(box.offsets[d]) + ":" + std::to_string(box.end(d));
  }
  return s + "]";
}

namespace {

// Strided copy with dims already normalized (no length-1 dims, mergeable dims
// merged). The innermost dim is a contiguous run in both when both strides are 1.
struct CopyShape {
  int rank = 0;
  int64_t len[16];
  int64_t dst[16];
  int64_t src[16];
};

CopyShape normalize(const int64_t* dst_strides, const int64_t* src_strides, const int64_t* lengths,
                    int rank) {
  CopyShape c;
  for (int d = 0; d < rank; ++d) {
    if (lengths[d] == 1) continue;
    if (c.rank > 0) {
      const int p = c.rank - 1;
      // Merge with the previous (outer) dim when it steps exactly over this one.
      if (c.dst[p] == dst_strides[d] * lengths[d] && c.src[p] == src_strides[d] * lengths[d]) {
        c.len[p] *= lengths[d];
        c.dst[p] = dst_strides[d];
        c.src[p] = src_strides[d];
        continue;
      }
    }
    if (c.rank == 16) fail(Errc::unsupported, "copy_box: more than 16 dims");
    c.len[c.rank] = lengths[d];
    c.dst[c.rank] = dst_strides[d];
    c.src[c.rank] = src_strides[d];
    ++c.rank;
  }
  return c;
}

template <class T>
void copy_elements(char* dst, const char* src, int64_t n, int64_t ds, int64_t ss) {
  auto* d = reinterpret_cast<T*>(dst);
  const auto* s = reinterpret_cast<const T*>(src);
  for (int64_t i = 0; i < n; ++i) std::memcpy(d + i * ds, s + i * ss, sizeof(T));
}

void copy_inner(char* dst, const char* src, const CopyShape& c, size_t item) {
  const int in = c.rank - 1;
  const int64_t n = c.len[in];
  if (c.dst[in] == 1 && c.src[in] == 1) {
    std::memcpy(dst, src, static_cast<size_t>(n) * item);
    return;
  }
  switch (item) {
    case 1:
      copy_elements<uint8_t>(dst, src, n, c.dst[in], c.src[in]);
      return;
    case 2:
      copy_elements<uint16_t>(dst, src, n, c.dst[in], c.src[in]);
      return;
    case 4:
      copy_elements<uint32_t>(dst, src, n, c.dst[in], c.src[in]);
      return;
    case 8:
      copy_elements<uint64_t>(dst, src, n, c.dst[in], c.src[in]);
      return;
    default:
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(dst + i * c.dst[in] * item, src + i * c.src[in] * item, item);
  }
}

}  // namespace

void copy_strided(void* dst, const int64_t* dst_strides, const void* src,
                  const int64_t* src_strides, const int64_t* lengths, int rank,
                  std::size_t itemsize) {
  for (int d = 0; d < rank; ++d)
    if (lengths[d] == 0) return;
  CopyShape c = normalize(dst_strides, src_strides, lengths, rank);
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  if (c.rank == 0) {
    std::memcpy(d, s, itemsize);
    return;
  }
  // Odometer over the outer dims; the innermost dim is one run.
  int64_t idx[16] = {};
  const int outer = c.rank - 1;
  while (true) {
    copy_inner(d, s, c, itemsize);
    int k = outer - 1;
    for (; k >= 0; --k) {
      d += c.dst[k] * static_cast<int64_t>(itemsize);
      s += c.src[k] * static_cast<int64_t>(itemsize);
      if (++idx[k] < c.len[k]) break;
      d -= c.dst[k] * c.len[k] * static_cast<int64_t>(itemsize);
      s -= c.src[k] * c.len[k] * static_cast<int64_t>(itemsize);
      idx[k] = 0;
    }
    if (k < 0) return;
  }
}

namespace {

void check_copy(const TensorView& src, const Box& src_box, const TensorView& dst,
                const Box& dst_box) {
  if (src.dtype != dst.dtype)
    fail(Errc::mismatch, "copy_box: dtype ", dtype_name(src.dtype), " into ",
         dtype_name(dst.dtype));
  if (!same_lengths_but_leading_ones(src_box.lengths, dst_box.lengths))
    fail(Errc::mismatch, "copy_box: box ", box_str(src_box), " into box ", box_str(dst_box),
         " of other lengths");
  if (!src_box.fits(src.shape))
    fail(Errc::invalid_argument, "copy_box: source box ", box_str(src_box),
         " outside tensor of shape ", shape_str(src.shape));
  if (!dst_box.fits(dst.shape))
    fail(Errc::invalid_argument, "copy_box: destination box ", box_str(dst_box),
         " outside tensor of shape ", shape_str(dst.shape));
}

int64_t element_offset(const Box& box, const Shape& strides) {
  int64_t off = 0;
  for (size_t d = 0; d < box.rank(); ++d) off += box.offsets[d] * strides[d];
  return off;
}

// CUDA memory on either side: one copy program run by the copy kernel. A
// host side (pageable memory the kernel cannot reach) is packed or unpacked
// on the host and crosses in one cudaMemcpy of the dense block.
void copy_cuda(const TensorView& src, const char* s, const Shape& ss, const TensorView& dst,
               char* d, const Shape& ds, const Shape& len, size_t item, void* stream) {
  const auto addr = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  const Shape dense = contiguous_strides(len);
  const size_t bytes = static_cast<size_t>(numel(len)) * item;
  if (src.memory == MemoryKind::cuda && dst.memory == MemoryKind::cuda) {
    CopyProgram p;
    p.add(static_cast<int64_t>(addr(s)), ss, static_cast<int64_t>(addr(d)), ds, len, item);
    return gpu::run_once(p, dst.device, stream, 0, 0);
  }
  const bool to_device = dst.memory == MemoryKind::cuda;
  const int device = to_device ? dst.device : src.device;
  gpu::Memory block(bytes, gpu::MemoryPlace::device, device);
  std::vector<char> host(bytes);
  CopyProgram p;
  if (to_device) {
    copy_strided(host.data(), dense.data(), s, ss.data(), len.data(), static_cast<int>(len.size()),
                 item);
    gpu::synchronize_stream(stream);  // after the stream's earlier work
    gpu::copy_to_device(block.data(), host.data(), bytes);
    p.add(static_cast<int64_t>(addr(block.data())), dense, static_cast<int64_t>(addr(d)), ds, len,
          item);
    return gpu::run_once(p, device, nullptr, 0, 0);
  }
  p.add(static_cast<int64_t>(addr(s)), ss, static_cast<int64_t>(addr(block.data())), dense, len,
        item);
  gpu::run_once(p, device, stream, 0, 0);
  gpu::copy_to_host(host.data(), block.data(), bytes);
  copy_strided(d, ds.data(), host.data(), dense.data(), len.data(), static_cast<int>(len.size()),
               item);
}

}  // namespace

void copy_box(const TensorView& src, const Box& src_box, const TensorView& dst, const Box& dst_box,
              void* cuda_stream) {
  check_copy(src, src_box, dst, dst_box);
  if (src_box.empty()) return;
  const size_t item = itemsize(src.dtype);
  Shape ss = src.effective_strides();
  Shape ds = dst.effective_strides();
  const char* s = static_cast<const char*>(src.data) + element_offset(src_box, ss) * item;
  char* d = static_cast<char*>(dst.data) + element_offset(dst_box, ds) * item;
  // Boxes that differ by leading length-1 dims: the shorter side steps 0 there.
  const Shape& lengths = src_box.rank() >= dst_box.rank() ? src_box.lengths : dst_box.lengths;
  ss.insert(ss.begin(), lengths.size() - ss.size(), 0);
  ds.insert(ds.begin(), lengths.size() - ds.size(), 0);
  if (src.memory == MemoryKind::host && dst.memory == MemoryKind::host) {
    copy_strided(d, ds.data(), s, ss.data(), lengths.data(), static_cast<int>(lengths.size()),
                 item);
    return;
  }
  copy_cuda(src, s, ss, dst, d, ds, lengths, item, cuda_stream);
}

}  // namespace weightsync
