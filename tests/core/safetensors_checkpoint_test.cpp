// Checkpoint directories: an index over several files, a lone file, and the
// ways an index and its files can disagree.
#include "core/safetensors_test_util.h"

#include <weightsync/safetensors.h>

#include <gtest/gtest.h>

#include <cstring>

namespace weightsync {
namespace {

using testing::expect_error;
using testing::image;
using testing::write_bytes;
namespace fs = std::filesystem;

class SafetensorsCheckpoint : public testing::ScratchDir {
 protected:
  // Writes a file of U8 tensors whose bytes are all `fill`.
  void write_u8(const std::string& name, const std::vector<std::pair<std::string, int>>& tensors,
                char fill) {
    std::vector<SafetensorsWriter::Entry> entries;
    for (const auto& [key, n] : tensors) entries.push_back({key, DType::U8, {n}});
    SafetensorsWriter writer(path(name), entries, {{"file", name}});
    for (const auto& [key, n] : tensors) {
      std::string bytes(size_t(n), fill);
      writer.write_tensor(key, bytes.data(), bytes.size());
    }
    writer.finish();
  }
  void write_index(const std::string& weight_map, const std::string& extra = "") {
    write_bytes(path("model.safetensors.index.json"),
                R"({"metadata": {"total_size": 9, "format": "pt"}, "weight_map": )" + weight_map +
                    extra + "}");
  }
  void three_shards() {
    write_u8("model-00001-of-00003.safetensors", {{"a", 2}, {"b", 1}}, 'x');
    write_u8("model-00002-of-00003.safetensors", {{"c", 3}}, 'y');
    write_u8("model-00003-of-00003.safetensors", {{"d", 3}, {"e", 0}}, 'z');
  }
  std::string index_path() const { return path("model.safetensors.index.json"); }
};

TEST_F(SafetensorsCheckpoint, IndexOverSeveralFiles) {
  three_shards();
  write_index(
      R"({"a": "model-00001-of-00003.safetensors", "b": "model-00001-of-00003.safetensors",)"
      R"( "c": "model-00002-of-00003.safetensors", "d": "model-00003-of-00003.safetensors",)"
      R"( "e": "model-00003-of-00003.safetensors"})");
  Checkpoint ckpt = Checkpoint::open(dir_.string());
  EXPECT_EQ(ckpt.path(), dir_.string());
  EXPECT_EQ(ckpt.keys(), (std::vector<std::string>{"a", "b", "c", "d", "e"}));
  EXPECT_EQ(ckpt.files().size(), 3u);
  EXPECT_EQ(ckpt.metadata().at("total_size"), "9");
  EXPECT_EQ(ckpt.metadata().at("format"), "pt");
  EXPECT_TRUE(ckpt.contains("c"));
  EXPECT_FALSE(ckpt.contains("f"));
  EXPECT_EQ(std::string(static_cast<const char*>(ckpt.view("c").data), 3), "yyy");
  EXPECT_EQ(std::string(static_cast<const char*>(ckpt.view("a").data), 2), "xx");
  EXPECT_EQ(std::string(static_cast<const char*>(ckpt.view("d").data), 3), "zzz");
  EXPECT_EQ(ckpt.view("e").nbytes(), 0u);
  EXPECT_EQ(ckpt.info("d").shape, (Shape{3}));
  expect_error([&] { ckpt.view("f"); }, Errc::not_found, {"'f'", dir_.string()});
  expect_error([&] { ckpt.info("f"); }, Errc::not_found, {"'f'", dir_.string()});
}

TEST_F(SafetensorsCheckpoint, KeysOutsideTheWeightMapAreStillServed) {
  // vLLM loads every tensor of the files an index names; so do we.
  three_shards();
  write_index(R"({"a": "model-00001-of-00003.safetensors"})");
  Checkpoint ckpt = Checkpoint::open(dir_.string());
  EXPECT_TRUE(ckpt.contains("b"));
  EXPECT_FALSE(ckpt.contains("c"));  // its file is not named by the index
}

TEST_F(SafetensorsCheckpoint, LoneFileDirectory) {
  write_u8("weights.safetensors", {{"w", 4}}, 'q');
  Checkpoint ckpt = Checkpoint::open(dir_.string());
  EXPECT_EQ(ckpt.keys(), std::vector<std::string>{"w"});
  EXPECT_EQ(ckpt.metadata().at("file"), "weights.safetensors");
}

TEST_F(SafetensorsCheckpoint, NothingToOpen) {
  expect_error([&] { Checkpoint::open(path("nowhere")); }, Errc::not_found, {path("nowhere")});
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::not_found,
               {dir_.string(), "no .safetensors file"});
}

TEST_F(SafetensorsCheckpoint, SeveralFilesWithoutIndex) {
  three_shards();
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format,
               {dir_.string(), "3 .safetensors files", "model.safetensors.index.json"});
}

