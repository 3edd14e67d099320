// `weightsync inspect`, run as the real command on files written by the writer.
#include "core/safetensors_test_util.h"

#include <weightsync/safetensors.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <cstdio>

namespace weightsync {
namespace {

using testing::image;
using testing::write_bytes;

struct CommandResult {
  int status = -1;
  std::string output;  // stdout, or stdout + stderr
};

CommandResult run_cli(const std::string& args, bool with_stderr) {
  const std::string cmd =
      std::string("'") + WEIGHTSYNC_CLI + "' " + args + (with_stderr ? " 2>&1" : " 2>/dev/null");
  CommandResult result;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return result;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) result.output.append(buf, n);
  const int raw = ::pclose(pipe);
  result.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  return result;
}

class SafetensorsInspect : public testing::ScratchDir {
 protected:
  void SetUp() override {
    ScratchDir::SetUp();
    SafetensorsWriter writer(path("m.safetensors"),
                             {{"model.embed_tokens.weight", DType::BF16, {4, 3}},
                              {"model.norm.weight", DType::F32, {3}},
                              {"empty", DType::F8_E4M3, {0, 2}}},
                             {{"format", "pt"}});
    std::string bytes(24 + 12, '\1');
    writer.write(bytes.data(), bytes.size());
    writer.finish();
  }
};

TEST_F(SafetensorsInspect, JsonListsEveryTensorAndTheTotal) {
  const auto r = run_cli("inspect '" + path("m.safetensors") + "' --json", false);
  ASSERT_EQ(r.status, 0) << r.output;
  const auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j.at("path"), path("m.safetensors"));
  EXPECT_EQ(j.at("total_bytes"), 36);
  EXPECT_EQ(j.at("metadata"), (nlohmann::json{{"format", "pt"}}));
  ASSERT_EQ(j.at("tensors").size(), 3u);
  const auto& embed = j.at("tensors").at(1);  // sorted by name: empty, model.embed..., model.norm
  EXPECT_EQ(embed.at("name"), "model.embed_tokens.weight");
  EXPECT_EQ(embed.at("dtype"), "BF16");
  EXPECT_EQ(embed.at("shape"), (nlohmann::json{4, 3}));
  EXPECT_EQ(embed.at("bytes"), 24);
  EXPECT_EQ(j.at("tensors").at(0).at("bytes"), 0);
}

TEST_F(SafetensorsInspect, TableOnADirectory) {
  const auto r = run_cli("inspect '" + dir_.string() + "'", false);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("model.norm.weight"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("F8_E4M3"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[4, 3]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("3 tensors, 36 bytes"), std::string::npos) << r.output;
}

TEST_F(SafetensorsInspect, MalformedFileIsAnErrorNamingIt) {
  const std::string bad = path("bad.safetensors");
  write_bytes(bad, image(R"({"w":{"dtype":"Q8","shape":[1],"data_offsets":[0,1]}})", 1));
  const auto r = run_cli("inspect '" + bad + "'", true);
  EXPECT_EQ(r.status, 1) << r.output;
  EXPECT_NE(r.output.find("[format]"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(bad), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("'w'"), std::string::npos) << r.output;
}

TEST_F(SafetensorsInspect, UsageErrors) {
  EXPECT_EQ(run_cli("inspect", true).status, 2);
  EXPECT_EQ(run_cli("inspect a b", true).status, 2);
  EXPECT_EQ(run_cli("inspect --bogus x", true).status, 2);
  const auto help = run_cli("inspect --help", false);
  EXPECT_EQ(help.status, 0);
  EXPECT_NE(help.output.find("usage: weightsync inspect"), std::string::npos);
  EXPECT_EQ(run_cli("inspect '" + path("missing") + "'", true).status, 1);
}

}  // namespace
}  // namespace weightsync
