// The delta apply kernels' interface (delta_kernel.cu): they execute the
// tables core/delta.h builds and checks on the CPU (delta::patch_table,
// delta::hash_table; delta::execute_patch_host and execute_hash_host are
// the same arithmetic on the host, which the CPU tests check).
#pragma once

#include "core/delta_tables.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace weightsync::gpu::kernel {

// Patches the memory at target_base + chunk.dst from the frame at
// frame_base + chunk.table / chunk.values, a block per chunk (grid-stride,
// at most `blocks` blocks).
cudaError_t launch_delta_patch(const delta::PatchChunk* chunks, unsigned num_chunks,
                               std::uintptr_t frame_base, std::uintptr_t target_base,
                               unsigned blocks, cudaStream_t stream);

// Adds the checksum64 of each chunk (its bytes at target_base + chunk.dst,
// its seed) to *sum (device memory), a thread per chunk.
cudaError_t launch_delta_hash(const delta::HashChunk* chunks, unsigned num_chunks,
                              std::uintptr_t target_base, unsigned long long* sum,
                              cudaStream_t stream);

}  // namespace weightsync::gpu::kernel
