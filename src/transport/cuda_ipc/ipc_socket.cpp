#include "ipc_socket.h"

#include <weightsync/error.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>

#include <fcntl.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#if defined(__SANITIZE_THREAD__)
#define WEIGHTSYNC_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define WEIGHTSYNC_TSAN 1
#endif
#endif
#ifdef WEIGHTSYNC_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace weightsync::transport::cuda_ipc {
namespace {

// A packet orders what its writer did before it before what its reader does
// after it: the memory a sender wrote before its completion, the params an
// engine lent after reading them. ThreadSanitizer cannot see that through a
// socket; where two transports of one process talk (threads of a test), it
// is told, with one sync object for every connection (release at each
// write, acquire at each read). Nothing in other builds.
#ifdef WEIGHTSYNC_TSAN
char packet_order;
void packet_written() {
  __tsan_release(&packet_order);
}
void packet_read() {
  __tsan_acquire(&packet_order);
}
#else
void packet_written() {}
void packet_read() {}
#endif

// How long connect_to() retries while the listener's backlog is full.
constexpr auto kConnectRetry = std::chrono::seconds(10);

std::string errno_text(int err) {
  return std::strerror(err);
}

// sockaddr_un for an address ('@' = abstract namespace); returns its length.
socklen_t make_sockaddr(const std::string& address, sockaddr_un& sa) {
  std::memset(&sa, 0, sizeof(sa));
  sa.sun_family = AF_UNIX;
  if (address.size() >= sizeof(sa.sun_path))
    fail(Errc::invalid_argument, "cuda_ipc: socket address '", address, "' is longer than ",
         sizeof(sa.sun_path) - 1, " bytes");
  std::memcpy(sa.sun_path, address.data(), address.size());
  if (!address.empty() && address[0] == '@') sa.sun_path[0] = '\0';
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size() +
                                (address[0] == '@' ? 0 : 1));
}

UniqueFd new_socket() {
  const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) fail(Errc::io, "cuda_ipc: socket(AF_UNIX, SOCK_SEQPACKET): ", errno_text(errno));
  return UniqueFd(fd);
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.release();
  }
  return *this;
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

int UniqueFd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void Connection::send(OutPacket packet) {
  if (packet.bytes.empty() || packet.bytes.size() > kMaxPacketBytes ||
      packet.fds.size() > kMaxPacketFds)
    fail(Errc::internal, "cuda_ipc: packet of ", packet.bytes.size(), " bytes and ",
         packet.fds.size(), " descriptors is outside the channel's limits");
  packet_written();
  outbox_.push_back(std::move(packet));
  flush();
}

bool Connection::flush() {
  while (!outbox_.empty()) {
    if (!fd_) fail(Errc::io, "cuda_ipc: the connection is closed");
    OutPacket& p = outbox_.front();
    iovec iov{p.bytes.data(), p.bytes.size()};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    std::vector<char> control;
    if (!p.fds.empty()) {
      control.assign(CMSG_SPACE(sizeof(int) * p.fds.size()), 0);
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * p.fds.size());
      std::memcpy(CMSG_DATA(c), p.fds.data(), sizeof(int) * p.fds.size());
    }
    const ssize_t n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      if (errno == EINTR) continue;
      fail(Errc::io, "cuda_ipc: sendmsg: ", errno_text(errno));
    }
    outbox_.pop_front();  // a SEQPACKET send is all or nothing
  }
  return true;
}

bool Connection::receive(InPacket& packet) {
  if (!fd_) fail(Errc::io, "cuda_ipc: the connection is closed");
  packet.bytes.resize(kMaxPacketBytes);
  packet.fds.clear();
  iovec iov{packet.bytes.data(), packet.bytes.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxPacketFds));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = ::recvmsg(fd_.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
  // Take ownership of passed descriptors before anything can throw.
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    std::vector<int> fds(count);
    std::memcpy(fds.data(), CMSG_DATA(c), count * sizeof(int));
    for (int fd : fds) packet.fds.emplace_back(fd);
  }
  if (n < 0) fail(Errc::io, "cuda_ipc: recvmsg: ", errno_text(errno));
  // Every packet of the protocol has a header, so an empty read is the end.
  if (n == 0)
    fail(
        Errc::io,
        "cuda_ipc: the other process closed the connection (it exited or destroyed its transport)");
  if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))
    fail(Errc::format, "cuda_ipc: a packet exceeded ", kMaxPacketBytes, " bytes or ", kMaxPacketFds,
         " descriptors");
  packet.bytes.resize(static_cast<std::size_t>(n));
  packet_read();
  return true;
}

void Connection::close() {
  fd_ = UniqueFd();
  outbox_.clear();
}

Listener::Listener(const std::string& dir) {
  fd_ = new_socket();
  // A random name: several transports (worlds, ranks) may live in one process.
  const std::string name = cat("weightsync-cuda_ipc-", ::getpid(), "-", hex64(random_u64()));
  address_ = dir.empty() ? "@" + name : dir + "/" + name;
  sockaddr_un sa;
  const socklen_t len = make_sockaddr(address_, sa);
  if (::bind(fd_.get(), reinterpret_cast<sockaddr*>(&sa), len) != 0)
    fail(Errc::io, "cuda_ipc: bind ", address_, ": ", errno_text(errno));
  if (::listen(fd_.get(), 256) != 0)
    fail(Errc::io, "cuda_ipc: listen ", address_, ": ", errno_text(errno));
}

Listener::~Listener() {
  if (!address_.empty() && address_[0] != '@') ::unlink(address_.c_str());
}

UniqueFd Listener::accept() {
  for (;;) {
    const int fd = ::accept4(fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) return UniqueFd(fd);
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return UniqueFd();
    fail(Errc::io, "cuda_ipc: accept on ", address_, ": ", errno_text(errno));
  }
}

UniqueFd connect_to(const std::string& address, const std::string& who) {
  if (address.empty()) fail(Errc::invalid_argument, "cuda_ipc: empty socket address for ", who);
  UniqueFd fd = new_socket();
  sockaddr_un sa;
  const socklen_t len = make_sockaddr(address, sa);
  const auto deadline = std::chrono::steady_clock::now() + kConnectRetry;
  for (;;) {
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), len) == 0) return fd;
    const int err = errno;
    if (err == EINTR) continue;
    // A full backlog: the listener's process is alive but has not accepted yet.
    if ((err == EAGAIN || err == EWOULDBLOCK) && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    if (err == ECONNREFUSED || err == ENOENT)
      fail(Errc::peer_failure, "cuda_ipc: ", who, " does not listen at ", address, " (",
           errno_text(err), "): its process has exited");
    fail(Errc::io, "cuda_ipc: connecting to ", who, " at ", address, ": ", errno_text(err));
  }
}

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

void raise_descriptor_limit() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) == 0 && r.rlim_cur < r.rlim_max) {
    r.rlim_cur = r.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &r);  // best effort: a refusal leaves the old limit
  }
}

uint64_t random_u64() {
  uint64_t v = 0;
  while (v == 0)
    if (::getrandom(&v, sizeof(v), 0) != sizeof(v))
      fail(Errc::io, "cuda_ipc: getrandom: ", errno_text(errno));
  return v;
}

}  // namespace weightsync::transport::cuda_ipc
