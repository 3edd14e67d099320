// checksum64's arithmetic (weightsync/checksum.h), written once for the host
// (checksum.cpp) and for CUDA kernels (cuda/delta_kernel.cu, which hashes
// the chunks of a delta step's params on the device): the same bytes give
// the same value on either. Loads are the caller's (the host reads
// unaligned words, a kernel reads what its alignment allows); the values are
// always the little-endian words of the bytes.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define WEIGHTSYNC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define WEIGHTSYNC_HOST_DEVICE inline
#endif

namespace weightsync::checksum_core {

inline constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
inline constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
inline constexpr uint64_t kPrime3 = 0x165667B19E3779F9ULL;
inline constexpr uint64_t kPrime4 = 0x85EBCA77C2B2AE63ULL;

WEIGHTSYNC_HOST_DEVICE uint64_t rotl(uint64_t x, int r) {
  return (x << r) | (x >> (64 - r));
}

// One 8-byte word into a lane; four lanes take a 32-byte round.
WEIGHTSYNC_HOST_DEVICE uint64_t mix_lane(uint64_t lane, uint64_t input) {
  lane += input * kPrime2;
  return rotl(lane, 31) * kPrime1;
}

WEIGHTSYNC_HOST_DEVICE uint64_t avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kPrime2;
  h ^= h >> 29;
  h *= kPrime3;
  h ^= h >> 32;
  return h;
}

// The lanes' starting values (used when there are 32 bytes or more).
WEIGHTSYNC_HOST_DEVICE void start_lanes(uint64_t* lane, uint64_t seed) {
  lane[0] = seed + kPrime1 + kPrime2;
  lane[1] = seed + kPrime2;
  lane[2] = seed;
  lane[3] = seed - kPrime1;
}

// The hash before the lanes and the tail: the seed and the length.
WEIGHTSYNC_HOST_DEVICE uint64_t first_hash(uint64_t seed, std::size_t bytes) {
  return seed + kPrime4 + static_cast<uint64_t>(bytes) * kPrime3;
}

// The lanes into the hash, after the last round.
WEIGHTSYNC_HOST_DEVICE uint64_t merge_lanes(uint64_t h, const uint64_t* lane) {
  h ^= rotl(lane[0], 1) + rotl(lane[1], 7) + rotl(lane[2], 12) + rotl(lane[3], 18);
  for (int i = 0; i < 4; ++i) h = (h ^ mix_lane(0, lane[i])) * kPrime1 + kPrime4;
  return h;
}

// The tail after the rounds: whole words, then single bytes.
WEIGHTSYNC_HOST_DEVICE uint64_t tail_word(uint64_t h, uint64_t word) {
  return rotl(h ^ mix_lane(0, word), 27) * kPrime1 + kPrime4;
}
WEIGHTSYNC_HOST_DEVICE uint64_t tail_byte(uint64_t h, unsigned char byte) {
  return rotl(h ^ (uint64_t{byte} * kPrime4), 11) * kPrime1;
}

}  // namespace weightsync::checksum_core
