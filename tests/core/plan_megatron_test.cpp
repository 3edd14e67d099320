// Plans from Megatron-Core trainer layouts (segments, stages, expert grids)
// into vLLM engines of several shapes: verify_plan re-derives every item and
// checks exact cover, for every family the megatron style covers.
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>
#include <weightsync/plan.h>
#include <weightsync/topology.h>

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <numeric>

namespace weightsync {
namespace {

HfModelConfig model(const std::string& name, int64_t layers) {
  nlohmann::json j = HfModelConfig::load(std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/" +
                                         name + "/config.json")
                         .raw();
  j["num_hidden_layers"] = layers;
  return HfModelConfig::from_json(j);
}

struct Case {
  const char* model;
  int64_t layers;
  const char* parallel;
  int tp;
  bool expert_parallel;
  PlanMode mode;
};

class MegatronPlans : public ::testing::TestWithParam<Case> {};

TEST_P(MegatronPlans, ExactCoverIntoVllm) {
  const Case& c = GetParam();
  const HfModelConfig config = model(c.model, c.layers);
  const TrainerLayout trainer = make_megatron_layout(config, parse_megatron_parallel(c.parallel));
  EngineConfig ec;
  ec.hf = config;
  ec.dtype = config.dtype;
  ec.tp = c.tp;
  ec.expert_parallel = c.expert_parallel;
  ec.replicas = 2;
  const EngineLayout engine = make_engine_layout(ec);
  PlanOptions options;
  options.mode = c.mode;
  options.bucket_bytes = 8192;
  const Plan plan = make_plan(trainer, engine, Topology{}, options);
  EXPECT_NO_THROW(verify_plan(plan, trainer, engine));
  // Every trainer rank holds something, and pipeline stages all send.
  const auto& sent = plan.stats().bytes_per_trainer_rank;
  const int64_t total = std::accumulate(sent.begin(), sent.end(), int64_t{0});
  EXPECT_GT(total, 0);
  const int64_t per_stage = trainer.mesh.world() / trainer.mesh.shape[0];
  for (int64_t s = 0; s < trainer.mesh.shape[0]; ++s) {
    int64_t stage_bytes = 0;
    for (int64_t r = s * per_stage; r < (s + 1) * per_stage; ++r) stage_bytes += sent[r];
    EXPECT_GT(stage_bytes, 0) << "stage " << s << " sends nothing";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Families, MegatronPlans,
    ::testing::Values(
        Case{"tiny-llama", 2, "pp=2,tp=2", 2, false, PlanMode::p2p},
        Case{"tiny-llama", 4, "pp=2,tp=2,dp=2", 4, false, PlanMode::p2p},
        Case{"tiny-llama", 3, "pp=3,tp=1,dp=2", 2, false, PlanMode::broadcast},
        Case{"tiny-qwen2", 2, "pp=2,tp=2", 2, false, PlanMode::p2p},
        Case{"tiny-qwen3", 4, "pp=2,tp=4", 4, false, PlanMode::p2p},
        Case{"tiny-qwen3-moe", 3, "pp=3,tp=2,dp=2,ep=2,etp=1", 2, false, PlanMode::p2p},
        Case{"tiny-qwen3-moe", 3, "pp=1,tp=2,dp=3,ep=3,etp=2", 2, true, PlanMode::p2p},
        Case{"tiny-mixtral", 2, "pp=2,tp=2,dp=2,ep=2,etp=2", 2, false, PlanMode::broadcast},
        Case{"tiny-deepseek-v3", 3, "pp=3,tp=2,dp=1,ep=2,etp=1", 2, true, PlanMode::p2p},
        Case{"tiny-deepseek-v3", 4, "pp=2,tp=1,dp=4,ep=2,etp=1", 4, false, PlanMode::p2p}),
    [](const auto& info) { return "case" + std::to_string(info.index); });

}  // namespace
}  // namespace weightsync
