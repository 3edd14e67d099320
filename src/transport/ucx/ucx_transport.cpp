#include "ucx_transport.h"

#include <weightsync/error.h>

#include "builtin.h"

#include <chrono>
#include <cstdlib>
#include <limits>
#include <set>
#include <sstream>
#include <thread>

namespace weightsync::transport::ucx {
namespace {

constexpr int kRankBits = 16;
constexpr int kTagBits = 64 - kRankBits;
constexpr Tag kTagLimit = Tag{1} << kTagBits;
// How long a destructor waits for UCX to let go of a buffer.
constexpr auto kReleaseWait = std::chrono::seconds(10);

ucp_tag_t wire_tag(int sender, Tag tag) {
  return (ucp_tag_t(sender) << kTagBits) | tag;
}

std::string address_key(const std::string& prefix, int rank) {
  return cat(prefix, "/ucx/address/", rank);
}

// What a rank publishes: its incarnation (8 bytes, little-endian; 0 when
// unknown), then its worker address.
constexpr size_t kIncarnationBytes = 8;

std::vector<uint8_t> published(uint64_t incarnation, const std::vector<uint8_t>& address) {
  std::vector<uint8_t> out(kIncarnationBytes);
  for (size_t i = 0; i < kIncarnationBytes; ++i)
    out[i] = static_cast<uint8_t>(incarnation >> (8 * i));
  out.insert(out.end(), address.begin(), address.end());
  return out;
}

// The transports UCX may use: params["tls"], else the user's UCX_TLS (UCX
// reads it itself; it is read here only to know whether tcp is among them).
std::string selected_tls(const TransportOptions& options) {
  if (auto it = options.params.find("tls"); it != options.params.end()) return it->second;
  const char* env = std::getenv("UCX_TLS");
  return env ? env : "";
}

bool is_shared_memory(const std::string& tl) {
  static const std::set<std::string> shm{"self",  "posix", "sysv", "cma", "knem",
                                         "xpmem", "shm",   "sm",   "mm"};
  return shm.count(tl) > 0;
}

// Whether endpoints ask UCX to report peer failures. UCX 1.13's shared-memory
// transports cannot, and asking excludes them; so with only those selected,
// do not ask (dead peers then show as timeouts). params["peer_errors"]:
// "on", "off" or "auto" (the default).
bool want_peer_errors(const TransportOptions& options, bool& forced) {
  const auto mode =
      options.params.count("peer_errors") ? options.params.at("peer_errors") : std::string("auto");
  forced = mode != "auto";
  if (mode == "on") return true;
  if (mode == "off") return false;
  if (mode != "auto")
    fail(Errc::invalid_argument, "ucx transport: peer_errors=", mode,
         " (expected on, off or auto)");
  const std::string tls = selected_tls(options);
  if (tls.empty() || tls[0] == '^') return true;
  std::stringstream list(tls);
  for (std::string tl; std::getline(list, tl, ',');)
    if (!is_shared_memory(tl)) return true;
  return false;
}

// Whether the user chose a value for the UCX setting `name` (no prefix), in
// the params or as a UCX environment variable; theirs then stands.
bool user_sets(const TransportOptions& options, const std::string& name,
               const std::string& tl_prefix = "") {
  for (const std::string& full : {"UCX_" + name, "UCX_" + tl_prefix + name})
    if (options.params.count(full) || std::getenv(full.c_str())) return true;
  return false;
}

// UCX settings of this transport's own context (ucp_config_modify; never the
// process environment, which other UCX users in the process share). The
// environment's UCX_* still applies to everything not set here.
std::map<std::string, std::string> ucx_settings(const TransportOptions& options) {
  std::map<std::string, std::string> s;
  if (auto it = options.params.find("tls"); it != options.params.end()) s["TLS"] = it->second;
  for (const auto& [key, value] : options.params)
    if (key.rfind("UCX_", 0) == 0) s[key.substr(4)] = value;
  // UCX 1.13 takes tcp's settings only without their TCP_ prefix (tcp_tuning).
  for (const auto& [name, value] : tcp_tuning())
    if (auto it = s.find("TCP_" + name); it != s.end()) {
      s[name] = it->second;
      s.erase(it);
    }
  // UCX checks idle peers every 20 s by default; a dead shared-memory peer is
  // only noticed by that check, so look more often unless told otherwise.
  if (auto it = options.params.find("keepalive_interval"); it != options.params.end())
    s["KEEPALIVE_INTERVAL"] = it->second;
  else if (!user_sets(options, "KEEPALIVE_INTERVAL"))
    s["KEEPALIVE_INTERVAL"] = "1s";
  if (selects_tcp(selected_tls(options)))
    for (const auto& [name, value] : tcp_tuning())
      if (!user_sets(options, name, "TCP_")) s.emplace(name, value);
  return s;
}

// params["cuda"]: "auto" (default), "require" or "off".
std::string cuda_mode(const TransportOptions& options) {
  const auto it = options.params.find("cuda");
  const std::string mode = it == options.params.end() ? "auto" : it->second;
  if (mode != "auto" && mode != "require" && mode != "off")
    fail(Errc::invalid_argument, "ucx transport: cuda=", mode, " (expected auto, require or off)");
  return mode;
}

ucs_memory_type_t memory_type(MemoryKind kind) {
  return kind == MemoryKind::cuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
}

void send_callback(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<UcxOp*>(user_data);
  op->transport->on_complete(op, request, status);
}

void recv_callback(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                   void* user_data) {
  auto* op = static_cast<UcxOp*>(user_data);
  if (info) op->info = *info;
  op->transport->on_complete(op, request, status);
}

void peer_error_callback(void* arg, ucp_ep_h ep, ucs_status_t status) {
  auto* peer = static_cast<UcxPeer*>(arg);
  // A retired endpoint (the peer failed, or a new process took its rank)
  // may still report: the peer's current endpoint is not concerned.
  if (ep != peer->ep) return;
  peer->transport->on_peer_error(*peer, status);
}

class UcxRegion final : public MemoryRegion {
 public:
  UcxRegion(ucp_context_h context, const Buffer& b)
      : MemoryRegion(b.data, b.bytes, b.memory, b.device), context_(context) {
    ucp_mem_map_params_t p{};
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                   UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
    p.address = b.data;
    p.length = b.bytes;
    p.memory_type = memory_type(b.memory);
    check(ucp_mem_map(context, &p, &memh_), cat("UCX: ucp_mem_map of ", b.bytes, " bytes"));
  }
  ~UcxRegion() override { ucp_mem_unmap(context_, memh_); }
  ucp_mem_h memh() const { return memh_; }

