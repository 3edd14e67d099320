// The wire format: fragments of a bucket, their routes and the slot memory.
#include "pipeline/wire.h"

#include <weightsync/error.h>

#include "transport/staging.h"

#include <algorithm>
#include <map>
#include <string_view>

namespace weightsync {

std::vector<Fragment> bucket_fragments(const Plan& plan, int32_t bucket, int64_t direct_min_bytes) {
  const auto items = plan.items(bucket);
  std::vector<Fragment> out;
  int64_t next = 0;
  bool open = false;  // the last fragment collects small items
  for (uint32_t i = 0; i < items.size(); ++i) {
    const Copy c = plan.resolve(items[i]);
    if (c.offset != next)
      fail(Errc::internal, "bucket ", bucket, ": item ", i, " starts at byte ", c.offset,
           ", expected ", next, " (items must be packed back to back)");
    next += c.bytes;
    if (c.bytes >= direct_min_bytes) {
      out.push_back({c.offset, c.bytes, i, 1});
      open = false;
    } else if (open) {
      out.back().bytes += c.bytes;
      ++out.back().count;
    } else {
      out.push_back({c.offset, c.bytes, i, 1});
      open = true;
    }
  }
  return out;
}

int64_t bucket_messages(const Plan& plan, int32_t bucket, const WireOptions& wire) {
  // With delta sync, a whole bucket's header goes first (delta_frame.h).
  return static_cast<int64_t>(bucket_fragments(plan, bucket, wire.direct_min_bytes).size()) +
         (wire.checksums ? 1 : 0) + (wire.delta ? 1 : 0);
}

bool lending_possible(const Plan& plan, const WireOptions& wire, const Capabilities& caps) {
  return plan.mode() == PlanMode::p2p && wire.lend && !wire.checksums_on_device() && !wire.delta &&
         caps.maps_peer_memory;
}

bool lendable_bucket(const Plan& plan, int32_t bucket) {
  for (const PlanItem& item : plan.items(bucket)) {
    const Copy c = plan.resolve(item);
    if (c.fp8 || c.view_box != c.hf_box) return false;
  }
  return true;
}

std::vector<int> lent_params(const Plan& plan, const std::vector<int32_t>& buckets) {
  std::vector<int> out;
  for (int32_t b : buckets)
    for (const PlanItem& item : plan.items(b)) out.push_back(plan.resolve(item).dst_param);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<DType> received_dtypes(const Plan& plan, int engine_template,
                                   const EngineRankLayout& layout) {
  std::map<std::string_view, DType> source;
  std::vector<DType> out;
  out.reserve(layout.params.size());
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const EngineParam& p = layout.params[i];
    out.push_back(p.dtype);
    if (!p.quant || p.segments.empty() || plan.fp8_on_sender(engine_template, static_cast<int>(i)))
      continue;
    if (source.empty())
      for (const PlanKey& k : plan.keys()) source.emplace(k.name, k.dtype);
    const auto it = source.find(p.segments.front().hf_key);
    if (it == source.end())
      fail(Errc::internal, "FP8 param '", p.name, "' reads '", p.segments.front().hf_key,
           "', which the plan lacks");
    out.back() = it->second;
  }
  return out;
}

FragmentRoute direct_route(const TensorView& tensor, const Box& box, const Capabilities& caps,
                           const WireOptions& wire) {
  FragmentRoute r;
  const bool reachable = tensor.memory == MemoryKind::host
                             ? caps.host_memory
                             : caps.cuda_memory && !wire.checksums_on_device();
  if (!reachable) return r;
  const auto first = dense_run_offset(tensor.effective_strides(), box);
  if (!first) return r;
  r.direct =
      static_cast<char*>(tensor.data) + *first * static_cast<int64_t>(itemsize(tensor.dtype));
  r.memory = tensor.memory;
  r.device = tensor.device;
  return r;
}

std::vector<FragmentRoute> route_fragments(
    const Plan& plan, int32_t bucket, int64_t direct_min_bytes,
    const std::function<FragmentRoute(const Copy&)>& direct,
    const std::function<void(const Copy&, int64_t shift)>& add_op, int64_t& slot_bytes) {
  const auto items = plan.items(bucket);
  std::vector<FragmentRoute> out;
  uint32_t ops = 0;
  for (const Fragment& f : bucket_fragments(plan, bucket, direct_min_bytes)) {
    if (f.count == 1 && f.bytes >= direct_min_bytes) {
      // An item its sender quantizes is packed on one side and split into
      // codes and scales on the other: never sent in place.
      const Copy c = plan.resolve(items[f.first]);
      FragmentRoute r = c.fp8 ? FragmentRoute{} : direct(c);
      if (r.direct) {
        r.offset = f.offset;
        r.bytes = f.bytes;
        out.push_back(r);
        continue;
      }
    }
    FragmentRoute r;
    r.offset = f.offset;
    r.bytes = f.bytes;
    r.slot_offset = slot_bytes;
    slot_bytes += f.bytes;
    r.first_op = ops;
    for (uint32_t i = f.first; i < f.first + f.count; ++i, ++ops)
      add_op(plan.resolve(items[i]), r.slot_offset - f.offset);
    r.num_ops = f.count;
    out.push_back(r);
  }
  return out;
}

std::size_t slot_depth(std::size_t slot_bytes, int64_t bucket_bytes, std::size_t buckets,
                       bool broadcast_buckets, const WireOptions& wire, const Capabilities& caps) {
  const std::size_t most = std::min(kMaxSlotDepth, buckets);
  if (broadcast_buckets || wire.delta || caps.ordered_only || most <= 2) return 2;
  if (slot_bytes == 0) return most;
  const std::size_t budget = 2 * static_cast<std::size_t>(std::max<int64_t>(bucket_bytes, 1));
  return std::clamp<std::size_t>(budget / slot_bytes, 2, most);
}

SlotMemory choose_slot_memory(MemoryKind tensors, const Capabilities& caps, const WireOptions& wire,
                              const std::string& who, const std::string& transport) {
  if (tensors == MemoryKind::host) {
    if (caps.host_memory) return SlotMemory::host;
    fail(Errc::unsupported, who, ": its tensors are in host memory, but transport '", transport,
         "' reaches CUDA device memory only (register CUDA tensors, or use a host transport such "
         "as ucx)");
  }
  if (caps.cuda_memory && !wire.checksums_on_device()) return SlotMemory::device;
  if (caps.host_memory) return SlotMemory::pinned;
  fail(Errc::unsupported, who, ": its tensors are in CUDA memory and transport '", transport, "' ",
       caps.cuda_memory ? "reaches device memory only, but checksums are computed on the host "
                          "(turn checksums_gpu off, or use a transport that reaches host memory)"
                        : "reaches neither host nor device memory");
}

std::optional<int64_t> dense_run_offset(const Shape& strides, const Box& box) {
  if (strides.size() != box.rank()) return std::nullopt;
  int64_t expected = 1;  // the stride a dense row-major run needs at this dim
  int64_t first = 0;
  for (size_t d = box.rank(); d-- > 0;) {
    first += box.offsets[d] * strides[d];
    if (box.lengths[d] == 1) continue;
    if (strides[d] != expected) return std::nullopt;
    expected *= box.lengths[d];
  }
  return first;
}

}  // namespace weightsync
