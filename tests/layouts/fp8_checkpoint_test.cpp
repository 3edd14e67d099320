// FP8 as the checkpoint says (issue 54): the model's quantization_config read
// as vLLM 0.32 and SGLang 0.5.23 read it, the engine config's "quantization"
// checked against it, and which params each engine holds in FP8.
#include "layouts/fp8_checkpoint.h"
#include "layouts/engine_test_util.h"

#include <nlohmann/json.hpp>

#include <weightsync/dtype.h>
#include <weightsync/layouts.h>

#include <fstream>
#include <set>

#include <gtest/gtest.h>

namespace weightsync {
namespace {

using engine::CheckpointFp8;
using engine::FusedModules;
using engine::MatchMode;
using engine::read_checkpoint_fp8;
using engine::vllm_layer_skipped;
using nlohmann::json;
using testing::has_param;
using testing::model_config_path;
using testing::param;
using testing::throws_errc;

json model_json(const std::string& name) {
  std::ifstream in(model_config_path(name));
  return json::parse(in);
}

json engine_json(json hf, int tp, const std::string& framework = "vllm", bool ep = false) {
  return {{"framework", framework},
          {"hf_config", std::move(hf)},
          {"tp", tp},
          {"expert_parallel", ep},
          {"replicas", 1},
          {"dtype", "BF16"}};
}

EngineLayout layout_of(const json& j) {
  return make_engine_layout(engine_config_from_json(j, ""));
}

// The FP8 weights of rank `r`, by name.
std::set<std::string> fp8_params(const EngineLayout& l, int r = 0) {
  std::set<std::string> out;
  for (const EngineParam& p : l.ranks.at(static_cast<size_t>(r)).params)
    if (p.dtype == DType::F8_E4M3) out.insert(p.name);
  return out;
}

TEST(CheckpointFp8, ReadsTheFieldsTheEnginesRead) {
  json hf = model_json("tiny-qwen3-fp8");
  auto q = read_checkpoint_fp8(hf);
  ASSERT_TRUE(q);
  EXPECT_EQ(q->quant.block_rows, 128);
  EXPECT_EQ(q->quant.scale, ScaleFormat::fp32);
  const std::vector<std::string> mtnc{"lm_head", "model.layers.0.mlp.down_proj"};
  EXPECT_FALSE(q->ignored_layers);
  EXPECT_EQ(q->modules_to_not_convert, mtnc);
  EXPECT_EQ(engine::vllm_ignored(*q), mtnc);
  // SGLang keeps each name with and without "model.".
  EXPECT_EQ(engine::sglang_ignored(*q),
            (std::vector<std::string>{"lm_head", "model.lm_head", "layers.0.mlp.down_proj",
                                      "model.layers.0.mlp.down_proj"}));
  // ignored_layers wins where it has names, in both engines.
  hf["quantization_config"]["ignored_layers"] = {"model.layers.1.self_attn.o_proj"};
  q = read_checkpoint_fp8(hf);
  EXPECT_EQ(engine::vllm_ignored(*q),
            (std::vector<std::string>{"model.layers.1.self_attn.o_proj"}));
  EXPECT_EQ(engine::sglang_ignored(*q).size(), 2u);
  // An empty (or null) ignored_layers: vLLM falls back to
  // modules_to_not_convert, SGLang takes the empty list (the first key there).
  for (json empty : {json::array(), json(nullptr)}) {
    hf["quantization_config"]["ignored_layers"] = empty;
    q = read_checkpoint_fp8(hf);
    EXPECT_EQ(engine::vllm_ignored(*q), mtnc) << empty;
    EXPECT_TRUE(engine::sglang_ignored(*q).empty()) << empty;
  }
  // DeepSeek-V3.1's power-of-two scales.
  hf["quantization_config"]["scale_fmt"] = "ue8m0";
  EXPECT_EQ(read_checkpoint_fp8(hf)->quant.scale, ScaleFormat::ue8m0);
  // No quantization_config (or null): nothing to read.
  EXPECT_FALSE(read_checkpoint_fp8(model_json("tiny-fp8-llama")));
  hf["quantization_config"] = nullptr;
  EXPECT_FALSE(read_checkpoint_fp8(hf));
  // The real DeepSeek-V3 config.
  EXPECT_TRUE(read_checkpoint_fp8(model_json("DeepSeek-V3")));
}

TEST(CheckpointFp8, WhatWeightsyncCannotHoldIsRefusedNamingTheField) {
  const json base = model_json("tiny-qwen3-fp8");
  auto with = [&](const char* key, json value) {
    json hf = base;
    if (value.is_null())
      hf["quantization_config"].erase(key);
    else
      hf["quantization_config"][key] = std::move(value);
    return [hf] { read_checkpoint_fp8(hf); };
  };
  EXPECT_TRUE(throws_errc(with("quant_method", "awq"), Errc::unsupported, "quant_method 'awq'"));
  EXPECT_TRUE(throws_errc(with("weight_block_size", nullptr), Errc::unsupported,
                          "no weight_block_size: per-tensor FP8"));
  EXPECT_TRUE(throws_errc(with("weight_block_size", {64, 64}), Errc::unsupported,
                          "weight_block_size [64,64]"));
  EXPECT_TRUE(throws_errc(with("fmt", "e5m2"), Errc::unsupported, "fmt 'e5m2'"));
  EXPECT_TRUE(throws_errc(with("scale_fmt", "e8m0x4"), Errc::unsupported, "scale_fmt 'e8m0x4'"));
  EXPECT_TRUE(throws_errc(with("activation_scheme", "static"), Errc::unsupported,
                          "activation_scheme 'static'"));
  EXPECT_TRUE(throws_errc(with("modules_to_not_convert", "lm_head"), Errc::format,
                          "modules_to_not_convert must be a list"));
}

TEST(VllmLayerSkipped, ExactFusedAndExpertRules) {
  const FusedModules fused{{"qkv_proj", {"q_proj", "k_proj", "v_proj"}},
                           {"gate_up_proj", {"gate_proj", "up_proj"}}};
  const std::string a = "model.layers.0.self_attn.";
  auto skipped = [&](const std::string& m, std::vector<std::string> ignored,
                     MatchMode mode = MatchMode::exact) {
    return vllm_layer_skipped(m, ignored, fused, mode, "vLLM 0.32");
  };
  EXPECT_TRUE(skipped(a + "o_proj", {a + "o_proj"}));
  EXPECT_FALSE(skipped(a + "o_proj", {"o_proj"}));  // exact: the full name
  EXPECT_TRUE(skipped(a + "o_proj", {"o_proj"}, MatchMode::suffix));
  EXPECT_FALSE(skipped(a + "q_b_proj", {"b_proj"}, MatchMode::suffix));
  EXPECT_TRUE(skipped(a + "q_b_proj", {"b_proj"}, MatchMode::substring));
  // A fused module: by its parts, all or none.
  EXPECT_TRUE(skipped(a + "qkv_proj", {a + "q_proj", a + "k_proj", a + "v_proj"}));
  EXPECT_TRUE(skipped(a + "qkv_proj", {a + "qkv_proj"}));  // listed under the fused name
  EXPECT_FALSE(skipped(a + "qkv_proj", {"model.layers.1.self_attn.q_proj"}));
  EXPECT_TRUE(throws_errc([&] { skipped(a + "qkv_proj", {a + "k_proj"}); }, Errc::invalid_layout,
                          "fused module 'model.layers.0.self_attn.qkv_proj', "
                          "'model.layers.0.self_attn.k_proj' is listed unquantized and "
                          "'model.layers.0.self_attn.q_proj' is not"));
  // Experts: an ignored name mentioning experts that contains the module.
  const std::string e = "model.layers.3.mlp.experts";
  EXPECT_TRUE(skipped(e, {e + ".0.gate_proj"}));
  EXPECT_FALSE(skipped(e, {"model.layers.4.mlp.experts.0.gate_proj"}));
  EXPECT_TRUE(skipped(e, {e}));  // the fused experts under their own name
}

TEST(SglangLayerSkipped, PathBoundariesFallbackFusionAndExperts) {
  auto skipped = [](const std::string& m, std::vector<std::string> ignored,
                    const FusedModules& fused = {}) {
    return engine::sglang_layer_skipped(m, ignored, fused, "SGLang 0.5.23");
  };
  const std::string l = "model.layers.0.";
  // Dotted boundaries: "mlp.gate" is not "mlp.gate_up_proj"'s prefix.
  EXPECT_TRUE(skipped(l + "mlp.gate", {"mlp.gate"}));
  EXPECT_FALSE(skipped(l + "mlp.gate_up_proj", {"mlp.gate"}));
  EXPECT_TRUE(skipped(l + "self_attn.o_proj", {"layers.0"}));  // a whole layer
  EXPECT_FALSE(skipped("model.layers.10.self_attn.o_proj", {"layers.1"}));
  // qkv_proj and gate_up_proj split by SGLang's fallback table.
  EXPECT_TRUE(skipped(l + "mlp.gate_up_proj", {l + "mlp.gate_proj", l + "mlp.up_proj"}));
  EXPECT_TRUE(throws_errc([&] { skipped(l + "self_attn.qkv_proj", {l + "self_attn.v_proj"}); },
                          Errc::invalid_layout, "SGLang 0.5.23 refuses this model"));
  // The model's own fusion (DeepSeek's MLA).
  const FusedModules mla{{"fused_qkv_a_proj_with_mqa", {"q_a_proj", "kv_a_proj_with_mqa"}}};
  EXPECT_TRUE(skipped(l + "self_attn.fused_qkv_a_proj_with_mqa",
                      {l + "self_attn.q_a_proj", l + "self_attn.kv_a_proj_with_mqa"}, mla));
  EXPECT_FALSE(skipped(l + "self_attn.fused_qkv_a_proj_with_mqa", {}, mla));
  // Experts: by path, or by an expert's name that contains the module.
  EXPECT_TRUE(skipped(l + "mlp.experts", {l + "mlp.experts.3.down_proj"}));
  EXPECT_FALSE(skipped(l + "mlp.experts", {"model.layers.1.mlp.experts.3.down_proj"}));
}

TEST(CheckpointFp8Layout, Qwen3AsTheIssueTriedIt) {
  // No "quantization" in the engine config: the model's config says FP8,
  // every linear but lm_head and layer 0's down_proj.
  const json hf = model_json("tiny-qwen3-fp8");
  for (const char* fw : {"vllm", "sglang"}) {
    const EngineLayout l = layout_of(engine_json(hf, 1, fw));
    ASSERT_TRUE(l.config.quantization) << fw;
    EXPECT_EQ(fp8_params(l), (std::set<std::string>{
                                 "model.layers.0.self_attn.qkv_proj.weight",
                                 "model.layers.0.self_attn.o_proj.weight",
                                 "model.layers.0.mlp.gate_up_proj.weight",
                                 "model.layers.1.self_attn.qkv_proj.weight",
                                 "model.layers.1.self_attn.o_proj.weight",
                                 "model.layers.1.mlp.gate_up_proj.weight",
                                 "model.layers.1.mlp.down_proj.weight",
                             }))
        << fw;
    EXPECT_EQ(param(l, 0, "model.layers.0.mlp.down_proj.weight").dtype, DType::BF16) << fw;
    EXPECT_FALSE(has_param(l, 0, "model.layers.0.mlp.down_proj.weight_scale_inv")) << fw;
    EXPECT_EQ(param(l, 0, "lm_head.weight").dtype, DType::BF16) << fw;
    EXPECT_EQ(param(l, 0, "model.layers.1.mlp.down_proj.weight_scale_inv").shape, (Shape{2, 4}));
  }
  // The same with a "quantization" field that agrees.
  json j = engine_json(hf, 1);
  j["quantization"] = {{"method", "fp8"}, {"weight_block_size", {128, 128}}};
  EXPECT_EQ(fp8_params(layout_of(j)).size(), 7u);
}

TEST(CheckpointFp8Layout, EngineFieldThatDisagreesIsRefusedNamingBoth) {
  json hf = model_json("tiny-qwen3-fp8");
  hf["quantization_config"]["scale_fmt"] = "ue8m0";
  json j = engine_json(hf, 1);
  j["quantization"] = {{"method", "fp8"}, {"scale", "fp32"}};
  EXPECT_TRUE(throws_errc([&] { engine_config_from_json(j, ""); }, Errc::invalid_layout,
                          "quantization.scale \"fp32\" disagrees with the model config's "
                          "quantization_config.scale_fmt \"ue8m0\""));
  // Unstated, the scale follows the checkpoint; "ue8m0" over FP32 scales is
  // the engine's choice (DeepGEMM on Blackwell) and agrees.
  j["quantization"].erase("scale");
  EXPECT_EQ(engine_config_from_json(j, "").quantization->scale, ScaleFormat::ue8m0);
  json fp32 = engine_json(model_json("tiny-qwen3-fp8"), 1);
  fp32["quantization"] = {{"method", "fp8"}, {"scale", "ue8m0"}};
  EXPECT_EQ(engine_config_from_json(fp32, "").quantization->scale, ScaleFormat::ue8m0);
  // A model config that is not FP8 at all: refused before any layout.
  json awq = model_json("tiny-qwen3-fp8");
  awq["quantization_config"]["quant_method"] = "awq";
  EXPECT_TRUE(throws_errc([&] { engine_config_from_json(engine_json(awq, 1), ""); },
                          Errc::unsupported, "quant_method 'awq'"));
}

TEST(CheckpointFp8Layout, Qwen3MoeRouterFollowsTheEngine) {
  // vLLM 0.32 builds Qwen3-MoE's router (GateLinear) with the quant config:
  // FP8 unless the checkpoint lists it, as Qwen3-30B-A3B-FP8 does.
  json hf = model_json("tiny-qwen3-moe-fp8");
  const std::string gate = "model.layers.0.mlp.gate.weight";
  const EngineLayout listed = layout_of(engine_json(hf, 2));
  EXPECT_EQ(param(listed, 0, gate).dtype, DType::BF16);
  EXPECT_EQ(param(listed, 0, "model.layers.0.mlp.experts.w13_weight").dtype, DType::F8_E4M3);
  EXPECT_EQ(param(listed, 0, "model.layers.1.mlp.gate.weight").dtype, DType::BF16);
  hf["quantization_config"]["modules_to_not_convert"] = {"lm_head"};
  const EngineLayout unlisted = layout_of(engine_json(hf, 2));
  EXPECT_EQ(param(unlisted, 0, gate).dtype, DType::F8_E4M3);
  EXPECT_EQ(param(unlisted, 0, gate + "_scale_inv").shape, (Shape{1, 2}));  // 4 experts x 256
  // Experts listed by one expert's projection: the layer's fused experts stay BF16.
  hf["quantization_config"]["modules_to_not_convert"] = {"model.layers.0.mlp.gate",
                                                         "model.layers.0.mlp.experts.0.gate_proj"};
  const EngineLayout experts = layout_of(engine_json(hf, 2));
  EXPECT_EQ(param(experts, 0, "model.layers.1.mlp.experts.w13_weight").dtype, DType::F8_E4M3);
  EXPECT_EQ(param(experts, 0, "model.layers.1.mlp.gate.weight").dtype, DType::F8_E4M3);
  EXPECT_EQ(param(experts, 0, "model.layers.0.mlp.experts.w13_weight").dtype, DType::BF16);
  EXPECT_EQ(param(experts, 0, "model.layers.0.mlp.experts.w2_weight").dtype, DType::BF16);
  EXPECT_FALSE(has_param(experts, 0, "model.layers.0.mlp.experts.w13_weight_scale_inv"));
}

TEST(CheckpointFp8Layout, SglangKeepsRoutersInBf16AndDiffersFromVllmWhereItsRulesDo) {
  json hf = model_json("tiny-qwen3-moe-fp8");
  hf["quantization_config"]["modules_to_not_convert"] = {"lm_head"};
  const std::string gate = "model.layers.0.mlp.gate.weight";
  EXPECT_EQ(param(layout_of(engine_json(hf, 2, "sglang")), 0, gate).dtype, DType::BF16);
  EXPECT_EQ(param(layout_of(engine_json(hf, 2, "vllm")), 0, gate).dtype, DType::F8_E4M3);
  // A name without "model.": SGLang adds it, vLLM matches exactly.
  hf["quantization_config"]["modules_to_not_convert"] = {"model.layers.0.mlp.gate",
                                                         "layers.1.self_attn.o_proj"};
  const std::string o = "model.layers.1.self_attn.o_proj.weight";
  EXPECT_EQ(param(layout_of(engine_json(hf, 2, "sglang")), 0, o).dtype, DType::BF16);
  EXPECT_EQ(param(layout_of(engine_json(hf, 2, "vllm")), 0, o).dtype, DType::F8_E4M3);
  // DeepSeek: SGLang's name for the MLA fusion.
  json ds = model_json("tiny-deepseek-v3-fp8");
  ds["quantization_config"]["modules_to_not_convert"] = {
      "model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"};
  const EngineLayout l = layout_of(engine_json(ds, 2, "sglang", true));
  EXPECT_EQ(param(l, 0, "model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight").dtype,
            DType::BF16);
  EXPECT_EQ(param(l, 0, "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight").dtype,
            DType::F8_E4M3);
}

TEST(CheckpointFp8Layout, DeepseekV3FusedPartsMustAgree) {
  json hf = model_json("tiny-deepseek-v3-fp8");
  const EngineLayout l = layout_of(engine_json(hf, 2, "vllm", true));
  const std::string a = "model.layers.0.self_attn.";
  EXPECT_EQ(param(l, 0, a + "fused_qkv_a_proj.weight").dtype, DType::F8_E4M3);
  EXPECT_EQ(param(l, 0, "model.layers.1.mlp.gate.weight").dtype, DType::BF16);  // no quant config
  EXPECT_EQ(param(l, 0, "model.layers.1.mlp.shared_experts.down_proj.weight").dtype,
            DType::F8_E4M3);
  // Leaving one part of a fused module BF16: vLLM refuses the model, so do we.
  hf["quantization_config"]["modules_to_not_convert"] = {a + "q_a_proj"};
  EXPECT_TRUE(throws_errc([&] { layout_of(engine_json(hf, 2, "vllm", true)); },
                          Errc::invalid_layout,
                          "vLLM 0.32 refuses this model: of the parts of fused module "
                          "'model.layers.0.self_attn.fused_qkv_a_proj'"));
  // Both parts listed: the fused module stays BF16, q_b_proj is still FP8.
  hf["quantization_config"]["modules_to_not_convert"] = {a + "q_a_proj", a + "kv_a_proj_with_mqa"};
  const EngineLayout both = layout_of(engine_json(hf, 2, "vllm", true));
  EXPECT_EQ(param(both, 0, a + "fused_qkv_a_proj.weight").dtype, DType::BF16);
  EXPECT_EQ(param(both, 0, a + "q_b_proj.weight").dtype, DType::F8_E4M3);
}

TEST(CheckpointFp8Layout, WithoutQuantizationConfigTheEngineFieldAloneSays) {
  // As before issue 54: the tiny-fp8-* models carry no quantization_config.
  json j = engine_json(model_json("tiny-fp8-qwen3-moe"), 2);
  EXPECT_TRUE(fp8_params(layout_of(j)).empty());
  j["quantization"] = {{"method", "fp8"}};
  const EngineLayout l = layout_of(j);
  EXPECT_EQ(param(l, 0, "model.layers.0.mlp.gate.weight").dtype, DType::BF16);
  EXPECT_EQ(param(l, 0, "model.layers.0.mlp.experts.w13_weight").dtype, DType::F8_E4M3);
}

TEST(CheckpointFp8Layout, SummaryLineAndSource) {
  const EngineLayout l = layout_of(engine_json(model_json("tiny-qwen3-fp8"), 1));
  // 8 linear weights (qkv, o, gate_up, down per layer), layer 0's down_proj BF16.
  EXPECT_EQ(fp8_summary(l.ranks[0]), "7 of 8 linear weights FP8, scales fp32");
  EXPECT_EQ(fp8_source(l.config), "the model's quantization_config, as vLLM 0.32 reads it");
  json legacy = engine_json(model_json("tiny-fp8-llama"), 2);
  legacy["quantization"] = {{"method", "fp8"}, {"scale", "ue8m0"}};
  const EngineLayout g = layout_of(legacy);
  EXPECT_EQ(fp8_summary(g.ranks[1]), "8 of 8 linear weights FP8, scales ue8m0");
  EXPECT_EQ(fp8_source(g.config), "the engine config's \"quantization\"");
  const EngineLayout plain = layout_of(engine_json(model_json("tiny-fp8-llama"), 1));
  EXPECT_EQ(fp8_summary(plain.ranks[0]), "");
  EXPECT_EQ(fp8_source(plain.config), "");
}

}  // namespace
}  // namespace weightsync
