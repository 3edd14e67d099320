// The FP8 block quantizer's kernel interface (quant_kernel.cu), plain structs
// so that nvcc compiles it without the library's C++20 headers. The tables
// come from core/fp8.h's QuantProgram (tiles and parts) via gpu_cuda.cpp;
// the arithmetic is fp8_math.h's, shared word for word with the host.
#pragma once

#include "copy_kernel.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace weightsync::gpu::kernel {

struct QuantPart {
  long long src, row_stride, col_stride;  // bytes; strides in source elements
  int row0, rows, col0, cols;
  int relative;  // src is an offset from the source base
};

struct QuantTile {
  long long dst, dst_row_stride, dst_col_stride;  // bytes
  long long scale, scale_stride;                  // bytes; stride in F32 elements
  int rows, cols;
  unsigned first_part, num_parts;
  int src_dtype;  // 0 BF16, 1 F16, 2 F32
  int ue8m0;
  int relative;  // dst and scale are offsets from the destination base
};

// One CUDA block's work: column block `block` of tile `tile`.
struct QuantBlock {
  unsigned tile, block;
};

// One launch quantizing every block of `blocks`. Returns cudaGetLastError.
cudaError_t launch_quant(const QuantTile* tiles, const QuantPart* parts, const QuantBlock* blocks,
                         unsigned num_blocks, std::uintptr_t src_base, std::uintptr_t dst_base,
                         cudaStream_t stream);

// A quantize program's tables on the device and its bases, for the fused
// launch.
struct QuantArgs {
  const QuantTile* tiles = nullptr;
  const QuantPart* parts = nullptr;
  const QuantBlock* blocks = nullptr;
  unsigned num_blocks = 0;
  std::uintptr_t src_base = 0, dst_base = 0;
};

// One launch running the copy program (runs, tasks: launch_copy's, on at most
// `copy_blocks` CUDA blocks) and every block of `q`, which must write bytes
// the copy neither reads nor writes. Returns cudaGetLastError.
cudaError_t launch_pack_quant(const Run* runs, const Task* tasks, unsigned num_tasks,
                              std::uintptr_t copy_src, std::uintptr_t copy_dst,
                              unsigned copy_blocks, const QuantArgs& q, cudaStream_t stream);

}  // namespace weightsync::gpu::kernel
