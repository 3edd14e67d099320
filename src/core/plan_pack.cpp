// Packing items into buckets: per link for p2p, per run of HF keys for
// broadcast (gathered at a root, then extracted by every engine rank).
#include "plan_builder.h"

#include "core/fp8.h"

#include <weightsync/error.h>

#include <algorithm>

namespace weightsync {
namespace {

// The dim along which an oversized box is cut: its outermost non-trivial one.
size_t split_dim_of(const Box& box) {
  for (size_t d = 0; d < box.rank(); ++d)
    if (box.lengths[d] > 1) return d;
  return 0;
}

// Fills buckets in order; opens a new one when the next slab does not fit.
class BucketFiller {
 public:
  BucketFiller(Plan& plan, std::vector<Bucket>& buckets, int64_t limit)
      : plan_(plan), buckets_(buckets), limit_(limit) {}

  // Places an item of `bytes` whole when it fits, else cuts its HF box
  // (`box_of()`, only computed then) along its outer dim into slabs that fill
  // buckets. `emit(bucket, offset, lo, len, d)` receives each slab (len 0:
  // uncut). `key_of()` names the HF key in an error.
  // An item quantized by its sender (`fp8`) is cut into slabs of whole
  // 128-row blocks along its rows (dim -2), each holding its codes and scales.
  template <class KeyOf, class BoxOf, class Emit>
  void place(int32_t src, int32_t dst, KeyOf key_of, int64_t bytes, BoxOf box_of, Emit emit,
             bool fp8 = false) {
    if (bytes <= limit_) {
      if (open_ < 0 || used_ + bytes > limit_) open(src, dst);
      emit(open_, used_, 0, 0, 0);
      used_ += bytes;
      buckets_.back().bytes = used_;
      return;
    }
    const Box box = box_of();
    if (fp8) return place_fp8(src, dst, key_of, box, emit);
    const size_t d = split_dim_of(box);
    const int64_t slab = bytes / box.lengths[d];
    if (slab > limit_)
      fail(Errc::invalid_argument, "bucket_bytes ", limit_, " is smaller than one slab (", slab,
           " bytes) of '", plan_.keys()[static_cast<size_t>(key_of())].name, "' ", box_str(box),
           " along dim ", d);
    for (int64_t done = 0; done < box.lengths[d];) {
      if (open_ < 0 || (limit_ - used_) < slab) open(src, dst);
      const int64_t take = std::min((limit_ - used_) / slab, box.lengths[d] - done);
      emit(open_, used_, box.offsets[d] + done, take, d);
      used_ += take * slab;
      buckets_.back().bytes = used_;
      done += take;
    }
  }
  void close() { open_ = -1; }

 private:
  template <class KeyOf, class Emit>
  void place_fp8(int32_t src, int32_t dst, KeyOf key_of, const Box& box, Emit emit) {
    const size_t d = box.rank() - 2;
    constexpr int64_t kRows = fp8::kBlock;
    auto slab_bytes = [&](int64_t rows) {
      Box b = box;
      b.lengths[d] = rows;
      return fp8_wire_bytes(b);
    };
    const int64_t unit = slab_bytes(std::min(kRows, box.lengths[d]));
    if (unit > limit_)
      fail(Errc::invalid_argument, "bucket_bytes ", limit_,
           " is smaller than one row of 128 x 128 ", "FP8 blocks (", unit, " bytes) of '",
           plan_.keys()[static_cast<size_t>(key_of())].name, "' ", box_str(box));
    for (int64_t done = 0; done < box.lengths[d];) {
      if (open_ < 0 || (limit_ - used_) < unit) open(src, dst);
      const int64_t take = std::min((limit_ - used_) / unit * kRows, box.lengths[d] - done);
      emit(open_, used_, box.offsets[d] + done, take, d);
      used_ += slab_bytes(take);
      buckets_.back().bytes = used_;
      done += take;
    }
  }

