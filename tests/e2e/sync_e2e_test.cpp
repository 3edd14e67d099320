// End to end: the real `weightsync demo` binary starts one process per
// trainer rank and engine rank, with the coordinator embedded in the parent,
// and syncs versions over UCX. The engines check their params bit for bit
// against the reference after every committed step; these tests read the
// summary the demo writes and compare dumps with `materialize`.
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <weightsync/backend/transport.h>
#include <weightsync/layouts.h>
#include "pipeline/wire.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace weightsync::e2e {
namespace {

Demo run_demo(const Model& m, std::vector<std::string> extra, const std::string& dump = "") {
  extra.insert(extra.begin(), {"--timeout", "60"});
  return run_model_demo(m, extra, dump);
}

// Every step committed and verified on every engine rank, and the dumps
// equal materialize of the checkpoint.
void expect_all_good(const Model& m, const Demo& d, int engines, const std::string& dump) {
  ASSERT_EQ(d.run.exit_code, 0) << d.run.output;
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_TRUE(d.summary["ok"].get<bool>());
  std::vector<int> all(static_cast<size_t>(engines));
  for (int g = 0; g < engines; ++g) all[static_cast<size_t>(g)] = g;
  for (const auto& row : d.summary["steps"]) {
    EXPECT_EQ(ints(row["committed"]), all) << "step " << row["step"];
    EXPECT_EQ(ints(row["verified"]), all) << "step " << row["step"];
  }
  const EngineLayout layout = make_engine_layout(load_engine_spec(m.engine));
  for (int g = 0; g < engines && !dump.empty(); ++g) {
    const std::string file = dump_file(dump, layout, g);
    EXPECT_EQ(compare_with_materialize(m, file, g), "") << file;
  }
}

TEST(E2E, DefaultDemoSyncsEveryStepBitExactly) {
  REQUIRE_UCX();
  const auto run = run_cli({"demo", "--json", "--timeout", "60"});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const auto summary = nlohmann::json::parse(run.output.substr(run.output.rfind("\n{") + 1));
  ASSERT_EQ(summary["steps"].size(), 3u);
  for (const auto& row : summary["steps"]) {
    EXPECT_EQ(row["committed"].size(), 4u);
    EXPECT_EQ(row["verified"].size(), 4u);
    EXPECT_GT(row["engine_rank_bytes"].get<int64_t>(), 0);
  }
}

TEST(E2E, Qwen3MoeBroadcastSmallBuckets) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const std::string dump = m.dir + "/dump";
  const auto d =
      run_demo(m, {"--mode", "broadcast", "--bucket-bytes", "4096", "--steps", "2"}, dump);
  expect_all_good(m, d, 4, dump);
}

TEST(E2E, LlamaUnevenShardsP2p) {
  REQUIRE_UCX();
  // fsdp=3 over dims that 3 does not divide: uneven and empty shards.
  const Model m = make_model("tiny-llama", "fsdp=3", 2, 1);
  const std::string dump = m.dir + "/dump";
  const auto d = run_demo(m, {"--bucket-bytes", "2048", "--steps", "3"}, dump);
  expect_all_good(m, d, 2, dump);
}

TEST(E2E, Qwen2UnevenShardsBroadcastWithStaging) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-qwen2", "fsdp=3", 2, 1);
  const std::string dump = m.dir + "/dump";
  const auto d = run_demo(m, {"--mode", "broadcast", "--staging", "--steps", "2"}, dump);
  expect_all_good(m, d, 2, dump);
}

TEST(E2E, DeepseekV3TinyExpertParallelEngine) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-deepseek-v3", "ep=2,fsdp=2", 2, 1, /*expert_parallel=*/true);
  const std::string dump = m.dir + "/dump";
  const auto d = run_demo(m, {"--bucket-bytes", "8192", "--steps", "2"}, dump);
  expect_all_good(m, d, 2, dump);
}

