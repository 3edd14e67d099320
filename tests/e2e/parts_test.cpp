// The in-process parts the end-to-end path relies on: bucket checksums, the
// Chrome-trace writer, and the registration checks of Publisher/Subscriber.
#include <weightsync/checksum.h>
#include <weightsync/control.h>
#include <weightsync/error.h>
#include <weightsync/publisher.h>
#include <weightsync/subscriber.h>
#include <weightsync/trace.h>

#include "core/checksum_stream.h"
#include "pipeline/wire.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <fstream>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include <unistd.h>

namespace weightsync {
namespace {

TEST(Checksum, DeterministicAndSensitiveToEveryByte) {
  std::vector<unsigned char> data(1000);
  std::iota(data.begin(), data.end(), 0);
  const uint64_t base = checksum64(data.data(), data.size(), 3);
  EXPECT_EQ(base, checksum64(data.data(), data.size(), 3));
  EXPECT_NE(base, checksum64(data.data(), data.size(), 4)) << "the seed (step) matters";
  EXPECT_NE(base, checksum64(data.data(), data.size() - 1, 3)) << "the length matters";
  std::set<uint64_t> seen{base};
  for (size_t i = 0; i < data.size(); ++i) {
    for (int bit = 0; bit < 8; bit += 7) {
      data[i] ^= static_cast<unsigned char>(1 << bit);
      seen.insert(checksum64(data.data(), data.size(), 3));
      data[i] ^= static_cast<unsigned char>(1 << bit);
    }
  }
  EXPECT_EQ(seen.size(), 1 + 2 * data.size()) << "every single-bit flip gives a new checksum";
  EXPECT_NE(checksum64(nullptr, 0, 0), checksum64(nullptr, 0, 1));
}

// The wire's values, pinned (a bucket's trailer and a delta's digest are
// checksum64 values that both sides must agree on, across versions).
TEST(Checksum, KnownValuesAndTheStreamGivesThemInAnyPieces) {
  std::vector<unsigned char> data(1000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
  EXPECT_EQ(checksum64(data.data(), 5, 3), 0xd6c6d6d749430e50ULL);
  EXPECT_EQ(checksum64(data.data(), 100, 3), 0x8b7f7d5952a1f9f8ULL);
  EXPECT_EQ(checksum64(data.data(), 1000, 3), 0xaa217101601e6e93ULL);
  std::mt19937 rng(9);
  for (size_t n : {0, 1, 8, 31, 32, 33, 100, 999, 1000}) {
    for (int trial = 0; trial < 4; ++trial) {
      Checksum64Stream stream(7, n);
      for (size_t at = 0; at < n;) {
        const size_t piece = std::min<size_t>(n - at, trial == 0 ? 32 : 1 + rng() % 80);
        stream.update(data.data() + at, piece);
        at += piece;
      }
      EXPECT_EQ(stream.finish(), checksum64(data.data(), n, 7)) << n << " bytes, trial " << trial;
    }
  }
}

TEST(Checksum, BucketTagsSeparateStepsBucketsAndParts) {
  EXPECT_NE(bucket_tag(1, 5, 0), bucket_tag(2, 5, 0));
  EXPECT_NE(bucket_tag(1, 5, 0), bucket_tag(1, 6, 0));
  EXPECT_NE(bucket_tag(1, 5, 0), bucket_tag(1, 5, 1));
  EXPECT_LT(bucket_tag(0x7FFF, 0x7FFFFFFF, 1), uint64_t{1} << 48);
}

TEST(Trace, WritesCompleteEventsAndMergesProcesses) {
  char dir[] = "/tmp/ws-trace-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  Tracer a("trainer 0", 0), b("engine 0", 1000);
  a.complete("pack 1", "pack", 10, 25, {{"bucket", 1}});
  { TraceSpan span(&b, "apply 1", "apply"); }
  EXPECT_EQ(a.size(), 1u);
  EXPECT_EQ(b.size(), 1u);
  const std::string fa = std::string(dir) + "/a.json", fb = std::string(dir) + "/b.json";
  a.write(fa);
  b.write(fb);
  const std::string merged = std::string(dir) + "/all.json";
  const auto missing = merge_traces({fa, fb, std::string(dir) + "/none.json"}, merged);
  EXPECT_EQ(missing.size(), 1u);
  std::ifstream in(merged);
  const auto j = nlohmann::json::parse(in);
  int complete = 0;
  std::set<int> pids;
  for (const auto& e : j["traceEvents"]) {
    pids.insert(e["pid"].get<int>());
    if (e["ph"] == "X") {
      ++complete;
      EXPECT_GE(e["dur"].get<int64_t>(), 0);
    }
  }
  EXPECT_EQ(complete, 2);
  EXPECT_EQ(pids, (std::set<int>{0, 1000}));
  EXPECT_THROW(merge_traces({fa}, "/nonexistent-dir/x.json"), Error);
}

TrainerLayout two_param_layout() {
  return TrainerLayout::from_json(nlohmann::json::parse(R"({
    "mesh": {"axes": ["fsdp"], "shape": [2]},
    "params": [
      {"name": "w", "hf_keys": ["model.w"], "fused_dim": null, "global_shape": [5, 4],
       "dtype": "BF16", "shards": [{"dim": 0, "axis": "fsdp"}]}
    ]})"));
}

TEST(Publisher, RegistrationIsCheckedAgainstTheLoadSpec) {
  control::Coordinator coordinator(control::CoordinatorOptions{});
  PublisherOptions opt;
  opt.coordinator = coordinator.address();
  opt.rank = 1;
  opt.layout = two_param_layout();
  Publisher pub(opt);
  std::vector<uint16_t> data(16);
  try {
    pub.register_tensor("nope", data.data(), DType::BF16, {2, 4});
    FAIL() << "an unknown name must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::not_found);
    EXPECT_NE(std::string(e.what()).find("nope"), std::string::npos);
  }
  try {
    pub.register_tensor("w", data.data(), DType::BF16, {3, 4});  // rank 1 holds rows 3..5: 2 rows
    FAIL() << "a wrong local shape must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::mismatch);
    EXPECT_NE(std::string(e.what()).find("trainer rank 1: param 'w' registered with shape [3, 4] "
                                         "but rank 1's local shape is [2, 4]"),
              std::string::npos)
        << e.what();
  }
  try {
    pub.register_tensor("w", data.data(), DType::F32, {2, 4});
    FAIL() << "a wrong dtype must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::mismatch);
    EXPECT_NE(std::string(e.what()).find("registered as F32 but its LoadSpec says BF16"),
              std::string::npos)
        << e.what();
  }
  try {
    pub.register_tensor("w", nullptr, DType::BF16, {2, 4});
    FAIL() << "a null pointer must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("null pointer"), std::string::npos) << e.what();
  }
  pub.register_tensor("w", data.data(), DType::BF16, {2, 4});
  EXPECT_THROW(pub.plan(), Error) << "no plan before the first push";
}

// Plan options a publisher cannot honour are refused before it connects.
TEST(Publisher, RejectsPlanOptionsItCannotHonour) {
  PublisherOptions opt;
  opt.coordinator = "127.0.0.1:1";
  opt.layout = two_param_layout();
  opt.plan.bucket_bytes = 512;
  try {
    Publisher pub(opt);
    FAIL() << "a bucket below 1024 bytes must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("bucket_bytes 512"), std::string::npos) << e.what();
  }
  opt.plan.bucket_bytes = 4096;
  opt.plan.replicas = {0};
  try {
    Publisher pub(opt);
    FAIL() << "replicas chosen by hand must be refused";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("plan.replicas must be empty"), std::string::npos)
        << e.what();
  }
}

TEST(Publisher, RejectsARankOutsideTheMesh) {
  PublisherOptions opt;
  opt.coordinator = "127.0.0.1:1";
  opt.rank = 2;
  opt.layout = two_param_layout();
  try {
    Publisher pub(opt);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
  }
}

}  // namespace
}  // namespace weightsync
