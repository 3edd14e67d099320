// The body of a string moves 32 bytes per round as two 16-byte vectors; each
// vector's four words feed four lanes of (a, s) sums, s accumulating a after
// every round (Fletcher's recurrence), so a round is a handful of vector
// adds beside its loads and stores and runs at copy speed. The lanes' sums
// turn into (a, b) at the end: lane l sees words l, l + 8, ... of its body,
// and sum(k * w_(8k + l)) over its K rounds is K * a_l - s_l.
#include "core/wire_sum.h"

#include "core/checksum_core.h"

#include <bit>
#include <cstring>

namespace weightsync {
namespace {

// The little-endian value of `n` (at most 8) bytes at `p`.
inline uint64_t load_le(const unsigned char* p, std::size_t n) noexcept {
  uint64_t v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, n);
  } else {
    for (std::size_t i = n; i-- > 0;) v = (v << 8) | p[i];
  }
  return v;
}

inline void add_word(WireSum& s, uint64_t word, uint64_t index) noexcept {
  s.a += word;
  s.b += index * word;
}

inline void add_byte(WireSum& s, unsigned char byte, uint64_t position) noexcept {
  add_word(s, uint64_t{byte} << (8 * (position & 3)), position >> 2);
}

// An element's `n` bytes (little-endian `value`) at `position`.
inline void add_element(WireSum& s, uint64_t value, std::size_t n, uint64_t position) noexcept {
  const unsigned shift = 8 * static_cast<unsigned>(position & 3);
  if (n == 8 && shift == 0) {
    add_word(s, value & 0xffffffffu, position >> 2);
    add_word(s, value >> 32, (position >> 2) + 1);
  } else if (shift + 8 * n <= 32) {
    add_word(s, value << shift, position >> 2);  // within one word
  } else {
    for (std::size_t i = 0; i < n; ++i, value >>= 8)
      add_byte(s, static_cast<unsigned char>(value), position + i);
  }
}

template <int kVec>
struct Vector;
template <>
struct Vector<16> {
  typedef uint64_t type __attribute__((vector_size(16)));
};
template <>
struct Vector<32> {
  typedef uint64_t type __attribute__((vector_size(32)));
};

// `rounds` rounds of two kVec-byte vectors from `src` (copied to `dst` when
// kCopy), the first word being word `index` of the string. Little-endian
// hosts only (sum_range): a vector's 64-bit halves hold its words in order.
template <int kVec, bool kCopy>
[[gnu::always_inline]] inline WireSum rounds_of(unsigned char* dst, const unsigned char* src,
                                                std::size_t rounds, uint64_t index) {
  using V = typename Vector<kVec>::type;
  constexpr int kLanes = kVec / 8;       // 64-bit lanes per vector
  constexpr uint64_t kWords = kVec / 2;  // 32-bit words per round
  V low;
  for (int e = 0; e < kLanes; ++e) low[e] = 0xffffffffu;
  V a0{}, a1{}, a2{}, a3{}, s0{}, s1{}, s2{}, s3{};
  for (std::size_t k = 0; k < rounds; ++k, src += 2 * kVec) {
    __builtin_prefetch(src + 1024);
    V v, w;
    std::memcpy(&v, src, kVec);
    std::memcpy(&w, src + kVec, kVec);
    if constexpr (kCopy) {
      std::memcpy(dst, &v, kVec);
      std::memcpy(dst + kVec, &w, kVec);
      dst += 2 * kVec;
    }
    a0 += v & low;  // the even words of v
    a1 += v >> 32;  // its odd words
    a2 += w & low;
    a3 += w >> 32;
    s0 += a0;
    s1 += a1;
    s2 += a2;
    s3 += a3;
  }
  // Lane e of a0 holds word 2e of each round, of a1 word 2e + 1; a2 and a3
  // the same for the second vector, from word kWords / 2 on.
  WireSum out;
  auto lane = [&](uint64_t a, uint64_t s, uint64_t word) {
    out.a += a;
    out.b += kWords * (rounds * a - s) + word * a;
  };
  for (int e = 0; e < kLanes; ++e) {
    const auto w = static_cast<uint64_t>(2 * e);
    lane(a0[e], s0[e], w);
    lane(a1[e], s1[e], w + 1);
    lane(a2[e], s2[e], kWords / 2 + w);
    lane(a3[e], s3[e], kWords / 2 + w + 1);
  }
  out.b += index * out.a;
  return out;
}

