#include "nccl_transport.h"

#include <weightsync/error.h>

#include "builtin.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <thread>

namespace weightsync::transport::nccl {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kReleaseWait = std::chrono::seconds(10);
constexpr auto kGroupEnqueueWait = std::chrono::seconds(60);

void check_cuda(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) fail(Errc::transport, what, ": ", cudaGetErrorString(err));
}

class NoopRegion final : public MemoryRegion {
 public:
  explicit NoopRegion(const Buffer& b) : MemoryRegion(b.data, b.bytes, b.memory, b.device) {}
};

class NcclRequest final : public Request {
 public:
  NcclRequest(NcclTransport& t, std::shared_ptr<NcclOp> op, Kind kind, Tag tag)
      : Request("nccl", kind, op->peer, tag, op->bytes), transport_(t), op_(std::move(op)) {}

  ~NcclRequest() override {
    // The GPU may still write into the buffer: wait, and abort the
    // communicator if the operation does not finish.
    const auto deadline = Clock::now() + kReleaseWait;
    try {
      while (!transport_.poll(*op_)) {
        if (Clock::now() >= deadline) {
          transport_.abort(cat("an unfinished ", describe(), " was abandoned"));
          break;
        }
        std::this_thread::yield();
      }
    } catch (const Error&) {
    }
  }

  bool test() override { return transport_.poll(*op_); }
  std::size_t wait(std::chrono::milliseconds timeout) override {
    try {
      return Request::wait(timeout);
    } catch (const Error& e) {
      if (e.code() == Errc::timeout) transport_.abort(e.what());
      throw;
    }
  }
  void cancel() override { transport_.abort(cat(describe(), " was cancelled")); }
  std::size_t transferred() const override { return bytes(); }

 private:
  NcclTransport& transport_;
  std::shared_ptr<NcclOp> op_;
};

}  // namespace

NcclOp::~NcclOp() {
  if (done_event) cudaEventDestroy(done_event);
}

NcclTransport::NcclTransport(const TransportOptions& options)
    : rank_(options.rank), world_(options.world) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
    fail(Errc::unsupported,
         "nccl transport: no usable GPU here (cudaGetDeviceCount: ", cudaGetErrorString(err), ")");
  if (count == 0) fail(Errc::unsupported, "nccl transport: no CUDA device present");
  // Loaded only now: a process without a GPU never needs NCCL, and a libnccl
  // that weightsync loads stays in the process (see nccl_library.h).
  nccl_ = &nccl_library();
  if (options.device >= 0) {
    if (options.device >= count)
      fail(Errc::invalid_argument, "nccl transport: device ", options.device, " but only ", count,
           " present");
    check_cuda(cudaSetDevice(options.device), "nccl transport: cudaSetDevice");
  }
  check_cuda(cudaGetDevice(&device_), "nccl transport: cudaGetDevice");
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
             "nccl transport: cudaStreamCreate");
  try {
    init_communicator(options);
  } catch (...) {
    cudaStreamDestroy(stream_);
    throw;
  }
}

// A non-blocking communicator, so that a rank that never shows up costs a
// bounded wait and an abort instead of a hang.
void NcclTransport::init_communicator(const TransportOptions& options) {
  const std::string key = cat(options.prefix, "/nccl/unique_id");
  ncclUniqueId id{};
  if (rank_ == 0) {
    if (ncclResult_t r = nccl_->get_unique_id(&id); r != ncclSuccess)
      fail(Errc::transport, "nccl transport: ncclGetUniqueId: ", nccl_->get_error_string(r));
    const auto* p = reinterpret_cast<const uint8_t*>(&id);
    options.store->set(key, std::vector<uint8_t>(p, p + sizeof(id)));
  } else {
    const auto bytes = options.store->get(key, options.bootstrap_timeout);
    if (bytes.size() != sizeof(id))
      fail(Errc::format, "nccl transport: unique id under '", key, "' has ", bytes.size(),
           " bytes, expected ", sizeof(id));
    std::memcpy(&id, bytes.data(), sizeof(id));
  }
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclResult_t r = nccl_->comm_init_rank_config(&comm_, world_, id, rank_, &config);
  if (r != ncclSuccess && r != ncclInProgress)
    fail(Errc::transport, "nccl transport: ncclCommInitRankConfig (rank ", rank_, " of ", world_,
         "): ", nccl_->get_error_string(r));
  const auto deadline = Clock::now() + options.bootstrap_timeout;
  do {
    nccl_->comm_get_async_error(comm_, &r);
    if (r == ncclInProgress && Clock::now() >= deadline) {
      nccl_->comm_abort(comm_);
      comm_ = nullptr;
      fail(Errc::timeout, "nccl transport: rank ", rank_, " of ", world_,
           ": communicator not formed within ", options.bootstrap_timeout.count(), " ms");
    }
  } while (r == ncclInProgress);
  if (r != ncclSuccess) {
    const std::string detail = nccl_->get_last_error(comm_);
    nccl_->comm_abort(comm_);
    comm_ = nullptr;
    fail(Errc::transport, "nccl transport: joining the communicator: ", nccl_->get_error_string(r),
         " ", detail);
  }
}

