// The coordinator's network side: one io_context on its own thread, an
// acceptor, and a Session per connection. All state lives in
// CoordinatorState and is touched only from that thread.
#include "coordinator_state.h"
#include "metrics.h"

#include <boost/asio.hpp>

#include <atomic>
#include <deque>
#include <future>
#include <iostream>
#include <thread>

namespace weightsync::control {
namespace {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;

// After a close is decided, unread input is drained for at most this long so
// that the final error frame is not lost to a TCP reset.
constexpr auto kLinger = std::chrono::milliseconds(1000);
constexpr size_t kReadChunk = 64 * 1024;

}  // namespace

struct Coordinator::Impl final : Outbox {
  struct Session;

  explicit Impl(CoordinatorOptions opts) : options(std::move(opts)), state(options, *this) {}

  void listen();
  void accept();
  void schedule_tick();
  void lost(ConnId id, const std::string& reason);
  void reject(ConnId id, Errc code, const std::string& message);
  void send(ConnId conn, const wire::Json& message) override;
  void close(ConnId conn, std::optional<Errc> code, const std::string& message) override;
  void shutdown();

  template <class F>
  auto on_io_thread(F&& f) const {
    if (stopped) fail(Errc::cancelled, "coordinator ", address, " is stopped");
    // Held by shared_ptr in a plain lambda: Asio treats a packaged_task
    // passed as a handler as a completion token and takes its future itself.
    using Result = decltype(f());
    auto task = std::make_shared<std::packaged_task<Result()>>(std::forward<F>(f));
    auto result = task->get_future();
    asio::post(const_cast<asio::io_context&>(io), [task] { (*task)(); });
    return result.get();
  }

  CoordinatorOptions options;
  std::unique_ptr<Metrics> metrics;  // before the state, which records into it
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer tick{io};
  asio::steady_timer accept_retry{io};
  CoordinatorState state;
  std::map<ConnId, std::shared_ptr<Session>> sessions;
  ConnId next_conn = 1;
  std::string address;
  uint16_t port = 0;
  std::atomic<bool> stopped{false};
  std::thread thread;
};

struct Coordinator::Impl::Session : std::enable_shared_from_this<Session> {
  Session(Impl& owner, ConnId id, tcp::socket socket)
      : owner(owner),
        id(id),
        socket(std::move(socket)),
        decoder(owner.options.max_frame_bytes),
        linger(owner.io) {}

  void read() {
    reading = true;
    socket.async_read_some(asio::buffer(buffer), [self = shared_from_this()](auto ec, size_t n) {
      self->on_read(ec, n);
    });
  }

  void on_read(const boost::system::error_code& ec, size_t n) {
    reading = false;
    if (closed) return;
    if (closing) {  // input is discarded while the last frames go out
      if (ec) return hard_close();
      if (!writing) drain();
      return;
    }
    if (ec) {
      const bool truncated = decoder.mid_frame();
      return owner.lost(
          id, ec == asio::error::eof
                  ? (truncated ? "connection closed in the middle of a frame" : "connection closed")
                  : cat("connection error: ", ec.message()));
    }
    try {
      decoder.feed(buffer.data(), n);
      while (auto payload = decoder.next()) {
        owner.state.on_message(id, wire::parse_message(*payload), Clock::now());
        if (closing || closed) return;
      }
    } catch (const Error& e) {
      return owner.reject(id, e.code(), e.what());
    } catch (const std::exception& e) {
      // A bug must cost one connection, never the coordinator.
      return owner.reject(id, Errc::internal, e.what());
    }
    read();
  }

  // Returns false when the queue limit was exceeded (the session is then closed).
  bool enqueue(std::string frame) {
    if (closed) return true;
    out_bytes += frame.size();
    if (out_bytes > owner.options.max_outgoing_bytes) {
      hard_close();
      return false;
    }
    out.push_back(std::move(frame));
    if (!writing) write();
    return true;
  }

