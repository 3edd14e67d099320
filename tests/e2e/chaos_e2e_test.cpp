// `weightsync demo --chaos SEED`: a short soak whose seed hits every fault
// kind (kills of a trainer, an engine and the coordinator, a corrupted and a
// truncated bucket, a stalled rank) holds every invariant, and the schedule
// depends on the seed alone.
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <set>

namespace weightsync::e2e {
namespace {

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// `weightsync args...` (no argument needs quoting here), stdout and stderr apart.
CliRun run_cli(const std::vector<std::string>& args, int timeout_s = 240) {
  const std::string dir = temp_dir("chaos");
  std::string cmd = "timeout -s KILL " + std::to_string(timeout_s) + " " WEIGHTSYNC_CLI;
  for (const auto& a : args) cmd += " " + a;
  cmd += " >" + dir + "/out 2>" + dir + "/err";
  const int status = std::system(cmd.c_str());
  CliRun r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = slurp(dir + "/out");
  r.err = slurp(dir + "/err");
  std::filesystem::remove_all(dir);
  return r;
}

nlohmann::json schedule(int seed, int steps) {
  const CliRun r = run_cli({"demo", "--chaos", std::to_string(seed), "--steps",
                            std::to_string(steps), "--schedule-only", "--json"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return nlohmann::json::parse(r.out)["schedule"];
}

TEST(Chaos, ScheduleDependsOnTheSeedAlone) {
  const auto a = schedule(7, 200), b = schedule(7, 200), c = schedule(8, 200);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  std::set<std::string> kinds;
  for (const auto& f : a) kinds.insert(f["fault"].get<std::string>());
  EXPECT_EQ(kinds.size(), 7u) << a.dump();  // none and the six faults
  // The first and the last steps are clean.
  EXPECT_EQ(a.front()["fault"], "none");
  EXPECT_EQ(a.back()["fault"], "none");
}

TEST(Chaos, RefusesTheOptionsItDecides) {
  const CliRun kill = run_cli({"demo", "--chaos", "1", "--kill", "engine:0:2"});
  EXPECT_NE(kill.exit_code, 0);
  EXPECT_NE(kill.err.find("--kill"), std::string::npos) << kill.err;
  const CliRun elastic = run_cli({"demo", "--chaos", "1", "--elastic"});
  EXPECT_NE(elastic.exit_code, 0);
  EXPECT_NE(elastic.err.find("--elastic"), std::string::npos) << elastic.err;
  const CliRun alone = run_cli({"demo", "--schedule-only"});
  EXPECT_NE(alone.exit_code, 0);
  EXPECT_NE(alone.err.find("--chaos"), std::string::npos) << alone.err;
}

// Seed 4 over 14 steps: corrupt (4), delay (6), the coordinator killed (7),
// engines killed (8, 12), a trainer killed (9), truncate (13).
TEST(Chaos, ShortSoakHoldsEveryInvariant) {
  REQUIRE_UCX();
  const CliRun r = run_cli({"demo", "--chaos", "4", "--steps", "14", "--json"});
  const auto j = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out << r.err;
  EXPECT_EQ(r.exit_code, 0) << j.value("violations", nlohmann::json()).dump(2) << "\n"
                            << j.value("work_dir", std::string());
  EXPECT_TRUE(j.value("ok", false));
  const auto& t = j["table"];
  EXPECT_EQ(t["steps"], 14);
  for (const char* kind :
       {"kill_trainer", "kill_engine", "kill_coordinator", "corrupt", "truncate", "delay"})
    EXPECT_GE(t["faults"][kind].get<int>(), 1) << kind << ": " << t.dump();
  EXPECT_EQ(t["bytes_lost"], 0);
  EXPECT_EQ(t["violations"], 0);
  EXPECT_EQ(t["commits"].get<int>() + t["aborts"].get<int>(), 14);
  EXPECT_GE(t["aborts"].get<int>(), 1);  // the coordinator's death aborts its step
  EXPECT_EQ(t["last_committed"], 14);    // the last step is clean: every live rank takes it
  EXPECT_LE(t["longest_step_s"].get<double>(), t["bound_s"].get<double>());
  EXPECT_GT(t["invariant_checks"].get<int>(), 14 * 4);
#ifdef WEIGHTSYNC_WITH_PROMETHEUS
  EXPECT_EQ(t["metrics"], "checked");
#endif
  // Every failed step names who failed and why.
  for (const auto& s : j["steps"])
    for (const auto& f : s["failed"])
      EXPECT_FALSE(f["reason"].get<std::string>().empty()) << s.dump();
}

}  // namespace
}  // namespace weightsync::e2e
