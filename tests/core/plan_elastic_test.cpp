// Plans for elastic replicas (PlanOptions::replicas): only the replicas of
// the membership receive, each its whole part, the load spreads over them, and
// the plan id follows the membership.
#include "plan_sim.h"

#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <numeric>
#include <set>

namespace weightsync::test {
namespace {

int64_t param_bytes(const EngineLayout& e, int g) {
  int64_t bytes = 0;
  for (const EngineParam& p : e.rank_layout(g).params)
    for (const Segment& s : p.segments)
      bytes += s.hf_box.numel() * static_cast<int64_t>(itemsize(p.dtype));
  return bytes;
}

struct Layouts {
  TrainerLayout trainer;
  EngineLayout engine;
};

// tiny-llama over dp 2 x fsdp 2 into `replicas` slots of tp 2.
Layouts llama(int replicas) {
  const HfModelConfig config = HfModelConfig::load(model_config_path("tiny-llama"));
  Mesh mesh;
  mesh.axes = {"dp", "fsdp"};
  mesh.shape = {2, 2};
  EngineConfig ec;
  ec.hf = config;
  ec.dtype = config.dtype;
  ec.tp = 2;
  ec.replicas = replicas;
  return {make_trainer_layout(config, mesh), make_engine_layout(ec)};
}

class ElasticPlans : public ::testing::TestWithParam<PlanMode> {};

TEST_P(ElasticPlans, OnlyTheMembershipReceivesEachRankItsWholePart) {
  const Layouts s = llama(4);
  PlanOptions options;
  options.mode = GetParam();
  options.bucket_bytes = 8192;
  options.replicas = {1, 3};
  const Plan plan = make_plan(s.trainer, s.engine, Topology{}, options);
  EXPECT_NO_THROW(verify_plan(plan, s.trainer, s.engine));
  const SimResult sim = simulate(plan, s.trainer, s.engine);
  for (int g = 0; g < s.engine.world(); ++g) {
    const int replica = g / 2;
    const bool served = replica == 1 || replica == 3;
    EXPECT_EQ(plan.serves(g), served) << "engine rank " << g;
    EXPECT_EQ(plan.replica_of(g), replica);
    const int64_t want = !served                       ? 0
                         : GetParam() == PlanMode::p2p ? param_bytes(s.engine, g)
                                                       : sim.model_bytes;
    EXPECT_EQ(sim.bytes_in[static_cast<size_t>(g)], want) << "engine rank " << g;
    EXPECT_EQ(plan.stats().bytes_per_engine_rank[static_cast<size_t>(g)], want);
    EXPECT_EQ(plan.buckets_received_by(g).empty(), !served);
  }
  EXPECT_EQ(plan.summary_json()["replicas"], nlohmann::json({1, 3}));
}

TEST_P(ElasticPlans, PlanIdFollowsTheMembership) {
  const Layouts s = llama(3);
  PlanOptions options;
  options.mode = GetParam();
  options.bucket_bytes = 8192;
  std::set<uint64_t> ids;
  const std::vector<std::vector<int32_t>> memberships = {{}, {0}, {1}, {0, 1}, {0, 2}, {0, 1, 2}};
  for (const auto& m : memberships) {
    options.replicas = m;
    const Plan a = make_plan(s.trainer, s.engine, Topology{}, options);
    const Plan b = make_plan(s.trainer, s.engine, Topology{}, options);
    EXPECT_EQ(a.plan_id(), b.plan_id()) << "same membership, same plan";
    ids.insert(a.plan_id());
  }
  // Every membership its own id; the full list too differs from "every replica" (static jobs).
  EXPECT_EQ(ids.size(), memberships.size());
}

INSTANTIATE_TEST_SUITE_P(Modes, ElasticPlans, ::testing::Values(PlanMode::p2p, PlanMode::broadcast),
                         [](const auto& info) { return std::string(plan_mode_name(info.param)); });

// Random layouts (groups of replicas too) and a random membership.
TEST(ElasticPlan, RandomLayoutsAndMembershipsCoverEveryServedRank) {
  for (uint64_t seed = 0; seed < 24; ++seed) {
    std::mt19937_64 rng(7000 + seed);
    const std::string model = tiny_models()[rng() % tiny_models().size()];
    const TrainerLayout trainer = random_trainer_layout(model, rng);
    EngineConfig one = random_engine_config(model, rng);
    one.replicas = 2 + static_cast<int>(rng() % 2);
    EngineSpec spec(one);
    if (rng() % 2) spec.groups.push_back(random_engine_config(model, rng));
    const EngineLayout engine = make_engine_layout(spec);
    PlanOptions options;
    options.mode = seed % 2 ? PlanMode::p2p : PlanMode::broadcast;
    options.bucket_bytes = int64_t{1024} << (rng() % 8);
    for (int r = 0; r < engine.num_replicas(); ++r)
      if (rng() % 2) options.replicas.push_back(r);
    if (options.replicas.empty()) options.replicas.push_back(engine.num_replicas() - 1);
    SCOPED_TRACE(cat(model, " seed ", seed, " ", plan_mode_name(options.mode), " replicas ",
                     nlohmann::json(options.replicas).dump(), " of ", engine.num_replicas()));
    const Plan plan = make_plan(trainer, engine, Topology{}, options);
    EXPECT_NO_THROW(verify_plan(plan, trainer, engine));
    const SimResult sim = simulate(plan, trainer, engine);  // every served rank exactly covered
    for (int g = 0; g < engine.world(); ++g) {
      const bool served = std::find(options.replicas.begin(), options.replicas.end(),
                                    plan.replica_of(g)) != options.replicas.end();
      EXPECT_EQ(plan.serves(g), served);
      if (options.mode == PlanMode::p2p) {
        EXPECT_EQ(sim.bytes_in[static_cast<size_t>(g)], served ? param_bytes(engine, g) : 0);
      }
    }
  }
}

TEST(ElasticPlan, LoadSpreadsOverTheSendersForTheMembershipServed) {
  const Layouts s = llama(4);
  PlanOptions options;
  options.bucket_bytes = 4096;
  options.replicas = {2};
  const Plan one = make_plan(s.trainer, s.engine, Topology{}, options);
  options.replicas = {0, 2, 3};
  const Plan three = make_plan(s.trainer, s.engine, Topology{}, options);
  const auto total = [](const Plan& p) {
    const auto& v = p.stats().bytes_per_trainer_rank;
    return std::accumulate(v.begin(), v.end(), int64_t{0});
  };
  EXPECT_EQ(total(three), 3 * total(one));
  // Each replica's bytes come from every trainer rank that holds data, not
  // from the ranks a plan for all four replicas would have given it.
  for (const Plan* p : {&one, &three})
    for (int64_t sent : p->stats().bytes_per_trainer_rank) EXPECT_GT(sent, 0);
  EXPECT_NO_THROW(verify_plan(three, s.trainer, s.engine));
}

TEST(ElasticPlan, BadMembershipIsNamed) {
  const Layouts s = llama(2);
  for (const std::vector<int32_t>& bad :
       std::vector<std::vector<int32_t>>{{2}, {-1}, {1, 0}, {0, 0}}) {
    PlanOptions options;
    options.replicas = bad;
    try {
      make_plan(s.trainer, s.engine, Topology{}, options);
      ADD_FAILURE() << "accepted replicas " << nlohmann::json(bad).dump();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("replicas must be ascending distinct indices in 0..1"),
                std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace weightsync::test
