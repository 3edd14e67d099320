// FP8 block quantization on the GPU: one CUDA block per 128 x 128 block of a
// tile (QuantBlock); its threads take the block's maximum |x| (a reduction
// on the FP32 bits, which order as the values), then quantize every element
// with fp8_math.h's arithmetic, the host quantizer's, so both give the same
// bytes.
//
// Two paths, chosen per block (uniformly across its threads):
//  - the vector path, for a whole 128-column block of BF16 or F16 read from
//    one part with unit column stride, rows 16-byte aligned, codes written
//    with unit column stride at 8-byte aligned rows (every dense weight a
//    sender or an engine quantizes): each thread loads its 8 x 16 bytes once
//    into registers, the block reduces the maximum, then each thread writes
//    8 codes per load from the registers (one read of the source);
//  - the general path, any tile: elements found through the tile's parts
//    (one, or several where the tile was assembled from several places),
//    read twice.
// On sm_89 and later the vector path converts with the hardware's
// round-to-nearest-even, saturating E4M3 conversion (cvt.rn.satfinite), which
// equals e4m3_from_f32 for every finite input; a block holding an infinity or
// NaN takes e4m3_from_f32 (the hardware gives NaN there, the formula 448).
//
// launch_pack_quant runs a copy program and a quantize program as one launch
// (a sender's bucket: its packed items and its quantized items, which occupy
// disjoint bytes of the slot).
#include "quant_kernel.h"

#include "copy_device.cuh"
#include "core/fp8_math.h"

namespace weightsync::gpu::kernel {
namespace {

constexpr unsigned kThreads = 256;
constexpr int kBlock = 128;
constexpr unsigned kWarps = kThreads / 32;
static_assert(kThreads == copy_dev::kThreads, "the fused launch shares one block size");

// Vector path geometry: a row of 128 2-byte elements is 16 loads of 16 bytes;
// 256 threads cover 16 rows per pass, 8 passes the 128 rows.
constexpr int kVecsPerRow = kBlock * 2 / 16;
constexpr int kRowsPerPass = static_cast<int>(kThreads) / kVecsPerRow;
constexpr int kPasses = kBlock / kRowsPerPass;

__device__ __forceinline__ float load_source(int dtype, const char* at) {
  if (dtype == 2) return *reinterpret_cast<const float*>(at);
  const unsigned short h = *reinterpret_cast<const unsigned short*>(at);
  return dtype == 1 ? fp8::f16_to_f32(h) : fp8::bf16_to_f32(h);
}

__device__ __forceinline__ float half_to_f32(int dtype, unsigned short h) {
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

// The block's maximum of every thread's `m` (bits of |x|), in all threads.
__device__ __forceinline__ unsigned block_max(unsigned m, unsigned* shared) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned v = __shfl_xor_sync(0xFFFFFFFFu, m, o);
    m = v > m ? v : m;
  }
  if ((threadIdx.x & 31) == 0) shared[threadIdx.x / 32] = m;
  __syncthreads();
  m = shared[0];
#pragma unroll
  for (unsigned w = 1; w < kWarps; ++w) m = shared[w] > m ? shared[w] : m;
  return m;
}

// Two codes (lo, hi) as a little-endian pair.
__device__ __forceinline__ unsigned short e4m3x2(float lo, float hi, bool finite) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (finite) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
  }
#endif
  (void)finite;
  return static_cast<unsigned short>(fp8::e4m3_from_f32(lo) |
                                     (static_cast<unsigned>(fp8::e4m3_from_f32(hi)) << 8));
}

