// make_trainer_layout (XTuner style) and the mesh spec parser, on the repo's
// real and tiny model configs; `weightsync trainer-layout` through the binary.
#include <weightsync/error.h>
#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <map>
#include <set>

namespace weightsync {
namespace {

HfModelConfig model(const std::string& name) {
  return HfModelConfig::load(std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/" + name +
                             "/config.json");
}

TrainerLayoutOptions transformers_style() {
  TrainerLayoutOptions o;
  o.style = TrainerLayoutStyle::transformers;
  return o;
}

const LoadSpec* find(const TrainerLayout& layout, const std::string& name) {
  for (const auto& p : layout.params)
    if (p.name == name) return &p;
  return nullptr;
}

TEST(MeshSpec, ParsesAxesInOrder) {
  const Mesh m = parse_mesh_spec("ep=2,fsdp=4");
  EXPECT_EQ(m.axes, (std::vector<std::string>{"ep", "fsdp"}));
  EXPECT_EQ(m.shape, (Shape{2, 4}));
  EXPECT_EQ(parse_mesh_spec("fsdp=8").world(), 8);
}

TEST(MeshSpec, RejectsMalformedSpecs) {
  for (const char* bad : {"", "ep", "ep=", "=2", "ep=0", "ep=-1", "ep=2,", "ep=2,ep=4", "ep=x",
                          "ep=2;fsdp=4", "ep=2.5"}) {
    try {
      parse_mesh_spec(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument) << bad;
    }
  }
}

// Every HF key of the model is in exactly one param, and the layout validates.
void expect_covers_model(const HfModelConfig& config, const TrainerLayout& layout) {
  std::map<std::string, Shape> hf;
  for (const auto& t : hf_tensors(config)) hf[t.key] = t.shape;
  std::set<std::string> seen;
  for (const auto& p : layout.params)
    for (const auto& k : p.hf_keys) {
      EXPECT_TRUE(seen.insert(k).second) << k;
      ASSERT_TRUE(hf.count(k)) << "unknown key " << k;
      EXPECT_EQ(hf[k], p.hf_key_shape()) << k << " in " << p.name;
    }
  EXPECT_EQ(seen.size(), hf.size());
  EXPECT_NO_THROW(layout.validate());
}

TEST(TrainerLayoutGen, DenseModelIsFsdpShardedOnDim0) {
  const HfModelConfig config = model("tiny-llama");
  const TrainerLayout layout = make_trainer_layout(config, parse_mesh_spec("dp=2,fsdp=4"));
  expect_covers_model(config, layout);
  EXPECT_EQ(layout.params.size(), hf_tensors(config).size());
  for (const auto& p : layout.params) {
    EXPECT_EQ(p.hf_keys, std::vector<std::string>{p.name});
    EXPECT_FALSE(p.fused_dim.has_value());
    ASSERT_EQ(p.shards.size(), 1u) << p.name;
    EXPECT_EQ(p.shards[0].axis, "fsdp");
    EXPECT_EQ(p.shards[0].dim, 0);
  }
}

TEST(TrainerLayoutGen, WithoutFsdpAxisDenseTensorsReplicate) {
  const TrainerLayout layout =
      make_trainer_layout(model("tiny-qwen3-moe"), parse_mesh_spec("ep=2"));
  const LoadSpec* norm = find(layout, "model.norm.weight");
  ASSERT_NE(norm, nullptr);
  EXPECT_TRUE(norm->shards.empty());
  const LoadSpec* experts = find(layout, "model.layers.0.mlp.experts.down_proj");
  ASSERT_NE(experts, nullptr);
  ASSERT_EQ(experts->shards.size(), 1u);
  EXPECT_EQ(experts->shards[0].axis, "ep");
}

TEST(TrainerLayoutGen, MoeExpertsFuseGateUpExpertMajor) {
  const HfModelConfig config = model("tiny-qwen3-moe");
  const TrainerLayout layout = make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=3"));
  expect_covers_model(config, layout);
  const int64_t e = config.num_experts, i = config.moe_intermediate_size, h = config.hidden_size;
  const LoadSpec* gu = find(layout, "model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_NE(gu, nullptr);
  EXPECT_EQ(gu->global_shape, (Shape{e * 2 * i, h}));
  EXPECT_EQ(gu->fused_dim, 0);
  ASSERT_EQ(gu->hf_keys.size(), static_cast<size_t>(2 * e));
  EXPECT_EQ(gu->hf_keys[0], "model.layers.0.mlp.experts.0.gate_proj.weight");
  EXPECT_EQ(gu->hf_keys[1], "model.layers.0.mlp.experts.0.up_proj.weight");
  EXPECT_EQ(gu->hf_keys[2], "model.layers.0.mlp.experts.1.gate_proj.weight");
  ASSERT_EQ(gu->shards.size(), 2u);
  EXPECT_EQ(gu->shards[0].axis, "ep");
  EXPECT_EQ(gu->shards[1].axis, "fsdp");
  const LoadSpec* down = find(layout, "model.layers.0.mlp.experts.down_proj");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->global_shape, (Shape{e * h, i}));
  EXPECT_EQ(down->hf_keys[1], "model.layers.0.mlp.experts.1.down_proj.weight");
  // The router stays a dense param.
  EXPECT_NE(find(layout, "model.layers.0.mlp.gate.weight"), nullptr);
}

TEST(TrainerLayoutGen, MixtralUsesBlockSparseMoeNames) {
  const HfModelConfig config = model("tiny-mixtral");
  const TrainerLayout layout = make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=2"));
  expect_covers_model(config, layout);
  const LoadSpec* gu = find(layout, "model.layers.1.block_sparse_moe.experts.gate_up_proj");
  ASSERT_NE(gu, nullptr);
  EXPECT_EQ(gu->hf_keys[0], "model.layers.1.block_sparse_moe.experts.0.w1.weight");
  EXPECT_EQ(gu->hf_keys[1], "model.layers.1.block_sparse_moe.experts.0.w3.weight");
  EXPECT_NE(find(layout, "model.layers.1.block_sparse_moe.experts.down_proj"), nullptr);
}

TEST(TrainerLayoutGen, EveryFamilyCoversItsCheckpoint) {
  for (const char* name : {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe",
                           "tiny-qwen2-moe", "tiny-mixtral", "tiny-deepseek-v3", "Kimi-K2",
                           "DeepSeek-V3", "Qwen3-30B-A3B", "Mixtral-8x7B", "Llama-3-8B"}) {
    SCOPED_TRACE(name);
    const HfModelConfig config = model(name);
    expect_covers_model(config, make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=4")));
  }
}

TEST(TrainerLayoutGen, TransformersStyleStacksExperts) {
  const HfModelConfig config = model("tiny-qwen3-moe");
  const TrainerLayout layout =
      make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=3"), transformers_style());
  expect_covers_model(config, layout);
  const int64_t e = config.num_experts, i = config.moe_intermediate_size, h = config.hidden_size;
  const LoadSpec* gu = find(layout, "model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_NE(gu, nullptr);
  EXPECT_EQ(gu->global_shape, (Shape{e, 2 * i, h}));
  EXPECT_EQ(gu->stack_dim, 0);
  EXPECT_EQ(gu->fused_dim, 1);
  EXPECT_EQ(gu->hf_keys[1], "model.layers.0.mlp.experts.0.up_proj.weight");
  ASSERT_EQ(gu->shards.size(), 2u);
  EXPECT_EQ(gu->shards[0].axis, "ep");
  EXPECT_EQ(gu->shards[0].dim, 0);
  const LoadSpec* down = find(layout, "model.layers.0.mlp.experts.down_proj");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->global_shape, (Shape{e, h, i}));
  EXPECT_FALSE(down->fused_dim.has_value());
}

// transformers_param maps every param of the transformers-style layout back
// to the same keys, for every family (the Python side relies on it).
TEST(TrainerLayoutGen, TransformersParamInvertsTheTransformersStyle) {
  for (const char* name : {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe",
                           "tiny-qwen2-moe", "tiny-mixtral", "tiny-deepseek-v3", "Kimi-K2"}) {
    SCOPED_TRACE(name);
    const HfModelConfig config = model(name);
    const TrainerLayout layout =
        make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=2"), transformers_style());
    expect_covers_model(config, layout);
    for (const LoadSpec& p : layout.params) {
      EXPECT_EQ(p.name.find("block_sparse_moe"), std::string::npos) << p.name;
      const TransformersParam t = transformers_param(config.model_type, p.name, p.global_shape);
      EXPECT_EQ(t.hf_keys, p.hf_keys) << p.name;
      EXPECT_EQ(t.fused_dim, p.fused_dim) << p.name;
      EXPECT_EQ(t.stack_dim, p.stack_dim) << p.name;
    }
  }
}

TEST(TrainerLayoutGen, TransformersParamRenamesMixtralAndRejectsOddGateUp) {
  EXPECT_EQ(transformers_param("mixtral", "model.layers.2.mlp.gate.weight", {8, 16}).hf_keys,
            std::vector<std::string>{"model.layers.2.block_sparse_moe.gate.weight"});
  EXPECT_EQ(
      transformers_param("mixtral", "model.layers.2.mlp.experts.down_proj", {2, 4, 3}).hf_keys,
      (std::vector<std::string>{"model.layers.2.block_sparse_moe.experts.0.w2.weight",
                                "model.layers.2.block_sparse_moe.experts.1.w2.weight"}));
  EXPECT_EQ(transformers_param("llama", "model.norm.weight", {4}).hf_keys,
            std::vector<std::string>{"model.norm.weight"});
  EXPECT_THROW(transformers_param("qwen3_moe", "m.experts.gate_up_proj", {2, 5, 4}), Error);
  EXPECT_EQ(parse_trainer_layout_style("megatron"), TrainerLayoutStyle::megatron);
  EXPECT_THROW(parse_trainer_layout_style("deepspeed"), Error);
}

TEST(TrainerLayoutGen, DeepSeekSharedExpertsStayDense) {
  const HfModelConfig config = model("tiny-deepseek-v3");
  const TrainerLayout layout = make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=2"));
  const LoadSpec* shared = find(layout, "model.layers.1.mlp.shared_experts.gate_proj.weight");
  ASSERT_NE(shared, nullptr);
  ASSERT_EQ(shared->shards.size(), 1u);
  EXPECT_EQ(shared->shards[0].axis, "fsdp");
  EXPECT_NE(find(layout, "model.layers.1.mlp.experts.gate_up_proj"), nullptr);
  // Layer 0 is dense (first_k_dense_replace = 1).
  EXPECT_EQ(find(layout, "model.layers.0.mlp.experts.gate_up_proj"), nullptr);
}

TEST(TrainerLayoutGen, DtypeOverride) {
  const TrainerLayout layout =
      make_trainer_layout(model("tiny-llama"), parse_mesh_spec("fsdp=2"), {DType::F32});
  for (const auto& p : layout.params) EXPECT_EQ(p.dtype, DType::F32);
}

std::pair<int, std::string> run_cli(const std::string& args) {
  const std::string cmd = std::string(WEIGHTSYNC_CLI) + " " + args + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(TrainerLayoutCli, PrintsTheLayoutJson) {
  const std::string cfg =
      std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/tiny-qwen3-moe/config.json";
  const auto [rc, out] = run_cli("trainer-layout --hf-config " + cfg + " --mesh ep=2,fsdp=3");
  ASSERT_EQ(rc, 0) << out;
  const TrainerLayout printed = TrainerLayout::from_json(nlohmann::json::parse(out));
  const TrainerLayout expected =
      make_trainer_layout(HfModelConfig::load(cfg), parse_mesh_spec("ep=2,fsdp=3"));
  EXPECT_EQ(printed.to_json(), expected.to_json());
}

TEST(TrainerLayoutCli, TransformersStyle) {
  const std::string cmd = std::string(WEIGHTSYNC_CLI) + " trainer-layout --hf-config " +
                          WEIGHTSYNC_SOURCE_DIR +
                          "/configs/models/tiny-mixtral/config.json --mesh ep=2 --style "
                          "transformers";
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  ASSERT_EQ(pclose(pipe), 0);
  const TrainerLayout layout = TrainerLayout::from_json(nlohmann::json::parse(out));
  const LoadSpec* gu = find(layout, "model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_NE(gu, nullptr);
  EXPECT_EQ(gu->stack_dim, 0);
  EXPECT_EQ(gu->hf_keys[0], "model.layers.0.block_sparse_moe.experts.0.w1.weight");
}

TEST(TrainerLayoutCli, BadMeshIsAClearError) {
  const std::string cfg =
      std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/tiny-llama/config.json";
  const auto [rc, out] = run_cli("trainer-layout --hf-config " + cfg + " --mesh fsdp=0");
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("fsdp"), std::string::npos) << out;
}

TEST(TrainerLayoutCli, LayoutBenchPrintsOneJsonObject) {
  const std::string cfg =
      std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/tiny-qwen3-moe/config.json";
  const auto [rc, out] = run_cli("bench layout --json --hf-config " + cfg + " --mesh ep=2,fsdp=3");
  ASSERT_EQ(rc, 0) << out;
  const auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["ranks"], 6);
  // Every param is held by some rank: at least one piece per param.
  EXPECT_GE(j["pieces"].get<int64_t>(), j["params"].get<int64_t>());
  EXPECT_TRUE(j.contains("total_s") && j.contains("reference_local_shape_s"));
}

TEST(TrainerLayoutExamples, CheckedInExamplesParse) {
  const auto dir = std::filesystem::path(WEIGHTSYNC_SOURCE_DIR) / "configs/examples";
  int found = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.find("trainer") == std::string::npos || entry.path().extension() != ".json") continue;
    ++found;
    EXPECT_NO_THROW(TrainerLayout::load(entry.path().string())) << name;
  }
  EXPECT_GT(found, 0) << "no configs/examples/*trainer*.json";
}

}  // namespace
}  // namespace weightsync
