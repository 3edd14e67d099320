// `weightsync plan` through the real binary, and topology files.
#include "plan_sim.h"

#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/topology.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <sstream>

namespace weightsync::test {
namespace {

namespace fs = std::filesystem;

struct CliRun {
  int status = -1;
  std::string out;
};

CliRun run_cli(const std::string& args) {
  CliRun r;
  FILE* p = popen((std::string(WEIGHTSYNC_CLI) + " " + args).c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

class PlanCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ws_plan_cli_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Writes the trainer layout and an engine config of `model`; returns the layouts.
  std::pair<TrainerLayout, EngineLayout> write(const std::string& model, const std::string& mesh,
                                               int tp, int replicas, bool ep) {
    const HfModelConfig config = HfModelConfig::load(model_config_path(model));
    TrainerLayout t = make_trainer_layout(config, parse_mesh_spec(mesh));
    std::ofstream(dir_ / "t.json") << t.to_json().dump();
    nlohmann::json e = {
        {"framework", "vllm"},   {"hf_config", model_config_path(model)}, {"tp", tp},
        {"expert_parallel", ep}, {"expert_placement", "linear"},          {"replicas", replicas},
        {"dtype", "BF16"}};
    std::ofstream(dir_ / "e.json") << e.dump();
    return {t, make_engine_layout(load_engine_config((dir_ / "e.json").string()))};
  }
  std::string files() const {
    return "--trainer " + (dir_ / "t.json").string() + " --engine " + (dir_ / "e.json").string();
  }
  fs::path dir_;
};

TEST_F(PlanCli, JsonSummaryMatchesOwnByteCount) {
  const auto [trainer, engine] = write("tiny-deepseek-v3", "ep=2,fsdp=3", 2, 2, true);
  const CliRun r = run_cli("plan " + files() + " --json --verify");
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  int64_t lo = INT64_MAX, hi = 0;
  for (int g = 0; g < engine.world(); ++g) {
    int64_t bytes = 0;
    for (const EngineParam& p : engine.rank_layout(g).params)
      for (const Segment& s : p.segments) bytes += s.hf_box.numel() * 2;  // BF16
    lo = std::min(lo, bytes);
    hi = std::max(hi, bytes);
  }
  EXPECT_EQ(j["bytes_per_engine_rank"]["min"].get<int64_t>(), lo);
  EXPECT_EQ(j["bytes_per_engine_rank"]["max"].get<int64_t>(), hi);
  EXPECT_EQ(j["mode"], "p2p");
  EXPECT_EQ(j["plan_id"].get<std::string>().size(), 16u);
  EXPECT_GT(j["buckets"].get<int64_t>(), 0);
  EXPECT_LE(j["lower_bound_s"].get<double>(), j["predicted_s"].get<double>());
  EXPECT_TRUE(j.contains("plan_s"));
  EXPECT_TRUE(j["verified"].get<bool>());
  // The same inputs give the same id in another process.
  const CliRun again = run_cli("plan " + files() + " --json");
  EXPECT_EQ(nlohmann::json::parse(again.out)["plan_id"], j["plan_id"]);
}

// Elastic replicas: --replicas plans for a membership; its id is that
// membership's, the library computes the same plan, and others differ.
TEST_F(PlanCli, ReplicasPlanForAMembership) {
  const auto [trainer, engine] = write("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 3, false);
  std::set<std::string> ids;
  for (const std::string list : {"", "1", "0,2", "0,1,2"}) {
    const CliRun r = run_cli("plan " + files() + " --json --verify" +
                             (list.empty() ? "" : " --replicas " + list));
    ASSERT_EQ(r.status, 0) << r.out;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_TRUE(j["verified"].get<bool>());
    ids.insert(j["plan_id"].get<std::string>());
    if (list.empty()) {
      EXPECT_FALSE(j.contains("replicas"));
      continue;
    }
    PlanOptions options;
    std::stringstream in(list);
    for (std::string x; std::getline(in, x, ',');) options.replicas.push_back(std::stoi(x));
    EXPECT_EQ(j["replicas"], nlohmann::json(options.replicas));
    const Plan plan = make_plan(trainer, engine, Topology{}, options);
    EXPECT_EQ(j["plan_id"], plan.plan_id_hex()) << list;
    EXPECT_EQ(j["bytes_total"].get<int64_t>(), plan.stats().bytes_total);
  }
  EXPECT_EQ(ids.size(), 4u);
  const CliRun bad = run_cli("plan " + files() + " --replicas 3 2>&1");
  EXPECT_NE(bad.status, 0);
  EXPECT_NE(bad.out.find("replicas must be ascending distinct indices in 0..2"), std::string::npos)
      << bad.out;
}

TEST_F(PlanCli, BroadcastAndItemsLines) {
  write("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 1, false);
  const CliRun r = run_cli("plan " + files() + " --mode broadcast --bucket-bytes 8192 --json");
  ASSERT_EQ(r.status, 0) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["mode"], "broadcast");
  EXPECT_EQ(j["bytes_per_engine_rank"]["min"], j["bytes_per_engine_rank"]["max"]);
  EXPECT_LE(j["max_bucket_bytes"].get<int64_t>(), 8192);

  const CliRun items = run_cli("plan " + files() + " --items 2>/dev/null");
  ASSERT_EQ(items.status, 0);
  int64_t lines = 0, bytes = 0;
  std::istringstream in(items.out);
  for (std::string line; std::getline(in, line); ++lines)
    bytes += nlohmann::json::parse(line)["bytes"].get<int64_t>();
  const nlohmann::json p2p = nlohmann::json::parse(run_cli("plan " + files() + " --json").out);
  EXPECT_EQ(lines, p2p["items"].get<int64_t>());
  EXPECT_EQ(bytes, p2p["bytes_total"].get<int64_t>());
}

TEST_F(PlanCli, BadInputsFailWithAMessage) {
  write("tiny-llama", "fsdp=2", 1, 1, false);
  CliRun r = run_cli("plan " + files() + " --mode scatter 2>&1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("scatter"), std::string::npos) << r.out;
  r = run_cli("plan --trainer " + (dir_ / "missing.json").string() + " --engine x.json 2>&1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("missing.json"), std::string::npos) << r.out;
  std::ofstream(dir_ / "topo.json") << R"({"gpus_per_node": 8, "nic_bandwidth_GBps": "fast"})";
  r = run_cli("plan " + files() + " --topology " + (dir_ / "topo.json").string() + " 2>&1");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.out.find("nic_bandwidth_GBps"), std::string::npos) << r.out;
}

TEST(Topology, ShippedFilesLoadAndPlaceRanks) {
  int count = 0;
  for (const auto& f :
       fs::directory_iterator(std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/topologies")) {
    if (f.path().extension() != ".json") continue;
    SCOPED_TRACE(f.path().string());
    const Topology t = Topology::load(f.path().string());
    EXPECT_GT(t.nic_bandwidth_GBps, 0);
    ++count;
  }
  EXPECT_GE(count, 1);
  Topology t;  // default: trainer on nodes 0..1 for 16 ranks, engines after
  EXPECT_EQ(t.trainer_node(15, 16), 1);
  EXPECT_EQ(t.engine_node(0, 16), 2);
  EXPECT_EQ(t.engine_slot(9, 16), 1);
  EXPECT_THROW(Topology::from_json(nlohmann::json{{"gpus_per_nic", 3}}), Error);
  EXPECT_THROW(Topology::from_json(nlohmann::json{{"bogus", 1}}), Error);
}

// Two GPUs per NIC share its bandwidth: the lower bound about doubles.
TEST(Topology, SharedNicRaisesTheLowerBound) {
  const HfModelConfig config = HfModelConfig::load(model_config_path("tiny-qwen3"));
  const TrainerLayout trainer = make_trainer_layout(config, parse_mesh_spec("fsdp=4"));
  EngineConfig ec;
  ec.hf = config;
  ec.dtype = config.dtype;
  ec.tp = 2;
  ec.replicas = 2;
  const EngineLayout engine = make_engine_layout(ec);
  Topology one, two;
  one.nic_latency_us = two.nic_latency_us = 0;
  two.gpus_per_nic = 2;
  const Plan a = make_plan(trainer, engine, one);
  const Plan b = make_plan(trainer, engine, two);
  EXPECT_GT(b.stats().lower_bound_s, 1.5 * a.stats().lower_bound_s);
  EXPECT_NE(a.plan_id(), b.plan_id());
}

}  // namespace
}  // namespace weightsync::test
