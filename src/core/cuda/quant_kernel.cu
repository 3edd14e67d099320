// FP8 block quantization on the GPU: one CUDA block per 128 x 128 block of a
// tile (QuantBlock); its threads take the block's maximum |x| (a reduction
// on the FP32 bits, which order as the values), then quantize every element
// with fp8_math.h's arithmetic, the host quantizer's, so both give the same
// bytes. Elements are found through the tile's parts (one, or several where
// the tile was assembled from several places).
#include "quant_kernel.h"

#include "core/fp8_math.h"

namespace weightsync::gpu::kernel {
namespace {

constexpr unsigned kThreads = 256;
constexpr int kBlock = 128;

__device__ __forceinline__ float load_source(int dtype, const char* at) {
  if (dtype == 2) return *reinterpret_cast<const float*>(at);
  const unsigned short h = *reinterpret_cast<const unsigned short*>(at);
  return dtype == 1 ? fp8::f16_to_f32(h) : fp8::bf16_to_f32(h);
}

// Element (r, c) of the tile through the part that holds it.
__device__ __forceinline__ float element(const QuantTile& t, const QuantPart* parts, int r, int c,
                                         std::uintptr_t src_base) {
  const long long item = t.src_dtype == 2 ? 4 : 2;
  for (unsigned i = 0; i < t.num_parts; ++i) {
    const QuantPart& p = parts[t.first_part + i];
    if (r < p.row0 || r >= p.row0 + p.rows || c < p.col0 || c >= p.col0 + p.cols) continue;
    const std::uintptr_t base = (p.relative ? src_base : 0) + static_cast<std::uintptr_t>(p.src);
    const long long off = ((r - p.row0) * p.row_stride + (c - p.col0) * p.col_stride) * item;
    return load_source(t.src_dtype, reinterpret_cast<const char*>(base + off));
  }
  return 0.0f;  // unreachable: the parts cover the tile (QuantProgram::add)
}

__global__ void __launch_bounds__(kThreads)
    quant_kernel(const QuantTile* __restrict__ tiles, const QuantPart* __restrict__ parts,
                 const QuantBlock* __restrict__ blocks, std::uintptr_t src_base,
                 std::uintptr_t dst_base) {
  __shared__ unsigned amax[kThreads];
  const QuantBlock b = blocks[blockIdx.x];
  const QuantTile t = tiles[b.tile];
  const int c0 = static_cast<int>(b.block) * kBlock;
  const int bc = t.cols - c0 < kBlock ? t.cols - c0 : kBlock;
  const int n = t.rows * bc;
  unsigned m = 0;
  for (int e = threadIdx.x; e < n; e += kThreads) {
    const unsigned v = fp8::abs_bits_f32(element(t, parts, e / bc, c0 + e % bc, src_base));
    m = v > m ? v : m;
  }
  amax[threadIdx.x] = m;
  __syncthreads();
  for (unsigned s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s && amax[threadIdx.x + s] > amax[threadIdx.x])
      amax[threadIdx.x] = amax[threadIdx.x + s];
    __syncthreads();
  }
  const float scale = fp8::block_scale(fp8::bits_f32(amax[0]), t.ue8m0 != 0);
  const float inv = 1.0f / scale;
  const std::uintptr_t dst = (t.relative ? dst_base : 0) + static_cast<std::uintptr_t>(t.dst);
  for (int e = threadIdx.x; e < n; e += kThreads) {
    const int r = e / bc, c = c0 + e % bc;
    *reinterpret_cast<unsigned char*>(dst + r * t.dst_row_stride + c * t.dst_col_stride) =
        fp8::e4m3_from_f32(element(t, parts, r, c, src_base) * inv);
  }
  if (threadIdx.x == 0) {
    const std::uintptr_t at = (t.relative ? dst_base : 0) + static_cast<std::uintptr_t>(t.scale) +
                              static_cast<std::uintptr_t>(b.block * t.scale_stride * 4);
    *reinterpret_cast<float*>(at) = scale;
  }
}

}  // namespace

cudaError_t launch_quant(const QuantTile* tiles, const QuantPart* parts, const QuantBlock* blocks,
                         unsigned num_blocks, std::uintptr_t src_base, std::uintptr_t dst_base,
                         cudaStream_t stream) {
  if (num_blocks == 0) return cudaSuccess;
  (void)cudaGetLastError();  // speak of this launch only
  quant_kernel<<<num_blocks, kThreads, 0, stream>>>(tiles, parts, blocks, src_base, dst_base);
  return cudaGetLastError();
}

}  // namespace weightsync::gpu::kernel
