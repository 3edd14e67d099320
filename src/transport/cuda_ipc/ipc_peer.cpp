#include "ipc_peer.h"
#include "transport/staging.h"

#include <algorithm>

namespace weightsync::transport::cuda_ipc {
namespace {

// The exporter's own memory, reached without importing (a send to oneself,
// or two worlds in one process): CUDA refuses to open its own IPC handles.
class DirectMapping final : public Mapping {
 public:
  explicit DirectMapping(uint64_t base) : base_(reinterpret_cast<void*>(base)) {}
  void* data() const override { return base_; }

 private:
  void* base_;
};

}  // namespace

void IpcOp::finish(std::size_t bytes) {
  done = true;
  transferred = bytes;
  copy.reset();
  mapping.reset();
}

void IpcOp::set_error(Errc code, std::string why) {
  if (done) return;
  done = true;
  error.emplace(code, std::move(why));
}

PeerLink::PeerLink(int peer, IpcMemory& memory, ExportTable& exports, uint64_t process_id,
                   Sink sink)
    : peer_(peer),
      memory_(memory),
      exports_(exports),
      process_id_(process_id),
      sink_(std::move(sink)) {}

PeerLink::~PeerLink() = default;

void PeerLink::send(const Message& m, SharedFds owner, std::vector<int> fds) {
  if (failed_) return;  // nobody is listening
  std::vector<uint8_t> bytes = encode(m);
  if (!fds.empty()) {
    flush();
    sink_(OutPacket{std::move(bytes), std::move(owner), std::move(fds)});
    return;
  }
  if (out_bytes_ + kBatchEntryBytes + bytes.size() > kMaxPacketBytes) flush();
  out_bytes_ += kBatchEntryBytes + bytes.size();
  out_.push_back(std::move(bytes));
}

void PeerLink::flush() {
  if (out_.empty()) return;
  std::vector<uint8_t> packet = out_.size() == 1 ? std::move(out_.front()) : encode_batch(out_);
  out_.clear();
  out_bytes_ = kBatchHeaderBytes;
  if (!failed_) sink_(OutPacket{std::move(packet), nullptr, {}});
}

// The region message, then its descriptors in as many packets as they need.
void PeerLink::announce(ExportEntry& entry) {
  if (entry.announced.count(peer_)) return;
  Export ex = memory_.export_region(entry.where);
  RegionMsg m;
  m.region_id = entry.region_id;
  m.kind = ex.kind;
  m.bytes = entry.where.bytes;
  m.exporter = process_id_;
  m.base = entry.where.base;
  m.handle_bytes = static_cast<uint32_t>(ex.handle.size());
  m.fd_count = static_cast<uint32_t>(ex.fds.size());
  // Closed once the packets carrying them are written (the kernel passes copies).
  auto fds = std::make_shared<const std::vector<UniqueFd>>(std::move(ex.fds));
  std::vector<int> all;
  for (const UniqueFd& fd : *fds) all.push_back(fd.get());
  // The handle and the descriptors go in slices, the first with the region
  // message, the rest in region_more packets, until both are out.
  std::size_t h = 0, f = 0;
  auto next = [&](std::vector<uint8_t>& handle) {
    const std::size_t hn = std::min(ex.handle.size() - h, kHandleSlice);
    const std::size_t fn = std::min(all.size() - f, kMaxPacketFds);
    handle.assign(ex.handle.begin() + h, ex.handle.begin() + h + hn);
    std::vector<int> slice(all.begin() + f, all.begin() + f + fn);
    h += hn;
    f += fn;
    return slice;
  };
  auto first = next(m.handle);
  send(m, fds, std::move(first));
  while (h < ex.handle.size() || f < all.size()) {
    RegionMore more{entry.region_id, {}};
    auto slice = next(more.handle);
    send(more, fds, std::move(slice));
  }
  entry.announced.insert(peer_);
}

void PeerLink::post_recv(const std::shared_ptr<IpcOp>& op, uint64_t region_id) {
  RecvPosted r;
  r.recv_id = next_recv_id_++;
  r.tag = op->tag;
  r.capacity = op->buffer.bytes;
  if (op->buffer.bytes > 0) {
    ExportEntry& entry = exports_.find(op->buffer, region_id, r.offset);
    announce(entry);
    r.region_id = entry.region_id;
  }
  op->recv_id = r.recv_id;
  recvs_[r.recv_id] = op;
  send(r);
}

void PeerLink::post_send(const std::shared_ptr<IpcOp>& op) {
  sends_[op->tag].push_back(op);
  match(op->tag);
}

void PeerLink::post_expose(const std::shared_ptr<IpcOp>& op, const std::vector<Buffer>& buffers,
                           const std::vector<uint64_t>& region_ids) {
  Expose m;
  m.expose_id = next_recv_id_++;
  m.tag = op->tag;
  m.total = static_cast<uint32_t>(buffers.size());
  std::vector<ExposeEntry> entries;
  entries.reserve(buffers.size());
  for (std::size_t i = 0; i < buffers.size(); ++i) {
    ExposeEntry e;
    if (buffers[i].bytes > 0) {
      ExportEntry& entry = exports_.find(buffers[i], region_ids[i], e.offset);
      announce(entry);
      e.region_id = entry.region_id;
      e.bytes = buffers[i].bytes;
    }
    entries.push_back(e);
  }
  op->recv_id = m.expose_id;
  recvs_[m.expose_id] = op;
  // Slices of kExposeSlice entries; an empty list is one message.
  std::size_t at = 0;
  do {
    const std::size_t n = std::min(entries.size() - at, kExposeSlice);
    m.entries.assign(entries.begin() + static_cast<std::ptrdiff_t>(at),
                     entries.begin() + static_cast<std::ptrdiff_t>(at + n));
    send(m);
    at += n;
  } while (at < entries.size());
}

void PeerLink::post_map(const std::shared_ptr<IpcOp>& op) {
  maps_[op->tag].push_back(op);
  match_maps(op->tag);
}

void PeerLink::cancel(IpcOp& op) {
  if (op.done) return;
  if (op.kind == Request::Kind::recv || op.kind == Request::Kind::expose) {
    // Only the sender knows whether it took the receive: ask it. Its answer
    // (cancelled, or the message's completion) settles the operation.
    if (!op.cancelling && !failed_) send(Cancel{op.recv_id});
    op.cancelling = true;
    return;
  }
  auto& queues = op.kind == Request::Kind::map ? maps_ : sends_;
  auto it = queues.find(op.tag);
  if (it == queues.end()) return;  // matched: its copy runs and cannot be withdrawn
  auto& queue = it->second;
  auto pos =
      std::find_if(queue.begin(), queue.end(), [&](const auto& p) { return p.get() == &op; });
  if (pos == queue.end()) return;
  queue.erase(pos);
  if (queue.empty()) queues.erase(it);
  op.set_error(Errc::cancelled, "cancelled");
}

void PeerLink::on_packet(InPacket packet) {
  if (is_batch(packet.bytes)) {
    if (!packet.fds.empty())
      weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_,
                       " passed descriptors with a batch packet");
    for (auto& bytes : split_batch(std::move(packet.bytes))) dispatch(decode(bytes), {});
    return;
  }
  dispatch(decode(packet.bytes), std::move(packet.fds));
}

