// Client: blocking calls on the caller's thread, all socket work on a
// background io thread (reads, writes, heartbeats). Replies are matched to
// requests by id; events are queued for wait_event / wait_step_result.
#include "client_impl.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

namespace weightsync::control {
namespace {

using wire::Json;
using wire::Kind;

std::pair<std::string, std::string> split_address(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size())
    fail(Errc::invalid_argument, "coordinator address '", address, "' is not HOST:PORT");
  std::string host = address.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return {host, address.substr(colon + 1)};
}

// A welcome's "features": the requests the coordinator knows beyond the
// first set (absent in coordinators older than the field).
std::set<std::string> features_of(const Json& welcome) {
  std::set<std::string> out;
  if (auto f = welcome.find("features"); f != welcome.end() && f->is_array())
    for (const auto& name : *f)
      if (name.is_string()) out.insert(name.get<std::string>());
  return out;
}

}  // namespace

void Client::Impl::connect() {
  const auto [host, port] = split_address(address);
  const auto deadline = Clock::now() + options.connect_timeout;
  std::string last_error = "no attempt";
  while (true) {
    boost::system::error_code ec = asio::error::would_block;
    tcp::resolver resolver(io);
    auto endpoints = resolver.resolve(host, port, ec);
    if (!ec) {
      ec = asio::error::would_block;
      asio::async_connect(socket, endpoints, [&](auto e, const auto&) { ec = e; });
      io.restart();
      io.run_until(deadline);
      if (ec == asio::error::would_block) {  // still connecting at the deadline
        boost::system::error_code ignored;
        socket.close(ignored);
        io.restart();
        io.run();
        ec = asio::error::timed_out;
      }
    }
    if (!ec) break;
    last_error = ec.message();
    if (Clock::now() + Millis(50) >= deadline)
      fail(Errc::timeout, "cannot reach the coordinator at ", options.address, " within ",
           options.connect_timeout.count(), " ms (last error: ", last_error, ")");
    std::this_thread::sleep_for(Millis(50));
  }
  boost::system::error_code ignored;
  socket.set_option(tcp::no_delay(true), ignored);
  if (options.link_timeout.count() > 0) {
    const auto ms = static_cast<unsigned int>(options.link_timeout.count());
    ::setsockopt(socket.native_handle(), IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms);
  }
  io.restart();
}

void Client::Impl::start_io() {
  {
    std::lock_guard lock(mu);
    connected = true;
  }
  work.emplace(io.get_executor());
  read();
  schedule_heartbeat();
  thread = std::thread([this] { io.run(); });
}

void Client::Impl::read() {
  socket.async_read_some(asio::buffer(buffer), [this, gen = generation](auto ec, size_t n) {
    if (closed || gen != generation) return;
    if (ec) {
      const char* how =
          ec == asio::error::eof ? "the coordinator closed the connection" : "connection error";
      return lost(Error(
          Errc::peer_failure,
          cat(how, " (", options.address, ")", ec == asio::error::eof ? "" : ": " + ec.message())));
    }
    try {
      decoder.feed(buffer.data(), n);
      while (auto payload = decoder.next()) {
        on_payload(*payload);
        if (closed || gen != generation) return;  // a refused reconnection dropped the socket
      }
    } catch (const Error& e) {
      return lost(Error(Errc::protocol, cat("coordinator ", options.address,
                                            " sent a malformed message: ", e.what())));
    }
    read();
  });
}