NcclTransport::~NcclTransport() {
  if (comm_) {
    if (!aborted_) cudaStreamSynchronize(stream_);
    // Destroy flushes outstanding work; abort does not wait for peers.
    aborted_ ? nccl_->comm_abort(comm_) : nccl_->comm_destroy(comm_);
  }
  if (stream_) cudaStreamDestroy(stream_);
}

Capabilities NcclTransport::capabilities() const {
  Capabilities c;
  c.host_memory = false;
  c.cuda_memory = true;
  c.native_broadcast = true;
  c.max_message_bytes = std::numeric_limits<std::size_t>::max();
  c.tag_bits = 64;  // tags are not matched (see the header)
  c.ordered_only = true;
  return c;
}

std::unique_ptr<MemoryRegion> NcclTransport::register_memory(const Buffer& buffer) {
  if (buffer.memory != MemoryKind::cuda)
    fail(Errc::unsupported, "nccl transport: host memory is not supported (register ", buffer.bytes,
         " bytes)");
  return std::make_unique<NoopRegion>(buffer);
}

std::shared_ptr<NcclOp> NcclTransport::post(NcclOp::Call call, int peer, const Buffer& buffer,
                                            const char* what) {
  if (aborted_)
    fail(Errc::peer_failure, "nccl transport: ", what, " rank ", peer, ": communicator aborted (",
         abort_reason_, ")");
  if (peer < 0 || peer >= world_)
    fail(Errc::invalid_argument, "nccl transport: ", what, " rank ", peer, " outside world of ",
         world_);
  if (buffer.memory != MemoryKind::cuda)
    fail(Errc::unsupported, "nccl transport: ", what, " rank ", peer,
         ": host memory is not supported (CUDA device memory only)");
  auto op = std::make_shared<NcclOp>();
  op->call = call;
  op->data = buffer.data;
  op->bytes = buffer.bytes;
  op->peer = peer;
  // On the communicator's device: the event is recorded on its stream.
  check_cuda(cudaSetDevice(device_), "nccl transport: cudaSetDevice");
  check_cuda(cudaEventCreateWithFlags(&op->done_event, cudaEventDisableTiming),
             "nccl transport: cudaEventCreate");
  pending_.push_back(op);
  return op;
}

std::unique_ptr<Request> NcclTransport::send(int peer, Tag tag, const Buffer& buffer) {
  auto op = post(NcclOp::Call::send, peer, buffer, "send to");
  return std::make_unique<NcclRequest>(*this, std::move(op), Request::Kind::send, tag);
}

std::unique_ptr<Request> NcclTransport::recv(int peer, Tag tag, const Buffer& buffer) {
  auto op = post(NcclOp::Call::recv, peer, buffer, "receive from");
  return std::make_unique<NcclRequest>(*this, std::move(op), Request::Kind::recv, tag);
}

std::unique_ptr<Request> NcclTransport::broadcast(const Buffer& buffer, int root,
                                                  const std::vector<int>& ranks, Tag tag) {
  // The communicator spans the world: a broadcast to a subset fans out.
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  bool whole_world = static_cast<int>(sorted.size()) == world_;
  for (int i = 0; whole_world && i < world_; ++i) whole_world = sorted[i] == i;
  if (!whole_world) return Transport::broadcast(buffer, root, ranks, tag);
  auto op = post(NcclOp::Call::broadcast, root, buffer, "broadcast from");
  return std::make_unique<NcclRequest>(*this, std::move(op), Request::Kind::broadcast, tag);
}

