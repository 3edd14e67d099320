// Client's blocking calls and the decoding of coordinator events.
#include "client_impl.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <utility>

namespace weightsync::control {
namespace {

using wire::Json;
using wire::Kind;

// The coordinator enforces a wait's timeout itself and answers with
// Errc::timeout; the local wait allows a little longer for that answer to
// arrive, so the coordinator's more precise message is the one users see.
Millis local_wait(Millis timeout, Millis slack) {
  return timeout + std::min(slack, Millis(5000));
}

uint64_t as_ms(Millis m) {
  return static_cast<uint64_t>(std::max<int64_t>(0, m.count()));
}

template <class F>
auto with_context(const std::string& what, F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    if (e.code() == Errc::timeout || e.code() == Errc::protocol ||
        e.code() == Errc::invalid_argument || e.code() == Errc::mismatch)
      fail(e.code(), what, ": ", e.what());
    throw;
  }
}

}  // namespace

std::vector<Member> Client::members() {
  const Json r =
      impl_->request(wire::make(Kind::members), impl_->options.request_timeout, "members");
  return wire::members_from_json(r.at("members"));
}

void Client::set(const std::string& key, const std::vector<uint8_t>& value) {
  Json m = wire::make(Kind::kv_set);
  m["key"] = key;
  m["value"] = wire::base64_encode(value);
  with_context(cat("store set '", key, "'"),
               [&] { return impl_->request(m, impl_->options.request_timeout, "kv_set"); });
  impl_->written(impl_->kv_written, key, value);
}

std::vector<uint8_t> Client::get(const std::string& key, Millis timeout) {
  Json m = wire::make(Kind::kv_get);
  m["key"] = key;
  m["timeout_ms"] = as_ms(timeout);
  const Json r = with_context(cat("store get '", key, "' (timeout ", timeout.count(), " ms)"), [&] {
    return impl_->request(m, local_wait(timeout, impl_->options.request_timeout), "kv_get");
  });
  return wire::get_bytes(r, "value");
}

void Client::barrier(const std::string& name, int count, Millis timeout) {
  Json m = wire::make(Kind::barrier);
  m["name"] = name;
  m["count"] = count;
  m["timeout_ms"] = as_ms(timeout);
  with_context(
      cat("barrier '", name, "' (", count, " members, timeout ", timeout.count(), " ms)"), [&] {
        return impl_->request(m, local_wait(timeout, impl_->options.request_timeout), "barrier");
      });
}

std::vector<Member> Client::wait_members(int trainers, int engines, Millis timeout) {
  Json m = wire::make(Kind::wait_members);
  m["trainers"] = trainers;
  m["engines"] = engines;
  m["timeout_ms"] = as_ms(timeout);
  const Json r =
      with_context(cat("wait_members (", trainers, " trainers, ", engines, " engines, timeout ",
                       timeout.count(), " ms)"),
                   [&] {
                     return impl_->request(m, local_wait(timeout, impl_->options.request_timeout),
                                           "wait_members");
                   });
  return wire::members_from_json(r.at("members"));
}

void Client::put_plan(const std::string& plan_id, const std::vector<uint8_t>& blob) {
  Json m = wire::make(Kind::plan_put);
  m["plan_id"] = plan_id;
  m["blob"] = wire::base64_encode(blob);
  with_context(cat("put_plan '", plan_id, "'"),
               [&] { return impl_->request(m, impl_->options.request_timeout, "plan_put"); });
  impl_->written(impl_->plans_written, plan_id, blob);
}

std::vector<uint8_t> Client::get_plan(const std::string& plan_id, Millis timeout) {
  Json m = wire::make(Kind::plan_get);
  m["plan_id"] = plan_id;
  m["timeout_ms"] = as_ms(timeout);
  const Json r =
      with_context(cat("get_plan '", plan_id, "' (timeout ", timeout.count(), " ms)"), [&] {
        return impl_->request(m, local_wait(timeout, impl_->options.request_timeout), "plan_get");
      });
  return wire::get_bytes(r, "value");
}

namespace {
Millis or_default(Millis wait, Millis fallback) {
  return wait.count() > 0 ? wait : fallback;
}
}  // namespace

std::vector<Member> Client::begin_step(int64_t step, const std::string& plan_id, Millis wait) {
  if (plan_id.empty()) fail(Errc::invalid_argument, "begin_step ", step, ": no plan id");
  Json m = wire::make(Kind::begin_step);
  m["step"] = step;
  m["plan_id"] = plan_id;
  const Json r =
      impl_->request(m, or_default(wait, impl_->options.request_timeout), cat("begin_step ", step));
  if (!r.contains("engines")) return {};
  return wire::members_from_json(r.at("engines"));
}

