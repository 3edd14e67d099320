// The batched strided-copy kernel's interface (copy_kernel.cu), kept to plain
// structs so that nvcc compiles it without the library's C++20 headers. The
// tables come from copy_program.h (CopyRun, CopyTask) via gpu.cpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace weightsync::gpu::kernel {

struct Run {
  long long src, dst, bytes;
  long long count0, count1;  // count2 is implied by the task's rows
  long long src_stride[3], dst_stride[3];
};

struct Task {
  unsigned run, vec, rows, vecs_per_row, tile;  // tile: CopyTask::tile
  long long row, offset;
};

// The blocks of the copy kernel that fit on `device` at once (the grid bound:
// a persistent grid whose blocks stride over the tasks).
cudaError_t max_resident_blocks(int device, unsigned* blocks);

// One launch of `tasks` (indexing `runs`) on `stream`, reading at
// src_base + run.src and writing at dst_base + run.dst; both bases aligned to
// 16 bytes. `blocks` bounds the grid (the blocks stride over the tasks).
// Returns the launch's error (cudaGetLastError).
cudaError_t launch_copy(const Run* runs, const Task* tasks, unsigned num_tasks,
                        std::uintptr_t src_base, std::uintptr_t dst_base, unsigned blocks,
                        cudaStream_t stream);

}  // namespace weightsync::gpu::kernel