TEST_F(SafetensorsCheckpoint, IndexNamesAMissingFile) {
  three_shards();
  write_index(R"({"a": "model-00001-of-00003.safetensors", "q": "model-gone.safetensors"})");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::not_found,
               {"model-gone.safetensors", "'q'", "model.safetensors.index.json"});
}

TEST_F(SafetensorsCheckpoint, IndexKeyMissingFromItsFile) {
  three_shards();
  write_index(
      R"({"a": "model-00001-of-00003.safetensors", "zz": "model-00001-of-00003.safetensors"})");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format,
               {"'zz'", "model-00001-of-00003.safetensors", "no such tensor"});
}

TEST_F(SafetensorsCheckpoint, IndexMapsAKeyToTheWrongFile) {
  three_shards();
  write_index(
      R"({"a": "model-00002-of-00003.safetensors", "d": "model-00001-of-00003.safetensors",)"
      R"( "e": "model-00003-of-00003.safetensors"})");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format,
               {"'a'", "mapped to model-00002-of-00003.safetensors", "lives in"});
}

TEST_F(SafetensorsCheckpoint, SameKeyInTwoFiles) {
  write_u8("one.safetensors", {{"a", 1}, {"shared", 2}}, '1');
  write_u8("two.safetensors", {{"shared", 2}}, '2');
  write_index(R"({"a": "one.safetensors", "shared": "two.safetensors"})");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format,
               {"'shared'", "two files", "one.safetensors", "two.safetensors"});
}

TEST_F(SafetensorsCheckpoint, MalformedIndex) {
  write_u8("one.safetensors", {{"a", 1}}, '1');
  write_bytes(index_path(), "{\"weight_map\": ");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format,
               {index_path(), "not valid JSON"});
  write_bytes(index_path(), "[]");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format, {index_path(), "object"});
  write_bytes(index_path(), R"({"metadata": {}})");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format,
               {index_path(), "missing \"weight_map\""});
  write_bytes(index_path(), R"({"weight_map": ["one.safetensors"]})");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format, {"\"weight_map\""});
  write_bytes(index_path(), R"({"metadata": [], "weight_map": {"a": "one.safetensors"}})");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format,
               {index_path(), "\"metadata\" must be an object"});
  write_bytes(index_path(), R"({"weight_map": {"a": 3}})");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format, {"'a'", "file name"});
  write_bytes(index_path(), R"({"weight_map": {"a": "one.safetensors", "a": "two.safetensors"}})");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format,
               {index_path(), "duplicate key 'a'"});
}

TEST_F(SafetensorsCheckpoint, MalformedShardNamesTheShard) {
  write_u8("one.safetensors", {{"a", 1}}, '1');
  write_bytes(path("two.safetensors"), image(R"({"b":{"dtype":"U8","shape":[1]}})", 1));
  write_index(R"({"a": "one.safetensors", "b": "two.safetensors"})");
  expect_error([&] { Checkpoint::open(dir_.string()); }, Errc::format,
               {path("two.safetensors"), "'b'", "data_offsets"});
}

}  // namespace
}  // namespace weightsync
