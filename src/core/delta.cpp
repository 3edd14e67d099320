#include "core/delta.h"

#include <weightsync/checksum.h>

#include <weightsync/error.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace weightsync::delta {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the delta codec reads elements as lanes of little-endian words");

constexpr int kKindShift = 14;
constexpr uint16_t kCountMask = (1u << kKindShift) - 1;
static_assert(kChunkElements <= kCountMask, "a chunk's count must fit its head");

void put_u16(uint8_t* at, uint16_t v) {
  at[0] = static_cast<uint8_t>(v & 0xff);
  at[1] = static_cast<uint8_t>(v >> 8);
}

uint16_t get_u16(const uint8_t* at) {
  return static_cast<uint16_t>(at[0] | (at[1] << 8));
}

uint16_t head(ChunkKind kind, int64_t count) {
  return static_cast<uint16_t>((static_cast<unsigned>(kind) << kKindShift) |
                               static_cast<unsigned>(count));
}

// Bit i: byte i of the 64 bytes at `a` and `b` differs (SSE2, x86-64's
// baseline; bytewise elsewhere).
inline uint64_t diff_bytes64(const uint8_t* a, const uint8_t* b) {
#if defined(__SSE2__)
  uint64_t m = 0;
  for (int j = 0; j < 4; ++j) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * j));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * j));
    const auto eq = static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)));
    m |= static_cast<uint64_t>(~eq & 0xffffu) << (16 * j);
  }
  return m;
#else
  uint64_t m = 0;
  for (int i = 0; i < 64; ++i) m |= static_cast<uint64_t>(a[i] != b[i]) << i;
  return m;
#endif
}

// The same for the `len` (< 64) bytes left at the end of a chunk.
inline uint64_t diff_bytes_tail(const uint8_t* a, const uint8_t* b, size_t len) {
  uint64_t m = 0;
  for (size_t i = 0; i < len; ++i) m |= static_cast<uint64_t>(a[i] != b[i]) << i;
  return m;
}

// One flag per element of E bytes, at bit E * i for element i: any of its
// bytes differs.
template <int E>
inline uint64_t element_flags(uint64_t bytes) {
  if constexpr (E >= 2) bytes |= bytes >> 1;
  if constexpr (E >= 4) bytes |= bytes >> 2;
  if constexpr (E >= 8) bytes |= bytes >> 4;
  constexpr uint64_t kFirst = E == 1   ? ~uint64_t{0}
                              : E == 2 ? 0x5555555555555555ULL
                              : E == 4 ? 0x1111111111111111ULL
                                       : 0x0101010101010101ULL;
  return bytes & kFirst;
}

// Set bits. x86-64's baseline has no popcount instruction: where the build
// does not assume one, the encoder is compiled twice, with (Pop, chosen at
// run time when the CPU has it: encode_all_popcnt) and without it (this
// arithmetic).
template <bool Pop>
inline int64_t count_bits(uint64_t x) {
  if constexpr (Pop) return __builtin_popcountll(x);
  x = x - ((x >> 1) & 0x5555555555555555ULL);
  x = (x & 0x3333333333333333ULL) + ((x >> 2) & 0x3333333333333333ULL);
  x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0fULL;
  return static_cast<int64_t>((x * 0x0101010101010101ULL) >> 56);
}

// The changed-element flags of block j (64 bytes) of a chunk of `bytes` bytes.
template <int E>
inline uint64_t block_flags(const uint8_t* next, const uint8_t* base, size_t j, size_t bytes) {
  const size_t at = j * 64;
  return element_flags<E>(at + 64 <= bytes ? diff_bytes64(next + at, base + at)
                                           : diff_bytes_tail(next + at, base + at, bytes - at));
}

// What a record of `n` elements with `changed` of them changed in `runs`
// runs takes as each kind, its 2-byte head aside.
struct RecordBytes {
  int64_t list, runs, dense;
};

template <int E>
RecordBytes record_bytes(int64_t n, int64_t changed, int64_t runs) {
  return {changed * (2 + E), runs * 4 + changed * E, n * E};
}

