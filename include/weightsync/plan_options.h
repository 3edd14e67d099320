// Plan options: how a sync is planned (plan.h), and their JSON. Trainer rank
// 0 publishes its options with the job's plan (pipeline/setup.h,
// PublishedOptions) and every process plans from them, so the JSON is the
// one form both ends read and write.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string_view>
#include <vector>

namespace weightsync {

enum class PlanMode : uint8_t { p2p, broadcast };
std::string_view plan_mode_name(PlanMode mode) noexcept;
PlanMode parse_plan_mode(std::string_view name);  // Errc::invalid_argument

// Where FP8 engine params are quantized: on the engine rank always, or by the
// sending trainer rank where it holds whole blocks (p2p only; else the engine).
enum class Fp8Site : uint8_t { sender, engine };
std::string_view fp8_site_name(Fp8Site site) noexcept;
Fp8Site parse_fp8_site(std::string_view name);  // Errc::invalid_argument

struct PlanOptions {
  PlanMode mode = PlanMode::p2p;
  int64_t bucket_bytes = int64_t{256} << 20;  // 1 KiB .. 4 GiB - 1
  Fp8Site fp8_site = Fp8Site::sender;
  // Elastic replicas (docs/elastic.md): the global replica
  // indices the plan serves, ascending, each once; the engine ranks of the
  // others receive nothing. Empty: every replica. A list (even of every
  // replica) is part of the plan id: a plan for one membership is never
  // taken for another's.
  std::vector<int32_t> replicas = {};
  // p2p: every replica of an engine template gets each item from the same
  // trainer rank, in the same buckets (the first replica's choice, balanced
  // over the holders), instead of spreading the replicas over the holders.
  // A trainer rank then packs equal bytes for each of them, and delta sync
  // encodes them once (docs/delta.md); the publisher sets it with delta on.
  // Part of the plan id.
  bool same_buckets_per_replica = false;

  bool operator==(const PlanOptions&) const = default;

  // {"mode", "bucket_bytes", "fp8_site", "same_buckets_per_replica"}, and
  // "replicas" when there are any.
  nlohmann::json to_json() const;
  // Of an object to_json wrote: "mode" and "bucket_bytes" required, the
  // others optional (their defaults). Errc::format naming the field for a
  // malformed object; Errc::invalid_argument for an unknown mode or site.
  static PlanOptions from_json(const nlohmann::json& j);
};

}  // namespace weightsync
