// Round trips through SafetensorsWriter and the reader, the writer's misuse
// errors and its temp-file discipline.
#include "core/safetensors_test_util.h"

#include <nlohmann/json.hpp>

#include <weightsync/safetensors.h>

#include <gtest/gtest.h>

#include <cstring>
#include <random>

namespace weightsync {
namespace {

using testing::expect_error;
using testing::image;
using testing::le64;
using testing::write_bytes;
namespace fs = std::filesystem;

class SafetensorsRoundTrip : public testing::ScratchDir {};
class SafetensorsWriterTest : public testing::ScratchDir {};

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(gen());
  return out;
}

uint64_t nbytes_of(const SafetensorsWriter::Entry& e) {
  return static_cast<uint64_t>(numel(e.shape)) * itemsize(e.dtype);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

const std::vector<DType> kAllDTypes = {DType::BOOL, DType::U8,      DType::I8,      DType::I16,
                                       DType::U16,  DType::I32,     DType::U32,     DType::I64,
                                       DType::U64,  DType::F16,     DType::BF16,    DType::F32,
                                       DType::F64,  DType::F8_E4M3, DType::F8_E5M2, DType::F8_E8M0};

TEST_F(SafetensorsRoundTrip, EveryDTypeScalarsZeroSizedAndMetadata) {
  std::vector<SafetensorsWriter::Entry> entries;
  for (size_t i = 0; i < kAllDTypes.size(); ++i)
    entries.push_back({cat("t.", dtype_name(kAllDTypes[i])), kAllDTypes[i],
                       Shape{int64_t(i % 3 + 1), int64_t(i + 2)}});
  entries.push_back({"scalar", DType::F32, Shape{}});
  entries.push_back({"empty.rows", DType::BF16, Shape{0, 7}});
  entries.push_back({"empty.cols", DType::F64, Shape{5, 0}});
  entries.push_back({"last", DType::I32, Shape{3}});
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "42"}};

  std::vector<std::vector<uint8_t>> payloads;
  const std::string file = path("all.safetensors");
  {
    SafetensorsWriter writer(file, entries, meta);
    for (size_t i = 0; i < entries.size(); ++i) {
      payloads.push_back(random_bytes(nbytes_of(entries[i]), uint32_t(i)));
      writer.write_tensor(entries[i].name, payloads[i].data(), payloads[i].size());
    }
    writer.finish();
  }
  EXPECT_FALSE(fs::exists(file + ".tmp"));

  auto st = SafetensorsFile::open(file);
  EXPECT_EQ(st->path(), file);
  EXPECT_EQ(st->metadata(), meta);
  ASSERT_EQ(st->tensors().size(), entries.size());
  for (size_t i = 1; i < st->tensors().size(); ++i)
    EXPECT_LE(st->tensors()[i - 1].end, st->tensors()[i].begin) << "sorted by offset";
  for (size_t i = 0; i < entries.size(); ++i) {
    SCOPED_TRACE(entries[i].name);
    const TensorInfo* info = st->find(entries[i].name);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(info->dtype, entries[i].dtype);
    EXPECT_EQ(info->shape, entries[i].shape);
    EXPECT_EQ(info->end - info->begin, payloads[i].size());
    TensorView v = st->view(entries[i].name);
    EXPECT_EQ(v.memory, MemoryKind::host);
    EXPECT_EQ(v.dtype, entries[i].dtype);
    EXPECT_EQ(v.shape, entries[i].shape);
    ASSERT_EQ(v.nbytes(), payloads[i].size());
    if (!payloads[i].empty()) {
      EXPECT_EQ(std::memcmp(v.data, payloads[i].data(), v.nbytes()), 0);
    }
  }

  // The same file through Checkpoint, as a path and as a one-file directory.
  for (const std::string& where : {file, dir_.string()}) {
    Checkpoint ckpt = Checkpoint::open(where);
    const auto keys = ckpt.keys();
    EXPECT_EQ(keys.size(), entries.size());
    EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
    EXPECT_EQ(ckpt.metadata(), meta);
    TensorView v = ckpt.view("last");
    EXPECT_EQ(std::memcmp(v.data, payloads.back().data(), 12), 0);
    EXPECT_EQ(ckpt.info("t.BF16").dtype, DType::BF16);
  }
}

