#include "coordinator_state.h"
#include "metrics.h"

#include <algorithm>

namespace weightsync::control {
namespace {

using wire::Json;
using wire::Kind;

// Compares without an early exit, so response time does not reveal how much
// of a guessed token was right.
bool constant_time_equal(const std::string& a, const std::string& b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned diff = a.size() == b.size() ? 0u : 1u;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

std::string who(const Member& m) {
  return cat(role_name(m.role), " rank ", m.rank);
}

// Memory bounds against a client that parks many waits or sends huge names.
constexpr int kMaxWaitsPerConnection = 256;
constexpr size_t kMaxNameBytes = 4096;

}  // namespace

Clock::time_point deadline_after(Clock::time_point now, uint64_t timeout_ms) {
  constexpr uint64_t kMaxWaitMs = uint64_t{7} * 24 * 3600 * 1000;
  return now + std::chrono::milliseconds(std::min(timeout_ms, kMaxWaitMs));
}

// Member ids start at this coordinator's start time in microseconds, so that
// a coordinator restarted on the same address never hands out an id its
// predecessor gave, which the members that come back keep.
CoordinatorState::CoordinatorState(const CoordinatorOptions& options, Outbox& outbox)
    : options_(options),
      outbox_(outbox),
      instance_(static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                          std::chrono::system_clock::now().time_since_epoch())
                                          .count())),
      next_member_id_(instance_) {}

void CoordinatorState::on_connect(ConnId conn, Clock::time_point now) {
  conns_[conn] = Conn{now, now, false, {}, 0};
}

void CoordinatorState::on_message(ConnId conn, const wire::Message& m, Clock::time_point now) {
  auto it = conns_.find(conn);
  if (it == conns_.end()) return;  // already dropped; late bytes are ignored
  Conn& c = it->second;
  c.last_seen = now;
  if (!wire::is_request(m.kind))
    fail(Errc::protocol, "message kind '", wire::kind_name(m.kind),
         "' is not a request to the coordinator");
  if (!c.registered) {
    if (m.kind != Kind::hello)
      fail(Errc::protocol, "the first message must be hello, got '", wire::kind_name(m.kind), "'");
    handle_hello(conn, c, m.body);
    return;
  }
  if (m.kind == Kind::hello) fail(Errc::protocol, who(c.member), " sent a second hello");
  handle_request(conn, c, m, now);
}

void CoordinatorState::handle_hello(ConnId conn, Conn& c, const Json& body) {
  if (!options_.token.empty() && !constant_time_equal(body.value("token", ""), options_.token))
    fail(Errc::protocol, "hello rejected: missing or wrong token");
  Member m;
  try {
    m.role = parse_role(body.at("role").get<std::string>());
  } catch (const Error& e) {
    fail(Errc::protocol, "hello: ", e.what());
  }
  m.rank = body.at("rank").get<int>();
  m.world = body.at("world").get<int>();
  if (m.world < 1 || m.rank >= m.world)
    fail(Errc::protocol, "hello: ", role_name(m.role), " rank ", m.rank, " is outside world ",
         m.world);
  const int64_t replica = body.value("replica", int64_t{-1});
  if (replica < -1 || replica > std::numeric_limits<int>::max())
    fail(Errc::protocol, "hello: replica ", replica, " out of range");
  m.replica = static_cast<int>(replica);
  m.layout_hash = body.value("layout_hash", "");
  m.parity = body.value("parity", "");
  if (!m.parity.empty() && m.role != Role::engine)
    fail(Errc::protocol, "hello: ", role_name(m.role), " rank ", m.rank,
         " sent a parity line; only engine ranks check parity");
  if (body.contains("address")) m.transport_address = wire::get_bytes(body, "address");
  const std::optional<Resume> resume = resume_of(body, m);
  if (m.role != Role::observer) {
    for (const auto& [other_conn, other] : conns_) {
      if (other.registered && other.member.role == m.role && other.member.rank == m.rank)
        fail(Errc::protocol, "duplicate registration: ", who(m), " is already live (member id ",
             other.member.id, ")");
    }
  }
  if (resume) {
    // The same process, registering again (this coordinator restarted, or
    // its connection broke): it keeps its member id, and what it reports
    // rebuilds the versions and the step count.
    m.id = resume->member;
    next_member_id_ = std::max(next_member_id_, m.id + 1);
    adopt(m, *resume);
    // A trainer that had ended the open step before it came back (it failed
    // the step with the lost coordinator) takes no part in it here: the step
    // cannot complete, so it fails now, not at its deadline (decided below,
    // once the member is welcomed).
    if (m.role == Role::trainer && open_step_ && resume->last_step >= open_step_->step &&
        open_step_->failure.empty())
      open_step_->failure = cat(who(m), " had ended step ", open_step_->step,
                                " before it came back to this coordinator");
  } else {
    m.id = next_member_id_++;
  }
  c.member = m;
  c.registered = true;
  Json welcome = wire::make(Kind::welcome);
  welcome["id"] = wire::get_u64(body, "id");
  welcome["member"] = wire::member_to_json(m);
  welcome["members"] = members_json();
  welcome["coordinator"] = instance_;
  // Requests a client may send only where the coordinator knows them (an
  // older one closes the connection on an unknown kind).
  welcome["features"] = Json::array({"applied"});
  outbox_.send(conn, welcome);
  record_membership();
  if (open_step_ && !open_step_->failure.empty()) decide();
  // Membership grew: some wait_members requests may now be satisfied.
  auto ready = std::stable_partition(
      member_waiters_.begin(), member_waiters_.end(),
      [&](const MemberWaiter& w) { return !members_satisfy(w.trainers, w.engines); });
  std::vector<MemberWaiter> done(ready, member_waiters_.end());
  member_waiters_.erase(ready, member_waiters_.end());
  for (const auto& w : done) {
    answered(w.conn);
    reply(w.conn, w.request, Json{{"members", members_json()}});
  }
}

