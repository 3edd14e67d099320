// The coordinator's bookkeeping, apart from any socket: connections, members,
// the key/value store, waiters (kv_get, barrier, wait_members), and the step
// protocol. It runs on one thread (the coordinator's io_context); the I/O
// layer feeds it validated messages and deadlines and carries out the sends
// and closes it asks for through Outbox.
#pragma once

#include "protocol.h"

#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace weightsync::control {

using Clock = std::chrono::steady_clock;

// Caps a client-supplied wait so that now + wait cannot overflow.
Clock::time_point deadline_after(Clock::time_point now, uint64_t timeout_ms);
using ConnId = uint64_t;

class Outbox {
 public:
  virtual ~Outbox() = default;
  virtual void send(ConnId conn, const wire::Json& message) = 0;
  // Closes `conn` once what is queued for it is written; with `code`, after
  // a final error frame carrying `message`. The state has already forgotten
  // the connection when it calls this.
  virtual void close(ConnId conn, std::optional<Errc> code, const std::string& message) = 0;
};

class Metrics;

class CoordinatorState {
 public:
  CoordinatorState(const CoordinatorOptions& options, Outbox& outbox);
  // Where steps, membership and versions are recorded too (not owned; may
  // be null: no metrics).
  void set_metrics(Metrics* metrics) { metrics_ = metrics; }

  void on_connect(ConnId conn, Clock::time_point now);
  // Handles one validated message. Throws Error for a violation that must
  // close the connection (the caller sends the error frame and closes, then
  // calls on_disconnect); request-level failures are answered with error
  // replies instead.
  void on_message(ConnId conn, const wire::Message& message, Clock::time_point now);
  void on_disconnect(ConnId conn, const std::string& reason);
  // Expires hello, heartbeat, waiter and step deadlines. Ticks come often
  // (every 100 ms at most); one that comes more than kStalled after the one
  // before finds a coordinator that was not running (its process stopped,
  // or starved on a loaded machine): the time it missed does not count as
  // any member's silence (their heartbeats may be waiting unread).
  void on_tick(Clock::time_point now);
  static constexpr Millis kStalled{2000};

  std::vector<Member> members() const;
  int64_t committed_version(int engine_rank) const;
  // The status request's answer (Client::status_json).
  wire::Json status() const;

 private:
  struct Conn {
    Clock::time_point opened;
    Clock::time_point last_seen;
    bool registered = false;
    Member member;
    int waits = 0;  // requests parked in waiters (capped per connection)
  };
  struct Waiter {
    ConnId conn;
    uint64_t request;
    Clock::time_point deadline;
  };
  struct MemberWaiter : Waiter {
    int trainers;
    int engines;
  };
  struct Barrier {
    int count = 0;
    std::vector<Waiter> arrived;
  };
  enum class Outcome { pending, ok, failed };
  struct Participant {
    ConnId conn;
    Member member;
    Outcome outcome = Outcome::pending;
    std::string reason;
    uint64_t bytes = 0;    // an engine's acked bytes
    bool aborted = false;  // told to abort already (a trainer's send to it failed)
    bool landed = false;   // an engine's ack: the step wrote its params (no staging)
  };
  struct Follower : Waiter {  // a trainer waiting for the leader of `step`
    int64_t step;
  };
  struct StepBegin {  // a begin_step request's step, plan and replicas
    int64_t step;
    std::string plan_id;  // empty: follow the step's leader
    std::optional<std::vector<int>> replicas;
  };
  struct OpenStep {
    int64_t step = 0;
    std::string plan_id;
    std::optional<std::vector<int>> replicas;  // elastic replicas: the membership served
    Clock::time_point began;
    Clock::time_point deadline;
    std::map<uint64_t, Participant> trainers;  // by member id
    std::map<uint64_t, Participant> engines;
    std::string failure;  // the step fails for this, whatever its participants say
  };

  // Membership.
  struct Resume {  // a hello's "resume": a member registering again
    uint64_t member = 0;
    int64_t version = -1;
    int64_t last_step = -1;
    bool torn = false;
  };
  void handle_hello(ConnId conn, Conn& c, const wire::Json& body);
  std::optional<Resume> resume_of(const wire::Json& body, const Member& m) const;
  void adopt(const Member& m, const Resume& r);
  void drop(ConnId conn, const std::string& reason);
  std::vector<ConnId> registered_conns(std::optional<Role> role = std::nullopt) const;
  wire::Json members_json() const;
  bool members_satisfy(int trainers, int engines) const;

