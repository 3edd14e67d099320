// PlanOptions as JSON (trainer rank 0 publishes them for every process).
#include <weightsync/error.h>
#include <weightsync/json_fields.h>
#include <weightsync/plan_options.h>

#include <nlohmann/json.hpp>

namespace weightsync {

nlohmann::json PlanOptions::to_json() const {
  nlohmann::json j = {{"mode", plan_mode_name(mode)},
                      {"bucket_bytes", bucket_bytes},
                      {"fp8_site", fp8_site_name(fp8_site)},
                      {"same_buckets_per_replica", same_buckets_per_replica}};
  if (!replicas.empty()) j["replicas"] = replicas;
  return j;
}

PlanOptions PlanOptions::from_json(const nlohmann::json& j) {
  if (!j.is_object() || !j.contains("mode") || !j["mode"].is_string() ||
      !j.contains("bucket_bytes") || !j["bucket_bytes"].is_number_integer())
    fail(Errc::format, "lacks a string \"mode\" and an integer \"bucket_bytes\": ", j.dump());
  // The published form adds the wire options and elastic settings
  // (pipeline/setup.cpp), read there.
  check_fields(j,
               {"mode", "bucket_bytes", "fp8_site", "same_buckets_per_replica", "replicas", "wire",
                "elastic"},
               "plan options");
  PlanOptions o;
  o.mode = parse_plan_mode(j["mode"].get<std::string>());
  o.bucket_bytes = j["bucket_bytes"].get<int64_t>();
  if (j.contains("fp8_site")) {
    if (!j["fp8_site"].is_string()) fail(Errc::format, "has a non-string \"fp8_site\": ", j.dump());
    o.fp8_site = parse_fp8_site(j["fp8_site"].get<std::string>());
  }
  if (j.contains("same_buckets_per_replica")) {
    if (!j["same_buckets_per_replica"].is_boolean())
      fail(Errc::format, "has a non-boolean \"same_buckets_per_replica\": ", j.dump());
    o.same_buckets_per_replica = j["same_buckets_per_replica"].get<bool>();
  }
  if (j.contains("replicas")) {
    const auto& r = j["replicas"];
    bool ints = r.is_array();
    for (const auto& x : r) ints = ints && x.is_number_integer();
    if (!ints) fail(Errc::format, "has a \"replicas\" that is no list of integers: ", j.dump());
    o.replicas = r.get<std::vector<int32_t>>();
  }
  return o;
}

}  // namespace weightsync
