// Engine layouts against small hand-computed cases.
#include "layouts/engine_test_util.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

namespace weightsync {
namespace {

using testing::engine;
using testing::has_param;
using testing::param;
using testing::throws_errc;

void expect_segment(const EngineParam& p, size_t i, const std::string& key, const Box& hf,
                    const Box& dst) {
  ASSERT_LT(i, p.segments.size()) << p.name;
  EXPECT_EQ(p.segments[i].hf_key, key) << p.name << " segment " << i;
  EXPECT_EQ(p.segments[i].hf_box, hf)
      << p.name << " segment " << i << ": " << box_str(p.segments[i].hf_box);
  EXPECT_EQ(p.segments[i].param_box, dst)
      << p.name << " segment " << i << ": " << box_str(p.segments[i].param_box);
}

// tiny-llama: 8 heads of 8, 2 KV heads, tp=4: each KV head serves 2 ranks.
TEST(EngineLayout, QkvWithKvHeadsReplicatedOverRanks) {
  const auto layout = make_engine_layout(engine("tiny-llama", 4));
  const std::string q = "model.layers.0.self_attn.q_proj.weight";
  const std::string k = "model.layers.0.self_attn.k_proj.weight";
  const std::string v = "model.layers.0.self_attn.v_proj.weight";
  for (int r = 0; r < 4; ++r) {
    const auto& p = param(layout, r, "model.layers.0.self_attn.qkv_proj.weight");
    EXPECT_EQ(p.shape, (Shape{32, 64}));
    ASSERT_EQ(p.segments.size(), 3u);
    const int64_t kv_head = r / 2;
    expect_segment(p, 0, q, Box{{16 * r, 0}, {16, 64}}, Box{{0, 0}, {16, 64}});
    expect_segment(p, 1, k, Box{{8 * kv_head, 0}, {8, 64}}, Box{{16, 0}, {8, 64}});
    expect_segment(p, 2, v, Box{{8 * kv_head, 0}, {8, 64}}, Box{{24, 0}, {8, 64}});
  }
  // o_proj and down_proj are row parallel: split on dim 1.
  const auto& o = param(layout, 3, "model.layers.1.self_attn.o_proj.weight");
  EXPECT_EQ(o.shape, (Shape{64, 16}));
  expect_segment(o, 0, "model.layers.1.self_attn.o_proj.weight", Box{{0, 48}, {64, 16}},
                 Box{{0, 0}, {64, 16}});
  const auto& down = param(layout, 1, "model.layers.0.mlp.down_proj.weight");
  expect_segment(down, 0, "model.layers.0.mlp.down_proj.weight", Box{{0, 24}, {64, 24}},
                 Box{{0, 0}, {64, 24}});
  // gate_up_proj = [gate slice | up slice].
  const auto& gu = param(layout, 2, "model.layers.0.mlp.gate_up_proj.weight");
  EXPECT_EQ(gu.shape, (Shape{48, 64}));
  expect_segment(gu, 0, "model.layers.0.mlp.gate_proj.weight", Box{{48, 0}, {24, 64}},
                 Box{{0, 0}, {24, 64}});
  expect_segment(gu, 1, "model.layers.0.mlp.up_proj.weight", Box{{48, 0}, {24, 64}},
                 Box{{24, 0}, {24, 64}});
  // Norms are replicated whole.
  const auto& norm = param(layout, 3, "model.layers.1.input_layernorm.weight");
  expect_segment(norm, 0, "model.layers.1.input_layernorm.weight", Box{{0}, {64}}, Box{{0}, {64}});
}

// Vocab 100 padded to 128 on tp=4: 32 rows per rank; rank 3 holds rows
// 96..99 and 28 rows of zero padding.
TEST(EngineLayout, VocabPaddedToMultipleOf64ThenSplit) {
  const auto layout = make_engine_layout(engine("tiny-llama", 4));
  for (const std::string name : {"model.embed_tokens.weight", "lm_head.weight"}) {
    for (int r = 0; r < 3; ++r) {
      const auto& p = param(layout, r, name);
      EXPECT_EQ(p.shape, (Shape{32, 64}));
      expect_segment(p, 0, name, Box{{32 * r, 0}, {32, 64}}, Box{{0, 0}, {32, 64}});
    }
    const auto& last = param(layout, 3, name);
    EXPECT_EQ(last.shape, (Shape{32, 64}));
    ASSERT_EQ(last.segments.size(), 1u);
    expect_segment(last, 0, name, Box{{96, 0}, {4, 64}}, Box{{0, 0}, {4, 64}});
  }
  EXPECT_EQ(padded_vocab(100), 128);
  EXPECT_EQ(padded_vocab(128256), 128256);
  EXPECT_EQ(padded_vocab(129280), 129280);
}

// 6 experts over 4 EP ranks: linear gives 2, 2, 1, 1 contiguous; round_robin
// gives {0, 4}, {1, 5}, {2}, {3}.
TEST(EngineLayout, ExpertPlacementLinearVsRoundRobin) {
  const auto lin = engine("tiny-qwen3-moe", 4, true, "linear");
  const auto rr = engine("tiny-qwen3-moe", 4, true, "round_robin");
  const std::vector<std::vector<int64_t>> want_lin{{0, 1}, {2, 3}, {4}, {5}};
  const std::vector<std::vector<int64_t>> want_rr{{0, 4}, {1, 5}, {2}, {3}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(local_experts(lin, r), want_lin[r]) << "rank " << r;
    EXPECT_EQ(local_experts(rr, r), want_rr[r]) << "rank " << r;
  }
  EXPECT_EQ(local_experts(engine("tiny-qwen3-moe", 4), 2).size(), 6u);  // no EP: all
  const auto l = make_engine_layout(rr);
  const std::string pre = "model.layers.2.mlp.experts.";
  // With EP, MoE tp is 1: whole experts, I = 32.
  const auto& w13 = param(l, 1, "model.layers.2.mlp.experts.w13_weight");
  EXPECT_EQ(w13.shape, (Shape{2, 64, 64}));
  ASSERT_EQ(w13.segments.size(), 4u);
  expect_segment(w13, 2, pre + "5.gate_proj.weight", Box{{0, 0}, {32, 64}},
                 Box{{1, 0, 0}, {1, 32, 64}});
  expect_segment(w13, 3, pre + "5.up_proj.weight", Box{{0, 0}, {32, 64}},
                 Box{{1, 32, 0}, {1, 32, 64}});
  const auto& w2 = param(l, 3, "model.layers.2.mlp.experts.w2_weight");
  EXPECT_EQ(w2.shape, (Shape{1, 64, 32}));
  expect_segment(w2, 0, pre + "3.down_proj.weight", Box{{0, 0}, {64, 32}},
                 Box{{0, 0, 0}, {1, 64, 32}});
  // The router stays replicated, all 6 rows.
  EXPECT_EQ(param(l, 3, "model.layers.2.mlp.gate.weight").shape, (Shape{6, 64}));
}

// Without EP, every rank holds every expert's slice of I; SGLang's w31 puts
// up (w3) before gate (w1).
TEST(EngineLayout, FusedExpertsTensorParallelAndW31Order) {
  auto c = engine("tiny-qwen3-moe", 2, false, "linear", "sglang");
  const std::string pre = "model.layers.0.mlp.experts.";
  const auto w13_layout = make_engine_layout(c);
  const auto& w13 = param(w13_layout, 1, pre + "w13_weight");
  EXPECT_EQ(w13.shape, (Shape{6, 32, 64}));
  expect_segment(w13, 8, pre + "4.gate_proj.weight", Box{{16, 0}, {16, 64}},
                 Box{{4, 0, 0}, {1, 16, 64}});
  expect_segment(w13, 9, pre + "4.up_proj.weight", Box{{16, 0}, {16, 64}},
                 Box{{4, 16, 0}, {1, 16, 64}});
  c.moe_order = "w31";
  const auto w31_layout = make_engine_layout(c);
  const auto& w31 = param(w31_layout, 1, pre + "w13_weight");
  expect_segment(w31, 8, pre + "4.gate_proj.weight", Box{{16, 0}, {16, 64}},
                 Box{{4, 16, 0}, {1, 16, 64}});
  expect_segment(w31, 9, pre + "4.up_proj.weight", Box{{16, 0}, {16, 64}},
                 Box{{4, 0, 0}, {1, 16, 64}});
  const auto& w2 = param(w31_layout, 1, pre + "w2_weight");
  EXPECT_EQ(w2.shape, (Shape{6, 64, 16}));
  expect_segment(w2, 5, pre + "5.down_proj.weight", Box{{0, 16}, {64, 16}},
                 Box{{5, 0, 0}, {1, 64, 16}});
}

TEST(EngineLayout, MlaFusedQkvAProjAndSplits) {
  const auto layout = make_engine_layout(engine("tiny-deepseek-v3", 2));
  const std::string a = "model.layers.1.self_attn.";
  for (int r = 0; r < 2; ++r) {
    const auto& fused = param(layout, r, a + "fused_qkv_a_proj.weight");
    EXPECT_EQ(fused.shape, (Shape{44, 64}));
    expect_segment(fused, 0, a + "q_a_proj.weight", Box{{0, 0}, {24, 64}}, Box{{0, 0}, {24, 64}});
    expect_segment(fused, 1, a + "kv_a_proj_with_mqa.weight", Box{{0, 0}, {20, 64}},
                   Box{{24, 0}, {20, 64}});
  }
  expect_segment(param(layout, 1, a + "q_b_proj.weight"), 0, a + "q_b_proj.weight",
                 Box{{24, 0}, {24, 24}}, Box{{0, 0}, {24, 24}});
  expect_segment(param(layout, 1, a + "kv_b_proj.weight"), 0, a + "kv_b_proj.weight",
                 Box{{32, 0}, {32, 16}}, Box{{0, 0}, {32, 16}});
  EXPECT_EQ(param(layout, 0, a + "o_proj.weight").shape, (Shape{64, 16}));
  EXPECT_EQ(param(layout, 0, a + "q_a_layernorm.weight").shape, (Shape{24}));
  EXPECT_EQ(param(layout, 0, "model.layers.1.mlp.gate.e_score_correction_bias").shape, (Shape{6}));
  // vLLM keeps DeepSeek's shared experts a separate tensor-parallel MLP.
  const auto& shared = param(layout, 1, "model.layers.2.mlp.shared_experts.gate_up_proj.weight");
  EXPECT_EQ(shared.shape, (Shape{32, 64}));
  expect_segment(shared, 1, "model.layers.2.mlp.shared_experts.up_proj.weight",
                 Box{{16, 0}, {16, 64}}, Box{{16, 0}, {16, 64}});
  EXPECT_EQ(param(layout, 0, "model.layers.0.mlp.gate_up_proj.weight").shape, (Shape{96, 64}));
  EXPECT_FALSE(has_param(layout, 0, "model.layers.0.mlp.experts.w13_weight"));
  // SGLang names the fusion fused_qkv_a_proj_with_mqa.
  const auto sg = make_engine_layout(engine("tiny-deepseek-v3", 2, false, "linear", "sglang"));
  EXPECT_TRUE(has_param(sg, 0, a + "fused_qkv_a_proj_with_mqa.weight"));
  EXPECT_FALSE(has_param(sg, 0, a + "fused_qkv_a_proj.weight"));
  // Without q LoRA: a column-parallel q_proj and a replicated kv_a_proj_with_mqa.
  auto c = engine("tiny-deepseek-v3", 2);
  auto raw = c.hf.raw();
  raw.erase("q_lora_rank");
  c.hf = HfModelConfig::from_json(raw);
  const auto nolora = make_engine_layout(c);
  expect_segment(param(nolora, 1, a + "q_proj.weight"), 0, a + "q_proj.weight",
                 Box{{24, 0}, {24, 64}}, Box{{0, 0}, {24, 64}});
  EXPECT_EQ(param(nolora, 1, a + "kv_a_proj_with_mqa.weight").shape, (Shape{20, 64}));
}

TEST(EngineLayout, Qwen2BiasesFollowWeightsAndTiedEmbeddingHasNoLmHead) {
  const auto layout = make_engine_layout(engine("tiny-qwen2", 2));
  const std::string a = "model.layers.0.self_attn.";
  const auto& bias = param(layout, 1, a + "qkv_proj.bias");
  EXPECT_EQ(bias.shape, (Shape{64}));
  expect_segment(bias, 0, a + "q_proj.bias", Box{{32}, {32}}, Box{{0}, {32}});
  expect_segment(bias, 1, a + "k_proj.bias", Box{{16}, {16}}, Box{{32}, {16}});
  expect_segment(bias, 2, a + "v_proj.bias", Box{{16}, {16}}, Box{{48}, {16}});
  EXPECT_FALSE(has_param(layout, 0, "lm_head.weight"));
  EXPECT_EQ(param(layout, 1, "model.embed_tokens.weight").shape, (Shape{64, 64}));
}

TEST(EngineLayout, MixtralAndQwen2MoeNames) {
  const auto mix = make_engine_layout(engine("tiny-mixtral", 2));
  const std::string b = "model.layers.1.block_sparse_moe.";
  EXPECT_EQ(param(mix, 0, b + "gate.weight").shape, (Shape{6, 64}));
  const auto& w13 = param(mix, 0, b + "experts.w13_weight");
  EXPECT_EQ(w13.shape, (Shape{6, 64, 64}));
  EXPECT_EQ(w13.segments[0].hf_key, b + "experts.0.w1.weight");
  EXPECT_EQ(w13.segments[1].hf_key, b + "experts.0.w3.weight");
  EXPECT_EQ(param(mix, 0, b + "experts.w2_weight").segments[0].hf_key, b + "experts.0.w2.weight");

  const auto q2 = make_engine_layout(engine("tiny-qwen2-moe", 2));
  const std::string m = "model.layers.0.mlp.";
  EXPECT_EQ(param(q2, 1, m + "shared_expert.gate_up_proj.weight").shape, (Shape{64, 64}));
  EXPECT_EQ(param(q2, 1, m + "shared_expert.down_proj.weight").shape, (Shape{64, 32}));
  EXPECT_EQ(param(q2, 1, m + "shared_expert_gate.weight").shape, (Shape{1, 64}));
}

TEST(EngineLayout, ValidationNamesWhatTpMustDivide) {
  auto c = engine("tiny-llama", 3);
  EXPECT_TRUE(
      throws_errc([&] { make_engine_layout(c); }, Errc::invalid_layout, "num_attention_heads"));
  // 12 heads, 4 KV heads, tp=6: 6 is neither a multiple nor a divisor of 4.
  auto raw = c.hf.raw();
  raw["num_attention_heads"] = 12;
  raw["num_key_value_heads"] = 4;
  raw["hidden_size"] = 96;
  raw["intermediate_size"] = 96;
  c.hf = HfModelConfig::from_json(raw);
  c.tp = 6;
  EXPECT_TRUE(
      throws_errc([&] { make_engine_layout(c); }, Errc::invalid_layout, "num_key_value_heads"));
  // tp=3 divides 12 heads but not the vocab padded to 128.
  raw["num_key_value_heads"] = 12;
  c.hf = HfModelConfig::from_json(raw);
  c.tp = 3;
  EXPECT_TRUE(throws_errc([&] { make_engine_layout(c); }, Errc::invalid_layout, "vocab"));
  // intermediate_size 90 on tp=4.
  auto l = engine("tiny-llama", 4);
  raw = l.hf.raw();
  raw["intermediate_size"] = 90;
  l.hf = HfModelConfig::from_json(raw);
  EXPECT_TRUE(
      throws_errc([&] { make_engine_layout(l); }, Errc::invalid_layout, "intermediate_size"));
  // moe_intermediate_size 30 on tp=4 fails without EP and is fine with it.
  auto moe = engine("tiny-qwen3-moe", 4);
  raw = moe.hf.raw();
  raw["moe_intermediate_size"] = 30;
  moe.hf = HfModelConfig::from_json(raw);
  EXPECT_TRUE(
      throws_errc([&] { make_engine_layout(moe); }, Errc::invalid_layout, "moe_intermediate_size"));
  moe.expert_parallel = true;
  EXPECT_NO_THROW(make_engine_layout(moe));
  // EP over more ranks than experts.
  auto many = engine("tiny-mixtral", 8, true);
  EXPECT_TRUE(throws_errc([&] { make_engine_layout(many); }, Errc::invalid_layout, "experts"));
  auto bad = engine("tiny-llama", 2);
  bad.framework = "trtllm";
  EXPECT_TRUE(throws_errc([&] { make_engine_layout(bad); }, Errc::invalid_layout, "trtllm"));
  bad = engine("tiny-mixtral", 2, true, "random");
  EXPECT_TRUE(throws_errc([&] { make_engine_layout(bad); }, Errc::invalid_layout, "random"));
  bad = engine("tiny-mixtral", 2);
  bad.moe_order = "w31";  // vLLM has no w31 option
  EXPECT_TRUE(throws_errc([&] { make_engine_layout(bad); }, Errc::invalid_layout, "w31"));
}

TEST(EngineLayout, GlobalRankMapsToReplicaRank) {
  auto c = engine("tiny-qwen2", 2);
  c.replicas = 3;
  const auto layout = make_engine_layout(c);
  EXPECT_EQ(layout.world(), 6);
  EXPECT_EQ(layout.rank_layout(5).rank, 1);
  EXPECT_EQ(layout.rank_layout(4).rank, 0);
}

}  // namespace
}  // namespace weightsync
