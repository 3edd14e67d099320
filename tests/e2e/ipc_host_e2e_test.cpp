// The GPU path's lending, on every machine: `weightsync demo --transport
// ipc_host` runs whole jobs over cuda_ipc's protocol on host memory that the
// processes map from each other (src/transport/cuda_ipc/ipc_host_memory.h),
// so that what only a GPU machine ran before runs in CI: buckets written by
// the trainers straight into the engines' params (or staging copies, or FP8
// staging tensors), staging on and off, small and large buckets, FP8 on both
// sites, and the kill drills. Every engine rank checks every committed step
// bit for bit; the dumps are compared with `weightsync materialize`.
//
// Two of these are the failures the first GPU run found (issue 41):
// engine-site FP8 over cuda_ipc failed every trainer at step 1, and staging
// with 4 KiB buckets never completed a step (each trainer waited out the step
// timeout for a loan).
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <fstream>

namespace weightsync::e2e {
namespace {

// Over ipc_host, each step bounded by 20 s (no drill may wait that out).
Demo run_demo(const Model& m, std::vector<std::string> extra, const std::string& dump = "") {
  extra.insert(extra.begin(), {"--transport", "ipc_host", "--timeout", "20"});
  return run_model_demo(m, extra, dump, 300);
}

std::vector<int> upto(int n) {
  std::vector<int> all(static_cast<size_t>(n));
  for (int g = 0; g < n; ++g) all[static_cast<size_t>(g)] = g;
  return all;
}

// Every step committed and verified on every engine rank, with buckets lent
// in each, and the dumps equal materialize of the checkpoint.
void expect_all_good_and_lent(const Model& m, const Demo& d, int engines, int steps,
                              const std::string& dump) {
  ASSERT_EQ(d.run.exit_code, 0) << d.run.output;
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_TRUE(d.summary["ok"].get<bool>());
  EXPECT_EQ(d.summary["steps"].size(), static_cast<size_t>(steps)) << d.run.output;
  for (const auto& row : d.summary["steps"]) {
    EXPECT_EQ(ints(row["committed"]), upto(engines)) << "step " << row["step"];
    EXPECT_EQ(ints(row["verified"]), upto(engines)) << "step " << row["step"];
    EXPECT_GT(row["buckets_lent"].get<int64_t>(), 0) << "step " << row["step"];
  }
  const EngineLayout layout = make_engine_layout(load_engine_spec(m.engine));
  for (int g = 0; g < engines && !dump.empty(); ++g) {
    const std::string file = dump_file(dump, layout, g);
    EXPECT_EQ(compare_with_materialize(m, file, g), "") << file;
  }
}

// No step failed by waiting out the step timeout: the drills end in the
// time their failures take, not in the timeout's.
void expect_no_timeouts(const Model& m, int engines) {
  for (int g = 0; g < engines; ++g) {
    const auto stats = read_json(m.dir + "/work/stats-engine" + std::to_string(g) + ".json");
    if (!stats.is_object()) continue;  // the killed rank wrote none
    for (const auto& s : stats["steps"]) {
      const std::string reason = s.value("reason", "");
      EXPECT_EQ(reason.find("timeout"), std::string::npos) << "engine " << g << ": " << reason;
    }
  }
}

struct LendCase {
  const char* label;
  std::vector<std::string> options;
};

class IpcHostLend : public ::testing::TestWithParam<LendCase> {};

// Staging off and on, small and large buckets, p2p: every bucket that can be
// lent is written by its trainer into the engine's memory; the rest travel
// as fragments into memory the trainer maps.
TEST_P(IpcHostLend, EveryStepIsBitExactWithBucketsLent) {
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const std::string dump = m.dir + "/dump";
  std::vector<std::string> options{"--steps", "3"};
  options.insert(options.end(), GetParam().options.begin(), GetParam().options.end());
  const auto d = run_demo(m, options, dump);
  expect_all_good_and_lent(m, d, 4, 3, dump);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, IpcHostLend,
    ::testing::Values(LendCase{"small_buckets", {"--bucket-bytes", "4096"}},
                      LendCase{"large_buckets", {}},
                      // The second failure of the first GPU run: every loan
                      // waited out the step timeout.
                      LendCase{"staging_small_buckets", {"--staging", "--bucket-bytes", "4096"}},
                      LendCase{"staging_large_buckets", {"--staging"}}),
    [](const ::testing::TestParamInfo<LendCase>& info) { return std::string(info.param.label); });

// Where lending is off, the same job moves fragments into the mapped memory
// and lends nothing.
TEST(IpcHost, WithoutLendingEveryBucketTravelsAsFragments) {
  const Model m = make_model("tiny-llama", "fsdp=3", 2, 1);
  const auto d = run_demo(m, {"--steps", "2", "--bucket-bytes", "2048", "--no-lend"});
  ASSERT_EQ(d.run.exit_code, 0) << d.run.output;
  ASSERT_EQ(d.summary["steps"].size(), 2u) << d.run.output;
  for (const auto& row : d.summary["steps"]) {
    EXPECT_EQ(ints(row["verified"]), upto(2)) << "step " << row["step"];
    EXPECT_EQ(row["buckets_lent"].get<int64_t>(), 0) << "step " << row["step"];
  }
}

// FP8 engines on both sites. The first failure of the first GPU run: with
// the engine site, each trainer compiled its loans against the engine's F8
// params rather than the tensors the engine lends (its staging of the
// trainer's dtype, which it quantizes after the step). With the sender site,
// buckets of weights the trainers quantize travel as fragments (FP8 on the
// wire); the others (norms, embeddings: small buckets keep them apart) are
// lent in the same steps.
TEST(IpcHost, Fp8OnBothSitesLendsAndQuantizesBitExactly) {
  for (const char* site : {"sender", "engine"}) {
    SCOPED_TRACE(std::string("FP8 site ") + site);
    const std::string bucket = std::string(site) == "sender" ? "40000" : "131072";
    const Model m = make_model("tiny-fp8-qwen3-moe", "fsdp=2", 2, 1);
    nlohmann::json engine = read_json(m.engine);
    engine["quantization"] = {{"method", "fp8"}, {"weight_block_size", {128, 128}}};
    std::ofstream(m.engine, std::ios::trunc) << engine.dump();
    const std::string dump = m.dir + "/dump";
    for (const char* staging : {"", "--staging"}) {
      SCOPED_TRACE(*staging ? "staging" : "no staging");
      std::vector<std::string> options{"--steps", "3",          "--bucket-bytes",
                                       bucket,    "--fp8-site", site};
      if (*staging) options.push_back(staging);
      const auto d = run_demo(m, options, dump);
      expect_all_good_and_lent(m, d, 2, 3, dump);
    }
  }
}

// The GPU suite's drill (GpuSyncFailures.EngineKilledMidStepLeavesTheOthersCommitting)
// on the host: engine rank 3 dies in step 2; its replica aborts that step,
// the other commits, and step 3 commits without it. Nothing waits out the
// step timeout.
TEST(IpcHost, EngineKilledMidStepLeavesTheOthersCommitting) {
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const auto d =
      run_demo(m, {"--staging", "--steps", "3", "--bucket-bytes", "4096", "--kill", "engine:3:2"});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0);
  const auto& steps = d.summary["steps"];
  ASSERT_EQ(steps.size(), 3u) << d.run.output;
  EXPECT_EQ(ints(steps[0]["committed"]), upto(4));
  EXPECT_GT(steps[0]["buckets_lent"].get<int64_t>(), 0);
  EXPECT_EQ(ints(steps[1]["committed"]), (std::vector<int>{0, 1}));
  EXPECT_EQ(ints(steps[1]["verified"]), (std::vector<int>{0, 1}));
  EXPECT_EQ(ints(steps[2]["committed"]), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(ints(steps[2]["verified"]), (std::vector<int>{0, 1, 2}));
  for (const auto& c : d.summary["children"])
    if (c["label"] == "engine 3")
      EXPECT_NE(c["status"].get<std::string>().find("signal 9"), std::string::npos);
    else
      EXPECT_EQ(c["status"], "exit 0") << c["label"];
  expect_no_timeouts(m, 4);
}

// A trainer killed mid-step: no engine commits the step, and every engine
// keeps version 1 bit for bit (staging: the lent copies took the partial
// step, the params did not).
TEST(IpcHost, TrainerKilledMidStepLeavesEnginesOnTheirVersion) {
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const auto d =
      run_demo(m, {"--staging", "--steps", "3", "--bucket-bytes", "4096", "--kill", "trainer:1:2"});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0);
  EXPECT_EQ(ints(d.summary["steps"][0]["committed"]), upto(4));
  EXPECT_TRUE(d.summary["steps"][1]["committed"].empty());
  for (int g = 0; g < 4; ++g) {
    EXPECT_EQ(d.summary["engine_versions"][g].get<int>(), 1) << "engine " << g;
    EXPECT_TRUE(d.summary["engine_ok"][g].get<bool>()) << "engine " << g;
  }
  expect_no_timeouts(m, 4);
}

// The benchmark over ipc_host, FP8 quantized by the engines: every timed step
// commits (and is verified) with buckets lent, and the raw ceiling runs over
// the same transport.
TEST(IpcHost, BenchWithEngineSiteFp8CommitsEveryStepWithBucketsLent) {
  const std::string work = temp_dir("ipc-host-bench");
  const auto run =
      run_cli({"bench", "--transport", "ipc_host", "--fp8", "--fp8-site", "engine", "--size-gb",
               "0.02", "--steps", "2", "--no-peer", "--json", "--work-dir", work},
              300);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto r = nlohmann::json::parse(run.output.substr(run.output.rfind("\n{") + 1));
  EXPECT_TRUE(r["ok"].get<bool>()) << run.output;
  EXPECT_EQ(r["transport"], "ipc_host");
  EXPECT_EQ(r["sync_s"].size(), 2u);
  EXPECT_GT(r["buckets_lent"].get<int64_t>(), 0) << run.output;
  EXPECT_GT(r["raw_gbps"].get<double>(), 0) << run.output;
}

// A failing step over ipc_host's protocol: each trainer's first message of
// step 1 goes out one byte short (the fault wrapper on every rank, which
// answers loans without lending, so every bucket travels as fragments). An
// engine that got a short fragment rejects the step; step 2 commits
// everywhere, and nothing waits out the step timeout.
TEST(IpcHost, ShortMessageFailsTheStepForItsEngineOnly) {
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const auto d = run_demo(m, {"--staging", "--steps", "2", "--bucket-bytes", "4096", "--transport",
                              "fault:ipc_host?truncate_send=1&count=1"});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0);
  const auto& steps = d.summary["steps"];
  ASSERT_EQ(steps.size(), 2u) << d.run.output;
  EXPECT_LT(ints(steps[0]["committed"]).size(), 4u) << "a short fragment must fail its engine";
  EXPECT_EQ(ints(steps[1]["committed"]), upto(4));
  for (const auto& row : steps) EXPECT_EQ(row["buckets_lent"].get<int64_t>(), 0);
  for (int g = 0; g < 4; ++g) {
    EXPECT_EQ(d.summary["engine_versions"][g].get<int>(), 2) << "engine " << g;
    EXPECT_TRUE(d.summary["engine_ok"][g].get<bool>()) << "engine " << g;
  }
  expect_no_timeouts(m, 4);
}

}  // namespace
}  // namespace weightsync::e2e
