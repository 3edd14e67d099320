// The coordinator's Prometheus metrics (docs/metrics.md), served over HTTP on
// their own port by prometheus-cpp. The coordinator's state calls the
// recording methods from its one thread; the exposer's threads read the
// registry (prometheus-cpp's metrics are safe for that).
#pragma once

#include <weightsync/control.h>

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <string>

namespace weightsync::control {

class Metrics {
 public:
  // Serves http://host:port/metrics (port 0: any free port). Errc::io when it
  // cannot bind; Errc::unsupported when weightsync was built without
  // prometheus-cpp.
  Metrics(const std::string& host, int port);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  uint16_t port() const;

  // Live members by role, and the engine replicas they make up.
  void membership(int trainers, int engines, int observers, int replicas);
  // A member that did not leave by itself (connection lost, heartbeat
  // timeout, ...): `reason` is that cause.
  void member_lost(Role role, int rank, const std::string& reason);
  void step_begun(const std::string& plan_id);
  // A decided step: committed when the trainers succeeded and some engine
  // committed, else aborted for `abort_reason` (a short class: trainer_failed,
  // trainer_lost, timeout, no_engine_committed).
  void step_decided(double seconds, uint64_t bytes, bool committed,
                    const std::string& abort_reason);
  // An engine rank that did not commit a step, and why (failed, lost,
  // timeout, aborted).
  void engine_step_failed(int rank, const std::string& reason);
  void engine_version(int rank, int64_t version, int64_t newest);
  // 1 while an engine rank's params hold part of a step that did not commit
  // (no staging), until its next commit.
  void engine_torn(int rank, bool torn);
  // An engine rank serves committed step `step` since `at` (seconds since
  // the epoch): its apply ended (the "applied" report).
  void engine_applied(int rank, int64_t step, double at);
  // A rank's own report of its step (RankStepStats as JSON).
  void rank_stats(Role role, int rank, const nlohmann::json& stats);

 private:
  void export_zeros();

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightsync::control