std::optional<CoordinatorState::Resume> CoordinatorState::resume_of(const Json& body,
                                                                    const Member& m) const {
  auto it = body.find("resume");
  if (it == body.end()) return std::nullopt;
  const Json& r = *it;
  const auto integer = [&](const char* name) -> int64_t {
    auto f = r.find(name);
    if (f == r.end() || !f->is_number_integer() || f->get<int64_t>() < -1)
      fail(Errc::protocol, "hello of ", who(m), ": resume.", name, " must be an integer >= -1");
    return f->get<int64_t>();
  };
  for (const auto& [key, value] : r.items())
    if (key != "member" && key != "version" && key != "last_step" && key != "torn" &&
        key != "coordinator")
      fail(Errc::protocol, "hello of ", who(m), ": unknown field resume.", key,
           " (expected member, version, last_step, torn, coordinator)");
  // Only a restarted coordinator takes members back. One that dropped this
  // member (a heartbeat timeout, a broken link) has told everyone it left,
  // and the trainers count on a new member id for a new connection: the
  // process must register anew.
  if (auto c = r.find("coordinator");
      c != r.end() && c->is_number_unsigned() && c->get<uint64_t>() == instance_)
    fail(Errc::protocol, "hello of ", who(m), ": this coordinator dropped member ",
         r.value("member", uint64_t{0}),
         " already; it takes members back only after a restart (register anew as a new ",
         "process)");
  Resume out;
  auto member = r.find("member");
  if (member == r.end() || !member->is_number_unsigned() || member->get<uint64_t>() == 0)
    fail(Errc::protocol, "hello of ", who(m), ": resume.member must be a member id");
  out.member = member->get<uint64_t>();
  out.version = integer("version");
  out.last_step = integer("last_step");
  auto torn = r.find("torn");
  if (torn != r.end() && !torn->is_boolean())
    fail(Errc::protocol, "hello of ", who(m), ": resume.torn must be a boolean");
  out.torn = torn != r.end() && torn->get<bool>();
  return out;
}

void CoordinatorState::adopt(const Member& m, const Resume& r) {
  if (m.role == Role::engine && r.version >= 0) {
    int64_t& v = versions_[m.rank];
    v = std::max(v, r.version);
    if (metrics_) {
      int64_t newest = -1;
      for (const auto& [rank, x] : versions_) newest = std::max(newest, x);
      for (const auto& [rank, x] : versions_) metrics_->engine_version(rank, x, newest);
    }
  }
  if (m.role == Role::engine && r.torn) mark_torn(m.rank);
  const int64_t seen = std::max(r.version, r.last_step);
  if (seen >= 0 && !open_step_ && (!last_decided_ || *last_decided_ < seen)) last_decided_ = seen;
}

void CoordinatorState::on_disconnect(ConnId conn, const std::string& reason) {
  drop(conn, reason);
}

