#include "demo_chaos_check.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <sstream>
#include <thread>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace weightsync::demo::chaos {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// GET /metrics over HTTP/1.0 ("" when nobody answers).
std::string http_get_metrics(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return "";
  timeval tv{2, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[8192];
      for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;)
        out.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  const auto body = out.find("\r\n\r\n");
  return body == std::string::npos ? "" : out.substr(body + 4);
}

std::unique_ptr<control::Client> observer(const std::string& address, const std::string& token) {
  control::ClientOptions c;
  c.address = address;
  c.token = token;
  c.role = control::Role::observer;
  c.connect_timeout = Millis(5000);
  return std::make_unique<control::Client>(c);
}

const nlohmann::json* line_of(const std::vector<nlohmann::json>& lines, int step) {
  for (const auto& l : lines)
    if (l.value("step", -1) == step) return &l;
  return nullptr;
}

}  // namespace

double Scrape::sum(const std::string& name, const std::vector<std::string>& labels) const {
  double total = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size()) continue;
    if (line[name.size()] != '{' && line[name.size()] != ' ') continue;
    bool all = true;
    for (const auto& l : labels) all &= line.find(l) != std::string::npos;
    if (all) total += std::atof(line.substr(line.rfind(' ') + 1).c_str());
  }
  return total;
}

Checker::Checker(const JobSpec& job, int trainers, int engines)
    : job_(job), trainers_(trainers), engines_(engines), engine_seen_(engines, 0) {}

Scrape Checker::scrape(int metrics_port) const {
  if (metrics_port <= 0) return {};
  Scrape s;
  s.text = http_get_metrics(metrics_port);
  s.ok = !s.text.empty();
  return s;
}

const std::vector<nlohmann::json>& Checker::lines(const std::string& role, int rank) {
  const std::string path = report_path(job_.chaos_dir, role, rank);
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  auto& cached = lines_[{role, rank}];
  if (!ec && size != sizes_[{role, rank}]) {
    sizes_[{role, rank}] = size;
    cached = read_lines(path);
  }
  return cached;
}

bool Checker::trainer_reported(int rank, int step) {
  return line_of(lines("trainer", rank), step) != nullptr;
}
bool Checker::engine_reported(int rank, int step) {
  return line_of(lines("engine", rank), step) != nullptr;
}
bool Checker::any_trainer_ok(int step) {
  for (int r = 0; r < trainers_; ++r)
    if (const auto* l = line_of(lines("trainer", r), step); l && l->value("ok", false)) return true;
  return false;
}

void Checker::violation(int step, const std::string& who, const std::string& invariant,
                        const std::string& detail) {
  violations_.push_back(
      {{"step", step}, {"who", who}, {"invariant", invariant}, {"detail", detail}});
}

void Checker::check_engine_line(int rank, const nlohmann::json& line) {
  const int step = line.value("step", line.value("version", -1));
  const std::string who = cat("engine rank ", rank);
  const bool torn = line.value("torn", false);
  if (torn && job_.staging)
    violation(step, who, "no rank ever serves a mix", "torn with staging on");
  if (!line.contains("check")) return;  // torn: says so, holds part of a step
  ++checks_;
  const auto& c = line["check"];
  const int64_t bad = c.value("bad_bytes", int64_t{0});
  bytes_lost_ += bad;
  if (bad == 0) return;
  const bool committed = line.value("committed", false);
  violation(step, who,
            committed ? "every rank that reports version k holds k bit for bit"
                      : "no rank ever serves a mix",
            cat("reports version ", line.value("version", int64_t{-1}), " (not torn) but ", bad,
                " bytes differ from it (first: ", c.value("first_bad_param", std::string()), ")"));
}

