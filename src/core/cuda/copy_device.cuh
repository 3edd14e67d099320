// The copy kernel's device code (copy_kernel.cu), shared with the fused
// pack-and-quantize launch (quant_kernel.cu): a block's share of a copy
// program's tasks, taken in turn from `first` with stride `stride`.
#pragma once

#include "copy_kernel.h"

namespace weightsync::gpu::kernel::copy_dev {

constexpr unsigned kThreads = 256;
constexpr unsigned kUnroll = 4;  // independent loads in flight per thread

struct alignas(16) V16 {
  unsigned long long a, b;
};

// Where row `row` (flattened (i0, i1, i2), i0 fastest) starts on each side.
struct RowStart {
  long long src, dst;
};

__device__ __forceinline__ RowStart row_start(const Run& r, long long row) {
  long long i0 = row, i1 = 0, i2 = 0;
  if (row >= r.count0) {  // most tasks lie in the first count0 rows: no division
    i0 = row % r.count0;
    const long long rest = row / r.count0;
    i1 = rest % r.count1;
    i2 = rest / r.count1;
  }
  return {r.src + i0 * r.src_stride[0] + i1 * r.src_stride[1] + i2 * r.src_stride[2],
          r.dst + i0 * r.dst_stride[0] + i1 * r.dst_stride[1] + i2 * r.dst_stride[2]};
}

// One row's [offset, offset + n * sizeof(T)): loads kUnroll apart first, then
// the stores, so that several loads are in flight.
template <class T>
__device__ __forceinline__ void copy_row(const char* src, char* dst, unsigned n) {
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  unsigned j = threadIdx.x;
  for (; j + (kUnroll - 1) * kThreads < n; j += kUnroll * kThreads) {
    T v[kUnroll];
#pragma unroll
    for (unsigned u = 0; u < kUnroll; ++u) v[u] = s[j + u * kThreads];
#pragma unroll
    for (unsigned u = 0; u < kUnroll; ++u) d[j + u * kThreads] = v[u];
  }
  for (; j < n; j += kThreads) d[j] = s[j];
}

constexpr unsigned kTile = 32;  // kTileElements (copy_program.h)
constexpr unsigned kTileRows = kThreads / kTile;

// A transpose tile (CopyTask::tile): the threads as kTile lanes x kTileRows
// rows load it with lanes along the source's contiguous dim into `tile`
// (kTile rows of kTile + 1 elements: no bank conflicts on the way out),
// then store it with lanes along the destination's, so that a warp reads
// and writes consecutive elements. execute_tasks_host runs the same loops.
template <class T>
__device__ void run_tile(const Run& r, const Task& t, std::uintptr_t src_base,
                         std::uintptr_t dst_base, T* tile) {
  const long long i0s = t.row % r.count0, rest = t.row / r.count0;
  const long long i1s = rest % r.count1, i2 = rest / r.count1;
  const long long n0 = min(static_cast<long long>(kTile), r.count0 - i0s);
  const long long n1 = min(static_cast<long long>(kTile), r.count1 - i1s);
  const long long src0 =
      r.src + i0s * r.src_stride[0] + i1s * r.src_stride[1] + i2 * r.src_stride[2];
  const long long dst0 =
      r.dst + i0s * r.dst_stride[0] + i1s * r.dst_stride[1] + i2 * r.dst_stride[2];
  const unsigned tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  const bool src_along_0 = t.tile == 1;
  const long long load_rows = src_along_0 ? n1 : n0, load_lanes = src_along_0 ? n0 : n1;
  if (tx < load_lanes)
    for (long long y = ty; y < load_rows; y += kTileRows) {
      const long long i0 = src_along_0 ? tx : y, i1 = src_along_0 ? y : tx;
      tile[y * (kTile + 1) + tx] = *reinterpret_cast<const T*>(
          src_base + src0 + i0 * r.src_stride[0] + i1 * r.src_stride[1]);
    }
  __syncthreads();
  if (tx < load_rows)
    for (long long y = ty; y < load_lanes; y += kTileRows) {
      const long long i0 = src_along_0 ? y : tx, i1 = src_along_0 ? tx : y;
      *reinterpret_cast<T*>(dst_base + dst0 + i0 * r.dst_stride[0] + i1 * r.dst_stride[1]) =
          tile[tx * (kTile + 1) + y];
    }
}

template <class T>
__device__ void run_task(const Run& r, const Task& t, std::uintptr_t src_base,
                         std::uintptr_t dst_base, void* tile) {
  if (t.tile != 0) return run_tile<T>(r, t, src_base, dst_base, static_cast<T*>(tile));
  if (t.rows == 1) {
    const RowStart at = row_start(r, t.row);
    copy_row<T>(reinterpret_cast<const char*>(src_base + at.src + t.offset),
                reinterpret_cast<char*>(dst_base + at.dst + t.offset), t.vecs_per_row);
    return;
  }
  // Many small rows: every thread takes (row, vector) pairs.
  const unsigned n = t.rows * t.vecs_per_row;
  for (unsigned j = threadIdx.x; j < n; j += kThreads) {
    const unsigned in_task = j / t.vecs_per_row;
    const unsigned col = j - in_task * t.vecs_per_row;
    const RowStart at = row_start(r, t.row + in_task);
    const long long off = t.offset + static_cast<long long>(col) * sizeof(T);
    *reinterpret_cast<T*>(dst_base + at.dst + off) =
        *reinterpret_cast<const T*>(src_base + at.src + off);
  }
}

// Tasks first, first + stride, ... of the program; every thread of the block
// calls it (it synchronizes the block).
__device__ __forceinline__ void run_tasks(const Run* __restrict__ runs,
                                          const Task* __restrict__ tasks, unsigned num_tasks,
                                          unsigned first, unsigned stride, std::uintptr_t src_base,
                                          std::uintptr_t dst_base) {
  __shared__ Task task;
  __shared__ Run run;
  __shared__ V16 tile[kTile * (kTile + 1)];  // a transpose tile's elements (run_tile)
  for (unsigned i = first; i < num_tasks; i += stride) {
    if (threadIdx.x == 0) {
      task = tasks[i];
      run = runs[task.run];
    }
    __syncthreads();
    switch (task.vec) {  // uniform across the block: no divergence
      case 16:
        run_task<V16>(run, task, src_base, dst_base, tile);
        break;
      case 8:
        run_task<unsigned long long>(run, task, src_base, dst_base, tile);
        break;
      case 4:
        run_task<unsigned>(run, task, src_base, dst_base, tile);
        break;
      case 2:
        run_task<unsigned short>(run, task, src_base, dst_base, tile);
        break;
      default:
        run_task<unsigned char>(run, task, src_base, dst_base, tile);
    }
    __syncthreads();  // the next task overwrites the shared copies
  }
}

}  // namespace weightsync::gpu::kernel::copy_dev
