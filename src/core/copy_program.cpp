#include "copy_program.h"

#include <weightsync/error.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace weightsync {
namespace {

// A block's dims in bytes after dropping length-1 dims and merging dims that
// are contiguous on both sides; outermost first.
struct Dims {
  std::vector<int64_t> len, src, dst;
};

Dims normalize(const Shape& src_strides, const Shape& dst_strides, const Shape& lengths,
               int64_t item) {
  Dims d;
  for (size_t k = 0; k < lengths.size(); ++k) {
    if (lengths[k] == 1) continue;
    const int64_t ss = src_strides[k] * item, ds = dst_strides[k] * item;
    if (!d.len.empty() && d.src.back() == ss * lengths[k] && d.dst.back() == ds * lengths[k]) {
      // The outer dim steps exactly over this one on both sides: one dim.
      d.len.back() *= lengths[k];
      d.src.back() = ss;
      d.dst.back() = ds;
      continue;
    }
    d.len.push_back(lengths[k]);
    d.src.push_back(ss);
    d.dst.push_back(ds);
  }
  return d;
}

template <class T>
void copy_strided_elements(char* dst, const char* src, int64_t n, int64_t ds, int64_t ss) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * ds, src + i * ss, sizeof(T));
}

// The count[0] runs of one (i1, i2) position.
void copy_row_family(char* dst, const char* src, const CopyRun& r) {
  const int64_t n = r.count[0], ss = r.src_stride[0], ds = r.dst_stride[0];
  switch (r.bytes) {  // element-sized runs (a transpose): typed, not memcpy calls
    case 1:
      return copy_strided_elements<uint8_t>(dst, src, n, ds, ss);
    case 2:
      return copy_strided_elements<uint16_t>(dst, src, n, ds, ss);
    case 4:
      return copy_strided_elements<uint32_t>(dst, src, n, ds, ss);
    case 8:
      return copy_strided_elements<uint64_t>(dst, src, n, ds, ss);
    default:
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(dst + i * ds, src + i * ss, static_cast<size_t>(r.bytes));
  }
}

uint32_t widest_access(uint64_t bits) {
  for (uint32_t v = 16; v > 1; v /= 2)
    if (bits % v == 0) return v;
  return 1;
}

}  // namespace

void CopyProgram::add(int64_t src, const Shape& src_strides, int64_t dst, const Shape& dst_strides,
                      const Shape& lengths, std::size_t itemsize) {
  if (src_strides.size() != lengths.size() || dst_strides.size() != lengths.size())
    fail(Errc::invalid_argument, "copy program: ", lengths.size(), " dims with ",
         src_strides.size(), " source and ", dst_strides.size(), " destination strides");
  for (int64_t n : lengths) {
    if (n < 0)
      fail(Errc::invalid_argument, "copy program: negative length in ", shape_str(lengths));
    if (n == 0) return;
  }
  const auto item = static_cast<int64_t>(itemsize);
  Dims d = normalize(src_strides, dst_strides, lengths, item);
  CopyRun run;
  run.src = src;
  run.dst = dst;
  run.bytes = item;
  // A dim dense on both sides becomes the run itself.
  if (!d.len.empty() && d.src.back() == item && d.dst.back() == item) {
    run.bytes = item * d.len.back();
    d.len.pop_back();
    d.src.pop_back();
    d.dst.pop_back();
  }
  // The innermost kCopyOuterDims dims go into the run; any outer ones are
  // enumerated into one run each (rare: merging leaves few dims).
  const size_t outer = d.len.size() > kCopyOuterDims ? d.len.size() - kCopyOuterDims : 0;
  for (size_t k = outer; k < d.len.size(); ++k) {
    const size_t slot = d.len.size() - 1 - k;
    run.count[slot] = d.len[k];
    run.src_stride[slot] = d.src[k];
    run.dst_stride[slot] = d.dst[k];
  }
  std::vector<int64_t> idx(outer, 0);
  while (true) {
    CopyRun r = run;
    for (size_t k = 0; k < outer; ++k) {
      r.src += idx[k] * d.src[k];
      r.dst += idx[k] * d.dst[k];
    }
    add_run(r);
    size_t k = outer;
    while (k > 0 && ++idx[k - 1] == d.len[k - 1]) idx[--k] = 0;
    if (k == 0) return;
  }
}

void CopyProgram::add_run(const CopyRun& run) {
  if (run.bytes <= 0 || run.rows() <= 0) return;
  runs_.push_back(run);
  bytes_ += run.total_bytes();
}