  void write() {
    writing = true;
    asio::async_write(socket, asio::buffer(out.front()),
                      [self = shared_from_this()](auto ec, size_t) { self->on_written(ec); });
  }

  void on_written(const boost::system::error_code& ec) {
    if (closed) return;
    out_bytes -= out.front().size();
    out.pop_front();
    if (ec) {
      hard_close();
      return owner.lost(id, cat("write failed: ", ec.message()));
    }
    if (!out.empty()) return write();
    writing = false;
    if (closing) drain();
  }

  void close_after_flush() {
    if (closing || closed) return;
    closing = true;
    linger.expires_after(kLinger);
    linger.async_wait([self = shared_from_this()](auto ec) {
      if (!ec) self->hard_close();
    });
    if (!writing) drain();
  }

  // Half-closes and reads until the peer closes too (or the linger ends), so
  // that our last frames reach it before the socket goes away: closing with
  // unread input would reset the connection and could destroy them.
  void drain() {
    boost::system::error_code ignored;
    socket.shutdown(tcp::socket::shutdown_send, ignored);
    if (!reading) read();
  }

  void hard_close() {
    if (closed) return;
    closed = true;
    boost::system::error_code ignored;
    socket.close(ignored);
    linger.cancel();
    owner.sessions.erase(id);
  }

