// The delta codec (core/delta.h): every element size, sparse and clustered
// and total changes, chunk edges, the kinds it picks, its size bound, and
// malformed encodings refused without a byte of the target changed; the
// tables a GPU applies encodings with, run on the host as the kernel runs
// them, against apply().
#include "core/delta.h"

#include <weightsync/checksum.h>

#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace weightsync::delta {
namespace {

using Bytes = std::vector<uint8_t>;

Bytes random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  Bytes out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// `old` with a `fraction` of its elements changed at random (each changed
// element differs in exactly one of its bytes, the last: a BF16 weight's
// smallest step touches its low byte, its sign and exponent live high).
Bytes changed(const Bytes& old, int e, double fraction, uint32_t seed) {
  std::mt19937 rng(seed);
  std::bernoulli_distribution pick(fraction);
  Bytes out = old;
  for (size_t i = 0; i < old.size() / static_cast<size_t>(e); ++i)
    if (pick(rng)) out[i * static_cast<size_t>(e) + static_cast<size_t>(e) - 1] ^= 0x5a;
  return out;
}

struct RoundTrip {
  EncodeStats stats;
  int64_t bytes = 0;
};

// Encodes `next` against `old`, checks the base was brought up to `next` and
// that applying the encoding to `old` gives `next`.
RoundTrip round_trip(const Bytes& old, const Bytes& next, int e) {
  const auto elements = static_cast<int64_t>(old.size()) / e;
  Bytes base = old;
  Bytes out(static_cast<size_t>(max_encoded_bytes(elements, e)));
  RoundTrip r;
  // Both sides hash as they go: the new bytes, chunk by chunk.
  Digest sent{5}, applied{5};
  r.bytes = encode(next.data(), base.data(), elements, e, out.data(), &r.stats, &sent);
  const uint64_t want = digest(next.data(), elements, e, 5);
  EXPECT_EQ(sent.sum, want);
  {
    // Without the popcount instruction: the same encoding, base and digest.
    Bytes base2 = old;
    Bytes out2(out.size());
    EncodeStats stats2;
    Digest sent2{5};
    const int64_t bytes2 =
        encode_baseline(next.data(), base2.data(), elements, e, out2.data(), &stats2, &sent2);
    EXPECT_EQ(bytes2, r.bytes);
    EXPECT_TRUE(std::equal(out.begin(), out.begin() + r.bytes, out2.begin()));
    EXPECT_EQ(base2, next);
    EXPECT_EQ(stats2.changed, r.stats.changed);
    EXPECT_EQ(sent2.sum, want);
  }
  EXPECT_LE(r.bytes, static_cast<int64_t>(out.size()));
  EXPECT_EQ(r.bytes, r.stats.bytes);
  EXPECT_EQ(base, next) << "the sender's base must equal what it sent";
  Bytes target = old;
  apply(out.data(), r.bytes, target.data(), elements, e, "test item", &applied);
  EXPECT_EQ(target, next);
  EXPECT_EQ(applied.sum, want);

  // The GPU's way: tables from the encoding at byte 13 of a frame, for a
  // target at byte 8 * e of its memory, run as the kernel runs them.
  Bytes frame(static_cast<size_t>(13 + r.bytes));
  std::copy(out.begin(), out.begin() + r.bytes, frame.begin() + 13);
  Bytes memory(static_cast<size_t>(8 * e), 0xee);
  memory.insert(memory.end(), old.begin(), old.end());
  std::vector<PatchChunk> patch;
  std::vector<HashChunk> hash;
  const bool any =
      patch_table(frame.data() + 13, r.bytes, elements, e, "test item", 13, 8 * e, patch);
  EXPECT_EQ(any, old != next);
  EXPECT_EQ(any, r.bytes != unchanged_bytes(elements));
  hash_table(elements, e, 5, 8 * e, hash);
  EXPECT_EQ(hash.size(), static_cast<size_t>((elements + kChunkElements - 1) / kChunkElements));
  execute_patch_host(patch, reinterpret_cast<const char*>(frame.data()),
                     reinterpret_cast<char*>(memory.data()));
  EXPECT_EQ(Bytes(memory.begin() + 8 * e, memory.end()), next);
  EXPECT_EQ(Bytes(memory.begin(), memory.begin() + 8 * e), Bytes(static_cast<size_t>(8 * e), 0xee))
      << "the patch wrote before its target";
  EXPECT_EQ(execute_hash_host(hash, reinterpret_cast<const char*>(memory.data())), want);
  return r;
}

class DeltaSizes : public ::testing::TestWithParam<int> {};

TEST_P(DeltaSizes, RoundTripsAtEveryFractionAndChunkEdge) {
  const int e = GetParam();
  // Whole chunks, a partial last chunk, a tail shorter than a word, tiny items.
  for (int64_t elements : {int64_t{0}, int64_t{1}, int64_t{7}, kChunkElements,
                           3 * kChunkElements + 5, 2 * kChunkElements - 1}) {
    const Bytes old = random_bytes(static_cast<size_t>(elements * e), 7);
    for (double fraction : {0.0, 0.001, 0.02, 0.3, 1.0}) {
      SCOPED_TRACE(testing::Message() << elements << " elements, fraction " << fraction);
      const Bytes next = changed(old, e, fraction, 11);
      const RoundTrip r = round_trip(old, next, e);
      int64_t want_changed = 0;
      for (int64_t i = 0; i < elements; ++i)
        want_changed += std::memcmp(&old[static_cast<size_t>(i * e)],
                                    &next[static_cast<size_t>(i * e)], static_cast<size_t>(e)) != 0;
      EXPECT_EQ(r.stats.changed, want_changed);
      const int64_t chunks = (elements + kChunkElements - 1) / kChunkElements;
      EXPECT_LE(r.bytes, elements * e + 2 * chunks) << "never above the dense bytes + heads";
      if (fraction == 0.0) {
        EXPECT_EQ(r.bytes, 2 * chunks) << "unchanged chunks cost their head";
      }
      if (fraction == 1.0) {
        EXPECT_EQ(r.bytes, elements * e + 2 * chunks);
      }
    }
  }
}

TEST_P(DeltaSizes, PicksListsForScatteredChangesRunsForClusteredOnesDenseForAll) {
  const int e = GetParam();
  const int64_t elements = 4 * kChunkElements;
  const Bytes old = random_bytes(static_cast<size_t>(elements * e), 3);
  {
    const RoundTrip r = round_trip(old, changed(old, e, 0.01, 5), e);
    EXPECT_EQ(r.stats.chunks[static_cast<int>(ChunkKind::list)], 4);
    EXPECT_LT(r.bytes, elements * e / 10);
  }
  {
    // Runs of 64 elements every 1024: far fewer bytes as runs than as a list.
    Bytes next = old;
    for (int64_t i = 0; i < elements; ++i)
      if (i % 1024 < 64) next[static_cast<size_t>(i * e)] ^= 1;
    const RoundTrip r = round_trip(old, next, e);
    EXPECT_EQ(r.stats.chunks[static_cast<int>(ChunkKind::runs)], 4);
    EXPECT_EQ(r.bytes, 4 * (2 + 4 * 4 + 4 * 64 * e));
  }
  {
    // One run of 8 elements a chunk (for E >= 2 the encoder's path for
    // chunks where few blocks hold a change; for E = 1 the two-slot one):
    // runs.
    Bytes next = old;
    for (int64_t i = 0; i < elements; ++i)
      if (i % kChunkElements >= 100 && i % kChunkElements < 108)
        next[static_cast<size_t>(i * e)] ^= 1;
    const RoundTrip r = round_trip(old, next, e);
    EXPECT_EQ(r.stats.chunks[static_cast<int>(ChunkKind::runs)], 4);
    EXPECT_EQ(r.bytes, 4 * (2 + 4 + 8 * e));
  }
  {
    // Every element changed: dense (with a few unchanged among wide
    // elements, runs can still be smaller, and are taken).
    const RoundTrip r = round_trip(old, changed(old, e, 1.0, 9), e);
    EXPECT_EQ(r.stats.chunks[static_cast<int>(ChunkKind::dense)], 4);
  }
}

INSTANTIATE_TEST_SUITE_P(ElementBytes, DeltaSizes, ::testing::Values(1, 2, 4, 8),
                         [](const auto& info) { return "E" + std::to_string(info.param); });

// Each element is compared as a whole: a change in any one of its bytes is
// found, and only that element is sent.
// The sender's look before it encodes: near the encoding's size for
// scattered changes, about dense for a total change, next to nothing for
// none, and well under dense for changes clustered in runs; it writes nothing.
TEST(Delta, EstimateIsNearTheEncodingWithoutWritingAnything) {
  const size_t n = size_t{8} << 20;
  const Bytes old = random_bytes(n, 7);
  for (int e : {1, 2, 4}) {
    SCOPED_TRACE(e);
    const auto elements = static_cast<int64_t>(n) / e;
    for (double fraction : {0.0, 0.02, 0.2, 1.0}) {
      SCOPED_TRACE(fraction);
      const Bytes next = changed(old, e, fraction, 11);
      const Bytes before = next;
      const int64_t estimate = estimate_encoded_bytes(next.data(), old.data(), elements, e);
      EXPECT_EQ(next, before);
      const int64_t exact = round_trip(old, next, e).bytes;
      if (fraction == 0.0) {
        EXPECT_EQ(estimate, 0);
      } else {
        EXPECT_GT(estimate, exact * 7 / 10) << "exact " << exact;
        EXPECT_LT(estimate, exact * 13 / 10) << "exact " << exact;
      }
    }
  }
  // Half of every 16 KiB changed in one run: runs, not a list.
  Bytes next = old;
  for (size_t at = 0; at < n; at += 16384)
    for (size_t i = at; i < at + 8192; ++i) next[i] = static_cast<uint8_t>(next[i] ^ 0xff);
  const int64_t estimate = estimate_encoded_bytes(next.data(), old.data(), n / 2, 2);
  EXPECT_GT(estimate, static_cast<int64_t>(n) / 4);
  EXPECT_LT(estimate, static_cast<int64_t>(n) * 3 / 4);
  EXPECT_THROW(estimate_encoded_bytes(next.data(), old.data(), 1, 3), Error);
}

TEST(Delta, FindsAChangeInAnyByteOfAnElement) {
  for (int e : {2, 4, 8})
    for (int byte = 0; byte < e; ++byte) {
      const Bytes old = random_bytes(static_cast<size_t>(64 * e), 1);
      Bytes next = old;
      next[static_cast<size_t>(13 * e + byte)] ^= 0x80;
      const RoundTrip r = round_trip(old, next, e);
      EXPECT_EQ(r.stats.changed, 1) << "E" << e << " byte " << byte;
      EXPECT_EQ(r.bytes, 2 + 2 + e) << "one listed element";
    }
}

// A malformed encoding is refused naming the item and the chunk, and the
// target keeps every byte it had.
TEST(Delta, MalformedEncodingsAreRefusedAndChangeNothing) {
  const int e = 2;
  const int64_t elements = 2 * kChunkElements;
  const Bytes old = random_bytes(static_cast<size_t>(elements * e), 21);
  const Bytes next = changed(old, e, 0.01, 22);
  Bytes base = old;
  Bytes good(static_cast<size_t>(max_encoded_bytes(elements, e)));
  good.resize(static_cast<size_t>(encode(next.data(), base.data(), elements, e, good.data())));

  auto expect_refused = [&](Bytes enc, const std::string& needle, const char* what) {
    Bytes target = old;
    try {
      apply(enc.data(), static_cast<int64_t>(enc.size()), target.data(), elements, e,
            "engine rank 3: param 'w'");
      ADD_FAILURE() << what << ": accepted";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), Errc::format) << what;
      const std::string msg = err.what();
      EXPECT_NE(msg.find("engine rank 3: param 'w'"), std::string::npos) << msg;
      EXPECT_NE(msg.find(needle), std::string::npos) << what << ": " << msg;
    }
    EXPECT_EQ(target, old) << what << ": the target changed";
    // The GPU's tables are refused alike, and none is made.
    std::vector<PatchChunk> patch;
    try {
      patch_table(enc.data(), static_cast<int64_t>(enc.size()), elements, e,
                  "engine rank 3: param 'w'", 0, 0, patch);
      ADD_FAILURE() << what << ": tables made";
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), Errc::format) << what;
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << what;
    }
    EXPECT_TRUE(patch.empty()) << what;
  };
  // The first chunk's record: a list of k indices.
  ASSERT_EQ(good[1] >> 6, static_cast<int>(ChunkKind::list));
  const int k = (good[0] | (good[1] << 8)) & 0x3fff;
  ASSERT_GT(k, 1);

  expect_refused(Bytes(good.begin(), good.end() - 1), "chunk 1", "truncated by a byte");
  Bytes longer = good;
  longer.push_back(0);
  expect_refused(longer, "but " + std::to_string(longer.size()) + " arrived", "a byte too many");
  Bytes outside = good;
  outside[2] = 0xff;  // first index 0x..ff >= 4096
  outside[3] = 0xff;
  expect_refused(outside, "delta chunk 0", "an index outside its chunk");
  Bytes descending = good;
  std::swap(descending[2], descending[4]);
  std::swap(descending[3], descending[5]);
  expect_refused(descending, "ascending", "indices out of order");
  Bytes counted = good;
  counted[0] = 1;  // kind dense with a count
  counted[1] = static_cast<uint8_t>(3 << 6);
  expect_refused(counted, "count 1", "a dense record with a count");
  expect_refused(Bytes{}, "before its record", "nothing at all");
}