 private:
  ucp_context_h context_;
  ucp_mem_h memh_ = nullptr;
};

class UcxRequest final : public Request {
 public:
  UcxRequest(UcxTransport& t, UcxOp* op)
      : Request("ucx", op->kind, op->peer, op->tag, op->bytes), transport_(t), op_(op) {}
  ~UcxRequest() override { transport_.release(op_); }

  bool test() override {
    if (!op_->done) transport_.progress();
    if (!op_->done) return false;
    if (op_->status != UCS_OK) raise();
    return true;
  }
  void cancel() override { transport_.cancel(*op_); }
  std::size_t transferred() const override {
    return op_->kind == Kind::recv ? op_->info.length : op_->bytes;
  }

 private:
  [[noreturn]] void raise() const {
    if (op_->peer_failed)
      fail(Errc::peer_failure, describe(), ": peer rank ", peer(), " failed (",
           transport_.peer_failure(peer()), ")");
    if (op_->status == UCS_ERR_MESSAGE_TRUNCATED)
      fail(Errc::mismatch, describe(), ": the message is larger than the ", bytes(),
           "-byte receive buffer");
    if (op_->user_cancelled) fail(Errc::cancelled, describe(), ": cancelled");
    fail(Errc::transport, describe(), ": ", ucs_status_string(op_->status));
  }

