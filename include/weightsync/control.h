// The control plane: a TCP coordinator and its clients.
//
// One Coordinator serves a job (standalone: `weightsync coordinator`, or
// embedded, e.g. in trainer rank 0). Every trainer rank, engine rank and
// observer connects a Client. The coordinator keeps membership (with
// heartbeats), a key/value store for transport bootstrap (Client implements
// Store), barriers, plan blobs, and drives the step protocol:
//
//   trainers: begin_step(step, plan_id) ... data moves ... sent(step, ok)
//   engines:  receive StepBegin, apply, ack(step, ok, bytes, checksum)
//   coordinator, once every trainer sent and every engine acked (or died or
//   timed out): Commit to engines that acked ok, Abort to the others; if any
//   trainer failed or died, Abort to every engine. Trainers receive a
//   StepResult. An engine's committed version only moves on Commit.
//
// Wire: frames of a 4-byte big-endian length + a UTF-8 JSON object carrying
// "v" (protocol version) and "kind". A connection that breaks the protocol
// is closed (after an error frame where possible); the others keep being
// served. Every blocking call takes or has a timeout and throws
// Errc::timeout naming what it waited for; a lost coordinator connection is
// Errc::peer_failure; an error reply is Errc::protocol (or the code the
// coordinator sent, e.g. invalid_argument).
#pragma once

#include <weightsync/store.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace weightsync::control {

using Millis = std::chrono::milliseconds;

inline constexpr int kProtocolVersion = 1;
// The coordinator decides a step at the latest when its step timeout runs
// out (CoordinatorOptions::step_timeout, counted from begin_step). Ranks
// count their own step deadline from about the same moment, so each waits
// for the decision until its deadline plus this grace: a decision that comes
// right at the deadline (an engine that timed out, acked, and was failed)
// still reaches every rank, instead of each giving up just before it.
inline constexpr Millis kDecisionGrace{2000};
// The coordinator fails a rank that has not reported (an engine's ack, a
// trainer's "sent") at its step timeout plus this grace: a rank counts its
// own deadline from when it heard of the step, a moment after the
// coordinator opened it, so the failure it reports at that deadline, which
// names what it waited for, must still reach the decision. Below
// kDecisionGrace, so that every rank still hears the decision.
inline constexpr Millis kReportGrace{1000};
static_assert(kReportGrace < kDecisionGrace);
inline constexpr size_t kDefaultMaxFrameBytes = size_t{16} << 20;

enum class Role { trainer, engine, observer };
std::string_view role_name(Role role) noexcept;
Role parse_role(std::string_view name);  // Errc::invalid_argument for anything else

// A registered process, as the coordinator sees it.
struct Member {
  uint64_t id = 0;  // unique for the coordinator's lifetime, never reused
  Role role = Role::observer;
  int rank = 0;      // global rank within the role (unique among live trainers / engines)
  int world = 1;     // size of the role's world, as the member declared it
  int replica = -1;  // engine replica, -1 when not given
  std::string layout_hash;
  std::vector<uint8_t> transport_address;  // opaque (e.g. a UCX worker address)
  // An engine rank's parity line, as it reported it when it registered: what
  // its FP8 parity check at connect found ("N of M linear weights FP8,
  // scales fp32; matches the engine"); "" when not checked or without FP8.
  std::string parity;
};

// ---------------------------------------------------------------- coordinator

struct CoordinatorOptions {
  std::string host = "127.0.0.1";  // listen address; "0.0.0.0" to serve other hosts
  uint16_t port = 0;               // 0: any free port (read it back with port())
  std::string token;               // non-empty: every hello must carry it
  size_t max_frame_bytes = kDefaultMaxFrameBytes;
  size_t max_connections = 4096;
  size_t max_outgoing_bytes = size_t{64} << 20;  // per connection; a slower reader is dropped
  size_t max_store_bytes = size_t{256} << 20;    // keys + values + plan blobs, all together
  size_t max_plan_bytes = size_t{64} << 20;      // one plan blob
  Millis hello_timeout{5000};                    // a connection must say hello within this
  Millis heartbeat_timeout{10000};               // a member silent for this long is dropped
  Millis step_timeout{300000};  // engines not acked by then failed; trainers not sent: abort
  int expect_trainers = 0;      // informational (printed, and in members replies)
  int expect_engines = 0;
  // Prometheus metrics on http://metrics_host:metrics_port/metrics: steps,
  // step times, bytes, membership, engine versions and lag, plan changes,
  // failures by peer, and each rank's step phases (docs/metrics.md). -1: off
  // (the library's default); 0: any free port (read it with metrics_port()).
  // Errc::unsupported when weightsync was built without prometheus-cpp.
  int metrics_port = -1;
  std::string metrics_host = "127.0.0.1";
};

