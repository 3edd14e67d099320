// Client internals shared by client.cpp (connection, I/O thread) and
// client_calls.cpp (the blocking calls and event decoding).
#pragma once

#include "protocol.h"

#include <boost/asio.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

namespace weightsync::control {

namespace asio = boost::asio;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;

inline constexpr size_t kClientReadChunk = 64 * 1024;
// Between two attempts to reach a lost coordinator again.
inline constexpr Millis kRetryEvery{200};

struct Client::Impl {
  struct Pending {
    bool done = false;
    wire::Json reply;
    std::optional<Error> error;
  };

  explicit Impl(ClientOptions opts)
      : options(std::move(opts)), decoder(options.max_frame_bytes), address(options.address) {}

  void connect();
  void start_io();
  // Reconnection (io thread): drop the broken socket, retry every
  // kRetryEvery until reconnect_timeout, say hello again as the same member.
  bool may_reconnect(const std::optional<Error>& why) const;
  void drop_socket();
  void schedule_reconnect(Millis after);
  void try_reconnect();
  void on_reconnected();
  wire::Json hello_message() const;  // under mu
  void read();
  void on_payload(const std::string& payload);
  void enqueue(std::string frame);
  void write();
  void schedule_heartbeat();
  void lost(std::optional<Error> why);
  wire::Json request(wire::Json message, Millis wait, const std::string& what);
  // cv.wait_for(lock, timeout, done), running the while_waiting hooks (with
  // `lock` released) between looks, first after tens of microseconds, then
  // about every millisecond. True once done() holds.
  template <class Done>
  bool wait(std::unique_lock<std::mutex>& lock, Millis timeout, Done done);
  void run_progress();
  // Whether a wait on this thread runs the while_waiting hooks: some are
  // registered and the thread is not quiet (Client::QuietWaits).
  bool progress_here() const;
  void close_on_io();
  Error lost_error() const;
  // Records a store write for replay after a reconnection (only then kept).
  void written(std::map<std::string, std::vector<uint8_t>>& log, const std::string& key,
               const std::vector<uint8_t>& value) {
    if (options.reconnect_timeout.count() <= 0) return;
    std::lock_guard lock(mu);
    log[key] = value;
  }

  ClientOptions options;
  asio::io_context io;
  tcp::socket socket{io};
  asio::steady_timer heartbeat{io};
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
  std::thread thread;
  // io thread only
  uint64_t generation = 0;  // of the socket: handlers of an older one do nothing
  asio::steady_timer retry{io};
  Clock::time_point reconnect_deadline;
  wire::FrameDecoder decoder;
  std::array<uint8_t, kClientReadChunk> buffer{};
  std::deque<std::string> out;
  bool writing = false;
  bool closed = false;
  // shared, under mu
  mutable std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::shared_ptr<Pending>> pending;
  uint64_t next_id = 1;
  std::deque<Event> events;
  std::map<int64_t, StepResult> results;
  bool connected = false;
  bool left = false;
  std::optional<Error> closed_because;  // the coordinator's final error frame, if any
  std::string lost_reason;
  Member self;
  std::vector<Member> at_join;
  // Reconnection, under mu.
  std::string address;        // where (re)connections go: options.address or set_address
  bool reconnecting = false;  // lost, trying to reach the coordinator again
  uint64_t losses = 0;
  uint64_t resume_hello = 0;  // the request id of a reconnection's hello
  uint64_t coordinator = 0;   // the coordinator instance registered with (its welcome)
  // The requests it knows beyond protocol version 1's first set (its
  // welcome's "features"; a coordinator older than the field: none).
  std::set<std::string> features;
  ResumeState resume;
  // What this client wrote to the store, written again after a reconnection.
  std::map<std::string, std::vector<uint8_t>> kv_written;
  std::map<std::string, std::vector<uint8_t>> plans_written;
  // while_waiting hooks: registered and run by the callers' threads
  std::mutex progress_mu;
  std::map<uint64_t, std::function<void()>> progress;
  uint64_t next_progress = 1;
  std::atomic<bool> has_progress{false};
};

template <class Done>
bool Client::Impl::wait(std::unique_lock<std::mutex>& lock, Millis timeout, Done done) {
  if (!progress_here()) return cv.wait_for(lock, timeout, done);
  const auto deadline = Clock::now() + timeout;
  auto slice = std::chrono::microseconds(16);
  while (!done()) {
    const auto now = Clock::now();
    if (now >= deadline) return false;
    lock.unlock();
    run_progress();
    lock.lock();
    if (cv.wait_for(lock, std::min<Clock::duration>(slice, deadline - now), done)) return true;
    slice = std::min(slice * 2, std::chrono::microseconds(1024));
  }
  return true;
}

}  // namespace weightsync::control
