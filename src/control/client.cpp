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

}  // namespace

void Client::Impl::connect() {
  const auto [host, port] = split_address(options.address);
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
  socket.async_read_some(asio::buffer(buffer), [this](auto ec, size_t n) {
    if (closed) return;
    if (ec) {
      const char* how =
          ec == asio::error::eof ? "the coordinator closed the connection" : "connection error";
      return lost(Error(
          Errc::peer_failure,
          cat(how, " (", options.address, ")", ec == asio::error::eof ? "" : ": " + ec.message())));
    }
    try {
      decoder.feed(buffer.data(), n);
      while (auto payload = decoder.next()) on_payload(*payload);
    } catch (const Error& e) {
      return lost(Error(Errc::protocol, cat("coordinator ", options.address,
                                            " sent a malformed message: ", e.what())));
    }
    read();
  });
}

void Client::Impl::on_payload(const std::string& payload) {
  wire::Message m = wire::parse_message(payload);
  std::lock_guard lock(mu);
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
  asio::async_write(socket, asio::buffer(out.front()), [this](auto ec, size_t) {
    if (closed) return;
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
  heartbeat.async_wait([this](auto ec) {
    if (ec || closed) return;
    enqueue(wire::encode_frame(wire::make(Kind::heartbeat)));
    schedule_heartbeat();
  });
}

void Client::Impl::lost(std::optional<Error> why) {
  close_on_io();
  std::lock_guard lock(mu);
  if (!connected) return;
  connected = false;
  if (closed_because) why = closed_because;
  lost_reason = why ? why->what() : "connection closed";
  for (auto& [id, p] : pending) {
    p->error = why ? *why : Error(Errc::peer_failure, lost_reason);
    p->done = true;
  }
  pending.clear();
  cv.notify_all();
}

void Client::Impl::close_on_io() {
  if (closed) return;
  closed = true;
  boost::system::error_code ignored;
  socket.close(ignored);
  heartbeat.cancel();
  work.reset();
}

Error Client::Impl::lost_error() const {
  if (closed_because) return *closed_because;
  return Error(Errc::peer_failure,
               cat("not connected to the coordinator ", options.address, ": ", lost_reason));
}

Json Client::Impl::request(Json message, Millis wait, const std::string& what) {
  auto p = std::make_shared<Pending>();
  uint64_t id = 0;
  {
    std::lock_guard lock(mu);
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
  Json hello = wire::make(Kind::hello);
  hello["role"] = role_name(o.role);
  hello["rank"] = o.rank;
  hello["world"] = o.world;
  hello["replica"] = o.replica;
  hello["layout_hash"] = o.layout_hash;
  hello["address"] = wire::base64_encode(o.transport_address);
  if (!o.token.empty()) hello["token"] = o.token;
  try {
    const Json welcome = impl_->request(hello, o.connect_timeout,
                                        cat("hello from ", role_name(o.role), " rank ", o.rank));
    impl_->self = wire::member_from_json(welcome.at("member"));
    impl_->at_join = wire::members_from_json(welcome.at("members"));
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

}  // namespace weightsync::control
