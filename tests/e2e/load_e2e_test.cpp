// One coordinator under load (`weightsync bench load`, the real processes):
// many trainer and engine ranks sync every step bit-exactly while client
// connections join and leave the coordinator; every join succeeds, every
// churned observer is gone at the end, and steps ran during the churn. (The
// full size, 16 trainer ranks and 64 engine ranks for 50 steps with 1000
// connections, is the benchmark's default; this is a smaller one for CI.)
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

namespace weightsync::e2e {
namespace {

TEST(E2ELoad, ManyRanksCommitEveryStepWhileConnectionsChurn) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  const CliRun run =
      run_cli({"bench", "load", "--trainers", "8", "--engines", "16", "--steps", "12", "--churn",
               "300", "--churn-open", "30", "--step-gap", "150", "--timeout", "60", "--json"},
              300);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  // stdout's last line is the JSON object (stderr is merged in by run_cli).
  const size_t at = run.output.rfind("\n{");
  const auto j = nlohmann::json::parse(run.output.substr(at == std::string::npos ? 0 : at + 1),
                                       nullptr, false);
  ASSERT_TRUE(j.is_object()) << run.output;
  EXPECT_TRUE(j["ok"].get<bool>()) << j.dump();
  EXPECT_EQ(j["trainers"], 8);
  EXPECT_EQ(j["engines"], 16);
  EXPECT_EQ(j["steps_committed_by_every_engine"], 12) << j.dump();
  const auto& c = j["churn"];
  EXPECT_EQ(c["joined"], 300) << c.dump();
  EXPECT_EQ(c["failed"], 0) << c.dump();
  EXPECT_EQ(c["observers_left"], 0) << c.dump();
  EXPECT_GT(c["steps_during"].get<int>(), 0) << "the churn overlapped no step: " << c.dump();
}

}  // namespace
}  // namespace weightsync::e2e
