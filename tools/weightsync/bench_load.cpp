// `weightsync bench load`: one coordinator under load. Many trainer ranks and
// engine ranks (real processes, the demo's small model) sync for many steps
// while, beside them, client connections join and leave the coordinator in
// waves. Prints the steps committed, step times (all steps, and the steps
// that ran while connections churned against those that did not), how long
// a join took, and the peak memory of every kind of process.
#include "cli.h"
#include "demo_job.h"
#include "demo_run.h"
#include "demo_setup.h"
#include "pipeline/loop.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace weightsync::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage =
    "usage: weightsync bench load [--trainers N] [--engines M] [--tp T] [--steps K]\n"
    "                             [--churn C] [--churn-open P] [--step-gap MS]\n"
    "                             [--timeout S]\n"
    "                             [--work-dir D] [--json]\n\n"
    "One coordinator, N trainer ranks (default 16, mesh fsdp=N) and M engine ranks\n"
    "(default 64: M/T vLLM-layout replicas of tp=T, default 2), every rank its own\n"
    "process, syncing the demo's model (Qwen3-MoE shaped, about 12 MB) for K steps\n"
    "(default 50) over UCX; every engine checks every version bit for bit. Once the\n"
    "first step committed, C client connections (default 1000) join the coordinator\n"
    "and leave again (P threads, default 50, each joining, staying 10 ms and leaving\n"
    "over and over), while the steps go on (the trainers\n"
    "pause MS milliseconds between steps, default 100, so that they span the churn).\n"
    "Prints the steps committed by every engine, p50/p99 step time (the slowest\n"
    "trainer's push) over all steps and over the steps that ran during the churn\n"
    "against the others, the joins' and leaves' p50/p99 time and failures, the observers left\n"
    "at the end (0: none leaked), and the peak RSS of the trainer and engine\n"
    "processes and of this one (coordinator, churn clients). --timeout: per step\n"
    "(default 120 s). Exit 1 unless every engine committed and verified every step\n"
    "and every join succeeded.\n";

using pipeline::seconds_since;

struct Churn {
  int target = 0, open_at_once = 0;
  int joined = 0, failed = 0;
  std::string first_error;
  std::vector<double> join_s, leave_s;
  int64_t version_before = -1, version_after = -1;  // engine 0's, around the churn
  int observers_left = -1;                          // observers still members at the end
};

// The side task: waits for the first committed step, then makes the joins
// and leaves, then counts the observers the coordinator still lists.
void churn(Churn& c, const std::string& address, const std::string& token,
           const std::atomic<bool>& stop) {
  control::ClientOptions o;
  o.address = address;
  o.token = token;
  o.role = control::Role::observer;
  o.connect_timeout = std::chrono::seconds(30);
  try {
    control::Client monitor(o);
    while (!stop && monitor.committed_version(0) < 1)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (stop) return;
    c.version_before = monitor.committed_version(0);
    // Observers of the job itself (the workers may have some) stay listed.
    std::vector<uint64_t> before;
    for (const control::Member& m : monitor.members()) before.push_back(m.id);
    // P threads, each joining, staying a moment and leaving, over and over:
    // P clients at a time, independent of each other as real ones are.
    std::mutex mu;
    int started = 0;
    std::vector<std::thread> threads;
    for (int t = 0; t < c.open_at_once; ++t)
      threads.emplace_back([&] {
        for (;;) {
          {
            std::lock_guard lock(mu);
            if (stop || started >= c.target) return;
            ++started;
          }
          auto start = Clock::now();
          try {
            control::Client client(o);
            const double join = seconds_since(start);
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
            start = Clock::now();
            client.leave();
            const double leave = seconds_since(start);
            std::lock_guard lock(mu);
            c.join_s.push_back(join);
            c.leave_s.push_back(leave);
            ++c.joined;
          } catch (const std::exception& e) {
            std::lock_guard lock(mu);
            if (c.first_error.empty()) c.first_error = e.what();
            ++c.failed;
          }
        }
      });
    for (auto& t : threads) t.join();
    c.version_after = monitor.committed_version(0);
    // The leaves are processed by now (each waited for its reply): none of
    // the churn's observers may still be listed.
    int observers = 0;
    for (const control::Member& m : monitor.members())
      observers += m.role == control::Role::observer &&
                   std::find(before.begin(), before.end(), m.id) == before.end();
    c.observers_left = observers;
  } catch (const std::exception& e) {
    if (c.first_error.empty()) c.first_error = e.what();
    ++c.failed;
  }
}