void Checker::step_done(const Fault& f, double seconds, int64_t bound_ms, double go_at) {
  const int s = f.step;
  ++faults_[fault_name(f.kind)];
  nlohmann::json row = {{"step", s}, {"fault", fault_name(f.kind)}, {"seconds", seconds}};
  if (f.kind != FaultKind::none) row["what"] = f.describe();
  nlohmann::json committed = nlohmann::json::array(), failed = nlohmann::json::array();
  nlohmann::json unreported = nlohmann::json::array();  // no outcome of this step (not in it)
  for (int g = 0; g < engines_; ++g) {
    const auto& ls = lines("engine", g);
    for (; engine_seen_[static_cast<size_t>(g)] < ls.size(); ++engine_seen_[static_cast<size_t>(g)])
      check_engine_line(g, ls[engine_seen_[static_cast<size_t>(g)]]);
    if (const auto* l = line_of(ls, s)) {
      if (l->value("committed", false))
        committed.push_back(g);
      else
        failed.push_back({{"who", cat("engine rank ", g)}, {"reason", l->value("reason", "")}});
    } else {
      unreported.push_back(g);
    }
  }
  for (int r = 0; r < trainers_; ++r)
    if (const auto* l = line_of(lines("trainer", r), s); l && !l->value("ok", false))
      failed.push_back({{"who", cat("trainer rank ", r)}, {"reason", l->value("error", "")}});
  row["committed"] = committed;
  row["failed"] = failed;
  row["unreported"] = unreported;
  if (committed.empty()) {
    ++aborts_;
  } else {
    ++commits_;
    last_committed_ = s;
  }
  bound_s_ = static_cast<double>(bound_ms) / 1000;
  if (seconds > longest_s_) longest_s_ = seconds, longest_step_ = s;
  ++checks_;
  if (seconds * 1000 > static_cast<double>(bound_ms)) {
    // When each trainer rank began and ended it, from the release.
    std::string when;
    for (int r = 0; r < trainers_; ++r)
      if (const auto* l = line_of(lines("trainer", r), s))
        when += cat("; trainer rank ", r, " began ", l->value("began_at", go_at) - go_at,
                    " s after the release, ended at ", l->value("ended_at", go_at) - go_at, " s");
    violation(s, "job", "no step outlives its bound",
              cat("the step took ", seconds, " s (bound ", bound_s_, " s)", when));
  }
  steps_.push_back(row);
}

void Checker::check_coordinator(const Fault& f, const std::string& address,
                                const std::string& token, int metrics_port, const Scrape& before) {
  const int s = f.step;
  const auto& row = steps_.back();
  const bool kill = f.kind == FaultKind::kill_trainer || f.kind == FaultKind::kill_engine;
  if (row["failed"].empty() && !kill) return;
  std::vector<std::string> missing;
  const auto deadline = Clock::now() + Millis(3000);
  for (;;) {
    missing.clear();
    nlohmann::json status;
    try {
      status = nlohmann::json::parse(observer(address, token)->status_json());
    } catch (const std::exception& e) {
      missing.push_back(cat("status: ", e.what()));
    }
    const nlohmann::json* srow = nullptr;
    if (status.is_object())
      for (const auto& r : status["steps"])
        if (r.value("step", -1) == s) srow = &r;
    const bool aborted = srow && !srow->value("reason", std::string()).empty();
    for (const auto& fl : row["failed"]) {
      const std::string who = fl["who"];
      bool listed = aborted;
      if (srow && who.rfind("engine rank ", 0) == 0)
        for (const auto& e : (*srow)["failed"])
          listed |= cat("engine rank ", e.value("rank", -1)) == who &&
                    !e.value("reason", std::string()).empty();
      if (srow && who.rfind("trainer", 0) == 0) listed |= !(*srow)["failed"].empty();
      if (!listed) missing.push_back(cat(who, "'s failure in status"));
    }
    const Scrape after = scrape(metrics_port);
    if (after.ok && before.ok) {
      metrics_checked_ = true;
      const auto failures = [](const Scrape& m) {
        return m.sum("weightsync_engine_step_failures_total") +
               m.sum("weightsync_steps_aborted_total");
      };
      if (!row["failed"].empty() && failures(after) <= failures(before))
        missing.push_back("the step's failures in the metrics");
      if (kill) {
        const std::vector<std::string> labels{cat("role=\"", f.role, "\""),
                                              cat("rank=\"", f.rank, "\""), "reason=\""};
        if (after.sum("weightsync_member_failures_total", labels) <=
            before.sum("weightsync_member_failures_total", labels))
          missing.push_back(cat("the killed ", f.role, " rank ", f.rank,
                                " in weightsync_member_failures_total with its reason"));
      }
    } else {
      metrics_missing_ = true;
    }
    if (missing.empty() || Clock::now() > deadline) break;
    std::this_thread::sleep_for(Millis(100));
  }
  ++checks_;
  for (const auto& m : missing)
    violation(s, "coordinator", "every failure appears in status and the metrics with its reason",
              cat("missing: ", m));
}

void Checker::wait_members(const std::string& address, const std::string& token, Millis timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    try {
      const auto status = nlohmann::json::parse(observer(address, token)->status_json());
      int t = 0, e = 0;
      for (const auto& m : status["members"]) {
        t += m["role"] == "trainer";
        e += m["role"] == "engine";
      }
      if (t >= trainers_ && e >= engines_) return;
    } catch (const Error&) {
    }
    std::this_thread::sleep_for(Millis(50));
  }
  violation(-1, "coordinator", "every rank registers again", "not every rank registered in time");
}

