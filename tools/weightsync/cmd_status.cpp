// `weightsync status`: a running job as its coordinator sees it (membership,
// each engine rank's committed version and lag, the last steps with their
// times and failures), once or refreshed (--watch), as a table or one JSON
// object (--json).
#include "cli.h"
#include "json_stdout.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>
#include <vector>

namespace weightsync::cli {
namespace {

constexpr const char* kUsage =
    "usage: weightsync status --coordinator HOST:PORT [--token-file F] [--json]\n"
    "                         [--watch [--interval S] [--count N]]\n\n"
    "Membership, each engine rank's committed version and how far it lags the\n"
    "newest, the open step, and the last decided steps with their times and\n"
    "failures, as the coordinator sees them (it connects as an observer).\n\n"
    "  --json         one JSON object on stdout (with --watch: one per line, each\n"
    "                 as its refresh comes)\n"
    "  --watch        refresh every --interval seconds (default 1) until\n"
    "                 interrupted, or --count times\n";

std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

std::string ranks(const nlohmann::json& list) {
  std::string out;
  for (const auto& r : list) out += (out.empty() ? "" : ",") + std::to_string(r.get<int>());
  return out.empty() ? "-" : out;
}

// The person's view of one status object.
std::string table(const std::string& address, const nlohmann::json& s) {
  std::ostringstream out;
  int trainers = 0, engines = 0, observers = 0;
  for (const auto& m : s["members"]) {
    const std::string role = m["role"];
    trainers += role == "trainer";
    engines += role == "engine";
    observers += role == "observer";
  }
  out << "coordinator " << address << ": " << trainers << " trainers, " << engines
      << " engine ranks, " << observers << " observers; newest committed version "
      << s["newest"].get<int64_t>() << "\n";
  if (engines > 0) {
    out << "\n  engine rank  replica  version  lag\n";
    for (const auto& m : s["members"]) {
      if (m["role"] != "engine") continue;
      char line[96];
      // A torn rank's params hold part of a step that did not commit.
      std::snprintf(line, sizeof line, "  %11d  %7d  %7lld  %3lld%s\n", m["rank"].get<int>(),
                    m["replica"].get<int>(), static_cast<long long>(m["version"].get<int64_t>()),
                    static_cast<long long>(m["lag"].get<int64_t>()),
                    m.value("torn", false) ? "  torn" : "");
      out << line;
    }
    // Each engine rank's FP8 parity line (docs/fp8.md), once per distinct line.
    std::map<std::string, std::vector<int>> parity;
    for (const auto& m : s["members"])
      if (m["role"] == "engine" && !m.value("parity", std::string()).empty())
        parity[m["parity"].get<std::string>()].push_back(m["rank"].get<int>());
    for (const auto& [line, ranks] : parity) {
      out << "  parity (engine rank" << (ranks.size() > 1 ? "s " : " ");
      for (size_t i = 0; i < ranks.size(); ++i) out << (i ? "," : "") << ranks[i];
      out << "): " << line << "\n";
    }
  }
  if (!s["open_step"].is_null()) {
    const auto& o = s["open_step"];
    out << "\nopen step " << o["step"].get<int64_t>() << " (plan "
        << o["plan_id"].get<std::string>() << "): " << fmt("%.2f", o["seconds"].get<double>())
        << " s, trainers reported " << o["trainers_reported"].get<int>() << "/"
        << o["trainers"].get<int>() << ", engines acked " << o["engines_acked"].get<int>() << "/"
        << o["engines"].get<int>() << "\n";
  }
  out << "\n  step  seconds        MB  committed        failed\n";
  for (const auto& row : s["steps"]) {
    char line[160];
    std::snprintf(line, sizeof line, "  %4lld  %7.3f  %8.1f  %-15s  %s\n",
                  static_cast<long long>(row["step"].get<int64_t>()), row["seconds"].get<double>(),
                  row["bytes"].get<double>() / 1e6, ranks(row["committed"]).c_str(),
                  row["failed"].empty() ? "-" : std::to_string(row["failed"].size()).c_str());
    out << line;
    if (row.contains("reason"))
      out << "        aborted: " << row["reason"].get<std::string>() << "\n";
    for (const auto& f : row["failed"])
      out << "        engine rank " << f["rank"].get<int>() << ": "
          << f["reason"].get<std::string>() << "\n";
  }
  if (s["steps"].empty()) out << "  (no step decided yet)\n";
  return out.str();
}

int run_status(const std::vector<std::string>& argv) {
  const Args args(argv, {"json", "watch"}, {"coordinator", "token-file", "interval", "count"});
  control::ClientOptions c;
  c.address = args.require("coordinator");
  if (auto f = args.get("token-file")) {
    std::ifstream in(*f, std::ios::binary);
    if (!in) fail(Errc::io, "cannot read the token file ", *f);
    std::getline(in, c.token);
  }
  c.role = control::Role::observer;
  c.connect_timeout = control::Millis(5000);
  const double interval = args.get_double("interval", 1.0);
  if (interval <= 0) fail(Errc::invalid_argument, "--interval must be positive");
  const int64_t count = args.get_int("count", args.flag("watch") ? 0 : 1);
  control::Client client(c);
  const bool tty = ::isatty(STDOUT_FILENO) && !args.flag("json");
  for (int64_t i = 0; count == 0 || i < count; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::duration<double>(interval));
    const auto s = nlohmann::json::parse(client.status_json());
    if (args.flag("json")) {
      // Each refresh as it comes: JSON lines with --watch.
      emit_json_line(s.dump());
      continue;
    }
    // On a terminal each refresh replaces the last; elsewhere they follow
    // each other, one blank line apart.
    if (tty && args.flag("watch")) std::cout << "\033[H\033[2J";
    if (i > 0 && !tty) std::cout << "\n";
    std::cout << table(c.address, s) << std::flush;
  }
  return 0;
}

const CommandRegistrar registrar{{"status",
                                  "membership, engine versions and the last steps of a running job",
                                  kUsage, run_status}};

}  // namespace
}  // namespace weightsync::cli
