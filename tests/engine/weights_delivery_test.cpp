// load_weights mode's delivery plan (engine_adapter/weights_delivery.h): each
// HF tensor goes to the engine once, with the bucket that completes it, and
// the arena shares memory only between tensors whose lives do not meet.
#include "engine_adapter/weights_delivery.h"
#include "layouts/engine_test_util.h"

#include <weightsync/layouts.h>
#include <weightsync/plan.h>
#include <weightsync/topology.h>

#include <gtest/gtest.h>

namespace weightsync {
namespace {

struct Case {
  TrainerLayout trainer;
  EngineLayout engine;
  Plan plan;
};

Case make_case(PlanMode mode, int64_t bucket_bytes) {
  const HfModelConfig hf = HfModelConfig::load(testing::model_config_path("tiny-qwen3-moe"));
  TrainerLayoutOptions style;
  style.style = TrainerLayoutStyle::transformers;
  EngineConfig vllm, whole;
  vllm.hf = whole.hf = hf;
  vllm.dtype = whole.dtype = hf.dtype;
  vllm.tp = 2;
  whole.framework = "hf";
  whole.tp = 2;
  EngineSpec spec;
  spec.groups = {vllm, whole};
  Case c{
      make_trainer_layout(hf, parse_mesh_spec("ep=2,fsdp=2"), style), make_engine_layout(spec), {}};
  c.plan = make_plan(c.trainer, c.engine, Topology{}, {mode, bucket_bytes});
  return c;
}

class Delivery : public ::testing::TestWithParam<PlanMode> {};

TEST_P(Delivery, EachTensorOnceWithItsLastBucketInMemoryOfItsOwn) {
  const Case c = make_case(GetParam(), 8 << 10);
  const int rank = 3;  // the "hf" group's second rank
  const EngineRankLayout& layout = c.engine.rank_layout(rank);
  const engine::DeliveryPlan d = engine::plan_delivery(c.plan, rank, layout);
  const auto& order = c.plan.buckets_received_by(rank);
  ASSERT_EQ(d.complete_after.size(), order.size());
  ASSERT_GT(order.size(), 4u) << "small buckets: the arena has lives to share";
  // The buckets that write each param, from the plan itself.
  const size_t n = layout.params.size();
  std::vector<int64_t> first(n, -1), last(n, -1), delivered(n, -1);
  for (size_t k = 0; k < order.size(); ++k) {
    for (uint32_t p : d.complete_after[k]) {
      EXPECT_EQ(delivered[p], -1) << layout.params[p].name << " delivered twice";
      delivered[p] = static_cast<int64_t>(k);
    }
    auto touch = [&](int32_t segment) {
      const auto p = static_cast<size_t>(c.plan.segment_param(segment));
      if (first[p] < 0) first[p] = static_cast<int64_t>(k);
      last[p] = static_cast<int64_t>(k);
    };
    if (GetParam() == PlanMode::p2p)
      for (const PlanItem& it : c.plan.items(order[k])) touch(it.segment);
    else
      for (const ApplyItem& a : c.plan.apply_items(order[k], c.plan.engine_template(rank)))
        touch(a.segment);
  }
  int64_t model = 0;
  for (size_t p = 0; p < n; ++p) {
    EXPECT_EQ(delivered[p], last[p]) << layout.params[p].name;
    model += numel(layout.params[p].shape) * static_cast<int64_t>(itemsize(layout.params[p].dtype));
  }
  // Params whose places overlap live at different times (with the two
  // buckets of receives posted ahead).
  for (size_t a = 0; a < n; ++a)
    for (size_t b = a + 1; b < n; ++b) {
      const auto bytes = [&](size_t p) {
        return numel(layout.params[p].shape) *
               static_cast<int64_t>(itemsize(layout.params[p].dtype));
      };
      const bool share =
          d.offset[a] < d.offset[b] + bytes(b) && d.offset[b] < d.offset[a] + bytes(a);
      if (!share || bytes(a) == 0 || bytes(b) == 0) continue;
      EXPECT_TRUE(last[a] < first[b] - 2 || last[b] < first[a] - 2)
          << layout.params[a].name << " and " << layout.params[b].name << " share memory";
    }
  EXPECT_LT(d.arena_bytes, model) << "the arena reuses memory across buckets";
}

INSTANTIATE_TEST_SUITE_P(Modes, Delivery, ::testing::Values(PlanMode::p2p, PlanMode::broadcast),
                         [](const auto& info) { return std::string(plan_mode_name(info.param)); });

TEST(Delivery, NeedsWholeTensors) {
  const Case c = make_case(PlanMode::p2p, 1 << 20);
  EXPECT_TRUE(
      testing::throws_errc([&] { engine::plan_delivery(c.plan, 0, c.engine.rank_layout(0)); },
                           Errc::invalid_argument, "framework \"hf\""));
}

}  // namespace
}  // namespace weightsync
