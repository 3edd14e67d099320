// Plan: which trainer rank sends which bytes to which engine rank, grouped
// into buckets and scheduled (DESIGN.md "The plan").
//
// The plan is the intersection, in HF space, of the trainer's pieces
// (local_pieces over every trainer rank) with the engine's segments (every
// parameter of every engine rank). It is NOT shipped between processes: every
// process recomputes it from the same layouts, topology and options; the
// computation is deterministic (no hashing of pointers, no unordered
// iteration, no threads), so equal inputs give equal plans and an equal
// plan_id, which the coordinator compares to catch a process that disagrees.
//
// Two modes:
// - p2p: a bucket belongs to one link (trainer rank -> global engine rank) and
//   carries exactly the bytes that engine rank needs from that trainer rank.
//   Each item is packed at `offset` in its bucket as a contiguous row-major
//   tensor of hf_box.lengths (view_box == hf_box). The sender packs
//   (copy_box from its local tensor, src_box) and the receiver applies
//   (copy_box into param dst_box, through a transposed view when `transpose`).
// - broadcast: a bucket is gathered at a root trainer rank and broadcast to all
//   engine ranks. Its items are the gather: holders pack their items (each at
//   its own offset; one holder's items are contiguous, see gather_parts) and
//   send that range to the root. Every engine rank then extracts its segments
//   with apply_items(bucket, rank inside the replica): each names the packed
//   view (offset, view_box) it reads from and the sub-box hf_box of it.
//
// FP8 engines (DESIGN.md "FP8 engines"): an FP8 param is quantized from its
// trainer's BF16/F16/F32 data either on the engine rank (its items carry the
// source bytes, which the engine stages and quantizes after the step) or,
// with Fp8Site::sender in p2p mode, by the senders: when every item of the
// param (on that engine rank) holds whole 128 x 128 blocks of it, each item
// travels quantized (`Copy::fp8`): its FP8 codes row-major, then its blocks'
// F32 scales row-major, about half the bytes of BF16. Both give the same bytes.
//
// Items are stored compactly (indices into tables of pieces and segments that
// the plan keeps); `resolve` turns one into boxes.
#pragma once

#include <weightsync/box.h>
#include <weightsync/dtype.h>
#include <weightsync/engine_layout.h>
#include <weightsync/load_spec.h>
#include <weightsync/plan_options.h>
#include <weightsync/topology.h>

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <iosfwd>
#include <span>
#include <string>
#include <vector>

