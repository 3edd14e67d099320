// Every malformed safetensors file is a weightsync::Error naming the file and
// the key, never a crash: one crafted file per case.
#include "core/safetensors_test_util.h"

#include <weightsync/safetensors.h>

#include <gtest/gtest.h>

namespace weightsync {
namespace {

using testing::expect_error;
using testing::image;
using testing::le64;
using testing::write_bytes;

class SafetensorsMalformed : public testing::ScratchDir {
 protected:
  // Writes `bytes` to a file and expects open() to fail with `code`, the file
  // name and `parts` in the message.
  void expect_rejected(const std::string& bytes, Errc code,
                       std::initializer_list<std::string> parts) {
    const std::string file = path("bad.safetensors");
    write_bytes(file, bytes);
    expect_error([&] { SafetensorsFile::open(file); }, code, parts);
    expect_error([&] { SafetensorsFile::open(file); }, code, {file});
  }
  // A header with one entry "w" whose body is `entry`, over `data` bytes.
  void expect_entry_rejected(const std::string& entry, uint64_t data,
                             std::initializer_list<std::string> parts) {
    expect_rejected(image(R"({"w":)" + entry + "}", data), Errc::format, parts);
    expect_error([&] { SafetensorsFile::open(path("bad.safetensors")); }, Errc::format, {"'w'"});
  }
};

TEST_F(SafetensorsMalformed, ShorterThanTheLengthPrefix) {
  expect_rejected("", Errc::format, {"too short"});
  expect_rejected(std::string("\x10\0\0\0\0\0\0", 7), Errc::format, {"7 bytes", "too short"});
}

TEST_F(SafetensorsMalformed, HeaderLengthPastTheEnd) {
  expect_rejected(le64(64) + "{}", Errc::format, {"header length 64", "past the end"});
  expect_rejected(le64(~uint64_t(0)) + "{}", Errc::format, {"exceeds the limit"});
  expect_rejected(le64(kMaxSafetensorsHeaderBytes + 1) + "{}", Errc::format, {"exceeds the limit"});
}

TEST_F(SafetensorsMalformed, HeaderNotJsonOrNotAnObject) {
  expect_rejected(image("{\"w\": ", 0), Errc::format, {"not valid JSON"});
  expect_rejected(image("[1, 2]", 0), Errc::format, {"JSON object"});
  expect_rejected(image(" {}", 0), Errc::format, {"starting with '{'"});
  expect_rejected(image("", 0), Errc::format, {"starting with '{'"});
  expect_rejected(image("{} {}", 0), Errc::format, {"not valid JSON"});
  expect_rejected(image("{\"w\": \"\xff\"}", 0), Errc::format, {"not valid JSON"});
}

TEST_F(SafetensorsMalformed, EntryNotAnObject) {
  expect_entry_rejected("[1, 2]", 0, {"must be an object"});
  expect_entry_rejected("\"F32\"", 0, {"must be an object"});
}

TEST_F(SafetensorsMalformed, MissingFields) {
  expect_entry_rejected(R"({"shape":[1],"data_offsets":[0,1]})", 1, {"missing \"dtype\""});
  expect_entry_rejected(R"({"dtype":"U8","data_offsets":[0,1]})", 1, {"missing \"shape\""});
  expect_entry_rejected(R"({"dtype":"U8","shape":[1]})", 1, {"missing \"data_offsets\""});
}

TEST_F(SafetensorsMalformed, MistypedFields) {
  expect_entry_rejected(R"({"dtype":8,"shape":[1],"data_offsets":[0,1]})", 1,
                        {"\"dtype\" must be a string"});
  expect_entry_rejected(R"({"dtype":"U8","shape":"1","data_offsets":[0,1]})", 1,
                        {"\"shape\" must be an array"});
  expect_entry_rejected(R"({"dtype":"U8","shape":[1],"data_offsets":[0]})", 1, {"[begin, end]"});
  expect_entry_rejected(R"({"dtype":"U8","shape":[1],"data_offsets":[0,"1"]})", 1,
                        {"[begin, end]"});
  expect_entry_rejected(R"({"dtype":"U8","shape":[1],"data_offsets":[0,1,2]})", 1,
                        {"[begin, end]"});
  expect_entry_rejected(R"({"dtype":"U8","shape":[1],"data_offsets":[-1,1]})", 1, {"[begin, end]"});
  expect_entry_rejected(R"({"dtype":"U8","shape":[1],"data_offsets":{"a":0}})", 1,
                        {"[begin, end]"});
}

TEST_F(SafetensorsMalformed, NegativeNonIntegerAndHugeDims) {
  expect_entry_rejected(R"({"dtype":"U8","shape":[-1],"data_offsets":[0,0]})", 0, {"dim 0", "-1"});
  expect_entry_rejected(R"({"dtype":"U8","shape":[2, 1.5],"data_offsets":[0,3]})", 3,
                        {"dim 1", "integer"});
  expect_entry_rejected(R"({"dtype":"U8","shape":[true],"data_offsets":[0,1]})", 1,
                        {"dim 0", "integer"});
  expect_entry_rejected(R"({"dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,0]})", 0,
                        {"dim 0"});
  expect_entry_rejected(R"({"dtype":"U8","shape":[1e3],"data_offsets":[0,1000]})", 1000,
                        {"dim 0", "integer"});
}

