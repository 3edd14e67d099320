#include "ipc_exports.h"

#include <weightsync/error.h>

#include <algorithm>

namespace weightsync::transport::cuda_ipc {
namespace {

// True when `entry` maps every piece of `where` (same allocations): a buffer
// inside those pieces can be written through the entry's mapping, whatever
// became of the entry's other pieces.
bool covers(const ExportEntry& entry, const Located& where) {
  const auto& have = entry.where.pieces;
  auto it = std::find(have.begin(), have.end(), where.pieces.front());
  if (it == have.end()) return false;
  for (const Piece& p : where.pieces) {
    if (it == have.end() || !(*it == p)) return false;
    ++it;
  }
  return true;
}

}  // namespace

ExportTable::~ExportTable() = default;

ExportEntry& ExportTable::find(const Buffer& buffer, uint64_t region_id, uint64_t& offset) {
  const auto data = reinterpret_cast<uintptr_t>(buffer.data);
  if (region_id != 0) {
    ExportEntry* e = get(region_id);
    // Registered memory whose allocation was replaced under the registration
    // was evicted; fall back to a lookup.
    if (e && data >= e->where.base && data - e->where.base + buffer.bytes <= e->where.bytes) {
      offset = data - e->where.base;
      return *e;
    }
  }
  const Located where = memory_.locate(buffer);
  if (where.pieces.empty() || data < where.base || data - where.base + buffer.bytes > where.bytes)
    fail(Errc::internal, "cuda_ipc: located region [0x", std::hex, where.base, ", +", std::dec,
         where.bytes, ") does not hold the ", buffer.bytes, "-byte buffer at ", buffer.data);
  ExportEntry& e = lookup(where);
  offset = data - e.where.base;
  return e;
}

ExportEntry& ExportTable::lookup(const Located& where) {
  evict_stale(where);
  if (auto it = pieces_.find(where.pieces.front().base); it != pieces_.end())
    for (uint64_t id : it->second.regions)
      if (covers(entries_.at(id), where)) return entries_.at(id);
  const uint64_t id = next_region_id_++;
  ExportEntry& e = entries_[id];
  e.region_id = id;
  e.where = where;
  for (const Piece& p : where.pieces) {
    PieceUse& use = pieces_[p.base];
    use.id = p.id;
    use.regions.insert(id);
  }
  return e;
}

// An allocation at a known base with a new identity: the old one was freed,
// so every export that used it points at memory that is gone.
void ExportTable::evict_stale(const Located& where) {
  for (const Piece& p : where.pieces) {
    auto it = pieces_.find(p.base);
    if (it == pieces_.end() || it->second.id == p.id) continue;
    const std::set<uint64_t> stale = it->second.regions;
    for (uint64_t id : stale) drop(id);
  }
}

void ExportTable::drop(uint64_t region_id) {
  auto it = entries_.find(region_id);
  if (it == entries_.end()) return;
  for (const Piece& p : it->second.where.pieces) {
    auto use = pieces_.find(p.base);
    if (use == pieces_.end()) continue;
    use->second.regions.erase(region_id);
    if (use->second.regions.empty()) pieces_.erase(use);
  }
  ExportEntry gone = std::move(it->second);
  entries_.erase(it);
  on_release_(gone);
}

uint64_t ExportTable::pin(const Buffer& buffer) {
  uint64_t offset = 0;
  ExportEntry& e = find(buffer, 0, offset);
  ++e.pins;
  return e.region_id;
}

void ExportTable::unpin(uint64_t region_id) {
  ExportEntry* e = get(region_id);
  if (!e) return;  // evicted already
  // Dropped with its last registration: deregistering is how a caller says
  // the memory may be freed (a later receive into it exports it afresh).
  if (--e->pins <= 0) drop(region_id);
}

ExportEntry* ExportTable::get(uint64_t region_id) {
  auto it = entries_.find(region_id);
  return it == entries_.end() ? nullptr : &it->second;
}

void ExportTable::forget_peer(int peer) {
  for (auto& [id, e] : entries_) e.announced.erase(peer);
}

}  // namespace weightsync::transport::cuda_ipc
