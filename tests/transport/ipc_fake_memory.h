// Test doubles for the cuda_ipc protocol inside one process: a memory whose
// "allocations" the test declares (so that reuse of an address can be staged)
// and whose copies the test completes or fails when it wants, and a pair of
// PeerLinks wired back to back, packets delivered when the test pumps them.
#pragma once

#include "transport/cuda_ipc/ipc_exports.h"
#include "transport/cuda_ipc/ipc_memory.h"
#include "transport/cuda_ipc/ipc_peer.h"

#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include <unistd.h>

namespace weightsync::transport_test {

namespace ipc = weightsync::transport::cuda_ipc;

class FakeMemory final : public ipc::IpcMemory {
 public:
  // A copy the test drives: done() is false until complete() or fail_with().
  struct Pending {
    void* dst;
    Buffer src;
    bool complete = false;
    std::optional<Error> error;
  };
  class FakeCopy final : public ipc::Copy {
   public:
    FakeCopy(std::shared_ptr<Pending> p, FakeMemory& m) : p_(std::move(p)), m_(m) {}
    // A real copy's destructor waits for the device, which still writes into
    // the mapping: record whether it was still mapped.
    ~FakeCopy() override { m_.mapped_when_copy_ended.push_back(m_.live_mappings); }
    bool done() override {
      ++m_.done_calls;
      if (p_->error) throw *p_->error;
      return p_->complete;
    }

   private:
    std::shared_ptr<Pending> p_;
    FakeMemory& m_;
  };

  MemoryKind memory() const override { return MemoryKind::host; }
  bool copies_in_order() const override { return in_order; }

  // Declares [base, base + bytes) as one allocation with identity `id`.
  void allocation(const void* base, std::size_t bytes, uint64_t id) {
    allocations[reinterpret_cast<uintptr_t>(base)] =
        ipc::Piece{reinterpret_cast<uintptr_t>(base), bytes, id};
  }

  ipc::Located locate(const Buffer& b) override {
    const auto p = reinterpret_cast<uintptr_t>(b.data);
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) fail(Errc::unsupported, "fake memory: not an allocation");
    --it;
    const ipc::Piece& a = it->second;
    if (p + b.bytes > a.base + a.bytes) fail(Errc::unsupported, "fake memory: past its end");
    return ipc::Located{a.base, a.bytes, {a}, unmap_before_free};
  }

  ipc::Export export_region(const ipc::Located& where) override {
    ++exports;
    ipc::Export ex;
    ex.kind = 7;
    // The base, then as many filler bytes as a long chunk table would take.
    ex.handle.resize(sizeof(uintptr_t) + extra_handle_bytes);
    std::memcpy(ex.handle.data(), &where.base, sizeof(uintptr_t));
    for (std::size_t i = 0; i < extra_handle_bytes; ++i)
      ex.handle[sizeof(uintptr_t) + i] = static_cast<uint8_t>(i * 7);
    for (int i = 0; i < fds_per_export; ++i) ex.fds.emplace_back(::dup(0));
    return ex;
  }

  std::unique_ptr<ipc::Mapping> import(uint32_t kind, const std::vector<uint8_t>& handle,
                                       std::vector<ipc::UniqueFd> fds, std::size_t bytes) override {
    ++imports;
    imported_fds += fds.size();
    imported_handles.push_back(handle);
    if (import_error) throw *import_error;
    uintptr_t base = 0;
    std::memcpy(&base, handle.data(), sizeof(base));
    return std::make_unique<Direct>(reinterpret_cast<void*>(base), live_mappings);
  }

  std::unique_ptr<ipc::Copy> copy(void* dst, const Buffer& src) override {
    if (copy_error) throw *copy_error;
    auto p = std::make_shared<Pending>(Pending{dst, src, false, std::nullopt});
    if (auto_complete) {
      std::memcpy(dst, src.data, src.bytes);
      p->complete = true;
    }
    copies.push_back(p);
    return std::make_unique<FakeCopy>(p, *this);
  }

  // Completes the oldest copy not yet complete (writing its bytes).
  void complete_next() {
    for (auto& p : copies)
      if (!p->complete && !p->error) {
        std::memcpy(p->dst, p->src.data, p->src.bytes);
        p->complete = true;
        return;
      }
  }