constexpr std::size_t kRoundBytes = 64;  // what one call of rounds() takes per round

// Rounds of 64 bytes: two 32-byte vectors where the CPU has AVX2, else four
// 16-byte (SSE2) vectors; the same sums either way.
template <bool kCopy>
WireSum rounds_sse2(unsigned char* dst, const unsigned char* src, std::size_t n, uint64_t index) {
  return rounds_of<16, kCopy>(dst, src, 2 * n, index);
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__AVX2__)
template <bool kCopy>
__attribute__((target("avx2"), flatten)) WireSum rounds_avx2(unsigned char* dst,
                                                             const unsigned char* src,
                                                             std::size_t n, uint64_t index) {
  return rounds_of<32, kCopy>(dst, src, n, index);
}

bool cpu_has_avx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}

template <bool kCopy>
WireSum rounds(unsigned char* dst, const unsigned char* src, std::size_t n, uint64_t index) {
  return cpu_has_avx2() ? rounds_avx2<kCopy>(dst, src, n, index)
                        : rounds_sse2<kCopy>(dst, src, n, index);
}
#elif defined(__AVX2__)
template <bool kCopy>
WireSum rounds(unsigned char* dst, const unsigned char* src, std::size_t n, uint64_t index) {
  return rounds_of<32, kCopy>(dst, src, n, index);
}
#else
template <bool kCopy>
WireSum rounds(unsigned char* dst, const unsigned char* src, std::size_t n, uint64_t index) {
  return rounds_sse2<kCopy>(dst, src, n, index);
}
#endif

template <bool kCopy>
WireSum sum_range(unsigned char* dst, const unsigned char* src, std::size_t n, uint64_t position) {
  WireSum s;
  for (; n > 0 && (position & 3) != 0; --n, ++position) {  // up to a word boundary
    if constexpr (kCopy) *dst++ = *src;
    add_byte(s, *src++, position);
  }
  if constexpr (std::endian::native == std::endian::little) {
    if (const std::size_t r = n / kRoundBytes) {
      s += rounds<kCopy>(dst, src, r, position >> 2);
      if constexpr (kCopy) dst += kRoundBytes * r;
      src += kRoundBytes * r;
      position += kRoundBytes * r;
      n -= kRoundBytes * r;
    }
  }
  for (; n >= 4; n -= 4, position += 4, src += 4) {
    if constexpr (kCopy) {
      std::memcpy(dst, src, 4);
      dst += 4;
    }
    add_word(s, load_le(src, 4), position >> 2);
  }
  for (; n > 0; --n, ++position) {
    if constexpr (kCopy) *dst++ = *src;
    add_byte(s, *src++, position);
  }
  return s;
}

}  // namespace

WireSum wire_sum(const void* data, std::size_t bytes, uint64_t position) noexcept {
  return sum_range<false>(nullptr, static_cast<const unsigned char*>(data), bytes, position);
}

WireSum copy_wire_sum(void* dst, const void* src, std::size_t bytes, uint64_t position) noexcept {
  return sum_range<true>(static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src),
                         bytes, position);
}

WireSum copy_wire_sum_elements(char* dst, const char* src, int64_t count, std::size_t element,
                               int64_t dst_stride, int64_t src_stride, uint64_t position,
                               int64_t position_stride) noexcept {
  WireSum s;
  for (int64_t j = 0; j < count; ++j) {
    const auto* from = reinterpret_cast<const unsigned char*>(src + j * src_stride);
    std::memcpy(dst + j * dst_stride, from, element);
    add_element(s, load_le(from, element), element,
                position + static_cast<uint64_t>(j * position_stride));
  }
  return s;
}

uint64_t wire_digest(const WireSum& sums, uint64_t total, uint64_t seed) noexcept {
  using namespace checksum_core;
  // Each step is a bijection of the value it mixes in, so a change of a
  // alone or of b alone always changes the digest.
  uint64_t h = first_hash(seed, total);
  h = tail_word(h, sums.a);
  h = tail_word(h, sums.b);
  h = avalanche(h);
  return h != 0 ? h : 1;
}

}  // namespace weightsync