void CoordinatorState::drop(ConnId conn, const std::string& reason) {
  auto it = conns_.find(conn);
  if (it == conns_.end()) return;
  const Conn c = it->second;
  conns_.erase(it);
  for (auto w = store_waiters_.begin(); w != store_waiters_.end();)
    w = w->second.conn == conn ? store_waiters_.erase(w) : std::next(w);
  for (auto b = barriers_.begin(); b != barriers_.end();) {
    auto& arrived = b->second.arrived;
    std::erase_if(arrived, [&](const Waiter& w) { return w.conn == conn; });
    b = arrived.empty() ? barriers_.erase(b) : std::next(b);
  }
  std::erase_if(member_waiters_, [&](const MemberWaiter& w) { return w.conn == conn; });
  std::erase_if(followers_, [&](const Follower& w) { return w.conn == conn; });
  if (!c.registered) return;
  // A new process for the rank holds none of the mix, and has applied nothing yet.
  if (c.member.role == Role::engine && torn_.erase(c.member.rank) > 0 && metrics_)
    metrics_->engine_torn(c.member.rank, false);
  if (c.member.role == Role::engine) applied_.erase(c.member.rank);
  Json left = wire::make(Kind::member_left);
  left["member"] = wire::member_to_json(c.member);
  left["reason"] = reason;
  // An observer's departure matters to observers only: trainers and engines
  // would wake for every monitoring client that comes and goes (and queue
  // the events), which under churn slows every step.
  const std::optional<Role> audience =
      c.member.role == Role::observer ? std::optional<Role>(Role::observer) : std::nullopt;
  for (ConnId other : registered_conns(audience)) outbox_.send(other, left);
  record_membership();
  if (metrics_ && reason != "left") metrics_->member_lost(c.member.role, c.member.rank, reason);
  participant_lost(c.member.id, cat(who(c.member), ": ", reason));
}

std::vector<ConnId> CoordinatorState::registered_conns(std::optional<Role> role) const {
  std::vector<ConnId> out;
  for (const auto& [id, c] : conns_)
    if (c.registered && (!role || c.member.role == *role)) out.push_back(id);
  return out;
}

std::vector<Member> CoordinatorState::members() const {
  std::vector<Member> out;
  for (const auto& [id, c] : conns_)
    if (c.registered) out.push_back(c.member);
  std::sort(out.begin(), out.end(), [](const Member& a, const Member& b) { return a.id < b.id; });
  return out;
}

Json CoordinatorState::members_json() const {
  Json list = Json::array();
  for (const Member& m : members()) list.push_back(wire::member_to_json(m));
  return list;
}

bool CoordinatorState::members_satisfy(int trainers, int engines) const {
  int t = 0, e = 0;
  for (const auto& [id, c] : conns_) {
    if (!c.registered) continue;
    t += c.member.role == Role::trainer;
    e += c.member.role == Role::engine;
  }
  return t >= trainers && e >= engines;
}

int64_t CoordinatorState::committed_version(int engine_rank) const {
  auto it = versions_.find(engine_rank);
  return it == versions_.end() ? -1 : it->second;
}

void CoordinatorState::handle_request(ConnId conn, Conn& c, const wire::Message& m,
                                      Clock::time_point now) {
  const Json& b = m.body;
  if (m.kind == Kind::heartbeat) return;
  const uint64_t id = wire::get_u64(b, "id");
  switch (m.kind) {
    case Kind::leave:
      reply(conn, id);
      outbox_.close(conn, std::nullopt, "left");
      drop(conn, "left");
      return;
    case Kind::kv_set:
      return kv_set(conn, id, "k:" + b.at("key").get<std::string>(), wire::get_bytes(b, "value"),
                    options_.max_frame_bytes);
    case Kind::kv_get:
      return kv_get(conn, id, "k:" + b.at("key").get<std::string>(),
                    deadline_after(now, wire::get_u64(b, "timeout_ms")), now);
    case Kind::plan_put:
      return kv_set(conn, id, "p:" + b.at("plan_id").get<std::string>(), wire::get_bytes(b, "blob"),
                    options_.max_plan_bytes);
    case Kind::plan_get:
      return kv_get(conn, id, "p:" + b.at("plan_id").get<std::string>(),
                    deadline_after(now, wire::get_u64(b, "timeout_ms")), now);
    case Kind::barrier:
      return barrier(conn, id, b, now);
    case Kind::wait_members: {
      const int t = b.at("trainers").get<int>(), e = b.at("engines").get<int>();
      if (members_satisfy(t, e)) return reply(conn, id, Json{{"members", members_json()}});
      if (!admit(conn, id, "wait_members")) return;
      MemberWaiter w{{conn, id, deadline_after(now, wire::get_u64(b, "timeout_ms"))}, t, e};
      member_waiters_.push_back(w);
      return;
    }
    case Kind::members:
      return reply(conn, id,
                   Json{{"members", members_json()},
                        {"expect_trainers", options_.expect_trainers},
                        {"expect_engines", options_.expect_engines}});
    case Kind::version:
      return reply(conn, id, Json{{"version", committed_version(b.at("engine_rank").get<int>())}});
    case Kind::status:
      return reply(conn, id, status());
    case Kind::begin_step:
      return begin_step(conn, c, id, b, now);
    case Kind::sent:
      return record_report(conn, c, id, b, Role::trainer);
    case Kind::ack:
      return record_report(conn, c, id, b, Role::engine);
    case Kind::send_failed:
      return record_send_failure(conn, c, id, b);
    case Kind::restored:
      return record_restored(conn, c, id, b);
    case Kind::applied:
      return record_applied(conn, c, id, b);
    default:
      fail(Errc::internal, "unhandled request kind '", wire::kind_name(m.kind), "'");
  }
}