  std::map<uintptr_t, ipc::Piece> allocations;
  std::vector<std::shared_ptr<Pending>> copies;
  bool auto_complete = true;
  bool in_order = false;  // complete_next() keeps any order true
  int done_calls = 0;
  bool unmap_before_free = true;  // as cudaMalloc memory
  int fds_per_export = 0;
  std::size_t extra_handle_bytes = 0;
  std::vector<std::vector<uint8_t>> imported_handles;
  int exports = 0;
  int imports = 0;
  std::size_t imported_fds = 0;
  std::optional<Error> import_error;
  std::optional<Error> copy_error;
  int live_mappings = 0;
  std::vector<int> mapped_when_copy_ended;

 private:
  struct Direct final : ipc::Mapping {
    Direct(void* p, int& live) : p_(p), live_(live) { ++live_; }
    ~Direct() override { --live_; }
    void* data() const override { return p_; }
    void* p_;
    int& live_;
  };
};

// Two ranks' views of each other: a[0] is rank 0's link to rank 1, a[1] rank
// 1's link to rank 0. Each side has its own memory and export table; packets
// wait in a queue until pump() delivers them (descriptors duplicated, as the
// kernel does).
struct LinkPair {
  FakeMemory memory[2];
  std::vector<uint64_t> released[2];  // region ids each side's table dropped
  std::unique_ptr<ipc::ExportTable> exports[2];
  std::unique_ptr<ipc::PeerLink> link[2];
  std::deque<ipc::OutPacket> wire[2];  // wire[i]: packets from side i, not yet delivered

  LinkPair() {
    for (int i = 0; i < 2; ++i) {
      exports[i] = std::make_unique<ipc::ExportTable>(memory[i], [this, i](const auto& e) {
        released[i].push_back(e.region_id);
        link[i]->release(e);
      });
      // Distinct process ids: regions are imported, not used directly.
      link[i] = std::make_unique<ipc::PeerLink>(
          1 - i, memory[i], *exports[i], 100 + i,
          [this, i](ipc::OutPacket p) { wire[i].push_back(std::move(p)); });
    }
  }

  // Delivers every queued packet (also those sent while delivering).
  // Each side flushes what it queued first, as progress() does.
  void pump() {
    for (bool more = true; more;) {
      more = false;
      for (auto& l : link) l->flush();
      for (int i = 0; i < 2; ++i)
        while (!wire[i].empty()) {
          ipc::OutPacket p = std::move(wire[i].front());
          wire[i].pop_front();
          ipc::InPacket in{std::move(p.bytes), {}};
          for (int fd : p.fds) in.fds.emplace_back(::dup(fd));
          link[1 - i]->on_packet(std::move(in));
          more = true;
        }
      for (auto& l : link) more = l->poll() || more;
    }
  }

  std::shared_ptr<ipc::IpcOp> recv(int side, Tag tag, void* data, std::size_t bytes,
                                   uint64_t region_id = 0) {
    auto op = make_op(Request::Kind::recv, side, tag, data, bytes);
    link[side]->post_recv(op, region_id);
    return op;
  }
  std::shared_ptr<ipc::IpcOp> send(int side, Tag tag, const void* data, std::size_t bytes) {
    auto op = make_op(Request::Kind::send, side, tag, const_cast<void*>(data), bytes);
    link[side]->post_send(op);
    return op;
  }
  // Side `side` lends `buffers` (unregistered) to the other.
  std::shared_ptr<ipc::IpcOp> expose(int side, Tag tag, const std::vector<Buffer>& buffers) {
    std::size_t bytes = 0;
    for (const Buffer& b : buffers) bytes += b.bytes;
    auto op = make_op(Request::Kind::expose, side, tag, nullptr, bytes);
    link[side]->post_expose(op, buffers, std::vector<uint64_t>(buffers.size(), 0));
    return op;
  }
  // Side `side` maps what the other lends under `tag`, into `addresses`.
  std::shared_ptr<ipc::IpcOp> map(int side, Tag tag, std::vector<void*>* addresses) {
    auto op = make_op(Request::Kind::map, side, tag, nullptr, 0);
    op->addresses = addresses;
    link[side]->post_map(op);
    return op;
  }

 private:
  static std::shared_ptr<ipc::IpcOp> make_op(Request::Kind kind, int side, Tag tag, void* data,
                                             std::size_t bytes) {
    auto op = std::make_shared<ipc::IpcOp>();
    op->kind = kind;
    op->peer = 1 - side;
    op->tag = tag;
    op->buffer = Buffer{data, bytes, MemoryKind::host, -1, nullptr};
    return op;
  }
};

}  // namespace weightsync::transport_test
