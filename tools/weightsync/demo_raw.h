// The raw transport ceiling for `weightsync bench`: the same bytes per
// (trainer rank, engine rank) link as the plan moves, sent as plain tagged
// transfers between the same processes, everything posted at once, no
// packing, no planning, no checksums. What the sync could reach at best.
#pragma once

#include "demo_job.h"

#include <weightsync/control.h>
#include <weightsync/plan.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>

namespace weightsync::demo {

// {"bytes": this rank's bytes, "seconds": [one per round]}.
nlohmann::json run_raw_rounds(const JobSpec& job, const Plan& plan, control::Client& client,
                              const std::string& role, int rank);

// An observer connection of a worker (barriers, raw transport bootstrap).
std::unique_ptr<control::Client> observer_client(const JobSpec& job,
                                                 std::chrono::milliseconds timeout);
// The transport name a worker uses (per-engine overrides, the kill wrapper).
std::string worker_transport(const JobSpec& job, const std::string& role, int rank);

}  // namespace weightsync::demo