  UcxTransport& transport_;
  UcxOp* op_;
};

}  // namespace

UcxTransport::UcxTransport(const TransportOptions& options)
    : options_(options), rank_(options.rank), world_(options.world) {
  if (world_ > (1 << kRankBits))
    fail(Errc::invalid_argument, "ucx transport: world of ", world_, " ranks exceeds ",
         1 << kRankBits);
  peer_errors_ = want_peer_errors(options, peer_errors_forced_);
  const std::string cuda = cuda_mode(options);
  worker_ = std::make_unique<UcxWorker>(ucx_settings(options));
  cuda_memory_ = worker_->cuda_memory() && cuda != "off";
  if (cuda == "off")
    no_cuda_ = "CUDA memory is switched off (cuda=off)";
  else if (!cuda_memory_)
    no_cuda_ = ucx_library().why_no_cuda();
  if (cuda == "require" && !cuda_memory_)
    fail(Errc::unsupported, "ucx transport (cuda=require): ", no_cuda_);
  peers_.resize(static_cast<std::size_t>(world_));
  for (int r = 0; r < world_; ++r) {
    peers_[r].transport = this;
    peers_[r].rank = r;
  }
  options_.store->set(address_key(options_.prefix, rank_),
                      published(options_.incarnation, worker_->address()));
}

UcxTransport::~UcxTransport() {
  // A cancel may complete (and free, if orphaned) an op at once: iterate a copy.
  const std::vector<UcxOp*> pending(ops_.begin(), ops_.end());
  for (UcxOp* op : pending)
    if (ops_.count(op) && !op->done && op->kind == Request::Kind::recv && op->ucx_request)
      ucp_request_cancel(worker_->worker(), op->ucx_request);
  close_endpoints();
  // Operations UCX still holds are completed (with errors) by now; whatever
  // is left was orphaned and is freed with the worker.
  for (UcxOp* op : ops_) {
    if (op->ucx_request) ucp_request_free(op->ucx_request);
    delete op;
  }
}

// A peer whose sends are all settled closes at once (sends_settled); while a
// send of this transport to it is still posted, sends_settled() leaves it.
void UcxTransport::sends_settled() {
  std::set<int> posting;
  for (const UcxOp* op : ops_)
    if (op->kind == Request::Kind::send && !op->done) posting.insert(op->peer);
  for (int peer = 0; peer < static_cast<int>(peers_.size()); ++peer)
    if (!posting.count(peer)) peers_[static_cast<size_t>(peer)].sent = false;
}

// Graceful close first (flushes what was sent, so the last message of a
// sender that exits at once still arrives), forced after a bounded wait.
void UcxTransport::close_endpoints() {
  std::vector<void*> closing;
  for (auto& p : peers_) {
    if (!p.ep) continue;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // Nothing sent over it since its sends were settled, nothing to flush:
    // no wait for the peer (an engine leaving between steps, or a trainer
    // after its last step, need not wait for peers that are not progressing
    // their workers).
    param.flags = p.failed || !p.sent ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &param);
    if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
    p.ep = nullptr;
  }
  for (ucp_ep_h ep : retired_) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(ep, &param);
    if (UCS_PTR_IS_PTR(r)) closing.push_back(r);
  }
  retired_.clear();
  const auto deadline = std::chrono::steady_clock::now() + kReleaseWait;
  for (void* r : closing) {
    while (ucp_request_check_status(r) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < deadline)
      ucp_worker_progress(worker_->worker());
    ucp_request_free(r);
  }
}

Capabilities UcxTransport::capabilities() const {
  Capabilities c;
  c.host_memory = true;
  c.cuda_memory = cuda_memory_;
  c.library = ucx_library().describe();
  c.native_broadcast = false;
  c.max_message_bytes = std::numeric_limits<std::size_t>::max();
  c.tag_bits = kTagBits;
  return c;
}

std::unique_ptr<MemoryRegion> UcxTransport::register_memory(const Buffer& buffer) {
  if (buffer.memory == MemoryKind::cuda && !cuda_memory_)
    fail(Errc::unsupported, "ucx transport: cannot register ", buffer.bytes,
         " bytes of CUDA memory: ", no_cuda_);
  if (!buffer.data || buffer.bytes == 0)
    fail(Errc::invalid_argument, "ucx transport: cannot register an empty buffer");
  return std::make_unique<UcxRegion>(worker_->context(), buffer);
}

