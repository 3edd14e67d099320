// `weightsync demo --chaos SEED`: a soak that injects one real fault (or
// none) per step into a demo job whose every rank, and the coordinator, is
// its own process, and checks the job's invariants after every step from the
// ranks' own reports, the coordinator's status and its metrics.
//
// The parent paces the steps through files in JobSpec::chaos_dir, which
// outlive any process (the coordinator's store does not): it writes
// go-<step> to release a step and `stop` to end the job; each worker writes
// ready-<role>-<rank>-<pid> once prepared and appends one JSON line per step
// to <role>-<rank>.jsonl (trainers: their push; engines: the outcome, the
// version and torn flag they hold after it, and the check of their params
// against the reference of that version).
#pragma once

#include "demo_job.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace weightsync::demo::chaos {

enum class FaultKind {
  none,
  kill_trainer,      // SIGKILL a trainer rank during the step; a new process takes it
  kill_engine,       // SIGKILL an engine rank during the step; a new process takes it
  kill_coordinator,  // SIGKILL the coordinator during the step; restarted on its address
  corrupt,           // an engine rank's receive of one bucket has a byte flipped (fault:)
  truncate,          // a trainer's send of one bucket goes out one byte short (fault:)
  delay,             // a rank stalls (SIGSTOP, then SIGCONT) during the step
};
inline constexpr int kFaultKinds = 7;
const char* fault_name(FaultKind kind);

struct Fault {
  int step = 0;
  FaultKind kind = FaultKind::none;
  std::string role;      // the rank's role: "trainer" | "engine" (kills, delay, corrupt, truncate)
  int rank = -1;         // trainer rank or global engine rank
  int bucket = -1;       // corrupt / truncate: the plan's bucket hit
  int64_t at_ms = 0;     // kills, delay: after the step's release
  int64_t stall_ms = 0;  // delay: how long the rank stays stopped
  std::string describe() const;
};

// What a schedule may hit: the job's ranks and, per rank, the buckets it
// sends (trainers) or receives (engines) in one step (from the plan).
struct Targets {
  std::vector<std::vector<int32_t>> trainer_buckets, engine_buckets;
};

// One fault (or none) per step, from `seed` alone: the same seed and
// targets give the same schedule. Step 1 and the last step are clean (all
// ranks connect first; every live rank can take the last version at the end).
// The buckets each rank of `job` sends or receives in a step (its p2p plan).
Targets targets_of(const JobSpec& job);

std::vector<Fault> make_schedule(uint64_t seed, int steps, const Targets& targets);
nlohmann::json schedule_json(const std::vector<Fault>& schedule);

// The fault-transport options that arm `role` rank `rank` for its scheduled
// corrupt (engines) or truncate (trainers) faults, by the tags of the buckets
// hit (pipeline/wire.h bucket_tag): "" when it has none.
std::string fault_options(const std::vector<Fault>& schedule, const std::string& role, int rank);

// The files of the protocol above.
std::string go_path(const std::string& dir, int step);
std::string stop_path(const std::string& dir);
std::string ready_path(const std::string& dir, const std::string& role, int rank, long pid);
std::string report_path(const std::string& dir, const std::string& role, int rank);
void touch(const std::string& path);
// Appends one line of JSON (one write, flushed): a process killed mid-way
// leaves at most a torn last line, which read_lines skips.
void append_line(const std::string& path, const nlohmann::json& line);
std::vector<nlohmann::json> read_lines(const std::string& path);
// The first step a worker starting now takes part in: one past the last released.
int first_step(const std::string& dir);
// Seconds since the epoch (system clock): when a rank saw and ended a step.
double unix_seconds();
// Waits for go-<step> (true) or stop (false).
bool wait_for_go(const std::string& dir, int step);

// The parent: runs the soak for `job` (its steps, timeout, staging, model;
// work_dir must exist) with the schedule of `seed`. Returns the summary:
// "table" (steps, faults by kind, commits, aborts, the longest step, bytes
// lost, netns), "schedule", "violations" (each: step, rank, invariant,
// detail) and "ok".
nlohmann::json run_soak(JobSpec job, uint64_t seed, bool quiet);
void print_table(std::ostream& out, const nlohmann::json& summary);

}  // namespace weightsync::demo::chaos
