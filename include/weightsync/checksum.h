// A fast 64-bit, non-cryptographic checksum for buckets on the wire. It guards
// against corruption and mis-delivery (a wrong buffer, a torn write, a flipped
// byte), not against an adversary. The same bytes always give the same value on
// every host (little-endian reads are explicit).
#pragma once

#include <cstddef>
#include <cstdint>

namespace weightsync {

// The checksum of `bytes` bytes at `data`; `seed` separates uses (e.g. steps).
uint64_t checksum64(const void* data, std::size_t bytes, uint64_t seed = 0) noexcept;

// Folds the checksum of one more bucket into a step's running value. Order
// independent: the engine sums buckets in whatever order they land and the
// trainers' side gets the same total.
inline uint64_t checksum_fold(uint64_t total, uint64_t bucket) noexcept {
  return total + bucket;
}

// How a bucket travels (publisher <-> subscriber): its payload followed by an
// 8-byte little-endian trailer holding checksum64(payload, bytes, step), so
// one message carries both and a flipped byte anywhere is caught.
inline constexpr std::size_t kBucketTrailerBytes = 8;

// The transport tag of bucket `bucket` of `step`; part 0 is the bucket itself,
// part 1 a broadcast gather part on its way to the root. The step rides in the
// tag so that a message of an aborted step never matches a later receive.
// Below 2^47: fits every backend's tag space (UCX keeps 48 bits).
inline uint64_t bucket_tag(int64_t step, int32_t bucket, int part) noexcept {
  return ((static_cast<uint64_t>(step) & 0x7FFF) << 32) | (static_cast<uint64_t>(bucket) << 1) |
         static_cast<uint64_t>(part & 1);
}

}  // namespace weightsync
