// Every `--json` command of the `weightsync` binary, run as a user would from
// some other directory: stdout holds exactly one JSON object (logs, child
// processes and library warnings go to stderr), the files a command ships
// with (configs, the peer baseline) are found whatever the working directory,
// and weightsync's own UCX settings cause no UCX warning.
#include "core/cuda/gpu.h"
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <weightsync/backend/transport.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstring>

extern char** environ;

namespace weightsync::e2e {
namespace {

struct Run {
  int exit_code = -1;
  std::string out, err;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs `weightsync args` in a fresh temporary working directory, stdout and
// stderr apart.
// `exe`: the command to run (default: the one this build made).
Run run_elsewhere(const std::vector<std::string>& args, const std::string& env = "",
                  int timeout_s = 300, const std::string& exe = WEIGHTSYNC_CLI) {
  const std::string cwd = temp_dir("cwd");
  std::string cmd = "cd " + quote(cwd) + " && " + env + " timeout -s KILL " +
                    std::to_string(timeout_s) + " " + quote(exe);
  for (const auto& a : args) cmd += " " + quote(a);
  cmd += " >" + quote(cwd + "/.stdout") + " 2>" + quote(cwd + "/.stderr");
  const int status = std::system(cmd.c_str());
  Run r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_file(cwd + "/.stdout");
  r.err = read_file(cwd + "/.stderr");
  std::filesystem::remove_all(cwd);
  return r;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// stdout is one JSON object and nothing else; returns it.
nlohmann::json one_object(const Run& r, const std::string& what) {
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << what << ": stdout is not one JSON document:\n"
                                 << r.out.substr(0, 2000) << "\nstderr:\n"
                                 << r.err.substr(0, 2000);
  EXPECT_TRUE(j.is_object()) << what << ": stdout holds " << r.out.substr(0, 500);
  EXPECT_FALSE(j.contains("error")) << what << ": " << j.dump().substr(0, 1000) << "\nstderr:\n"
                                    << r.err.substr(0, 2000);
  // weightsync's own UCX settings never make UCX warn (the test does not set
  // any UCX_* variable that could).
  EXPECT_EQ(lower(r.err).find("unused env"), std::string::npos) << what << ":\n" << r.err;
  EXPECT_EQ(lower(r.err).find("invalid config"), std::string::npos) << what << ":\n" << r.err;
  return j.is_object() ? j : nlohmann::json::object();
}

class CliJson : public ::testing::Test {
 protected:
  void SetUp() override {
    // No UCX_* of the caller's: warnings would then be theirs, not ours.
    // The memory-hook settings the ThreadSanitizer leg sets are UCX's own,
    // valid everywhere (never "unused"), so they do not count.
    for (char** e = environ; *e; ++e)
      if (std::strncmp(*e, "UCX_", 4) == 0 && std::strncmp(*e, "UCX_MEM_MALLOC_HOOKS=", 21) != 0 &&
          std::strncmp(*e, "UCX_MEM_MMAP_HOOK_MODE=", 23) != 0)
        GTEST_SKIP() << "UCX variables are set in the environment (" << *e << ")";
  }
};

TEST_F(CliJson, InspectPlanEngineLayout) {
  const Model m = make_model("tiny-llama", "fsdp=2", 2, 1);
  const auto inspect = one_object(run_elsewhere({"inspect", m.checkpoint, "--json"}), "inspect");
  EXPECT_FALSE(inspect.empty());
  const auto plan = one_object(
      run_elsewhere({"plan", "--trainer", m.trainer, "--engine", m.engine, "--json"}), "plan");
  EXPECT_FALSE(plan.empty());
  const auto layout =
      one_object(run_elsewhere({"engine-layout", "--engine", m.engine, "--json"}), "engine-layout");
  EXPECT_FALSE(layout.empty());
  std::filesystem::remove_all(m.dir);
}

TEST_F(CliJson, Export) {
  const Model m = make_model("tiny-llama", "fsdp=2", 2, 1);
  const auto r = run_elsewhere({"export", "--checkpoint", m.checkpoint, "--trainer", m.trainer,
                                "--out", m.dir + "/out", "--json", "--timeout", "60"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  one_object(r, "export");
  std::filesystem::remove_all(m.dir);
}

TEST_F(CliJson, Demo) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  const auto r = run_elsewhere({"demo", "--json", "--steps", "2", "--timeout", "60"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const auto j = one_object(r, "demo");
  EXPECT_TRUE(j.value("ok", false)) << j.dump();
}

// Benchmarks that need no peer processes, at their smallest sizes; those
// with shipped inputs (bench plan: configs/models) find them from anywhere.
TEST_F(CliJson, SmallBenchmarks) {
  const std::vector<std::vector<std::string>> benches = {
      {"bench", "control", "--engines", "2", "--steps", "2", "--json"},
      {"bench", "copy", "--mib", "4", "--repeats", "2", "--json"},
      {"bench", "delta", "--mib", "4", "--repeats", "2", "--json"},
      {"bench", "layout", "--json"},
      {"bench", "materialize", "--bytes", "4000000", "--repeat", "1", "--json"},
  };
  for (const auto& args : benches) {
    const std::string what = args[0] + " " + args[1];
    const auto r = run_elsewhere(args);
    EXPECT_EQ(r.exit_code, 0) << what << ":\n" << r.err;
    one_object(r, what);
  }
}

// bench sync --delta: the full and the delta run of the same versions, and
// their ratios (docs/delta.md).
TEST_F(CliJson, BenchSyncDeltaReportsItsRatiosToAFullSync) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  const auto r = run_elsewhere({"bench", "sync", "--delta", "--update", "random:0.02", "--size-gb",
                                "0.02", "--steps", "2", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = one_object(r, "bench sync --delta");
  if (!j.is_object()) return;
  ASSERT_TRUE(j.contains("full")) << j.dump();
  const double bytes = j["bytes_ratio_to_full"].get<double>();
  EXPECT_GT(bytes, 0.0);
  EXPECT_LT(bytes, 0.2) << "about 2 % of the elements changed";
  EXPECT_GT(j["time_ratio_to_full"].get<double>(), 0.0);
  EXPECT_GT(j["full"]["wire_bytes"].get<int64_t>(), j["wire_bytes"].get<int64_t>());
}

// The colocated shapes of the hybrid engine: 2 trainer ranks -> 1 engine rank
// (tp=1) gets the whole model; --mesh is refused with a given checkpoint.
TEST_F(CliJson, BenchSyncTakesTheJobsShape) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  const auto r = run_elsewhere({"bench", "sync", "--mesh", "fsdp=2", "--tp", "1", "--replicas", "1",
                                "--size-gb", "0.02", "--steps", "1", "--no-peer", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = one_object(r, "bench sync --mesh fsdp=2 --tp 1 --replicas 1");
  if (!j.is_object()) return;
  EXPECT_EQ(j["trainer_ranks"], 2);
  EXPECT_EQ(j["engine_ranks"], 1);
  EXPECT_EQ(j["engine_rank_bytes"], j["model_bytes"]) << "tp=1: one engine rank holds it all";
  EXPECT_NE(j["transport_library"].get<std::string>().find("UCX "), std::string::npos) << j.dump();
  EXPECT_EQ(j["slot_memory"], "host");
  const auto refused = run_elsewhere(
      {"bench", "sync", "--tp", "1", "--checkpoint", "c", "--trainer", "t", "--engine", "e"});
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.err.find("--tp is for the generated model"), std::string::npos) << refused.err;
}

TEST_F(CliJson, BenchPlanFindsItsConfigs) {
  const auto r = run_elsewhere({"bench", "plan", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  one_object(r, "bench plan");
}

TEST_F(CliJson, BenchExport) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  const auto r = run_elsewhere({"bench", "export", "--size-gb", "0.02", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  one_object(r, "bench export");
}

// `weightsync bench --json` finds the peer baseline (tools/bench/
// peer_baseline.py, shipped beside the command) from another directory. It
// runs it under Debian's python3 here: what matters is that the script is
// found and started (the baseline itself, with torch and 8 processes, takes
// minutes on a small machine; without torch it fails at once, and says so).
TEST_F(CliJson, BenchSyncFindsThePeerBaseline) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  const auto r = run_elsewhere({"bench", "--json", "--steps", "1", "--size-gb", "0.02"},
                               "WEIGHTSYNC_PYTHON=/usr/bin/python3");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const auto j = one_object(r, "bench");
  ASSERT_TRUE(j.contains("peer")) << j.dump();
  const std::string error = j["peer"].is_object() ? j["peer"].value("error", "") : "";
  EXPECT_EQ(error.find("not found"), std::string::npos) << error;
  // A CPU job has one peer, gloo's; each peer's result or error is kept.
  ASSERT_EQ(j["peer"].value("peers", nlohmann::json::array()).size(), 1u) << j.dump();
  EXPECT_EQ(j["peer"]["peers"][0].value("name", ""), "gloo");
  // A python with torch runs the baseline: then the ratio is a real one.
  // Without torch (or numpy) it fails, and the error carries the script's own
  // reason.
  if (error.empty()) {
    EXPECT_GT(j.value("ratio_to_peer", 0.0), 0.0) << j.dump();
    EXPECT_EQ(j.value("peer_name", ""), "gloo");
  } else {
    EXPECT_NE(error.find("peer baseline gloo failed"), std::string::npos) << error;
    EXPECT_NE(error.find("ModuleNotFoundError"), std::string::npos) << error;
  }
}

// A build folder outside the source tree: the command, as that build makes
// it, sitting where no source tree or share/ folder is above it, still finds
// its data (configs, the bench scripts) in the tree it was configured from.
TEST_F(CliJson, CommandOutsideTheTreeFindsItsData) {
  const std::string dir = temp_dir("out-of-tree") + "/build/bin";
  std::filesystem::create_directories(dir);
  const std::string exe = dir + "/weightsync";
  std::filesystem::copy_file(WEIGHTSYNC_CLI, exe);
  const auto plan = run_elsewhere({"bench", "plan", "--json"}, "", 300, exe);
  EXPECT_EQ(plan.exit_code, 0) << plan.err;
  one_object(plan, "bench plan (out of tree)");
  if (have_ucx()) {
    const auto r = run_elsewhere({"bench", "--json", "--steps", "1", "--size-gb", "0.02"},
                                 "WEIGHTSYNC_PYTHON=/usr/bin/python3", 300, exe);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    const auto j = one_object(r, "bench (out of tree)");
    ASSERT_TRUE(j.contains("peer")) << j.dump();
    const std::string error = j["peer"].is_object() ? j["peer"].value("error", "") : "";
    EXPECT_EQ(error.find("not found"), std::string::npos) << error;
  }
  std::filesystem::remove_all(std::filesystem::path(dir).parent_path().parent_path());
}

// Over shared memory (the default) weightsync's TCP tuning is not given to
// UCX at all; over tcp it is, and used: no warning either way.
TEST_F(CliJson, BenchTransportCausesNoUcxWarning) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  for (const std::string tls : {"shm", "tcp"}) {
    const auto r = run_elsewhere({"bench", "transport", "--tls", tls, "--iters", "4", "--json"});
    EXPECT_EQ(r.exit_code, 0) << tls << ":\n" << r.err;
    const auto j = one_object(r, "bench transport --tls " + tls);
    EXPECT_EQ(j.value("tls", ""), tls) << j.dump();
    EXPECT_EQ(lower(r.err).find("ucx  warn"), std::string::npos) << tls << ":\n" << r.err;
  }
}

// --device cuda: GPU buffers over ucx (CUDA memory) and cuda_ipc against a
// D2D copy. Without a GPU it refuses at once, saying so; --transport is for
// the GPU mode only.
TEST_F(CliJson, BenchTransportOnTheGpu) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  const auto host = run_elsewhere({"bench", "transport", "--transport", "cuda_ipc"});
  EXPECT_NE(host.exit_code, 0);
  EXPECT_NE(host.err.find("--transport is for --device cuda"), std::string::npos) << host.err;
  const auto r = run_elsewhere({"bench", "transport", "--device", "cuda", "--transport", "cuda_ipc",
                                "--iters", "4", "--json"});
  if (gpu::device_count() == 0) {
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.err.find("--device cuda needs a GPU"), std::string::npos) << r.err;
    return;
  }
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const auto j = one_object(r, "bench transport --device cuda");
  ASSERT_TRUE(j.contains("results")) << j.dump();
  for (const auto& row : j["results"]) {
    EXPECT_GT(row["d2d_gbps"].get<double>(), 0.0) << row.dump();
    EXPECT_GT(row["transports"]["cuda_ipc"]["gbps"].get<double>(), 0.0) << row.dump();
  }
}

// A command that fails still prints one JSON object, with the error.
TEST_F(CliJson, FailureIsOneObjectToo) {
  const auto r = run_elsewhere({"inspect", "/nonexistent/model.safetensors", "--json"});
  EXPECT_NE(r.exit_code, 0);
  auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(j.is_object()) << r.out;
  ASSERT_TRUE(j.contains("error")) << j.dump();
  EXPECT_NE(j["error"].value("message", "").find("/nonexistent/model.safetensors"),
            std::string::npos)
      << j.dump();
}

}  // namespace
}  // namespace weightsync::e2e
