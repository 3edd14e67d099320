// The receiver's exported regions: each allocation that receives are posted
// into is exported and announced once to each sender, which maps it once. A region is found again
// by the identity of its allocations, so an address range that was freed and allocated anew (same
// address, new allocation) gets a new export, and senders are told to drop the stale one.
#pragma once

#include "ipc_memory.h"

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <vector>

namespace weightsync::transport::cuda_ipc {

// The handles themselves are made when a region is announced to a peer
// (IpcMemory::export_region): descriptors are not held open meanwhile, which
// for a VMM range of thousands of chunks would be thousands of them.
struct ExportEntry {
  uint64_t region_id = 0;
  Located where;
  int pins = 0;             // registered MemoryRegions holding it
  std::set<int> announced;  // peers that were sent its region message
};

class ExportTable {
 public:
  // `on_release(entry)` runs for every entry dropped, so that the peers it
  // was announced to are told to unmap it.
  ExportTable(IpcMemory& memory, std::function<void(const ExportEntry&)> on_release)
      : memory_(memory), on_release_(std::move(on_release)) {}
  ~ExportTable();

  // The export holding `buffer`: the pinned entry `region_id` when given
  // (registered memory: no lookup), else found (or created) by locating the
  // buffer's allocations. `offset` is where the buffer starts in it.
  ExportEntry& find(const Buffer& buffer, uint64_t region_id, uint64_t& offset);
  // Registration: exports the buffer's region now and holds it until unpin().
  uint64_t pin(const Buffer& buffer);
  void unpin(uint64_t region_id);
  ExportEntry* get(uint64_t region_id);
  // A peer's process was replaced: it must be told about every region again.
  void forget_peer(int peer);

 private:
  ExportEntry& lookup(const Located& where);
  void evict_stale(const Located& where);
  void drop(uint64_t region_id);

  IpcMemory& memory_;
  std::function<void(const ExportEntry&)> on_release_;
  std::map<uint64_t, ExportEntry> entries_;  // by region id
  // Each exported allocation (by its base) with its identity and the entries using it.
  struct PieceUse {
    uint64_t id = 0;
    std::set<uint64_t> regions;
  };
  std::map<uintptr_t, PieceUse> pieces_;
  uint64_t next_region_id_ = 1;  // 0 means "no region" on the wire
};

}  // namespace weightsync::transport::cuda_ipc
