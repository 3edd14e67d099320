// The engine config JSON: paths, inline configs, typed fields, round trip.
#include "layouts/engine_test_util.h"

#include <nlohmann/json.hpp>

#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

namespace weightsync {
namespace {

using nlohmann::json;
using testing::model_config_path;
using testing::throws_errc;

json base() {
  return {{"framework", "vllm"},
          {"hf_config", model_config_path("tiny-mixtral")},
          {"tp", 2},
          {"expert_parallel", true},
          {"expert_placement", "round_robin"},
          {"replicas", 3},
          {"dtype", "BF16"}};
}

TEST(EngineConfig, ParsesTheContractFields) {
  const auto c = engine_config_from_json(base(), "");
  EXPECT_EQ(c.framework, "vllm");
  EXPECT_EQ(c.hf.family, "mixtral");
  EXPECT_EQ(c.tp, 2);
  EXPECT_TRUE(c.expert_parallel);
  EXPECT_EQ(c.expert_placement, "round_robin");
  EXPECT_EQ(c.replicas, 3);
  EXPECT_EQ(c.dtype, DType::BF16);
  EXPECT_EQ(c.moe_order, "w13");
  // Round trip through to_json (hf_config inline).
  const auto again = engine_config_from_json(c.to_json(), "");
  EXPECT_EQ(again.to_json(), c.to_json());
  EXPECT_EQ(again.hf.num_experts, 6);
}

TEST(EngineConfig, RelativePathsResolveAgainstTheEngineFile) {
  const auto c = load_engine_config(std::string(WEIGHTSYNC_SOURCE_DIR) +
                                    "/configs/examples/engine_tiny_deepseek_v3_vllm_tp2.json");
  EXPECT_EQ(c.hf.family, "deepseek_v3");
  EXPECT_EQ(c.replicas, 2);
  // A model directory works too, and defaults apply to absent fields.
  const json j = {{"framework", "sglang"}, {"hf_config", "models/tiny-qwen2"}, {"tp", 1}};
  const auto d = engine_config_from_json(j, std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs");
  EXPECT_EQ(d.hf.family, "qwen2");
  EXPECT_FALSE(d.expert_parallel);
  EXPECT_EQ(d.replicas, 1);
  EXPECT_EQ(d.dtype, DType::BF16);
  EXPECT_TRUE(throws_errc(
      [] {
        engine_config_from_json({{"framework", "vllm"}, {"hf_config", "nope"}, {"tp", 1}}, "/tmp");
      },
      Errc::not_found, "nope"));
}

TEST(EngineConfig, InlineHfConfig) {
  auto j = base();
  j["hf_config"] = testing::model("tiny-llama").raw();
  EXPECT_EQ(engine_config_from_json(j, "").hf.family, "llama");
}

TEST(EngineConfig, WrongTypesAreFormatErrorsNamingTheField) {
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, json>>{{"tp", "2"},
                                                 {"expert_parallel", 1},
                                                 {"replicas", 1.5},
                                                 {"framework", 3},
                                                 {"expert_placement", false},
                                                 {"hf_config", 7},
                                                 {"dtype", "bf16"},
                                                 {"moe_order", json::array()}}) {
    auto j = base();
    j[field] = value;
    EXPECT_TRUE(throws_errc([&] { engine_config_from_json(j, ""); }, Errc::format, field)) << field;
  }
  auto j = base();
  j.erase("tp");
  EXPECT_TRUE(throws_errc([&] { engine_config_from_json(j, ""); }, Errc::format, "tp"));
  EXPECT_TRUE(throws_errc([] { engine_config_from_json(json::array(), ""); }, Errc::format));
}

TEST(EngineConfig, UnknownValuesAreLayoutErrors) {
  for (const auto& [field, value] :
       std::vector<std::pair<std::string, json>>{{"framework", "tensorrt"},
                                                 {"expert_placement", "random"},
                                                 {"tp", 0},
                                                 {"replicas", -1},
                                                 {"moe_order", "w31"}}) {  // w31 is SGLang only
    auto j = base();
    j[field] = value;
    EXPECT_TRUE(throws_errc([&] { engine_config_from_json(j, ""); }, Errc::invalid_layout, field))
        << field;
  }
  auto j = base();
  j["framework"] = "sglang";
  j["moe_order"] = "w31";
  EXPECT_EQ(engine_config_from_json(j, "").moe_order, "w31");
}

}  // namespace
}  // namespace weightsync