namespace {

StepStart step_start_from(const Json& r) {
  StepStart out;
  out.plan_id = r.value("plan_id", std::string());
  out.replicas = wire::replicas_from_json(r);
  if (r.contains("engines")) out.engines = wire::members_from_json(r.at("engines"));
  return out;
}

}  // namespace

StepStart Client::begin_step(int64_t step, const std::string& plan_id,
                             const std::vector<int>& replicas, Millis wait) {
  if (plan_id.empty())
    fail(Errc::invalid_argument, "begin_step ", step, ": a leader needs a plan id");
  Json m = wire::make(Kind::begin_step);
  m["step"] = step;
  m["plan_id"] = plan_id;
  m["replicas"] = replicas;
  return step_start_from(impl_->request(m, or_default(wait, impl_->options.request_timeout),
                                        cat("begin_step ", step)));
}

StepStart Client::follow_step(int64_t step, Millis wait) {
  Json m = wire::make(Kind::begin_step);
  m["step"] = step;
  m["plan_id"] = "";  // follow the step's leader
  m["timeout_ms"] = static_cast<uint64_t>(wait.count());
  // The coordinator answers when the leader begins the step (or at the
  // timeout): wait a little longer for that answer.
  return step_start_from(impl_->request(m, wait + Millis(2000), cat("follow_step ", step)));
}

namespace {
// A rank's step stats as the "stats" object of sent and ack.
Json stats_json(const RankStepStats& s) {
  return Json{{"phases", s.phases}, {"bytes", s.bytes}, {"staging_bytes", s.staging_bytes}};
}
}  // namespace

void Client::sent(int64_t step, bool ok, const std::string& error, Millis wait,
                  const RankStepStats& stats) {
  Json m = wire::make(Kind::sent);
  m["step"] = step;
  m["ok"] = ok;
  if (!error.empty()) m["error"] = error;
  m["stats"] = stats_json(stats);
  impl_->request(m, or_default(wait, impl_->options.request_timeout), cat("sent for step ", step));
}

void Client::send_failed(int64_t step, int engine_rank, const std::string& error, Millis wait) {
  Json m = wire::make(Kind::send_failed);
  m["step"] = step;
  m["engine_rank"] = engine_rank;
  m["error"] = error;
  impl_->request(m, or_default(wait, impl_->options.request_timeout),
                 cat("send_failed for step ", step, ", engine rank ", engine_rank));
}

void Client::restored(int64_t step) {
  Json m = wire::make(Kind::restored);
  m["step"] = step;
  impl_->request(m, impl_->options.request_timeout, cat("restored after step ", step));
}

bool Client::applied(int64_t step, const std::map<std::string, int64_t>& requests, Millis wait) {
  {
    std::lock_guard lock(impl_->mu);
    if (!impl_->features.count("applied")) return false;
  }
  Json m = wire::make(Kind::applied);
  m["step"] = step;
  m["requests"] = Json::object();
  for (const auto& [name, index] : requests) m["requests"][name] = index;
  impl_->request(m, or_default(wait, impl_->options.request_timeout),
                 cat("applied for step ", step));
  return true;
}

void Client::ack(const StepAck& a, Millis wait) {
  Json m = wire::make(Kind::ack);
  m["step"] = a.step;
  m["ok"] = a.ok;
  m["bytes"] = a.bytes;
  // A decimal string keeps all 64 bits for JSON readers that use doubles.
  m["checksum"] = std::to_string(a.checksum);
  if (!a.error.empty()) m["error"] = a.error;
  m["stats"] = stats_json(a.stats);
  if (a.landed) m["landed"] = true;
  if (a.stopped) m["stopped"] = true;
  impl_->request(m, or_default(wait, impl_->options.request_timeout), cat("ack for step ", a.step));
}

int64_t Client::committed_version(int engine_rank) {
  Json m = wire::make(Kind::version);
  m["engine_rank"] = engine_rank;
  const Json r = impl_->request(m, impl_->options.request_timeout,
                                cat("committed_version of engine rank ", engine_rank));
  return r.at("version").get<int64_t>();
}