// The vector path's source and destination, or false where the block does
// not qualify.
__device__ __forceinline__ bool vector_block(const QuantTile& t, const QuantPart* parts, int c0,
                                             int bc, std::uintptr_t src_base,
                                             std::uintptr_t dst_base, const char** src,
                                             long long* src_rs, unsigned char** dst) {
  if (t.num_parts != 1 || t.src_dtype == 2 || bc != kBlock || t.dst_col_stride != 1) return false;
  const QuantPart& p = parts[t.first_part];
  if (p.col_stride != 1 || p.row0 != 0 || p.col0 != 0) return false;
  const std::uintptr_t s = (p.relative ? src_base : 0) + static_cast<std::uintptr_t>(p.src) +
                           static_cast<std::uintptr_t>(c0) * 2;
  const std::uintptr_t d = (t.relative ? dst_base : 0) + static_cast<std::uintptr_t>(t.dst) +
                           static_cast<std::uintptr_t>(c0);
  const long long rs = p.row_stride * 2;
  if (((s | static_cast<std::uintptr_t>(rs)) & 15) != 0) return false;
  if (((d | static_cast<std::uintptr_t>(t.dst_row_stride)) & 7) != 0) return false;
  *src = reinterpret_cast<const char*>(s);
  *src_rs = rs;
  *dst = reinterpret_cast<unsigned char*>(d);
  return true;
}

__device__ __forceinline__ void store_scale(const QuantTile& t, const QuantBlock& b,
                                            std::uintptr_t dst_base, float scale) {
  const std::uintptr_t at = (t.relative ? dst_base : 0) + static_cast<std::uintptr_t>(t.scale) +
                            static_cast<std::uintptr_t>(b.block * t.scale_stride * 4);
  *reinterpret_cast<float*>(at) = scale;
}

__device__ __forceinline__ void quant_vector(const QuantTile& t, const QuantBlock& b,
                                             const char* src, long long src_rs, unsigned char* dst,
                                             std::uintptr_t dst_base, unsigned* shared) {
  const int col = static_cast<int>(threadIdx.x) % kVecsPerRow;  // 16-byte vector in the row
  const int row0 = static_cast<int>(threadIdx.x) / kVecsPerRow;
  uint4 v[kPasses];
  unsigned m = 0;
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const int r = row0 + k * kRowsPerPass;
    v[k] = r < t.rows ? __ldg(reinterpret_cast<const uint4*>(src + r * src_rs) + col)
                      : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const unsigned w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const unsigned a = fp8::abs_bits_f32(half_to_f32(t.src_dtype, w[j] & 0xFFFFu));
      const unsigned c = fp8::abs_bits_f32(half_to_f32(t.src_dtype, w[j] >> 16));
      m = a > m ? a : m;
      m = c > m ? c : m;
    }
  }
  const unsigned amax = block_max(m, shared);
  const float scale = fp8::block_scale(fp8::bits_f32(amax), t.ue8m0 != 0);
  const float inv = 1.0f / scale;
  const bool finite = amax < 0x7F800000u;
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const int r = row0 + k * kRowsPerPass;
    if (r >= t.rows) continue;
    const unsigned w[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
    unsigned out[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const unsigned lo = e4m3x2(half_to_f32(t.src_dtype, w[2 * j] & 0xFFFFu) * inv,
                                 half_to_f32(t.src_dtype, w[2 * j] >> 16) * inv, finite);
      const unsigned hi = e4m3x2(half_to_f32(t.src_dtype, w[2 * j + 1] & 0xFFFFu) * inv,
                                 half_to_f32(t.src_dtype, w[2 * j + 1] >> 16) * inv, finite);
      out[j] = lo | (hi << 16);
    }
    *reinterpret_cast<uint2*>(dst + r * t.dst_row_stride + col * 8) = make_uint2(out[0], out[1]);
  }
  if (threadIdx.x == 0) store_scale(t, b, dst_base, scale);
}