// Experts stacked as transformers >= 5 holds them, into two engine groups at
// once: a vLLM replica of tp=2 and two replicas of framework "hf" (every HF
// tensor whole), in both plan modes.
TEST(E2E, TransformersLayoutIntoEngineGroups) {
  REQUIRE_UCX();
  for (const char* mode : {"p2p", "broadcast"}) {
    SCOPED_TRACE(mode);
    Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 1);
    const HfModelConfig config = HfModelConfig::load(std::string(WEIGHTSYNC_SOURCE_DIR) +
                                                     "/configs/models/tiny-qwen3-moe/config.json");
    TrainerLayoutOptions style;
    style.style = TrainerLayoutStyle::transformers;
    std::ofstream(m.trainer)
        << make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=2"), style).to_json().dump();
    nlohmann::json vllm = read_json(m.engine), hf = vllm;
    hf["framework"] = "hf";
    hf["tp"] = 1;
    hf["replicas"] = 2;
    std::ofstream(m.engine) << nlohmann::json::array({vllm, hf}).dump();
    const std::string dump = m.dir + "/dump";
    const auto d = run_demo(m, {"--mode", mode, "--bucket-bytes", "8192", "--steps", "2"}, dump);
    expect_all_good(m, d, 4, dump);
  }
}

// A delta run of `steps` steps: version 1 whole, the later ones as deltas
// of under a quarter of its bytes.
void expect_deltas_after_the_first(const Demo& d, size_t steps_run) {
  if (!d.summary.is_object()) return;  // expect_all_good said why
  const auto& steps = d.summary["steps"];
  ASSERT_EQ(steps.size(), steps_run);
  EXPECT_EQ(steps[0]["delta_buckets"].get<int>(), 0) << "version 1: nothing to diff against";
  const auto whole = steps[0]["engine_bytes_total"].get<int64_t>();
  for (size_t s = 1; s < steps_run; ++s) {
    EXPECT_GT(steps[s]["delta_buckets"].get<int>(), 0) << "step " << s + 1;
    EXPECT_LT(steps[s]["engine_bytes_total"].get<int64_t>() * 4, whole)
        << "step " << s + 1 << " moved " << steps[s]["engine_bytes_total"] << " bytes, whole "
        << whole;
  }
}

// Delta sync's bases, p2p: a trainer rank keeps one per bucket it sends
// alike to every replica (PlanOptions::same_buckets_per_replica), so all of
// them together hold one replica's bytes, whatever the replica count.
void expect_one_base_for_every_replica(const Model& m, const Demo& d, int64_t bucket_bytes,
                                       int replicas) {
  if (!d.summary.is_object()) return;  // expect_all_good said why
  PlanOptions o;
  o.bucket_bytes = bucket_bytes;
  o.same_buckets_per_replica = true;
  const Plan plan = make_plan(TrainerLayout::load(m.trainer),
                              make_engine_layout(load_engine_config(m.engine)), Topology{}, o);
  for (const auto& step : d.summary["steps"])
    EXPECT_EQ(step["delta_base_bytes"].get<int64_t>() * replicas, plan.stats().bytes_total)
        << "step " << step["step"];
}

