// Internals of the planner shared by plan_build.cpp, plan_broadcast.cpp and
// schedule.cpp. Not installed.
#pragma once

#include <weightsync/plan.h>

#include "plan_tables.h"

#include <cstdint>
#include <vector>

namespace weightsync {

// Trainer pieces with the same key and HF box: replicas of one piece of data.
struct PieceGroup {
  int32_t key = 0;
  uint32_t first = 0;  // into PlanBuilder::sorted_pieces_
  uint32_t count = 0;
};

// A piece group meets a segment (one per replica-template, before a sender is chosen).
struct Overlap {
  int32_t group = 0;
  int32_t segment = 0;
  int64_t bytes = 0;
};

class PlanBuilder {
 public:
  PlanBuilder(const TrainerLayout& trainer, const EngineLayout& engine, const Topology& topology,
              const PlanOptions& options);
  Plan build();

  // Public for schedule.cpp: orders the buckets, predicts the time and the
  // lower bound, and fills the per-rank byte totals.
  static void schedule_p2p(Plan& plan, const Topology& topology);
  static void schedule_broadcast(Plan& plan, const Topology& topology);

 private:
  void index_engine_groups();
  void intern_keys();
  void collect_pieces();
  void collect_segments();
  void group_pieces();
  void init_loads();
  std::vector<Overlap> overlaps_of_key(int32_t key, const std::vector<int32_t>& segs) const;
  std::vector<Overlap> all_overlaps() const;
  void decide_fp8_sites(std::vector<Overlap>& overlaps);
  uint32_t choose_holder(const PieceGroup& group, int64_t bytes);
  uint32_t least_loaded_by_nic(const PieceGroup& group) const;
  uint32_t least_loaded(const PieceGroup& group) const;
  void build_p2p();
  struct P2pChoices;
  // Calls f(k, overlap, dst engine rank) for every p2p item k in the order
  // build_p2p chooses holders: replica-major, each replica index over the
  // overlaps of the groups that have it.
  template <class F>
  void for_each_p2p_item(const P2pChoices& c, F f) const;
  struct LinkEntry;  // a p2p item's piece and overlap (plan_pack.cpp)
  std::vector<LinkEntry> sort_by_link(const P2pChoices& c) const;
  void pack_p2p_links(const P2pChoices& choices);
  void build_broadcast();
  void choose_broadcast_roots();
  void build_apply_items();
  uint64_t hash_inputs() const;
  int64_t item_bytes(const PlanItem& item) const;

  const TrainerLayout& trainer_;
  const EngineLayout& engine_;
  const Topology& topology_;
  Plan plan_;
  std::vector<uint32_t> sorted_pieces_;             // piece indices by (key, hf box, rank)
  std::vector<int32_t> sorted_rank_;                // trainer rank of each sorted_pieces_ entry
  std::vector<PieceGroup> groups_;                  // by (key, hf box)
  std::vector<uint32_t> key_groups_;                // key -> first group (size keys + 1)
  std::vector<int32_t> key_max_len0_;               // key -> longest group extent on dim 0
  std::vector<std::vector<int32_t>> key_segments_;  // key -> segment indices
  std::vector<bool> seg_quant_;                     // by segment: its param is FP8 (quantized)
  int64_t fp8_saved_ = 0;           // source bytes minus wire bytes of sender-quantized items
  std::vector<int64_t> rank_load_;  // bytes sent per trainer rank so far
  std::vector<int64_t> nic_load_;   // bytes sent per trainer NIC so far
  std::vector<int32_t> rank_nic_;   // trainer rank -> NIC id
  bool shared_nics_ = false;        // some trainer ranks share a NIC
  // Engine groups, per template: its group's replicas and global rank of
  // replica 0 (replica `rep` of template t is template_base_[t] + rep * tp).
  std::vector<int32_t> template_replicas_, template_base_, template_tp_;
  std::vector<int32_t> template_active_;  // its replicas the plan serves
  int32_t max_replicas_ = 1;
};

// p2p: item k (for_each_p2p_item's order) moves its overlap from
// sorted_pieces_ position holders[k]; seg_rank[o] is overlap o's engine
// template; link_first (size links + 1) starts each link (trainer rank *
// engine world + engine rank).
struct PlanBuilder::P2pChoices {
  std::vector<Overlap> overlaps;
  std::vector<uint32_t> seg_rank;
  std::vector<uint32_t> holders;
  std::vector<uint32_t> link_first;
};

template <class F>
void PlanBuilder::for_each_p2p_item(const P2pChoices& c, F f) const {
  size_t k = 0;
  for (int32_t rep = 0; rep < max_replicas_; ++rep)
    for (size_t o = 0; o < c.overlaps.size(); ++o) {
      const auto t = static_cast<size_t>(c.seg_rank[o]);
      if (rep >= template_replicas_[t]) continue;
      const int dst = template_base_[t] + rep * template_tp_[t];
      if (!plan_.serves_[static_cast<size_t>(dst)]) continue;
      f(k++, o, dst);
    }
}

// Pieces of groups sorted by offset on dim 0 whose extent on dim 0 meets [lo, hi).
// `max_len0` is the longest such extent, which bounds how far back to look.
template <class OffsetOf>
std::pair<uint32_t, uint32_t> dim0_window(uint32_t first, uint32_t last, int64_t lo, int64_t hi,
                                          int64_t max_len0, OffsetOf offset_of) {
  uint32_t a = first, b = last;
  // First index whose offset > lo - max_len0 (earlier ones end before lo).
  uint32_t l = first, r = last;
  while (l < r) {
    const uint32_t m = l + (r - l) / 2;
    if (offset_of(m) <= lo - max_len0)
      l = m + 1;
    else
      r = m;
  }
  a = l;
  l = a, r = last;
  while (l < r) {
    const uint32_t m = l + (r - l) / 2;
    if (offset_of(m) < hi)
      l = m + 1;
    else
      r = m;
  }
  b = l;
  return {a, b};
}

// The number of elements intersect(a, b) holds (0: none), without building
// the box: the planner tests millions of candidate pairs and keeps few cuts.
int64_t common_numel(const Box& a, const Box& b);
// The HF box an item moves: its piece's box, cut by its segment and its split.
Box item_hf_box(const Plan& plan, const PlanItem& item);
// Maps a sub-box of a segment's HF box into the parameter (transpose, rank).
Box map_to_param(const Plan::SegmentRef& seg, const Box& hf);

}  // namespace weightsync
