// SafetensorsWriter's positional writes (write_at, tensors in any order) and
// direct I/O (use_direct_io): the file equals, byte for byte, the one the
// appending calls write through the page cache, whatever the order, the run
// cuts and the alignment of the memory; misuse is refused by name.
#include "core/safetensors_test_util.h"

#include <weightsync/safetensors.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>

namespace weightsync {
namespace {

using testing::expect_error;

class PositionalWrite : public testing::ScratchDir, public ::testing::WithParamInterface<bool> {};
class PositionalMisuse : public testing::ScratchDir {};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Sizes that put tensors at offsets of every alignment, some larger than the
// writer's 4 MiB bounce buffer and staging, some empty.
std::vector<SafetensorsWriter::Entry> entries() {
  return {{"a", DType::BF16, {37, 129}},    {"b", DType::U8, {5000}},
          {"empty", DType::F32, {0, 4}},    {"c", DType::F32, {3, 2048}},
          {"big", DType::U8, {4, 1200007}}, {"d", DType::U8, {8193}},
          {"e", DType::I16, {1}},           {"f", DType::U8, {4096 * 3}}};
}

uint64_t nbytes(const SafetensorsWriter::Entry& e) {
  return static_cast<uint64_t>(numel(e.shape)) * itemsize(e.dtype);
}

// Memory `shift` bytes past a 4096-byte boundary.
struct Shifted {
  // aligned_alloc takes a multiple of the alignment.
  Shifted(size_t n, size_t shift)
      : base(static_cast<char*>(std::aligned_alloc(4096, (n / 4096 + 2) * 4096))) {
    p = base + shift;
  }
  ~Shifted() { std::free(base); }
  char* base;
  char* p;
};

TEST_P(PositionalWrite, AnyOrderAnyCutAnyAlignmentGivesTheAppendedFile) {
  const bool direct = GetParam();
  const auto es = entries();
  std::mt19937 gen(7);
  std::vector<uint64_t> offset;
  uint64_t total = 0;
  for (const auto& e : es) offset.push_back(total), total += nbytes(e);
  std::vector<char> data(total);
  for (char& c : data) c = static_cast<char>(gen());

  const std::string reference = path("appended.safetensors");
  {
    SafetensorsWriter w(reference, es, {{"format", "pt"}});
    for (size_t i = 0; i < es.size(); ++i)
      w.write_tensor(es[i].name, data.data() + offset[i], nbytes(es[i]));
    w.finish();
  }
  const std::string ref = read_file(reference);
  uint64_t header = 0;
  for (int b = 7; b >= 0; --b) header = header << 8 | static_cast<uint8_t>(ref[size_t(b)]);
  const uint64_t data_start = 8 + header;
  for (int trial = 0; trial < 3; ++trial) {
    SCOPED_TRACE(cat("trial ", trial, direct ? " direct" : " buffered"));
    const std::string file = path(cat("positional", trial, ".safetensors"));
    SafetensorsWriter w(file, es, {{"format", "pt"}});
    if (direct && !w.use_direct_io())
      GTEST_SKIP() << "the filesystem of " << file << " refuses O_DIRECT";
    std::vector<size_t> order(es.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), gen);
    for (size_t i : order) {
      // Each tensor in up to three runs from memory of its own alignment:
      // aligned like the file (the zero-copy path), or not (the bounce buffer).
      const uint64_t n = nbytes(es[i]);
      Shifted mem(n, trial == 0 ? (data_start + offset[i]) % 4096 : (trial * 977 + i * 31) % 4096);
      std::memcpy(mem.p, data.data() + offset[i], n);
      uint64_t done = 0;
      for (int cut = 0; cut < 3 && done < n; ++cut) {
        const uint64_t run = cut == 2 ? n - done : std::min<uint64_t>(n - done, gen() % (n + 1));
        w.write_at(offset[i] + done, mem.p + done, run);
        done += run;
      }
      if (done < n) w.write_at(offset[i] + done, mem.p + done, n - done);
    }
    w.finish();
    EXPECT_FALSE(std::filesystem::exists(file + ".tmp"));
    EXPECT_TRUE(read_file(file) == ref) << "the files differ";
  }
}

TEST_P(PositionalWrite, AppendingWithDirectIoGivesTheSameFile) {
  const auto es = entries();
  std::mt19937 gen(11);
  uint64_t total = 0;
  for (const auto& e : es) total += nbytes(e);
  Shifted mem(total, 3);
  for (uint64_t i = 0; i < total; ++i) mem.p[i] = static_cast<char>(gen());
  const std::string a = path("a.safetensors"), b = path("b.safetensors");
  {
    SafetensorsWriter w(a, es);
    w.write(mem.p, total);
    w.finish();
  }
  SafetensorsWriter w(b, es);
  if (GetParam() && !w.use_direct_io())
    GTEST_SKIP() << "the filesystem of " << b << " refuses O_DIRECT";
  // Small writes gather in the staging buffer, large ones go straight through.
  for (uint64_t at = 0; at < total;) {
    const uint64_t n = std::min<uint64_t>(total - at, gen() % 3 ? gen() % 9000 : 5u << 20);
    w.write(mem.p + at, n);
    at += n;
  }
  w.finish();
  EXPECT_TRUE(read_file(a) == read_file(b)) << "the files differ";
}

INSTANTIATE_TEST_SUITE_P(Io, PositionalWrite, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "direct" : "buffered"; });

TEST_F(PositionalMisuse, MixingModesRunningPastTheEndAndMissingBytesAreRefused) {
  const std::vector<SafetensorsWriter::Entry> es = {{"x", DType::U8, {10}}, {"y", DType::U8, {6}}};
  const char bytes[16] = {};
  {
    SafetensorsWriter w(path("m1.safetensors"), es);
    w.write_at(10, bytes, 6);
    expect_error([&] { w.write(bytes, 1); }, Errc::invalid_argument,
                 {"appending write after positional writes"});
    expect_error([&] { w.use_direct_io(); }, Errc::invalid_argument,
                 {"use_direct_io() after data was written"});
    expect_error([&] { w.write_at(12, bytes, 5); }, Errc::invalid_argument,
                 {"runs past the 16 bytes"});
    expect_error([&] { w.finish(); }, Errc::mismatch,
                 {"m1.safetensors", "positional writes of 6 of 16 data bytes"});
  }
  EXPECT_FALSE(std::filesystem::exists(path("m1.safetensors")));
  EXPECT_FALSE(std::filesystem::exists(path("m1.safetensors.tmp")));
  SafetensorsWriter w(path("m2.safetensors"), es);
  w.write(bytes, 3);
  expect_error([&] { w.write_at(3, bytes, 1); }, Errc::invalid_argument,
               {"positional write after appending writes"});
}

}  // namespace
}  // namespace weightsync