// The changed elements of the `bytes` bytes at `next` against `base`, and
// the runs they form (a flag per element, 64 bytes at a time); with
// `flags`, each block's flags go there too. At a few percent of elements
// changed about half the blocks hold a change, so no branch is taken on
// that for a single block (it would mispredict half the time). For E >= 2 a
// block's flags sit at every E-th bit, so E blocks are counted in one word.
template <int E, bool Pop>
void count_changes(const uint8_t* next, const uint8_t* base, size_t bytes, uint64_t* flags,
                   int64_t& changed, int64_t& runs) {
  uint64_t carry = 0;  // 1: the previous block's last element changed
  const size_t blocks = (bytes + 63) / 64;
  // Groups of 2 * E blocks: a group with no change is passed over (a branch
  // that goes one way nearly always at 0.1 % changed and at 2 %), and the
  // others' flags fill two words, counted together.
  constexpr size_t kGroup = 2 * E;
  uint64_t f[kGroup];
  for (size_t g = 0; g < blocks; g += kGroup) {
    uint64_t any = 0;
    if ((g + kGroup) * 64 <= bytes) {
      for (size_t l = 0; l < kGroup; ++l) {
        __builtin_prefetch(next + (g + l) * 64 + 2048);
        __builtin_prefetch(base + (g + l) * 64 + 2048);
        f[l] = element_flags<E>(diff_bytes64(next + (g + l) * 64, base + (g + l) * 64));
        any |= f[l];
      }
    } else {
      for (size_t l = 0; l < kGroup; ++l) {
        f[l] = g + l < blocks ? block_flags<E>(next, base, g + l, bytes) : 0;
        any |= f[l];
      }
    }
    if (flags) {
      for (size_t l = 0; l < kGroup && g + l < blocks; ++l) flags[g + l] = f[l];
    }
    if (any == 0) {
      carry = 0;
      continue;
    }
    uint64_t changed_words[2] = {0, 0}, start_words[2] = {0, 0};
    for (size_t l = 0; l < kGroup; ++l) {
      changed_words[l / E] |= f[l] << (l % E);
      start_words[l / E] |= (f[l] & ~((f[l] << E) | carry)) << (l % E);
      carry = (f[l] >> (64 - E)) & 1;
    }
    changed += count_bits<Pop>(changed_words[0]) + count_bits<Pop>(changed_words[1]);
    runs += count_bits<Pop>(start_words[0]) + count_bits<Pop>(start_words[1]);
  }
}

// The changed elements of a chunk, from its blocks' `flags` (`k` of them in
// `blocks` blocks): their indices, ascending, into `index`, and their new
// values from `next` into `values` (also written into the base).
template <int E>
inline void take_changes(const uint64_t* flags, size_t blocks, int64_t k, const uint8_t* next,
                         uint8_t* base, uint8_t* values, uint16_t* index) {
  auto take_value = [&](int64_t i, int64_t e) {  // changed element e, the i-th
    std::memcpy(values + i * E, next + e * E, E);
    std::memcpy(base + e * E, next + e * E, E);
  };
  int64_t t = 0;
  if (static_cast<size_t>(k) * 8 < blocks || static_cast<size_t>(k) > 2 * blocks) {
    // Few blocks hold a change (a branch past the others goes one way), or
    // most hold several (the loop over a block's changes runs long): a
    // branch on each.
    for (size_t j = 0; j < blocks; ++j) {
      for (uint64_t f = flags[j]; f; f &= f - 1) {
        const auto e = static_cast<int64_t>(j * (64 / E)) + std::countr_zero(f) / E;
        index[t] = static_cast<uint16_t>(e);
        take_value(t++, e);
      }
    }
    return;
  }
  // About one a block: each block takes two slots whether it has a change
  // or not (a slot is kept only when it names one), so that the loop does
  // not branch on how many a block has; the rare third and later come
  // after them.
  constexpr uint64_t kNone = uint64_t{1} << 63;  // a slot's index when a block has no more
  for (size_t j = 0; j < blocks; ++j) {
    uint64_t f = flags[j];
    const auto first = static_cast<uint16_t>(j * (64 / E));
    index[t] = static_cast<uint16_t>(first + std::countr_zero(f | kNone) / E);
    t += f != 0;
    f &= f - 1;
    index[t] = static_cast<uint16_t>(first + std::countr_zero(f | kNone) / E);
    t += f != 0;
    f &= f - 1;
    for (; f; f &= f - 1) index[t++] = static_cast<uint16_t>(first + std::countr_zero(f) / E);
  }
  for (int64_t i = 0; i < k; ++i) take_value(i, index[i]);
}