std::string Client::status_json(Millis timeout) {
  Json r = impl_->request(wire::make(Kind::status),
                          or_default(timeout, impl_->options.request_timeout), "status");
  r.erase("id");
  r.erase("kind");
  r.erase("v");
  return r.dump();
}

namespace {
thread_local bool quiet_waits = false;  // set by Client::QuietWaits
}  // namespace

bool Client::Impl::progress_here() const {
  return has_progress.load(std::memory_order_acquire) && !quiet_waits;
}

void Client::Impl::run_progress() {
  std::lock_guard lock(progress_mu);
  for (auto& [id, fn] : progress) fn();
}

Client::QuietWaits::QuietWaits() : was_quiet_(std::exchange(quiet_waits, true)) {}

Client::QuietWaits::~QuietWaits() {
  quiet_waits = was_quiet_;
}

Client::Progress Client::while_waiting(std::function<void()> fn) {
  std::lock_guard lock(impl_->progress_mu);
  const uint64_t id = impl_->next_progress++;
  impl_->progress.emplace(id, std::move(fn));
  impl_->has_progress.store(true, std::memory_order_release);
  return Progress(this, id);
}

Client::Progress::Progress(Progress&& other) noexcept
    : client_(std::exchange(other.client_, nullptr)), id_(other.id_) {}

Client::Progress& Client::Progress::operator=(Progress&& other) noexcept {
  if (this != &other) {
    Progress gone(std::move(*this));
    client_ = std::exchange(other.client_, nullptr);
    id_ = other.id_;
  }
  return *this;
}

Client::Progress::~Progress() {
  if (!client_) return;
  Impl& m = *client_->impl_;
  std::lock_guard lock(m.progress_mu);
  m.progress.erase(id_);
  m.has_progress.store(!m.progress.empty(), std::memory_order_release);
}

std::optional<Event> Client::poll_event() {
  std::lock_guard lock(impl_->mu);
  if (impl_->events.empty()) return std::nullopt;
  Event e = std::move(impl_->events.front());
  impl_->events.pop_front();
  if (auto* r = std::get_if<StepResult>(&e)) impl_->results.erase(r->step);
  return e;
}

Event Client::wait_event(Millis timeout) {
  {
    std::unique_lock lock(impl_->mu);
    // A wait the connection broke under fails (what it waited for will not
    // come); one that begins while the client reconnects waits for events.
    const uint64_t losses = impl_->losses;
    impl_->wait(lock, timeout, [&] {
      return !impl_->events.empty() || impl_->losses != losses ||
             (!impl_->connected && !impl_->reconnecting);
    });
    if (impl_->events.empty()) {
      if (impl_->losses != losses || (!impl_->connected && !impl_->reconnecting))
        throw impl_->lost_error();
      fail(Errc::timeout, "no control event from the coordinator ", impl_->options.address,
           " within ", timeout.count(), " ms");
    }
  }
  return *poll_event();
}

StepResult Client::wait_step_result(int64_t step, Millis timeout) {
  std::unique_lock lock(impl_->mu);
  impl_->wait(lock, timeout, [&] { return impl_->results.count(step) || !impl_->connected; });
  auto it = impl_->results.find(step);
  if (it == impl_->results.end()) {
    if (!impl_->connected) throw impl_->lost_error();
    fail(Errc::timeout, "no step_result for step ", step, " from the coordinator ",
         impl_->options.address, " within ", timeout.count(), " ms");
  }
  StepResult r = std::move(it->second);
  impl_->results.erase(it);
  std::erase_if(impl_->events, [&](const Event& e) {
    const auto* q = std::get_if<StepResult>(&e);
    return q && q->step == step;
  });
  return r;
}

void Client::leave() {
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->left) return;
    impl_->left = true;
    if (!impl_->connected) {  // lost (perhaps reconnecting): nothing to tell, stop trying
      impl_->reconnecting = false;
      impl_->lost_reason = "this client left";
      impl_->cv.notify_all();
      asio::post(impl_->io, [impl = impl_.get()] { impl->close_on_io(); });
      return;
    }
  }
  // Best effort: an unreachable coordinator must not hold up a process's
  // exit (it sees the connection close, or the heartbeats stop, either way).
  impl_->request(wire::make(Kind::leave), std::min(impl_->options.request_timeout, Millis(5000)),
                 "leave");
  {
    std::lock_guard lock(impl_->mu);
    impl_->connected = false;
    impl_->lost_reason = "this client left";
  }
  asio::post(impl_->io, [impl = impl_.get()] { impl->close_on_io(); });
}

}  // namespace weightsync::control
