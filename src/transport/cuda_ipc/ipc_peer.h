// The cuda_ipc protocol with one peer, both roles at once: as receiver it
// announces regions and posts receives to the peer; as sender it matches the
// peer's posted receives with local sends (per tag, in posting order), copies
// each message straight into the peer's mapped memory and signals its
// completion. No sockets and no CUDA here: packets go out through a sink and
// come in through on_packet(), memory is reached through IpcMemory, so the
// whole protocol is unit-tested in one process with host memory.
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/error.h>

#include "ipc_exports.h"
#include "ipc_memory.h"
#include "ipc_wire.h"

#include <chrono>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace weightsync::transport::cuda_ipc {

// One posted operation, shared by its Request and the peer link.
struct IpcOp {
  Request::Kind kind = Request::Kind::send;
  int peer = 0;
  Tag tag = 0;
  Buffer buffer;  // as posted
  bool done = false;
  std::size_t transferred = 0;
  // Set when done with a failure: the code and what happened, without the
  // request's description (the Request prefixes it).
  std::optional<std::pair<Errc, std::string>> error;
  // Receive: its id in the pair, and whether a cancel was sent for it.
  uint64_t recv_id = 0;
  bool cancelling = false;
  // Send while its copy runs: the mapping it writes into and the copy.
  // Declared in this order so that the copy (whose destructor waits for
  // it) goes first, and the memory it writes into stays mapped until then.
  std::shared_ptr<Mapping> mapping;
  std::unique_ptr<Copy> copy;
  uint64_t target_recv = 0;
  // Map (sender): where the lent buffers' addresses go once mapped; null
  // declines the loan.
  std::vector<void*>* addresses = nullptr;
  // Set when the peer was lost while the copy ran: the send fails with this
  // once the copy is done, since until then the device still reads its buffer.
  std::optional<std::string> lost;

  void finish(std::size_t bytes);
  void set_error(Errc code, std::string why);
};

class PeerLink {
 public:
  using Sink = std::function<void(OutPacket)>;
  // `process_id` identifies this process: a region exported by it is used
  // directly instead of being imported.
  PeerLink(int peer, IpcMemory& memory, ExportTable& exports, uint64_t process_id, Sink sink);
  ~PeerLink();

  // Receiver: posts `op` (a receive into op->buffer; `region_id` is the
  // registered region holding it, or 0).
  void post_recv(const std::shared_ptr<IpcOp>& op, uint64_t region_id);
  // Sender: queues `op` (a send of op->buffer) and matches it if it can.
  void post_send(const std::shared_ptr<IpcOp>& op);
  // Receiver: lends `buffers` (region_ids[i]: the registered region holding
  // buffers[i], or 0) to the peer as `op` (kind expose, op->buffer.bytes
  // their bytes in all): announces their regions, then the expose messages.
  void post_expose(const std::shared_ptr<IpcOp>& op, const std::vector<Buffer>& buffers,
                   const std::vector<uint64_t>& region_ids);
  // Sender: queues `op` (kind map) for the peer's next expose with its tag,
  // and maps that when it is already here.
  void post_map(const std::shared_ptr<IpcOp>& op);
  // Asks for `op` to be withdrawn (see transport.h's cancel()).
  void cancel(IpcOp& op);
  // A packet from the peer (one message or a batch). Errc::protocol when it
  // breaks the protocol.
  void on_packet(InPacket packet);
  // Messages to the peer wait in this link until flush() (the transport
  // flushes once per progress pass), and go out then in as few packets as
  // they fit: the receives posted in one go and the completions found in one
  // pass cost one write. A message passing descriptors flushes those before it.
  void flush();
  std::size_t queued() const { return out_.size(); }
  // Advances running copies; true when something completed.
  bool poll();
  // Tells the peer that a region it may have mapped is gone. For memory that
  // must be unmapped before it is freed, releasing(id) stays true until the
  // peer confirms it unmapped it (or failed), unless the peer was found slow.
  void release(const ExportEntry& entry);
  bool releasing(uint64_t region_id) const { return !slow_ && releasing_.count(region_id) > 0; }
  // The peer let a release wait out its bound (it does not call progress):
  // later releases do not wait for it until it confirms one.
  void mark_slow() { slow_ = true; }
  // The peer died or was replaced: every pending operation fails with
  // Errc::peer_failure (`why` says what happened), and mappings are dropped
  // (each running copy keeps its own). A send whose copy runs fails when the
  // copy is done (poll()): its buffer is in use until then.
  void lose(const std::string& why);
  // Polls until no copy runs (after lose(), before the link is dropped);
  // bounded by `timeout`, after which the remaining sends fail at once.
  void drain(std::chrono::milliseconds timeout);
  bool failed() const { return failed_; }
  const std::string& failure() const { return failure_; }
  // Operations not complete (for bounded waits and tests).
  std::size_t pending() const;

 private:
  struct RemoteRegion {
    RegionMsg msg;
    std::vector<UniqueFd> fds;
    std::shared_ptr<Mapping> mapping;
    std::string error;  // an import that failed stays failed
  };
  void announce(ExportEntry& entry);
  void send(const Message& m, SharedFds owner = nullptr, std::vector<int> fds = {});
  void dispatch(Message m, std::vector<UniqueFd> fds);
  void on_region(RegionMsg m, std::vector<UniqueFd> fds);
  void on_region_more(const RegionMore& m, std::vector<UniqueFd> fds);
  void on_release(const Release& m);
  void on_released(const Released& m);
  void on_recv_posted(const RecvPosted& m);
  void on_cancel(const Cancel& m);
  void on_cancelled(const Cancelled& m);
  void on_complete(const Complete& m);
  void on_expose(Expose m);
  void match(Tag tag);
  void match_maps(Tag tag);
  void map_exposed(IpcOp& op, const Expose& e);
  void start(const std::shared_ptr<IpcOp>& op, const RecvPosted& r);
  std::shared_ptr<Mapping> mapping(uint64_t region_id, std::size_t end);
  void sender_failed(IpcOp& op, uint64_t recv_id, Errc code, const std::string& why);
  std::shared_ptr<IpcOp> take_recv(uint64_t recv_id, const char* what);

  int peer_;
  IpcMemory& memory_;
  ExportTable& exports_;
  uint64_t process_id_;
  Sink sink_;
  std::vector<std::vector<uint8_t>> out_;      // encoded messages not yet flushed
  std::size_t out_bytes_ = kBatchHeaderBytes;  // their batch's size
  bool failed_ = false;
  std::string failure_;
  // Receiver side.
  uint64_t next_recv_id_ = 1;
  std::map<uint64_t, std::shared_ptr<IpcOp>> recvs_;
  std::set<uint64_t> releasing_;  // regions released, not yet confirmed unmapped
  bool slow_ = false;
  // Sender side.
  std::map<Tag, std::deque<std::shared_ptr<IpcOp>>> sends_;
  std::map<Tag, std::deque<RecvPosted>> remote_recvs_;
  std::map<uint64_t, Tag> remote_index_;        // recv id -> tag, for cancels
  std::deque<std::shared_ptr<IpcOp>> copying_;  // in start order
  std::map<uint64_t, RemoteRegion> regions_;
  std::map<Tag, std::deque<std::shared_ptr<IpcOp>>> maps_;
  std::map<uint64_t, Expose> partial_exposes_;        // by id, until all entries came
  std::map<Tag, std::deque<Expose>> remote_exposes_;  // whole, not yet mapped
  std::map<uint64_t, Tag> expose_index_;              // expose id -> tag, for cancels
};

}  // namespace weightsync::transport::cuda_ipc