// A list or runs record's table at `table`: the `k` ascending `index`es as
// they are (little-endian, as the format), or the runs they form as (start,
// length) pairs.
inline void write_table(uint8_t* table, const uint16_t* index, int64_t k, bool list) {
  if (list) {
    std::memcpy(table, index, static_cast<size_t>(2 * k));
    return;
  }
  int64_t start = index[0], end = start + 1;  // the open run, [start, end)
  for (int64_t i = 1; i <= k; ++i) {
    if (i < k && index[i] == end) {
      ++end;
      continue;
    }
    put_u16(table, static_cast<uint16_t>(start));
    put_u16(table + 2, static_cast<uint16_t>(end - start));
    table += 4;
    if (i < k) {
      start = index[i];
      end = start + 1;
    }
  }
}

// One chunk of `n` elements: the record at `out`, `base` brought up to
// `next`. A first pass counts the changed elements and their runs, which
// decides the record's kind and its layout; a second pass, for a list or
// runs, writes them.
template <int E, bool Pop>
int64_t encode_chunk(const uint8_t* next, uint8_t* base, int64_t n, uint8_t* out,
                     EncodeStats* stats) {
  const auto bytes = static_cast<size_t>(n * E);
  const size_t blocks = (bytes + 63) / 64;
  int64_t k = 0, runs = 0;
  uint64_t flags[kChunkElements * 8 / 64];  // by block, for the second pass
  count_changes<E, Pop>(next, base, bytes, flags, k, runs);
  if (stats) stats->changed += k;
  if (k == 0) {
    put_u16(out, head(ChunkKind::unchanged, 0));
    if (stats) ++stats->chunks[0];
    return 2;
  }
  const RecordBytes kinds = record_bytes<E>(n, k, runs);
  const int64_t list_bytes = 2 + kinds.list, runs_bytes = 2 + kinds.runs,
                dense_bytes = 2 + kinds.dense;
  if (dense_bytes <= list_bytes && dense_bytes <= runs_bytes) {
    put_u16(out, head(ChunkKind::dense, 0));
    std::memcpy(out + 2, next, bytes);
    std::memcpy(base, next, bytes);
    if (stats) ++stats->chunks[3];
    return dense_bytes;
  }
  const bool list = list_bytes <= runs_bytes;
  put_u16(out, list ? head(ChunkKind::list, k) : head(ChunkKind::runs, runs));
  uint16_t index[kChunkElements + 2];
  uint8_t* values = out + 2 + (list ? 2 * k : 4 * runs);
  take_changes<E>(flags, blocks, k, next, base, values, index);
  write_table(out + 2, index, k, list);
  if (stats) ++stats->chunks[list ? 1 : 2];
  return list ? list_bytes : runs_bytes;
}

// Samples of `next` against `base`: windows of kSampleWindow bytes, one in
// every kSampleStride bytes at a pseudo-random place (64-byte aligned), so
// that the samples do not fall in step with a tensor's rows. Each window is
// costed as a chunk would be (the least of list, runs and dense for its
// elements, runs cut at the window's edges), and the sum scaled to the
// whole item.
constexpr size_t kSampleWindow = 256, kSampleStride = 16384;

