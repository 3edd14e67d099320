#include "ipc_transport.h"

#include <weightsync/error.h>

#include "transport/staging.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <thread>

namespace weightsync::transport::cuda_ipc {
namespace {

using Clock = std::chrono::steady_clock;
// How long a destructor waits for the peer to settle an operation, and for
// queued control packets to go out.
constexpr auto kReleaseWait = std::chrono::seconds(10);
// A registered buffer. Exported on its first receive (whole, so that later
// receives anywhere inside need no lookup), released with the registration.
class IpcRegion final : public MemoryRegion {
 public:
  IpcRegion(IpcTransport& t, const Buffer& b)
      : MemoryRegion(b.data, b.bytes, b.memory, b.device), transport_(t) {}
  ~IpcRegion() override {
    try {
      if (id_) transport_.unpin(id_);
    } catch (const Error&) {
      // A destructor must not throw; a peer that failed has no mapping left.
    }
  }
  uint64_t region_id() const {
    if (!id_) id_ = transport_.pin(Buffer{data(), bytes(), memory(), device(), nullptr});
    return id_;
  }

 private:
  IpcTransport& transport_;
  mutable uint64_t id_ = 0;
};

class IpcRequest final : public Request {
 public:
  IpcRequest(IpcTransport& t, std::shared_ptr<IpcOp> op)
      : Request(t.name(), op->kind, op->peer, op->tag, op->buffer.bytes),
        transport_(t),
        op_(std::move(op)) {}
  ~IpcRequest() override { transport_.release(op_); }

  bool test() override {
    if (!op_->done) transport_.progress();
    if (!op_->done) return false;
    if (op_->error) fail(op_->error->first, describe(), ": ", op_->error->second);
    return true;
  }
  void cancel() override { transport_.cancel(*op_); }
  std::size_t transferred() const override { return op_->transferred; }