void NcclTransport::issue_pending() {
  if (pending_.empty() || aborted_) return;
  check_cuda(cudaSetDevice(device_), "nccl transport: cudaSetDevice");
  nccl_->group_start();
  for (auto& op : pending_) {
    ncclResult_t r = ncclSuccess;
    switch (op->call) {
      case NcclOp::Call::send:
        r = nccl_->send(op->data, op->bytes, ncclUint8, op->peer, comm_, stream_);
        break;
      case NcclOp::Call::recv:
        r = nccl_->recv(op->data, op->bytes, ncclUint8, op->peer, comm_, stream_);
        break;
      case NcclOp::Call::broadcast:
        r = nccl_->broadcast(op->data, op->data, op->bytes, ncclUint8, op->peer, comm_, stream_);
        break;
    }
    if (r != ncclSuccess && r != ncclInProgress) {
      nccl_->group_end();
      pending_.clear();
      // A half-issued group leaves the communicator in an unknown state.
      const std::string why = cat("posting an operation with rank ", op->peer, ": ",
                                  nccl_->get_error_string(r), " ", nccl_->get_last_error(comm_));
      abort(why);
      fail(Errc::transport, "nccl transport: ", why);
    }
  }
  ncclResult_t r = nccl_->group_end();
  // A non-blocking communicator may still be enqueuing the group's kernels
  // (ncclInProgress, typically while connections to new peers form): an event
  // recorded now could land before them and complete at once. Wait until
  // NCCL is done with the group (bounded), then record.
  const auto deadline = Clock::now() + kGroupEnqueueWait;
  while (r == ncclInProgress) {
    nccl_->comm_get_async_error(comm_, &r);
    if (r == ncclInProgress && Clock::now() >= deadline) {
      pending_.clear();
      const std::string why = "ncclGroupEnd: the group was still being enqueued after 60 s";
      abort(why);
      fail(Errc::timeout, "nccl transport: ", why);
    }
    if (r == ncclInProgress) std::this_thread::yield();
  }
  if (r != ncclSuccess) {
    pending_.clear();
    const std::string why =
        cat("ncclGroupEnd: ", nccl_->get_error_string(r), " ", nccl_->get_last_error(comm_));
    abort(why);
    fail(Errc::transport, "nccl transport: ", why);
  }
  for (auto& op : pending_) {
    check_cuda(cudaEventRecord(op->done_event, stream_), "nccl transport: cudaEventRecord");
    op->issued = true;
  }
  pending_.clear();
}

void NcclTransport::check_async(const std::string& what) {
  ncclResult_t r = ncclSuccess;
  nccl_->comm_get_async_error(comm_, &r);
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string detail = nccl_->get_last_error(comm_);
    abort(cat("asynchronous error: ", nccl_->get_error_string(r)));
    fail(Errc::transport, "nccl transport: ", what, ": ", nccl_->get_error_string(r), " ", detail);
  }
}

void NcclTransport::progress() {
  if (aborted_) return;
  issue_pending();
  check_async("progress");
}

bool NcclTransport::poll(NcclOp& op) {
  if (op.complete) return true;
  if (aborted_)
    fail(Errc::peer_failure, "nccl transport: operation with rank ", op.peer,
         " lost: communicator aborted (", abort_reason_, ")");
  progress();
  if (!op.issued) return false;  // an unrecorded event would read as complete
  const cudaError_t e = cudaEventQuery(op.done_event);
  if (e == cudaErrorNotReady) return false;
  check_cuda(e, cat("nccl transport: operation with rank ", op.peer));
  op.complete = true;
  return true;
}

void NcclTransport::abort(const std::string& why) {
  if (aborted_) return;
  aborted_ = true;
  abort_reason_ = why;
  if (comm_) nccl_->comm_abort(comm_);
  comm_ = nullptr;
}

}  // namespace weightsync::transport::nccl

namespace weightsync::transport {

std::unique_ptr<Transport> make_nccl_transport(const TransportOptions& options) {
  return std::make_unique<nccl::NcclTransport>(options);
}

}  // namespace weightsync::transport