void PeerLink::dispatch(Message m, std::vector<UniqueFd> fds) {
  if (!fds.empty() && !std::holds_alternative<RegionMsg>(m) &&
      !std::holds_alternative<RegionMore>(m))
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " passed descriptors with a ",
                     message_name(m), " message");
  std::visit(
      [&](auto& msg) {
        using T = std::decay_t<decltype(msg)>;
        if constexpr (std::is_same_v<T, RegionMsg>)
          on_region(std::move(msg), std::move(fds));
        else if constexpr (std::is_same_v<T, RegionMore>)
          on_region_more(msg, std::move(fds));
        else if constexpr (std::is_same_v<T, Release>)
          on_release(msg);
        else if constexpr (std::is_same_v<T, Released>)
          on_released(msg);
        else if constexpr (std::is_same_v<T, RecvPosted>)
          on_recv_posted(msg);
        else if constexpr (std::is_same_v<T, Cancel>)
          on_cancel(msg);
        else if constexpr (std::is_same_v<T, Cancelled>)
          on_cancelled(msg);
        else if constexpr (std::is_same_v<T, Complete>)
          on_complete(msg);
        else if constexpr (std::is_same_v<T, Expose>)
          on_expose(std::move(msg));
        else
          weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " sent a second hello");
      },
      m);
}

