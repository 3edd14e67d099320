#include "weights_delivery.h"

#include <weightsync/error.h>

#include "core/first_fit.h"

#include <algorithm>
#include <limits>

namespace weightsync::engine {
namespace {

// Places inside the arena start on 256-byte boundaries (vectorised copies,
// and what allocators give tensors).
constexpr int64_t kAlign = 256;

int64_t aligned(int64_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

void check_whole_tensors(const EngineRankLayout& layout, int global_rank) {
  for (const EngineParam& p : layout.params)
    if (p.segments.size() != 1 || p.segments[0].hf_box != Box::full(p.shape) ||
        p.segments[0].param_box != Box::full(p.shape) || p.segments[0].transpose)
      fail(Errc::invalid_argument, "engine rank ", global_rank, ": param '", p.name,
           "' is not a whole HF tensor; load_weights mode needs an engine group of framework "
           "\"hf\"");
}

// The params each bucket writes, in receive order.
std::vector<std::vector<uint32_t>> params_per_bucket(const Plan& plan, int global_rank) {
  const std::vector<int32_t>& order = plan.buckets_received_by(global_rank);
  std::vector<std::vector<uint32_t>> out(order.size());
  const int engine_template = plan.engine_template(global_rank);
  for (size_t k = 0; k < order.size(); ++k) {
    auto add = [&](int32_t segment) {
      out[k].push_back(static_cast<uint32_t>(plan.segment_param(segment)));
    };
    if (plan.mode() == PlanMode::p2p)
      for (const PlanItem& item : plan.items(order[k])) add(item.segment);
    else
      for (const ApplyItem& a : plan.apply_items(order[k], engine_template)) add(a.segment);
    std::sort(out[k].begin(), out[k].end());
    out[k].erase(std::unique(out[k].begin(), out[k].end()), out[k].end());
  }
  return out;
}

}  // namespace

DeliveryPlan plan_delivery(const Plan& plan, int global_rank, const EngineRankLayout& layout,
                           bool keep_version) {
  check_whole_tensors(layout, global_rank);
  const auto per_bucket = params_per_bucket(plan, global_rank);
  const size_t n = layout.params.size();
  std::vector<int64_t> first(n, std::numeric_limits<int64_t>::max()), last(n, -1);
  for (size_t k = 0; k < per_bucket.size(); ++k)
    for (uint32_t p : per_bucket[k]) {
      first[p] = std::min(first[p], static_cast<int64_t>(k));
      last[p] = static_cast<int64_t>(k);
    }
  DeliveryPlan out;
  out.offset.assign(n, 0);
  out.complete_after.assign(per_bucket.size(), {});
  std::vector<detail::LiveSpan> spans;
  const int64_t end = static_cast<int64_t>(per_bucket.size()) - 1;
  for (uint32_t p = 0; p < n; ++p) {
    const EngineParam& param = layout.params[p];
    const int64_t bytes = numel(param.shape) * static_cast<int64_t>(itemsize(param.dtype));
    if (last[p] < 0) {  // no bytes move for it: delivered (empty) with the last bucket
      if (bytes > 0)
        fail(Errc::internal, "engine rank ", global_rank, ": no bucket carries param '", param.name,
             "'");
      if (end >= 0) out.complete_after[static_cast<size_t>(end)].push_back(p);
      continue;
    }
    out.complete_after[static_cast<size_t>(last[p])].push_back(p);
    // Receives are posted up to two buckets ahead of the one being applied.
    if (keep_version)
      spans.push_back({p, 0, end, aligned(bytes)});
    else
      spans.push_back({p, std::max<int64_t>(0, first[p] - 2), last[p], aligned(bytes)});
  }
  for (auto& c : out.complete_after) std::sort(c.begin(), c.end());
  out.arena_bytes = detail::place_first_fit(std::move(spans), out.offset);
  return out;
}

}  // namespace weightsync::engine
