// The NCCL transport: ncclSend/ncclRecv (and ncclBroadcast over the whole
// world) of CUDA device memory on one dedicated stream.
//
// Bootstrap: rank 0 creates the unique id and sets it in the Store under
// `<prefix>/nccl/unique_id`; every rank then joins a non-blocking
// communicator, bounded by bootstrap_timeout (aborted, not hung, on expiry).
//
// Operations posted between two progress calls are issued together in one
// ncclGroupStart/End, so that a rank may post a send and a receive to the same
// peer in either order without deadlocking the stream; each operation's
// completion is a CUDA event recorded after the group. NCCL matches messages
// by order, not by tag: both sides must post their operations with a peer in
// the same order and with equal sizes (NCCL cannot detect a size mismatch).
// Errors: the communicator's asynchronous error is polled with every test; a
// wait that times out aborts the communicator (ncclCommAbort) rather than
// hanging, after which the transport fails every operation.
//
// NCCL itself is loaded at run time, not linked (nccl_library.h): the one
// already in the process (PyTorch's) when there is one.
#pragma once

#include <weightsync/backend/transport.h>

#include "nccl_library.h"

#include <cuda_runtime_api.h>

#include <memory>
#include <vector>

namespace weightsync::transport::nccl {

// One posted operation, shared by its Request and the transport's queue.
struct NcclOp {
  enum class Call { send, recv, broadcast };
  Call call = Call::send;
  void* data = nullptr;
  std::size_t bytes = 0;
  int peer = 0;  // the root for a broadcast
  cudaEvent_t done_event = nullptr;
  bool issued = false;
  bool complete = false;
  ~NcclOp();
};

class NcclTransport final : public Transport {
 public:
  explicit NcclTransport(const TransportOptions& options);
  ~NcclTransport() override;

  std::string name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int world() const override { return world_; }
  Capabilities capabilities() const override;

  std::unique_ptr<MemoryRegion> register_memory(const Buffer& buffer) override;
  std::unique_ptr<Request> send(int peer, Tag tag, const Buffer& buffer) override;
  std::unique_ptr<Request> recv(int peer, Tag tag, const Buffer& buffer) override;
  std::unique_ptr<Request> broadcast(const Buffer& buffer, int root, const std::vector<int>& ranks,
                                     Tag tag) override;
  void progress() override;
  void connect(int peer) override {}
  bool peer_failed(int peer) const override { return aborted_; }

  // Used by NcclRequest: true once `op` finished; throws on communicator errors.
  bool poll(NcclOp& op);
  // Aborts the communicator (after a timeout or an abandoned operation).
  void abort(const std::string& why);

 private:
  void init_communicator(const TransportOptions& options);
  std::shared_ptr<NcclOp> post(NcclOp::Call call, int peer, const Buffer& buffer, const char* what);
  void issue_pending();
  void check_async(const std::string& what);

  int rank_;
  int world_;
  int device_ = 0;
  const NcclLibrary* nccl_ = nullptr;  // set once a GPU was found (the constructor)
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<std::shared_ptr<NcclOp>> pending_;  // posted, not yet issued
  bool aborted_ = false;
  std::string abort_reason_;
};

}  // namespace weightsync::transport::nccl
