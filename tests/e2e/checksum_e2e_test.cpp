// Corruption is caught by default (issue 52, item 5): the real `weightsync
// demo`, its transport flipping a byte in about half of the messages every
// rank sends, with no flag about checksums. Every engine rank that commits a
// step holds it bit for bit, and the ranks that got a bad bucket reject the
// step, naming the bucket, the trainer rank and both checksums. With
// --no-checksums (the off switch kept) the same corruption is committed.
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace weightsync::e2e {
namespace {

nlohmann::json corrupted_demo(const std::vector<std::string>& extra, CliRun& run) {
  std::vector<std::string> args{
      "demo", "--json",         "--timeout", "60",          "--steps",
      "2",    "--bucket-bytes", "65536",     "--transport", "fault:ucx?corrupt_send=0.5"};
  args.insert(args.end(), extra.begin(), extra.end());
  run = run_cli(args);
  // The summary is the last line that opens an object (the whole output
  // when nothing else was printed).
  const auto at = run.output.rfind("\n{");
  return nlohmann::json::parse(run.output.substr(at == std::string::npos ? 0 : at + 1), nullptr,
                               false);
}

TEST(ChecksumE2E, CorruptedBucketsAreRejectedWithoutAnyFlag) {
  REQUIRE_UCX();
  CliRun run;
  const auto summary = corrupted_demo({}, run);
  ASSERT_TRUE(summary.is_object()) << run.output;
  EXPECT_NE(run.exit_code, 0) << "a rejected step must fail the demo";
  ASSERT_EQ(summary["steps"].size(), 2u);
  size_t committed = 0;
  for (const auto& row : summary["steps"]) {
    // Before checksums were on by default every rank committed both steps,
    // and only the demo's reference check saw the flipped bytes.
    EXPECT_EQ(ints(row["committed"]), ints(row["verified"]))
        << "step " << row["step"] << ": a rank committed bytes it did not receive as sent";
    committed += row["committed"].size();
  }
  EXPECT_LT(committed, 2 * summary["engines"].get<size_t>()) << "nothing was rejected";
  int named = 0;
  for (const auto& f : summary.value("failures", nlohmann::json::array())) {
    const std::string why = f["reason"].get<std::string>();
    EXPECT_EQ(why.find("its params differ from the reference"), std::string::npos)
        << f["who"] << ": " << why;
    if (why.find("failed its checksum: expected ") != std::string::npos) {
      EXPECT_NE(why.find("bucket "), std::string::npos) << why;
      EXPECT_NE(why.find("from trainer rank "), std::string::npos) << why;
      EXPECT_NE(why.find(", got "), std::string::npos) << why;
      ++named;
    }
  }
  EXPECT_GT(named, 0) << summary.dump();
}

TEST(ChecksumE2E, NoChecksumsLetsTheSameCorruptionThrough) {
  REQUIRE_UCX();
  CliRun run;
  const auto summary = corrupted_demo({"--no-checksums"}, run);
  ASSERT_TRUE(summary.is_object()) << run.output;
  size_t unverified = 0;
  for (const auto& row : summary["steps"]) {
    EXPECT_EQ(row["committed"].size(), summary["engines"].get<size_t>()) << "step " << row["step"];
    unverified += row["committed"].size() - row["verified"].size();
  }
  EXPECT_GT(unverified, 0u) << "the fault transport corrupted nothing: the test proves nothing";
}

}  // namespace
}  // namespace weightsync::e2e