void PeerLink::on_region(RegionMsg m, std::vector<UniqueFd> fds) {
  if (m.region_id == 0 || regions_.count(m.region_id))
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " announced region ", m.region_id,
                     " twice");
  RemoteRegion& r = regions_[m.region_id];
  r.msg = std::move(m);
  r.fds = std::move(fds);
  if (r.fds.size() > r.msg.fd_count || r.msg.handle.size() > r.msg.handle_bytes)
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " sent more of region ",
                     r.msg.region_id, " than it announced");
}

void PeerLink::on_region_more(const RegionMore& m, std::vector<UniqueFd> fds) {
  auto it = regions_.find(m.region_id);
  if (it == regions_.end() || it->second.fds.size() + fds.size() > it->second.msg.fd_count ||
      it->second.msg.handle.size() + m.handle.size() > it->second.msg.handle_bytes)
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " sent more of region ", m.region_id,
                     " than it announced");
  RemoteRegion& r = it->second;
  r.msg.handle.insert(r.msg.handle.end(), m.handle.begin(), m.handle.end());
  for (auto& fd : fds) r.fds.push_back(std::move(fd));
}

// A copy still running into the region keeps its own reference, so the
// region is unmapped when that copy is done; the receiver released the
// region, so it has no receive into it pending and waits for no such copy.
void PeerLink::on_release(const Release& m) {
  regions_.erase(m.region_id);
  send(Released{m.region_id});
}

void PeerLink::on_released(const Released& m) {
  releasing_.erase(m.region_id);
  slow_ = false;
}

void PeerLink::on_recv_posted(const RecvPosted& m) {
  if (m.capacity > 0 && !regions_.count(m.region_id))
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " posted receive ", m.recv_id,
                     " into region ", m.region_id, ", which it never announced");
  remote_recvs_[m.tag].push_back(m);
  remote_index_[m.recv_id] = m.tag;
  match(m.tag);
}

namespace {

// Withdraws the receiver's message `id` (a posted receive or a loan) from
// the sender's queues, by its tag in `index`; false when it is not there
// (already taken: its completion is on the way).
template <class Queued, class IdOf>
bool withdraw(std::map<Tag, std::deque<Queued>>& queues, std::map<uint64_t, Tag>& index,
              uint64_t id, IdOf id_of) {
  auto idx = index.find(id);
  if (idx == index.end()) return false;
  auto& queue = queues[idx->second];
  auto pos =
      std::find_if(queue.begin(), queue.end(), [&](const Queued& q) { return id_of(q) == id; });
  if (pos != queue.end()) queue.erase(pos);
  if (queue.empty()) queues.erase(idx->second);
  index.erase(idx);
  return true;
}

// Per tag, the oldest local operation meets the oldest of the peer's queued
// messages (a posted receive, a loan), in posting order both ways: each pair
// leaves its queues (and the message its index) and goes to `start`.
template <class Remote, class IdOf, class Start>
void pair_oldest(std::map<Tag, std::deque<std::shared_ptr<IpcOp>>>& local,
                 std::map<Tag, std::deque<Remote>>& remote, std::map<uint64_t, Tag>& index, Tag tag,
                 IdOf id_of, Start start) {
  auto l = local.find(tag);
  auto r = remote.find(tag);
  if (l == local.end() || r == remote.end()) return;
  while (!l->second.empty() && !r->second.empty()) {
    auto op = std::move(l->second.front());
    l->second.pop_front();
    const Remote message = std::move(r->second.front());
    r->second.pop_front();
    index.erase(id_of(message));
    start(op, message);
  }
  if (l->second.empty()) local.erase(l);
  if (r->second.empty()) remote.erase(r);
}

}  // namespace