void UcxTransport::check_post(int peer, Tag tag, const Buffer& buffer, const char* what) const {
  if (peer < 0 || peer >= world_)
    fail(Errc::invalid_argument, "ucx transport: ", what, " rank ", peer, " outside world of ",
         world_);
  if (tag >= kTagLimit)
    fail(Errc::invalid_argument, "ucx transport: tag ", tag, " exceeds the ", kTagBits,
         "-bit limit");
  if (!buffer.data && buffer.bytes > 0)
    fail(Errc::invalid_argument, "ucx transport: ", what, " rank ", peer, ": null buffer of ",
         buffer.bytes, " bytes");
  if (buffer.memory == MemoryKind::cuda && !cuda_memory_)
    fail(Errc::unsupported, "ucx transport: ", what, " rank ", peer, ": a buffer of ", buffer.bytes,
         " bytes in CUDA memory: ", no_cuda_);
  if (buffer.region && !buffer.region->contains(buffer))
    fail(Errc::invalid_argument, "ucx transport: ", what, " rank ", peer,
         ": buffer lies outside its registered region");
}

void UcxTransport::check_alive(int peer, const char* what) const {
  if (peers_[peer].failed)
    fail(Errc::peer_failure, "ucx transport: ", what, " rank ", peer, ": peer rank ", peer,
         " failed (", peers_[peer].failure, ")");
}

ucp_ep_h UcxTransport::endpoint(int peer) {
  UcxPeer& p = peers_[peer];
  if (p.ep || p.failed) return p.ep;  // never reconnect to a failed peer
  auto address = fresh_address(p);
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = peer_errors_ ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  params.err_handler.cb = peer_error_callback;
  params.err_handler.arg = &p;
  ucs_status_t status = ucp_ep_create(worker_->worker(), &params, &p.ep);
  if (status == UCS_ERR_UNREACHABLE && peer_errors_ && !peer_errors_forced_) {
    // None of the transports that reach this peer can report its failure
    // (UCX 1.13 shared memory); connect without, and rely on timeouts.
    params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    status = ucp_ep_create(worker_->worker(), &params, &p.ep);
  }
  check(status, cat("ucx transport: connecting to rank ", peer));
  p.address = std::move(address);
  p.sent = false;
  return p.ep;
}

// The address published by the process that holds the peer's rank now
// (TransportOptions::incarnation_of): a departed process's address may
// still be in the store while a new one takes the rank over, and must never
// be used. Without incarnations, after reconnect() one other than the old
// process's (the new process may not have published its own yet).
std::vector<uint8_t> UcxTransport::fresh_address(const UcxPeer& p) {
  const auto key = address_key(options_.prefix, p.rank);
  const auto deadline = std::chrono::steady_clock::now() + options_.bootstrap_timeout;
  uint64_t want = 0, got = 0;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    auto value = options_.store->get(key, std::max(left, std::chrono::milliseconds(0)));
    if (value.size() < kIncarnationBytes)
      fail(Errc::format, "ucx transport: rank ", p.rank, "'s published address (key '", key,
           "') is ", value.size(), " bytes, shorter than its incarnation");
    got = 0;
    for (size_t i = 0; i < kIncarnationBytes; ++i) got |= uint64_t{value[i]} << (8 * i);
    std::vector<uint8_t> address(value.begin() + kIncarnationBytes, value.end());
    if (options_.incarnation_of && got != 0) {
      want = options_.incarnation_of(p.rank);
      if (want == got) return address;
      // The process that published the address registered before it did,
      // and is gone; none holds the rank now. Waiting would hold this rank
      // until the bootstrap timeout while the step it serves fails anyway.
      if (want == 0)
        fail(Errc::peer_failure, "ucx transport: rank ", p.rank, "'s process (member id ", got,
             ") left and no process holds the rank now");
    } else if (p.stale_address.empty() || address != p.stale_address) {
      return address;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      if (want != 0 || (options_.incarnation_of && got != 0))
        fail(Errc::timeout, "ucx transport: rank ", p.rank, " is held by process ", want,
             " (member id), which did not publish its address within ",
             options_.bootstrap_timeout.count(), " ms; the address in the store is process ", got,
             "'s, which ", want == 0 ? "is not registered" : "departed");
      fail(Errc::timeout, "ucx transport: rank ", p.rank,
           " was taken by a new process, which did not publish its address within ",
           options_.bootstrap_timeout.count(), " ms");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(want == 0 ? 20 : 5));
  }
}