// Delta sync (docs/delta.md) on every p2p family and layout above: sparse
// versions, version 1 whole, the later ones as deltas of a small part of the
// bytes, every step verified bit for bit and the dumps equal materialize.
TEST(E2E, DeltaSyncIsBitExactOnEveryP2pFamilyAndLayout) {
  REQUIRE_UCX();
  struct Case {
    const char* model;
    const char* mesh;
    int tp, replicas;
    bool expert_parallel;
    std::vector<std::string> extra;
  };
  const std::vector<Case> cases = {
      {"tiny-llama", "fsdp=3", 2, 1, false, {"--bucket-bytes", "2048"}},
      {"tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2, false, {"--bucket-bytes", "4096"}},
      {"tiny-deepseek-v3", "ep=2,fsdp=2", 2, 1, true, {"--bucket-bytes", "8192"}},
      {"tiny-qwen2", "fsdp=3", 2, 1, false, {"--staging"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.model);
    const Model m = make_model(c.model, c.mesh, c.tp, c.replicas, c.expert_parallel);
    const std::string dump = m.dir + "/dump";
    std::vector<std::string> args = c.extra;
    for (const char* a : {"--delta", "--update", "random:0.02", "--steps", "3"}) args.push_back(a);
    const auto d = run_demo(m, args, dump);
    expect_all_good(m, d, c.tp * c.replicas, dump);
    expect_deltas_after_the_first(d, 3);
    if (c.extra.size() == 2 && c.extra[0] == "--bucket-bytes")
      expect_one_base_for_every_replica(m, d, std::stoll(c.extra[1]), c.replicas);
  }
}

// Delta sync in broadcast mode: one frame for every engine rank, each rank
// rebuilding and checking (its own digest) only the part it reads; tensor
// parallel engines of two replicas, expert parallel ones, engine groups of
// different layouts (a digest per engine template), and staging engines.
TEST(E2E, DeltaSyncIsBitExactInBroadcastMode) {
  REQUIRE_UCX();
  struct Case {
    const char* model;
    const char* mesh;
    int tp, replicas;
    bool expert_parallel, engine_groups;
    int64_t bucket_bytes;
    bool staging = false;
  };
  const std::vector<Case> cases = {
      {"tiny-llama", "fsdp=3", 2, 1, false, false, 2048},
      {"tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2, false, false, 4096},
      {"tiny-deepseek-v3", "ep=2,fsdp=2", 2, 1, true, false, 8192},
      {"tiny-qwen3-moe", "ep=2,fsdp=2", 2, 1, false, true, 8192},
      {"tiny-qwen2", "fsdp=3", 2, 1, false, false, 8192, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.model) + (c.engine_groups ? " (engine groups)" : ""));
    const Model m = make_model(c.model, c.mesh, c.tp, c.replicas, c.expert_parallel);
    int engine_ranks = c.tp * c.replicas;
    if (c.engine_groups) {
      // Beside the vLLM replica, two replicas of framework "hf" (tp=1).
      nlohmann::json vllm = read_json(m.engine), hf = vllm;
      hf["framework"] = "hf";
      hf["tp"] = 1;
      hf["replicas"] = 2;
      std::ofstream(m.engine) << nlohmann::json::array({vllm, hf}).dump();
      engine_ranks += 2;
    }
    const std::string dump = m.dir + "/dump";
    std::vector<std::string> args = {
        "--mode",  "broadcast", "--bucket-bytes", std::to_string(c.bucket_bytes),
        "--delta", "--update",  "random:0.02",    "--steps",
        "3"};
    if (c.staging) args.push_back("--staging");
    const auto d = run_demo(m, args, dump);
    expect_all_good(m, d, engine_ranks, dump);
    expect_deltas_after_the_first(d, 3);
  }
}

// The fault transport of engine rank 1 that damages one byte of the first
// message of `step` it receives (its first bucket's frame, or header).
std::string corrupt_first_frame_of_rank1(const Model& m, int64_t step) {
  const Plan plan = plan_of(m, "p2p", 4096);
  const Tag tag = bucket_tag(step, plan.buckets_received_by(1).at(0), 0);
  return "1:fault:ucx?corrupt_recv=1&count=1&tag=" + std::to_string(tag);
}

// Engine rank 1's reason for step `step` (index `step` - 1 of its steps).
std::string rank1_reason(const Model& m, size_t step) {
  const auto stats = read_json(m.dir + "/work/stats-engine1.json");
  if (!stats.is_object()) return "(no stats-engine1.json)";
  return stats["steps"][step - 1]["reason"].get<std::string>();
}

// A delta frame damaged on its way to engine rank 1 (no checksums: the
// frame's own checks and its digest) fails step 2 for that rank's replica
// only, with the params half-patched (no staging); step 3 goes whole to it
// and is bit-exact.
TEST(E2E, DeltaDamagedOnTheWireIsRejectedAndTheNextStepGoesWhole) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const auto d = run_demo(m, {"--delta", "--no-checksums", "--steps", "3", "--bucket-bytes", "4096",
                              "--engine-transport", corrupt_first_frame_of_rank1(m, 2)});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0) << "a rejected step must fail the demo";
  const auto& steps = d.summary["steps"];
  EXPECT_EQ(ints(steps[0]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(ints(steps[1]["committed"]), (std::vector<int>{2, 3}));
  EXPECT_GT(steps[1]["delta_buckets"].get<int>(), 0);
  EXPECT_EQ(ints(steps[2]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(ints(steps[2]["verified"]), (std::vector<int>{0, 1, 2, 3}));
  for (int g = 0; g < 4; ++g) EXPECT_EQ(d.summary["engine_versions"][g].get<int>(), 3);
  const std::string reason = rank1_reason(m, 2);
  EXPECT_NE(reason.find("of step 2 from trainer rank"), std::string::npos) << reason;
}

// A whole bucket's header damaged on its way to engine rank 1 (step 1 goes
// whole: the header, then the fragments): the engine still takes the
// fragments that follow, so nobody stalls, rejects the step naming the
// header, and step 2 goes whole to it again and is bit-exact.
TEST(E2E, DeltaDamagedWholeHeaderIsRejectedWithoutAStall) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const auto d = run_demo(m, {"--delta", "--steps", "2", "--bucket-bytes", "4096", "--timeout",
                              "20", "--engine-transport", corrupt_first_frame_of_rank1(m, 1)});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0) << "a rejected step must fail the demo";
  const auto& steps = d.summary["steps"];
  EXPECT_EQ(ints(steps[0]["committed"]), (std::vector<int>{2, 3}));
  EXPECT_EQ(ints(steps[1]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(ints(steps[1]["verified"]), (std::vector<int>{0, 1, 2, 3}));
  const std::string reason = rank1_reason(m, 1);
  EXPECT_NE(reason.find("of step 1 from trainer rank"), std::string::npos) << reason;
  EXPECT_EQ(reason.find("did not complete"), std::string::npos) << "a stall: " << reason;
}

// A restarted engine rank (a new process, nothing of the old version) gets
// the whole version from trainers that send the others deltas (p2p), or
// that send every rank the whole bucket for that step (broadcast: one frame
// for all), and deltas go on after it.
TEST(E2E, DeltaRestartedEngineGetsTheWholeVersion) {
  REQUIRE_UCX();
  for (const char* mode : {"p2p", "broadcast"}) {
    SCOPED_TRACE(mode);
    const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
    const auto d = run_demo(m, {"--mode", mode, "--delta", "--steps", "6", "--bucket-bytes", "4096",
                                "--kill", "engine:3:2", "--restart"});
    ASSERT_TRUE(d.summary.is_object()) << d.run.output;
    const auto& steps = d.summary["steps"];
    EXPECT_EQ(ints(steps[1]["committed"]), (std::vector<int>{0, 1})) << "killed mid-step 2";
    EXPECT_EQ(ints(steps[5]["committed"]), (std::vector<int>{0, 1, 2, 3}));
    EXPECT_EQ(ints(steps[5]["verified"]), (std::vector<int>{0, 1, 2, 3}));
    EXPECT_GT(steps[5]["delta_buckets"].get<int>(), 0);
    // Step 3: replica 1 (the restarted rank 3, and rank 2, a step behind)
    // takes the whole version. p2p: replica 0 still takes deltas, the frames
    // a trainer rank encoded once for both replicas (every bucket goes as a
    // delta at step 4). Broadcast: one frame for all, whole.
    if (std::string(mode) == "p2p")
      EXPECT_EQ(2 * steps[2]["delta_buckets"].get<int>(), steps[3]["delta_buckets"].get<int>());
    else
      EXPECT_EQ(steps[2]["delta_buckets"].get<int>(), 0);
    for (int g = 0; g < 4; ++g) {
      EXPECT_EQ(d.summary["engine_versions"][g].get<int>(), 6) << "engine " << g;
      EXPECT_TRUE(d.summary["engine_ok"][g].get<bool>()) << "engine " << g;
    }
  }
}

TEST(E2E, CorruptedStepIsRejectedAndEngineKeepsPreviousVersion) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const int64_t bucket = 4096;
  // Engine rank 1's receives of step 1 come first; the first receive of step 2
  // gets one byte flipped.
  const Plan plan = plan_of(m, "p2p", bucket);
  WireOptions wire;
  wire.checksums = true;
  int64_t per_step = 0;
  for (int32_t b : plan.buckets_received_by(1)) per_step += bucket_messages(plan, b, wire);
  const std::string fault = "1:fault:ucx?corrupt_recv=1&count=1&after=" + std::to_string(per_step);
  const auto d = run_demo(m, {"--staging", "--checksums", "--steps", "2", "--bucket-bytes", "4096",
                              "--engine-transport", fault});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0) << "a rejected step must fail the demo";
  const auto& steps = d.summary["steps"];
  EXPECT_EQ(ints(steps[0]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  // Rank 1's replica (ranks 0 and 1, tp=2) aborts whole; replica 1 commits.
  EXPECT_EQ(ints(steps[1]["committed"]), (std::vector<int>{2, 3}));
  EXPECT_EQ(ints(steps[1]["verified"]), (std::vector<int>{2, 3}));
  EXPECT_EQ(d.summary["engine_versions"][0].get<int>(), 1);
  EXPECT_EQ(d.summary["engine_versions"][1].get<int>(), 1);
  EXPECT_TRUE(d.summary["engine_ok"][0].get<bool>()) << d.run.output;
  // The staging copy kept version 1's params intact, bit for bit.
  EXPECT_TRUE(d.summary["engine_ok"][1].get<bool>()) << d.run.output;
  const auto stats = read_json(m.dir + "/work/stats-engine1.json");
  ASSERT_TRUE(stats.is_object());
  EXPECT_EQ(stats["final_check"]["version"].get<int>(), 1);
  EXPECT_TRUE(stats["final_check"]["ok"].get<bool>());
  EXPECT_NE(stats["steps"][1]["reason"].get<std::string>().find("checksum"), std::string::npos)
      << stats["steps"][1]["reason"];
}

// Without checksums, message sizes still guard the wire: a fragment that comes
// short (a peer out of step with the plan) is never applied as data.
TEST(E2E, ShortMessageFailsTheStepForItsEngineOnly) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  // Each trainer's first message of step 1 goes out one byte short.
  const auto d = run_demo(m, {"--staging", "--steps", "2", "--bucket-bytes", "4096", "--transport",
                              "fault:ucx?truncate_send=1&count=1"});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0);
  const auto& steps = d.summary["steps"];
  const auto first = ints(steps[0]["committed"]);
  EXPECT_LT(first.size(), 4u) << "an engine that got a short fragment must not commit";
  EXPECT_EQ(ints(steps[1]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  int reasons = 0;
  for (int g = 0; g < 4; ++g) {
    EXPECT_EQ(d.summary["engine_versions"][g].get<int>(), 2) << "engine " << g;
    EXPECT_TRUE(d.summary["engine_ok"][g].get<bool>()) << "engine " << g;
    const auto stats = read_json(m.dir + "/work/stats-engine" + std::to_string(g) + ".json");
    ASSERT_TRUE(stats.is_object());
    const std::string reason = stats["steps"][0]["reason"].get<std::string>();
    if (std::find(first.begin(), first.end(), g) == first.end()) {
      EXPECT_NE(reason.find("bytes, expected"), std::string::npos)
          << "engine " << g << ": " << reason;
      ++reasons;
    }
  }
  EXPECT_EQ(reasons, 4 - static_cast<int>(first.size()));
}

void engine_killed_mid_step(const char* mode);

// In both plan modes: a broadcast root whose send to the dead rank is
// refused at posting (endpoint timeout) drops that rank and sends the
// bucket to the others.
TEST(E2E, EngineKilledMidStepDoesNotStopTheOthers) {
  REQUIRE_UCX();
  for (const char* mode : {"p2p", "broadcast"}) {
    SCOPED_TRACE(mode);
    engine_killed_mid_step(mode);
  }
}

void engine_killed_mid_step(const char* mode) {
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const auto d = run_demo(m, {"--mode", mode, "--staging", "--steps", "3", "--bucket-bytes", "4096",
                              "--kill", "engine:3:2"});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0);
  const auto& steps = d.summary["steps"];
  EXPECT_EQ(ints(steps[0]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  // Step 2: rank 3 dies in it, so rank 2, of the same replica, aborts with
  // it (a replica commits whole or not at all). Step 3: rank 3 takes no part
  // (its process is gone) and the rest commit.
  EXPECT_EQ(ints(steps[1]["committed"]), (std::vector<int>{0, 1}));
  EXPECT_EQ(ints(steps[1]["verified"]), (std::vector<int>{0, 1}));
  EXPECT_EQ(ints(steps[2]["committed"]), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(ints(steps[2]["verified"]), (std::vector<int>{0, 1, 2}));
  for (int g = 0; g < 3; ++g) EXPECT_EQ(d.summary["engine_versions"][g].get<int>(), 3);
  // The killed engine's process really died (SIGKILL), nobody else did.
  for (const auto& c : d.summary["children"]) {
    if (c["label"] == "engine 3")
      EXPECT_NE(c["status"].get<std::string>().find("signal 9"), std::string::npos);
    else
      EXPECT_EQ(c["status"], "exit 0") << c["label"];
  }
}

TEST(E2E, RestartedEngineRejoinsAndCatchesUp) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const auto d = run_demo(m, {"--staging", "--steps", "5", "--bucket-bytes", "4096", "--kill",
                              "engine:3:2", "--restart"});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  const auto& steps = d.summary["steps"];
  EXPECT_EQ(ints(steps[0]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(ints(steps[1]["committed"]), (std::vector<int>{0, 1})) << "killed mid-step 2";
  // The new process for rank 3 joins a later step and gets the whole state:
  // it serves the last version, bit for bit.
  EXPECT_EQ(ints(steps[4]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  for (int g = 0; g < 4; ++g) {
    EXPECT_EQ(d.summary["engine_versions"][g].get<int>(), 5) << "engine " << g;
    EXPECT_TRUE(d.summary["engine_ok"][g].get<bool>()) << "engine " << g;
  }
  bool restarted = false;
  for (const auto& c : d.summary["children"]) {
    if (c["label"] == "engine 3")
      EXPECT_NE(c["status"].get<std::string>().find("signal 9"), std::string::npos);
    else
      EXPECT_EQ(c["status"], "exit 0") << c["label"];
    restarted |= c["label"] == "engine 3 restarted";
  }
  EXPECT_TRUE(restarted) << d.run.output;
}

TEST(E2E, TrainerKilledMidStepLeavesEnginesOnLastCommittedVersion) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const auto d =
      run_demo(m, {"--staging", "--steps", "3", "--bucket-bytes", "4096", "--kill", "trainer:1:2"});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0);
  EXPECT_EQ(ints(d.summary["steps"][0]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(d.summary["steps"][1]["committed"].empty());
  for (int g = 0; g < 4; ++g) {
    EXPECT_EQ(d.summary["engine_versions"][g].get<int>(), 1) << "engine " << g;
    // Staging: the params are exactly version 1, bit for bit.
    EXPECT_TRUE(d.summary["engine_ok"][g].get<bool>()) << "engine " << g;
  }
}

}  // namespace
}  // namespace weightsync::e2e
