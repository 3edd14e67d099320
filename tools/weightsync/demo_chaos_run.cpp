// The chaos soak's parent: the coordinator and every rank as processes of
// its own, one scheduled fault per step, the invariants checked after every
// step (demo_chaos.h).
#include "demo_chaos.h"
#include "demo_chaos_check.h"
#include "demo_procs.h"

#include <weightsync/control.h>
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/load_spec.h>
#include <weightsync/plan.h>
#include <weightsync/topology.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>

namespace weightsync::demo::chaos {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The coordinator as a `weightsync coordinator` process, restarted on the
// address (and metrics port) it first bound.
class CoordinatorProcess {
 public:
  CoordinatorProcess(ProcessGroup& group, std::string dir, int64_t step_timeout_ms)
      : group_(group), dir_(std::move(dir)), step_timeout_ms_(step_timeout_ms) {
    std::random_device rd;
    token_ = cat(std::hex, rd(), rd());
    std::ofstream(dir_ + "/token") << token_;
  }
  void start() {
    std::vector<std::string> args{
        "coordinator",   "--listen",          cat("127.0.0.1:", port_),        "--token-file",
        dir_ + "/token", "--step-timeout-ms", std::to_string(step_timeout_ms_)};
    if (starts_ > 0) args.insert(args.end(), {"--metrics-port", std::to_string(metrics_port_)});
    pid_ = group_.spawn(starts_ ? cat("coordinator restart ", starts_) : "coordinator", args,
                        /*may_fail=*/true);
    ++starts_;
    const std::string log = group_.result(pid_)->log_path;
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    for (;;) {
      const std::string text = tail_of_file(log, 4000);
      const auto at = text.find("coordinator listening on ");
      if (at != std::string::npos &&
          (text.find("/metrics") != std::string::npos ||
           text.find("without metrics") != std::string::npos || metrics_port_ < 0)) {
        const auto end = text.find('\n', at);
        address_ = text.substr(at + 25, end - at - 25);
        port_ = std::stoi(address_.substr(address_.rfind(':') + 1));
        const auto m = text.find("metrics on http://");
        if (m == std::string::npos) {
          metrics_port_ = -1;
        } else {
          const auto colon = text.find(':', m + 18);
          metrics_port_ = std::stoi(text.substr(colon + 1));
        }
        return;
      }
      if (!group_.running(pid_) || Clock::now() > deadline)
        fail(Errc::io, "the coordinator did not start: ", tail_of_file(log, 600));
      std::this_thread::sleep_for(Millis(5));
    }
  }
  void kill() {
    ::kill(pid_, SIGKILL);
    while (group_.running(pid_)) std::this_thread::sleep_for(Millis(2));
  }
  void stop() {
    ::kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (group_.running(pid_) && Clock::now() < deadline) std::this_thread::sleep_for(Millis(5));
  }
  const std::string& address() const { return address_; }
  const std::string& token() const { return token_; }
  int metrics_port() const { return metrics_port_; }

 private:
  ProcessGroup& group_;
  std::string dir_, token_, address_;
  int64_t step_timeout_ms_;
  int port_ = 0, metrics_port_ = 0, starts_ = 0;
  pid_t pid_ = -1;
};

// "fault:<transport>?<options>" (or the transport itself without options).
std::string armed(const std::string& transport, const std::string& options) {
  if (options.empty()) return transport;
  const std::string name = transport.rfind("fault:", 0) == 0 ? transport : "fault:" + transport;
  return name + (name.find('?') == std::string::npos ? "?" : "&") + options;
}

// The worker processes, by role and rank: the pid of the current process.
struct Workers {
  ProcessGroup& group;
  std::string job_path, dir;
  std::map<std::pair<std::string, int>, pid_t> pid;
  std::map<std::pair<std::string, int>, int> restarts;