void Client::Impl::on_payload(const std::string& payload) {
  wire::Message m = wire::parse_message(payload);
  std::unique_lock lock(mu);
  if (resume_hello != 0 && (m.kind == Kind::welcome || m.kind == Kind::error) &&
      m.body.contains("id") && wire::get_u64(m.body, "id") == resume_hello) {
    resume_hello = 0;
    if (m.kind == Kind::error) {
      // Refused (e.g. a wrong token, or the rank is live in another
      // process): the connection is over.
      closed_because =
          Error(wire::errc_from_name(m.body.value("code", "protocol")),
                cat("the coordinator ", address,
                    " refused this client's return: ", m.body.at("message").get<std::string>()));
      lock.unlock();
      reconnect_deadline = Clock::now();
      return lost(closed_because);
    }
    self = wire::member_from_json(m.body.at("member"));
    coordinator = m.body.contains("coordinator") ? wire::get_u64(m.body, "coordinator") : 0;
    features = features_of(m.body);
    lock.unlock();
    return on_reconnected();
  }
  if (m.kind == Kind::welcome || m.kind == Kind::reply ||
      (m.kind == Kind::error && m.body.contains("id"))) {
    auto it = pending.find(wire::get_u64(m.body, "id"));
    if (it == pending.end()) return;  // the caller gave up waiting
    if (m.kind == Kind::error)
      it->second->error = Error(wire::errc_from_name(m.body.value("code", "protocol")),
                                m.body.at("message").get<std::string>());
    else
      it->second->reply = std::move(m.body);
    it->second->done = true;
    pending.erase(it);
  } else if (m.kind == Kind::error) {
    closed_because =
        Error(wire::errc_from_name(m.body.value("code", "protocol")),
              cat("the coordinator ", options.address,
                  " closed the connection: ", m.body.at("message").get<std::string>()));
  } else if (wire::is_request(m.kind)) {
    fail(Errc::protocol, "unexpected message kind '", wire::kind_name(m.kind), "'");
  } else {
    Event event = wire::event_from_message(m);
    if (auto* r = std::get_if<StepResult>(&event)) results[r->step] = *r;
    events.push_back(std::move(event));
  }
  cv.notify_all();
}

void Client::Impl::enqueue(std::string frame) {
  if (closed) return;
  out.push_back(std::move(frame));
  if (!writing) write();
}

void Client::Impl::write() {
  writing = true;
  asio::async_write(socket, asio::buffer(out.front()), [this, gen = generation](auto ec, size_t) {
    if (closed || gen != generation) return;
    out.pop_front();
    if (ec)
      return lost(Error(Errc::peer_failure, cat("cannot write to the coordinator ", options.address,
                                                ": ", ec.message())));
    if (out.empty())
      writing = false;
    else
      write();
  });
}

void Client::Impl::schedule_heartbeat() {
  heartbeat.expires_after(options.heartbeat_interval);
  heartbeat.async_wait([this, gen = generation](auto ec) {
    if (ec || closed || gen != generation) return;
    enqueue(wire::encode_frame(wire::make(Kind::heartbeat)));
    schedule_heartbeat();
  });
}

void Client::Impl::lost(std::optional<Error> why) {
  std::lock_guard lock(mu);
  if (closed_because) why = closed_because;
  const bool retry = may_reconnect(why);
  if (retry)
    drop_socket();
  else
    close_on_io();
  if (!connected && !reconnecting) return;  // never registered (the constructor says why), or over
  if (connected) {
    connected = false;
    ++losses;
    // A step the lost coordinator began and this client has not taken up
    // yet is over: no coordinator will decide it (a restarted one knows
    // nothing of it). Taken up later, it would wait for a decision until
    // its deadline.
    std::erase_if(events, [](const Event& e) { return std::holds_alternative<StepBegin>(e); });
    lost_reason = why ? why->what() : "connection closed";
    for (auto& [id, p] : pending) {
      p->error = why ? *why : Error(Errc::peer_failure, lost_reason);
      p->done = true;
    }
    pending.clear();
    if (retry) {
      reconnecting = true;
      reconnect_deadline = Clock::now() + options.reconnect_timeout;
      schedule_reconnect(Millis(0));
    }
  } else if (retry) {
    return schedule_reconnect(kRetryEvery);  // an attempt failed: the next one
  } else {
    reconnecting = false;  // refused, or out of time
    if (why) lost_reason = why->what();
  }
  cv.notify_all();
}

// The connection is worth trying again: reconnection is on, this client
// neither left nor closed, the coordinator did not refuse it, and the time
// for it has not run out (a failed attempt).
bool Client::Impl::may_reconnect(const std::optional<Error>& why) const {
  if (options.reconnect_timeout.count() <= 0 || closed || left) return false;
  if (why && why->code() == Errc::protocol) return false;
  return !reconnecting || Clock::now() < reconnect_deadline;
}

