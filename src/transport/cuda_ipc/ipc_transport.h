// The cuda_ipc transport: messages between processes of one node written by
// the sender straight into the receiver's memory (CUDA IPC), with a control
// channel of Unix-domain sockets. See docs/transports.md.
//
// Bootstrap: each transport listens on a fresh Unix socket (abstract
// namespace unless params["socket_dir"] is given) and publishes
// "<prefix>/cuda_ipc/address/<rank>" = its instance id, boot id and socket
// address. On first contact with a peer it connects to the peer's socket and
// says hello; the peer does the same the other way when it first needs us,
// so each pair has two connections, each written by the side that made it.
//
// Liveness: a process that dies closes its sockets, which the other side
// reads as end-of-file on the next progress(): every pending operation with
// it then fails with Errc::peer_failure. A connect refused at first contact
// (nobody listens: the process is gone) is a peer failure too.
//
// The memory side (IpcMemory) is given at construction: CUDA memory for
// "cuda_ipc" (cuda_memory.cpp), host memory shared with memfd descriptors
// for "ipc_host" (ipc_host_memory.h), its stand-in on machines without a GPU.
#pragma once

#include <weightsync/backend/transport.h>

#include "ipc_exports.h"
#include "ipc_memory.h"
#include "ipc_peer.h"
#include "ipc_socket.h"

#include <memory>
#include <set>
#include <string>
#include <vector>

#include <poll.h>

namespace weightsync::transport::cuda_ipc {

class IpcTransport final : public Transport {
 public:
  IpcTransport(const TransportOptions& options, std::unique_ptr<IpcMemory> memory,
               std::string name);
  ~IpcTransport() override;

  std::string name() const override { return name_; }
  int rank() const override { return options_.rank; }
  int world() const override { return options_.world; }
  Capabilities capabilities() const override;

  std::unique_ptr<MemoryRegion> register_memory(const Buffer& buffer) override;
  std::unique_ptr<Request> send(int peer, Tag tag, const Buffer& buffer) override;
  std::unique_ptr<Request> recv(int peer, Tag tag, const Buffer& buffer) override;
  std::unique_ptr<Request> expose(int peer, Tag tag, const std::vector<Buffer>& buffers) override;
  std::unique_ptr<Request> map_exposed(int peer, Tag tag, std::vector<void*>* addresses) override;
  void progress() override;
  void connect(int peer) override;
  bool peer_failed(int peer) const override;
  void reconnect(int peer) override;
  std::shared_ptr<char> allocate_host(std::size_t bytes) override {
    return memory_->allocate_host(bytes);
  }

  // Used by requests and regions.
  void cancel(IpcOp& op);
  void release(const std::shared_ptr<IpcOp>& op);  // the Request is going away
  // Drops a registration; when it was the region's last, waits (bounded)
  // until the senders that mapped the region have unmapped it.
  void unpin(uint64_t region_id);
  uint64_t pin(const Buffer& buffer) { return exports_.pin(buffer); }

 private:
  struct Peer {
    std::unique_ptr<PeerLink> link;
    Connection out;            // made by us: carries our messages to the peer
    Connection in;             // made by the peer: carries its messages to us
    uint64_t instance = 0;     // the peer process's transport id, once known
    std::set<uint64_t> stale;  // ids of processes that held the rank before
    std::string broken;        // a connection failure not yet handled (see new_link)
  };
  struct Pending {  // an accepted connection, before its hello
    Connection conn;
    int rank = -1;
    uint64_t instance = 0;
  };

  void check_post(int peer, const Buffer& buffer, const char* what) const;
  void check_alive(int peer, const char* what);
  void publish();
  void ensure_connected(int peer);
  void new_link(int peer);
  void accept_pending();
  void read_pending(Pending& p);
  bool try_attach(Pending& p);
  void attach_waiting(int peer);
  bool read_in(int peer);
  void read_peer(int peer);
  void lose(int peer, const std::string& why);
  void handle_failures();
  void flush_peer(Peer& p);
  void flush_all();

  TransportOptions options_;
  std::string name_;
  std::unique_ptr<IpcMemory> memory_;
  uint64_t instance_;
  std::string boot_id_;
  std::unique_ptr<Listener> listener_;
  ExportTable exports_;
  std::vector<Peer> peers_;
  std::vector<Pending> pending_;  // accepted, not yet attached to a peer
  std::vector<pollfd> poll_fds_;  // progress()'s, kept to reuse the allocation
};

// The id of this process for cuda_ipc: a region exported by the same process
// is used directly (CUDA does not open a process's own IPC handles).
uint64_t process_id();

}  // namespace weightsync::transport::cuda_ipc
