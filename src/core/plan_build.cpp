// The planner: trainer pieces meet engine segments in HF space (per key, by a
// sweep over dim 0), senders are chosen among replicas, items are packed into
// buckets per link. See docs/planner.md.
#include "plan_builder.h"

#include "core/fp8.h"

#include <weightsync/error.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <compare>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <unordered_map>

namespace weightsync {
namespace {

constexpr int64_t kMaxCoord = std::numeric_limits<int32_t>::max();

// Boxes by offsets, then lengths, in one pass over each: the pieces of a
// key are sorted by it, and comparing the vectors for equality first (two
// memcmp calls and a third compare) cost more than the sort's own work.
std::strong_ordering box_order(const Box& a, const Box& b) {
  if (const auto c = a.offsets <=> b.offsets; c != 0) return c;
  return a.lengths <=> b.lengths;
}

// A segment's param box may add leading length-1 dims to its HF box.
void check_segment_shape(const Segment& s, const EngineParam& p, int rank) {
  const size_t n = s.hf_box.rank(), m = s.param_box.rank();
  bool ok = m >= n && n >= 1;
  for (size_t d = 0; ok && d + n < m; ++d) ok = s.param_box.lengths[d] == 1;
  Shape expect(s.hf_box.lengths);
  if (s.transpose && n >= 2) std::swap(expect[n - 2], expect[n - 1]);
  for (size_t d = 0; ok && d < n; ++d) ok = s.param_box.lengths[m - n + d] == expect[d];
  if (!ok || !s.param_box.fits(p.shape))
    fail(Errc::invalid_layout, "engine rank ", rank, " param '", p.name, "': segment of '",
         s.hf_key, "' ", box_str(s.hf_box), " -> ", box_str(s.param_box),
         s.transpose ? " (transposed)" : "", " does not map box to box inside ",
         shape_str(p.shape));
}

// FP8 engines: a quantized weight receives its trainer's BF16, F16 or F32
// bytes, quantized on the engine rank (DESIGN.md "FP8 engines"), all of one
// dtype (`first`: the trainer's key of the param's first segment); any other
// param receives its own dtype.
void check_segment_dtype(const Segment& s, const EngineParam& param, const PlanKey& key,
                         const PlanKey* first, int rank) {
  if (param.quant) {
    if (!fp8::quantizable_source(key.dtype))
      fail(Errc::invalid_layout, "engine rank ", rank, " param '", param.name,
           "' is FP8, quantized from the trainer's data, but the trainer holds '", s.hf_key,
           "' as ", dtype_name(key.dtype), " (the quantizer takes BF16, F16 or F32)");
    if (first->dtype != key.dtype)
      fail(Errc::invalid_layout, "engine rank ", rank, " param '", param.name,
           "' is FP8, quantized from one source dtype, but the trainer holds '", first->name,
           "' as ", dtype_name(first->dtype), " and '", s.hf_key, "' as ", dtype_name(key.dtype));
  } else if (param.dtype != key.dtype) {
    fail(Errc::invalid_layout, "engine rank ", rank, " param '", param.name, "' is ",
         dtype_name(param.dtype), " but the trainer holds '", s.hf_key, "' as ",
         dtype_name(key.dtype));
  }
}

// A segment's boxes and, for an FP8 param, how it is quantized (the caller
// fills in its template, param and key).
Plan::SegmentRef segment_ref(const PlanOptions& options, const Segment& s,
                             const EngineParam& param) {
  Plan::SegmentRef ref;
  ref.transpose = s.transpose;
  ref.hf_box = s.hf_box;
  ref.param_box = s.param_box;
  if (param.quant) {
    // A candidate for quantizing on the sender; decide_fp8_sites keeps
    // it when every item of the param holds whole blocks.
    ref.fp8_wire = options.mode == PlanMode::p2p && options.fp8_site == Fp8Site::sender &&
                   !s.transpose && s.hf_box.rank() == 2 && param.quant->block_rows == fp8::kBlock &&
                   param.quant->block_cols == fp8::kBlock;
    ref.fp8_format = param.quant->scale;
    ref.scale_param = param.scale_param;
  }
  return ref;
}

}  // namespace

int64_t common_numel(const Box& a, const Box& b) {
  if (a.rank() != b.rank()) (void)intersect(a, b);  // Errc::internal, as intersect says
  int64_t n = 1;
  for (size_t d = 0; d < a.rank(); ++d) {
    const int64_t lo = std::max(a.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(a.end(d), b.end(d));
    if (hi <= lo) return 0;
    n *= hi - lo;
  }
  return n;
}

PlanBuilder::PlanBuilder(const TrainerLayout& trainer, const EngineLayout& engine,
                         const Topology& topology, const PlanOptions& options)
    : trainer_(trainer), engine_(engine), topology_(topology) {
  if (options.bucket_bytes < 1024 || options.bucket_bytes > int64_t{0xFFFFFFFF})
    fail(Errc::invalid_argument, "bucket_bytes must be in [1 KiB, 4 GiB), got ",
         options.bucket_bytes);
  topology.validate();
  plan_.options_ = options;
  plan_.trainer_world_ = static_cast<int>(trainer.mesh.world());
  plan_.engine_templates_ = static_cast<int>(engine.ranks.size());
  plan_.engine_world_ = engine.world();
  index_engine_groups();
}

// Which template each global engine rank uses, and the reverse, from the
// groups (each: tp templates, `replicas` replicas of them).
void PlanBuilder::index_engine_groups() {
  const size_t templates = engine_.ranks.size();
  int expect_template = 0, expect_rank = 0;
  for (const EngineGroup& g : engine_.groups) {
    if (g.config.tp < 1 || g.config.replicas < 1 || g.first_template != expect_template ||
        g.first_rank != expect_rank)
      fail(Errc::invalid_layout, "engine layout: group of tp ", g.config.tp, " and ",
           g.config.replicas, " replicas at template ", g.first_template, " and rank ",
           g.first_rank, " (expected ", expect_template, " and ", expect_rank, ")");
    expect_template += g.config.tp;
    expect_rank += g.config.tp * g.config.replicas;
  }
  if (engine_.groups.empty() || static_cast<size_t>(expect_template) != templates)
    fail(Errc::invalid_layout, "engine layout: ", templates, " rank layouts for groups of ",
         expect_template, " ranks in all");
  template_replicas_.resize(templates);
  template_base_.resize(templates);
  template_tp_.resize(templates);
  plan_.template_rank_.resize(templates);
  plan_.template_of_.resize(static_cast<size_t>(plan_.engine_world_));
  plan_.replica_of_.resize(static_cast<size_t>(plan_.engine_world_));
  plan_.serves_.assign(static_cast<size_t>(plan_.engine_world_), 0);
  // Elastic replicas: which replicas the plan serves.
  const std::vector<int32_t>& chosen = plan_.options_.replicas;
  const int replicas = engine_.num_replicas();
  for (size_t i = 0; i < chosen.size(); ++i)
    if (chosen[i] < 0 || chosen[i] >= replicas || (i > 0 && chosen[i] <= chosen[i - 1]))
      fail(Errc::invalid_argument,
           "plan options: replicas must be ascending distinct indices in 0..", replicas - 1,
           " (the engines' replicas), got ", nlohmann::json(chosen).dump());
  std::vector<uint8_t> active(static_cast<size_t>(replicas), chosen.empty() ? 1 : 0);
  for (int32_t r : chosen) active[static_cast<size_t>(r)] = 1;
  template_active_.assign(templates, 0);
  for (const EngineGroup& g : engine_.groups) {
    max_replicas_ = std::max(max_replicas_, g.config.replicas);
    for (int r = 0; r < g.config.tp; ++r) {
      const auto t = static_cast<size_t>(g.first_template + r);
      template_replicas_[t] = g.config.replicas;
      template_base_[t] = g.first_rank + r;
      template_tp_[t] = g.config.tp;
      plan_.template_rank_[t] = g.first_rank + r;
      for (int rep = 0; rep < g.config.replicas; ++rep) {
        const auto global = static_cast<size_t>(g.first_rank + rep * g.config.tp + r);
        plan_.template_of_[global] = static_cast<int32_t>(t);
        plan_.replica_of_[global] = g.first_replica + rep;
        plan_.serves_[global] = active[static_cast<size_t>(g.first_replica + rep)];
        template_active_[t] += plan_.serves_[global];
      }
    }
  }
}

void PlanBuilder::intern_keys() {
  for (const LoadSpec& spec : trainer_.params) {
    std::vector<Shape> shapes = spec.key_shapes();
    for (size_t k = 0; k < shapes.size(); ++k) {
      for (int64_t v : shapes[k])
        if (v > kMaxCoord)
          fail(Errc::unsupported, "param '", spec.name, "': dim of ", v, " exceeds 2^31-1");
      plan_.keys_.push_back({spec.hf_keys[k], std::move(shapes[k]), spec.dtype});
    }
  }
}

void PlanBuilder::collect_pieces() {
  const int world = plan_.trainer_world_;
  // Room for two pieces per (param, rank) so that the table (a hundred bytes
  // per piece, ~10^5..10^6 pieces) is rarely moved; capacity never written
  // costs no memory.
  plan_.pieces_.reserve(2 * trainer_.params.size() * static_cast<size_t>(world));
  int32_t key_base = 0;
  for (size_t p = 0; p < trainer_.params.size(); ++p) {
    const LoadSpec& spec = trainer_.params[p];
    for (int r = 0; r < world; ++r) {
      for (Piece& piece : local_pieces(spec, trainer_.mesh, r)) {
        if (piece.hf_box.empty()) continue;
        plan_.pieces_.push_back({r, static_cast<int32_t>(p), key_base + piece.key,
                                 std::move(piece.hf_box), std::move(piece.local_box)});
      }
    }
    key_base += static_cast<int32_t>(spec.hf_keys.size());
  }
  if (plan_.pieces_.size() > static_cast<size_t>(kMaxCoord))
    fail(Errc::unsupported, "trainer layout has more than 2^31 pieces");
}

void PlanBuilder::collect_segments() {
  std::unordered_map<std::string_view, int32_t> key_ids;
  key_ids.reserve(plan_.keys_.size());
  for (size_t k = 0; k < plan_.keys_.size(); ++k)
    if (!key_ids.emplace(plan_.keys_[k].name, static_cast<int32_t>(k)).second)
      fail(Errc::invalid_layout, "trainer layout: HF key '", plan_.keys_[k].name,
           "' appears in two parameters");
  key_segments_.assign(plan_.keys_.size(), {});
  // Each template once (error messages name the first engine rank using it).
  for (int t = 0; t < plan_.engine_templates_; ++t) {
    const EngineRankLayout& rank = engine_.ranks[static_cast<size_t>(t)];
    const int r = plan_.template_rank_[static_cast<size_t>(t)];
    for (size_t q = 0; q < rank.params.size(); ++q) {
      const EngineParam& param = rank.params[q];
      for (const Segment& s : param.segments) {
        auto it = key_ids.find(s.hf_key);
        if (it == key_ids.end())
          fail(Errc::invalid_layout, "engine rank ", r, " param '", param.name, "' needs HF key '",
               s.hf_key, "', which no trainer parameter holds");
        const PlanKey& key = plan_.keys_[static_cast<size_t>(it->second)];
        if (!s.hf_box.fits(key.shape))
          fail(Errc::invalid_layout, "engine rank ", r, " param '", param.name, "': box ",
               box_str(s.hf_box), " of '", s.hf_key, "' outside its trainer shape ",
               shape_str(key.shape));
        const PlanKey* first =
            param.quant
                ? &plan_.keys_[static_cast<size_t>(key_ids.at(param.segments.front().hf_key))]
                : nullptr;
        check_segment_dtype(s, param, key, first, r);
        check_segment_shape(s, param, r);
        if (s.hf_box.empty()) continue;
        key_segments_[static_cast<size_t>(it->second)].push_back(
            static_cast<int32_t>(plan_.segments_.size()));
        Plan::SegmentRef ref = segment_ref(plan_.options_, s, param);
        ref.tp_rank = t;
        ref.param = static_cast<int32_t>(q);
        ref.key = it->second;
        seg_quant_.push_back(param.quant.has_value());
        plan_.segments_.push_back(std::move(ref));
      }
    }
  }
}

void PlanBuilder::group_pieces() {
  const auto& pieces = plan_.pieces_;
  // A counting sort by key, then a sort of each key's few pieces by (box,
  // rank, index): cheaper than one sort of all pieces comparing boxes.
  std::vector<uint32_t> first(plan_.keys_.size() + 1, 0);
  for (const auto& p : pieces) ++first[static_cast<size_t>(p.key) + 1];
  for (size_t k = 0; k < plan_.keys_.size(); ++k) first[k + 1] += first[k];
  sorted_pieces_.resize(pieces.size());
  {
    std::vector<uint32_t> next(first.begin(), first.end() - 1);
    for (size_t i = 0; i < pieces.size(); ++i)
      sorted_pieces_[next[static_cast<size_t>(pieces[i].key)]++] = static_cast<uint32_t>(i);
  }
  for (size_t k = 0; k < plan_.keys_.size(); ++k)
    std::sort(sorted_pieces_.begin() + first[k], sorted_pieces_.begin() + first[k + 1],
              [&](uint32_t a, uint32_t b) {
                const auto &pa = pieces[a], &pb = pieces[b];
                if (const auto c = box_order(pa.hf_box, pb.hf_box); c != 0) return c < 0;
                return pa.rank != pb.rank ? pa.rank < pb.rank : a < b;
              });
  key_groups_.assign(plan_.keys_.size() + 1, 0);
  key_max_len0_.assign(plan_.keys_.size(), 0);
  sorted_rank_.resize(sorted_pieces_.size());
  for (size_t i = 0; i < sorted_pieces_.size(); ++i) {
    const auto& p = pieces[sorted_pieces_[i]];
    sorted_rank_[i] = p.rank;
    if (i > 0) {
      const auto& prev = pieces[sorted_pieces_[i - 1]];
      if (prev.key == p.key && prev.hf_box == p.hf_box) {
        ++groups_.back().count;
        continue;
      }
    }
    groups_.push_back({p.key, static_cast<uint32_t>(i), 1});
    key_max_len0_[static_cast<size_t>(p.key)] = std::max<int32_t>(
        key_max_len0_[static_cast<size_t>(p.key)], static_cast<int32_t>(p.hf_box.lengths[0]));
  }
  // key_groups_[k] = first group of key k (groups are sorted by key).
  size_t g = 0;
  for (size_t k = 0; k <= plan_.keys_.size(); ++k) {
    while (g < groups_.size() && static_cast<size_t>(groups_[g].key) < k) ++g;
    key_groups_[k] = static_cast<uint32_t>(g);
  }
}

// The piece groups meeting each segment of `key`; checks that they tile it.
std::vector<Overlap> PlanBuilder::overlaps_of_key(int32_t key,
                                                  const std::vector<int32_t>& segs) const {
  std::vector<Overlap> out;
  const uint32_t first = key_groups_[static_cast<size_t>(key)];
  const uint32_t last = key_groups_[static_cast<size_t>(key) + 1];
  const size_t item = itemsize(plan_.keys_[static_cast<size_t>(key)].dtype);
  auto group_box = [&](uint32_t g) -> const Box& {
    return plan_.pieces_[sorted_pieces_[groups_[g].first]].hf_box;
  };
  for (int32_t s : segs) {
    const Plan::SegmentRef& seg = plan_.segments_[static_cast<size_t>(s)];
    const auto [a, b] = dim0_window(first, last, seg.hf_box.offsets[0], seg.hf_box.end(0),
                                    key_max_len0_[static_cast<size_t>(key)],
                                    [&](uint32_t g) { return group_box(g).offsets[0]; });
    int64_t covered = 0;
    for (uint32_t g = a; g < b; ++g) {
      const int64_t n = common_numel(group_box(g), seg.hf_box);
      if (n == 0) continue;
      covered += n;
      out.push_back({static_cast<int32_t>(g), s, n * static_cast<int64_t>(item)});
    }
    if (covered != seg.hf_box.numel()) {
      const auto& rank = engine_.ranks[static_cast<size_t>(seg.tp_rank)];
      fail(Errc::invalid_layout, "engine rank ",
           plan_.template_rank_[static_cast<size_t>(seg.tp_rank)], " param '",
           rank.params[static_cast<size_t>(seg.param)].name, "' needs ", box_str(seg.hf_box),
           " of '", plan_.keys_[static_cast<size_t>(key)].name, "': ",
           covered < seg.hf_box.numel() ? "the trainer ranks hold only "
                                        : "the trainer pieces overlap, covering ",
           covered, " of its ", seg.hf_box.numel(), " elements");
    }
  }
  return out;
}

std::vector<Overlap> PlanBuilder::all_overlaps() const {
  std::vector<Overlap> out;
  for (size_t k = 0; k < plan_.keys_.size(); ++k) {
    if (key_segments_[k].empty()) continue;
    auto part = overlaps_of_key(static_cast<int32_t>(k), key_segments_[k]);
    out.insert(out.end(), part.begin(), part.end());
  }
  return out;
}

// Least-loaded holder: by its NIC's bytes, then its own, then the lowest
// rank. Returns its position in sorted_pieces_. Called once per item (millions
// at 1T scale): it reads only the small rank and load tables.
uint32_t PlanBuilder::choose_holder(const PieceGroup& group, int64_t bytes) {
  uint32_t best = group.first;
  if (group.count > 1) best = shared_nics_ ? least_loaded_by_nic(group) : least_loaded(group);
  const auto rank = static_cast<size_t>(sorted_rank_[best]);
  rank_load_[rank] += bytes;
  nic_load_[static_cast<size_t>(rank_nic_[rank])] += bytes;
  return best;
}

uint32_t PlanBuilder::least_loaded_by_nic(const PieceGroup& group) const {
  uint32_t best = group.first;
  int32_t rank = sorted_rank_[best];
  int64_t best_nic = nic_load_[static_cast<size_t>(rank_nic_[static_cast<size_t>(rank)])];
  int64_t best_own = rank_load_[static_cast<size_t>(rank)];
  for (uint32_t pos = group.first + 1; pos < group.first + group.count; ++pos) {
    const int32_t r = sorted_rank_[pos];
    const int64_t nic = nic_load_[static_cast<size_t>(rank_nic_[static_cast<size_t>(r)])];
    const int64_t own = rank_load_[static_cast<size_t>(r)];
    if (nic < best_nic || (nic == best_nic && own < best_own))
      best = pos, best_nic = nic, best_own = own;
  }
  return best;
}

// One NIC per rank (the default topology): a NIC's bytes are its rank's, so
// the same choice reads one load per holder instead of three tables.
uint32_t PlanBuilder::least_loaded(const PieceGroup& group) const {
  uint32_t best = group.first;
  int64_t best_own = rank_load_[static_cast<size_t>(sorted_rank_[best])];
  for (uint32_t pos = group.first + 1; pos < group.first + group.count; ++pos) {
    const int64_t own = rank_load_[static_cast<size_t>(sorted_rank_[pos])];
    if (own < best_own) best = pos, best_own = own;
  }
  return best;
}

int64_t PlanBuilder::item_bytes(const PlanItem& item) const {
  const auto& piece = plan_.pieces_[static_cast<size_t>(item.piece)];
  return item_hf_box(plan_, item).numel() *
         static_cast<int64_t>(itemsize(plan_.keys_[static_cast<size_t>(piece.key)].dtype));
}

// Trainer NIC ids, so that senders sharing a NIC are balanced as one.
void PlanBuilder::init_loads() {
  const int world = plan_.trainer_world_;
  rank_nic_.resize(static_cast<size_t>(world));
  rank_load_.assign(static_cast<size_t>(world), 0);
  nic_load_.assign(static_cast<size_t>(world), 0);
  std::map<std::pair<int, int>, int32_t> nic_ids;
  for (int r = 0; r < world; ++r) {
    const std::pair<int, int> nic{topology_.trainer_node(r, world),
                                  topology_.trainer_slot(r, world) / topology_.gpus_per_nic};
    rank_nic_[static_cast<size_t>(r)] = nic_ids.emplace(nic, r).first->second;
  }
  shared_nics_ = nic_ids.size() < static_cast<size_t>(world);
}

void PlanBuilder::build_p2p() {
  P2pChoices c;
  c.overlaps = all_overlaps();
  decide_fp8_sites(c.overlaps);
  const size_t n = c.overlaps.size();
  const size_t engines = static_cast<size_t>(plan_.engine_world_);
  c.seg_rank.resize(n);
  size_t items = 0;
  for (size_t o = 0; o < n; ++o) {
    c.seg_rank[o] =
        static_cast<uint32_t>(plan_.segments_[static_cast<size_t>(c.overlaps[o].segment)].tp_rank);
    items += static_cast<size_t>(template_active_[c.seg_rank[o]]);
  }
  if (items > 0xFFFFFFFFull) fail(Errc::unsupported, "plan has more than 2^32 items");
  // Replica-major so that each replica spreads over the holders the previous
  // ones left least loaded. Only the chosen holder is kept, and the items per
  // link are counted: pack_p2p_links builds the items once, in link order.
  c.holders.resize(items);
  c.link_first.assign(static_cast<size_t>(plan_.trainer_world_) * engines + 1, 0);
  // Same buckets per replica: the later replicas take the first one's holders.
  constexpr uint32_t kNone = 0xFFFFFFFFu;
  std::vector<uint32_t> first_holder;
  if (plan_.options_.same_buckets_per_replica) first_holder.assign(n, kNone);
  for_each_p2p_item(c, [&](size_t k, size_t o, int dst) {
    const Overlap& ov = c.overlaps[o];
    uint32_t pos = first_holder.empty() ? kNone : first_holder[o];
    if (pos == kNone) {
      pos = choose_holder(groups_[static_cast<size_t>(ov.group)], ov.bytes);
      if (!first_holder.empty()) first_holder[o] = pos;
    } else {
      const auto rank = static_cast<size_t>(sorted_rank_[pos]);
      rank_load_[rank] += ov.bytes;
      nic_load_[static_cast<size_t>(rank_nic_[rank])] += ov.bytes;
    }
    c.holders[k] = pos;
    ++c.link_first[static_cast<size_t>(sorted_rank_[pos]) * engines + static_cast<size_t>(dst) + 1];
  });
  for (size_t l = 1; l < c.link_first.size(); ++l) c.link_first[l] += c.link_first[l - 1];
  pack_p2p_links(c);
}

namespace {

// Whether `cut`, a part of segment `seg`'s HF box, holds whole 128 x 128 blocks
// of it (the segment starts on a block boundary): its last two dims start on
// one and end on one or at the segment's end.
bool holds_whole_blocks(const Box& cut, const Box& seg) {
  for (size_t d = cut.rank() - 2; d < cut.rank(); ++d) {
    const int64_t lo = cut.offsets[d] - seg.offsets[d], hi = cut.end(d) - seg.offsets[d];
    if (lo % fp8::kBlock != 0 || (hi % fp8::kBlock != 0 && cut.end(d) != seg.end(d))) return false;
  }
  return true;
}

}  // namespace

// FP8 params quantized by the senders: those (per engine template) whose
// every segment is a candidate and every overlap holds whole blocks. Their
// overlaps then weigh their wire bytes.
void PlanBuilder::decide_fp8_sites(std::vector<Overlap>& overlaps) {
  std::map<std::pair<int32_t, int32_t>, bool> sender;  // (template, param) -> possible
  for (size_t i = 0; i < plan_.segments_.size(); ++i) {
    const Plan::SegmentRef& s = plan_.segments_[i];
    if (!seg_quant_[i]) continue;
    auto [it, fresh] = sender.emplace(std::pair{s.tp_rank, s.param}, true);
    if (!s.fp8_wire) it->second = false;
  }
  auto cut_of = [&](const Overlap& ov) {
    const Box& gb =
        plan_.pieces_[sorted_pieces_[groups_[static_cast<size_t>(ov.group)].first]].hf_box;
    return *intersect(gb, plan_.segments_[static_cast<size_t>(ov.segment)].hf_box);
  };
  for (const Overlap& ov : overlaps) {
    const Plan::SegmentRef& s = plan_.segments_[static_cast<size_t>(ov.segment)];
    if (s.fp8_wire && !holds_whole_blocks(cut_of(ov), s.hf_box))
      sender[{s.tp_rank, s.param}] = false;
  }
  for (size_t i = 0; i < plan_.segments_.size(); ++i) {
    Plan::SegmentRef& s = plan_.segments_[i];
    if (seg_quant_[i]) s.fp8_wire = sender.at({s.tp_rank, s.param});
  }
  for (const auto& [tp, yes] : sender) {
    const int64_t ranks = template_active_[static_cast<size_t>(tp.first)];
    (yes ? plan_.stats_.fp8_params_sender : plan_.stats_.fp8_params_engine) += ranks;
    if (yes) plan_.fp8_sender_params_.push_back(tp);
  }
  for (Overlap& ov : overlaps)
    if (plan_.segments_[static_cast<size_t>(ov.segment)].fp8_wire)
      ov.bytes = fp8_wire_bytes(cut_of(ov));
}

uint64_t PlanBuilder::hash_inputs() const {
  // A word-wise multiply-xorshift hash over the tables the plan is computed
  // from (stable across runs and machines of the same endianness).
  uint64_t h = 0x9e3779b97f4a7c15ull;
  auto mix = [&](uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 31;
  };
  auto mix_box = [&](const Box& b) {
    mix(b.rank());
    for (size_t d = 0; d < b.rank(); ++d)
      mix(static_cast<uint64_t>(b.offsets[d])), mix(b.lengths[d]);
  };
  mix(static_cast<uint64_t>(plan_.options_.mode));
  mix(static_cast<uint64_t>(plan_.options_.bucket_bytes));
  // FP8 engines: where they are quantized changes the items (other plans'
  // ids stay as they were).
  if (std::find(seg_quant_.begin(), seg_quant_.end(), true) != seg_quant_.end())
    mix(static_cast<uint64_t>(plan_.options_.fp8_site) + 0x8f8);
  mix(plan_.trainer_world_), mix(plan_.engine_world_), mix(plan_.engine_templates_);
  // Other plans' ids stay as they were.
  if (plan_.options_.same_buckets_per_replica && plan_.options_.mode == PlanMode::p2p)
    mix(0x5a3eb0c4ull);
  // Elastic replicas: the membership served (plans of static jobs keep their ids).
  if (!plan_.options_.replicas.empty()) {
    mix(0xe1a57ull + plan_.options_.replicas.size());
    for (int32_t r : plan_.options_.replicas) mix(static_cast<uint64_t>(r));
  }
  // Several groups: which template each engine rank uses (one group's is
  // implied by the counts above, and its plan ids stay as they were).
  if (engine_.groups.size() > 1)
    for (int32_t t : plan_.template_of_) mix(static_cast<uint64_t>(t));
  for (const PlanKey& k : plan_.keys_) {
    for (char c : k.name) mix(static_cast<uint8_t>(c));
    mix(static_cast<uint64_t>(k.dtype));
    mix_box(Box::full(k.shape));
  }
  for (const auto& p : plan_.pieces_) {
    mix(p.rank), mix(p.param), mix(p.key), mix_box(p.hf_box), mix_box(p.local_box);
  }
  for (const auto& s : plan_.segments_) {
    mix(s.tp_rank), mix(s.param), mix(s.key), mix(s.transpose), mix_box(s.hf_box),
        mix_box(s.param_box);
  }
  const std::string topo = topology_.to_json().dump();
  for (char c : topo) mix(static_cast<uint8_t>(c));
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

Plan PlanBuilder::build() {
  const auto t0 = std::chrono::steady_clock::now();
  // WEIGHTSYNC_PLAN_PROFILE=1 prints the time of each phase to stderr.
  const bool profile = std::getenv("WEIGHTSYNC_PLAN_PROFILE") != nullptr;
  auto last = t0;
  auto phase = [&](const char* name) {
    if (!profile) return;
    const auto now = std::chrono::steady_clock::now();
    std::fprintf(stderr, "plan phase %-10s %.3f s\n", name,
                 std::chrono::duration<double>(now - last).count());
    last = now;
  };
  intern_keys();
  collect_pieces();
  phase("pieces");
  collect_segments();
  group_pieces();
  phase("groups");
  init_loads();
  plan_.plan_id_ = hash_inputs();
  phase("hash");
  if (plan_.mode() == PlanMode::p2p) {
    build_p2p();
    phase("items");
    schedule_p2p(plan_, topology_);
    plan_.stats_.bytes_total_engine_site = plan_.stats_.bytes_total + fp8_saved_;
  } else {
    build_broadcast();
    phase("items");
    schedule_broadcast(plan_, topology_);
    plan_.stats_.bytes_total_engine_site = plan_.stats_.bytes_total;
    std::vector<Overlap> none;
    decide_fp8_sites(none);  // counts the FP8 params: all quantized on the engines
  }
  phase("schedule");
  plan_.stats_.plan_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return std::move(plan_);
}

}  // namespace weightsync