void CoordinatorState::kv_set(ConnId conn, uint64_t id, const std::string& key,
                              std::vector<uint8_t> value, size_t limit) {
  const std::string_view what = key[0] == 'p' ? "plan" : "key";
  const std::string name = key.substr(2);
  if (name.size() > kMaxNameBytes)
    return reply_error(conn, id, Errc::invalid_argument,
                       cat(what, " name of ", name.size(), " bytes exceeds ", kMaxNameBytes));
  if (value.size() > limit)
    return reply_error(
        conn, id, Errc::invalid_argument,
        cat(what, " '", name, "': ", value.size(), " bytes exceed the limit of ", limit, " bytes"));
  auto it = store_.find(key);
  const size_t old = it == store_.end() ? 0 : key.size() + it->second.size();
  const size_t total = store_bytes_ - old + key.size() + value.size();
  if (total > options_.max_store_bytes)
    return reply_error(conn, id, Errc::invalid_argument,
                       cat(what, " '", name, "': the store would hold ", total,
                           " bytes, above its limit of ", options_.max_store_bytes));
  store_bytes_ = total;
  auto range = store_waiters_.equal_range(key);
  if (range.first != range.second) {
    const Json answer{{"value", wire::base64_encode(value)}};
    for (auto w = range.first; w != range.second; ++w) {
      answered(w->second.conn);
      reply(w->second.conn, w->second.request, answer);
    }
    store_waiters_.erase(range.first, range.second);
  }
  store_[key] = std::move(value);
  reply(conn, id);
}

void CoordinatorState::kv_get(ConnId conn, uint64_t id, const std::string& key,
                              Clock::time_point deadline, Clock::time_point now) {
  auto it = store_.find(key);
  if (it != store_.end()) return reply(conn, id, Json{{"value", wire::base64_encode(it->second)}});
  // A zero timeout asks whether the key is there now (e.g. trainer rank 0
  // polling engines' ready keys): answered at once, not at the next tick.
  if (deadline <= now)
    return reply_error(conn, id, Errc::timeout,
                       cat(key[0] == 'p' ? "plan '" : "key '", key.substr(2), "' is not set"));
  if (!admit(conn, id, key.substr(2))) return;
  store_waiters_.emplace(key, Waiter{conn, id, deadline});
}

void CoordinatorState::barrier(ConnId conn, uint64_t id, const Json& body, Clock::time_point now) {
  const auto name = body.at("name").get<std::string>();
  const int count = body.at("count").get<int>();
  if (count < 1)
    return reply_error(conn, id, Errc::invalid_argument, cat("barrier '", name, "': count 0"));
  if (!admit(conn, id, name)) return;
  Barrier& b = barriers_[name];
  if (b.arrived.empty()) b.count = count;
  if (b.count != count) {
    answered(conn);
    return reply_error(conn, id, Errc::invalid_argument,
                       cat("barrier '", name, "': count ", count, " differs from the ", b.count,
                           " given by the members already waiting"));
  }
  b.arrived.push_back(Waiter{conn, id, deadline_after(now, wire::get_u64(body, "timeout_ms"))});
  if (static_cast<int>(b.arrived.size()) < b.count) return;
  const std::vector<Waiter> done = std::move(b.arrived);
  barriers_.erase(name);
  for (const Waiter& w : done) {
    answered(w.conn);
    reply(w.conn, w.request);
  }
}

bool CoordinatorState::admit(ConnId conn, uint64_t id, const std::string& name) {
  Conn& c = conns_.at(conn);
  if (name.size() > kMaxNameBytes) {
    reply_error(conn, id, Errc::invalid_argument,
                cat("name of ", name.size(), " bytes exceeds ", kMaxNameBytes));
    return false;
  }
  if (c.waits >= kMaxWaitsPerConnection) {
    reply_error(conn, id, Errc::invalid_argument,
                cat("more than ", kMaxWaitsPerConnection,
                    " waits pending on this connection; wait for some to finish"));
    return false;
  }
  ++c.waits;
  return true;
}

