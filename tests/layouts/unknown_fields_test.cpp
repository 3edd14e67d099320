// No option passes silently (issue 52): a field that the engine config, the
// trainer layout, a derived engine layout or the plan options do not know is
// refused, naming it and listing the accepted ones, instead of being ignored
// (a misspelt "replica" used to leave the job at one replica).
#include "layouts/engine_test_util.h"

#include <nlohmann/json.hpp>

#include <weightsync/engine_layout.h>
#include <weightsync/layouts.h>
#include <weightsync/load_spec.h>
#include <weightsync/plan_options.h>

#include <gtest/gtest.h>

namespace weightsync {
namespace {

using nlohmann::json;
using testing::model_config_path;
using testing::throws_errc;

json engine() {
  return {{"framework", "vllm"},
          {"hf_config", model_config_path("tiny-llama")},
          {"tp", 2},
          {"replicas", 1},
          {"dtype", "BF16"}};
}

TEST(UnknownFields, AnEngineConfigFieldNobodyReadsIsRefusedByName) {
  EXPECT_NO_THROW(engine_config_from_json(engine(), ""));
  json typo = engine();
  typo.erase("replicas");
  typo["replica"] = 2;  // meant "replicas": silently one replica before
  EXPECT_TRUE(throws_errc([&] { engine_config_from_json(typo, ""); }, Errc::format,
                          "engine config: unknown field 'replica' (accepted: framework, "
                          "hf_config, tp, replicas"));
  // An engine group names its index too.
  EXPECT_TRUE(throws_errc(
      [&] {
        engine_spec_from_json(json::array({engine(), typo}), "");
      },
      Errc::format, "engine group 1: engine config: unknown field 'replica'"));
  // The fields weightsync's own integrations write are accepted.
  json lora = engine();
  lora["lora"] = {{"name", "math"}};
  lora["moe_order"] = "w13";
  EXPECT_NO_THROW(engine_config_from_json(lora, ""));
}

json layout() {
  return {{"mesh", {{"axes", {"fsdp"}}, {"shape", {2}}}},
          {"params",
           {{{"name", "w"},
             {"hf_keys", {"model.w"}},
             {"fused_dim", nullptr},
             {"global_shape", {4, 4}},
             {"dtype", "F32"},
             {"shards", {{{"dim", 0}, {"axis", "fsdp"}}}}}}}};
}

TEST(UnknownFields, ATrainerLayoutFieldNobodyReadsIsRefusedByName) {
  EXPECT_NO_THROW(TrainerLayout::from_json(layout()));
  const auto refused = [](json j, const std::string& needle) {
    return throws_errc([&] { TrainerLayout::from_json(j); }, Errc::format, needle);
  };
  json top = layout();
  top["version"] = 2;
  EXPECT_TRUE(refused(top, "trainer layout: unknown field 'version' (accepted: mesh, params)"));
  json mesh = layout();
  mesh["mesh"]["names"] = {"fsdp"};
  EXPECT_TRUE(refused(mesh, "trainer layout: mesh: unknown field 'names' (accepted: axes, shape)"));
  json param = layout();
  param["params"][0]["fused_dims"] = 0;  // meant fused_dim
  EXPECT_TRUE(refused(param,
                      "trainer layout: param 'w': unknown field 'fused_dims' (accepted: "
                      "name, hf_keys, fused_dim"));
  json shard = layout();
  shard["params"][0]["shards"][0]["interleaves"] = 2;
  EXPECT_TRUE(refused(shard,
                      "trainer layout: param 'w'.shards[0]: unknown field 'interleaves' "
                      "(accepted: dim, axis, interleave)"));
}

TEST(UnknownFields, ADerivedEngineLayoutFieldIsRefusedByName) {
  const json box = {{"offsets", {0}}, {"lengths", {4}}};
  json derived = {
      {"tensors", {{{"key", "w"}, {"shape", {4}}, {"dtype", "F32"}}}},
      {"ranks",
       {{{"rank", 0},
         {"params",
          {{{"name", "w"},
            {"dtype", "F32"},
            {"shape", {4}},
            {"segments", {{{"hf_key", "w"}, {"hf_box", box}, {"param_box", box}}}}}}}}}}};
  EXPECT_NO_THROW(derived_layout_from_json(derived, 1));
  json seg = derived;
  seg["ranks"][0]["params"][0]["segments"][0]["transposed"] = true;  // meant transpose
  EXPECT_TRUE(throws_errc([&] { derived_layout_from_json(seg, 1); }, Errc::format,
                          "unknown field 'transposed' (accepted: hf_key, hf_box, param_box, "
                          "transpose)"));
  json tensor = derived;
  tensor["tensors"][0]["stride"] = {1};
  EXPECT_TRUE(throws_errc([&] { derived_layout_from_json(tensor, 1); }, Errc::format,
                          "unknown field 'stride' (accepted: key, shape, dtype)"));
}

TEST(UnknownFields, PlanOptionsRefuseAFieldTheyDoNotKnow) {
  EXPECT_TRUE(throws_errc(
      [] {
        PlanOptions::from_json({{"mode", "p2p"}, {"bucket_bytes", 4096}, {"buckets", 2}});
      },
      Errc::format, "plan options: unknown field 'buckets' (accepted: mode, bucket_bytes"));
}

}  // namespace
}  // namespace weightsync