void UcxTransport::reconnect(int peer) {
  check_post(peer, 0, Buffer{}, "reconnect to");
  UcxPeer& p = peers_[peer];
  // Fail what is pending with the old process and close its endpoint.
  mark_failed(p, "replaced by a new process");
  handle_failures();
  if (!p.address.empty()) p.stale_address = std::move(p.address);
  p.address.clear();
  p.failed = false;
  p.failure_handled = false;
  p.failure.clear();
}

void UcxTransport::connect(int peer) {
  check_post(peer, 0, Buffer{}, "connect to");
  check_alive(peer, "connect to");
  endpoint(peer);
}

bool UcxTransport::peer_failed(int peer) const {
  return peer >= 0 && peer < world_ && peers_[peer].failed;
}

UcxOp* UcxTransport::new_op(Request::Kind kind, int peer, Tag tag, std::size_t bytes) {
  auto* op = new UcxOp;
  op->transport = this;
  op->kind = kind;
  op->peer = peer;
  op->tag = tag;
  op->bytes = bytes;
  ops_.insert(op);
  return op;
}

std::unique_ptr<Request> UcxTransport::finish_post(UcxOp* op, ucs_status_ptr_t posted,
                                                   const char* what) {
  if (UCS_PTR_IS_ERR(posted)) {
    const ucs_status_t status = UCS_PTR_STATUS(posted);
    ops_.erase(op);
    delete op;
    check(status, cat("ucx transport: ", what));
  }
  if (posted == nullptr) {
    op->done = true;  // completed in place; no callback follows
  } else if (!op->done) {
    op->ucx_request = posted;  // else the callback already ran (and freed it)
  }
  return std::make_unique<UcxRequest>(*this, op);
}

// What UCX is told about a posted buffer: its registration, and its memory
// type where UCX moves CUDA memory (saving a lookup in its memory-type cache).
void UcxTransport::describe_buffer(ucp_request_param_t& param, const Buffer& buffer) const {
  if (cuda_memory_) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.memory_type = memory_type(buffer.memory);
  }
  if (buffer.region) {
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    param.memh = static_cast<const UcxRegion*>(buffer.region)->memh();
  }
}

std::unique_ptr<Request> UcxTransport::send(int peer, Tag tag, const Buffer& buffer) {
  check_post(peer, tag, buffer, "send to");
  check_alive(peer, "send to");
  ucp_ep_h ep = endpoint(peer);
  peers_[peer].sent = true;
  UcxOp* op = new_op(Request::Kind::send, peer, tag, buffer.bytes);
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = send_callback;
  param.user_data = op;
  describe_buffer(param, buffer);
  auto posted = ucp_tag_send_nbx(ep, buffer.data, buffer.bytes, wire_tag(rank_, tag), &param);
  return finish_post(op, posted, cat("send to rank ", peer).c_str());
}

std::unique_ptr<Request> UcxTransport::recv(int peer, Tag tag, const Buffer& buffer) {
  check_post(peer, tag, buffer, "receive from");
  // A receive from a failed peer is still posted: a message it sent before
  // it left may be waiting here, unexpected.
  endpoint(peer);  // so that the sender's death is noticed
  UcxOp* op = new_op(Request::Kind::recv, peer, tag, buffer.bytes);
  ucp_request_param_t param{};
  // Always through the callback: UCX 1.13 does not fill the receive info of a
  // receive that completes in place, and the size that arrived is needed.
  param.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  param.cb.recv = recv_callback;
  param.user_data = op;
  describe_buffer(param, buffer);
  auto posted = ucp_tag_recv_nbx(worker_->worker(), buffer.data, buffer.bytes, wire_tag(peer, tag),
                                 ~ucp_tag_t{0}, &param);
  auto request = finish_post(op, posted, cat("receive from rank ", peer).c_str());
  if (peers_[peer].failed && !op->done) {
    op->peer_failed = true;  // nothing more can come from it
    ucp_request_cancel(worker_->worker(), op->ucx_request);
  }
  return request;
}