template <int E>
int64_t estimate_all(const uint8_t* next, const uint8_t* base, int64_t elements) {
  const auto bytes = static_cast<size_t>(elements) * E;
  if (bytes == 0) return 0;
  int64_t sampled = 0, cost = 0;
  for (size_t start = 0, i = 0; start < bytes; start += kSampleStride, ++i) {
    const size_t room = std::min(kSampleStride, bytes - start);
    const size_t jitter =
        room > kSampleWindow ? ((i + 1) * 0x9E3779B97F4A7C15ULL >> 40) % (room - kSampleWindow) : 0;
    const size_t at = start + jitter / 64 * 64;
    const size_t len = std::min(kSampleWindow, bytes - at);
    int64_t k = 0, runs = 0;
    count_changes<E, false>(next + at, base + at, len, nullptr, k, runs);
    const RecordBytes kinds = record_bytes<E>(static_cast<int64_t>(len / E), k, runs);
    cost += std::min({kinds.list, kinds.runs, kinds.dense});
    sampled += static_cast<int64_t>(len);
  }
  return static_cast<int64_t>(static_cast<double>(cost) * static_cast<double>(bytes) /
                              static_cast<double>(sampled));
}

template <int E, bool Pop>
int64_t encode_all(const uint8_t* next, uint8_t* base, int64_t elements, uint8_t* out,
                   EncodeStats* stats, Digest* hash) {
  int64_t at = 0;
  for (int64_t first = 0, chunk = 0; first < elements; first += kChunkElements, ++chunk) {
    const int64_t n = std::min(kChunkElements, elements - first);
    at += encode_chunk<E, Pop>(next + first * E, base + first * E, n, out + at, stats);
    // While the chunk is in cache.
    if (hash)
      hash->sum +=
          checksum64(next + first * E, static_cast<size_t>(n * E), chunk_seed(hash->seed, chunk));
  }
  return at;
}

#if defined(__x86_64__) && !defined(__POPCNT__) && defined(__GNUC__)
// The encoder with the popcount instruction, for CPUs that have it (all
// x86-64 CPUs since about 2008): everything it calls is inlined into it, so
// that the instruction is used throughout.
template <int E>
__attribute__((target("popcnt"), flatten)) int64_t encode_all_popcnt(const uint8_t* next,
                                                                     uint8_t* base,
                                                                     int64_t elements, uint8_t* out,
                                                                     EncodeStats* stats,
                                                                     Digest* hash) {
  return encode_all<E, true>(next, base, elements, out, stats, hash);
}

bool cpu_has_popcnt() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("popcnt") != 0;
  }();
  return has;
}

template <int E>
int64_t encode_items(const uint8_t* next, uint8_t* base, int64_t elements, uint8_t* out,
                     EncodeStats* stats, Digest* hash) {
  return cpu_has_popcnt() ? encode_all_popcnt<E>(next, base, elements, out, stats, hash)
                          : encode_all<E, false>(next, base, elements, out, stats, hash);
}
#else
template <int E>
int64_t encode_items(const uint8_t* next, uint8_t* base, int64_t elements, uint8_t* out,
                     EncodeStats* stats, Digest* hash) {
#if defined(__x86_64__) && !defined(__POPCNT__)
  constexpr bool kPop = false;  // a compiler without the target attribute
#else
  constexpr bool kPop = true;
#endif
  return encode_all<E, kPop>(next, base, elements, out, stats, hash);
}
#endif

// A record as apply reads it: where its parts start inside the encoding.
struct Record {
  ChunkKind kind = ChunkKind::unchanged;
  int64_t count = 0;
  int64_t table = 0;   // indices or run pairs
  int64_t values = 0;  // the new elements
};