namespace weightsync {
namespace {

// `weightsync engine-layout --json` prints the same layout as the library.
TEST(EngineLayoutCli, JsonMatchesTheLibrary) {
  const std::string engine_json =
      std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/examples/engine_tiny_mixtral_vllm_tp2_rr.json";
  const std::string out = ::testing::TempDir() + "ws_engine_layout.json";
  const std::string cmd = std::string(WEIGHTSYNC_CLI) + " engine-layout --engine " + engine_json +
                          " --rank 1 --json > " + out;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(out);
  const auto j = nlohmann::json::parse(in);
  const auto layout = make_engine_layout(load_engine_config(engine_json));
  ASSERT_EQ(j["ranks"].size(), 1u);
  const auto& params = j["ranks"][0]["params"];
  const auto& want = layout.ranks[1].params;
  ASSERT_EQ(params.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(params[i]["name"], want[i].name);
    EXPECT_EQ(params[i]["shape"].get<Shape>(), want[i].shape);
    ASSERT_EQ(params[i]["segments"].size(), want[i].segments.size());
    const auto& s = params[i]["segments"].back();
    EXPECT_EQ(s["hf_key"], want[i].segments.back().hf_key);
    EXPECT_EQ(s["param_box"]["offsets"].get<Shape>(), want[i].segments.back().param_box.offsets);
  }
  std::remove(out.c_str());
}

// Framework "hf": every HF tensor whole under its own name on every rank.
TEST(EngineConfig, HfFrameworkHoldsEveryTensorWhole) {
  json j = base();
  j["framework"] = "hf";
  j["tp"] = 3;  // divides nothing of the model: whole tensors need no divisibility
  const EngineLayout layout = make_engine_layout(engine_config_from_json(j, ""));
  ASSERT_EQ(layout.ranks.size(), 3u);
  const auto tensors = hf_tensors(layout.config.hf);
  for (const auto& rank : layout.ranks) {
    ASSERT_EQ(rank.params.size(), tensors.size());
    for (size_t i = 0; i < tensors.size(); ++i) {
      const EngineParam& p = rank.params[i];
      EXPECT_EQ(p.name, tensors[i].key);
      EXPECT_EQ(p.shape, tensors[i].shape);
      ASSERT_EQ(p.segments.size(), 1u);
      EXPECT_EQ(p.segments[0].hf_box, Box::full(tensors[i].shape));
    }
  }
  EXPECT_NO_THROW(check_coverage(layout));
}

// Groups: an array of engine configs; ranks and replicas numbered group by group.
TEST(EngineSpec, GroupsNumberRanksAndReplicasInOrder) {
  json vllm = base(), hf = base();
  vllm["replicas"] = 2;  // tp 2: engine ranks 0..3, replicas 0..1
  hf["framework"] = "hf";
  hf["tp"] = 3;
  hf["replicas"] = 1;  // engine ranks 4..6, replica 2
  const EngineSpec spec = engine_spec_from_json(json::array({vllm, hf}), "");
  ASSERT_EQ(spec.groups.size(), 2u);
  EXPECT_EQ(engine_spec_from_json(spec.to_json(), "").to_json(), spec.to_json());
  EXPECT_TRUE(engine_spec_from_json(vllm, "").to_json().is_object());
  const EngineLayout layout = make_engine_layout(spec);
  EXPECT_EQ(layout.world(), 7);
  EXPECT_EQ(layout.num_replicas(), 3);
  EXPECT_EQ(layout.ranks.size(), 5u);
  EXPECT_EQ(layout.global_rank(1, 1), 3);
  EXPECT_EQ(layout.global_rank(2, 2), 6);
  EXPECT_EQ(layout.template_of(3), 1);
  EXPECT_EQ(layout.template_of(6), 4);
  EXPECT_EQ(layout.group_of(5).config.framework, "hf");
  EXPECT_EQ(&layout.rank_layout(5), &layout.ranks[3]);
  EXPECT_TRUE(throws_errc([&] { layout.global_rank(3, 0); }, Errc::invalid_argument, "replica 3"));
  EXPECT_TRUE(throws_errc([&] { layout.global_rank(0, 2); }, Errc::invalid_argument, "tp=2"));
  EXPECT_TRUE(throws_errc([&] { layout.group_of(7); }, Errc::invalid_argument, "engine rank 7"));
  EXPECT_NO_THROW(check_coverage(layout));
}

TEST(EngineSpec, BadGroupsAreNamed) {
  EXPECT_TRUE(
      throws_errc([] { engine_spec_from_json(json::array(), ""); }, Errc::format, "empty array"));
  json bad = base();
  bad["framework"] = "trtllm";
  EXPECT_TRUE(throws_errc(
      [&] {
        engine_spec_from_json(json::array({base(), bad}), "");
      },
      Errc::invalid_layout, "engine group 1: engine config: framework"));
}

}  // namespace
}  // namespace weightsync

