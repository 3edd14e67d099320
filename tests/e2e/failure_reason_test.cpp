// A failed step says why in the JSON of `weightsync demo --json` (and so of
// `bench`, which shares the summary): which step, which rank, and what it
// waited for and for how long. Real processes over real UCX; the failures
// are a message the fault transport drops and a trainer killed mid-step.
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace weightsync::e2e {
namespace {

struct JsonRun {
  int exit_code = -1;
  nlohmann::json result;  // stdout's one JSON object (discarded if none)
  std::string err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// `weightsync demo --json` on `m` with `extra`, stdout and stderr apart.
JsonRun demo_json(const Model& m, const std::vector<std::string>& extra) {
  std::string cmd = "timeout -s KILL 300 '" WEIGHTSYNC_CLI "' demo --json --checkpoint '" +
                    m.checkpoint + "' --trainer '" + m.trainer + "' --engine '" + m.engine +
                    "' --work-dir '" + m.dir + "/work'";
  for (const auto& a : extra) cmd += " '" + a + "'";
  cmd += " >'" + m.dir + "/out' 2>'" + m.dir + "/err'";
  const int status = std::system(cmd.c_str());
  JsonRun r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.result = nlohmann::json::parse(slurp(m.dir + "/out"), nullptr, false);
  r.err = slurp(m.dir + "/err");
  return r;
}

// The failures the JSON lists for `who` at `step`.
std::vector<std::string> reasons(const nlohmann::json& j, const std::string& who, int64_t step) {
  std::vector<std::string> out;
  for (const auto& f : j.value("failures", nlohmann::json::array()))
    if (f.value("who", "") == who && f.value("step", int64_t{-1}) == step)
      out.push_back(f.value("reason", ""));
  return out;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Every trainer's first send of step 1 is dropped: the engines wait for
// those messages until the step timeout, then say which receive they waited
// for and how long; the trainers say they waited for the decision (which
// the coordinator gave: abort).
TEST(FailureReason, DroppedMessageNamesStepRankAndWhatWasAwaited) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-llama", "fsdp=2", 2, 1);
  const auto r = demo_json(
      m, {"--steps", "2", "--timeout", "10", "--transport", "fault:ucx?drop_send=1&count=1"});
  ASSERT_TRUE(r.result.is_object()) << r.err;
  EXPECT_NE(r.exit_code, 0);
  EXPECT_FALSE(r.result["ok"].get<bool>());
  ASSERT_TRUE(r.result.contains("error")) << r.result.dump(1);
  EXPECT_TRUE(contains(r.result["error"].get<std::string>(), "step 1")) << r.result["error"];
  int waited = 0;
  for (int g = 0; g < 2; ++g)
    for (const std::string& why : reasons(r.result, cat("engine rank ", g), 1)) {
      SCOPED_TRACE(why);
      if (!contains(why, "did not complete before the step timeout")) continue;
      EXPECT_TRUE(contains(why, "receive from rank")) << "names the receive it waited for";
      EXPECT_TRUE(contains(why, "waited ")) << "says how long";
      ++waited;
    }
  EXPECT_GE(waited, 1) << r.result.dump(1);
}

// A trainer killed in step 2: the JSON names the killed process, and the
// engines' step 2 failures name the trainer the coordinator lost.
TEST(FailureReason, KilledTrainerIsNamedWithItsStep) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-llama", "fsdp=2", 2, 1);
  const auto r = demo_json(
      m, {"--steps", "3", "--timeout", "30", "--bucket-bytes", "4096", "--kill", "trainer:1:2"});
  ASSERT_TRUE(r.result.is_object()) << r.err;
  EXPECT_NE(r.exit_code, 0);
  ASSERT_TRUE(r.result.contains("failures")) << r.result.dump(1);
  bool child = false;
  for (const auto& f : r.result["failures"])
    child |= f.value("who", "") == "trainer 1" && contains(f.value("reason", ""), "signal 9");
  EXPECT_TRUE(child) << r.result.dump(1);
  const auto engine0 = reasons(r.result, "engine rank 0", 2);
  ASSERT_EQ(engine0.size(), 1u) << r.result.dump(1);
  EXPECT_TRUE(contains(engine0[0], "trainer rank 1")) << engine0[0];
  EXPECT_TRUE(contains(r.result.value("error", ""), "step 2")) << r.result.dump(1);
}

// Over "fault:ucx?release_ms=300" a send completes only once its receiver
// released it, 300 ms after its receive completed and only from the
// receiver's progress, as UCX's rendezvous needs the receiver's worker
// progressed (issue: syncs over shared memory hang under CPU contention).
// The engines receive everything, ack, and wait for the decision while the
// trainers' last sends still wait for their release; so do broadcast roots'
// gathers. A rank that stopped progressing while it waits (for a decision,
// an event, a store key) would hold its senders until the step timeout and
// fail every step; every wait keeps its transport progressing, so each step
// commits and is checked against the checkpoint.
TEST(WaitingRanks, KeepReleasingTheirSendersUntilTheStepIsDecided) {
  REQUIRE_UCX();
  const Model m = make_model("tiny-llama", "fsdp=2", 2, 1);
  for (const char* mode : {"p2p", "broadcast"}) {
    SCOPED_TRACE(mode);
    const auto r = demo_json(m, {"--steps", "3", "--timeout", "15", "--mode", mode, "--transport",
                                 "fault:ucx?release_ms=300"});
    ASSERT_TRUE(r.result.is_object()) << r.err;
    EXPECT_EQ(r.exit_code, 0) << r.result.dump(1) << "\n" << r.err;
    EXPECT_TRUE(r.result.value("ok", false)) << r.result.dump(1);
    EXPECT_FALSE(r.result.contains("failures")) << r.result.dump(1);
  }
}

}  // namespace
}  // namespace weightsync::e2e
