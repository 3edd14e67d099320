// The chaos soak's invariants, checked after every step from the ranks' own
// reports (demo_chaos.h), the coordinator's status and its metrics; and the
// soak's table.
#pragma once

#include "demo_chaos.h"

#include <nlohmann/json.hpp>

#include <chrono>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include <sys/types.h>

namespace weightsync::demo::chaos {

// One scrape of the coordinator's Prometheus metrics (ok: it answered).
struct Scrape {
  bool ok = false;
  std::string text;
  // The sum of every series of `name` whose line holds each of `labels`.
  double sum(const std::string& name, const std::vector<std::string>& labels = {}) const;
};

class Checker {
 public:
  Checker(const JobSpec& job, int trainers, int engines);

  Scrape scrape(int metrics_port) const;
  bool trainer_reported(int rank, int step);
  bool engine_reported(int rank, int step);
  bool any_trainer_ok(int step);

  // After step f.step: the ranks' reports (bit-exact, no mix, torn only
  // without staging) and its time against `bound_ms`.
  // `go_at`: when it was released (unix_seconds).
  void step_done(const Fault& f, double seconds, int64_t bound_ms, double go_at);
  // Every failure of the step is in the coordinator's status, with its
  // reason, and counted in its metrics (since `before`), with its reason.
  void check_coordinator(const Fault& f, const std::string& address, const std::string& token,
                         int metrics_port, const Scrape& before);
  // Waits until every trainer and engine rank is registered.
  void wait_members(const std::string& address, const std::string& token,
                    std::chrono::milliseconds timeout);
  // After the stop: engine rank `rank`'s process `pid` holds the last
  // committed version, bit for bit, and is not torn.
  void check_final(int rank, pid_t pid, bool still_running);
  void violation(int step, const std::string& who, const std::string& invariant,
                 const std::string& detail);
  void print_step(std::ostream& out, const Fault& f) const;
  nlohmann::json summary(uint64_t seed, double seconds) const;

 private:
  const std::vector<nlohmann::json>& lines(const std::string& role, int rank);
  void check_engine_line(int rank, const nlohmann::json& line);

  const JobSpec& job_;
  int trainers_, engines_;
  std::map<std::pair<std::string, int>, std::vector<nlohmann::json>> lines_;
  std::map<std::pair<std::string, int>, uintmax_t> sizes_;
  std::vector<size_t> engine_seen_;  // engine lines checked so far
  nlohmann::json steps_ = nlohmann::json::array(), violations_ = nlohmann::json::array();
  std::map<std::string, int> faults_;
  int commits_ = 0, aborts_ = 0, longest_step_ = 0, last_committed_ = -1;
  int64_t checks_ = 0, bytes_lost_ = 0;
  double longest_s_ = 0, bound_s_ = 0;
  bool metrics_checked_ = false, metrics_missing_ = false;
};

// Whether this soak can cut links in network namespaces, and why not.
std::string netns_note();

}  // namespace weightsync::demo::chaos