namespace weightsync {
namespace {

using nlohmann::json;
using testing::throws_errc;

// Framework "derived": the layout an engine derived from its loader, as
// python/weightsync/_derive.py writes it. Built here from the vllm table of a
// known model under an HF config whose family has no table.
json derived_from_table(const std::string& model, int tp) {
  const EngineLayout table = make_engine_layout(testing::engine(model, tp));
  json tensors = json::array();
  for (const auto& t : hf_tensors(table.config.hf))
    tensors.push_back({{"key", t.key}, {"shape", t.shape}, {"dtype", "BF16"}});
  json ranks = json::array();
  for (const auto& r : table.ranks) ranks.push_back(rank_layout_to_json(r));
  return {{"framework", "derived"},
          {"hf_config", {{"model_type", "no_table_for_this"}, {"hidden_size", 64}}},
          {"tp", tp},
          {"replicas", 2},
          {"dtype", "BF16"},
          {"derived", {{"tensors", tensors}, {"ranks", ranks}}}};
}

TEST(DerivedLayout, TakesTheEnginesRanksAsTheyAre) {
  const json j = derived_from_table("tiny-qwen3", 2);
  const EngineConfig c = engine_config_from_json(j, "");
  EXPECT_EQ(c.framework, "derived");
  EXPECT_EQ(c.hf.model_type, "no_table_for_this");
  const EngineLayout got = make_engine_layout(EngineSpec(c));
  const EngineLayout want = make_engine_layout(testing::engine("tiny-qwen3", 2));
  ASSERT_EQ(got.ranks.size(), 2u);
  EXPECT_EQ(got.world(), 4);  // 2 replicas of tp=2
  for (size_t r = 0; r < 2; ++r)
    EXPECT_EQ(rank_layout_to_json(got.ranks[r]), rank_layout_to_json(want.ranks[r])) << r;
  EXPECT_EQ(engine_hf_tensors(c).size(), hf_tensors(want.config.hf).size());
  // Round trip (the config travels through the job's store as JSON).
  EXPECT_EQ(engine_config_from_json(c.to_json(), "").to_json(), c.to_json());
}

TEST(DerivedLayout, BadLayoutsAreRefusedNamingWhat) {
  {  // a segment that writes over another
    json j = derived_from_table("tiny-qwen3", 1);
    json* fused = nullptr;  // qkv_proj: three segments
    for (auto& p : j["derived"]["ranks"][0]["params"])
      if (!fused && p["segments"].size() >= 2) fused = &p;
    ASSERT_NE(fused, nullptr);
    auto& segs = (*fused)["segments"];
    segs[1]["param_box"] = segs[0]["param_box"];
    segs[1]["hf_box"]["lengths"] = segs[0]["param_box"]["lengths"];
    const std::string name = (*fused)["name"];
    EXPECT_TRUE(throws_errc([&] { make_engine_layout(engine_config_from_json(j, "")); },
                            Errc::invalid_layout, name));
  }
  {  // fewer rank layouts than tp
    json j = derived_from_table("tiny-qwen3", 2);
    j["derived"]["ranks"].erase(1);
    EXPECT_TRUE(throws_errc([&] { engine_config_from_json(j, ""); }, Errc::invalid_layout, "tp=2"));
  }
  {  // a segment past its HF tensor
    json j = derived_from_table("tiny-qwen3", 1);
    j["derived"]["tensors"][0]["shape"][0] = 1;
    EXPECT_TRUE(throws_errc([&] { make_engine_layout(engine_config_from_json(j, "")); },
                            Errc::invalid_layout));
  }
  {  // malformed fields name where
    json j = derived_from_table("tiny-qwen3", 1);
    j["derived"]["ranks"][0]["params"][0]["segments"][0]["hf_box"]["offsets"] = "zero";
    EXPECT_TRUE(throws_errc([&] { engine_config_from_json(j, ""); }, Errc::format, "hf_box"));
    j = derived_from_table("tiny-qwen3", 1);
    j["derived"].erase("tensors");
    EXPECT_TRUE(throws_errc([&] { engine_config_from_json(j, ""); }, Errc::format, "tensors"));
    j = derived_from_table("tiny-qwen3", 1);
    j["hf_config"] = "config.json";
    EXPECT_TRUE(throws_errc([&] { engine_config_from_json(j, ""); }, Errc::format, "inline"));
  }
}

// The frameworks come from one registry (src/layouts/engine_frameworks.cpp):
// an unknown name is refused by the config reader and by make_engine_layout,
// both listing the registered ones.
TEST(EngineConfig, UnknownFrameworkListsTheRegisteredOnes) {
  const std::string expected =
      "framework 'trtllm' is not supported (expected \"vllm\", \"sglang\", \"hf\" or "
      "\"derived\")";
  auto j = base();
  j["framework"] = "trtllm";
  EXPECT_TRUE(throws_errc([&] { engine_config_from_json(j, ""); }, Errc::invalid_layout, expected));
  EngineConfig c = engine_config_from_json(base(), "");
  c.framework = "trtllm";
  EXPECT_TRUE(throws_errc([&] { make_engine_layout(c); }, Errc::invalid_layout, expected));
}

}  // namespace
}  // namespace weightsync
