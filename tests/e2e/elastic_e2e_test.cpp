// Elastic engine replicas end to end: `weightsync demo --elastic` with real
// processes over UCX. Replicas join (scale out) and leave (scale in) between
// steps; each step serves the replicas ready when trainer rank 0 began it,
// with its own plan (the id changes with the membership); a joining replica
// receives the whole version and serves it bit for bit; a replaced process
// comes back under the membership's plan.
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

namespace weightsync::e2e {
namespace {

Demo run_elastic(const Model& m, std::vector<std::string> extra) {
  extra.insert(extra.begin(), {"--timeout", "60", "--elastic"});
  return run_model_demo(m, extra);
}

bool has(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// Three replica slots of tp 2: replicas 0 and 2 start, 1 joins at step 3,
// 2 leaves after step 4. With min_replicas 2 the first step waits for both
// initial replicas and step 5 for replica 1. Step gaps give a joining process
// time to get ready (on a loaded machine it may join a step later: that is
// allowed, never earlier than its join step, and never mixed).
void scale_out_and_in(const std::string& mode) {
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 3);
  const Demo d =
      run_elastic(m, {"--mode", mode, "--steps", "6", "--bucket-bytes", "8192", "--step-gap", "1.5",
                      "--join", "1:3", "--leave", "2:4", "--min-replicas", "2"});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_EQ(d.run.exit_code, 0) << d.run.output;
  EXPECT_TRUE(d.summary["ok"].get<bool>()) << d.run.output;
  const auto& steps = d.summary["steps"];
  ASSERT_EQ(steps.size(), 6u);
  std::map<std::vector<int>, std::string> plan_of;
  std::set<std::string> ids;
  int joined_at = 0;
  for (int s = 1; s <= 6; ++s) {
    const auto& row = steps[static_cast<size_t>(s - 1)];
    const std::vector<int> replicas = ints(row["replicas"]);
    SCOPED_TRACE(cat("step ", s, " replicas ", row["replicas"].dump()));
    EXPECT_TRUE(has(replicas, 0));
    EXPECT_EQ(has(replicas, 2), s <= 4) << "replica 2 serves until it leaves after step 4";
    if (has(replicas, 1) && !joined_at) joined_at = s;
    if (joined_at) {
      EXPECT_TRUE(has(replicas, 1)) << "once joined, replica 1 stays";
    }
    // Exactly the membership's ranks committed and verified (replica r: ranks 2r, 2r+1).
    std::vector<int> ranks;
    for (int r : replicas) ranks.insert(ranks.end(), {2 * r, 2 * r + 1});
    EXPECT_EQ(ints(row["committed"]), ranks);
    EXPECT_EQ(ints(row["verified"]), ranks);
    // One plan per membership: the same id for the same replicas, another for others.
    const std::string id = row["plan_id"].get<std::string>();
    EXPECT_EQ(id.size(), 16u);
    auto [it, fresh] = plan_of.emplace(replicas, id);
    EXPECT_EQ(it->second, id);
    if (fresh) {
      EXPECT_TRUE(ids.insert(id).second) << "plan " << id << " reused";
    }
  }
  EXPECT_GE(joined_at, 3) << "replica 1 joined before its processes started";
  EXPECT_GE(plan_of.size(), 3u) << "[0,2], [0,1,2] and [0,1]";
  ASSERT_EQ(d.summary["joined"].size(), 1u);
  EXPECT_TRUE(d.summary["joined"][0]["served"].get<bool>());
  // Replica 1 holds the last version; replica 2 the one of the step it left after.
  const auto& versions = d.summary["engine_versions"];
  for (int g : {0, 1, 2, 3}) EXPECT_EQ(versions[static_cast<size_t>(g)].get<int>(), 6) << g;
  for (int g : {4, 5}) EXPECT_EQ(versions[static_cast<size_t>(g)].get<int>(), 4) << g;
}

TEST(E2EElastic, ReplicasJoinAndLeaveBetweenStepsP2p) {
  REQUIRE_UCX();
  scale_out_and_in("p2p");
}

TEST(E2EElastic, ReplicasJoinAndLeaveBetweenStepsBroadcast) {
  REQUIRE_UCX();
  scale_out_and_in("broadcast");
}

// A replaced node: engine rank 1 (replica 0) dies mid-step 2 and a new
// process takes its place. With min_replicas 2 the next step waits until the
// new process is ready; replica 0 is then served again under the plan of the
// full membership and catches up.
TEST(E2EElastic, AReplacedNodeRejoinsUnderTheMembershipsPlan) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-llama", "fsdp=2", 2, 2);
  const Demo d = run_elastic(m, {"--steps", "8", "--bucket-bytes", "4096", "--step-gap", "1.5",
                                 "--kill", "engine:1:2", "--restart", "--min-replicas", "2"});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  const auto& steps = d.summary["steps"];
  ASSERT_EQ(steps.size(), 8u);
  EXPECT_EQ(ints(steps[0]["replicas"]), (std::vector<int>{0, 1}));
  EXPECT_FALSE(has(ints(steps[1]["committed"]), 1)) << "rank 1 killed mid-step 2";
  EXPECT_TRUE(has(ints(steps[1]["committed"]), 2) && has(ints(steps[1]["committed"]), 3));
  // Later steps serve replica 0 once its new process for rank 1 is ready:
  // whenever served, both its ranks commit, bit for bit.
  for (size_t s = 2; s < 8; ++s) {
    const std::vector<int> replicas = ints(steps[s]["replicas"]);
    const std::vector<int> want =
        has(replicas, 0) ? std::vector<int>{0, 1, 2, 3} : std::vector<int>{2, 3};
    EXPECT_EQ(ints(steps[s]["committed"]), want) << "step " << s + 1;
    EXPECT_EQ(ints(steps[s]["verified"]), want) << "step " << s + 1;
  }
  EXPECT_EQ(ints(steps[7]["replicas"]), (std::vector<int>{0, 1})) << d.run.output;
  EXPECT_EQ(ints(steps[7]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(ints(steps[7]["verified"]), (std::vector<int>{0, 1, 2, 3}));
  for (int g = 0; g < 4; ++g)
    EXPECT_EQ(d.summary["engine_versions"][static_cast<size_t>(g)].get<int>(), 8) << g;
}

TEST(E2EElastic, OptionsAreChecked) {
  const Model m = make_model("tiny-llama", "fsdp=2", 2, 2);
  const CliRun no_elastic = run_cli({"demo", "--checkpoint", m.checkpoint, "--trainer", m.trainer,
                                     "--engine", m.engine, "--join", "1:2"});
  EXPECT_NE(no_elastic.exit_code, 0);
  EXPECT_NE(no_elastic.output.find("--join needs --elastic"), std::string::npos)
      << no_elastic.output;
  const CliRun bad = run_cli({"demo", "--checkpoint", m.checkpoint, "--trainer", m.trainer,
                              "--engine", m.engine, "--elastic", "--join", "2:2"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("replica must be in 0..1"), std::string::npos) << bad.output;
  const CliRun nccl =
      run_cli({"demo", "--checkpoint", m.checkpoint, "--trainer", m.trainer, "--engine", m.engine,
               "--elastic", "--transport", "nccl", "--steps", "1", "--timeout", "10"});
  EXPECT_NE(nccl.exit_code, 0);
  EXPECT_NE(nccl.output.find("an NCCL communicator is fixed"), std::string::npos) << nccl.output;
}

}  // namespace
}  // namespace weightsync::e2e