class Coordinator {
 public:
  // Binds and starts serving on its own thread; Errc::io if it cannot bind.
  explicit Coordinator(CoordinatorOptions options);
  ~Coordinator();  // stops and joins
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  uint16_t port() const;
  std::string address() const;    // "HOST:PORT" as bound
  uint16_t metrics_port() const;  // the bound metrics port; 0 when metrics are off
  void stop();                    // idempotent
  std::vector<Member> members() const;
  // Committed version of the engine of global rank `engine_rank`; -1 if none.
  int64_t committed_version(int engine_rank) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// --------------------------------------------------------------------- events

struct StepBegin {  // to engines (and observers) when a trainer begins a step
  int64_t step = 0;
  std::string plan_id;
  // Elastic replicas: the global replica indices the step serves (its
  // membership, as trainer rank 0 chose it); only their engine ranks take
  // part. nullopt: every engine live when the step began.
  std::optional<std::vector<int>> replicas = std::nullopt;
};
struct Commit {  // to an engine: make `step` visible
  int64_t step = 0;
};
struct Abort {  // to an engine: drop `step`, keep the previous version
  int64_t step = 0;
  std::string reason;
  // To trainers, while the step is open: engine rank `engine_rank` failed
  // it already (a send to it failed, or it stopped receiving): stop sending
  // to it. -1 in an engine's abort.
  int engine_rank = -1;
};
struct MemberLeft {  // a member left, died or was dropped: to everyone (an observer: to observers)
  Member member;
  std::string reason;  // "left", "heartbeat timeout", "connection lost", ...
};
struct EngineFailure {
  int rank = 0;
  std::string reason;
};
struct StepResult {  // to trainers (and observers) once a step is decided
  int64_t step = 0;
  bool trainers_ok = false;           // false: every engine was told to abort
  std::string reason;                 // why, when !trainers_ok
  std::vector<int> committed;         // engine ranks that committed, ascending
  std::vector<EngineFailure> failed;  // engine ranks that aborted, with reasons
};
using Event = std::variant<StepBegin, Commit, Abort, MemberLeft, StepResult>;

// -------------------------------------------------------------------- client

struct ClientOptions {
  std::string address;  // "HOST:PORT" of the coordinator
  std::string token;
  Role role = Role::observer;
  int rank = 0;
  int world = 1;
  int replica = -1;
  std::string layout_hash;
  std::vector<uint8_t> transport_address;
  std::string parity;             // engines: Member::parity (shown by `weightsync status`)
  Millis connect_timeout{10000};  // retries refused connections until then
  Millis request_timeout{30000};  // for replies that need no waiting
  Millis heartbeat_interval{1000};
  // The connection counts as lost once what this client sent (heartbeats
  // included) has gone unacknowledged by the coordinator's host this long
  // (TCP_USER_TIMEOUT): a cut link or a vanished host ends waits at once
  // instead of after TCP's retransmissions (many minutes). 0: TCP's default.
  Millis link_timeout{10000};
  size_t max_frame_bytes = kDefaultMaxFrameBytes;
  // After the connection to the coordinator is lost (it died, restarted, or
  // the link broke), keep trying to reach it again (the address, or the one
  // given to set_address) for this long; 0: never (the connection is over).
  // A reconnected client registers again as the same member (same member
  // id), reports its ResumeState, and writes again what it wrote to the
  // store (set, put_plan), so that a restarted coordinator rebuilds
  // membership, versions and bootstrap keys from its clients
  // (docs/usage.md, "The coordinator dies"). While reconnecting, requests
  // wait for the connection (up to their own timeout), wait_event waits,
  // and what was pending when the connection broke fails with
  // Errc::peer_failure.
  Millis reconnect_timeout{0};
};

// What a client tells a coordinator when it registers again after a lost
// connection: an engine rank's committed version and whether it is torn, a
// trainer's last step. -1: none.
struct ResumeState {
  int64_t version = -1;
  int64_t last_step = -1;
  bool torn = false;
};

// A step as begin_step / follow_step returns it.
struct StepStart {
  std::string plan_id;
  std::optional<std::vector<int>> replicas;  // elastic replicas: the step's membership
  std::vector<Member> engines;               // the step's engines, each with its member id
};

// What a rank reports of its part in a step, for the coordinator's metrics
// (CoordinatorOptions::metrics_port): seconds per phase ("pack", "wire",
// "receive", "apply", ...), the bytes it moved and its staging memory.
struct RankStepStats {
  std::map<std::string, double> phases;
  uint64_t bytes = 0;
  uint64_t staging_bytes = 0;
};

struct StepAck {
  int64_t step = 0;
  bool ok = true;
  uint64_t bytes = 0;
  uint64_t checksum = 0;
  std::string error;  // why, when !ok
  RankStepStats stats;
  // The step wrote the rank's params before its decision (no staging): if
  // it does not commit, the rank is torn (Subscriber::torn) until its next
  // commit. An ack of a step already decided (the rank was told to abort
  // while receiving) is ignored but for this.
  bool landed = false;
  // The rank stopped receiving before the step's data all came (a receive
  // failed; its receives are cancelled): the coordinator tells the trainers
  // to stop sending to it (Abort::engine_rank) instead of waiting.
  bool stopped = false;
};

class Client final : public Store {
 public:
  // Connects, registers (hello) and starts the background I/O thread.
  // Errc::timeout if the coordinator is not reachable within connect_timeout;
  // Errc::protocol (or the coordinator's code) if registration is refused.
  explicit Client(ClientOptions options);
  ~Client() override;  // leaves gracefully if still connected
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  uint64_t member_id() const;
  const Member& self() const;
  std::vector<Member> members_at_join() const;  // membership in the hello reply
  std::vector<Member> members();                // current membership

