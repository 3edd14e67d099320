// The bucket checksum (core/wire_sum.h) and its fusion into copy programs
// (execute_host_sum): the sums a copy computes while it moves bytes equal
// the sums of a separate read of the packed bytes, for every length,
// alignment, position and layout; and the digest changes under the faults
// the wire can make.
#include "core/wire_sum.h"
#include "core/copy_program.h"

#include "copy_random_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

namespace weightsync {
namespace {

// The definition, byte by byte: word i holds bytes [4i, 4i + 4) little-endian.
WireSum reference_sum(const unsigned char* p, std::size_t n, uint64_t position) {
  WireSum s;
  for (std::size_t i = 0; i < n; ++i) {
    const uint64_t at = position + i;
    const uint64_t w = uint64_t{p[i]} << (8 * (at % 4));
    s.a += w;
    s.b += (at / 4) * w;
  }
  return s;
}

int64_t address(const TensorView& v, const Box& b) {
  return static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(v.data)) +
         test::box_byte_offset(v, b);
}

std::vector<unsigned char> random_bytes(std::mt19937_64& rng, std::size_t n) {
  std::vector<unsigned char> v(n);
  for (auto& b : v) b = static_cast<unsigned char>(rng());
  return v;
}

TEST(WireSum, EqualsTheDefinitionForEveryLengthAndPosition) {
  std::mt19937_64 rng(1);
  const auto bytes = random_bytes(rng, 4096 + 64);
  for (std::size_t n : {0, 1, 3, 4, 5, 31, 32, 33, 63, 64, 65, 100, 255, 1000, 4096})
    for (std::size_t misalign = 0; misalign < 8; ++misalign)
      for (uint64_t position : {0, 1, 2, 3, 4, 7, 1000, 4099}) {
        SCOPED_TRACE(testing::Message()
                     << n << " bytes at +" << misalign << ", position " << position);
        EXPECT_EQ(wire_sum(bytes.data() + misalign, n, position),
                  reference_sum(bytes.data() + misalign, n, position));
      }
}

TEST(WireSum, PiecesInAnyOrderAddUpToTheWhole) {
  std::mt19937_64 rng(2);
  for (int trial = 0; trial < 200; ++trial) {
    const std::size_t n = rng() % 5000;
    const auto bytes = random_bytes(rng, n);
    std::vector<std::size_t> cuts{0, n};
    for (int c = static_cast<int>(rng() % 8); c > 0; --c) cuts.push_back(n ? rng() % (n + 1) : 0);
    std::sort(cuts.begin(), cuts.end());
    std::vector<std::size_t> order(cuts.size() - 1);
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    WireSum pieces;
    for (std::size_t k : order)
      pieces += wire_sum(bytes.data() + cuts[k], cuts[k + 1] - cuts[k], cuts[k]);
    EXPECT_EQ(pieces, wire_sum(bytes.data(), n, 0)) << n << " bytes in " << order.size();
  }
}

TEST(WireSum, CopyMovesTheBytesAndSumsThemInTheSamePass) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    const std::size_t n = trial < 100 ? static_cast<std::size_t>(trial) : rng() % 100000;
    const std::size_t src_at = rng() % 16, dst_at = rng() % 16;
    const uint64_t position = rng() % 1000;
    const auto src = random_bytes(rng, n + 16);
    std::vector<unsigned char> dst(n + 32, 0xAB), expected = dst;
    std::memcpy(expected.data() + dst_at, src.data() + src_at, n);
    const WireSum s = copy_wire_sum(dst.data() + dst_at, src.data() + src_at, n, position);
    EXPECT_EQ(dst, expected) << n << " bytes";
    EXPECT_EQ(s, reference_sum(src.data() + src_at, n, position)) << n << " bytes";
  }
}

TEST(WireSum, ElementCopiesSumEachElementAtItsPosition) {
  std::mt19937_64 rng(4);
  for (std::size_t e : {1, 2, 4, 8})
    for (int trial = 0; trial < 50; ++trial) {
      const int64_t count = 1 + static_cast<int64_t>(rng() % 40);
      const int64_t ss = static_cast<int64_t>(e * (1 + rng() % 5)), ds = static_cast<int64_t>(e);
      const int64_t ps = static_cast<int64_t>(e) * (1 + static_cast<int64_t>(rng() % 3));
      const uint64_t position = rng() % 13;  // unaligned too
      const auto src = random_bytes(rng, static_cast<std::size_t>(count * ss));
      std::vector<unsigned char> dst(static_cast<std::size_t>(count * ds));
      const WireSum s = copy_wire_sum_elements(reinterpret_cast<char*>(dst.data()),
                                               reinterpret_cast<const char*>(src.data()), count, e,
                                               ds, ss, position, ps);
      WireSum expected;
      for (int64_t j = 0; j < count; ++j) {
        EXPECT_EQ(std::memcmp(dst.data() + j * ds, src.data() + j * ss, e), 0);
        expected += reference_sum(src.data() + j * ss, e, position + static_cast<uint64_t>(j * ps));
      }
      EXPECT_EQ(s, expected) << e << "-byte elements at " << position;
    }
}

