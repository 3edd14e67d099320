// HF model facts: config parsing, the tensor lists of each family, MoE keys.
#include "layouts/engine_test_util.h"

#include <nlohmann/json.hpp>

#include <weightsync/hf_model.h>

#include <gtest/gtest.h>

#include <map>

namespace weightsync {
namespace {

using testing::model;
using testing::throws_errc;

std::map<std::string, Shape> tensor_map(const HfModelConfig& c) {
  std::map<std::string, Shape> m;
  for (const auto& t : hf_tensors(c)) {
    EXPECT_TRUE(m.emplace(t.key, t.shape).second) << "duplicate key " << t.key;
    EXPECT_EQ(t.dtype, c.dtype) << t.key;
  }
  return m;
}

int64_t param_count(const HfModelConfig& c) {
  int64_t n = 0;
  for (const auto& t : hf_tensors(c)) n += numel(t.shape);
  return n;
}

TEST(HfModel, RealConfigsParseWithTheirFacts) {
  const auto llama = model("Llama-3-8B");
  EXPECT_EQ(llama.family, "llama");
  EXPECT_EQ(llama.num_kv_heads, 8);
  EXPECT_EQ(llama.head_dim, 128);
  const auto q30 = model("Qwen3-30B-A3B");
  EXPECT_EQ(q30.family, "qwen3_moe");
  EXPECT_EQ(q30.num_experts, 128);
  EXPECT_EQ(q30.moe_intermediate_size, 768);
  const auto mixtral = model("Mixtral-8x7B");
  EXPECT_EQ(mixtral.num_experts, 8);
  EXPECT_EQ(mixtral.moe_intermediate_size, 14336);
  const auto ds = model("DeepSeek-V3");
  EXPECT_EQ(ds.family, "deepseek_v3");
  EXPECT_EQ(ds.first_k_dense_replace, 3);
  EXPECT_EQ(ds.q_lora_rank, 1536);
  const auto kimi = model("Kimi-K2");
  EXPECT_EQ(kimi.family, "deepseek_v3");
  EXPECT_EQ(kimi.model_type, "kimi_k2");
  EXPECT_EQ(kimi.num_experts, 384);
  EXPECT_EQ(kimi.dtype, DType::BF16);
}

// Published parameter counts of the HF checkpoints (main model, no MTP).
TEST(HfModel, ParameterCountsMatchThePublishedModels) {
  EXPECT_EQ(param_count(model("Llama-3-8B")), 8030261248);
  EXPECT_EQ(param_count(model("Qwen3-30B-A3B")), 30532122624);
  EXPECT_EQ(param_count(model("Mixtral-8x7B")), 46702792704);
  const int64_t q235 = param_count(model("Qwen3-235B-A22B"));
  EXPECT_GT(q235, 234'500'000'000);
  EXPECT_LT(q235, 235'500'000'000);
  const int64_t ds = param_count(model("DeepSeek-V3"));  // 671B without the MTP layer
  EXPECT_GT(ds, 670'000'000'000);
  EXPECT_LT(ds, 672'000'000'000);
  const int64_t kimi = param_count(model("Kimi-K2"));  // "1T total"
  EXPECT_GT(kimi, 1'000'000'000'000);
  EXPECT_LT(kimi, 1'050'000'000'000);
}

TEST(HfModel, Qwen2HasQkvBiasesAndTiedEmbeddings) {
  const auto m = tensor_map(model("tiny-qwen2"));
  EXPECT_EQ(m.at("model.layers.0.self_attn.q_proj.bias"), (Shape{64}));
  EXPECT_EQ(m.at("model.layers.1.self_attn.k_proj.bias"), (Shape{32}));
  EXPECT_EQ(m.at("model.layers.1.self_attn.v_proj.weight"), (Shape{32, 64}));
  EXPECT_FALSE(m.count("lm_head.weight"));
  EXPECT_FALSE(m.count("model.layers.0.self_attn.o_proj.bias"));
}

TEST(HfModel, Qwen3HasQkNormsAndMoeSkipsMlpOnlyLayers) {
  const auto q3 = tensor_map(model("tiny-qwen3"));
  EXPECT_EQ(q3.at("model.layers.0.self_attn.q_norm.weight"), (Shape{16}));
  EXPECT_EQ(q3.at("model.layers.0.self_attn.q_proj.weight"), (Shape{128, 48}));
  EXPECT_FALSE(q3.count("model.layers.0.self_attn.q_proj.bias"));
  const auto cfg = model("tiny-qwen3-moe");
  const auto m = tensor_map(cfg);
  EXPECT_EQ(m.at("model.layers.0.mlp.gate.weight"), (Shape{6, 64}));
  EXPECT_EQ(m.at("model.layers.0.mlp.experts.5.down_proj.weight"), (Shape{64, 32}));
  EXPECT_EQ(m.at("model.layers.1.mlp.gate_proj.weight"), (Shape{96, 64}));  // mlp_only_layers
  EXPECT_FALSE(m.count("model.layers.1.mlp.gate.weight"));
  const auto layers = hf_moe_layers(cfg);
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(layers[0].layer, 0);
  EXPECT_EQ(layers[1].layer, 2);
  EXPECT_EQ(layers[1].up[4], "model.layers.2.mlp.experts.4.up_proj.weight");
}

// transformers >= 5.2x's to_dict() of a Qwen MoE config names the expert
// count num_local_experts.
TEST(HfModel, QwenMoeExpertCountUnderEitherName) {
  nlohmann::json j = model("tiny-qwen3-moe").raw();
  const int64_t experts = j.at("num_experts");
  j.erase("num_experts");
  j["num_local_experts"] = experts;
  EXPECT_EQ(HfModelConfig::from_json(j).num_experts, experts);
  j.erase("num_local_experts");
  EXPECT_TRUE(throws_errc([&] { HfModelConfig::from_json(j); }, Errc::format));
}

TEST(HfModel, Qwen2MoeHasSharedExpertAndItsGate) {
  const auto m = tensor_map(model("tiny-qwen2-moe"));
  EXPECT_EQ(m.at("model.layers.0.mlp.shared_expert.gate_proj.weight"), (Shape{64, 64}));
  EXPECT_EQ(m.at("model.layers.0.mlp.shared_expert.down_proj.weight"), (Shape{64, 64}));
  EXPECT_EQ(m.at("model.layers.0.mlp.shared_expert_gate.weight"), (Shape{1, 64}));
  EXPECT_EQ(m.at("model.layers.1.mlp.experts.0.gate_proj.weight"), (Shape{32, 64}));
}

TEST(HfModel, MixtralUsesBlockSparseMoeNames) {
  const auto cfg = model("tiny-mixtral");
  const auto m = tensor_map(cfg);
  EXPECT_EQ(m.at("model.layers.0.block_sparse_moe.gate.weight"), (Shape{6, 64}));
  EXPECT_EQ(m.at("model.layers.0.block_sparse_moe.experts.2.w1.weight"), (Shape{64, 64}));
  EXPECT_EQ(m.at("model.layers.1.block_sparse_moe.experts.5.w2.weight"), (Shape{64, 64}));
  const auto layers = hf_moe_layers(cfg);
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(layers[0].gate[1], "model.layers.0.block_sparse_moe.experts.1.w1.weight");
  EXPECT_EQ(layers[0].up[1], "model.layers.0.block_sparse_moe.experts.1.w3.weight");
  EXPECT_EQ(layers[0].down[1], "model.layers.0.block_sparse_moe.experts.1.w2.weight");
}

TEST(HfModel, DeepSeekMlaDenseFirstLayersSharedExpertsNoMtp) {
  const auto cfg = model("tiny-deepseek-v3");
  const auto m = tensor_map(cfg);
  EXPECT_EQ(m.at("model.layers.0.self_attn.q_a_proj.weight"), (Shape{24, 64}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.q_a_layernorm.weight"), (Shape{24}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.q_b_proj.weight"), (Shape{48, 24}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"), (Shape{20, 64}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.kv_a_layernorm.weight"), (Shape{16}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.kv_b_proj.weight"), (Shape{64, 16}));
  EXPECT_EQ(m.at("model.layers.0.self_attn.o_proj.weight"), (Shape{64, 32}));
  EXPECT_EQ(m.at("model.layers.0.mlp.gate_proj.weight"), (Shape{96, 64}));  // dense layer
  EXPECT_FALSE(m.count("model.layers.0.mlp.gate.weight"));
  EXPECT_EQ(m.at("model.layers.1.mlp.gate.weight"), (Shape{6, 64}));
  EXPECT_EQ(m.at("model.layers.1.mlp.gate.e_score_correction_bias"), (Shape{6}));
  EXPECT_EQ(m.at("model.layers.2.mlp.shared_experts.up_proj.weight"), (Shape{32, 64}));
  EXPECT_FALSE(m.count("model.layers.3.input_layernorm.weight"));
  EXPECT_FALSE(m.count("model.layers.0.self_attn.q_proj.weight"));
  EXPECT_EQ(hf_moe_layers(cfg).size(), 2u);
  // Without q LoRA (DeepSeek-V2-Lite style): one q_proj.
  auto raw = cfg.raw();
  raw["q_lora_rank"] = nullptr;
  const auto m2 = tensor_map(HfModelConfig::from_json(raw));
  EXPECT_EQ(m2.at("model.layers.0.self_attn.q_proj.weight"), (Shape{48, 64}));
  EXPECT_FALSE(m2.count("model.layers.0.self_attn.q_a_proj.weight"));
}

TEST(HfModel, RecognisedByModelTypeOrArchitectures) {
  auto raw = model("tiny-deepseek-v3").raw();
  raw["model_type"] = "kimi_k2";
  EXPECT_EQ(HfModelConfig::from_json(raw).family, "deepseek_v3");
  raw["model_type"] = "some_fork";  // unknown type, known architecture
  EXPECT_EQ(HfModelConfig::from_json(raw).family, "deepseek_v3");
  raw["architectures"] = {"GPTNeoXForCausalLM"};
  EXPECT_TRUE(throws_errc([&] { HfModelConfig::from_json(raw); }, Errc::invalid_argument,
                          "GPTNeoXForCausalLM"));
}

TEST(HfModel, BadFieldsAreFormatErrorsNamingTheField) {
  auto raw = model("tiny-llama").raw();
  raw["hidden_size"] = "64";
  EXPECT_TRUE(throws_errc([&] { HfModelConfig::from_json(raw); }, Errc::format, "hidden_size"));
  raw = model("tiny-llama").raw();
  raw.erase("vocab_size");
  EXPECT_TRUE(throws_errc([&] { HfModelConfig::from_json(raw); }, Errc::format, "vocab_size"));
  raw = model("tiny-llama").raw();
  raw["torch_dtype"] = "int4";
  EXPECT_TRUE(throws_errc([&] { HfModelConfig::from_json(raw); }, Errc::format, "int4"));
  raw = model("tiny-mixtral").raw();
  raw.erase("num_local_experts");
  EXPECT_TRUE(
      throws_errc([&] { HfModelConfig::from_json(raw); }, Errc::format, "num_local_experts"));
  EXPECT_TRUE(throws_errc([] { HfModelConfig::from_json(nlohmann::json::array()); }, Errc::format));
  EXPECT_TRUE(throws_errc([] { HfModelConfig::load("/nonexistent/config.json"); }, Errc::io,
                          "/nonexistent/config.json"));
}

}  // namespace
}  // namespace weightsync
