// checksum64 (weightsync/checksum.h) of bytes that come in pieces, in order:
// the same value as one checksum64 call over all of them, whatever the
// pieces' sizes. The delta codec (core/delta.h) hashes each chunk while it
// is in cache, so that the digest of a delta step costs no read of its own.
#pragma once

#include <cstddef>
#include <cstdint>

namespace weightsync {

class Checksum64Stream {
 public:
  // `total`: the bytes that will come, all of them (checksum64 mixes the
  // length in first).
  Checksum64Stream(uint64_t seed, std::size_t total) noexcept;
  void update(const void* data, std::size_t bytes) noexcept;
  // checksum64(all the bytes, total, seed); the bytes must have come.
  uint64_t finish() const noexcept;

 private:
  uint64_t seed_;
  std::size_t total_;
  uint64_t lane_[4];
  unsigned char pending_[32];  // bytes short of a 32-byte round
  std::size_t pending_bytes_ = 0;
};

}  // namespace weightsync
