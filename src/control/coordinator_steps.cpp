// The step protocol of CoordinatorState: begin, sent, ack, and the decision.
//
// The participants of a step are the trainers and engines live when its first
// begin_step arrives; members joining later wait for the next step. The step
// is decided as soon as the outcome is known: at once when a trainer fails or
// dies (every engine aborts), otherwise once every trainer reported sent ok
// and no engine is still pending (acked, failed, died, or timed out). A
// replica commits whole or not at all: a rank that failed aborts the step on
// every rank of its replica.
#include "coordinator_state.h"
#include "metrics.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>

namespace weightsync::control {
namespace {

using wire::Json;
using wire::Kind;

constexpr size_t kMaxRequestIdBytes = 1024;   // an engine's request id, in "applied"
constexpr size_t kMaxAppliedRequests = 4096;  // requests per "applied" report

std::string who(const Member& m) {
  return cat(role_name(m.role), " rank ", m.rank);
}

// An engine that named no replica is a replica of its own.
int replica_of(const Member& m) {
  return m.replica >= 0 ? m.replica : -1 - m.rank;
}

}  // namespace

Json CoordinatorState::step_engines_json(const OpenStep& s) const {
  Json list = Json::array();
  for (const auto& [member_id, p] : s.engines) list.push_back(wire::member_to_json(p.member));
  return list;
}

Json CoordinatorState::step_reply(const OpenStep& s) const {
  Json r{{"engines", step_engines_json(s)}, {"plan_id", s.plan_id}};
  if (s.replicas) r["replicas"] = *s.replicas;
  return r;
}

// Trainers that follow the step's leader (elastic replicas) get the open
// step's plan and membership; those waiting for another step, an error.
void CoordinatorState::answer_followers() {
  std::vector<Follower> waiting;
  waiting.swap(followers_);
  for (const Follower& f : waiting) {
    answered(f.conn);
    const OpenStep& s = *open_step_;
    const auto c = conns_.find(f.conn);
    if (c == conns_.end()) continue;
    if (f.step != s.step)
      reply_error(
          f.conn, f.request, Errc::protocol,
          cat(who(c->second.member), " follows step ", f.step, " but step ", s.step, " began"));
    else if (!s.trainers.count(c->second.member.id))
      reply_error(f.conn, f.request, Errc::protocol,
                  cat(who(c->second.member), " joined after step ", s.step, " began"));
    else
      reply(f.conn, f.request, step_reply(s));
  }
}

void CoordinatorState::begin_step(ConnId conn, const Conn& c, uint64_t id, const Json& body,
                                  Clock::time_point now) {
  StepBegin b{body.at("step").get<int64_t>(), body.at("plan_id").get<std::string>(), {}};
  const int64_t step = b.step;
  if (c.member.role != Role::trainer)
    return reply_error(conn, id, Errc::protocol,
                       cat("begin_step from ", who(c.member), ": only trainers begin steps"));
  // An empty plan id follows the step's leader (elastic replicas).
  const bool follow = b.plan_id.empty();
  try {
    b.replicas = wire::replicas_from_json(body);
  } catch (const Error& e) {
    return reply_error(conn, id, Errc::invalid_argument,
                       cat("begin_step ", step, " from ", who(c.member), ": ", e.what()));
  }
  if (follow && b.replicas)
    return reply_error(conn, id, Errc::invalid_argument,
                       cat("begin_step ", step, " from ", who(c.member),
                           ": replicas without a plan id (a follower takes the leader's)"));
  // A trainer of the open step that begins a later one gave the open step up
  // (its coordinator was lost during it, and it reached this one only for
  // the next): the open step can no longer complete, so it fails now rather
  // than at its deadline, and the later step begins.
  if (open_step_ && step > open_step_->step) {
    auto p = open_step_->trainers.find(c.member.id);
    if (p != open_step_->trainers.end()) {
      if (p->second.outcome != Outcome::failed) {
        p->second.outcome = Outcome::failed;
        p->second.reason = cat(who(c.member), " began step ", step, " while step ",
                               open_step_->step, " was open: it gave that step up");
      }
      decide();
    }
  }
  if (open_step_) return join_open_step(conn, c, id, b);
  if (last_decided_ && step <= *last_decided_)
    return reply_error(conn, id, Errc::protocol,
                       cat("begin_step ", step, ": steps must increase (step ", *last_decided_,
                           " was already decided)"));
  if (follow) {
    if (!admit(conn, id, "begin_step")) return;
    const uint64_t ms = body.contains("timeout_ms") ? wire::get_u64(body, "timeout_ms") : 0;
    followers_.push_back(Follower{{conn, id, deadline_after(now, ms)}, step});
    return;
  }
  open_new_step(conn, id, std::move(b), now);
}

// A begin_step while a step is open: the same step's plan joins it (or
// follows its leader); another step, or another plan, is refused.
void CoordinatorState::join_open_step(ConnId conn, const Conn& c, uint64_t id, const StepBegin& b) {
  OpenStep& s = *open_step_;
  const int64_t step = b.step;
  if (s.step != step)
    return reply_error(conn, id, Errc::protocol,
                       cat("begin_step ", step, " from ", who(c.member), ": step ", s.step,
                           " is still open (wait for its step_result)"));
  auto p = s.trainers.find(c.member.id);
  if (p == s.trainers.end())
    return reply_error(conn, id, Errc::protocol,
                       cat(who(c.member), " joined after step ", step, " began"));
  if (b.plan_id.empty()) return reply(conn, id, step_reply(s));
  if (b.plan_id != s.plan_id || b.replicas != s.replicas) {
    const auto list = [](const std::optional<std::vector<int>>& r) {
      return r ? cat(" for replicas ", Json(*r).dump()) : std::string();
    };
    const std::string why =
        cat(who(c.member), " began step ", step, " with plan '", b.plan_id, "'", list(b.replicas),
            " but the step uses plan '", s.plan_id, "'", list(s.replicas));
    p->second.outcome = Outcome::failed;
    p->second.reason = why;
    reply_error(conn, id, Errc::mismatch, why);
    return decide();
  }
  return reply(conn, id, step_reply(s));
}

// Opens the step with the members live now, answers the leader and its
// followers, and announces the step to engines and observers.
void CoordinatorState::open_new_step(ConnId conn, uint64_t id, StepBegin b, Clock::time_point now) {
  OpenStep s;
  s.step = b.step;
  s.plan_id = b.plan_id;
  s.replicas = b.replicas;
  s.began = now;
  s.deadline = now + options_.step_timeout + kReportGrace;  // control.h
  const auto& replicas = b.replicas;
  for (const auto& [cid, other] : conns_) {
    if (!other.registered) continue;
    if (other.member.role == Role::trainer)
      s.trainers[other.member.id] = {cid, other.member, Outcome::pending, {}};
    // Elastic replicas: only the engines of the replicas served take part.
    if (other.member.role == Role::engine &&
        (!replicas || std::binary_search(replicas->begin(), replicas->end(), other.member.replica)))
      s.engines[other.member.id] = {cid, other.member, Outcome::pending, {}};
  }
  open_step_ = std::move(s);
  if (metrics_) metrics_->step_begun(b.plan_id);
  reply(conn, id, step_reply(*open_step_));
  answer_followers();
  Json announce = wire::make(Kind::step_begin);
  announce["step"] = b.step;
  announce["plan_id"] = b.plan_id;
  if (replicas) announce["replicas"] = *replicas;
  for (ConnId e : registered_conns(Role::engine)) outbox_.send(e, announce);
  for (ConnId o : registered_conns(Role::observer)) outbox_.send(o, announce);
}

// Shared checks of sent and ack: true when the report should be recorded.
// A report for a step already decided (e.g. aborted because a trainer died)
// is acknowledged and ignored: the reporter learns the outcome from its event.
bool CoordinatorState::report_applies(ConnId conn, uint64_t id, int64_t step,
                                      const std::string& what) {
  if (open_step_ && open_step_->step == step) return true;
  if (last_decided_ && step <= *last_decided_)
    reply(conn, id, Json{{"ignored", true}});
  else
    reply_error(conn, id, Errc::protocol,
                cat(what, " for step ", step, ", but that step is not open"));
  return false;
}

void CoordinatorState::record_report(ConnId conn, const Conn& c, uint64_t id, const Json& body,
                                     Role from) {
  const int64_t step = body.at("step").get<int64_t>();
  const bool trainer = from == Role::trainer;
  const char* what = trainer ? "sent from " : "ack from ";
  if (c.member.role != from)
    return reply_error(conn, id, Errc::protocol,
                       cat(what, who(c.member), trainer ? ": trainers only" : ": engines only"));
  const bool landed = !trainer && body.value("landed", false);
  if (landed && !(open_step_ && open_step_->step == step)) note_late_landing(c.member.rank, step);
  if (!report_applies(conn, id, step, cat(what, who(c.member)))) return;
  auto& group = trainer ? open_step_->trainers : open_step_->engines;
  auto p = group.find(c.member.id);
  if (p == group.end())
    return reply_error(conn, id, Errc::protocol,
                       cat(who(c.member), " is not a participant of step ", step));
  // A rank told to abort early still says whether the step wrote its params.
  p->second.landed |= landed;
  if (p->second.outcome == Outcome::pending) {
    const bool ok = body.at("ok").get<bool>();
    p->second.outcome = ok ? Outcome::ok : Outcome::failed;
    if (!ok)
      p->second.reason =
          trainer ? cat(who(c.member), " reported failure: ", body.value("error", "(none)"))
                  : cat(who(c.member), " failed: ", body.value("error", "(no reason given)"));
    if (!trainer) p->second.bytes = wire::get_u64(body, "bytes");
    if (!trainer && !ok && body.value("stopped", false)) stop_sends_to(p->second);
    if (metrics_ && body.contains("stats"))
      metrics_->rank_stats(from, c.member.rank, body["stats"]);
  }
  // A rank that failed never commits the step: what it landed is a mix now.
  if (p->second.landed && p->second.outcome == Outcome::failed) mark_torn(c.member.rank);
  reply(conn, id);
  try_decide();
}

// A trainer could not send to an engine rank: that rank cannot complete the
// step, so it fails now with the trainer's reason and is told to stop
// receiving (its receives would otherwise wait for the step timeout). The
// other engines go on, as when an engine dies.
void CoordinatorState::record_send_failure(ConnId conn, const Conn& c, uint64_t id,
                                           const Json& body) {
  const int64_t step = body.at("step").get<int64_t>();
  const int rank = body.at("engine_rank").get<int>();
  if (c.member.role != Role::trainer)
    return reply_error(conn, id, Errc::protocol,
                       cat("send_failed from ", who(c.member), ": trainers only"));
  if (!report_applies(conn, id, step, cat("send_failed from ", who(c.member)))) return;
  auto e = std::find_if(open_step_->engines.begin(), open_step_->engines.end(),
                        [&](const auto& kv) { return kv.second.member.rank == rank; });
  if (e == open_step_->engines.end())
    return reply_error(conn, id, Errc::protocol,
                       cat("send_failed from ", who(c.member), ": engine rank ", rank,
                           " is not a participant of step ", step));
  Participant& p = e->second;
  if (p.outcome != Outcome::failed) {
    p.outcome = Outcome::failed;
    p.reason = body.at("error").get<std::string>();
  }
  if (!p.aborted && conns_.count(p.conn) > 0) {
    send_abort(p.conn, step, p.reason);
    p.aborted = true;
  }
  reply(conn, id);
  stop_sends_to(p);
  try_decide();
}

// Tells the trainers of the open step that engine rank `p` failed it, so
// that they stop sending to it (sends it will never receive would wait for
// the step timeout).
void CoordinatorState::stop_sends_to(const Participant& p) {
  Json abort = wire::make(Kind::abort);
  abort["step"] = open_step_->step;
  abort["reason"] = p.reason;
  abort["engine_rank"] = p.member.rank;
  for (const auto& [id, t] : open_step_->trainers)
    if (t.outcome == Outcome::pending && conns_.count(t.conn) > 0) outbox_.send(t.conn, abort);
}

void CoordinatorState::note_late_landing(int rank, int64_t step) {
  if (!last_decided_ || step > *last_decided_ || committed_version(rank) >= step) return;
  mark_torn(rank);
}

void CoordinatorState::mark_torn(int rank) {
  if (torn_.insert(rank).second && metrics_) metrics_->engine_torn(rank, true);
}

// The rank restores after its outcome of the step is settled (decided, or
// it was told to abort while the others go on), on the thread that takes
// its steps: no later step of it is open that this report could be
// mistaken for. While the step is open, its landing is forgotten too, so
// that the decision does not mark it torn again.
void CoordinatorState::record_restored(ConnId conn, const Conn& c, uint64_t id, const Json& body) {
  if (c.member.role != Role::engine)
    return reply_error(conn, id, Errc::protocol,
                       cat("restored from ", who(c.member), ": engines only"));
  const int64_t step = body.at("step").get<int64_t>();
  if (open_step_ && open_step_->step == step) {
    auto p = open_step_->engines.find(c.member.id);
    if (p != open_step_->engines.end()) {
      if (p->second.outcome == Outcome::pending)
        return reply_error(conn, id, Errc::protocol,
                           cat("restored from ", who(c.member), " for step ", step,
                               ", which is still open and which it has not acked"));
      p->second.landed = false;
    }
  }
  if (torn_.erase(c.member.rank) > 0 && metrics_) metrics_->engine_torn(c.member.rank, false);
  reply(conn, id);
}

// The engine rank reports after its apply ends: from then on it serves
// "step", which must be a step it committed. "requests" maps each request
// running at the swap (the engine's own id) to the index of its first token
// made by "step"; the rank's last report is kept, whole, for status().
void CoordinatorState::record_applied(ConnId conn, const Conn& c, uint64_t id, const Json& body) {
  if (c.member.role != Role::engine)
    return reply_error(conn, id, Errc::protocol,
                       cat("applied from ", who(c.member), ": engines only"));
  const int64_t step = body.at("step").get<int64_t>();
  const int64_t committed = committed_version(c.member.rank);
  if (step < 0 || step > committed)
    return reply_error(
        conn, id, Errc::protocol,
        cat("applied from ", who(c.member), ": step ", step,
            " is not a step it committed (its committed version is ", committed, ")"));
  const Json& requests = body.at("requests");
  if (requests.size() > kMaxAppliedRequests)
    return reply_error(
        conn, id, Errc::invalid_argument,
        cat("applied from ", who(c.member), " for step ", step, ": ", requests.size(),
            " requests, above the limit of ", kMaxAppliedRequests, " per report"));
  for (const auto& [name, index] : requests.items())
    if (name.empty() || name.size() > kMaxRequestIdBytes || !index.is_number_integer() ||
        index.get<int64_t>() < 0)
      return reply_error(
          conn, id, Errc::protocol,
          cat("applied from ", who(c.member), " for step ", step, ": request '", name.substr(0, 64),
              "' must map to a token index >= 0 (request ids of ", "1 to ", kMaxRequestIdBytes,
              " bytes)"));
  const double at =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  applied_[c.member.rank] = Json{{"step", step}, {"at", at}, {"requests", requests}};
  if (metrics_) metrics_->engine_applied(c.member.rank, step, at);
  reply(conn, id);
}

void CoordinatorState::participant_lost(uint64_t member_id, const std::string& reason) {
  if (!open_step_) return;
  if (auto t = open_step_->trainers.find(member_id); t != open_step_->trainers.end()) {
    t->second.outcome = Outcome::failed;
    t->second.reason = reason;
  }
  // An engine that acked ok and then vanished cannot receive its commit, so
  // it counts as failed as well.
  if (auto e = open_step_->engines.find(member_id); e != open_step_->engines.end()) {
    e->second.outcome = Outcome::failed;
    e->second.reason = reason;
  }
  try_decide();
}

void CoordinatorState::try_decide() {
  if (!open_step_) return;
  bool trainers_done = true;
  for (const auto& [id, p] : open_step_->trainers) {
    if (p.outcome == Outcome::failed) return decide();
    trainers_done &= p.outcome == Outcome::ok;
  }
  if (!trainers_done) return;
  for (const auto& [id, p] : open_step_->engines)
    if (p.outcome == Outcome::pending) return;
  decide();
}

// Why the trainers failed the step, or empty when every one sent ok. The
// reason names the trainer that failed (a step is decided as soon as one
// fails), not one that was still sending when that happened.
std::string CoordinatorState::trainer_failure_of(const OpenStep& s) const {
  if (!s.failure.empty()) return s.failure;
  std::string failure, pending;
  for (const auto& [id, p] : s.trainers) {
    if (p.outcome == Outcome::failed && failure.empty())
      failure = p.reason.empty() ? cat(who(p.member), " failed") : p.reason;
    if (p.outcome == Outcome::pending && pending.empty())
      pending = cat(who(p.member), " did not finish");
  }
  return failure.empty() ? pending : failure;
}

// A replica commits whole or not at all: its ranks serve one model
// together, so one rank that failed (or died, or did not ack) aborts the
// step on every rank of its replica, which keep their previous version.
// Returns the first failure of each replica that has one.
std::map<int, std::string> CoordinatorState::replica_failures(
    const std::vector<const Participant*>& engines) const {
  std::map<int, std::string> replica_failure;
  for (const Participant* p : engines) {
    if (p->outcome == Outcome::ok && conns_.count(p->conn) > 0) continue;
    std::string& why = replica_failure[replica_of(p->member)];
    if (why.empty())
      why = p->outcome == Outcome::pending ? cat(who(p->member), " did not ack")
            : p->reason.empty()            ? cat(who(p->member), " failed")
                                           : p->reason;
  }
  return replica_failure;
}

void CoordinatorState::send_abort(ConnId conn, int64_t step, const std::string& reason) {
  Json abort = wire::make(Kind::abort);
  abort["step"] = step;
  abort["reason"] = reason;
  outbox_.send(conn, abort);
}

void CoordinatorState::decide() {
  const OpenStep s = std::move(*open_step_);
  open_step_.reset();
  last_decided_ = s.step;
  const std::string trainer_failure = trainer_failure_of(s);
  const bool trainers_ok = trainer_failure.empty();

  std::vector<const Participant*> engines;
  for (const auto& [id, p] : s.engines) engines.push_back(&p);
  std::sort(engines.begin(), engines.end(),
            [](auto* a, auto* b) { return a->member.rank < b->member.rank; });
  const std::map<int, std::string> replica_failure = replica_failures(engines);
  Json committed = Json::array(), failed = Json::array();
  for (const Participant* p : engines) {
    const bool alive = conns_.count(p->conn) > 0;
    const auto replica_failed = replica_failure.find(replica_of(p->member));
    if (trainers_ok && p->outcome == Outcome::ok && alive &&
        replica_failed != replica_failure.end()) {
      // Acked ok, but another rank of its replica did not.
      const std::string reason =
          cat("replica ", p->member.replica, " aborts whole: ", replica_failed->second);
      send_abort(p->conn, s.step, reason);
      if (p->landed) mark_torn(p->member.rank);
      failed.push_back(Json{{"rank", p->member.rank}, {"reason", reason}});
      continue;
    }
    if (trainers_ok && p->outcome == Outcome::ok && alive) {
      Json commit = wire::make(Kind::commit);
      commit["step"] = s.step;
      outbox_.send(p->conn, commit);
      versions_[p->member.rank] = s.step;
      torn_.erase(p->member.rank);
      committed.push_back(p->member.rank);
      continue;
    }
    std::string reason = !trainers_ok                     ? cat("step aborted: ", trainer_failure)
                         : p->outcome == Outcome::pending ? cat(who(p->member), " did not ack")
                                                          : p->reason;
    if (alive && !p->aborted) send_abort(p->conn, s.step, reason);
    if (p->landed) mark_torn(p->member.rank);
    failed.push_back(Json{{"rank", p->member.rank}, {"reason", reason}});
  }
  Json result = wire::make(Kind::step_result);
  result["step"] = s.step;
  result["trainers_ok"] = trainers_ok;
  result["committed"] = committed;
  result["failed"] = failed;
  if (!trainers_ok) result["reason"] = trainer_failure;
  for (ConnId t : registered_conns(Role::trainer)) outbox_.send(t, result);
  for (ConnId o : registered_conns(Role::observer)) outbox_.send(o, result);
  record_decision(s, result, trainers_ok);
}

}  // namespace weightsync::control