// Checks the record of one chunk of `n` elements at byte `at` of the
// encoding (`bytes` long) up to its values, and returns it with the number of
// `values` it carries; `bad(why...)` throws naming the chunk.
template <class Bad>
Record read_record(const uint8_t* enc, int64_t bytes, int64_t at, int64_t n, int64_t& values,
                   Bad bad) {
  if (at + 2 > bytes) bad("the encoding ends at byte ", bytes, " before its record");
  const uint16_t h = get_u16(enc + at);
  Record r;
  r.kind = static_cast<ChunkKind>(h >> kKindShift);
  r.count = h & kCountMask;
  r.table = at + 2;
  values = 0;
  switch (r.kind) {
    case ChunkKind::unchanged:
    case ChunkKind::dense:
      if (r.count != 0) bad("count ", r.count, " in a record that takes none");
      values = r.kind == ChunkKind::dense ? n : 0;
      r.values = r.table;
      break;
    case ChunkKind::list: {
      if (r.count < 1 || r.count > n) bad("a list of ", r.count, " elements");
      if (r.table + r.count * 2 > bytes) bad("the encoding ends inside its indices");
      int64_t prev = -1;
      for (int64_t j = 0; j < r.count; ++j) {
        const int64_t i = get_u16(enc + r.table + j * 2);
        if (i <= prev || i >= n)
          bad("index ", i, " after ", prev, " (ascending, below ", n, " expected)");
        prev = i;
      }
      values = r.count;
      r.values = r.table + r.count * 2;
      break;
    }
    case ChunkKind::runs: {
      if (r.count < 1 || r.count > n) bad(r.count, " runs");
      if (r.table + r.count * 4 > bytes) bad("the encoding ends inside its runs");
      int64_t end = 0;
      for (int64_t j = 0; j < r.count; ++j) {
        const int64_t start = get_u16(enc + r.table + j * 4);
        const int64_t len = get_u16(enc + r.table + j * 4 + 2);
        if (len < 1 || start < end || start + len > n)
          bad("run ", j, " [", start, ", ", start + len, ") (apart, ascending, non-empty, ",
              "inside ", n, " elements expected)");
        end = start + len;
        values += len;
      }
      r.values = r.table + r.count * 4;
      break;
    }
  }
  return r;
}

// Checks a whole encoding of `elements` elements and returns its records,
// one per chunk: Errc::format naming `what`, the chunk and the fault.
template <int E>
std::vector<Record> parse_records(const uint8_t* enc, int64_t bytes, int64_t elements,
                                  const std::string& what) {
  std::vector<Record> records;
  records.reserve(static_cast<size_t>((elements + kChunkElements - 1) / kChunkElements));
  int64_t at = 0;
  for (int64_t first = 0, chunk = 0; first < elements; first += kChunkElements, ++chunk) {
    const int64_t n = std::min(kChunkElements, elements - first);
    auto bad = [&](const auto&... why) {
      fail(Errc::format, what, ": delta chunk ", chunk, " (elements ", first, "..", first + n,
           "): ", why...);
    };
    int64_t values = 0;
    const Record r = read_record(enc, bytes, at, n, values, bad);
    at = r.values + values * E;
    if (at > bytes) bad("the encoding ends inside its values");
    records.push_back(r);
  }
  if (at != bytes)
    fail(Errc::format, what, ": delta encoding of ", elements, " elements takes ", at,
         " bytes, but ", bytes, " arrived");
  return records;
}

// Writes one checked record's new elements into its chunk at `dst` (`n`
// elements of E bytes).
template <int E>
void patch_chunk(ChunkKind kind, int64_t count, const uint8_t* table, const uint8_t* v,
                 uint8_t* dst, int64_t n) {
  constexpr int64_t e = E;
  switch (kind) {
    case ChunkKind::unchanged:
      break;
    case ChunkKind::dense:
      std::memcpy(dst, v, static_cast<size_t>(n * e));
      break;
    case ChunkKind::list:
      for (int64_t j = 0; j < count; ++j, v += e)
        std::memcpy(dst + get_u16(table + j * 2) * e, v, static_cast<size_t>(e));
      break;
    case ChunkKind::runs:
      for (int64_t j = 0; j < count; ++j) {
        const int64_t start = get_u16(table + j * 4);
        const int64_t len = get_u16(table + j * 4 + 2);
        std::memcpy(dst + start * e, v, static_cast<size_t>(len * e));
        v += len * e;
      }
      break;
  }
}