  void start(const std::string& role, int rank, bool restarted) {
    std::vector<std::string> args{
        "worker", "--job", job_path, "--role", role, "--rank", std::to_string(rank)};
    if (restarted) args.push_back("--restarted");
    // Each process its own log: "engine 3", "engine 3 restart 1", ...
    const int n = restarted ? ++restarts[{role, rank}] : 0;
    pid[{role, rank}] =
        group.spawn(cat(role, " ", rank, n ? cat(" restart ", n) : ""), args, /*may_fail=*/true);
  }
  // Waits until every listed worker wrote its ready file (or ended).
  void wait_ready(const std::vector<std::pair<std::string, int>>& who, Millis timeout) {
    const auto deadline = Clock::now() + timeout;
    for (const auto& w : who) {
      const pid_t p = pid.at(w);
      while (!std::filesystem::exists(ready_path(dir, w.first, w.second, p))) {
        if (!group.running(p))
          fail(Errc::peer_failure, w.first, " rank ", w.second,
               " ended before it was ready: ", reason_in_log(group.result(p)->log_path));
        if (Clock::now() > deadline)
          fail(Errc::timeout, w.first, " rank ", w.second, " was not ready in time");
        std::this_thread::sleep_for(Millis(5));
      }
    }
  }
};

void stall(pid_t pid, int64_t ms) {
  ::kill(pid, SIGSTOP);
  std::this_thread::sleep_for(Millis(ms));
  ::kill(pid, SIGCONT);
}

}  // namespace

Targets targets_of(const JobSpec& job) {
  PlanOptions po;
  po.mode = parse_plan_mode(job.mode);
  po.bucket_bytes = job.bucket_bytes;
  po.fp8_site = parse_fp8_site(job.fp8_site);
  const Plan plan = make_plan(TrainerLayout::load(job.trainer),
                              make_engine_layout(load_engine_spec(job.engine)), Topology{}, po);
  Targets t;
  for (int r = 0; r < plan.trainer_world(); ++r)
    t.trainer_buckets.push_back(plan.buckets_sent_by(r));
  for (int g = 0; g < plan.engine_world(); ++g)
    t.engine_buckets.push_back(plan.buckets_received_by(g));
  return t;
}