  Impl& owner;
  ConnId id;
  tcp::socket socket;
  wire::FrameDecoder decoder;
  asio::steady_timer linger;
  std::array<uint8_t, kReadChunk> buffer{};
  std::deque<std::string> out;
  size_t out_bytes = 0;
  bool reading = false;
  bool writing = false;
  bool closing = false;
  bool closed = false;
};

void Coordinator::Impl::listen() {
  try {
    tcp::resolver resolver(io);
    const auto results = resolver.resolve(options.host, std::to_string(options.port),
                                          tcp::resolver::passive | tcp::resolver::numeric_service);
    const tcp::endpoint endpoint = *results.begin();
    acceptor.open(endpoint.protocol());
    acceptor.set_option(tcp::acceptor::reuse_address(true));
    acceptor.bind(endpoint);
    acceptor.listen(asio::socket_base::max_listen_connections);
    port = acceptor.local_endpoint().port();
    address = cat(acceptor.local_endpoint().address().to_string(), ":", port);
  } catch (const boost::system::system_error& e) {
    fail(Errc::io, "coordinator: cannot listen on ", options.host, ":", options.port, ": ",
         e.code().message());
  }
}

void Coordinator::Impl::accept() {
  acceptor.async_accept([this](const boost::system::error_code& ec, tcp::socket socket) {
    if (stopped || !acceptor.is_open()) return;
    if (ec) {
      // Out of descriptors, most likely: back off instead of spinning.
      accept_retry.expires_after(Millis(50));
      accept_retry.async_wait([this](auto wait_ec) {
        if (!wait_ec && !stopped) accept();
      });
      return;
    }
    {
      const ConnId id = next_conn++;
      if (sessions.size() >= options.max_connections) {
        // Refused without a session: one best-effort error frame, then close.
        wire::Json err = wire::make(wire::Kind::error);
        err["code"] = errc_name(Errc::unsupported);
        err["message"] =
            cat("coordinator is at its limit of ", options.max_connections, " connections");
        boost::system::error_code ignored;
        socket.non_blocking(true, ignored);
        socket.write_some(asio::buffer(wire::encode_frame(err)), ignored);
        socket.close(ignored);
      } else {
        boost::system::error_code ignored;
        socket.set_option(tcp::no_delay(true), ignored);
        auto session = std::make_shared<Session>(*this, id, std::move(socket));
        sessions[id] = session;
        state.on_connect(id, Clock::now());
        session->read();
      }
    }
    accept();
  });
}

void Coordinator::Impl::schedule_tick() {
  // Deadlines are checked at a granularity well below every configured timeout.
  auto period = std::min({options.hello_timeout, options.heartbeat_timeout, options.step_timeout,
                          Millis(400)}) /
                4;
  tick.expires_after(std::max(period, Millis(5)));
  tick.async_wait([this](const boost::system::error_code& ec) {
    if (ec || stopped) return;
    try {
      state.on_tick(Clock::now());
    } catch (const std::exception& e) {
      std::cerr << "weightsync coordinator: internal error in deadline handling: " << e.what()
                << "\n";
    }
    schedule_tick();
  });
}

void Coordinator::Impl::lost(ConnId id, const std::string& reason) {
  if (auto it = sessions.find(id); it != sessions.end()) it->second->hard_close();
  state.on_disconnect(id, reason);
}

void Coordinator::Impl::reject(ConnId id, Errc code, const std::string& message) {
  close(id, code, message);
  state.on_disconnect(id, cat("closed for a protocol violation: ", message));
}

void Coordinator::Impl::send(ConnId conn, const wire::Json& message) {
  auto it = sessions.find(conn);
  if (it == sessions.end()) return;
  auto session = it->second;
  std::string reason;
  try {
    if (session->enqueue(wire::encode_frame(message, options.max_frame_bytes))) return;
    reason = cat("outgoing queue above ", options.max_outgoing_bytes,
                 " bytes (the peer reads too slowly)");
  } catch (const Error& e) {
    // A reply too big to frame (a huge membership list) costs that connection.
    session->hard_close();
    reason = e.what();
  }
  // The state is in the middle of a handler (it may be iterating over its
  // waiters): tell it about the loss once that handler has returned.
  asio::post(io, [this, conn, reason] { state.on_disconnect(conn, reason); });
}

void Coordinator::Impl::close(ConnId conn, std::optional<Errc> code, const std::string& message) {
  auto it = sessions.find(conn);
  if (it == sessions.end()) return;
  auto session = it->second;
  if (code) {
    wire::Json err = wire::make(wire::Kind::error);
    err["code"] = errc_name(*code);
    err["message"] = message;
    if (!session->enqueue(wire::encode_frame(err))) return;
  }
  session->close_after_flush();
}

void Coordinator::Impl::shutdown() {
  boost::system::error_code ignored;
  acceptor.close(ignored);
  tick.cancel();
  accept_retry.cancel();
  auto all = sessions;
  for (auto& [id, s] : all) s->hard_close();
}

Coordinator::Coordinator(CoordinatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {
  if (impl_->options.metrics_port >= 0) {
    impl_->metrics =
        std::make_unique<Metrics>(impl_->options.metrics_host, impl_->options.metrics_port);
    impl_->state.set_metrics(impl_->metrics.get());
  }
  impl_->listen();
  impl_->accept();
  impl_->schedule_tick();
  impl_->thread = std::thread([impl = impl_.get()] {
    while (true) {
      try {
        impl->io.run();
        return;
      } catch (const std::exception& e) {
        std::cerr << "weightsync coordinator: internal error: " << e.what() << "\n";
      }
    }
  });
}

Coordinator::~Coordinator() {
  stop();
}

void Coordinator::stop() {
  if (impl_->stopped.exchange(true)) return;
  asio::post(impl_->io, [impl = impl_.get()] { impl->shutdown(); });
  if (impl_->thread.joinable()) impl_->thread.join();
}

uint16_t Coordinator::port() const {
  return impl_->port;
}
std::string Coordinator::address() const {
  return impl_->address;
}
uint16_t Coordinator::metrics_port() const {
  return impl_->metrics ? impl_->metrics->port() : 0;
}

std::vector<Member> Coordinator::members() const {
  return impl_->on_io_thread([this] { return impl_->state.members(); });
}

int64_t Coordinator::committed_version(int engine_rank) const {
  return impl_->on_io_thread(
      [this, engine_rank] { return impl_->state.committed_version(engine_rank); });
}

}  // namespace weightsync::control