void Client::Impl::drop_socket() {
  ++generation;
  boost::system::error_code ignored;
  socket.close(ignored);
  heartbeat.cancel();
  out.clear();
  writing = false;
  decoder = wire::FrameDecoder(options.max_frame_bytes);
}

void Client::Impl::schedule_reconnect(Millis after) {
  retry.expires_after(after);
  retry.async_wait([this](auto ec) {
    if (!ec && !closed) try_reconnect();
  });
}

void Client::Impl::try_reconnect() {
  std::string where;
  {
    std::lock_guard lock(mu);
    if (!reconnecting) return;
    if (Clock::now() >= reconnect_deadline) {
      reconnecting = false;
      lost_reason = cat(lost_reason, "; gave up reaching it again after ",
                        options.reconnect_timeout.count(), " ms");
      cv.notify_all();
      return;
    }
    where = address;
  }
  std::pair<std::string, std::string> hp;
  try {
    hp = split_address(where);
  } catch (const Error&) {
    return schedule_reconnect(kRetryEvery);
  }
  boost::system::error_code ec;
  tcp::resolver resolver(io);
  auto endpoints = resolver.resolve(hp.first, hp.second, ec);
  if (ec) return schedule_reconnect(kRetryEvery);
  socket = tcp::socket(io);
  asio::async_connect(socket, endpoints, [this, gen = generation](auto e, const auto&) {
    if (closed || gen != generation) return;
    std::unique_lock lock(mu);
    if (!reconnecting) return;
    if (e) {
      lock.unlock();
      drop_socket();
      return schedule_reconnect(kRetryEvery);
    }
    boost::system::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    if (options.link_timeout.count() > 0) {
      const auto ms = static_cast<unsigned int>(options.link_timeout.count());
      ::setsockopt(socket.native_handle(), IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, sizeof ms);
    }
    Json hello = hello_message();
    resume_hello = next_id++;
    hello["id"] = resume_hello;
    hello["resume"] = Json{{"member", self.id},
                           {"version", resume.version},
                           {"last_step", resume.last_step},
                           {"torn", resume.torn},
                           {"coordinator", coordinator}};
    lock.unlock();
    read();
    enqueue(wire::encode_frame(hello, options.max_frame_bytes));
  });
}

// Registered again: the store writes of this client go again (before any
// request a caller makes now), then heartbeats and callers resume.
void Client::Impl::on_reconnected() {
  std::vector<std::string> frames;
  {
    std::lock_guard lock(mu);
    for (const auto& [key, value] : kv_written) {
      Json m = wire::make(Kind::kv_set);
      m["id"] = next_id++;  // replies to these are not waited for
      m["key"] = key;
      m["value"] = wire::base64_encode(value);
      frames.push_back(wire::encode_frame(m, options.max_frame_bytes));
    }
    for (const auto& [plan_id, blob] : plans_written) {
      Json m = wire::make(Kind::plan_put);
      m["id"] = next_id++;
      m["plan_id"] = plan_id;
      m["blob"] = wire::base64_encode(blob);
      frames.push_back(wire::encode_frame(m, options.max_frame_bytes));
    }
  }
  for (auto& f : frames) enqueue(std::move(f));
  schedule_heartbeat();
  std::lock_guard lock(mu);
  reconnecting = false;
  connected = true;
  closed_because.reset();
  cv.notify_all();
}

Json Client::Impl::hello_message() const {
  const ClientOptions& o = options;
  Json hello = wire::make(Kind::hello);
  hello["role"] = role_name(o.role);
  hello["rank"] = o.rank;
  hello["world"] = o.world;
  hello["replica"] = o.replica;
  hello["layout_hash"] = o.layout_hash;
  hello["address"] = wire::base64_encode(o.transport_address);
  if (!o.token.empty()) hello["token"] = o.token;
  if (!o.parity.empty()) hello["parity"] = o.parity;
  return hello;
}

