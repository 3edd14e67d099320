// The job's documents in the store (src/pipeline/setup.h): the keys, and the
// plan options trainer rank 0 publishes, which every process reads back.
#include <weightsync/error.h>
#include <weightsync/plan_options.h>

#include "pipeline/setup.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace weightsync::pipeline {
namespace {

TEST(PublishedOptions, KeysAreTheJobsDocuments) {
  const JobKeys keys{"job7"};
  EXPECT_EQ(keys.trainer_layout(), "job7/layout/trainer");
  EXPECT_EQ(keys.engine_config(), "job7/layout/engine");
  EXPECT_EQ(keys.plan_options(), "job7/plan_options");
  EXPECT_EQ(keys.transport(), "job7/transport");
  EXPECT_EQ(keys.ready(5), "job7/ready/5");
}

TEST(PublishedOptions, JsonKeepsTheFieldsEveryVersionReads) {
  PublishedOptions o;
  o.plan.mode = PlanMode::broadcast;
  o.plan.bucket_bytes = 4096;
  o.plan.fp8_site = Fp8Site::engine;
  o.plan.same_buckets_per_replica = true;
  o.wire.checksums = true;
  o.min_replicas = 2;
  const nlohmann::json j = o.to_json();
  // The object as the Publisher wrote it by hand before this schema.
  const nlohmann::json before = {{"mode", "broadcast"},      {"bucket_bytes", 4096},
                                 {"fp8_site", "engine"},     {"same_buckets_per_replica", true},
                                 {"wire", o.wire.to_json()}, {"elastic", {{"min_replicas", 2}}}};
  EXPECT_EQ(j, before);
  const PublishedOptions back = PublishedOptions::from_json(j, "the store's 'x'");
  EXPECT_EQ(back.plan, o.plan);
  EXPECT_EQ(back.wire.to_json(), o.wire.to_json());
  EXPECT_EQ(back.min_replicas, 2);
  // Static jobs publish no "elastic"; an empty `replicas` is not written.
  o.min_replicas.reset();
  EXPECT_FALSE(o.to_json().contains("elastic"));
  EXPECT_FALSE(o.to_json().contains("replicas"));
  EXPECT_FALSE(PublishedOptions::from_json(o.to_json(), "x").min_replicas);
}

TEST(PublishedOptions, PlanOptionsRoundTripWithReplicas) {
  PlanOptions o;
  o.replicas = {0, 2};
  EXPECT_EQ(PlanOptions::from_json(o.to_json()), o);
  // Only "mode" and "bucket_bytes" are required: the others take defaults.
  const PlanOptions d = PlanOptions::from_json({{"mode", "p2p"}, {"bucket_bytes", 1 << 20}});
  EXPECT_EQ(d.fp8_site, Fp8Site::sender);
  EXPECT_FALSE(d.same_buckets_per_replica);
}

TEST(PublishedOptions, MalformedObjectsAreFormatErrorsNamingWhere) {
  auto format_error = [](const nlohmann::json& j) {
    try {
      PublishedOptions::from_json(j, "the store's 'job/plan_options'");
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::format) << e.what();
      return std::string(e.what());
    }
    ADD_FAILURE() << "accepted " << j.dump();
    return std::string();
  };
  EXPECT_NE(format_error({{"mode", 1}, {"bucket_bytes", 2}})
                .find("the store's 'job/plan_options' lacks a string \"mode\""),
            std::string::npos);
  EXPECT_NE(format_error({{"mode", "p2p"}, {"bucket_bytes", 4096}, {"fp8_site", 3}})
                .find("non-string \"fp8_site\""),
            std::string::npos);
  EXPECT_NE(format_error({{"mode", "p2p"}, {"bucket_bytes", 4096}, {"elastic", {}}})
                .find("\"elastic\" without an integer \"min_replicas\""),
            std::string::npos);
  EXPECT_NE(format_error({{"mode", "p2p"}, {"bucket_bytes", 4096}, {"replicas", {"a"}}})
                .find("\"replicas\""),
            std::string::npos);
}

}  // namespace
}  // namespace weightsync::pipeline
