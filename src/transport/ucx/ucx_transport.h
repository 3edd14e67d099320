// The UCX transport: UCP tag send/receive between the ranks of one world.
//
// One UCP context and one worker per transport, progressed from the caller's
// thread (UCS_THREAD_MODE_SINGLE; see transport.h). Endpoints are created on
// first contact with a peer from the worker address it published in the Store,
// with peer error handling: when UCX reports a peer unreachable (TCP reset,
// shared-memory keepalive finding the process gone) the peer is marked failed,
// its pending receives are cancelled and every operation with it fails with
// Errc::peer_failure. A receive creates the endpoint to its sender too, so
// that the death of a sender is noticed.
//
// UCP tags carry the sender rank in their top 16 bits: a receive from rank r
// matches only messages r sent, and user tags are limited to 48 bits.
#pragma once

#include <weightsync/backend/transport.h>

#include "ucx_worker.h"

#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

namespace weightsync::transport::ucx {

class UcxTransport;

// State shared by a Request and UCX's completion callback. Owned by the
// transport so that a callback never writes to freed memory, even when the
// Request was destroyed first.
struct UcxOp {
  UcxTransport* transport = nullptr;
  Request::Kind kind = Request::Kind::send;
  int peer = 0;
  Tag tag = 0;
  std::size_t bytes = 0;
  void* ucx_request = nullptr;  // until completion
  bool done = false;
  bool orphaned = false;        // its Request is gone: free on completion
  bool peer_failed = false;     // completed (or cancelled) because the peer failed
  bool user_cancelled = false;  // completed by Request::cancel()
  ucs_status_t status = UCS_OK;
  ucp_tag_recv_info_t info{};
};

struct UcxPeer {
  UcxTransport* transport = nullptr;
  int rank = 0;
  ucp_ep_h ep = nullptr;
  bool failed = false;
  bool failure_handled = false;
  bool sent = false;    // a send over `ep` is not known to be settled (its close then flushes)
  std::string failure;  // why, for messages
  std::vector<uint8_t> address;        // the worker address the endpoint was made for
  std::vector<uint8_t> stale_address;  // after reconnect(): the old process's address
};

class UcxTransport final : public Transport {
 public:
  explicit UcxTransport(const TransportOptions& options);
  ~UcxTransport() override;

  std::string name() const override { return "ucx"; }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Capabilities capabilities() const override;

  std::unique_ptr<MemoryRegion> register_memory(const Buffer& buffer) override;
  std::unique_ptr<Request> send(int peer, Tag tag, const Buffer& buffer) override;
  std::unique_ptr<Request> recv(int peer, Tag tag, const Buffer& buffer) override;
  void progress() override;
  void connect(int peer) override;
  bool peer_failed(int peer) const override;
  void reconnect(int peer) override;
  void sends_settled() override;

  // Used by UcxRequest.
  void cancel(UcxOp& op);
  void release(UcxOp* op);  // the Request is done with `op`
  std::string peer_failure(int peer) const { return peers_.at(peer).failure; }

  // Used by the UCX callbacks.
  void on_peer_error(UcxPeer& peer, ucs_status_t status);
  void on_complete(UcxOp* op, void* request, ucs_status_t status);

 private:
  void check_post(int peer, Tag tag, const Buffer& buffer, const char* what) const;
  void describe_buffer(ucp_request_param_t& param, const Buffer& buffer) const;
  void check_alive(int peer, const char* what) const;
  ucp_ep_h endpoint(int peer);
  std::vector<uint8_t> fresh_address(const UcxPeer& p);
  UcxOp* new_op(Request::Kind kind, int peer, Tag tag, std::size_t bytes);
  std::unique_ptr<Request> finish_post(UcxOp* op, ucs_status_ptr_t posted, const char* what);
  void handle_failures();
  void mark_failed(UcxPeer& peer, const std::string& why);
  void close_endpoints();

  TransportOptions options_;
  int rank_;
  int world_;
  std::unique_ptr<UcxWorker> worker_;
  std::vector<UcxPeer> peers_;
  std::unordered_set<UcxOp*> ops_;  // every op not yet freed
  // Endpoints of failed or replaced peers, kept open until the transport
  // ends: force-closing a UCX 1.13 tcp endpoint while its connection is in
  // flight left the tcp transport calling through the freed endpoint once a
  // new process reconnected from the same host (a trainer crash).
  std::vector<ucp_ep_h> retired_;
  bool failures_pending_ = false;
  bool peer_errors_ = true;          // endpoints in UCP_ERR_HANDLING_MODE_PEER
  bool peer_errors_forced_ = false;  // set by params["peer_errors"], no fallback
  bool cuda_memory_ = false;         // UCX moves CUDA memory and params["cuda"] allows it
  std::string no_cuda_;              // why not, for messages
};

}  // namespace weightsync::transport::ucx