  // Store (keys are any string; plan blobs live in the same byte budget).
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key, Millis timeout) override;

  // Returns when `count` members have entered barrier `name`.
  void barrier(const std::string& name, int count, Millis timeout);
  // Returns the membership once >= trainers trainers and >= engines engines are live.
  std::vector<Member> wait_members(int trainers, int engines, Millis timeout);

  void put_plan(const std::string& plan_id, const std::vector<uint8_t>& blob);
  std::vector<uint8_t> get_plan(const std::string& plan_id, Millis timeout);

  // Trainers. begin_step: Errc::protocol if another step is still open or
  // `step` is not above the last decided one. Returns the step's engines (the
  // engine members live when it began), each with its member id: a new id for
  // a rank means a new process took that rank.
  // `wait` bounds how long they wait for the coordinator's reply (a step's
  // deadline); zero: ClientOptions::request_timeout.
  std::vector<Member> begin_step(int64_t step, const std::string& plan_id, Millis wait = Millis(0));
  // Elastic replicas (docs/elastic.md): trainer rank 0 leads, beginning the step
  // with its plan for `replicas`, the global replica indices it serves
  // (ascending); only their engine ranks take part, and the engines learn the
  // list from StepBegin. The other trainers follow: follow_step waits (up to
  // `wait`) until the leader began step `step` and returns its plan id and
  // replicas. A leader that began with another plan id, or replicas, than
  // another leader of the same step fails the step (Errc::mismatch).
  StepStart begin_step(int64_t step, const std::string& plan_id, const std::vector<int>& replicas,
                       Millis wait = Millis(0));
  StepStart follow_step(int64_t step, Millis wait);
  void sent(int64_t step, bool ok, const std::string& error = {}, Millis wait = Millis(0),
            const RankStepStats& stats = {});
  // This trainer's send to `engine_rank` failed in `step`: the coordinator
  // fails that rank's step at once with `error` as its reason and tells it
  // to stop receiving (the abort), instead of it waiting out the step
  // timeout for data that will not come. The trainer goes on with the
  // others and reports sent as usual.
  void send_failed(int64_t step, int engine_rank, const std::string& error,
                   Millis wait = Millis(0));
  StepResult wait_step_result(int64_t step, Millis timeout);