namespace weightsync {

// PlanMode, Fp8Site and PlanOptions (with their JSON) are in plan_options.h.

// Bytes of a box of an FP8 param on the wire when the sender quantizes: one
// per element, then one F32 scale per (whole or edge) 128 x 128 block of its
// last two dims. The box starts on a block boundary.
int64_t fp8_wire_bytes(const Box& hf_box);

// An HF tensor the plan moves (interned: items refer to it by index).
struct PlanKey {
  std::string name;
  Shape shape;
  DType dtype = DType::BF16;
};

// One copy, compact (32 bytes). Use Plan::resolve for its boxes.
struct PlanItem {
  int32_t piece = -1;     // index into the plan's trainer pieces
  int32_t segment = -1;   // index into the plan's engine segments; -1: broadcast gather
  int32_t dst_rank = -1;  // global engine rank; -1: broadcast gather (dst = the root)
  int32_t bucket = -1;
  uint32_t offset = 0;    // byte offset of the packed item inside its bucket
  int32_t split_lo = 0;   // when split_len > 0, the item covers only
  int32_t split_len = 0;  // [split_lo, split_lo+split_len) of HF dim split_dim
  uint8_t split_dim = 0;
};

// Broadcast mode: the engine ranks of a template (engine_template) copy the
// part of gather item `item` that their segment `segment` needs.
struct ApplyItem {
  int32_t item = -1;
  int32_t segment = -1;
};

// Everything about one copy, in boxes.
struct Copy {
  int src_rank = -1;   // trainer rank holding the data
  int src_param = -1;  // index into TrainerLayout::params
  Box src_box;         // in src_rank's local tensor of that param
  int dst_rank = -1;   // global engine rank (replica * tp + rank); -1: broadcast root
  int dst_param = -1;  // index into EngineRankLayout::params; -1: broadcast gather
  Box dst_box;         // in the engine param
  bool transpose = false;
  int key = -1;        // index into Plan::keys()
  Box hf_box;          // the HF box moved
  int64_t offset = 0;  // byte offset in the bucket of the packed view
  Box view_box;        // HF box packed row-major at offset (== hf_box except apply items)
  DType dtype = DType::BF16;
  int64_t bytes = 0;  // hf_box.numel() * itemsize, or fp8_wire_bytes(hf_box) when fp8
  // Quantized by the sender: packed as FP8 codes of hf_box (row-major) at
  // offset, then the F32 scales of its blocks (row-major) at offset +
  // hf_box.numel(); the engine copies the codes into dst_box of dst_param and
  // the scales into scale_box of scale_param.
  bool fp8 = false;
  ScaleFormat fp8_format = ScaleFormat::fp32;
  int scale_param = -1;
  Box scale_box;
};

struct Bucket {
  int32_t id = 0;
  int32_t src_rank = 0;   // sender trainer rank (broadcast: the root)
  int32_t dst_rank = -1;  // global engine rank; -1: broadcast to every engine rank
  int64_t bytes = 0;
  uint32_t first_item = 0;  // items()[first_item, first_item + num_items)
  uint32_t num_items = 0;
  double start_s = 0;  // predicted start and end on the wire
  double end_s = 0;
};

// Contiguous part of a broadcast bucket packed by one holder and sent to the root.
struct GatherPart {
  int src_rank = 0;
  int64_t offset = 0;
  int64_t bytes = 0;
};

struct MinMax {
  int64_t min = 0;
  int64_t max = 0;
};

struct PlanStats {
  int64_t bytes_total = 0;                      // bytes received by all engine ranks together
  std::vector<int64_t> bytes_per_engine_rank;   // received, by global engine rank
  std::vector<int64_t> bytes_per_trainer_rank;  // sent (p2p, gather and broadcast)
  double predicted_s = 0;                       // simulated schedule (docs/planner.md)
  double lower_bound_s = 0;                     // busiest endpoint's bytes over its link + latency
  double plan_s = 0;                            // wall time make_plan took
  // FP8 engines: params (per engine rank, summed over ranks) quantized by the
  // senders and by the engines, and the bytes all engine ranks would receive
  // if every FP8 param were quantized on the engine (the source dtype's
  // bytes); bytes_total is what they receive with this plan.
  int64_t fp8_params_sender = 0, fp8_params_engine = 0;
  int64_t bytes_total_engine_site = 0;
};

class Plan {
 public:
  PlanMode mode() const noexcept { return options_.mode; }
  const PlanOptions& options() const noexcept { return options_; }
  uint64_t plan_id() const noexcept { return plan_id_; }
  std::string plan_id_hex() const;  // 16 lowercase hex digits
  int trainer_world() const noexcept { return trainer_world_; }
  int engine_world() const noexcept { return engine_world_; }
  // Engine ranks of a group's replicas share a rank layout, a "template"
  // (EngineLayout::ranks): the number of templates (tp with one group), the
  // template of a global engine rank, and the first global rank using one.
  int engine_templates() const noexcept { return engine_templates_; }
  int engine_template(int global_engine_rank) const;
  int template_rank(int engine_template) const;
  // Whether the plan sends to global engine rank g (its replica is among
  // PlanOptions::replicas, or that list is empty); Errc::invalid_argument
  // outside the engine world.
  bool serves(int global_engine_rank) const;
  // The global replica of a global engine rank.
  int replica_of(int global_engine_rank) const;

  const std::vector<PlanKey>& keys() const noexcept { return keys_; }
  const std::vector<Bucket>& buckets() const noexcept { return buckets_; }
  const std::vector<PlanItem>& items() const noexcept { return items_; }
  std::span<const PlanItem> items(int32_t bucket) const;
  Copy resolve(const PlanItem& item) const;
  // Broadcast: what the engine ranks of template `engine_template` (every
  // replica of its group) extract from a bucket.
  std::span<const ApplyItem> apply_items(int32_t bucket, int engine_template) const;
  Copy resolve(const ApplyItem& item, int global_engine_rank) const;
  // Broadcast: the holders' contiguous ranges of a bucket, by src_rank.
  std::vector<GatherPart> gather_parts(int32_t bucket) const;

