#include "checkpoint_save.h"

#include <weightsync/checksum.h>
#include <weightsync/error.h>

#include "core/cuda/gpu.h"
#include "pipeline/item_copies.h"
#include "transport/staging.h"

#include <algorithm>
#include <cstring>
#include <tuple>

namespace weightsync::trainer {
namespace {

using pipeline::addr;

int64_t dot(const Shape& a, const Shape& b) {
  int64_t out = 0;
  for (size_t d = 0; d < a.size(); ++d) out += a[d] * b[d];
  return out;
}

// Strides of the shorter side get leading zeros where the other has extra
// length-1 dims (a stacked shard's entry dim; copy_box does the same).
Shape lead_zeros(Shape strides, size_t rank) {
  strides.insert(strides.begin(), rank - strides.size(), 0);
  return strides;
}

}  // namespace

std::vector<int32_t> save_order(const Plan& plan, const WriterLayout& wl) {
  const int world = plan.trainer_world();
  using Key = std::tuple<int, int, int, int, int32_t>;
  std::vector<std::pair<Key, int32_t>> keyed;
  for (const Bucket& b : plan.buckets()) {
    const WriterWindow& w = wl.windows.at(static_cast<size_t>(b.dst_rank));
    const int shift = ((w.writer - b.src_rank) % world + world) % world;
    keyed.push_back({{w.index, shift, w.writer, b.src_rank, b.id}, b.id});
  }
  std::sort(keyed.begin(), keyed.end());
  std::vector<int32_t> out;
  out.reserve(keyed.size());
  for (const auto& [key, id] : keyed) out.push_back(id);
  return out;
}

SavePipeline::SavePipeline(const WriterLayout& wl, const Plan* plan, int rank,
                           const std::vector<TensorView>& tensors,
                           const pipeline::RankMemory& memory, const Capabilities& caps,
                           int64_t direct_min_bytes)
    : wl_(wl), plan_(plan), rank_(rank), tensors_(tensors), memory_(memory), caps_(caps) {
  wire_.direct_min_bytes = direct_min_bytes;
  std::vector<std::vector<int>> keys_of_receive;
  if (plan_) {
    if (plan_->keys().size() != wl_.files.keys.size())
      fail(Errc::internal, "save_hf: the plan has ", plan_->keys().size(),
           " keys, the writer layout ", wl_.files.keys.size());
    const std::vector<int32_t> order = save_order(*plan_, wl_);
    compile_sends(order);
    for (int32_t b : order) {
      const Bucket& bucket = plan_->buckets()[static_cast<size_t>(b)];
      if (wl_.windows[static_cast<size_t>(bucket.dst_rank)].writer != rank_) continue;
      RecvAction a;
      a.bucket = b;
      a.peer = bucket.src_rank;
      a.bytes = bucket.bytes;
      receives_.push_back(std::move(a));
      std::vector<int> keys;
      for (const PlanItem& item : plan_->items(b)) keys.push_back(plan_->piece_key(item.piece));
      std::sort(keys.begin(), keys.end());
      keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
      keys_of_receive.push_back(std::move(keys));
    }
  }
  compile_locals();
  std::vector<bool> direct;
  for (const Local& l : locals_) direct.push_back(l.straight);
  arena_plan_ = plan_arena(wl_, rank_, keys_of_receive, direct);
}

SavePipeline::~SavePipeline() {
  cancel_all();
}

void SavePipeline::compile_sends(const std::vector<int32_t>& order) {
  for (int32_t b : order) {
    const Bucket& bucket = plan_->buckets()[static_cast<size_t>(b)];
    if (bucket.src_rank != rank_) continue;
    SendAction a;
    a.bucket = b;
    a.peer = wl_.windows[static_cast<size_t>(bucket.dst_rank)].writer;
    a.bytes = bucket.bytes;
    if (a.peer == rank_)
      fail(Errc::internal, "save_hf: trainer rank ", rank_, " plans bucket ", b, " to itself");
    a.fragments = route_fragments(
        *plan_, b, wire_.direct_min_bytes,
        [&](const Copy& c) {
          const TensorView& t = tensors_.at(static_cast<size_t>(c.src_param));
          return same_lengths_but_leading_ones(c.src_box.lengths, c.hf_box.lengths)
                     ? direct_route(t, c.src_box, caps_, wire_)
                     : FragmentRoute{};
        },
        [&](const Copy& c, int64_t shift) {
          pipeline::add_pack(a.pack, c, tensors_.at(static_cast<size_t>(c.src_param)), -shift);
        },
        a.packed_bytes);
    send_slot_bytes_ = std::max(send_slot_bytes_, static_cast<size_t>(a.packed_bytes));
    sends_.push_back(std::move(a));
  }
}

// Parts of a key this rank holds that are one dense run both in its host
// shard and in the key go to the disk straight from the shard; the others
// are copied into the arena (compiled in prepare(), once the arena exists).
void SavePipeline::compile_locals() {
  const std::vector<int> stream = wl_.stream_of(rank_);
  locals_.assign(stream.size(), {});
  for (size_t i = 0; i < stream.size(); ++i) {
    const int key = stream[i];
    const HfKey& k = wl_.files.keys[static_cast<size_t>(key)];
    const auto item = static_cast<int64_t>(itemsize(k.dtype));
    const Shape key_strides = contiguous_strides(k.shape);
    const auto& local = wl_.local[static_cast<size_t>(key)];
    Local& l = locals_[i];
    std::vector<Local::Run> straight;
    for (size_t j = 0; j < local.size(); ++j) {
      const LocalPart& part = local[j];
      const TensorView& t = tensors_.at(static_cast<size_t>(part.param));
      const int64_t bytes = part.hf_box.numel() * item;
      stats_.bytes_local += static_cast<uint64_t>(bytes);
      const auto in_key = dense_run_offset(key_strides, part.hf_box);
      const auto in_shard = t.memory == MemoryKind::host
                                ? dense_run_offset(t.effective_strides(), part.local_box)
                                : std::nullopt;
      if (in_key && in_shard)
        straight.push_back(
            {static_cast<const char*>(t.data) + *in_shard * item, *in_key * item, bytes});
      else
        l.copied.push_back(j);
    }
    std::sort(straight.begin(), straight.end(),
              [](const Local::Run& a, const Local::Run& b) { return a.offset < b.offset; });
    int64_t at = 0;
    for (const Local::Run& r : straight) {
      if (r.offset > at) l.runs.push_back({nullptr, at, r.offset - at});
      l.runs.push_back(r);
      at = r.offset + r.bytes;
    }
    if (at < k.bytes) l.runs.push_back({nullptr, at, k.bytes - at});
    l.straight = std::all_of(l.runs.begin(), l.runs.end(),
                             [](const Local::Run& r) { return r.shard != nullptr; });
  }
}

void SavePipeline::compile_receives() {
  // Where stream position i sits in the arena, by key.
  std::vector<int64_t> place(wl_.files.keys.size(), -1);
  for (size_t i = 0; i < arena_plan_.stream.size(); ++i)
    place[static_cast<size_t>(arena_plan_.stream[i])] = arena_plan_.offset[i];
  auto target = [&](const Copy& c) {
    const HfKey& key = wl_.files.keys[static_cast<size_t>(c.key)];
    const int64_t at = place[static_cast<size_t>(c.key)];
    if (at < 0) fail(Errc::internal, "save_hf: key '", key.name, "' has no place in the arena");
    return tensor_view(arena_ + at, key.dtype, key.shape, MemoryKind::host, -1);
  };
  for (RecvAction& a : receives_) {
    a.fragments = route_fragments(
        *plan_, a.bucket, wire_.direct_min_bytes,
        [&](const Copy& c) { return direct_route(target(c), c.hf_box, caps_, wire_); },
        [&](const Copy& c, int64_t shift) {
          // Into the HF key itself: its box is the item's HF box.
          Copy into_key = c;
          into_key.dst_box = into_key.view_box = c.hf_box;
          into_key.transpose = false;
          pipeline::add_apply(a.apply, into_key, target(c), shift);
        },
        a.slot_bytes);
    recv_slot_bytes_ = std::max(recv_slot_bytes_, static_cast<size_t>(a.slot_bytes));
  }
}

void SavePipeline::prepare(Transport* transport, const std::string& who, SaveArenaCache* cache) {
  who_ = who;
  allocate_arena(transport, cache);
  if (plan_) compile_receives();
  compile_local_copies();
  if (transport) allocate_slots(*transport);
}

void SavePipeline::allocate_arena(Transport* transport, SaveArenaCache* cache) {
  const auto bytes = static_cast<size_t>(arena_plan_.arena_bytes);
  stats_.arena_bytes = bytes;
  if (bytes == 0) return;
  if (memory_.memory == MemoryKind::cuda && memory_.any) {
    // Pinned: the copy kernel writes CUDA shards' parts straight into it.
    auto mem = std::make_shared<gpu::Memory>(bytes, gpu::MemoryPlace::pinned, memory_.device);
    arena_ = mem->data();
    arena_owner_ = std::move(mem);
  } else {
    constexpr size_t kPage = 4096;
    SaveArenaCache fresh;
    if (!cache) cache = &fresh;
    if (cache->bytes < bytes) {
      cache->raw.reset();  // before the larger one: never both at once
      cache->raw.reset(new char[bytes + kPage]);
      cache->bytes = bytes;
    }
    arena_ =
        reinterpret_cast<char*>((addr(cache->raw.get()) + kPage - 1) & ~std::uintptr_t{kPage - 1});
    arena_owner_ = cache->raw;
  }
  if (transport && caps_.host_memory)
    arena_region_ = transport->register_memory(host_buffer(arena_, bytes));
}

// The parts of its keys this rank holds that cannot go to disk straight from
// its shards: copied into their key's place when it is handed off.
void SavePipeline::compile_local_copies() {
  std::vector<const CopyProgram*> programs;
  for (size_t i = 0; i < locals_.size(); ++i) {
    Local& l = locals_[i];
    if (l.copied.empty()) continue;
    const int key = arena_plan_.stream[i];
    const HfKey& k = wl_.files.keys[static_cast<size_t>(key)];
    const Shape strides = contiguous_strides(k.shape);
    const auto item = static_cast<int64_t>(itemsize(k.dtype));
    for (size_t j : l.copied) {
      const LocalPart& part = wl_.local[static_cast<size_t>(key)][j];
      const TensorView& t = tensors_.at(static_cast<size_t>(part.param));
      const Shape ts = t.effective_strides();
      const size_t rank = part.local_box.rank();
      l.copy.add(static_cast<int64_t>(addr(t.data)) + dot(part.local_box.offsets, ts) * item, ts,
                 static_cast<int64_t>(addr(arena_)) + arena_plan_.offset[i] +
                     dot(part.hf_box.offsets, strides) * item,
                 lead_zeros(strides, rank), part.local_box.lengths, itemsize(k.dtype));
    }
    l.program = static_cast<int>(programs.size());
    programs.push_back(&l.copy);
  }
  local_copier_.prepare(programs, memory_, 1);
}

void SavePipeline::allocate_slots(Transport& transport) {
  const SlotMemory send_memory =
      memory_.any ? choose_slot_memory(memory_.memory, caps_, wire_, who_, transport.name())
                  : (caps_.host_memory ? SlotMemory::host : SlotMemory::device);
  // Received parts go to the arena in host memory: through host slots when
  // the transport reaches them, else through device slots and the GPU.
  const bool recv_on_host = caps_.host_memory;
  if (!recv_on_host && memory_.memory != MemoryKind::cuda)
    fail(Errc::unsupported, who_, ": transport '", transport.name(),
         "' reaches CUDA memory only, but this rank's shards are in host memory");
  const int device = memory_.memory == MemoryKind::cuda ? memory_.device : -1;
  for (Slot& s : send_slots_)
    if (send_slot_bytes_ > 0)
      s.buffer = allocate_staging(transport, send_slot_bytes_, send_memory,
                                  send_memory == SlotMemory::device ? device : -1);
  for (Slot& s : recv_slots_)
    if (recv_slot_bytes_ > 0)
      s.buffer = allocate_staging(transport, recv_slot_bytes_,
                                  recv_on_host ? SlotMemory::host : SlotMemory::device,
                                  recv_on_host ? -1 : device);
  stats_.staging_bytes = 2 * (send_slot_bytes_ + recv_slot_bytes_);
  std::vector<const CopyProgram*> packs, applies;
  for (const SendAction& a : sends_) packs.push_back(&a.pack);
  for (const RecvAction& a : receives_) applies.push_back(&a.apply);
  pack_copier_.prepare(packs, memory_, 2);
  apply_copier_.prepare(
      applies, recv_on_host ? pipeline::RankMemory{MemoryKind::host, -1, true} : memory_, 2);
}

}  // namespace weightsync::trainer