 private:
  IpcTransport& transport_;
  std::shared_ptr<IpcOp> op_;
};

}  // namespace

uint64_t process_id() {
  static const uint64_t id = random_u64();
  return id;
}

IpcTransport::IpcTransport(const TransportOptions& options, std::unique_ptr<IpcMemory> memory,
                           std::string name)
    : options_(options),
      name_(std::move(name)),
      memory_(std::move(memory)),
      instance_(random_u64()),
      boot_id_(boot_id()),
      exports_(*memory_, [this](const ExportEntry& e) {
        for (auto& p : peers_) p.link->release(e);
      }) {
  raise_descriptor_limit();
  auto dir = options.params.find("socket_dir");
  listener_ = std::make_unique<Listener>(dir == options.params.end() ? "" : dir->second);
  peers_.resize(static_cast<std::size_t>(options_.world));
  for (int r = 0; r < options_.world; ++r) new_link(r);
  publish();
}

IpcTransport::~IpcTransport() {
  // The last completions may still wait in an outbox; a peer that exits
  // right after its send must not leave its receiver without them.
  const auto deadline = Clock::now() + kReleaseWait;
  for (;;) {
    flush_all();
    const bool idle = std::all_of(peers_.begin(), peers_.end(),
                                  [](const Peer& p) { return !p.out.open() || p.out.idle(); });
    if (idle || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void IpcTransport::new_link(int r) {
  peers_[r].link =
      std::make_unique<PeerLink>(r, *memory_, exports_, process_id(), [this, r](OutPacket packet) {
        // Called inside the link's methods: a failure here is recorded and
        // handled afterwards (lose() would change the link under its feet).
        Peer& p = peers_[r];
        if (!p.broken.empty()) return;
        try {
          ensure_connected(r);
          p.out.send(std::move(packet));
        } catch (const Error& e) {
          p.broken = e.what();
        }
      });
}

std::shared_ptr<char> IpcMemory::allocate_host(std::size_t bytes) {
  return heap_host_buffer(bytes);
}

Capabilities IpcTransport::capabilities() const {
  Capabilities c;
  c.host_memory = memory_->memory() == MemoryKind::host;
  c.cuda_memory = memory_->memory() == MemoryKind::cuda;
  c.native_broadcast = false;
  c.max_message_bytes = std::numeric_limits<std::size_t>::max();
  c.tag_bits = 64;
  c.maps_peer_memory = true;
  return c;
}

void IpcTransport::check_post(int peer, const Buffer& buffer, const char* what) const {
  if (peer < 0 || peer >= options_.world)
    fail(Errc::invalid_argument, name_, ": ", what, " rank ", peer, " outside world of ",
         options_.world);
  if (!buffer.data && buffer.bytes > 0)
    fail(Errc::invalid_argument, name_, ": ", what, " rank ", peer, ": null buffer of ",
         buffer.bytes, " bytes");
  if (buffer.memory != memory_->memory())
    fail(Errc::unsupported, name_, ": ", what, " rank ", peer, ": the ", buffer.bytes,
         "-byte buffer is in ", buffer.memory == MemoryKind::host ? "host" : "CUDA",
         " memory; this transport moves ",
         memory_->memory() == MemoryKind::host ? "host" : "CUDA device",
         " memory only (ucx reaches host memory)");
  if (buffer.region && !buffer.region->contains(buffer))
    fail(Errc::invalid_argument, name_, ": ", what, " rank ", peer,
         ": buffer lies outside its registered region");
}

void IpcTransport::check_alive(int peer, const char* what) {
  handle_failures();
  const PeerLink& link = *peers_[peer].link;
  if (link.failed())
    fail(Errc::peer_failure, name_, ": ", what, " rank ", peer, ": peer rank ", peer, " failed (",
         link.failure(), ")");
  try {
    ensure_connected(peer);
  } catch (const Error& e) {
    if (e.code() != Errc::peer_failure) throw;
    lose(peer, e.what());
    fail(Errc::peer_failure, name_, ": ", what, " rank ", peer, ": ", e.what());
  }
}

std::unique_ptr<MemoryRegion> IpcTransport::register_memory(const Buffer& buffer) {
  check_post(options_.rank, buffer, "register memory of");
  if (!buffer.data || buffer.bytes == 0)
    fail(Errc::invalid_argument, name_, ": cannot register an empty buffer");
  // Memory that cannot be shared is refused here rather than at a receive.
  memory_->locate(buffer);
  return std::make_unique<IpcRegion>(*this, buffer);
}

std::unique_ptr<Request> IpcTransport::send(int peer, Tag tag, const Buffer& buffer) {
  check_post(peer, buffer, "send to");
  check_alive(peer, "send to");
  auto op = std::make_shared<IpcOp>();
  op->kind = Request::Kind::send;
  op->peer = peer;
  op->tag = tag;
  op->buffer = buffer;
  peers_[peer].link->post_send(op);
  // A send that settled as it was posted (zero bytes, too large, a failed
  // copy) queued its completion: its sender may never progress again, so
  // that goes out now. A send that starts a copy queues nothing.
  if (peers_[peer].link->queued()) flush_peer(peers_[peer]);
  handle_failures();
  return std::make_unique<IpcRequest>(*this, std::move(op));
}

std::unique_ptr<Request> IpcTransport::recv(int peer, Tag tag, const Buffer& buffer) {
  check_post(peer, buffer, "receive from");
  check_alive(peer, "receive from");
  auto op = std::make_shared<IpcOp>();
  op->kind = Request::Kind::recv;
  op->peer = peer;
  op->tag = tag;
  op->buffer = buffer;
  const auto* region = dynamic_cast<const IpcRegion*>(buffer.region);
  peers_[peer].link->post_recv(op, region && buffer.bytes > 0 ? region->region_id() : 0);
  handle_failures();
  return std::make_unique<IpcRequest>(*this, std::move(op));
}

std::unique_ptr<Request> IpcTransport::expose(int peer, Tag tag,
                                              const std::vector<Buffer>& buffers) {
  std::vector<uint64_t> region_ids;
  region_ids.reserve(buffers.size());
  std::size_t bytes = 0;
  for (const Buffer& b : buffers) {
    check_post(peer, b, "lend memory to");
    const auto* region = dynamic_cast<const IpcRegion*>(b.region);
    region_ids.push_back(region && b.bytes > 0 ? region->region_id() : 0);
    bytes += b.bytes;
  }
  check_alive(peer, "lend memory to");
  auto op = std::make_shared<IpcOp>();
  op->kind = Request::Kind::expose;
  op->peer = peer;
  op->tag = tag;
  op->buffer = Buffer{nullptr, bytes, memory_->memory(), options_.device, nullptr};
  peers_[peer].link->post_expose(op, buffers, region_ids);
  flush_peer(peers_[peer]);  // the peer may be waiting for it already
  handle_failures();
  return std::make_unique<IpcRequest>(*this, std::move(op));
}

std::unique_ptr<Request> IpcTransport::map_exposed(int peer, Tag tag,
                                                   std::vector<void*>* addresses) {
  check_post(peer, Buffer{nullptr, 0, memory_->memory()}, "map the memory of");
  check_alive(peer, "map the memory of");
  auto op = std::make_shared<IpcOp>();
  op->kind = Request::Kind::map;
  op->peer = peer;
  op->tag = tag;
  op->buffer = Buffer{nullptr, 0, memory_->memory(), options_.device, nullptr};
  op->addresses = addresses;
  peers_[peer].link->post_map(op);
  if (peers_[peer].link->queued()) flush_peer(peers_[peer]);  // mapped at once: tell the peer
  handle_failures();
  return std::make_unique<IpcRequest>(*this, std::move(op));
}

void IpcTransport::connect(int peer) {
  check_post(peer, Buffer{nullptr, 0, memory_->memory()}, "connect to");
  check_alive(peer, "connect to");
}

bool IpcTransport::peer_failed(int peer) const {
  return peer >= 0 && peer < options_.world && peers_[peer].link->failed();
}

void IpcTransport::cancel(IpcOp& op) {
  peers_[op.peer].link->cancel(op);
  flush_peer(peers_[op.peer]);  // a receive's cancel asks the sender at once
  handle_failures();
}

void IpcTransport::release(const std::shared_ptr<IpcOp>& op) {
  try {
    if (op->done) return;
    cancel(*op);
    const auto deadline = Clock::now() + kReleaseWait;
    int spins = 0;
    while (!op->done && Clock::now() < deadline) {
      progress();
      poll_pause(spins);
    }
    // The peer never answered the cancel and might still write into the
    // buffer, which its owner is about to free: give the peer up.
    if (!op->done && (op->kind == Request::Kind::recv || op->kind == Request::Kind::expose))
      lose(op->peer,
           cat(op->kind == Request::Kind::recv ? "a receive of " : "a loan of ", op->buffer.bytes,
               " bytes was abandoned and rank ", op->peer, " did not confirm its cancellation"));
  } catch (const Error&) {
    // A destructor must not throw; the operation is failed or abandoned.
  }
}

// Deregistration is how a caller says the memory may be freed next, and
// freeing cudaMalloc memory that another process still has open is undefined
// in CUDA: so wait until every sender that mapped the region confirmed it
// unmapped it. A sender that does not answer within the bound (it stopped
// calling progress) is not waited for again until it answers one. VMM memory
// needs none of this: a mapping keeps its chunks alive.
void IpcTransport::unpin(uint64_t region_id) {
  exports_.unpin(region_id);
  // The release goes out now, not at the next progress(): a peer's mapping
  // of VMM memory keeps that memory allocated until it unmaps it.
  flush_all();
  const auto releasing = [&] {
    return std::any_of(peers_.begin(), peers_.end(),
                       [&](const Peer& p) { return p.link->releasing(region_id); });
  };
  const auto deadline = Clock::now() + kReleaseWait;
  int spins = 0;
  while (releasing() && Clock::now() < deadline) {
    progress();
    poll_pause(spins);
  }
  for (auto& p : peers_)
    if (p.link->releasing(region_id)) p.link->mark_slow();
}

void IpcTransport::lose(int peer, const std::string& why) {
  Peer& p = peers_[peer];
  p.link->lose(why);
  p.in.close();
  p.out.close();
  p.broken.clear();
}

void IpcTransport::handle_failures() {
  for (int r = 0; r < options_.world; ++r)
    if (!peers_[r].broken.empty()) lose(r, peers_[r].broken);
}

void IpcTransport::reconnect(int peer) {
  check_post(peer, Buffer{nullptr, 0, memory_->memory()}, "reconnect to");
  lose(peer, "replaced by a new process");
  Peer& p = peers_[peer];
  p.link->drain(kReleaseWait);  // sends copying into the old process finish first
  if (p.instance) p.stale.insert(p.instance);
  p.instance = 0;
  new_link(peer);
  exports_.forget_peer(peer);
  attach_waiting(peer);
}

void IpcTransport::flush_peer(Peer& p) {
  p.link->flush();  // its queued messages into the connection's outbox
  if (!p.out.open() || p.out.idle() || !p.broken.empty()) return;
  try {
    p.out.flush();
  } catch (const Error& e) {
    p.broken = e.what();
  }
}

void IpcTransport::flush_all() {
  for (auto& p : peers_) flush_peer(p);
}

}  // namespace weightsync::transport::cuda_ipc
