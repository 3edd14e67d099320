// materialize and fill_param against an element-by-element reference, the
// CLI against the library, and the checkpoint errors; random checkpoints.
#include "layouts/engine_test_util.h"

#include <nlohmann/json.hpp>

#include <weightsync/layouts.h>
#include <weightsync/materialize.h>
#include <weightsync/safetensors.h>

#include "core/random_checkpoint.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace weightsync {
namespace {

using testing::engine;
using testing::throws_errc;

namespace fs = std::filesystem;

class Materialize : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ws_materialize_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  fs::path dir_;
};

// The expected bytes of element `flat` of `p`: found by scanning the segments
// and recomputing the checkpoint element with fill_random (no copy_box).
uint64_t reference_element(const EngineParam& p, int64_t flat, uint64_t seed, uint64_t version,
                           const std::map<std::string, Shape>& hf) {
  Shape idx(p.shape.size());
  for (size_t d = p.shape.size(); d-- > 0;) {
    idx[d] = flat % p.shape[d];
    flat /= p.shape[d];
  }
  for (const auto& s : p.segments) {
    bool inside = true;
    for (size_t d = 0; d < idx.size(); ++d)
      inside = inside && idx[d] >= s.param_box.offsets[d] && idx[d] < s.param_box.end(d);
    if (!inside) continue;
    const size_t extra = s.param_box.rank() - s.hf_box.rank();
    const Shape& shape = hf.at(s.hf_key);
    int64_t src = 0;
    for (size_t d = 0; d < s.hf_box.rank(); ++d)
      src = src * shape[d] + s.hf_box.offsets[d] + idx[d + extra] - s.param_box.offsets[d + extra];
    uint64_t v = 0;
    fill_random(s.hf_key, p.dtype, seed, version, src, 1, &v);
    return v;
  }
  return 0;  // padding
}

void expect_matches_reference(const std::string& file, const EngineRankLayout& rank,
                              const HfModelConfig& hf_config, uint64_t seed, uint64_t version) {
  std::map<std::string, Shape> hf;
  for (const auto& t : hf_tensors(hf_config)) hf.emplace(t.key, t.shape);
  auto f = SafetensorsFile::open(file);
  ASSERT_EQ(f->tensors().size(), rank.params.size());
  for (const auto& p : rank.params) {
    const TensorView v = f->view(p.name);
    ASSERT_EQ(v.shape, p.shape) << p.name;
    ASSERT_EQ(v.dtype, p.dtype) << p.name;
    const size_t item = itemsize(p.dtype);
    for (int64_t e = 0; e < numel(p.shape); ++e) {
      uint64_t got = 0;
      std::memcpy(&got, static_cast<const char*>(v.data) + e * item, item);
      ASSERT_EQ(got, reference_element(p, e, seed, version, hf))
          << file << " " << p.name << " element " << e;
    }
  }
}

TEST_F(Materialize, EveryRankMatchesTheElementwiseReference) {
  struct Case {
    std::string model;
    int tp;
    bool ep;
    std::string placement, framework;
    int files;
  };
  const std::vector<Case> cases{{"tiny-llama", 4, false, "linear", "vllm", 0},
                                {"tiny-qwen2", 2, false, "linear", "vllm", 3},
                                {"tiny-qwen3-moe", 4, true, "round_robin", "vllm", 2},
                                {"tiny-qwen3-moe", 2, false, "linear", "sglang", 0},
                                {"tiny-mixtral", 2, true, "linear", "vllm", 0},
                                {"tiny-qwen2-moe", 2, false, "linear", "sglang", 2},
                                {"tiny-deepseek-v3", 4, false, "linear", "vllm", 3}};
  for (const auto& c : cases) {
    auto cfg = engine(c.model, c.tp, c.ep, c.placement, c.framework);
    if (c.model == "tiny-qwen3-moe" && c.framework == "sglang") cfg.moe_order = "w31";
    const std::string ckpt_path = path(c.model + (c.files ? "" : ".safetensors"));
    write_random_checkpoint(ckpt_path, hf_tensors(cfg.hf), {11, 3, c.files});
    const auto ckpt = Checkpoint::open(ckpt_path);
    const auto layout = make_engine_layout(cfg);
    for (int r = 0; r < c.tp; ++r) {
      const std::string out = path(c.model + "-rank" + std::to_string(r) + ".safetensors");
      materialize(ckpt, layout, r, out);
      SCOPED_TRACE(c.model + " rank " + std::to_string(r));
      expect_matches_reference(out, layout.ranks[static_cast<size_t>(r)], cfg.hf, 11, 3);
      if (::testing::Test::HasFatalFailure()) return;
    }
    fs::remove_all(ckpt_path);
  }
}

TEST_F(Materialize, FillParamEqualsTheFileAndGlobalRanksReduceModTp) {
  auto cfg = engine("tiny-llama", 4);
  cfg.replicas = 2;
  write_random_checkpoint(path("c.safetensors"), hf_tensors(cfg.hf), {5, 0, 0});
  const auto ckpt = Checkpoint::open(path("c.safetensors"));
  const auto layout = make_engine_layout(cfg);
  materialize(ckpt, layout, 7, path("g7.safetensors"));  // global 7 = replica 1, rank 3
  auto f = SafetensorsFile::open(path("g7.safetensors"));
  for (const auto& p : layout.ranks[3].params) {
    std::vector<char> buf(static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype), 'x');
    fill_param(ckpt, p, buf.data());
    const TensorView v = f->view(p.name);
    ASSERT_EQ(0, std::memcmp(buf.data(), v.data, buf.size())) << p.name;
  }
  EXPECT_TRUE(throws_errc([&] { materialize(ckpt, layout, 8, path("x.safetensors")); },
                          Errc::invalid_argument, "rank 8"));
  EXPECT_TRUE(throws_errc([&] { materialize(ckpt, layout, -1, path("x.safetensors")); },
                          Errc::invalid_argument));
}