// Several random boxes (every dtype size, padded and transposed storage)
// packed back to back from an unaligned bucket offset, then applied back
// out: the pack's fused sums are those of the packed bytes, and so are the
// apply's, and both move what execute_host moves.
TEST(WireSum, FusedPackAndApplyEqualTheChecksumOfThePackedBytes) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 150; ++trial) {
    const int items = 1 + static_cast<int>(rng() % 4);
    const int64_t origin = static_cast<int64_t>(rng() % 9);  // the fragment's first slot byte
    std::vector<test::RandomCopy> copies;
    CopyProgram pack, apply;
    int64_t at = origin;
    for (int i = 0; i < items; ++i) {
      copies.push_back(test::random_copy(rng));
      const test::RandomCopy& c = copies.back();
      const auto& lengths = c.src_box.lengths;
      const Shape dense = contiguous_strides(lengths);
      const std::size_t item = itemsize(c.src.view.dtype);
      pack.add(address(c.src.view, c.src_box), c.src.view.effective_strides(), at, dense, lengths,
               item);
      apply.add(at, dense, address(c.dst.view, c.dst_box), c.dst.view.effective_strides(), lengths,
                item);
      at += c.src_box.numel() * static_cast<int64_t>(item);
    }
    const auto bytes = static_cast<std::size_t>(at - origin);
    ASSERT_EQ(runs_bytes(pack), static_cast<int64_t>(bytes));
    std::vector<unsigned char> fused(static_cast<std::size_t>(at)), plain(fused.size());
    const auto slot = [](std::vector<unsigned char>& v) {
      return reinterpret_cast<std::uintptr_t>(v.data());
    };
    const WireSum packed = execute_host_sum(pack, 0, slot(fused), PackedSide::dst, origin);
    execute_host(pack, 0, slot(plain));
    ASSERT_EQ(fused, plain) << "the fused pack must write what the plain one writes";
    const WireSum expected = wire_sum(fused.data() + origin, bytes, 0);
    EXPECT_EQ(packed, expected) << "trial " << trial;
    // The apply back out, once fused and once plain, into copies of the targets.
    std::vector<std::vector<unsigned char>> before;
    for (const auto& c : copies) before.push_back(c.dst.storage);
    const WireSum applied = execute_host_sum(apply, slot(fused), 0, PackedSide::src, origin);
    EXPECT_EQ(applied, expected) << "trial " << trial;
    std::vector<std::vector<unsigned char>> after;
    for (std::size_t i = 0; i < copies.size(); ++i) {
      after.push_back(copies[i].dst.storage);
      copies[i].dst.storage = before[i];
    }
    execute_host(apply, slot(fused), 0);
    for (std::size_t i = 0; i < copies.size(); ++i)
      EXPECT_EQ(after[i], copies[i].dst.storage) << "item " << i;
  }
}

TEST(WireSum, DigestCatchesFlipsSwapsAndMisplacedPieces) {
  std::mt19937_64 rng(6);
  auto bytes = random_bytes(rng, 4099);
  const uint64_t good = wire_checksum(bytes.data(), bytes.size(), 7);
  EXPECT_NE(good, 0u);
  EXPECT_NE(wire_checksum(bytes.data(), bytes.size(), 8), good) << "the seed (step) matters";
  EXPECT_NE(wire_checksum(bytes.data(), bytes.size() - 1, 7), good) << "the length matters";
  for (std::size_t i = 0; i < bytes.size(); i += 37)
    for (unsigned char flip : {0x01, 0x80, 0xFF}) {
      bytes[i] ^= flip;
      EXPECT_NE(wire_checksum(bytes.data(), bytes.size(), 7), good) << "byte " << i;
      bytes[i] ^= flip;
    }
  // Two words swapped; the sign bits of two words flipped (a plain sum of
  // 64-bit words would miss that).
  std::swap_ranges(bytes.begin() + 8, bytes.begin() + 12, bytes.begin() + 400);
  EXPECT_NE(wire_checksum(bytes.data(), bytes.size(), 7), good);
  std::swap_ranges(bytes.begin() + 8, bytes.begin() + 12, bytes.begin() + 400);
  bytes[7] ^= 0x80;
  bytes[15] ^= 0x80;
  EXPECT_NE(wire_checksum(bytes.data(), bytes.size(), 7), good);
  bytes[7] ^= 0x80;
  bytes[15] ^= 0x80;
  // A piece summed at the wrong position (a fragment landed in the wrong place).
  WireSum s = wire_sum(bytes.data(), 1000, 0);
  s += wire_sum(bytes.data() + 1000, bytes.size() - 1000, 1004);
  EXPECT_NE(wire_digest(s, bytes.size(), 7), good);
  EXPECT_EQ(wire_checksum(bytes.data(), bytes.size(), 7), good);
}

}  // namespace
}  // namespace weightsync