void Checker::check_final(int rank, pid_t pid, bool still_running) {
  const std::string who = cat("engine rank ", rank);
  const auto& ls = lines("engine", rank);
  for (; engine_seen_[static_cast<size_t>(rank)] < ls.size();
       ++engine_seen_[static_cast<size_t>(rank)])
    if (!ls[engine_seen_[static_cast<size_t>(rank)]].contains("final"))
      check_engine_line(rank, ls[engine_seen_[static_cast<size_t>(rank)]]);
  const nlohmann::json* fin = nullptr;
  for (const auto& l : ls)
    if (l.contains("final") && l.value("pid", -1) == pid) fin = &l;
  const char* inv = "at the end every live rank holds the last committed version";
  if (!fin) {
    violation(job_.steps, who, inv,
              still_running ? "its process did not stop when told"
                            : "its process ended without a final report");
    return;
  }
  check_engine_line(rank, *fin);
  if (fin->value("version", int64_t{-1}) != last_committed_ || fin->value("torn", false))
    violation(job_.steps, who, inv,
              cat("holds version ", fin->value("version", int64_t{-1}),
                  fin->value("torn", false) ? " (torn)" : "", ", the last committed is ",
                  last_committed_));
}

void Checker::print_step(std::ostream& out, const Fault& f) const {
  const auto& row = steps_.back();
  out << "step " << f.step << " [" << fault_name(f.kind) << "]: " << std::fixed
      << std::setprecision(2) << row["seconds"].get<double>() << " s, committed "
      << row["committed"].size() << "/" << engines_;
  for (const auto& fl : row["failed"])
    out << "; " << fl["who"].get<std::string>() << ": " << fl["reason"].get<std::string>();
  out << "\n" << std::flush;
}

nlohmann::json Checker::summary(uint64_t seed, double seconds) const {
  nlohmann::json faults = nlohmann::json::object();
  for (int k = 0; k < kFaultKinds; ++k) {
    const char* name = fault_name(static_cast<FaultKind>(k));
    const auto it = faults_.find(name);
    faults[name] = it == faults_.end() ? 0 : it->second;
  }
  nlohmann::json table = {{"seed", seed},
                          {"steps", steps_.size()},
                          {"faults", faults},
                          {"commits", commits_},
                          {"aborts", aborts_},
                          {"longest_step_s", longest_s_},
                          {"longest_step", longest_step_},
                          {"bound_s", bound_s_},
                          {"bytes_lost", bytes_lost_},
                          {"last_committed", last_committed_},
                          {"invariant_checks", checks_},
                          {"violations", violations_.size()},
                          {"metrics", metrics_checked_ && !metrics_missing_ ? "checked"
                                      : metrics_checked_ ? "checked (some scrapes failed)"
                                                         : "unavailable"},
                          {"netns", netns_note()},
                          {"seconds", seconds}};
  return {{"ok", violations_.empty()},
          {"table", table},
          {"steps", steps_},
          {"violations", violations_}};
}

void print_table(std::ostream& out, const nlohmann::json& summary) {
  const auto& t = summary["table"];
  std::string faults;
  for (const auto& [k, v] : t["faults"].items())
    faults += cat(faults.empty() ? "" : ", ", k, " ", v.get<int>());
  auto row = [&](const std::string& k, const std::string& v) {
    out << "  " << std::left << std::setw(18) << k << v << "\n";
  };
  out << std::fixed << std::setprecision(2) << "chaos soak, seed " << t["seed"].get<uint64_t>()
      << ":\n";
  row("steps", std::to_string(t["steps"].get<int>()));
  row("faults by kind", faults);
  row("link cuts (netns)", t["netns"].get<std::string>());
  row("commits", std::to_string(t["commits"].get<int>()));
  row("aborts", std::to_string(t["aborts"].get<int>()));
  std::ostringstream longest;
  longest << std::fixed << std::setprecision(2) << t["longest_step_s"].get<double>() << " s (step "
          << t["longest_step"].get<int>() << "; bound " << t["bound_s"].get<double>() << " s)";
  row("longest step", longest.str());
  row("bytes lost", std::to_string(t["bytes_lost"].get<int64_t>()));
  row("last committed", std::to_string(t["last_committed"].get<int>()));
  row("metrics", t["metrics"].get<std::string>());
  row("invariant checks", std::to_string(t["invariant_checks"].get<int64_t>()));
  row("violations", std::to_string(t["violations"].get<size_t>()));
  std::ostringstream wall;
  wall << std::fixed << std::setprecision(1) << t["seconds"].get<double>() << " s";
  row("wall time", wall.str());
  for (const auto& v : summary["violations"])
    out << "VIOLATION step " << v["step"].get<int>() << ", " << v["who"].get<std::string>() << ": "
        << v["invariant"].get<std::string>() << ": " << v["detail"].get<std::string>() << "\n";
}

std::string netns_note() {
  if (::geteuid() != 0) return "unavailable: not root";
  if (std::system("ip netns list >/dev/null 2>&1") != 0) return "unavailable: no `ip netns`";
  return "not injected: root and `ip netns` are here, but the soak does not cut links yet "
         "(tests/netns/netns_faults.py does)";
}

}  // namespace weightsync::demo::chaos
