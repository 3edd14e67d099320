// FP8 engines: the "quantization" config field, the F8_E4M3 params and their
// scale params in the engine layout, and the TP slices refused because they
// would cut a block.
#include "layouts/engine_test_util.h"

#include <nlohmann/json.hpp>

#include <weightsync/dtype.h>
#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>

#include <gtest/gtest.h>

namespace weightsync {
namespace {

using nlohmann::json;
using testing::has_param;
using testing::model_config_path;
using testing::param;
using testing::throws_errc;

json fp8_engine(const std::string& model, int tp, bool ep = false, json quant = nullptr) {
  if (quant.is_null()) quant = {{"method", "fp8"}, {"weight_block_size", {128, 128}}};
  return {{"framework", "vllm"},
          {"hf_config", model_config_path(model)},
          {"tp", tp},
          {"expert_parallel", ep},
          {"expert_placement", "linear"},
          {"replicas", 1},
          {"dtype", "BF16"},
          {"quantization", quant}};
}

EngineLayout layout_of(const json& j) {
  return make_engine_layout(engine_config_from_json(j, ""));
}

TEST(Fp8Config, ParsesAndRoundTrips) {
  auto j = fp8_engine("tiny-fp8-llama", 2);
  j["quantization"]["scale"] = "ue8m0";
  const EngineConfig c = engine_config_from_json(j, "");
  ASSERT_TRUE(c.quantization);
  EXPECT_EQ(c.quantization->block_rows, 128);
  EXPECT_EQ(c.quantization->block_cols, 128);
  EXPECT_EQ(c.quantization->scale, ScaleFormat::ue8m0);
  const EngineConfig again = engine_config_from_json(c.to_json(), "");
  EXPECT_EQ(again.quantization, c.quantization);
  // Default scale format and block size.
  const EngineConfig d =
      engine_config_from_json(fp8_engine("tiny-fp8-llama", 1, false, {{"method", "fp8"}}), "");
  ASSERT_TRUE(d.quantization);
  EXPECT_EQ(d.quantization->scale, ScaleFormat::fp32);
  // Absent or null: no quantization.
  j.erase("quantization");
  EXPECT_FALSE(engine_config_from_json(j, "").quantization);
  j["quantization"] = nullptr;
  EXPECT_FALSE(engine_config_from_json(j, "").quantization);
}

TEST(Fp8Config, BadValuesAreClearErrors) {
  auto with = [](json q) { return fp8_engine("tiny-fp8-llama", 1, false, std::move(q)); };
  EXPECT_TRUE(throws_errc(
      [&] {
        engine_config_from_json(with({{"method", "int8"}}), "");
      },
      Errc::invalid_layout, "method 'int8'"));
  EXPECT_TRUE(throws_errc(
      [&] {
        engine_config_from_json(with({{"method", "fp8"}, {"weight_block_size", {64, 64}}}), "");
      },
      Errc::invalid_layout, "only [128, 128]"));
  EXPECT_TRUE(throws_errc(
      [&] {
        engine_config_from_json(with({{"method", "fp8"}, {"weight_block_size", {128}}}), "");
      },
      Errc::format, "weight_block_size"));
  EXPECT_TRUE(throws_errc(
      [&] {
        engine_config_from_json(with({{"method", "fp8"}, {"scale", "e5m2"}}), "");
      },
      Errc::invalid_layout, "scale 'e5m2'"));
  EXPECT_TRUE(throws_errc(
      [&] {
        engine_config_from_json(with({{"method", "fp8"}, {"activation", "dynamic"}}), "");
      },
      Errc::format, "quantization.activation"));
  EXPECT_TRUE(throws_errc([&] { engine_config_from_json(with("fp8"), ""); }, Errc::format,
                          "'quantization' must be an object"));
}

TEST(Fp8Layout, LlamaWeightsAndScales) {
  const EngineLayout l = layout_of(fp8_engine("tiny-fp8-llama", 2));
  // H 320, 4 heads x 128, 2 KV heads, I 512: per rank q 256 + k 128 + v 128 rows.
  const EngineParam& qkv = param(l, 1, "model.layers.0.self_attn.qkv_proj.weight");
  EXPECT_EQ(qkv.dtype, DType::F8_E4M3);
  ASSERT_TRUE(qkv.quant);
  EXPECT_EQ(qkv.shape, (Shape{512, 320}));
  const auto& ps = l.ranks[1].params;
  ASSERT_GE(qkv.scale_param, 0);
  const EngineParam& s = ps.at(static_cast<size_t>(qkv.scale_param));
  EXPECT_EQ(s.name, "model.layers.0.self_attn.qkv_proj.weight_scale_inv");
  EXPECT_EQ(s.dtype, DType::F32);
  EXPECT_EQ(s.shape, (Shape{4, 3}));  // 320 columns: two blocks and a ragged one
  EXPECT_TRUE(s.segments.empty());
  EXPECT_EQ(&ps.at(static_cast<size_t>(s.scale_of)), &qkv);
  EXPECT_EQ(param(l, 0, "model.layers.1.self_attn.o_proj.weight_scale_inv").shape, (Shape{3, 2}));
  EXPECT_EQ(param(l, 0, "model.layers.1.mlp.gate_up_proj.weight_scale_inv").shape, (Shape{4, 3}));
  EXPECT_EQ(param(l, 0, "model.layers.1.mlp.down_proj.weight_scale_inv").shape, (Shape{3, 2}));
  // Everything else keeps the engine dtype and has no scale.
  for (const char* name : {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                           "model.layers.0.input_layernorm.weight"}) {
    EXPECT_EQ(param(l, 0, name).dtype, DType::BF16) << name;
    EXPECT_FALSE(param(l, 0, name).quant) << name;
    EXPECT_FALSE(has_param(l, 0, std::string(name) + "_scale_inv")) << name;
  }
  // Without quantization the same names exist, in BF16, and no scales.
  auto plain = fp8_engine("tiny-fp8-llama", 2);
  plain.erase("quantization");
  const EngineLayout p = layout_of(plain);
  EXPECT_EQ(param(p, 0, "model.layers.0.self_attn.qkv_proj.weight").dtype, DType::BF16);
  EXPECT_FALSE(has_param(p, 0, "model.layers.0.self_attn.qkv_proj.weight_scale_inv"));
  EXPECT_EQ(l.ranks[0].params.size(), p.ranks[0].params.size() + 2 * 4 /*per layer*/);
}

TEST(Fp8Layout, MoeExpertsWithAndWithoutExpertParallel) {
  for (bool ep : {false, true}) {
    const EngineLayout l = layout_of(fp8_engine("tiny-fp8-qwen3-moe", 4, ep));
    const std::string e = "model.layers.0.mlp.experts.";
    const EngineParam& w13 = param(l, 3, e + "w13_weight");
    const EngineParam& w2 = param(l, 3, e + "w2_weight");
    EXPECT_EQ(w13.dtype, DType::F8_E4M3);
    // 4 experts, I 512, H 256: TP cuts I into 128s; EP gives one whole expert each.
    const int64_t el = ep ? 1 : 4, it = ep ? 512 : 128;
    EXPECT_EQ(w13.shape, (Shape{el, 2 * it, 256})) << ep;
    EXPECT_EQ(param(l, 3, e + "w13_weight_scale_inv").shape, (Shape{el, 2 * it / 128, 2})) << ep;
    EXPECT_EQ(w2.shape, (Shape{el, 256, it})) << ep;
    EXPECT_EQ(param(l, 3, e + "w2_weight_scale_inv").shape, (Shape{el, 2, it / 128})) << ep;
    // The router stays in the engine dtype.
    EXPECT_EQ(param(l, 3, "model.layers.0.mlp.gate.weight").dtype, DType::BF16);
    EXPECT_FALSE(has_param(l, 3, "model.layers.0.mlp.gate.weight_scale_inv"));
  }
}

TEST(Fp8Layout, DeepseekMlaFusedAndBias) {
  const EngineLayout l = layout_of(fp8_engine("tiny-fp8-deepseek-v3", 4, true));
  const std::string a = "model.layers.0.self_attn.";
  // q_a 128 rows + kv_a 128 + 64 rows: the ragged block last.
  EXPECT_EQ(param(l, 0, a + "fused_qkv_a_proj.weight").shape, (Shape{320, 256}));
  EXPECT_EQ(param(l, 0, a + "fused_qkv_a_proj.weight_scale_inv").shape, (Shape{3, 2}));
  EXPECT_EQ(param(l, 2, a + "q_b_proj.weight_scale_inv").shape, (Shape{2, 1}));
  EXPECT_EQ(param(l, 2, a + "kv_b_proj.weight_scale_inv").shape, (Shape{2, 1}));
  EXPECT_EQ(param(l, 2, a + "o_proj.weight_scale_inv").shape, (Shape{2, 1}));
  EXPECT_FALSE(param(l, 0, "model.layers.1.mlp.gate.e_score_correction_bias").quant);
  EXPECT_FALSE(has_param(l, 0, "model.layers.1.mlp.gate.e_score_correction_bias_scale_inv"));
  EXPECT_FALSE(has_param(l, 0, "model.layers.0.self_attn.q_a_layernorm.weight_scale_inv"));
  EXPECT_TRUE(param(l, 0, "model.layers.1.mlp.shared_experts.gate_up_proj.weight").quant);
}

TEST(Fp8Layout, SlicesThatCutABlockAreRefusedNamingParamAndRank) {
  // tiny-llama: I = 96 over tp 2 -> 48 rows per rank, not a block multiple.
  EXPECT_TRUE(throws_errc([] { layout_of(fp8_engine("tiny-llama", 2)); }, Errc::invalid_layout,
                          "engine rank 0 param 'model.layers.0.self_attn.qkv_proj.weight'"));
  try {
    // 8 heads: attention splits, but o_proj's 8 x 64 input columns give 64 per rank.
    layout_of(fp8_engine("tiny-fp8-deepseek-v3", 8));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("tp=8"), std::string::npos) << m;
    EXPECT_NE(m.find("not a multiple of 128"), std::string::npos) << m;
    EXPECT_NE(m.find("vLLM"), std::string::npos) << m;
  }
}

TEST(Fp8Layout, FusedPartThatEndsInsideABlockIsRefused) {
  // tiny-llama at tp 1: no slicing, but q (64 rows) is followed by k inside
  // qkv_proj, so q's last block would mix both tensors.
  EXPECT_TRUE(throws_errc([] { layout_of(fp8_engine("tiny-llama", 1)); }, Errc::invalid_layout,
                          "'model.layers.0.self_attn.qkv_proj.weight'"));
  // Unquantized, the same engine is fine.
  auto plain = fp8_engine("tiny-llama", 1);
  plain.erase("quantization");
  EXPECT_NO_THROW(layout_of(plain));
}

}  // namespace
}  // namespace weightsync
