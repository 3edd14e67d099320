// The cuda_ipc transport's connections: publishing this process's address,
// first contact with a peer, accepting the peers' connections and reading
// their packets (see ipc_transport.h for the scheme).
#include <weightsync/error.h>

#include "ipc_transport.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <sstream>
#include <thread>

namespace weightsync::transport::cuda_ipc {
namespace {

// Packets read from one connection per progress() call, so that one busy
// peer cannot starve the others.
constexpr int kReadBudget = 256;

std::string address_key(const std::string& prefix, int rank) {
  return cat(prefix, "/cuda_ipc/address/", rank);
}

struct Address {
  uint64_t instance = 0;
  std::string boot_id;
  std::string socket;
};

std::vector<uint8_t> encode_address(const Address& a) {
  const std::string text = cat(a.instance, "\n", a.boot_id, "\n", a.socket);
  return std::vector<uint8_t>(text.begin(), text.end());
}

Address decode_address(const std::vector<uint8_t>& bytes, const std::string& key) {
  std::istringstream in(std::string(bytes.begin(), bytes.end()));
  Address a;
  std::string instance;
  if (!std::getline(in, instance) || !std::getline(in, a.boot_id) || !std::getline(in, a.socket) ||
      a.socket.empty() || instance.empty() ||
      instance.find_first_not_of("0123456789") != std::string::npos)
    fail(Errc::format, "cuda_ipc: malformed address under '", key, "'");
  a.instance = std::stoull(instance);
  return a;
}

// The peer's published address; after reconnect(), one of a process other
// than those that held the rank before (the new one may not have published
// yet).
Address lookup_address(Store& store, const std::string& key, const std::set<uint64_t>& stale,
                       std::chrono::milliseconds timeout, int rank) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    Address a = decode_address(store.get(key, std::max(left, std::chrono::milliseconds(0))), key);
    if (!stale.count(a.instance)) return a;
    if (std::chrono::steady_clock::now() >= deadline)
      fail(Errc::timeout, "cuda_ipc: rank ", rank,
           " was taken by a new process, which did not publish its address within ",
           timeout.count(), " ms");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace

void IpcTransport::publish() {
  options_.store->set(address_key(options_.prefix, options_.rank),
                      encode_address({instance_, boot_id_, listener_->address()}));
}

void IpcTransport::ensure_connected(int r) {
  Peer& p = peers_[r];
  if (p.out.open()) return;
  if (p.link->failed())
    fail(Errc::peer_failure, "peer rank ", r, " failed (", p.link->failure(), ")");
  const Address a = lookup_address(*options_.store, address_key(options_.prefix, r), p.stale,
                                   options_.bootstrap_timeout, r);
  if (a.boot_id != boot_id_)
    fail(Errc::unsupported, name_, ": rank ", r, " runs under another kernel (boot id ", a.boot_id,
         ", here ", boot_id_, "); ", name_, " connects processes of one node only");
  if (p.instance && p.instance != a.instance)
    fail(Errc::peer_failure, "rank ", r, " was taken by a new process (reconnect() to it)");
  p.out = Connection(connect_to(a.socket, cat("rank ", r)));
  p.instance = a.instance;
  p.out.send(OutPacket{
      encode(Hello{options_.rank, options_.world, instance_, options_.prefix}), nullptr, {}});
  attach_waiting(r);
}

void IpcTransport::accept_pending() {
  for (UniqueFd fd = listener_->accept(); fd; fd = listener_->accept())
    pending_.push_back(Pending{Connection(std::move(fd)), -1, 0});
}

// The first packet of an accepted connection says who connected.
void IpcTransport::read_pending(Pending& p) {
  try {
    InPacket packet;
    if (!p.conn.receive(packet)) return;
    const Message m = decode(packet.bytes);
    const auto* hello = std::get_if<Hello>(&m);
    // Not one of this world's transports (another world's, a stray process):
    // it gets nothing.
    if (!hello || hello->prefix != options_.prefix || hello->world != options_.world ||
        hello->rank < 0 || hello->rank >= options_.world) {
      p.conn.close();
      return;
    }
    p.rank = hello->rank;
    p.instance = hello->instance;
    try_attach(p);
  } catch (const Error&) {
    p.conn.close();  // it closed or sent garbage before its hello
  }
}

// Attaches an identified connection as its rank's incoming one, when it is
// from the process this transport talks to for that rank. One from a process
// that took the rank while the old one is still attached or failed waits
// for reconnect(); one from a replaced process is dropped. True when used.
bool IpcTransport::try_attach(Pending& p) {
  Peer& peer = peers_[p.rank];
  if (peer.stale.count(p.instance)) {
    p.conn.close();
    return true;
  }
  if (peer.in.open() || peer.link->failed() || (peer.instance && peer.instance != p.instance))
    return false;
  peer.in = std::move(p.conn);
  p.conn.close();
  peer.instance = p.instance;
  return true;
}

void IpcTransport::attach_waiting(int r) {
  for (Pending& p : pending_)
    if (p.rank == r && p.conn.open() && try_attach(p) && peers_[r].in.open()) return;
}

// Reads the peer's packets; true when none is left waiting.
bool IpcTransport::read_in(int r) {
  Peer& p = peers_[r];
  InPacket packet;
  for (int n = 0; n < kReadBudget; ++n) {
    if (!p.broken.empty() || !p.in.open() || !p.in.receive(packet)) return true;
    p.link->on_packet(std::move(packet));
  }
  return false;
}

void IpcTransport::read_peer(int r) {
  Peer& p = peers_[r];
  try {
    // The connection this side made is looked at first (the peer never
    // writes on it: readable means closed). Once it is closed, every packet
    // the peer sent is waiting on its own connection, and all of them are
    // read before the end counts: a peer that completed a message and exited
    // leaves that message complete. Looked at after the packets, a last one
    // could arrive in between and be lost.
    std::optional<Error> closed;
    if (p.out.open()) {
      InPacket packet;
      try {
        if (p.out.receive(packet))
          fail(Errc::protocol, "cuda_ipc: rank ", r, " wrote on the connection this process made");
      } catch (const Error& e) {
        if (e.code() != Errc::io) throw;
        closed = e;
      }
    }
    if (!closed) {
      read_in(r);
      return;
    }
    if (!p.in.open()) {
      // Its own connection is not attached: it may have connected, sent and
      // exited since the listener was polled.
      accept_pending();
      for (Pending& q : pending_)
        if (q.rank < 0 && q.conn.open()) read_pending(q);
    }
    while (!read_in(r)) {
    }
    throw *closed;
  } catch (const Error& e) {
    if (p.broken.empty()) p.broken = e.what();
  }
}

void IpcTransport::progress() {
  // One poll() over the listener and the peers' sockets, then reads only
  // where something waits.
  poll_fds_.clear();
  poll_fds_.push_back(pollfd{listener_->fd(), POLLIN, 0});
  std::vector<int> rank_of;  // per poll entry after the listener
  for (int r = 0; r < options_.world; ++r)
    for (const Connection* c : {&peers_[r].in, &peers_[r].out})
      if (c->open()) {
        poll_fds_.push_back(pollfd{c->fd(), POLLIN, 0});
        rank_of.push_back(r);
      }
  if (::poll(poll_fds_.data(), poll_fds_.size(), 0) < 0 && errno != EINTR)
    fail(Errc::io, name_, ": poll: ", std::strerror(errno));
  // New connections first, hello and all: a peer that connected, sent and
  // exited must have its packets read before its end-of-file is.
  if (poll_fds_[0].revents) accept_pending();
  for (Pending& p : pending_)
    if (p.rank < 0 && p.conn.open()) read_pending(p);
  std::erase_if(pending_, [](const Pending& p) { return !p.conn.open(); });
  for (std::size_t i = 1; i < poll_fds_.size(); ++i)
    if (poll_fds_[i].revents) read_peer(rank_of[i - 1]);
  for (auto& p : peers_) p.link->poll();
  flush_all();
  handle_failures();
}

}  // namespace weightsync::transport::cuda_ipc