TEST_F(SafetensorsRoundTrip, ExactBytesFollowTheSpec) {
  // Header padded with spaces to a multiple of 8, little-endian length,
  // data right after it in declaration order.
  const std::string file = path("exact.safetensors");
  SafetensorsWriter writer(file, {{"b", DType::U8, {2}}, {"a", DType::I16, {1}}});
  writer.write("\x01\x02\x03\x04", 4);
  writer.finish();
  const std::string json = R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                           R"("a":{"dtype":"I16","shape":[1],"data_offsets":[2,4]}})";
  std::string padded = json + std::string((8 - json.size() % 8) % 8, ' ');
  EXPECT_EQ(read_file(file), le64(padded.size()) + padded + "\x01\x02\x03\x04");
}

TEST_F(SafetensorsRoundTrip, EmptyFileAndOnlyZeroSizedTensors) {
  const std::string none = path("none.safetensors");
  {
    SafetensorsWriter writer(none, {});
    writer.finish();
  }
  EXPECT_EQ(read_file(none), le64(8) + "{}      ");
  EXPECT_TRUE(SafetensorsFile::open(none)->tensors().empty());

  const std::string zeros = path("zeros.safetensors");
  {
    SafetensorsWriter writer(zeros, {{"z0", DType::F32, {0}}, {"z1", DType::U8, {2, 0, 3}}});
    writer.write_tensor("z0", nullptr, 0);
    writer.write_tensor("z1", nullptr, 0);
    writer.finish();
  }
  auto st = SafetensorsFile::open(zeros);
  ASSERT_EQ(st->tensors().size(), 2u);
  EXPECT_EQ(st->view("z1").nbytes(), 0u);
}

TEST_F(SafetensorsRoundTrip, ChunkedWritesAcrossTensorsAndPastTheStagingBuffer) {
  // 9 MiB tensor: larger than the writer's staging buffer.
  std::vector<SafetensorsWriter::Entry> entries = {
      {"small", DType::F16, {3, 5}}, {"big", DType::F32, {9, 1 << 18}}, {"tail", DType::U8, {7}}};
  uint64_t total = 0;
  for (const auto& e : entries) total += nbytes_of(e);
  const auto data = random_bytes(total, 7);
  const std::string file = path("chunks.safetensors");
  SafetensorsWriter writer(file, entries);
  std::mt19937 gen(3);
  for (size_t at = 0; at < data.size();) {
    size_t n = std::min<size_t>(data.size() - at, gen() % 3000000 + 1);
    writer.write(data.data() + at, n);
    at += n;
  }
  writer.finish();
  auto st = SafetensorsFile::open(file);
  uint64_t at = 0;
  for (const auto& e : entries) {
    TensorView v = st->view(e.name);
    EXPECT_EQ(std::memcmp(v.data, data.data() + at, v.nbytes()), 0) << e.name;
    at += v.nbytes();
  }
}

TEST_F(SafetensorsWriterTest, RejectsTooManyAndTooFewBytes) {
  const std::string file = path("w.safetensors");
  SafetensorsWriter writer(file, {{"x", DType::F32, {2}}, {"y", DType::U8, {3}}});
  const char bytes[16] = {};
  expect_error([&] { writer.write(bytes, 12); }, Errc::invalid_argument, {file, "past", "11"});
  expect_error([&] { writer.write(nullptr, 1); }, Errc::invalid_argument, {"null"});
  writer.write(bytes, 9);
  expect_error([&] { writer.finish(); }, Errc::mismatch, {file, "'y'", "1 of its 3"});
  writer.write(bytes, 2);
  writer.finish();
  EXPECT_EQ(SafetensorsFile::open(file)->tensors().size(), 2u);
  expect_error([&] { writer.finish(); }, Errc::invalid_argument, {"twice"});
  expect_error([&] { writer.write(bytes, 1); }, Errc::invalid_argument, {"after finish"});
}

TEST_F(SafetensorsWriterTest, WriteTensorChecksNameOrderAndSize) {
  const std::string file = path("w.safetensors");
  SafetensorsWriter writer(file, {{"first", DType::BF16, {2}}, {"second", DType::U8, {1}}});
  const char bytes[8] = {};
  expect_error([&] { writer.write_tensor("second", bytes, 1); }, Errc::invalid_argument,
               {file, "'second'", "next declared tensor is 'first'"});
  expect_error([&] { writer.write_tensor("first", bytes, 3); }, Errc::mismatch,
               {file, "'first'", "needs 4 bytes, got 3"});
  writer.write(bytes, 1);
  expect_error([&] { writer.write_tensor("first", bytes, 4); }, Errc::invalid_argument,
               {"'first'", "already written"});
  writer.write(bytes, 3);
  writer.write_tensor("second", bytes, 1);
  expect_error([&] { writer.write_tensor("third", bytes, 1); }, Errc::invalid_argument,
               {"'third'", "already written"});
  writer.finish();
}