void execute_host(const CopyProgram& program, std::uintptr_t src_base, std::uintptr_t dst_base,
                  std::size_t first, std::size_t count) {
  const auto& runs = program.runs();
  first = std::min(first, runs.size());
  const size_t end = first + std::min(count, runs.size() - first);
  for (size_t i = first; i < end; ++i) {
    const CopyRun& r = runs[i];
    for (int64_t i2 = 0; i2 < r.count[2]; ++i2)
      for (int64_t i1 = 0; i1 < r.count[1]; ++i1) {
        const int64_t s = r.src + i1 * r.src_stride[1] + i2 * r.src_stride[2];
        const int64_t d = r.dst + i1 * r.dst_stride[1] + i2 * r.dst_stride[2];
        copy_row_family(reinterpret_cast<char*>(dst_base + static_cast<std::uintptr_t>(d)),
                        reinterpret_cast<const char*>(src_base + static_cast<std::uintptr_t>(s)),
                        r);
      }
  }
}

uint32_t run_vector_bytes(const CopyRun& run) {
  uint64_t bits = static_cast<uint64_t>(run.src) | static_cast<uint64_t>(run.dst) |
                  static_cast<uint64_t>(run.bytes);
  for (int k = 0; k < kCopyOuterDims; ++k)
    if (run.count[k] > 1)
      bits |= static_cast<uint64_t>(run.src_stride[k]) | static_cast<uint64_t>(run.dst_stride[k]);
  return widest_access(bits);
}

int64_t task_chunk_bytes(int64_t bytes, unsigned blocks) {
  constexpr int64_t kMin = int64_t{16} << 10, kMax = int64_t{256} << 10;
  const int64_t per_task = bytes / (4 * static_cast<int64_t>(std::max(1u, blocks)));
  return std::clamp((per_task + 15) / 16 * 16, kMin, kMax);
}

uint32_t transpose_tile_kind(const CopyRun& run) {
  // Tiles pay where a row is one element and both dims are long enough to
  // fill a warp's reads and writes.
  if (run.bytes != static_cast<int64_t>(run_vector_bytes(run)) || run.count[0] < 4 ||
      run.count[1] < 4)
    return 0;
  if (run.src_stride[0] == run.bytes && run.dst_stride[1] == run.bytes) return 1;
  if (run.src_stride[1] == run.bytes && run.dst_stride[0] == run.bytes) return 2;
  return 0;
}

std::vector<CopyTask> copy_tasks(const CopyProgram& program, int64_t chunk_bytes) {
  if (chunk_bytes < 16 || chunk_bytes % 16 != 0 || chunk_bytes > (int64_t{1} << 30))
    fail(Errc::invalid_argument, "copy tasks: chunk of ", chunk_bytes,
         " bytes (a multiple of 16 up to 1 GiB expected)");
  std::vector<CopyTask> tasks;
  const auto& runs = program.runs();
  for (size_t i = 0; i < runs.size(); ++i) {
    const CopyRun& r = runs[i];
    CopyTask t;
    t.run = static_cast<uint32_t>(i);
    t.vec = run_vector_bytes(r);
    const int64_t rows = r.rows();
    if (const uint32_t tile = transpose_tile_kind(r)) {
      t.tile = tile;
      t.offset = 0;
      t.vecs_per_row = 1;
      for (int64_t i2 = 0; i2 < r.count[2]; ++i2)
        for (int64_t i1 = 0; i1 < r.count[1]; i1 += kTileElements)
          for (int64_t i0 = 0; i0 < r.count[0]; i0 += kTileElements) {
            t.row = i0 + r.count[0] * (i1 + r.count[1] * i2);
            t.rows = static_cast<uint32_t>(std::min(kTileElements, r.count[0] - i0) *
                                           std::min(kTileElements, r.count[1] - i1));
            tasks.push_back(t);
          }
      continue;
    }
    if (r.bytes >= chunk_bytes) {
      // Each row in pieces of chunk_bytes (a multiple of every vec).
      for (int64_t row = 0; row < rows; ++row)
        for (int64_t off = 0; off < r.bytes; off += chunk_bytes) {
          t.row = row;
          t.offset = off;
          t.rows = 1;
          t.vecs_per_row = static_cast<uint32_t>(std::min(chunk_bytes, r.bytes - off) / t.vec);
          tasks.push_back(t);
        }
      continue;
    }
    const int64_t per_task = std::max<int64_t>(1, chunk_bytes / r.bytes);
    t.offset = 0;
    t.vecs_per_row = static_cast<uint32_t>(r.bytes / t.vec);
    for (int64_t row = 0; row < rows; row += per_task) {
      t.row = row;
      t.rows = static_cast<uint32_t>(std::min(per_task, rows - row));
      tasks.push_back(t);
    }
  }
  return tasks;
}