  void open(int32_t src, int32_t dst) {
    open_ = static_cast<int32_t>(buckets_.size());
    Bucket b;
    b.id = open_;
    b.src_rank = src;
    b.dst_rank = dst;
    buckets_.push_back(b);
    used_ = 0;
  }
  Plan& plan_;
  std::vector<Bucket>& buckets_;
  int64_t limit_;
  int32_t open_ = -1;
  int64_t used_ = 0;
};

void index_items(std::vector<Bucket>& buckets, const std::vector<PlanItem>& items) {
  for (Bucket& b : buckets) b.num_items = 0;
  for (size_t i = items.size(); i-- > 0;) {
    Bucket& b = buckets[static_cast<size_t>(items[i].bucket)];
    b.first_item = static_cast<uint32_t>(i);
    ++b.num_items;
  }
}

}  // namespace

struct PlanBuilder::LinkEntry {
  int32_t piece;
  uint32_t overlap;
};

// A stable counting sort by link scatters 8-byte (piece, overlap) pairs into
// link order; the items are then built once, sequentially, into storage
// reserved up front. At 1T-model scale (millions of items) fresh pages and
// gathers through permutations cost more than the packing itself, so
// nothing larger than the items themselves is materialized.
std::vector<PlanBuilder::LinkEntry> PlanBuilder::sort_by_link(const P2pChoices& c) const {
  const size_t engines = static_cast<size_t>(plan_.engine_world_);
  std::vector<LinkEntry> sorted(c.holders.size());
  std::vector<uint32_t> next(c.link_first.begin(), c.link_first.end() - 1);
  // The same walk as build_p2p's: replica-major, each replica over its
  // group's overlaps.
  for_each_p2p_item(c, [&](size_t k, size_t o, int dst) {
    const uint32_t pos = c.holders[k];
    const size_t l = static_cast<size_t>(sorted_rank_[pos]) * engines + static_cast<size_t>(dst);
    sorted[next[l]++] = {static_cast<int32_t>(sorted_pieces_[pos]), static_cast<uint32_t>(o)};
  });
  return sorted;
}

void PlanBuilder::pack_p2p_links(const P2pChoices& c) {
  auto ov_key = [&](const PlanItem& it) {
    return plan_.pieces_[static_cast<size_t>(it.piece)].key;
  };
  const size_t engines = static_cast<size_t>(plan_.engine_world_);
  const size_t links = c.link_first.size() - 1;
  const std::vector<LinkEntry> sorted = sort_by_link(c);
  std::vector<PlanItem>& out = plan_.items_;
  out.reserve(sorted.size() + sorted.size() / 64);  // room for split items
  BucketFiller filler(plan_, plan_.buckets_, plan_.options_.bucket_bytes);
  const bool any_fp8 = !plan_.fp8_sender_params_.empty();
  for (size_t l = 0; l < links; ++l) {
    filler.close();
    const int32_t src = static_cast<int32_t>(l / engines);
    const int32_t dst = static_cast<int32_t>(l % engines);
    for (uint32_t e = c.link_first[l]; e < c.link_first[l + 1]; ++e) {
      // The overlaps a link reads are scattered over a table of megabytes.
      if (e + 16 < sorted.size()) __builtin_prefetch(&c.overlaps[sorted[e + 16].overlap]);
      const Overlap& ov = c.overlaps[sorted[e].overlap];
      PlanItem it;
      it.piece = sorted[e].piece;
      it.segment = ov.segment;
      it.dst_rank = dst;
      // Without sender-quantized params no segment needs reading (a cache
      // miss per item: the segments table is megabytes).
      const bool fp8 = any_fp8 && plan_.segments_[static_cast<size_t>(ov.segment)].fp8_wire;
      filler.place(
          src, dst, [&] { return plan_.pieces_[static_cast<size_t>(it.piece)].key; }, ov.bytes,
          [&] { return item_hf_box(plan_, it); },
          [&](int32_t bucket, int64_t offset, int64_t lo, int64_t len, size_t d) {
            it.bucket = bucket;
            it.offset = static_cast<uint32_t>(offset);
            it.split_lo = static_cast<int32_t>(lo);
            it.split_len = static_cast<int32_t>(len);
            it.split_dim = static_cast<uint8_t>(d);
            Bucket& b = plan_.buckets_[static_cast<size_t>(bucket)];
            if (b.num_items++ == 0) b.first_item = static_cast<uint32_t>(out.size());
            out.push_back(it);
            if (fp8) {
              const Box hf = item_hf_box(plan_, it);
              fp8_saved_ += hf.numel() * static_cast<int64_t>(itemsize(
                                             plan_.keys_[static_cast<size_t>(ov_key(it))].dtype)) -
                            fp8_wire_bytes(hf);
            }
          },
          fp8);
    }
  }
  if (out.size() > 0xFFFFFFFFull) fail(Errc::unsupported, "plan has more than 2^32 items");
}

void PlanBuilder::build_broadcast() {
  BucketFiller filler(plan_, plan_.buckets_, plan_.options_.bucket_bytes);
  std::vector<PlanItem> items;
  for (size_t k = 0; k < plan_.keys_.size(); ++k) {
    if (key_segments_[k].empty()) continue;  // no engine rank loads it
    const Box whole = Box::full(plan_.keys_[k].shape);
    const int32_t key = static_cast<int32_t>(k);
    const int64_t bytes = whole.numel() * static_cast<int64_t>(itemsize(plan_.keys_[k].dtype));
    filler.place(
        -1, -1, [&] { return key; }, bytes, [&] { return whole; },
        [&](int32_t bucket, int64_t, int64_t lo, int64_t len, size_t d) {
          Box slab = whole;
          if (len > 0) slab.offsets[d] = lo, slab.lengths[d] = len;
          int64_t covered = 0;
          for (uint32_t g = key_groups_[k]; g < key_groups_[k + 1]; ++g) {
            const Box& gb = plan_.pieces_[sorted_pieces_[groups_[g].first]].hf_box;
            auto cut = intersect(gb, slab);
            if (!cut) continue;
            covered += cut->numel();
            PlanItem x;
            x.piece = static_cast<int32_t>(sorted_pieces_[choose_holder(
                groups_[g], cut->numel() * static_cast<int64_t>(itemsize(plan_.keys_[k].dtype)))]);
            x.bucket = bucket;
            x.split_dim = static_cast<uint8_t>(d);
            x.split_lo = static_cast<int32_t>(slab.offsets[d]);
            x.split_len = static_cast<int32_t>(slab.lengths[d]);
            items.push_back(x);
          }
          if (covered != slab.numel())
            fail(Errc::invalid_layout, "broadcast needs all of '", plan_.keys_[k].name, "' ",
                 box_str(slab), " but the trainer pieces cover ", covered, " of its ", slab.numel(),
                 " elements");
        });
  }
  // Within a bucket, one holder's items are contiguous (one send to the root).
  std::stable_sort(items.begin(), items.end(), [&](const PlanItem& a, const PlanItem& b) {
    if (a.bucket != b.bucket) return a.bucket < b.bucket;
    return plan_.pieces_[static_cast<size_t>(a.piece)].rank <
           plan_.pieces_[static_cast<size_t>(b.piece)].rank;
  });
  int64_t used = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i == 0 || items[i].bucket != items[i - 1].bucket) used = 0;
    items[i].offset = static_cast<uint32_t>(used);
    used += item_bytes(items[i]);
  }
  plan_.items_ = std::move(items);
  index_items(plan_.buckets_, plan_.items_);
  choose_broadcast_roots();
  build_apply_items();
}