void PeerLink::on_cancel(const Cancel& m) {
  const bool withdrawn = withdraw(remote_recvs_, remote_index_, m.recv_id,
                                  [](const RecvPosted& r) { return r.recv_id; }) ||
                         withdraw(remote_exposes_, expose_index_, m.recv_id,
                                  [](const Expose& e) { return e.expose_id; });
  if (withdrawn) send(Cancelled{m.recv_id});
}

std::shared_ptr<IpcOp> PeerLink::take_recv(uint64_t recv_id, const char* what) {
  auto it = recvs_.find(recv_id);
  if (it == recvs_.end())
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " sent ", what, " for receive ",
                     recv_id, ", which is not pending");
  auto op = std::move(it->second);
  recvs_.erase(it);
  return op;
}

void PeerLink::on_cancelled(const Cancelled& m) {
  take_recv(m.recv_id, "cancelled")->set_error(Errc::cancelled, "cancelled");
}

void PeerLink::on_complete(const Complete& m) {
  auto op = take_recv(m.recv_id, "a completion");
  const std::size_t capacity = op->buffer.bytes;
  switch (m.status) {
    case CompleteStatus::ok:
      if (m.bytes > capacity)
        weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " reports ", m.bytes,
                         " bytes written into receive ", m.recv_id, " of ", capacity, " bytes");
      op->finish(m.bytes);
      break;
    case CompleteStatus::too_large:
      op->set_error(Errc::mismatch, cat("the message of ", m.bytes, " bytes is larger than the ",
                                        capacity, "-byte receive buffer"));
      break;
    case CompleteStatus::declined:
      if (op->kind != Request::Kind::expose)
        weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " declined receive ", m.recv_id,
                         ", which is no loan");
      op->set_error(Errc::cancelled, cat("rank ", peer_, " declined the loan"));
      break;
    case CompleteStatus::sender_failed:
      op->set_error(Errc::transport,
                    cat("rank ", peer_,
                        op->kind == Request::Kind::expose ? " could not map the lent memory: "
                                                          : " could not write the message: ",
                        m.error));
      break;
  }
}

// The entries of one expose id gather until all came; the whole list then
// waits for a map with its tag, oldest first.
void PeerLink::on_expose(Expose m) {
  if (m.expose_id == 0 || expose_index_.count(m.expose_id) || remote_index_.count(m.expose_id))
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " lent memory under id ",
                     m.expose_id, ", which is in use");
  for (const ExposeEntry& e : m.entries)
    if (e.bytes > 0 && !regions_.count(e.region_id))
      weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " lent ", e.bytes,
                       " bytes of region ", e.region_id, ", which it never announced");
  auto [it, added] = partial_exposes_.try_emplace(m.expose_id);
  Expose& whole = it->second;
  if (added) {
    whole.expose_id = m.expose_id;
    whole.tag = m.tag;
    whole.total = m.total;
  } else if (whole.tag != m.tag || whole.total != m.total) {
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " changed the tag or size of ",
                     "lent memory ", m.expose_id, " between its messages");
  }
  if (whole.entries.size() + m.entries.size() > whole.total)
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " lent more than the ", whole.total,
                     " buffers it announced under id ", m.expose_id);
  whole.entries.insert(whole.entries.end(), m.entries.begin(), m.entries.end());
  if (whole.entries.size() < whole.total) return;
  const Tag tag = whole.tag;
  expose_index_[whole.expose_id] = tag;
  remote_exposes_[tag].push_back(std::move(whole));
  partial_exposes_.erase(it);
  match_maps(tag);
}

