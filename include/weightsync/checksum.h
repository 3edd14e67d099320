// A fast 64-bit, non-cryptographic checksum for buckets on the wire (the
// wire format itself, its tags and trailer, is src/pipeline/wire.h). It guards
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

}  // namespace weightsync
