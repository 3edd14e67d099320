// `weightsync bench sync --checksum-overhead`: what the per-bucket checksums
// cost a sync, measured as the same job with them off and on, alternating,
// in one run (so that the machine's drift falls on both alike).
#pragma once

#include "demo_job.h"

#include <nlohmann/json.hpp>

namespace weightsync::cli {

// `rounds` runs of `job` each way, off first; every timed step (not the
// first, a warm-up) of each. The object holds sync_s_p50_off/_on, the
// per-round p50s, and ratio (p50 on / p50 off: 1.02 is 2 % more), or error.
nlohmann::json checksum_overhead(demo::JobSpec job, int rounds);

// Prints it in one line (or its error).
void print_checksum_overhead(const nlohmann::json& overhead);

}  // namespace weightsync::cli