// The digest sums its chunks' checksums, each with a seed of its own: a
// changed byte in any chunk, chunks swapped, or another seed changes it.
TEST(Delta, DigestSumsItsChunksEachWithItsOwnSeed) {
  const int e = 2;
  const int64_t elements = 3 * kChunkElements + 100;
  const Bytes data = random_bytes(static_cast<size_t>(elements * e), 31);
  const uint64_t d = digest(data.data(), elements, e, 77);
  uint64_t sum = 0;
  for (int64_t c = 0; c * kChunkElements < elements; ++c) {
    const int64_t n = std::min(kChunkElements, elements - c * kChunkElements);
    sum += checksum64(data.data() + c * kChunkElements * e, static_cast<size_t>(n * e),
                      chunk_seed(77, c));
  }
  EXPECT_EQ(d, sum);
  EXPECT_NE(digest(data.data(), elements, e, 78), d);
  for (int64_t c = 0; c < 4; ++c) {
    Bytes one = data;
    one[static_cast<size_t>(std::min(c * kChunkElements * e + 5, elements * e - 1))] ^= 1;
    EXPECT_NE(digest(one.data(), elements, e, 77), d) << "chunk " << c;
  }
  Bytes swapped = data;
  std::swap_ranges(swapped.begin(), swapped.begin() + kChunkElements * e,
                   swapped.begin() + kChunkElements * e);
  EXPECT_NE(digest(swapped.data(), elements, e, 77), d);
}

TEST(Delta, RefusesElementSizesItDoesNotKnow) {
  Bytes a(12), b(12), out(64);
  try {
    encode(a.data(), b.data(), 4, 3, out.data());
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), Errc::invalid_argument);
  }
  EXPECT_THROW(apply(out.data(), 2, a.data(), 4, 3, "x"), Error);
}

}  // namespace
}  // namespace weightsync::delta