  // Requests of registered members.
  void handle_request(ConnId conn, Conn& c, const wire::Message& m, Clock::time_point now);
  void kv_set(ConnId conn, uint64_t id, const std::string& key, std::vector<uint8_t> value,
              size_t limit);
  void kv_get(ConnId conn, uint64_t id, const std::string& key, Clock::time_point deadline,
              Clock::time_point now);
  void barrier(ConnId conn, uint64_t id, const wire::Json& body, Clock::time_point now);

  // Steps.
  wire::Json step_engines_json(const OpenStep& s) const;  // the step's engine members
  wire::Json step_reply(const OpenStep& s) const;         // begin_step's reply
  void answer_followers();  // the followers of the open step (or of others: errors)
  void begin_step(ConnId conn, const Conn& c, uint64_t id, const wire::Json& body,
                  Clock::time_point now);
  void join_open_step(ConnId conn, const Conn& c, uint64_t id, const StepBegin& b);
  void open_new_step(ConnId conn, uint64_t id, StepBegin b, Clock::time_point now);
  // A trainer's "sent" (from == trainer) or an engine's "ack" of the open step.
  void record_report(ConnId conn, const Conn& c, uint64_t id, const wire::Json& body, Role from);
  // A trainer's send_failed: the engine rank fails the step and is told now.
  void record_send_failure(ConnId conn, const Conn& c, uint64_t id, const wire::Json& body);
  bool report_applies(ConnId conn, uint64_t id, int64_t step, const std::string& what);
  void stop_sends_to(const Participant& p);
  // An engine rank's late ack of a step decided without it (told to abort
  // while receiving): torn if the step wrote its params.
  void note_late_landing(int rank, int64_t step);
  void mark_torn(int rank);  // torn_ and its metric
  // An engine rank put its last committed version back whole: not torn.
  void record_restored(ConnId conn, const Conn& c, uint64_t id, const wire::Json& body);
  // An engine rank serves committed step "step" from now (its apply ended).
  void record_applied(ConnId conn, const Conn& c, uint64_t id, const wire::Json& body);
  void participant_lost(uint64_t member_id, const std::string& reason);
  void try_decide();
  void decide();
  std::string trainer_failure_of(const OpenStep& s) const;  // empty: every trainer sent ok
  std::map<int, std::string> replica_failures(const std::vector<const Participant*>& engines) const;
  void send_abort(ConnId conn, int64_t step, const std::string& reason);
  // Metrics of a decided step and of the engines' versions after it.
  void record_decision(const OpenStep& s, const wire::Json& result, bool trainers_ok);
  void record_membership();

  bool admit(ConnId conn, uint64_t id, const std::string& name);
  void answered(ConnId conn);
  void reply(ConnId conn, uint64_t id, wire::Json fields = wire::Json::object());
  void reply_error(ConnId conn, uint64_t id, Errc code, const std::string& message);
  void expire_waiters(Clock::time_point now);

  CoordinatorOptions options_;
  Outbox& outbox_;
  std::map<ConnId, Conn> conns_;
  std::optional<Clock::time_point> last_tick_;
  // This coordinator's start time (microseconds since the epoch): welcome's
  // "coordinator", and the first member id (so that a restarted one never
  // hands out an id its predecessor gave, which the members keep).
  uint64_t instance_ = 0;
  uint64_t next_member_id_ = 1;
  std::map<std::string, std::vector<uint8_t>> store_;  // "k:" user keys, "p:" plan blobs
  size_t store_bytes_ = 0;
  std::multimap<std::string, Waiter> store_waiters_;
  std::map<std::string, Barrier> barriers_;
  std::vector<MemberWaiter> member_waiters_;
  std::vector<Follower> followers_;
  std::optional<OpenStep> open_step_;
  std::optional<int64_t> last_decided_;
  std::map<int, int64_t> versions_;  // engine rank -> committed step
  // Engine ranks whose params hold part of a step that did not commit
  // (StepAck::landed), until their next commit: status() and the metrics.
  std::set<int> torn_;
  // Engine rank -> its last "applied" report: {"step", "at" (seconds since
  // the epoch, the coordinator's clock), "requests"}; status() shows it.
  std::map<int, wire::Json> applied_;
  Metrics* metrics_ = nullptr;
  std::deque<wire::Json> recent_steps_;  // the last decided steps, for status()
};

}  // namespace weightsync::control