int run_load_bench(const std::vector<std::string>& argv) {
  Args args(argv, {"json"},
            {"trainers", "engines", "tp", "steps", "churn", "churn-open", "timeout", "work-dir",
             "step-gap"});
  const int trainers = static_cast<int>(args.get_int("trainers", 16));
  const int engines = static_cast<int>(args.get_int("engines", 64));
  const int tp = static_cast<int>(args.get_int("tp", 2));
  const int steps = static_cast<int>(args.get_int("steps", 50));
  Churn c;
  c.target = static_cast<int>(args.get_int("churn", 1000));
  c.open_at_once = static_cast<int>(args.get_int("churn-open", 50));
  if (trainers < 1 || engines < 1 || tp < 1 || engines % tp != 0)
    fail(Errc::invalid_argument, "bench load: --trainers and --engines must be positive and ",
         "--engines a multiple of --tp (", engines, " ranks, tp=", tp, ")");
  if (steps < 2) fail(Errc::invalid_argument, "bench load: --steps must be at least 2");
  if (c.target < 0 || c.open_at_once < 1)
    fail(Errc::invalid_argument, "bench load: --churn must be >= 0 and --churn-open >= 1");
  demo::JobSpec job;
  job.steps = steps;
  job.transport = "ucx";
  job.bucket_bytes = int64_t{4} << 20;
  job.timeout_ms = static_cast<int64_t>(args.get_double("timeout", 120) * 1000);
  job.step_gap_ms = args.get_int("step-gap", 100);
  if (job.step_gap_ms < 0) fail(Errc::invalid_argument, "bench load: --step-gap must be >= 0");
  job.work_dir = args.has("work-dir") ? args.require("work-dir") : demo::make_temp_dir("load");
  fs::create_directories(job.work_dir);
  demo::ModelSetup setup;
  setup.hf_config = demo::demo_model_config();
  setup.mesh = cat("fsdp=", trainers);
  setup.tp = tp;
  setup.replicas = engines / tp;
  const demo::ModelFiles model = demo::write_model(job.work_dir, setup);
  job.checkpoint = model.checkpoint;
  job.trainer = model.trainer;
  job.engine = model.engine;
  if (!args.flag("json"))
    std::printf(
        "weightsync bench load: %s model, %.1f MB, %d trainer ranks -> %d engine ranks "
        "(%d replicas x tp=%d), %d steps; %d connections joining and leaving, %d at a "
        "time\n",
        model.family.c_str(), static_cast<double>(model.bytes) / 1e6, trainers, engines,
        engines / tp, tp, steps, c.target, c.open_at_once);
  std::fflush(stdout);
  const auto start = Clock::now();
  const demo::JobRun run =
      demo::run_job(job, "",
                    [&](const std::string& address, const std::string& token,
                        const std::atomic<bool>& stop) { churn(c, address, token, stop); });
  const double wall = seconds_since(start);
  const nlohmann::json summary = demo::summarize(job, run);
  std::vector<double> all, during, outside;
  int committed_by_all = 0;
  for (const auto& row : summary["steps"]) {
    const double s = row["sync_s"].get<double>();
    const int64_t step = row["step"].get<int64_t>();
    all.push_back(s);
    // A step ran during the churn when it committed after the churn began
    // and no later than the first commit after it ended.
    const bool in = c.version_before >= 0 && step > c.version_before &&
                    (c.version_after < 0 || step <= c.version_after + 1);
    (in ? during : outside).push_back(s);
    committed_by_all += row["committed"].size() == static_cast<size_t>(engines) &&
                        row["verified"].size() == static_cast<size_t>(engines);
  }
  double trainer_rss = 0, engine_rss = 0;
  for (const auto& t : run.trainers)
    if (t.is_object()) trainer_rss = std::max(trainer_rss, t.value("peak_rss_mb", 0.0));
  for (const auto& e : run.engines)
    if (e.is_object()) engine_rss = std::max(engine_rss, e.value("peak_rss_mb", 0.0));
  const bool ok = summary["ok"].get<bool>() && committed_by_all == steps && c.failed == 0 &&
                  c.joined == c.target && c.observers_left == 0;
  nlohmann::json out = {
      {"bench", "load"},
      {"trainers", trainers},
      {"engines", engines},
      {"tp", tp},
      {"steps", steps},
      {"steps_committed_by_every_engine", committed_by_all},
      {"step_p50_s", percentile(all, 0.5)},
      {"step_p99_s", percentile(all, 0.99)},
      {"step_max_s", all.empty() ? 0.0 : *std::max_element(all.begin(), all.end())},
      {"wall_s", wall},
      {"churn",
       {{"connections", c.target},
        {"at_once", c.open_at_once},
        {"joined", c.joined},
        {"failed", c.failed},
        {"error", c.first_error},
        {"join_p50_s", percentile(c.join_s, 0.5)},
        {"join_p99_s", percentile(c.join_s, 0.99)},
        {"leave_p50_s", percentile(c.leave_s, 0.5)},
        {"leave_p99_s", percentile(c.leave_s, 0.99)},
        {"steps_during", during.size()},
        {"step_p99_during_s", percentile(during, 0.99)},
        {"step_p99_outside_s", percentile(outside, 0.99)},
        {"observers_left", c.observers_left}}},
      {"peak_rss_mb",
       {{"trainer_max", trainer_rss},
        {"engine_max", engine_rss},
        {"this_process", demo::peak_rss_mb()}}},
      {"ok", ok}};
  // Not ok: which step, which rank, and why (demo::summarize), or the churn's.
  for (const char* key : {"error", "failures"})
    if (summary.contains(key)) out[key] = summary[key];
  if (!ok && !out.contains("error"))
    out["error"] = c.first_error.empty() ? std::string("the churn did not complete (see churn)")
                                         : cat("churn: ", c.first_error);
  if (args.flag("json")) {
    std::cout << out.dump() << "\n";
  } else {
    std::printf(
        "steps: %d of %d committed and verified by all %d engine ranks; step p50 %.3f s, "
        "p99 %.3f s, max %.3f s (%.1f s in all)\n",
        committed_by_all, steps, engines, out["step_p50_s"].get<double>(),
        out["step_p99_s"].get<double>(), out["step_max_s"].get<double>(), wall);
    std::printf(
        "churn: %d of %d connections joined and left (%d failed%s%s), join p50 %.4f s, "
        "p99 %.4f s, leave p50 %.4f s, p99 %.4f s; %zu steps ran during it: step p99 %.3f s (other "
        "steps %.3f s); "
        "observers left at the end: %d\n",
        c.joined, c.target, c.failed, c.first_error.empty() ? "" : ": ", c.first_error.c_str(),
        percentile(c.join_s, 0.5), percentile(c.join_s, 0.99), percentile(c.leave_s, 0.5),
        percentile(c.leave_s, 0.99), during.size(), percentile(during, 0.99),
        percentile(outside, 0.99), c.observers_left);
    std::printf(
        "peak RSS: trainer %.0f MB, engine %.0f MB (max per process), this process "
        "(coordinator and churn clients) %.0f MB\n",
        trainer_rss, engine_rss, demo::peak_rss_mb());
    if (!summary["ok"].get<bool>()) demo::print_summary(std::cout, summary);
  }
  if (ok && !args.has("work-dir")) fs::remove_all(job.work_dir);
  return ok ? 0 : 1;
}

const BenchRegistrar registrar{
    {"load", "one coordinator under many ranks, many steps and churning client connections", kUsage,
     run_load_bench}};

}  // namespace
}  // namespace weightsync::cli