void PeerLink::match_maps(Tag tag) {
  pair_oldest(
      maps_, remote_exposes_, expose_index_, tag, [](const Expose& e) { return e.expose_id; },
      [&](const std::shared_ptr<IpcOp>& op, const Expose& lent) { map_exposed(*op, lent); });
}

// Every entry mapped (each region once, kept until the peer releases it), or
// none: both sides learn why. A map without addresses declines the loan.
void PeerLink::map_exposed(IpcOp& op, const Expose& lent) {
  if (!op.addresses) {
    send(Complete{lent.expose_id, CompleteStatus::declined, 0, {}});
    op.finish(0);
    return;
  }
  std::vector<void*> addresses;
  addresses.reserve(lent.entries.size());
  uint64_t bytes = 0;
  try {
    for (const ExposeEntry& e : lent.entries) {
      if (e.bytes == 0) {
        addresses.push_back(nullptr);
        continue;
      }
      addresses.push_back(static_cast<char*>(mapping(e.region_id, e.offset + e.bytes)->data()) +
                          e.offset);
      bytes += e.bytes;
    }
  } catch (const Error& e) {
    sender_failed(op, lent.expose_id, e.code(), e.what());
    return;
  }
  *op.addresses = std::move(addresses);
  send(Complete{lent.expose_id, CompleteStatus::ok, bytes, {}});
  op.finish(bytes);
}

// Per tag, the oldest send meets the oldest receive: posting order both ways.
void PeerLink::match(Tag tag) {
  pair_oldest(
      sends_, remote_recvs_, remote_index_, tag, [](const RecvPosted& r) { return r.recv_id; },
      [&](const std::shared_ptr<IpcOp>& op, const RecvPosted& recv) { start(op, recv); });
}

void PeerLink::start(const std::shared_ptr<IpcOp>& op, const RecvPosted& r) {
  const std::size_t bytes = op->buffer.bytes;
  if (bytes > r.capacity) {
    send(Complete{r.recv_id, CompleteStatus::too_large, bytes, {}});
    op->set_error(Errc::mismatch, cat("the message of ", bytes, " bytes is larger than the ",
                                      r.capacity, "-byte receive rank ", peer_, " posted"));
    return;
  }
  if (bytes == 0) {
    send(Complete{r.recv_id, CompleteStatus::ok, 0, {}});
    op->finish(0);
    return;
  }
  try {
    op->mapping = mapping(r.region_id, r.offset + bytes);
    op->copy = memory_.copy(static_cast<char*>(op->mapping->data()) + r.offset, op->buffer);
  } catch (const Error& e) {
    sender_failed(*op, r.recv_id, e.code(), e.what());
    return;
  }
  op->target_recv = r.recv_id;
  copying_.push_back(op);
}

// The mapping of a region, imported on its first use and kept until the
// receiver releases it.
std::shared_ptr<Mapping> PeerLink::mapping(uint64_t region_id, std::size_t end) {
  auto it = regions_.find(region_id);
  if (it == regions_.end())
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " released region ", region_id,
                     " while a receive into it was pending");
  RemoteRegion& r = it->second;
  if (!r.error.empty()) weightsync::fail(Errc::transport, r.error);
  if (end > r.msg.bytes)
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " posted a receive reaching byte ",
                     end, " of its ", r.msg.bytes, "-byte region ", region_id);
  if (r.mapping) return r.mapping;
  if (r.fds.size() != r.msg.fd_count || r.msg.handle.size() != r.msg.handle_bytes)
    weightsync::fail(Errc::protocol, "cuda_ipc: rank ", peer_, " used region ", region_id,
                     " before sending all of it (", r.fds.size(), " of ", r.msg.fd_count,
                     " descriptors, ", r.msg.handle.size(), " of ", r.msg.handle_bytes,
                     " handle bytes)");
  try {
    if (r.msg.exporter == process_id_)
      r.mapping = std::make_shared<DirectMapping>(r.msg.base);
    else
      r.mapping = memory_.import(r.msg.kind, r.msg.handle, std::move(r.fds), r.msg.bytes);
  } catch (const Error& e) {
    r.error = cat("mapping region ", region_id, " (", r.msg.bytes, " bytes) of rank ", peer_, ": ",
                  e.what());
    weightsync::fail(e.code(), r.error);
  }
  return r.mapping;
}