TEST_F(Materialize, CheckpointDisagreeingWithTheConfigIsAClearError) {
  const auto cfg = engine("tiny-qwen2", 2);
  const auto layout = make_engine_layout(cfg);
  auto tensors = hf_tensors(cfg.hf);
  const std::string k = "model.layers.1.self_attn.k_proj.bias";
  auto missing = tensors;
  missing.erase(std::find_if(missing.begin(), missing.end(),
                             [&](const HfTensorSpec& t) { return t.key == k; }));
  write_random_checkpoint(path("missing.safetensors"), missing);
  EXPECT_TRUE(throws_errc(
      [&] { materialize(Checkpoint::open(path("missing.safetensors")), layout, 0, path("o")); },
      Errc::not_found, k));
  auto shaped = tensors;
  for (auto& t : shaped)
    if (t.key == k) t.shape = {40};
  write_random_checkpoint(path("shape.safetensors"), shaped);
  EXPECT_TRUE(throws_errc(
      [&] { materialize(Checkpoint::open(path("shape.safetensors")), layout, 1, path("o")); },
      Errc::mismatch, "[40]"));
  auto typed = tensors;
  for (auto& t : typed) t.dtype = DType::F32;
  write_random_checkpoint(path("f32.safetensors"), typed);
  EXPECT_TRUE(throws_errc(
      [&] { materialize(Checkpoint::open(path("f32.safetensors")), layout, 0, path("o")); },
      Errc::mismatch, "F32"));
  EXPECT_FALSE(fs::exists(path("o")));
}

TEST_F(Materialize, CliWritesTheSameBytesAsTheLibrary) {
  const std::string engine_json = std::string(WEIGHTSYNC_SOURCE_DIR) +
                                  "/configs/examples/engine_tiny_qwen3_moe_vllm_tp4_ep.json";
  const auto cfg = load_engine_config(engine_json);
  write_random_checkpoint(path("ckpt"), hf_tensors(cfg.hf), {9, 1, 2});
  const auto layout = make_engine_layout(cfg);
  materialize(Checkpoint::open(path("ckpt")), layout, 2, path("lib.safetensors"));
  const std::string cmd = std::string(WEIGHTSYNC_CLI) + " materialize --checkpoint " +
                          path("ckpt") + " --engine " + engine_json + " --rank 2 --out " +
                          path("cli.safetensors") + " 2>" + path("err.txt");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  auto read = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string lib = read(path("lib.safetensors")), cli = read(path("cli.safetensors"));
  ASSERT_FALSE(lib.empty());
  EXPECT_TRUE(lib == cli) << "CLI output differs from materialize()";
  // A rank outside the engine is a usage error (exit 2) with a message.
  const std::string bad = std::string(WEIGHTSYNC_CLI) + " materialize --checkpoint " +
                          path("ckpt") + " --engine " + engine_json + " --rank 4 --out " +
                          path("bad.safetensors") + " 2>" + path("err.txt");
  const int rc = std::system(bad.c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 2);
  EXPECT_NE(read(path("err.txt")).find("--rank 4"), std::string::npos) << read(path("err.txt"));
}

TEST(RandomCheckpoint, VersionsDifferInEveryElementAndChunkingIsInvisible) {
  for (DType d : {DType::BF16, DType::F16, DType::F32, DType::F8_E4M3, DType::F8_E5M2, DType::I32,
                  DType::U8}) {
    const size_t item = itemsize(d);
    const int64_t n = 1000;
    std::vector<uint8_t> v0(n * item), v1(n * item), split(n * item);
    fill_random("k", d, 1, 0, 0, n, v0.data());
    fill_random("k", d, 1, 0, 0, 333, split.data());
    fill_random("k", d, 1, 0, 333, n - 333, split.data() + 333 * item);
    EXPECT_EQ(v0, split) << dtype_name(d);
    for (uint64_t version = 1; version < kVersionPeriod; ++version) {
      fill_random("k", d, 1, version, 0, n, v1.data());
      for (int64_t e = 0; e < n; ++e)
        ASSERT_NE(0, std::memcmp(&v0[e * item], &v1[e * item], item))
            << dtype_name(d) << " version " << version << " element " << e;
    }
  }
  // BF16 values are finite and of moderate magnitude.
  std::vector<uint16_t> b(4096);
  fill_random("w", DType::BF16, 3, 0, 0, 4096, b.data());
  for (uint16_t x : b) {
    const int exp = (x >> 7) & 0xff;
    ASSERT_GE(exp, 127 - 8);
    ASSERT_LT(exp, 127);
  }
  std::vector<uint16_t> other(4096);
  fill_random("w2", DType::BF16, 3, 0, 0, 4096, other.data());
  EXPECT_NE(b, other);  // keys get their own streams
}

}  // namespace
}  // namespace weightsync