void UcxTransport::progress() {
  // Drain what is ready now, bounded so one call never spins for long.
  for (int i = 0; i < 64 && ucp_worker_progress(worker_->worker()) != 0; ++i) {
  }
  if (failures_pending_) handle_failures();
}

void UcxTransport::on_complete(UcxOp* op, void* request, ucs_status_t status) {
  if (!op->done) {  // else completed already, failed, by handle_failures
    op->done = true;
    op->status = status;
  }
  // May run inside ucp_tag_*_nbx, before op->ucx_request is set.
  ucp_request_free(request);
  op->ucx_request = nullptr;
  if (status != UCS_OK && peers_[op->peer].failed) op->peer_failed = true;
  if (op->orphaned) {
    ops_.erase(op);
    delete op;
  }
}

void UcxTransport::on_peer_error(UcxPeer& peer, ucs_status_t status) {
  mark_failed(peer, cat("UCX: ", ucs_status_string(status)));
}

void UcxTransport::mark_failed(UcxPeer& peer, const std::string& why) {
  if (peer.failed) return;
  peer.failed = true;
  peer.failure = why;
  failures_pending_ = true;
}

// Outside the error callback: retires the failed peers' endpoints (closed
// when the transport ends, see retired_), cancels the receives waiting on
// those peers and completes their sends here, failed: UCX cannot withdraw a
// send that may be partly on the wire, so it keeps the request (and reads
// the buffer, for a peer that is gone) until the endpoint is closed.
void UcxTransport::handle_failures() {
  failures_pending_ = false;
  for (auto& p : peers_) {
    if (!p.failed || p.failure_handled) continue;
    p.failure_handled = true;
    // A cancel may complete (and free, if orphaned) an op at once: iterate a copy.
    const std::vector<UcxOp*> pending(ops_.begin(), ops_.end());
    for (UcxOp* op : pending) {
      if (!ops_.count(op) || op->peer != p.rank || op->done) continue;
      op->peer_failed = true;
      if (op->kind == Request::Kind::recv && op->ucx_request) {
        ucp_request_cancel(worker_->worker(), op->ucx_request);
      } else if (op->kind == Request::Kind::send && op->ucx_request) {
        op->done = true;  // UCX's completion, when it comes, only frees it
        op->status = UCS_ERR_CANCELED;
      }
    }
    if (p.ep) {
      retired_.push_back(p.ep);
      p.ep = nullptr;
    }
  }
}

void UcxTransport::cancel(UcxOp& op) {
  if (op.done) return;
  op.user_cancelled = true;
  if (op.kind == Request::Kind::recv) {
    ucp_request_cancel(worker_->worker(), op.ucx_request);
    return;
  }
  // UCX cannot withdraw a send that may be partly on the wire: the peer is
  // lost (its endpoint retired, its sends failed here).
  mark_failed(peers_[op.peer], cat("a send of ", op.bytes, " bytes to it was cancelled"));
  handle_failures();
}

void UcxTransport::release(UcxOp* op) {
  if (!op->done) {
    cancel(*op);
    const auto deadline = std::chrono::steady_clock::now() + kReleaseWait;
    while (!op->done && std::chrono::steady_clock::now() < deadline) progress();
  }
  if (op->done && !op->ucx_request) {
    ops_.erase(op);
    delete op;
  } else {
    op->orphaned = true;  // freed by its completion callback or the destructor
  }
}

}  // namespace weightsync::transport::ucx

namespace weightsync::transport {

std::unique_ptr<Transport> make_ucx_transport(const TransportOptions& options) {
  return std::make_unique<ucx::UcxTransport>(options);
}

}  // namespace weightsync::transport