  // Bucket ids in schedule order: by predicted start, then id, which is one
  // order for every process (the pipelines follow it as is; in broadcast mode
  // it is the id order). p2p: sent by trainer rank t / received by global
  // engine rank g. Broadcast: buckets rooted at t / every bucket.
  const std::vector<int32_t>& buckets_sent_by(int trainer_rank) const;
  const std::vector<int32_t>& buckets_received_by(int global_engine_rank) const;
  // Broadcast: buckets trainer rank t contributes gather parts to (in order).
  std::vector<int32_t> buckets_gathered_from(int trainer_rank) const;

  const PlanStats& stats() const noexcept { return stats_; }
  // The summary object of `weightsync plan --json` (without plan_s when 0).
  nlohmann::json summary_json() const;
  // One JSON object per item (p2p and gather items; apply items in broadcast).
  void write_items_jsonl(std::ostream& out) const;

  // The HF key a trainer piece (PlanItem::piece) moves, and the engine param
  // an engine segment (PlanItem::segment, ApplyItem::segment) writes.
  int32_t piece_key(int32_t piece) const;
  int32_t segment_param(int32_t segment) const;
  // True when engine template t's param `param` is quantized by the senders.
  bool fp8_on_sender(int engine_template, int param) const;

  // The tables items index: the planner's internals, defined in its private
  // header (src/core/plan_tables.h).
  struct PieceRef;
  struct SegmentRef;
  const std::vector<PieceRef>& pieces() const noexcept { return pieces_; }
  const std::vector<SegmentRef>& segments() const noexcept { return segments_; }

  // Out of line: the tables' types are complete in the planner only.
  Plan();
  ~Plan();
  Plan(const Plan&);
  Plan(Plan&&) noexcept;
  Plan& operator=(const Plan&);
  Plan& operator=(Plan&&) noexcept;

 private:
  friend class PlanBuilder;
  PlanOptions options_;
  uint64_t plan_id_ = 0;
  int trainer_world_ = 0, engine_world_ = 0, engine_templates_ = 1;
  std::vector<int32_t> template_of_;    // by global engine rank
  std::vector<int32_t> template_rank_;  // first global engine rank of each template
  std::vector<int32_t> replica_of_;     // by global engine rank
  std::vector<uint8_t> serves_;         // by global engine rank (PlanOptions::replicas)
  std::vector<PlanKey> keys_;
  std::vector<PieceRef> pieces_;
  std::vector<SegmentRef> segments_;
  std::vector<std::pair<int32_t, int32_t>> fp8_sender_params_;  // (template, param), sorted
  std::vector<PlanItem> items_;                                 // sorted by bucket
  std::vector<Bucket> buckets_;
  std::vector<ApplyItem> apply_;       // broadcast, sorted by (bucket, tp rank)
  std::vector<uint32_t> apply_index_;  // (bucket * templates + template) -> first apply item
  std::vector<std::vector<int32_t>> sent_by_;  // by trainer rank
  std::vector<std::vector<int32_t>> recv_by_;  // by global engine rank
  PlanStats stats_;
};

// Plans the transfer. Errc::invalid_layout when the engine needs a key or an
// element no trainer rank holds (naming key, engine rank, param and box), or
// when shapes or dtypes of a key disagree between the sides.
Plan make_plan(const TrainerLayout& trainer, const EngineLayout& engine, const Topology& topology,
               const PlanOptions& options = {});

// Checks the plan independently of how it was built (Errc::internal naming the
// engine rank, param and key on failure): every engine element that comes
// from the checkpoint is written exactly once, by an item whose source piece
// holds that HF data; buckets respect bucket_bytes; bytes per engine rank are
// its params' bytes (p2p) or the model bytes (broadcast); items lie inside
// their bucket.
void verify_plan(const Plan& plan, const TrainerLayout& trainer, const EngineLayout& engine);

}  // namespace weightsync
