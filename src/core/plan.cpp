// Plan accessors: resolving compact items into boxes, queries, JSON output.
#include "plan_builder.h"

#include "core/fp8.h"

#include <weightsync/error.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <ostream>

namespace weightsync {

std::string_view plan_mode_name(PlanMode mode) noexcept {
  return mode == PlanMode::p2p ? "p2p" : "broadcast";
}

PlanMode parse_plan_mode(std::string_view name) {
  if (name == "p2p") return PlanMode::p2p;
  if (name == "broadcast") return PlanMode::broadcast;
  fail(Errc::invalid_argument, "unknown plan mode '", name, "' (expected p2p or broadcast)");
}

std::string_view fp8_site_name(Fp8Site site) noexcept {
  return site == Fp8Site::sender ? "sender" : "engine";
}

Fp8Site parse_fp8_site(std::string_view name) {
  if (name == "sender") return Fp8Site::sender;
  if (name == "engine") return Fp8Site::engine;
  fail(Errc::invalid_argument, "unknown FP8 quantization site '", name,
       "' (expected sender or engine)");
}

int64_t fp8_wire_bytes(const Box& hf_box) {
  const size_t n = hf_box.rank();
  if (n < 2) return hf_box.numel();
  using fp8::kBlock;
  int64_t blocks = ((hf_box.lengths[n - 2] + kBlock - 1) / kBlock) *
                   ((hf_box.lengths[n - 1] + kBlock - 1) / kBlock);
  for (size_t d = 0; d + 2 < n; ++d) blocks *= hf_box.lengths[d];
  return hf_box.numel() + 4 * blocks;
}

// The scale param's box of an FP8 param box (last two dims in 128-blocks).
static Box fp8_scale_box(const Box& param_box) {
  Box out = param_box;
  const size_t n = out.rank();
  for (size_t d = n - 2; d < n; ++d) {
    out.offsets[d] /= fp8::kBlock;
    out.lengths[d] = (out.lengths[d] + fp8::kBlock - 1) / fp8::kBlock;
  }
  return out;
}

Box item_hf_box(const Plan& plan, const PlanItem& item) {
  Box hf = plan.pieces()[static_cast<size_t>(item.piece)].hf_box;
  if (item.segment >= 0) {
    auto cut = intersect(hf, plan.segments()[static_cast<size_t>(item.segment)].hf_box);
    if (!cut) fail(Errc::internal, "plan item: piece and segment do not meet");
    hf = *cut;
  }
  if (item.split_len > 0) {
    const size_t d = item.split_dim;
    const int64_t lo = std::max<int64_t>(hf.offsets[d], item.split_lo);
    const int64_t hi = std::min<int64_t>(hf.end(d), int64_t{item.split_lo} + item.split_len);
    hf.offsets[d] = lo;
    hf.lengths[d] = std::max<int64_t>(0, hi - lo);
  }
  return hf;
}

Box map_to_param(const Plan::SegmentRef& seg, const Box& hf) {
  const size_t n = hf.rank(), m = seg.param_box.rank();
  Box out = seg.param_box;
  Shape rel(n), len(n);
  for (size_t d = 0; d < n; ++d) {
    rel[d] = hf.offsets[d] - seg.hf_box.offsets[d];
    len[d] = hf.lengths[d];
  }
  if (seg.transpose && n >= 2) {
    std::swap(rel[n - 2], rel[n - 1]);
    std::swap(len[n - 2], len[n - 1]);
  }
  // A parameter may have more (leading, length-1) dims than the HF tensor.
  for (size_t d = 0; d < n; ++d) {
    out.offsets[m - n + d] += rel[d];
    out.lengths[m - n + d] = len[d];
  }
  return out;
}

std::string Plan::plan_id_hex() const {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(plan_id_));
  return buf;
}

std::span<const PlanItem> Plan::items(int32_t bucket) const {
  const Bucket& b = buckets_.at(static_cast<size_t>(bucket));
  return {items_.data() + b.first_item, b.num_items};
}

Copy Plan::resolve(const PlanItem& item) const {
  const PieceRef& piece = pieces_.at(static_cast<size_t>(item.piece));
  Copy c;
  c.src_rank = piece.rank;
  c.src_param = piece.param;
  c.key = piece.key;
  c.hf_box = item_hf_box(*this, item);
  c.src_box = local_sub_box(piece.hf_box, piece.local_box, c.hf_box);
  c.dst_rank = item.dst_rank;
  if (item.segment >= 0) {
    const SegmentRef& seg = segments_[static_cast<size_t>(item.segment)];
    c.dst_param = seg.param;
    c.transpose = seg.transpose;
    c.dst_box = map_to_param(seg, c.hf_box);
    if (seg.fp8_wire) {
      c.fp8 = true;
      c.fp8_format = seg.fp8_format;
      c.scale_param = seg.scale_param;
      c.scale_box = fp8_scale_box(c.dst_box);
    }
  }
  c.offset = item.offset;
  c.view_box = c.hf_box;
  c.dtype = keys_[static_cast<size_t>(c.key)].dtype;
  c.bytes =
      c.fp8 ? fp8_wire_bytes(c.hf_box) : c.hf_box.numel() * static_cast<int64_t>(itemsize(c.dtype));
  return c;
}

