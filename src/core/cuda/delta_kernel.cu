// Applies delta frames on the device (docs/delta.md): the patch kernel
// writes each changed chunk's new elements into the params (a block per
// chunk; a list's elements and a dense chunk's bytes spread over its
// threads, a runs record's values found by a scan of the run lengths), the
// hash kernel computes the digest the engine checks (a thread per chunk of
// 4096 elements, checksum64 from checksum_core.h: the host's value). Every
// table entry was checked on the CPU (delta::patch_table): nothing here
// checks or decides.
#include "core/checksum_core.h"
#include "delta_kernel.h"

namespace weightsync::gpu::kernel {
namespace {

constexpr unsigned kPatchThreads = 256;
constexpr unsigned kHashThreads = 128;
// Runs are apart (a gap between two), so a chunk of 4096 elements holds at
// most 2048 of them (delta.h).
constexpr unsigned kMaxRuns = 2048;

__device__ __forceinline__ unsigned get_u16(const unsigned char* p) {
  return static_cast<unsigned>(p[0]) | (static_cast<unsigned>(p[1]) << 8);
}

__device__ __forceinline__ void copy_element(unsigned char* dst, const unsigned char* src,
                                             unsigned e) {
  for (unsigned b = 0; b < e; ++b) dst[b] = src[b];
}

// A block copies `n` bytes, in words where both ends allow.
__device__ void copy_bytes(unsigned char* dst, const unsigned char* src, unsigned long long n) {
  const auto a = reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src);
  if (((a | n) & 15) == 0) {
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    for (unsigned long long i = threadIdx.x; i < n / 16; i += blockDim.x) d[i] = s[i];
  } else if (((a | n) & 3) == 0) {
    auto* d = reinterpret_cast<unsigned*>(dst);
    const auto* s = reinterpret_cast<const unsigned*>(src);
    for (unsigned long long i = threadIdx.x; i < n / 4; i += blockDim.x) d[i] = s[i];
  } else {
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
}

__global__ void __launch_bounds__(kPatchThreads)
    delta_patch_kernel(const delta::PatchChunk* __restrict__ chunks, unsigned num_chunks,
                       std::uintptr_t frame_base, std::uintptr_t target_base) {
  __shared__ unsigned start[kMaxRuns];       // a runs record: each run's first element
  __shared__ unsigned before[kMaxRuns + 1];  // and the values of the runs before it
  __shared__ unsigned group[kPatchThreads];  // the values of each thread's runs, then scanned
  for (unsigned c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const delta::PatchChunk k = chunks[c];
    const auto* table = reinterpret_cast<const unsigned char*>(frame_base + k.table);
    const auto* values = reinterpret_cast<const unsigned char*>(frame_base + k.values);
    auto* dst = reinterpret_cast<unsigned char*>(target_base + k.dst);
    const unsigned e = k.element_bytes;
    if (k.kind == 3) {  // dense
      copy_bytes(dst, values, static_cast<unsigned long long>(k.elements) * e);
    } else if (k.kind == 1) {  // list
      for (unsigned j = threadIdx.x; j < k.count; j += blockDim.x)
        copy_element(dst + get_u16(table + 2 * j) * e, values + j * e, e);
    } else if (k.kind == 2) {  // runs: each thread a contiguous group of runs
      const unsigned per = (k.count + blockDim.x - 1) / blockDim.x;
      const unsigned lo = min(threadIdx.x * per, k.count);
      const unsigned hi = min(lo + per, k.count);
      unsigned sum = 0;
      for (unsigned j = lo; j < hi; ++j) {
        start[j] = get_u16(table + 4 * j);
        sum += get_u16(table + 4 * j + 2);
      }
      group[threadIdx.x] = sum;
      __syncthreads();
      for (unsigned step = 1; step < blockDim.x; step <<= 1) {  // inclusive scan of the groups
        const unsigned add = threadIdx.x >= step ? group[threadIdx.x - step] : 0;
        __syncthreads();
        group[threadIdx.x] += add;
        __syncthreads();
      }
      unsigned at = threadIdx.x > 0 ? group[threadIdx.x - 1] : 0;
      for (unsigned j = lo; j < hi; ++j) {
        before[j] = at;
        at += get_u16(table + 4 * j + 2);
      }
      const unsigned total = group[blockDim.x - 1];
      __syncthreads();
      // Each value finds its run: the last whose values start at or before it.
      for (unsigned v = threadIdx.x; v < total; v += blockDim.x) {
        unsigned a = 0, b = k.count - 1;
        while (a < b) {
          const unsigned m = (a + b + 1) / 2;
          if (before[m] <= v)
            a = m;
          else
            b = m - 1;
        }
        copy_element(dst + (start[a] + (v - before[a])) * e, values + v * e, e);
      }
    }
    __syncthreads();  // the shared tables are the next chunk's
  }
}

__device__ __forceinline__ uint64_t load_word(const unsigned char* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint64_t*>(p);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

__global__ void __launch_bounds__(kHashThreads)
    delta_hash_kernel(const delta::HashChunk* __restrict__ chunks, unsigned num_chunks,
                      std::uintptr_t target_base, unsigned long long* sum) {
  using namespace checksum_core;
  for (unsigned c = blockIdx.x * blockDim.x + threadIdx.x; c < num_chunks;
       c += gridDim.x * blockDim.x) {
    const delta::HashChunk k = chunks[c];
    const auto* p = reinterpret_cast<const unsigned char*>(target_base + k.dst);
    const unsigned char* const end = p + k.bytes;
    const bool aligned = (reinterpret_cast<std::uintptr_t>(p) & 7) == 0;
    uint64_t lane[4] = {0, 0, 0, 0};
    const bool rounds = k.bytes >= 32;
    if (rounds) {
      start_lanes(lane, k.seed);
      for (; end - p >= 32; p += 32) {
        lane[0] = mix_lane(lane[0], load_word(p, aligned));
        lane[1] = mix_lane(lane[1], load_word(p + 8, aligned));
        lane[2] = mix_lane(lane[2], load_word(p + 16, aligned));
        lane[3] = mix_lane(lane[3], load_word(p + 24, aligned));
      }
    }
    uint64_t h = first_hash(k.seed, static_cast<std::size_t>(k.bytes));
    if (rounds) h = merge_lanes(h, lane);
    for (; end - p >= 8; p += 8) h = tail_word(h, load_word(p, aligned));
    for (; p < end; ++p) h = tail_byte(h, *p);
    atomicAdd(sum, static_cast<unsigned long long>(avalanche(h)));
  }
}

}  // namespace

cudaError_t launch_delta_patch(const delta::PatchChunk* chunks, unsigned num_chunks,
                               std::uintptr_t frame_base, std::uintptr_t target_base,
                               unsigned blocks, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  const unsigned grid = blocks > 0 && blocks < num_chunks ? blocks : num_chunks;
  (void)cudaGetLastError();  // speak of this launch only (copy_kernel.cu)
  delta_patch_kernel<<<grid, kPatchThreads, 0, stream>>>(chunks, num_chunks, frame_base,
                                                         target_base);
  return cudaGetLastError();
}

cudaError_t launch_delta_hash(const delta::HashChunk* chunks, unsigned num_chunks,
                              std::uintptr_t target_base, unsigned long long* sum,
                              cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  const unsigned grid = (num_chunks + kHashThreads - 1) / kHashThreads;
  (void)cudaGetLastError();
  delta_hash_kernel<<<grid, kHashThreads, 0, stream>>>(chunks, num_chunks, target_base, sum);
  return cudaGetLastError();
}

}  // namespace weightsync::gpu::kernel
