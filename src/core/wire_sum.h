// The bucket checksum on the wire (pipeline/wire.h), built to be computed
// inside the copies that pack and apply a bucket rather than by a read of
// its own.
//
// The bytes are read as 32-bit little-endian words w_i (word i: bytes
// [4i, 4i + 4), a last partial word padded with zeros) and summed twice,
// mod 2^64: a = sum(w_i) and b = sum(i * w_i). Both sums are linear in every
// byte at a known position, so any piece of the string, at any position and
// in any order (a strided run, a transposed element, a fragment received
// straight into a param), adds its own part: a copy loop keeps two running
// sums per lane at memcpy speed, where a hash needs the bytes in order.
//
// What it catches (the wire's faults are flipped, torn, short or misplaced
// bytes, not an adversary): any change confined to one word (a changes by
// the word's difference, never 0 mod 2^64), any change of two words (a
// cancels only when the differences are opposite, and then b changes by
// difference * distance, below 2^64 in magnitude), so any swap of two
// words; other changes go unseen with a chance of about 2^-64 after the
// digest mixes (a, b) with the length and a seed.
#pragma once

#include <cstddef>
#include <cstdint>

namespace weightsync {

// The two sums of some bytes of a string (see above).
struct WireSum {
  uint64_t a = 0;
  uint64_t b = 0;

  WireSum& operator+=(const WireSum& o) noexcept {
    a += o.a;
    b += o.b;
    return *this;
  }
  friend bool operator==(const WireSum&, const WireSum&) = default;
};

// The sums of the `bytes` bytes at `data`, which lie at byte `position` of
// the string.
WireSum wire_sum(const void* data, std::size_t bytes, uint64_t position) noexcept;

// Copies `bytes` bytes from `src` to `dst` (not overlapping) and returns
// wire_sum of them at `position`: one pass over the bytes.
WireSum copy_wire_sum(void* dst, const void* src, std::size_t bytes, uint64_t position) noexcept;

// The same for `count` elements of `element` bytes (1, 2, 4 or 8), element
// j read at src + j * src_stride and written at dst + j * dst_stride; it
// lies at position + j * position_stride of the string.
WireSum copy_wire_sum_elements(char* dst, const char* src, int64_t count, std::size_t element,
                               int64_t dst_stride, int64_t src_stride, uint64_t position,
                               int64_t position_stride) noexcept;

// The checksum of a whole string of `total` bytes whose sums are `sums`,
// for `seed` (the step). Never 0, which the wire keeps for "not computed"
// (a side whose bytes are in device memory).
uint64_t wire_digest(const WireSum& sums, uint64_t total, uint64_t seed) noexcept;

// wire_digest of `bytes` bytes at `data` (the whole string).
inline uint64_t wire_checksum(const void* data, std::size_t bytes, uint64_t seed) noexcept {
  return wire_digest(wire_sum(data, bytes, 0), bytes, seed);
}

}  // namespace weightsync