Plan::Plan() = default;
Plan::~Plan() = default;
Plan::Plan(const Plan&) = default;
Plan::Plan(Plan&&) noexcept = default;
Plan& Plan::operator=(const Plan&) = default;
Plan& Plan::operator=(Plan&&) noexcept = default;

int32_t Plan::piece_key(int32_t piece) const {
  if (piece < 0 || static_cast<size_t>(piece) >= pieces_.size())
    fail(Errc::invalid_argument, "plan: piece ", piece, " outside [0, ", pieces_.size(), ")");
  return pieces_[static_cast<size_t>(piece)].key;
}

int32_t Plan::segment_param(int32_t segment) const {
  if (segment < 0 || static_cast<size_t>(segment) >= segments_.size())
    fail(Errc::invalid_argument, "plan: segment ", segment, " outside [0, ", segments_.size(), ")");
  return segments_[static_cast<size_t>(segment)].param;
}

bool Plan::fp8_on_sender(int engine_template, int param) const {
  return std::binary_search(fp8_sender_params_.begin(), fp8_sender_params_.end(),
                            std::pair<int32_t, int32_t>{engine_template, param});
}

int Plan::engine_template(int global_engine_rank) const {
  if (global_engine_rank < 0 || global_engine_rank >= engine_world_)
    fail(Errc::invalid_argument, "plan: engine rank ", global_engine_rank, " outside its ",
         engine_world_, " engine ranks");
  return template_of_[static_cast<size_t>(global_engine_rank)];
}

bool Plan::serves(int global_engine_rank) const {
  engine_template(global_engine_rank);  // the range check
  return serves_[static_cast<size_t>(global_engine_rank)] != 0;
}

int Plan::replica_of(int global_engine_rank) const {
  engine_template(global_engine_rank);
  return replica_of_[static_cast<size_t>(global_engine_rank)];
}

int Plan::template_rank(int engine_template) const {
  if (engine_template < 0 || engine_template >= engine_templates_)
    fail(Errc::invalid_argument, "plan: engine template ", engine_template, " outside its ",
         engine_templates_);
  return template_rank_[static_cast<size_t>(engine_template)];
}

std::span<const ApplyItem> Plan::apply_items(int32_t bucket, int engine_template) const {
  if (mode() != PlanMode::broadcast) return {};
  if (bucket < 0 || static_cast<size_t>(bucket) >= buckets_.size() || engine_template < 0 ||
      engine_template >= engine_templates_)
    fail(Errc::invalid_argument, "apply_items: bucket ", bucket, " / engine template ",
         engine_template, " out of range");
  const size_t i = static_cast<size_t>(bucket) * static_cast<size_t>(engine_templates_) +
                   static_cast<size_t>(engine_template);
  return {apply_.data() + apply_index_[i], apply_index_[i + 1] - apply_index_[i]};
}

Copy Plan::resolve(const ApplyItem& apply, int global_engine_rank) const {
  const PlanItem& gather = items_.at(static_cast<size_t>(apply.item));
  const Copy src = resolve(gather);
  const SegmentRef& seg = segments_.at(static_cast<size_t>(apply.segment));
  Copy c = src;
  auto cut = intersect(src.hf_box, seg.hf_box);
  if (!cut) fail(Errc::internal, "apply item: gather item and segment do not meet");
  c.hf_box = *cut;
  c.view_box = src.hf_box;
  c.src_box = c.hf_box.relative_to(src.hf_box);  // inside the packed view
  c.dst_rank = global_engine_rank;
  c.dst_param = seg.param;
  c.transpose = seg.transpose;
  c.dst_box = map_to_param(seg, c.hf_box);
  c.bytes = c.hf_box.numel() * static_cast<int64_t>(itemsize(c.dtype));
  return c;
}

std::vector<GatherPart> Plan::gather_parts(int32_t bucket) const {
  std::vector<GatherPart> parts;
  for (const PlanItem& item : items(bucket)) {
    const int src = pieces_[static_cast<size_t>(item.piece)].rank;
    const int64_t bytes = item_hf_box(*this, item).numel() *
                          static_cast<int64_t>(itemsize(keys_[pieces_[item.piece].key].dtype));
    if (!parts.empty() && parts.back().src_rank == src) {
      parts.back().bytes = int64_t{item.offset} + bytes - parts.back().offset;
    } else {
      parts.push_back({src, int64_t{item.offset}, bytes});
    }
  }
  return parts;
}