// Roots rotate: each bucket goes to the least-loaded trainer rank (NIC first).
void PlanBuilder::choose_broadcast_roots() {
  const int world = plan_.trainer_world_;
  for (Bucket& b : plan_.buckets_) {
    int best = 0;
    for (int r = 1; r < world; ++r) {
      const int64_t nr = nic_load_[static_cast<size_t>(rank_nic_[static_cast<size_t>(r)])];
      const int64_t nb = nic_load_[static_cast<size_t>(rank_nic_[static_cast<size_t>(best)])];
      if (nr < nb ||
          (nr == nb && rank_load_[static_cast<size_t>(r)] < rank_load_[static_cast<size_t>(best)]))
        best = r;
    }
    b.src_rank = best;
    rank_load_[static_cast<size_t>(best)] += b.bytes;
    nic_load_[static_cast<size_t>(rank_nic_[static_cast<size_t>(best)])] += b.bytes;
  }
}

void PlanBuilder::build_apply_items() {
  const size_t tp = static_cast<size_t>(plan_.engine_templates_);
  std::vector<std::vector<ApplyItem>> per_rank(tp);
  plan_.apply_index_.assign(plan_.buckets_.size() * tp + 1, 0);
  for (const Bucket& b : plan_.buckets_) {
    for (auto& v : per_rank) v.clear();
    for (uint32_t i = b.first_item; i < b.first_item + b.num_items; ++i) {
      const PlanItem& item = plan_.items_[i];
      const Box hf = item_hf_box(plan_, item);
      const int32_t key = plan_.pieces_[static_cast<size_t>(item.piece)].key;
      for (int32_t s : key_segments_[static_cast<size_t>(key)]) {
        const auto& seg = plan_.segments_[static_cast<size_t>(s)];
        if (common_numel(hf, seg.hf_box) > 0)
          per_rank[static_cast<size_t>(seg.tp_rank)].push_back({static_cast<int32_t>(i), s});
      }
    }
    for (size_t r = 0; r < tp; ++r) {
      plan_.apply_index_[static_cast<size_t>(b.id) * tp + r] =
          static_cast<uint32_t>(plan_.apply_.size());
      plan_.apply_.insert(plan_.apply_.end(), per_rank[r].begin(), per_rank[r].end());
    }
  }
  plan_.apply_index_.back() = static_cast<uint32_t>(plan_.apply_.size());
}

}  // namespace weightsync
