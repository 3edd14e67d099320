// The cuda_ipc control channel's plumbing: Unix-domain SOCK_SEQPACKET sockets
// between the processes of one node. Each message is one packet (boundaries
// kept, so no framing on top), may carry file descriptors (SCM_RIGHTS: how a
// receiver hands the POSIX-fd handles of its VMM memory to a sender), and a
// peer's death closes its end, which the other side sees as end-of-file at
// once: that is how a dead peer is detected, with no heartbeat.
//
// Sockets are non-blocking and close-on-exec (a child spawned by a rank must
// not keep the rank's connections open after the rank died).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

namespace weightsync::transport::cuda_ipc {

// An owned file descriptor, closed by the destructor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.release()) {}
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();
  int get() const { return fd_; }
  int release();
  explicit operator bool() const { return fd_ >= 0; }

 private:
  int fd_ = -1;
};

using SharedFds = std::shared_ptr<const std::vector<UniqueFd>>;

// A message to write: bytes and, optionally, descriptors to pass along.
// The descriptors are owned elsewhere (`fd_owner` keeps them open until the
// message is written; the kernel duplicates them into the peer).
struct OutPacket {
  std::vector<uint8_t> bytes;
  SharedFds fd_owner;
  std::vector<int> fds;
};

struct InPacket {
  std::vector<uint8_t> bytes;
  std::vector<UniqueFd> fds;
};

// Largest packet and most descriptors in one packet (Linux allows 253).
constexpr std::size_t kMaxPacketBytes = 64 * 1024;
constexpr std::size_t kMaxPacketFds = 200;

// One connected socket with an outbox: packets that did not fit into the
// socket's buffer wait there and go out, in order, on later flushes.
class Connection {
 public:
  Connection() = default;
  explicit Connection(UniqueFd fd) : fd_(std::move(fd)) {}
  Connection(Connection&&) = default;
  Connection& operator=(Connection&&) = default;

  bool open() const { return static_cast<bool>(fd_); }
  int fd() const { return fd_.get(); }
  // Queues a packet and writes what the socket takes now. Errc::io when the
  // socket is broken (the peer closed it or died).
  void send(OutPacket packet);
  // Writes queued packets while the socket takes them; true when none is left.
  bool flush();
  bool idle() const { return outbox_.empty(); }
  // Reads one packet without blocking: false when none is waiting. Errc::io
  // on end-of-file (the peer closed its end or died) or a socket error.
  bool receive(InPacket& packet);
  void close();

 private:
  UniqueFd fd_;
  std::deque<OutPacket> outbox_;
};

// A listening socket. An address starting with '@' is in Linux's abstract
// namespace (no file, gone when the process is); any other is a path.
class Listener {
 public:
  // Binds a fresh address: abstract when `dir` is empty, else a socket file
  // in `dir` (removed by the destructor).
  explicit Listener(const std::string& dir);
  ~Listener();
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  const std::string& address() const { return address_; }
  int fd() const { return fd_.get(); }
  // Accepts one pending connection without blocking (an empty UniqueFd when
  // none is waiting).
  UniqueFd accept();

 private:
  UniqueFd fd_;
  std::string address_;
};

// Connects to a listener's address. Errc::peer_failure when nobody listens
// there (the process is gone), naming `who`.
UniqueFd connect_to(const std::string& address, const std::string& who);

// Identifies the running kernel (/proc/sys/kernel/random/boot_id): processes
// that can share CUDA memory see the same one, also across containers.
std::string boot_id();

// Raises this process's soft limit of open descriptors to its hard limit:
// the descriptors of a VMM range arrive by the hundred (one per chunk) and
// a packet whose descriptors do not fit is truncated by the kernel.
void raise_descriptor_limit();

// A random 64-bit value (from the kernel), never 0.
uint64_t random_u64();

}  // namespace weightsync::transport::cuda_ipc
