// Helpers shared by the safetensors tests: a scratch directory per test,
// hand-crafted files (for malformed inputs) and an error matcher.
#pragma once

#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>

namespace weightsync::testing {

// A fresh directory under the system temp dir, removed with the fixture.
class ScratchDir : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    // Parameterized names hold '/': one flat directory per test all the same.
    std::string name = std::string("ws_st_") + info->test_suite_name() + "_" + info->name() + "_" +
                       std::to_string(::getpid());
    std::replace(name.begin(), name.end(), '/', '_');
    dir_ = std::filesystem::temp_directory_path() / name;
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  std::filesystem::path dir_;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

// The 8-byte little-endian length prefix.
inline std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file image with `header` as given (no padding) and `data_bytes` of data.
inline std::string image(const std::string& header, uint64_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\x5a');
}

// Runs `f`, expects a weightsync::Error with `code` whose message contains
// every one of `parts`.
template <class F>
void expect_error(F&& f, Errc code, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected an Error [" << errc_name(code) << "], got none";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << "message: " << e.what();
    const std::string what = e.what();
    for (const auto& p : parts)
      EXPECT_NE(what.find(p), std::string::npos) << "'" << p << "' not in: " << what;
  }
}

}  // namespace weightsync::testing
