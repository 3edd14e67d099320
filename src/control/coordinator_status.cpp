// What the coordinator tells about itself: the status request's answer
// (`weightsync status`) and the metrics of steps, membership and versions.
#include "coordinator_state.h"
#include "metrics.h"

#include <algorithm>
#include <set>

namespace weightsync::control {
namespace {

using wire::Json;

constexpr size_t kRecentSteps = 16;  // decided steps kept for status()

bool has(const std::string& text, const char* part) {
  return text.find(part) != std::string::npos;
}

// A failure's class, for metric labels (the full reason stays in the step
// result and the status).
std::string trainer_failure_class(const std::string& reason) {
  if (has(reason, "reported failure")) return "trainer_failed";
  if (has(reason, "within the step timeout") || has(reason, "did not finish")) return "timeout";
  return "trainer_lost";
}

std::string engine_failure_class(const std::string& reason) {
  if (reason.rfind("step aborted", 0) == 0) return "aborted";
  if (has(reason, "within the step timeout") || has(reason, "did not ack")) return "timeout";
  if (has(reason, " failed: ")) return "failed";
  return "lost";
}

}  // namespace

void CoordinatorState::record_membership() {
  if (!metrics_) return;
  int trainers = 0, engines = 0, observers = 0;
  std::set<int> replicas;
  for (const auto& [id, c] : conns_) {
    if (!c.registered) continue;
    switch (c.member.role) {
      case Role::trainer:
        ++trainers;
        break;
      case Role::engine:
        ++engines;
        replicas.insert(c.member.replica);
        break;
      case Role::observer:
        ++observers;
        break;
    }
  }
  metrics_->membership(trainers, engines, observers, static_cast<int>(replicas.size()));
}

void CoordinatorState::record_decision(const OpenStep& s, const Json& result, bool trainers_ok) {
  const double seconds = std::chrono::duration<double>(Clock::now() - s.began).count();
  uint64_t bytes = 0;
  for (const auto& [id, p] : s.engines)
    if (p.outcome == Outcome::ok) bytes += p.bytes;
  Json row = {{"step", s.step},
              {"plan_id", s.plan_id},
              {"seconds", seconds},
              {"bytes", bytes},
              {"trainers_ok", trainers_ok},
              {"committed", result["committed"]},
              {"failed", result["failed"]}};
  if (result.contains("reason")) row["reason"] = result["reason"];
  recent_steps_.push_back(std::move(row));
  if (recent_steps_.size() > kRecentSteps) recent_steps_.pop_front();
  if (!metrics_) return;
  const bool committed = trainers_ok && !result["committed"].empty();
  metrics_->step_decided(seconds, bytes, committed,
                         !trainers_ok ? trainer_failure_class(result.value("reason", ""))
                         : committed  ? ""
                                      : "no_engine_committed");
  for (const auto& f : result["failed"])
    metrics_->engine_step_failed(f["rank"].get<int>(),
                                 engine_failure_class(f["reason"].get<std::string>()));
  int64_t newest = -1;
  for (const auto& [rank, v] : versions_) newest = std::max(newest, v);
  for (const auto& [rank, v] : versions_) metrics_->engine_version(rank, v, newest);
  for (const auto& [id, p] : s.engines)
    metrics_->engine_torn(p.member.rank, torn_.count(p.member.rank) > 0);
}

Json CoordinatorState::status() const {
  Json members = Json::array();
  int64_t newest = -1;
  for (const auto& [rank, v] : versions_) newest = std::max(newest, v);
  for (const Member& m : this->members()) {
    Json j = {{"id", m.id},
              {"role", std::string(role_name(m.role))},
              {"rank", m.rank},
              {"world", m.world},
              {"replica", m.replica}};
    if (m.role == Role::engine) {
      const int64_t v = committed_version(m.rank);
      j["version"] = v;
      j["lag"] = newest < 0 ? 0 : newest - v;
      // Its params hold part of a step that did not commit (no staging).
      j["torn"] = torn_.count(m.rank) > 0;
      // What its FP8 parity check at connect found ("" when not checked).
      j["parity"] = m.parity;
      // What it serves since when (its last apply), null before its first
      // report (engines that take each version at commit do not report).
      auto a = applied_.find(m.rank);
      j["applied"] = a == applied_.end() ? Json(nullptr) : a->second;
    }
    members.push_back(std::move(j));
  }
  Json steps = Json::array();
  for (const Json& row : recent_steps_) steps.push_back(row);
  Json out = {{"members", members},
              {"newest", newest},
              {"expect_trainers", options_.expect_trainers},
              {"expect_engines", options_.expect_engines},
              {"steps", steps},
              {"open_step", nullptr}};
  if (open_step_) {
    int sent = 0, acked = 0;
    for (const auto& [id, p] : open_step_->trainers) sent += p.outcome != Outcome::pending;
    for (const auto& [id, p] : open_step_->engines) acked += p.outcome != Outcome::pending;
    out["open_step"] = {
        {"step", open_step_->step},
        {"plan_id", open_step_->plan_id},
        {"seconds", std::chrono::duration<double>(Clock::now() - open_step_->began).count()},
        {"trainers", open_step_->trainers.size()},
        {"trainers_reported", sent},
        {"engines", open_step_->engines.size()},
        {"engines_acked", acked}};
  }
  return out;
}

}  // namespace weightsync::control