template <int E>
void apply_all(const uint8_t* enc, int64_t bytes, uint8_t* target, int64_t elements,
               const std::string& what, Digest* hash) {
  // Check everything first: nothing is written unless the whole encoding is sound.
  const std::vector<Record> records = parse_records<E>(enc, bytes, elements, what);
  if (!target) return;  // check only
  int64_t first = 0, chunk = 0;
  for (const Record& r : records) {
    const int64_t n = std::min(kChunkElements, elements - first);
    uint8_t* dst = target + first * E;
    patch_chunk<E>(r.kind, r.count, enc + r.table, enc + r.values, dst, n);
    if (hash)
      hash->sum += checksum64(dst, static_cast<size_t>(n * E), chunk_seed(hash->seed, chunk));
    first += kChunkElements;
    ++chunk;
  }
}

void check_element_bytes(int element_bytes) {
  if (element_bytes != 1 && element_bytes != 2 && element_bytes != 4 && element_bytes != 8)
    fail(Errc::invalid_argument, "delta: element size ", element_bytes,
         " bytes (1, 2, 4 or 8 expected)");
}

}  // namespace

int64_t max_encoded_bytes(int64_t elements, int element_bytes) noexcept {
  return elements * element_bytes + unchanged_bytes(elements);
}

int64_t unchanged_bytes(int64_t elements) noexcept {
  return 2 * ((elements + kChunkElements - 1) / kChunkElements);
}

uint64_t chunk_seed(uint64_t seed, int64_t chunk) noexcept {
  return seed ^ (static_cast<uint64_t>(chunk) * 0x9E3779B97F4A7C15ULL);
}

uint64_t digest(const void* data, int64_t elements, int element_bytes, uint64_t seed) noexcept {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t sum = 0;
  for (int64_t first = 0, chunk = 0; first < elements; first += kChunkElements, ++chunk) {
    const int64_t n = std::min(kChunkElements, elements - first);
    sum += checksum64(p + first * element_bytes, static_cast<size_t>(n * element_bytes),
                      chunk_seed(seed, chunk));
  }
  return sum;
}

// Calls f(std::integral_constant<int, E>{}) with E = element_bytes (1, 2, 4
// or 8, checked by the caller), so that one switch picks every templated path.
template <typename F>
decltype(auto) with_element_size(int element_bytes, F&& f) {
  switch (element_bytes) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 4:
      return f(std::integral_constant<int, 4>{});
    default:
      return f(std::integral_constant<int, 8>{});
  }
}

namespace {

// encode and encode_baseline: the checks, the element size, the stats.
template <bool Baseline>
int64_t encode_checked(const void* next, void* base, int64_t elements, int element_bytes, void* out,
                       EncodeStats* stats, Digest* hash) {
  check_element_bytes(element_bytes);
  if (elements < 0) fail(Errc::invalid_argument, "delta: ", elements, " elements");
  const auto* n = static_cast<const uint8_t*>(next);
  auto* b = static_cast<uint8_t*>(base);
  auto* o = static_cast<uint8_t*>(out);
  const int64_t bytes = with_element_size(element_bytes, [&](auto e) {
    constexpr int kE = decltype(e)::value;
    if constexpr (Baseline)
      return encode_all<kE, false>(n, b, elements, o, stats, hash);
    else
      return encode_items<kE>(n, b, elements, o, stats, hash);
  });
  if (stats) {
    stats->elements += elements;
    stats->bytes += bytes;
  }
  return bytes;
}

}  // namespace

int64_t encode(const void* next, void* base, int64_t elements, int element_bytes, void* out,
               EncodeStats* stats, Digest* hash) {
  return encode_checked<false>(next, base, elements, element_bytes, out, stats, hash);
}

int64_t encode_baseline(const void* next, void* base, int64_t elements, int element_bytes,
                        void* out, EncodeStats* stats, Digest* hash) {
  return encode_checked<true>(next, base, elements, element_bytes, out, stats, hash);
}