// The sender cannot deliver: both sides learn why, and nothing was written.
void PeerLink::sender_failed(IpcOp& op, uint64_t recv_id, Errc code, const std::string& why) {
  send(Complete{recv_id, CompleteStatus::sender_failed, 0, why.substr(0, 1024)});
  op.set_error(code, why);
}

bool PeerLink::poll() {
  bool progressed = false;
  const bool in_order = memory_.copies_in_order();
  for (std::size_t i = 0; i < copying_.size();) {
    IpcOp& op = *copying_[i];
    bool finished = false;
    std::optional<Error> failure;
    try {
      finished = op.copy->done();
    } catch (const Error& e) {
      finished = true;
      failure = e;
    }
    if (!finished) {
      if (in_order) break;  // those started after it run still
      ++i;
      continue;
    }
    if (op.lost) {
      op.set_error(Errc::peer_failure, *op.lost);
    } else if (failure) {
      // The copy may have written part of the message: the receiver is told
      // it failed, and never reads it as complete.
      sender_failed(op, op.target_recv, failure->code(), failure->what());
    } else {
      send(Complete{op.target_recv, CompleteStatus::ok, op.buffer.bytes, {}});
      op.finish(op.buffer.bytes);
    }
    op.copy.reset();
    op.mapping.reset();
    copying_.erase(copying_.begin() + static_cast<std::ptrdiff_t>(i));
    progressed = true;
  }
  return progressed;
}

void PeerLink::drain(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int spins = 0;
  while (!copying_.empty() && std::chrono::steady_clock::now() < deadline) {
    if (!poll()) poll_pause(spins);
  }
  // Still running after the bound: the sends fail now; each op keeps its copy,
  // whose destructor waits for the device.
  for (auto& op : copying_) op->set_error(Errc::peer_failure, op->lost.value_or(failure_));
  copying_.clear();
}

void PeerLink::release(const ExportEntry& entry) {
  if (failed_ || !entry.announced.count(peer_)) return;
  send(Release{entry.region_id});
  if (entry.where.unmap_before_free) releasing_.insert(entry.region_id);
}

void PeerLink::lose(const std::string& why) {
  if (failed_) return;
  failed_ = true;
  failure_ = why;
  out_.clear();  // nobody is listening
  out_bytes_ = kBatchHeaderBytes;
  const std::string text = cat("peer rank ", peer_, " failed (", why, ")");
  for (auto& [id, op] : recvs_) op->set_error(Errc::peer_failure, text);
  recvs_.clear();
  for (auto* queues : {&sends_, &maps_}) {
    for (auto& [tag, queue] : *queues)
      for (auto& op : queue) op->set_error(Errc::peer_failure, text);
    queues->clear();
  }
  partial_exposes_.clear();
  remote_exposes_.clear();
  expose_index_.clear();
  for (auto& op : copying_) op->lost = text;  // failed by poll() once the copy is done
  remote_recvs_.clear();
  remote_index_.clear();
  regions_.clear();
  releasing_.clear();  // its mappings went with it
}

std::size_t PeerLink::pending() const {
  std::size_t n = recvs_.size() + copying_.size();
  for (const auto* queues : {&sends_, &maps_})
    for (const auto& [tag, queue] : *queues) n += queue.size();
  return n;
}

}  // namespace weightsync::transport::cuda_ipc