TEST_F(SafetensorsWriterTest, ZeroSizedTensorsMayBeNamedOrSkipped) {
  const std::string file = path("z.safetensors");
  SafetensorsWriter writer(file, {{"a", DType::U8, {2}},
                                  {"z1", DType::F32, {0}},
                                  {"z2", DType::F32, {0}},
                                  {"b", DType::U8, {1}},
                                  {"z3", DType::U8, {0}}});
  writer.write_tensor("a", "ab", 2);
  writer.write_tensor("z2", nullptr, 0);  // skips z1: it holds no bytes
  expect_error([&] { writer.write_tensor("z1", nullptr, 0); }, Errc::invalid_argument,
               {"'z1'", "next declared tensor is 'b'"});
  writer.write("c", 1);  // covers b; z3 may still be named
  writer.write_tensor("z3", nullptr, 0);
  writer.finish();
  auto st = SafetensorsFile::open(file);
  EXPECT_EQ(st->tensors().size(), 5u);
  EXPECT_EQ(*static_cast<const char*>(st->view("b").data), 'c');
}

TEST_F(SafetensorsWriterTest, RejectsBadDeclarations) {
  const std::string file = path("w.safetensors");
  using E = SafetensorsWriter::Entry;
  expect_error(
      [&] {
        SafetensorsWriter w(file, {E{"a", DType::U8, {1}}, E{"a", DType::U8, {2}}});
      },
      Errc::invalid_argument, {file, "'a'", "twice"});
  expect_error(
      [&] {
        SafetensorsWriter w(file, {E{"__metadata__", DType::U8, {1}}});
      },
      Errc::invalid_argument, {"reserved"});
  expect_error(
      [&] {
        SafetensorsWriter w(file, {E{"neg", DType::U8, {2, -1}}});
      },
      Errc::invalid_argument, {"'neg'", "negative"});
  expect_error(
      [&] {
        SafetensorsWriter w(file, {E{"huge", DType::F32, {1LL << 40, 1LL << 40}}});
      },
      Errc::invalid_argument, {"'huge'", "overflows"});
  EXPECT_FALSE(fs::exists(file + ".tmp"));
  EXPECT_FALSE(fs::exists(file));
}

TEST_F(SafetensorsWriterTest, UnwritablePathIsAnIoErrorNamingIt) {
  const std::string file = path("no/such/dir/w.safetensors");
  expect_error(
      [&] {
        SafetensorsWriter w(file, {{"a", DType::U8, {1}}});
      },
      Errc::io, {file + ".tmp"});
}

TEST_F(SafetensorsWriterTest, UnfinishedWriterLeavesNothingAndKeepsTheOldFile) {
  const std::string fresh = path("fresh.safetensors");
  {
    SafetensorsWriter writer(fresh, {{"a", DType::U8, {4}}});
    writer.write("ab", 2);
    EXPECT_TRUE(fs::exists(fresh + ".tmp"));
  }
  EXPECT_FALSE(fs::exists(fresh + ".tmp"));
  EXPECT_FALSE(fs::exists(fresh));

  const std::string existing = path("existing.safetensors");
  {
    SafetensorsWriter writer(existing, {{"old", DType::U8, {3}}});
    writer.write("old", 3);
    writer.finish();
  }
  const std::string before = read_file(existing);
  {
    SafetensorsWriter writer(existing, {{"new", DType::U8, {3}}});
    writer.write("new", 3);  // complete, but never finished
  }
  EXPECT_EQ(read_file(existing), before);
  EXPECT_FALSE(fs::exists(existing + ".tmp"));
  EXPECT_NE(SafetensorsFile::open(existing)->find("old"), nullptr);
}

TEST_F(SafetensorsWriterTest, FinishReplacesAnExistingFile) {
  const std::string file = path("f.safetensors");
  write_bytes(file, image("{}", 0));
  SafetensorsWriter writer(file, {{"x", DType::I64, {1}}});
  const int64_t v = -5;
  writer.write_tensor("x", &v, sizeof v);
  writer.finish();
  EXPECT_EQ(*static_cast<const int64_t*>(SafetensorsFile::open(file)->view("x").data), -5);
}

}  // namespace
}  // namespace weightsync