const std::vector<int32_t>& Plan::buckets_sent_by(int trainer_rank) const {
  if (trainer_rank < 0 || trainer_rank >= trainer_world_)
    fail(Errc::invalid_argument, "buckets_sent_by: trainer rank ", trainer_rank, " outside 0..",
         trainer_world_ - 1);
  return sent_by_[static_cast<size_t>(trainer_rank)];
}

const std::vector<int32_t>& Plan::buckets_received_by(int global_engine_rank) const {
  if (global_engine_rank < 0 || global_engine_rank >= engine_world_)
    fail(Errc::invalid_argument, "buckets_received_by: engine rank ", global_engine_rank,
         " outside 0..", engine_world_ - 1);
  return recv_by_[static_cast<size_t>(global_engine_rank)];
}

std::vector<int32_t> Plan::buckets_gathered_from(int trainer_rank) const {
  std::vector<int32_t> out;
  if (mode() != PlanMode::broadcast) return out;
  for (const Bucket& b : buckets_)
    for (const GatherPart& p : gather_parts(b.id))
      if (p.src_rank == trainer_rank && b.src_rank != trainer_rank) {
        out.push_back(b.id);
        break;
      }
  return out;
}

namespace {

nlohmann::json min_max(const std::vector<int64_t>& v) {
  if (v.empty()) return {{"min", 0}, {"max", 0}};
  auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return {{"min", *lo}, {"max", *hi}};
}

nlohmann::json box_json(const Box& b) {
  return {{"offsets", b.offsets}, {"lengths", b.lengths}};
}

}  // namespace

nlohmann::json Plan::summary_json() const {
  int64_t max_bucket = 0;
  for (const Bucket& b : buckets_) max_bucket = std::max(max_bucket, b.bytes);
  nlohmann::json j = {{"plan_id", plan_id_hex()},
                      {"mode", plan_mode_name(mode())},
                      {"trainer_ranks", trainer_world_},
                      {"engine_ranks", engine_world_},
                      {"bucket_bytes", options_.bucket_bytes},
                      {"bytes_total", stats_.bytes_total},
                      {"bytes_per_engine_rank", min_max(stats_.bytes_per_engine_rank)},
                      {"bytes_per_trainer_rank", min_max(stats_.bytes_per_trainer_rank)},
                      {"buckets", buckets_.size()},
                      {"max_bucket_bytes", max_bucket},
                      {"items", items_.size() + apply_.size()},
                      {"keys", keys_.size()},
                      {"predicted_s", stats_.predicted_s},
                      {"lower_bound_s", stats_.lower_bound_s},
                      {"plan_s", stats_.plan_s}};
  if (!options_.replicas.empty()) j["replicas"] = options_.replicas;
  if (options_.same_buckets_per_replica && mode() == PlanMode::p2p)
    j["same_buckets_per_replica"] = true;
  if (stats_.fp8_params_sender + stats_.fp8_params_engine > 0)
    j["fp8"] = {{"site", fp8_site_name(options_.fp8_site)},
                {"params_quantized_by_sender", stats_.fp8_params_sender},
                {"params_quantized_by_engine", stats_.fp8_params_engine},
                {"wire_bytes", stats_.bytes_total},
                {"wire_bytes_engine_site", stats_.bytes_total_engine_site}};
  return j;
}

void Plan::write_items_jsonl(std::ostream& out) const {
  auto emit = [&](const Copy& c, const char* kind, int32_t bucket) {
    nlohmann::json j = {{"kind", kind},
                        {"bucket", bucket},
                        {"offset", c.offset},
                        {"bytes", c.bytes},
                        {"key", keys_[static_cast<size_t>(c.key)].name},
                        {"hf_box", box_json(c.hf_box)},
                        {"src_rank", c.src_rank},
                        {"src_param", c.src_param},
                        {"src_box", box_json(c.src_box)},
                        {"dst_rank", c.dst_rank},
                        {"dst_param", c.dst_param},
                        {"transpose", c.transpose}};
    if (c.dst_param >= 0) j["dst_box"] = box_json(c.dst_box);
    if (c.view_box != c.hf_box) j["view_box"] = box_json(c.view_box);
    if (c.fp8) {
      j["fp8"] = true;
      j["scale_param"] = c.scale_param;
      j["scale_box"] = box_json(c.scale_box);
    }
    out << j.dump() << '\n';
  };
  for (const Bucket& b : buckets_) {
    for (const PlanItem& item : items(b.id))
      emit(resolve(item), mode() == PlanMode::p2p ? "copy" : "gather", b.id);
    if (mode() != PlanMode::broadcast) continue;
    // Apply items are the same for every replica of a group: print them for
    // its first replica.
    for (int t = 0; t < engine_templates_; ++t)
      for (const ApplyItem& a : apply_items(b.id, t))
        emit(resolve(a, template_rank(t)), "apply", b.id);
  }
}

Plan make_plan(const TrainerLayout& trainer, const EngineLayout& engine, const Topology& topology,
               const PlanOptions& options) {
  return PlanBuilder(trainer, engine, topology, options).build();
}

}  // namespace weightsync
