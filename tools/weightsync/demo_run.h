// The parent side of a demo/bench job: embeds the coordinator, starts one
// worker process per trainer rank and engine rank, waits for them (bounded,
// killing the rest when one fails), and gathers their stats into a summary.
#pragma once

#include "demo_job.h"
#include "demo_procs.h"

#include <nlohmann/json.hpp>

#include <atomic>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

namespace weightsync::demo {

struct JobRun {
  std::vector<ChildResult> children;
  std::vector<nlohmann::json> trainers;  // each worker's stats (null when it wrote none)
  std::vector<nlohmann::json> engines;
  bool timed_out = false;
};

// Work beside a job's workers, on a thread of its own, from when they are
// spawned until they all ended (`stop` then set): e.g. clients joining and
// leaving the coordinator (`address`, `token`) while steps run.
using SideTask = std::function<void(const std::string& address, const std::string& token,
                                    const std::atomic<bool>& stop)>;

// Runs `job` (work_dir must exist). `trace_out`: the merged Chrome trace.
JobRun run_job(JobSpec job, const std::string& trace_out = "", const SideTask& side = {});

// Per step: sync seconds (slowest trainer's push), bytes into the busiest
// engine rank, GB/s, the phase breakdown (slowest rank of each phase), and
// which engines committed and verified. Plus overall "ok" for the demo rule:
// every child ended well, every engine committed and verified every step.
nlohmann::json summarize(const JobSpec& job, const JobRun& run);

// The human-readable report of a summary.
void print_summary(std::ostream& out, const nlohmann::json& summary);

// A fresh directory under $TMPDIR (or /tmp): "<tmp>/weightsync-<what>-XXXXXX".
std::string make_temp_dir(const std::string& what);

}  // namespace weightsync::demo