void CoordinatorState::answered(ConnId conn) {
  auto it = conns_.find(conn);
  if (it != conns_.end() && it->second.waits > 0) --it->second.waits;
}

void CoordinatorState::reply(ConnId conn, uint64_t id, Json fields) {
  Json msg = wire::make(Kind::reply);
  msg["id"] = id;
  for (auto& [k, v] : fields.items()) msg[k] = std::move(v);
  outbox_.send(conn, msg);
}

void CoordinatorState::reply_error(ConnId conn, uint64_t id, Errc code, const std::string& text) {
  Json msg = wire::make(Kind::error);
  msg["id"] = id;
  msg["code"] = errc_name(code);
  msg["message"] = text;
  outbox_.send(conn, msg);
}

void CoordinatorState::on_tick(Clock::time_point now) {
  if (last_tick_ && now - *last_tick_ > kStalled) {
    const auto missed = now - *last_tick_;
    for (auto& [id, c] : conns_) {
      c.last_seen = std::min(now, c.last_seen + missed);
      c.opened = std::min(now, c.opened + missed);
    }
  }
  last_tick_ = now;
  std::vector<std::pair<ConnId, std::string>> expired;
  for (const auto& [id, c] : conns_) {
    if (!c.registered && now - c.opened > options_.hello_timeout)
      expired.emplace_back(id, cat("no hello within ", options_.hello_timeout.count(), " ms"));
    else if (c.registered && now - c.last_seen > options_.heartbeat_timeout)
      expired.emplace_back(id, cat("heartbeat timeout (silent for more than ",
                                   options_.heartbeat_timeout.count(), " ms)"));
  }
  for (const auto& [id, reason] : expired) {
    outbox_.close(id, Errc::timeout, reason);
    drop(id, reason);
  }
  expire_waiters(now);
  if (open_step_ && now >= open_step_->deadline) {
    const auto ms = options_.step_timeout.count();
    for (auto& [id, p] : open_step_->trainers)
      if (p.outcome == Outcome::pending) {
        p.outcome = Outcome::failed;
        p.reason = cat(who(p.member), " did not report sent within the step timeout (", ms, " ms)");
      }
    for (auto& [id, p] : open_step_->engines)
      if (p.outcome == Outcome::pending) {
        p.outcome = Outcome::failed;
        p.reason = cat(who(p.member), " did not ack within the step timeout (", ms, " ms)");
      }
    decide();
  }
}

void CoordinatorState::expire_waiters(Clock::time_point now) {
  for (auto w = store_waiters_.begin(); w != store_waiters_.end();) {
    if (w->second.deadline > now) {
      ++w;
      continue;
    }
    const bool plan = w->first[0] == 'p';
    answered(w->second.conn);
    reply_error(w->second.conn, w->second.request, Errc::timeout,
                cat(plan ? "plan '" : "key '", w->first.substr(2),
                    "' was not set within the requested timeout"));
    w = store_waiters_.erase(w);
  }
  for (auto b = barriers_.begin(); b != barriers_.end();) {
    Barrier& bar = b->second;
    const size_t before = bar.arrived.size();
    for (const Waiter& w : bar.arrived)
      if (w.deadline <= now) {
        answered(w.conn);
        reply_error(w.conn, w.request, Errc::timeout,
                    cat("barrier '", b->first, "': only ", before, " of ", bar.count,
                        " members arrived within the requested timeout"));
      }
    std::erase_if(bar.arrived, [&](const Waiter& w) { return w.deadline <= now; });
    b = bar.arrived.empty() ? barriers_.erase(b) : std::next(b);
  }
  for (const auto& w : member_waiters_)
    if (w.deadline <= now) {
      answered(w.conn);
      reply_error(w.conn, w.request, Errc::timeout,
                  cat("wait_members: fewer than ", w.trainers, " trainers and ", w.engines,
                      " engines registered within the requested timeout (", members().size(),
                      " members live)"));
    }
  std::erase_if(member_waiters_, [&](const MemberWaiter& w) { return w.deadline <= now; });
  for (const auto& w : followers_)
    if (w.deadline <= now) {
      answered(w.conn);
      reply_error(w.conn, w.request, Errc::timeout,
                  cat("follow_step ", w.step,
                      ": no trainer began that step (with a plan) within the requested timeout"));
    }
  std::erase_if(followers_, [&](const Follower& w) { return w.deadline <= now; });
}

}  // namespace weightsync::control
