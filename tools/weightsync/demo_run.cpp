#include "demo_run.h"
#include "progress.h"

#include <nlohmann/json.hpp>

#include <weightsync/control.h>
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/load_spec.h>
#include <weightsync/trace.h>

#include "transport/staging.h"

#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <map>
#include <ostream>
#include <random>
#include <thread>

#include <unistd.h>

namespace weightsync::demo {
namespace {

nlohmann::json read_json_or_null(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nullptr;
  auto j = nlohmann::json::parse(in, nullptr, false);
  return j.is_discarded() ? nlohmann::json(nullptr) : j;
}

std::string random_token() {
  std::random_device rd;
  return cat(std::hex, rd(), rd());
}

const nlohmann::json* step_of(const nlohmann::json& stats, int64_t step) {
  if (!stats.is_object() || !stats.contains("steps")) return nullptr;
  for (const auto& s : stats["steps"])
    if (s.value("step", int64_t{-1}) == step) return &s;
  return nullptr;
}

double phase(const nlohmann::json* s, const char* name) {
  if (!s || !s->contains("phases")) return 0;
  return (*s)["phases"].value(name, 0.0);
}

// Every failure the job's processes reported, as {"who", "step" (when it was
// a step's), "reason"}: steps a trainer failed, steps an engine rank did not
// commit (with the coordinator's or its own reason), and processes that did
// not exit 0 (with the reason their log ends with; a process that died
// before it wrote its results shows only here).
nlohmann::json collect_failures(const JobRun& run) {
  nlohmann::json out = nlohmann::json::array();
  auto steps_of = [&](const nlohmann::json& stats, const std::string& who, bool trainer) {
    if (!stats.is_object()) return;
    for (const auto& s : stats.value("steps", nlohmann::json::array())) {
      const bool failed = trainer ? !s.value("ok", false) : !s.value("committed", false);
      if (!failed) continue;
      std::string why = s.value(trainer ? "error" : "reason", std::string());
      if (why.empty()) why = "not committed (no reason given)";
      out.push_back({{"who", who}, {"step", s.value("step", int64_t{-1})}, {"reason", why}});
    }
  };
  for (size_t t = 0; t < run.trainers.size(); ++t)
    steps_of(run.trainers[t], cat("trainer rank ", t), true);
  for (size_t g = 0; g < run.engines.size(); ++g) {
    steps_of(run.engines[g], cat("engine rank ", g), false);
    if (!run.engines[g].is_object()) continue;
    for (const auto& c : run.engines[g].value("checks", nlohmann::json::array()))
      if (!c.value("ok", true))
        out.push_back({{"who", cat("engine rank ", g)},
                       {"step", c.value("version", int64_t{-1})},
                       {"reason", cat("its params differ from the reference in ",
                                      c.value("bad_bytes", int64_t{0}), " bytes (first: ",
                                      c.value("first_bad_param", std::string()), ")")}});
  }
  for (const auto& c : run.children) {
    if (c.ok()) continue;
    std::string why = reason_in_log(c.log_path);
    out.push_back({{"who", c.label},
                   {"reason", cat(c.status(), why.empty() ? "" : ": ", why)},
                   {"log", c.log_path}});
  }
  if (run.timed_out)
    out.push_back({{"who", "job"},
                   {"reason",
                    "the job ran past its time budget (the step timeout for setup, "
                    "each step and teardown); its processes were killed"}});
  return out;
}

}  // namespace

std::string make_temp_dir(const std::string& what) {
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = cat(tmp && *tmp ? tmp : "/tmp", "/weightsync-", what, "-XXXXXX");
  if (!::mkdtemp(pattern.data())) fail(Errc::io, "cannot create a temporary directory ", pattern);
  return pattern;
}

JobRun run_job(JobSpec job, const std::string& trace_out, const SideTask& side) {
  const int trainers = static_cast<int>(TrainerLayout::load(job.trainer).mesh.world());
  const int engines = make_engine_layout(load_engine_spec(job.engine)).world();
  control::CoordinatorOptions co;
  co.token = random_token();
  co.step_timeout = std::chrono::milliseconds(job.timeout_ms);
  co.metrics_port = job.metrics_port;
  co.expect_trainers = trainers;
  co.expect_engines = engines;
  control::Coordinator coordinator(co);
  job.coordinator = coordinator.address();
  job.token = co.token;
  const std::string job_path = job.work_dir + "/job.json";
  job.save(job_path);

  ProcessGroup group(job.work_dir);
  auto spawn = [&](const std::string& role, int rank) {
    const bool victim = job.kill.role == role && job.kill.rank == rank;
    group.spawn(cat(role, " ", rank),
                {"worker", "--job", job_path, "--role", role, "--rank", std::to_string(rank)},
                victim, /*kill_when_stopped=*/victim);
  };
  // --restart: the killed rank comes back as a new process (without the kill).
  bool restarted = false;
  auto on_exit = [&](const ChildResult& c) {
    if (!job.restart_killed || restarted || c.exited ||
        c.label != cat(job.kill.role, " ", job.kill.rank))
      return;
    restarted = true;
    group.spawn(cat(c.label, " restarted"),
                {"worker", "--job", job_path, "--role", job.kill.role, "--rank",
                 std::to_string(job.kill.rank), "--restarted"});
  };
  // Elastic replicas: those that join later start once the step before
  // their join step was decided (some engine committed it).
  const EngineLayout layout = make_engine_layout(load_engine_spec(job.engine));
  auto replica_of = [&](int g) {
    const EngineGroup& grp = layout.group_of(g);
    return grp.first_replica + (g - grp.first_rank) / grp.config.tp;
  };
  std::map<int, int> joins = job.join;
  // Steps as they are decided (some engine committed them), on a terminal.
  cli::ProgressLine progress("sync", static_cast<double>(job.steps), "steps", 1, job.progress);
  auto last_look = std::chrono::steady_clock::now();
  auto on_tick = [&] {
    if (joins.empty() && !progress.active()) return;
    if (joins.empty() &&
        std::chrono::steady_clock::now() - last_look < std::chrono::milliseconds(200))
      return;
    last_look = std::chrono::steady_clock::now();
    int64_t decided = -1;
    for (int g = 0; g < engines; ++g) decided = std::max(decided, coordinator.committed_version(g));
    progress.update(static_cast<double>(std::max<int64_t>(decided, 0)));
    for (auto it = joins.begin(); it != joins.end();) {
      if (decided < it->second - 1) {
        ++it;
        continue;
      }
      for (int g = 0; g < engines; ++g)
        if (replica_of(g) == it->first) spawn("engine", g);
      it = joins.erase(it);
    }
  };
  for (int g = 0; g < engines; ++g)
    if (!job.join.count(replica_of(g))) spawn("engine", g);
  for (int t = 0; t < trainers; ++t) spawn("trainer", t);
  // Setup, every step, and the teardown each get the per-step timeout.
  const auto budget = std::chrono::milliseconds(job.timeout_ms) * (job.steps + 3);
  JobRun run;
  std::atomic<bool> stop{false};
  std::thread side_thread;
  if (side) side_thread = std::thread([&] { side(job.coordinator, job.token, stop); });
  try {
    run.children = group.wait_all(budget, std::chrono::seconds(10), on_exit, on_tick);
  } catch (...) {
    stop = true;
    if (side_thread.joinable()) side_thread.join();
    throw;
  }
  stop = true;
  if (side_thread.joinable()) side_thread.join();
  if (progress.active() && joins.empty()) {
    last_look = {};
    on_tick();  // the last report: the steps decided in all
  }
  run.timed_out = group.timed_out();
  for (int t = 0; t < trainers; ++t)
    run.trainers.push_back(read_json_or_null(job.stats_path("trainer", t)));
  for (int g = 0; g < engines; ++g)
    run.engines.push_back(read_json_or_null(job.stats_path("engine", g)));
  if (job.trace && !trace_out.empty()) {
    std::vector<std::string> files;
    for (int t = 0; t < trainers; ++t) files.push_back(job.trace_path("trainer", t));
    for (int g = 0; g < engines; ++g) files.push_back(job.trace_path("engine", g));
    merge_traces(files, trace_out);
  }
  return run;
}

nlohmann::json summarize(const JobSpec& job, const JobRun& run) {
  const EngineLayout layout = make_engine_layout(load_engine_spec(job.engine));
  auto replica_of = [&](int g) {
    const EngineGroup& grp = layout.group_of(g);
    return grp.first_replica + (g - grp.first_rank) / grp.config.tp;
  };
  nlohmann::json out = {{"trainers", run.trainers.size()}, {"engines", run.engines.size()}};
  bool ok = !run.timed_out;
  nlohmann::json children = nlohmann::json::array();
  for (const auto& c : run.children) {
    children.push_back({{"label", c.label}, {"status", c.status()}, {"log", c.log_path}});
    ok &= c.ok();
  }
  out["children"] = children;
  nlohmann::json steps = nlohmann::json::array();
  for (int64_t s = 1; s <= job.steps; ++s) {
    nlohmann::json row = {{"step", s}};
    double sync = 0, pack = 0, gather = 0, wire = 0, receive = 0, apply = 0, commit = 0;
    int64_t rank_bytes = 0, total = 0, delta_buckets = 0, delta_base = 0, buckets_lent = 0;
    nlohmann::json committed = nlohmann::json::array(), verified = nlohmann::json::array();
    nlohmann::json engine_committed = nlohmann::json::array();
    bool decided = false;  // a trainer saw the coordinator's decision
    for (const auto& t : run.trainers) {
      const auto* st = step_of(t, s);
      if (!st || !st->value("ok", false)) continue;
      if (!decided) committed = (*st)["committed"];  // the coordinator's word
      decided = true;
      sync = std::max(sync, st->value("seconds", 0.0));
      delta_buckets += st->value("delta_buckets", int64_t{0});
      buckets_lent += st->value("buckets_lent", int64_t{0});
      delta_base += st->value("delta_base_bytes", int64_t{0});
      pack = std::max(pack, phase(st, "pack"));
      gather = std::max(gather, phase(st, "gather"));
      wire = std::max(wire, phase(st, "wire"));
    }
    for (size_t g = 0; g < run.engines.size(); ++g) {
      const auto& e = run.engines[g];
      const auto* st = step_of(e, s);
      if (!st) continue;
      receive = std::max(receive, phase(st, "receive"));
      apply = std::max(apply, phase(st, "apply"));
      commit = std::max(commit, phase(st, "commit"));
      if (st->value("committed", false)) {
        engine_committed.push_back(g);
        rank_bytes = std::max<int64_t>(rank_bytes, st->value("bytes", int64_t{0}));
        total += st->value("bytes", int64_t{0});
      }
      for (const auto& c : e.value("checks", nlohmann::json::array()))
        if (c.value("version", int64_t{-2}) == s && c.value("ok", false)) verified.push_back(g);
    }
    // Without a trainer's view (all failed), what the engines report.
    if (!decided) committed = engine_committed;
    row["sync_s"] = sync;
    row["engine_rank_bytes"] = rank_bytes;
    row["engine_bytes_total"] = total;
    row["delta_buckets"] = delta_buckets;  // sent as deltas, by every trainer rank
    row["buckets_lent"] = buckets_lent;    // written into lent params, by every trainer rank
    row["delta_base_bytes"] = delta_base;  // the trainer ranks' bases, after the step
    row["engine_rank_gbps"] = sync > 0 ? static_cast<double>(rank_bytes) / sync / 1e9 : 0.0;
    row["total_gbps"] = sync > 0 ? static_cast<double>(total) / sync / 1e9 : 0.0;
    row["phases"] = {{"pack", pack},   {"gather", gather},
                     {"wire", wire},   {"receive_wait", receive},
                     {"apply", apply}, {"commit", commit}};
    row["committed"] = committed;
    row["verified"] = verified;
    if (job.elastic) {
      // The step's membership, as trainer rank 0 chose it: exactly its
      // replicas' ranks commit and verify, and there are enough of them.
      nlohmann::json replicas = nlohmann::json::array(), expected = nlohmann::json::array();
      for (const auto& t : run.trainers)
        if (const auto* st = step_of(t, s); st && st->value("ok", false)) {
          replicas = st->value("replicas", nlohmann::json::array());
          row["plan_id"] = st->value("plan_id", std::string());
          break;
        }
      for (int g = 0; g < static_cast<int>(run.engines.size()); ++g)
        for (const auto& r : replicas)
          if (r.get<int>() == replica_of(g)) expected.push_back(g);
      row["replicas"] = replicas;
      ok &= static_cast<int>(replicas.size()) >= job.min_replicas && committed == expected;
      if (job.verify) ok &= verified == expected;
    } else {
      ok &= committed.size() == run.engines.size();
      if (job.verify) ok &= verified.size() == run.engines.size();
    }
    steps.push_back(row);
  }
  out["steps"] = steps;
  nlohmann::json versions = nlohmann::json::array(), engine_ok = nlohmann::json::array();
  for (const auto& e : run.engines) {
    versions.push_back(e.is_object() ? e.value("version", int64_t{-1}) : int64_t{-1});
    engine_ok.push_back(e.is_object() && e.value("ok", false));
  }
  out["engine_versions"] = versions;
  out["engine_ok"] = engine_ok;
  if (job.elastic) {
    // Each replica that joined served: its ranks committed a step (from
    // their own start, first_commit_s; ready_s: registered and prepared).
    nlohmann::json joined = nlohmann::json::array();
    for (const auto& [replica, step] : job.join) {
      nlohmann::json j = {{"replica", replica}, {"join_step", step}};
      double first = 0, ready = 0;
      bool served = true;
      for (size_t g = 0; g < run.engines.size(); ++g) {
        if (replica_of(static_cast<int>(g)) != replica) continue;
        const auto& e = run.engines[g];
        served &= e.is_object() && e.contains("first_commit_s");
        if (!served) break;
        first = std::max(first, e["first_commit_s"].get<double>());
        ready = std::max(ready, e.value("ready_s", 0.0));
      }
      j["served"] = served;
      if (served) j["ready_s"] = ready, j["first_commit_s"] = first;
      ok &= served;
      joined.push_back(j);
    }
    out["joined"] = joined;
  }
  out["ok"] = ok;
  const nlohmann::json failures = collect_failures(run);
  if (!failures.empty()) out["failures"] = failures;
  // A run that is not ok always says why, in one line.
  if (!ok)
    out["error"] =
        failures.empty()
            ? std::string("not every engine rank committed and verified every step")
            : cat(failures[0]["who"].get<std::string>(),
                  failures[0].contains("step") ? cat(", step ", failures[0]["step"].get<int64_t>())
                                               : std::string(),
                  ": ", failures[0]["reason"].get<std::string>());
  return out;
}

void print_summary(std::ostream& out, const nlohmann::json& summary) {
  out << std::fixed;
  for (const auto& row : summary["steps"]) {
    const auto& p = row["phases"];
    out << "step " << row["step"].get<int64_t>() << ": sync " << std::setprecision(1)
        << row["sync_s"].get<double>() * 1e3 << " ms, " << std::setprecision(3)
        << row["engine_rank_gbps"].get<double>() << " GB/s per engine rank ("
        << row["engine_rank_bytes"].get<int64_t>() / 1e6 << " MB), "
        << row["total_gbps"].get<double>() << " GB/s total; committed " << row["committed"].size()
        << "/" << summary["engines"].get<size_t>() << ", verified bit-exact "
        << row["verified"].size() << "/" << summary["engines"].get<size_t>() << "\n"
        << std::setprecision(1) << "  phases (ms, slowest rank): pack "
        << p["pack"].get<double>() * 1e3 << ", gather " << p["gather"].get<double>() * 1e3
        << ", send/wire " << p["wire"].get<double>() * 1e3 << ", receive wait "
        << p["receive_wait"].get<double>() * 1e3 << ", apply " << p["apply"].get<double>() * 1e3
        << ", commit " << p["commit"].get<double>() * 1e3 << "\n";
    if (row.contains("replicas"))
      out << "  elastic: replicas " << row["replicas"].dump() << ", plan "
          << row.value("plan_id", std::string()) << "\n";
  }
  for (const auto& j : summary.value("joined", nlohmann::json::array())) {
    out << "replica " << j["replica"].get<int>() << " joined at step " << j["join_step"].get<int>()
        << ": ";
    if (j["served"].get<bool>())
      out << std::setprecision(2) << "ready " << j["ready_s"].get<double>()
          << " s after its processes started, first committed version at "
          << j["first_commit_s"].get<double>() << " s\n";
    else
      out << "never served\n";
  }
  for (const auto& c : summary["children"]) {
    if (c["status"] == "exit 0") continue;
    out << c["label"].get<std::string>() << ": " << c["status"].get<std::string>() << " (log "
        << c["log"].get<std::string>() << ")\n";
    // The end of its log says why, without opening the file.
    const std::string tail = tail_of_file(c["log"].get<std::string>(), 600);
    if (!tail.empty()) out << "  | " << tail << (tail.back() == '\n' ? "" : "\n");
  }
}

}  // namespace weightsync::demo