TEST_F(SafetensorsMalformed, ShapeProductOverflow) {
  expect_entry_rejected(R"({"dtype":"U8","shape":[4294967296, 4294967296],"data_offsets":[0,0]})",
                        0, {"overflow"});
  // Zeros do not excuse an overflowing product of the other dims.
  expect_entry_rejected(
      R"({"dtype":"U8","shape":[0, 4294967296, 4294967296],"data_offsets":[0,0]})", 0,
      {"overflow"});
  // Fits in elements, overflows in bytes.
  expect_entry_rejected(R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]})", 0,
                        {"needs"});
}

TEST_F(SafetensorsMalformed, UnknownDType) {
  expect_entry_rejected(R"({"dtype":"F31","shape":[1],"data_offsets":[0,4]})", 4,
                        {"unknown dtype 'F31'"});
  expect_entry_rejected(R"({"dtype":"f32","shape":[1],"data_offsets":[0,4]})", 4,
                        {"unknown dtype 'f32'"});
}

TEST_F(SafetensorsMalformed, OffsetsOutOfRangeOrReversed) {
  expect_entry_rejected(R"({"dtype":"U8","shape":[8],"data_offsets":[0,8]})", 4,
                        {"past the data section of 4 bytes"});
  expect_entry_rejected(R"({"dtype":"U8","shape":[0],"data_offsets":[4,0]})", 4,
                        {"begin 4 is past end 0"});
  expect_entry_rejected(
      R"({"dtype":"U8","shape":[1],"data_offsets":[18446744073709551615,18446744073709551615]})", 1,
      {"past the data section"});
}

TEST_F(SafetensorsMalformed, ByteLengthDisagreesWithShape) {
  expect_entry_rejected(R"({"dtype":"F32","shape":[2],"data_offsets":[0,4]})", 4,
                        {"shape [2] of F32", "hold 4"});
  expect_entry_rejected(R"({"dtype":"BF16","shape":[],"data_offsets":[0,4]})", 4, {"hold 4"});
}

TEST_F(SafetensorsMalformed, OverlapsGapsAndTrailingBytes) {
  const std::string a = R"("a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]})";
  expect_rejected(image("{" + a + R"(,"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6),
                  Errc::format, {"'b'", "overlap tensor 'a'"});
  expect_rejected(image("{" + a + R"(,"b":{"dtype":"U8","shape":[2],"data_offsets":[6,8]}})", 8),
                  Errc::format, {"'b'", "gap of 2 bytes after tensor 'a'"});
  expect_rejected(image(R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})", 4),
                  Errc::format, {"'b'", "gap of 2 bytes after the data start"});
  expect_rejected(image("{" + a + "}", 5), Errc::format, {"cover 4 bytes", "1 trailing"});
  expect_rejected(image("{}", 3), Errc::format, {"cover 0 bytes", "3 trailing"});
}