void Client::Impl::close_on_io() {
  if (closed) return;
  closed = true;
  boost::system::error_code ignored;
  socket.close(ignored);
  heartbeat.cancel();
  retry.cancel();
  work.reset();
}

Error Client::Impl::lost_error() const {
  if (closed_because) return *closed_because;
  return Error(Errc::peer_failure, cat("not connected to the coordinator ", address, ": ",
                                       lost_reason, reconnecting ? " (reconnecting)" : ""));
}

Json Client::Impl::request(Json message, Millis wait, const std::string& what) {
  auto p = std::make_shared<Pending>();
  uint64_t id = 0;
  {
    std::unique_lock lock(mu);
    // Reconnecting: the request waits for the connection, within its time.
    if (!connected && reconnecting)
      this->wait(lock, wait, [&] { return connected || !reconnecting; });
    if (!connected) throw lost_error();
    id = next_id++;
    pending[id] = p;
  }
  message["id"] = id;
  std::string frame;
  try {
    frame = wire::encode_frame(message, options.max_frame_bytes);
  } catch (...) {
    std::lock_guard lock(mu);
    pending.erase(id);
    throw;
  }
  asio::post(io, [this, f = std::move(frame)]() mutable { enqueue(std::move(f)); });
  std::unique_lock lock(mu);
  if (!this->wait(lock, wait, [&] { return p->done; })) {
    pending.erase(id);
    fail(Errc::timeout, what, ": no reply from the coordinator ", options.address, " within ",
         wait.count(), " ms");
  }
  if (p->error) throw *p->error;
  return std::move(p->reply);
}

Client::Client(ClientOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  const ClientOptions& o = impl_->options;
  if (o.world < 1 || o.rank < 0 || o.rank >= o.world)
    fail(Errc::invalid_argument, role_name(o.role), " rank ", o.rank, " is outside world ",
         o.world);
  impl_->connect();
  impl_->start_io();
  const Json hello = impl_->hello_message();
  try {
    const Json welcome = impl_->request(hello, o.connect_timeout,
                                        cat("hello from ", role_name(o.role), " rank ", o.rank));
    impl_->self = wire::member_from_json(welcome.at("member"));
    impl_->at_join = wire::members_from_json(welcome.at("members"));
    std::lock_guard lock(impl_->mu);
    impl_->coordinator =
        welcome.contains("coordinator") ? wire::get_u64(welcome, "coordinator") : 0;
    impl_->features = features_of(welcome);
  } catch (...) {
    asio::post(impl_->io, [impl = impl_.get()] { impl->close_on_io(); });
    impl_->thread.join();
    throw;
  }
}

Client::~Client() {
  try {
    leave();
  } catch (const Error&) {
    // Best effort: the coordinator drops us by connection loss anyway.
  }
  asio::post(impl_->io, [impl = impl_.get()] { impl->close_on_io(); });
  if (impl_->thread.joinable()) impl_->thread.join();
}

uint64_t Client::member_id() const {
  return impl_->self.id;
}
const Member& Client::self() const {
  return impl_->self;
}
std::vector<Member> Client::members_at_join() const {
  return impl_->at_join;
}

bool Client::connected() const {
  std::lock_guard lock(impl_->mu);
  return impl_->connected;
}

void Client::set_resume(const ResumeState& state) {
  std::lock_guard lock(impl_->mu);
  impl_->resume = state;
}

void Client::set_address(const std::string& address) {
  split_address(address);  // Errc::invalid_argument unless HOST:PORT
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->address == address) return;
    impl_->address = address;
  }
  // A live connection to the old address is dropped: the client goes to the new one.
  asio::post(impl_->io, [impl = impl_.get(), address] {
    if (!impl->closed)
      impl->lost(Error(Errc::peer_failure, cat("the coordinator moved to ", address)));
  });
}

std::string Client::address() const {
  std::lock_guard lock(impl_->mu);
  return impl_->address;
}

uint64_t Client::connection_losses() const {
  std::lock_guard lock(impl_->mu);
  return impl_->losses;
}

bool Client::reconnecting() const {
  std::lock_guard lock(impl_->mu);
  return impl_->reconnecting;
}

}  // namespace weightsync::control