  // Engines.
  // `wait` as for sent (the step's deadline); zero: request_timeout.
  void ack(const StepAck& ack, Millis wait = Millis(0));
  // This engine rank, torn by failed step `step`, holds its last committed
  // version whole again (the engine put it back by its own means): the
  // coordinator stops reporting it torn (status, weightsync_engine_torn).
  void restored(int64_t step);
  // This engine rank serves committed step `step` from now on (its apply
  // ended): status shows it, with `requests` (each request running at the
  // swap, by the engine's id -> the index of its first token `step` made).
  // False, sending nothing, where the coordinator is older than the
  // request; `wait` as for sent (zero: request_timeout).
  bool applied(int64_t step, const std::map<std::string, int64_t>& requests,
               Millis wait = Millis(0));

  // Next queued event, in arrival order. A StepResult already taken by
  // wait_step_result is not returned again (and vice versa). Errc::timeout if none arrives in time;
  // Errc::peer_failure once the connection is lost and the queue is empty.
  Event wait_event(Millis timeout);
  std::optional<Event> poll_event();

  int64_t committed_version(int engine_rank);  // -1 if none
  // The coordinator's view as one JSON object (text): "members" (each with
  // role, rank, replica, and an engine's "version"), "newest" (the newest
  // committed step), "open_step", and "steps" (the last decided ones, newest
  // last: step, seconds, trainers_ok, reason, committed, failed).
  std::string status_json(Millis timeout = Millis(0));

  // Work that must go on while a call of this client waits (for a reply, an
  // event or a step result): a data transport with operations outstanding.
  // UCX sends protocol messages (a rendezvous' completion, a shared-memory
  // fragment's ack) only from its worker's progress, so a rank that blocked
  // here without progressing it would leave its peers' sends hanging.
  // While registered, every wait of this client runs `fn` from the waiting
  // thread about every millisecond (the first looks sooner), and so only a
  // client whose waits run on the thread that drives the transport may
  // register it. The registration ends when the returned object goes, which
  // must be before the client does.
  class Progress {
   public:
    Progress() = default;
    Progress(Progress&& other) noexcept;
    Progress& operator=(Progress&& other) noexcept;
    ~Progress();

   private:
    friend class Client;
    Progress(Client* client, uint64_t id) : client_(client), id_(id) {}
    Client* client_ = nullptr;
    uint64_t id_ = 0;
  };
  [[nodiscard]] Progress while_waiting(std::function<void()> fn);
  // For a thread that waits on a client beside the thread that drives the
  // transport (a watcher): while one of these lives on a thread, that
  // thread's waits, on every client, run no while_waiting work. A transport
  // is driven by one thread at a time (backend/transport.h); two threads
  // progressing one UCX worker abort the process.
  class QuietWaits {
   public:
    QuietWaits();
    ~QuietWaits();
    QuietWaits(const QuietWaits&) = delete;
    QuietWaits& operator=(const QuietWaits&) = delete;

   private:
    bool was_quiet_;
  };
  // Idempotent; waits at most 5 s (or request_timeout, if shorter) for the
  // coordinator's reply: it notices a closed connection anyway.
  void leave();
  bool connected() const;

  // Reconnection (ClientOptions::reconnect_timeout). set_resume: what this
  // client reports when it registers again (kept up to date by its owner).
  // set_address: the coordinator moved; the next reconnection goes there
  // (the current connection, if any, is dropped and reconnected).
  // connection_losses: how many times the connection was lost so far (a
  // step that saw it change lost its coordinator and is aborted).
  void set_resume(const ResumeState& state);
  void set_address(const std::string& address);
  std::string address() const;
  uint64_t connection_losses() const;
  bool reconnecting() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightsync::control