nlohmann::json run_soak(JobSpec job, uint64_t seed, bool quiet) {
  const auto started = Clock::now();
  const Targets targets = targets_of(job);
  const int trainers = static_cast<int>(targets.trainer_buckets.size());
  const int engines = static_cast<int>(targets.engine_buckets.size());
  const auto schedule = make_schedule(seed, job.steps, targets);
  if (!quiet) {
    std::cout << "schedule (seed " << seed << "):\n";
    for (const auto& f : schedule)
      if (f.kind != FaultKind::none)
        std::cout << "  step " << f.step << ": " << f.describe() << "\n";
    std::cout << std::flush;
  }
  job.chaos_dir = job.work_dir + "/chaos";
  std::filesystem::create_directories(job.chaos_dir);
  for (int r = 0; r < trainers; ++r)
    job.trainer_transport.push_back(armed(job.transport, fault_options(schedule, "trainer", r)));
  job.engine_transport.clear();
  for (int g = 0; g < engines; ++g)
    job.engine_transport.push_back(armed(job.transport, fault_options(schedule, "engine", g)));
  // Ranks reach a restarted coordinator again (docs/usage.md "The coordinator dies").
  job.coordinator_reconnect_ms = std::max<int64_t>(job.coordinator_reconnect_ms, 120000);

  ProcessGroup group(job.work_dir);
  CoordinatorProcess coordinator(group, job.chaos_dir, job.timeout_ms);
  coordinator.start();
  job.coordinator = coordinator.address();
  job.token = coordinator.token();
  Workers workers{group, job.work_dir + "/job.json", job.chaos_dir, {}, {}};
  job.save(workers.job_path);

  Checker checker(job, trainers, engines);
  std::vector<std::pair<std::string, int>> all;
  for (int g = 0; g < engines; ++g) all.push_back({"engine", g});
  for (int r = 0; r < trainers; ++r) all.push_back({"trainer", r});
  for (const auto& [role, rank] : all) workers.start(role, rank, false);
  workers.wait_ready(all, Millis(job.timeout_ms) * 3);
  const int64_t bound_ms = job.timeout_ms + 5000;  // the step timeout, the decision's grace, slack

  for (const Fault& f : schedule) {
    const int s = f.step;
    const bool coordinator_dies = f.kind == FaultKind::kill_coordinator;
    const Scrape before = coordinator_dies ? Scrape{} : checker.scrape(coordinator.metrics_port());
    const auto go = Clock::now();
    const double go_at = unix_seconds();
    touch(go_path(job.chaos_dir, s));
    if (f.kind != FaultKind::none && f.at_ms > 0) std::this_thread::sleep_for(Millis(f.at_ms));
    if (f.kind == FaultKind::kill_trainer || f.kind == FaultKind::kill_engine)
      ::kill(workers.pid.at({f.role, f.rank}), SIGKILL);
    if (f.kind == FaultKind::delay) stall(workers.pid.at({f.role, f.rank}), f.stall_ms);
    if (coordinator_dies) {
      coordinator.kill();
      coordinator.start();
    }
    // The step ends when every live trainer reported it.
    double seconds = 0;
    for (bool done = false; !done;) {
      done = true;
      for (int r = 0; r < trainers; ++r) {
        const pid_t p = workers.pid.at({"trainer", r});
        done &= !group.running(p) || checker.trainer_reported(r, s);
      }
      seconds = since(go);
      if (seconds * 1000 > 3 * bound_ms) break;  // reported as outliving its bound below
      if (!done) std::this_thread::sleep_for(Millis(2));
    }
    // Every live engine rank that took part reports the step too.
    const auto engine_wait = Clock::now() + Millis(checker.any_trainer_ok(s) ? 5000 : 1500);
    for (bool done = false; !done && Clock::now() < engine_wait;) {
      done = true;
      for (int g = 0; g < engines; ++g)
        done &= !group.running(workers.pid.at({"engine", g})) || checker.engine_reported(g, s);
      if (!done) std::this_thread::sleep_for(Millis(2));
    }
    checker.step_done(f, seconds, bound_ms, go_at);
    if (!coordinator_dies)
      checker.check_coordinator(f, coordinator.address(), coordinator.token(),
                                coordinator.metrics_port(), before);
    // A rank that died is taken by a new process before the next step,
    // which waits for it; one that died unasked is a violation.
    std::vector<std::pair<std::string, int>> restarted;
    for (const auto& w : all) {
      const pid_t p = workers.pid.at(w);
      if (group.running(p)) continue;
      const bool victim = (f.kind == FaultKind::kill_trainer || f.kind == FaultKind::kill_engine) &&
                          f.role == w.first && f.rank == w.second;
      if (!victim && s < job.steps)
        checker.violation(
            s, cat(w.first, " rank ", w.second), "no process dies unasked",
            cat(group.result(p)->status(), ": ", reason_in_log(group.result(p)->log_path)));
      if (s < job.steps) {
        workers.start(w.first, w.second, true);
        restarted.push_back(w);
      }
    }
    workers.wait_ready(restarted, Millis(job.timeout_ms) * 3);
    if (coordinator_dies || !restarted.empty())
      checker.wait_members(coordinator.address(), coordinator.token(), Millis(job.timeout_ms));
    if (!quiet) checker.print_step(std::cout, f);
  }
  touch(stop_path(job.chaos_dir));
  const auto end = Clock::now() + Millis(job.timeout_ms) + std::chrono::seconds(10);
  for (const auto& w : all)
    while (group.running(workers.pid.at(w)) && Clock::now() < end)
      std::this_thread::sleep_for(Millis(5));
  for (int g = 0; g < engines; ++g) {
    const pid_t p = workers.pid.at({"engine", g});
    checker.check_final(g, p, group.running(p));
  }
  coordinator.stop();
  nlohmann::json out = checker.summary(seed, since(started));
  out["schedule"] = schedule_json(schedule);
  out["work_dir"] = job.work_dir;
  return out;
}

}  // namespace weightsync::demo::chaos