TEST_F(SafetensorsMalformed, DuplicateKeys) {
  const std::string a = R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]})";
  expect_rejected(image("{" + a + "," + a + "}", 2), Errc::format, {"duplicate key 'a'"});
  expect_rejected(image(R"({"a":{"dtype":"U8","dtype":"I8","shape":[2],"data_offsets":[0,2]}})", 2),
                  Errc::format, {"duplicate key 'dtype'"});
  expect_rejected(image(R"({"__metadata__":{"k":"1","k":"2"}})", 0), Errc::format,
                  {"duplicate key 'k'"});
  // Equal keys in different objects are fine.
  const std::string file = path("ok.safetensors");
  write_bytes(file, image(R"({"__metadata__":{"a":"x"},)" + a + "}", 2));
  EXPECT_EQ(SafetensorsFile::open(file)->metadata().at("a"), "x");
}

TEST_F(SafetensorsMalformed, MetadataNotAStringMap) {
  expect_rejected(image(R"({"__metadata__":["x"]})", 0), Errc::format,
                  {"__metadata__", "object of strings"});
  expect_rejected(image(R"({"__metadata__":{"total_size":12}})", 0), Errc::format,
                  {"'total_size'", "must be a string"});
  expect_rejected(image(R"({"__metadata__":null})", 0), Errc::format, {"__metadata__"});
}

TEST_F(SafetensorsMalformed, LegalEdgeCasesAreAccepted) {
  // Trailing-space padding, zero-sized tensors anywhere (also at the end of
  // the data), unknown extra fields in an entry.
  const std::string file = path("ok.safetensors");
  write_bytes(file, image(R"({"z":{"dtype":"F32","shape":[0,4],"data_offsets":[0,0]},)"
                          R"("a":{"dtype":"U16","shape":[2],"data_offsets":[0,4],"x":1},)"
                          R"("y":{"dtype":"F32","shape":[3,0],"data_offsets":[4,4]}}    )",
                          4));
  auto st = SafetensorsFile::open(file);
  ASSERT_EQ(st->tensors().size(), 3u);
  EXPECT_EQ(st->tensors()[0].name, "z");
  EXPECT_EQ(st->tensors()[2].name, "y");
  EXPECT_EQ(st->view("a").nbytes(), 4u);
}

TEST_F(SafetensorsMalformed, MissingFilesAndKeys) {
  const std::string missing = path("missing.safetensors");
  expect_error([&] { SafetensorsFile::open(missing); }, Errc::not_found, {missing});
  expect_error([&] { SafetensorsFile::open(dir_.string()); }, Errc::io,
               {dir_.string(), "regular file"});
  const std::string file = path("ok.safetensors");
  write_bytes(file, image("{}", 0));
  auto st = SafetensorsFile::open(file);
  expect_error([&] { st->view("nope"); }, Errc::not_found, {file, "'nope'"});
  EXPECT_EQ(st->find("nope"), nullptr);
}

TEST(SafetensorsHeaderParser, ParsesWithoutAFile) {
  auto h = parse_safetensors_header(R"({"a":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}})",
                                    16, "mem");
  ASSERT_EQ(h.tensors.size(), 1u);
  EXPECT_EQ(h.tensors[0].shape, (Shape{2, 2}));
  expect_error([] { parse_safetensors_header("{}", 1, "mem"); }, Errc::format, {"mem"});
  auto layout = parse_safetensors_image(image("{}      ", 0), "img");
  EXPECT_EQ(layout.data_offset, 16u);
  expect_error([] { parse_safetensors_image("1234567", "img"); }, Errc::format, {"img"});
}

}  // namespace
}  // namespace weightsync