namespace {

// A tile task as copy_device.cuh runs it: its 256 threads as 32 lanes x 8
// rows, the tile through a buffer of kTileElements rows of
// kTileElements + 1 elements; each lane's load, then each lane's store.
void execute_tile_host(const CopyRun& r, const CopyTask& t, std::uintptr_t src_base,
                       std::uintptr_t dst_base) {
  constexpr int64_t T = kTileElements, kLanes = 32, kRows = 8;
  const int64_t i0s = t.row % r.count[0], rest = t.row / r.count[0];
  const int64_t i1s = rest % r.count[1], i2 = rest / r.count[1];
  const int64_t n0 = std::min(T, r.count[0] - i0s), n1 = std::min(T, r.count[1] - i1s);
  const auto e = static_cast<size_t>(t.vec);
  std::vector<unsigned char> tile(static_cast<size_t>(T * (T + 1)) * e);
  auto src = [&](int64_t i0, int64_t i1) {
    return reinterpret_cast<const char*>(
        src_base + static_cast<std::uintptr_t>(r.src + i0 * r.src_stride[0] + i1 * r.src_stride[1] +
                                               i2 * r.src_stride[2]));
  };
  auto dst = [&](int64_t i0, int64_t i1) {
    return reinterpret_cast<char*>(
        dst_base + static_cast<std::uintptr_t>(r.dst + i0 * r.dst_stride[0] + i1 * r.dst_stride[1] +
                                               i2 * r.dst_stride[2]));
  };
  auto cell = [&](int64_t a, int64_t b) { return tile.data() + (a * (T + 1) + b) * e; };
  // Loads: lanes along the source's contiguous dim.
  const int64_t load_rows = t.tile == 1 ? n1 : n0, load_lanes = t.tile == 1 ? n0 : n1;
  for (int64_t ty = 0; ty < kRows; ++ty)
    for (int64_t tx = 0; tx < kLanes; ++tx)
      for (int64_t y = ty; y < load_rows; y += kRows)
        if (tx < load_lanes)
          std::memcpy(cell(y, tx), t.tile == 1 ? src(i0s + tx, i1s + y) : src(i0s + y, i1s + tx),
                      e);
  // Stores: lanes along the destination's contiguous dim.
  for (int64_t ty = 0; ty < kRows; ++ty)
    for (int64_t tx = 0; tx < kLanes; ++tx)
      for (int64_t y = ty; y < load_lanes; y += kRows)
        if (tx < load_rows)
          std::memcpy(t.tile == 1 ? dst(i0s + y, i1s + tx) : dst(i0s + tx, i1s + y), cell(tx, y),
                      e);
}

}  // namespace

void execute_tasks_host(const CopyProgram& program, const std::vector<CopyTask>& tasks,
                        std::uintptr_t src_base, std::uintptr_t dst_base) {
  // The kernel's arithmetic (cuda/copy_kernel.cu), one "thread" at a time.
  for (const CopyTask& t : tasks) {
    const CopyRun& r = program.runs().at(t.run);
    if (t.tile != 0) {
      execute_tile_host(r, t, src_base, dst_base);
      continue;
    }
    const uint32_t n = t.rows * t.vecs_per_row;
    for (uint32_t j = 0; j < n; ++j) {
      const uint32_t row_in_task = j / t.vecs_per_row;
      const uint32_t col = j - row_in_task * t.vecs_per_row;
      const int64_t row = t.row + row_in_task;
      const int64_t i0 = row % r.count[0], rest = row / r.count[0];
      const int64_t i1 = rest % r.count[1], i2 = rest / r.count[1];
      const int64_t at = t.offset + static_cast<int64_t>(col) * t.vec;
      const int64_t s =
          r.src + i0 * r.src_stride[0] + i1 * r.src_stride[1] + i2 * r.src_stride[2] + at;
      const int64_t d =
          r.dst + i0 * r.dst_stride[0] + i1 * r.dst_stride[1] + i2 * r.dst_stride[2] + at;
      std::memcpy(reinterpret_cast<char*>(dst_base + static_cast<std::uintptr_t>(d)),
                  reinterpret_cast<const char*>(src_base + static_cast<std::uintptr_t>(s)), t.vec);
    }
  }
}

}  // namespace weightsync