__device__ __forceinline__ void quant_general(const QuantTile& t, const QuantBlock& b,
                                              const QuantPart* parts, int c0, int bc,
                                              std::uintptr_t src_base, std::uintptr_t dst_base,
                                              unsigned* shared) {
  const int n = t.rows * bc;
  unsigned m = 0;
  for (int e = threadIdx.x; e < n; e += kThreads) {
    const unsigned v = fp8::abs_bits_f32(element(t, parts, e / bc, c0 + e % bc, src_base));
    m = v > m ? v : m;
  }
  const float scale = fp8::block_scale(fp8::bits_f32(block_max(m, shared)), t.ue8m0 != 0);
  const float inv = 1.0f / scale;
  const std::uintptr_t dst = (t.relative ? dst_base : 0) + static_cast<std::uintptr_t>(t.dst);
  for (int e = threadIdx.x; e < n; e += kThreads) {
    const int r = e / bc, c = c0 + e % bc;
    *reinterpret_cast<unsigned char*>(dst + r * t.dst_row_stride + c * t.dst_col_stride) =
        fp8::e4m3_from_f32(element(t, parts, r, c, src_base) * inv);
  }
  if (threadIdx.x == 0) store_scale(t, b, dst_base, scale);
}

// Quantizes block `b` (every thread of the CUDA block calls it).
__device__ __forceinline__ void quant_one(const QuantTile* __restrict__ tiles,
                                          const QuantPart* __restrict__ parts, const QuantBlock b,
                                          std::uintptr_t src_base, std::uintptr_t dst_base) {
  __shared__ unsigned shared[kWarps];
  const QuantTile t = tiles[b.tile];
  const int c0 = static_cast<int>(b.block) * kBlock;
  const int bc = t.cols - c0 < kBlock ? t.cols - c0 : kBlock;
  const char* src = nullptr;
  long long src_rs = 0;
  unsigned char* dst = nullptr;
  if (vector_block(t, parts, c0, bc, src_base, dst_base, &src, &src_rs, &dst))
    quant_vector(t, b, src, src_rs, dst, dst_base, shared);
  else
    quant_general(t, b, parts, c0, bc, src_base, dst_base, shared);
}

__global__ void __launch_bounds__(kThreads)
    quant_kernel(const QuantTile* __restrict__ tiles, const QuantPart* __restrict__ parts,
                 const QuantBlock* __restrict__ blocks, std::uintptr_t src_base,
                 std::uintptr_t dst_base) {
  quant_one(tiles, parts, blocks[blockIdx.x], src_base, dst_base);
}

// The first `q.num_blocks` CUDA blocks quantize, one 128 x 128 block each; the
// others share the copy program's tasks.
__global__ void __launch_bounds__(kThreads)
    pack_quant_kernel(const Run* __restrict__ runs, const Task* __restrict__ tasks,
                      unsigned num_tasks, std::uintptr_t copy_src, std::uintptr_t copy_dst,
                      QuantArgs q) {
  if (blockIdx.x < q.num_blocks) {
    quant_one(q.tiles, q.parts, q.blocks[blockIdx.x], q.src_base, q.dst_base);
    return;
  }
  copy_dev::run_tasks(runs, tasks, num_tasks, blockIdx.x - q.num_blocks, gridDim.x - q.num_blocks,
                      copy_src, copy_dst);
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

cudaError_t launch_pack_quant(const Run* runs, const Task* tasks, unsigned num_tasks,
                              std::uintptr_t copy_src, std::uintptr_t copy_dst,
                              unsigned copy_blocks, const QuantArgs& q, cudaStream_t stream) {
  if (q.num_blocks == 0)
    return launch_copy(runs, tasks, num_tasks, copy_src, copy_dst, copy_blocks, stream);
  const unsigned copy_grid = num_tasks == 0 ? 0 : copy_blocks < num_tasks ? copy_blocks : num_tasks;
  if (q.num_blocks > 0x7FFFFFFFu - copy_grid) return cudaErrorInvalidConfiguration;
  (void)cudaGetLastError();  // speak of this launch only
  pack_quant_kernel<<<q.num_blocks + copy_grid, kThreads, 0, stream>>>(runs, tasks, num_tasks,
                                                                       copy_src, copy_dst, q);
  return cudaGetLastError();
}

}  // namespace weightsync::gpu::kernel