int64_t estimate_encoded_bytes(const void* next, const void* base, int64_t elements,
                               int element_bytes) {
  check_element_bytes(element_bytes);
  if (elements < 0) fail(Errc::invalid_argument, "delta: ", elements, " elements");
  const auto* n = static_cast<const uint8_t*>(next);
  const auto* b = static_cast<const uint8_t*>(base);
  return with_element_size(
      element_bytes, [&](auto e) { return estimate_all<decltype(e)::value>(n, b, elements); });
}

void apply(const void* encoding, int64_t bytes, void* target, int64_t elements, int element_bytes,
           const std::string& what, Digest* hash) {
  check_element_bytes(element_bytes);
  if (elements < 0 || bytes < 0)
    fail(Errc::invalid_argument, what, ": delta of ", elements, " elements in ", bytes, " bytes");
  const auto* e = static_cast<const uint8_t*>(encoding);
  auto* t = static_cast<uint8_t*>(target);
  with_element_size(element_bytes, [&](auto size) {
    apply_all<decltype(size)::value>(e, bytes, t, elements, what, hash);
  });
}

void check(const void* encoding, int64_t bytes, int64_t elements, int element_bytes,
           const std::string& what) {
  apply(encoding, bytes, nullptr, elements, element_bytes, what);
}

bool patch_table(const void* encoding, int64_t bytes, int64_t elements, int element_bytes,
                 const std::string& what, int64_t encoding_offset, int64_t target_offset,
                 std::vector<PatchChunk>& out) {
  check_element_bytes(element_bytes);
  if (elements < 0 || bytes < 0)
    fail(Errc::invalid_argument, what, ": delta of ", elements, " elements in ", bytes, " bytes");
  const auto* e = static_cast<const uint8_t*>(encoding);
  const std::vector<Record> records = with_element_size(element_bytes, [&](auto size) {
    return parse_records<decltype(size)::value>(e, bytes, elements, what);
  });
  bool any = false;
  int64_t first = 0;
  for (const Record& r : records) {
    if (r.kind != ChunkKind::unchanged) {
      PatchChunk c;
      c.table = encoding_offset + r.table;
      c.values = encoding_offset + r.values;
      c.dst = target_offset + first * element_bytes;
      c.kind = static_cast<uint32_t>(r.kind);
      c.count = static_cast<uint32_t>(r.count);
      c.elements = static_cast<uint32_t>(std::min(kChunkElements, elements - first));
      c.element_bytes = static_cast<uint32_t>(element_bytes);
      out.push_back(c);
      any = true;
    }
    first += kChunkElements;
  }
  return any;
}

void hash_table(int64_t elements, int element_bytes, uint64_t seed, int64_t target_offset,
                std::vector<HashChunk>& out) {
  for (int64_t first = 0, chunk = 0; first < elements; first += kChunkElements, ++chunk) {
    const int64_t n = std::min(kChunkElements, elements - first);
    out.push_back(
        {target_offset + first * element_bytes, n * element_bytes, chunk_seed(seed, chunk)});
  }
}

void execute_patch_host(const std::vector<PatchChunk>& patch, const char* frame, char* target) {
  const auto* f = reinterpret_cast<const uint8_t*>(frame);
  auto* t = reinterpret_cast<uint8_t*>(target);
  for (const PatchChunk& c : patch) {
    const auto kind = static_cast<ChunkKind>(c.kind);
    with_element_size(static_cast<int>(c.element_bytes), [&](auto size) {
      patch_chunk<decltype(size)::value>(kind, c.count, f + c.table, f + c.values, t + c.dst,
                                         c.elements);
    });
  }
}

uint64_t execute_hash_host(const std::vector<HashChunk>& hash, const char* target) {
  uint64_t sum = 0;
  for (const HashChunk& c : hash)
    sum += checksum64(target + c.dst, static_cast<size_t>(c.bytes), c.seed);
  return sum;
}

}  // namespace weightsync::delta
