#include "subscriber_pipeline.h"

#include <weightsync/checksum.h>
#include <weightsync/error.h>
#include <weightsync/trace.h>
#include <weightsync/wire.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace weightsync::engine {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Swaps the last two entries (a transposed param seen in HF orientation).
Shape swap_last_two(Shape s) {
  if (s.size() >= 2) std::swap(s[s.size() - 1], s[s.size() - 2]);
  return s;
}

int64_t dot(const Shape& a, const Shape& b) {
  int64_t out = 0;
  for (size_t d = 0; d < a.size(); ++d) out += a[d] * b[d];
  return out;
}

// Prepends `n` entries of `value` (a param may have leading length-1 expert
// dims that the HF tensor lacks; engine_layout.h).
Shape lead(Shape s, size_t n, int64_t value) {
  s.insert(s.begin(), n, value);
  return s;
}

// `shift`: where the bucket's bytes lie in the slot, relative to their bucket
// offset (packed p2p fragments are compacted in the slot).
ApplyOp make_apply_op(const Copy& c, const TensorView& target, int64_t shift = 0) {
  if (c.dst_box.rank() < c.hf_box.rank())
    fail(Errc::internal, "plan copy into engine param ", c.dst_param, ": box ", box_str(c.dst_box),
         " has fewer dims than HF box ", box_str(c.hf_box));
  const size_t extra = c.dst_box.rank() - c.hf_box.rank();
  ApplyOp op;
  op.dtype = target.dtype;
  const auto item = static_cast<int64_t>(itemsize(target.dtype));
  const Box src = c.hf_box.relative_to(c.view_box);
  const Shape packed_strides = contiguous_strides(c.view_box.lengths);
  op.src_offset = c.offset + shift + dot(src.offsets, packed_strides) * item;
  op.lengths = lead(c.hf_box.lengths, extra, 1);
  op.src_strides = lead(packed_strides, extra, 0);
  // Seen through a transposed view, the param box has the HF box's lengths.
  const Shape strides = target.effective_strides();
  const Shape dst_offsets = c.transpose ? swap_last_two(c.dst_box.offsets) : c.dst_box.offsets;
  op.dst_strides = c.transpose ? swap_last_two(strides) : strides;
  const Shape dst_lengths = c.transpose ? swap_last_two(c.dst_box.lengths) : c.dst_box.lengths;
  if (dst_lengths != op.lengths)
    fail(Errc::internal, "plan copy into engine param ", c.dst_param, ": box ", box_str(c.dst_box),
         " does not match HF box ", box_str(c.hf_box), c.transpose ? " transposed" : "");
  op.dst = static_cast<char*>(target.data) + dot(dst_offsets, strides) * item;
  op.target = &target;
  op.view_lengths = lead(c.view_box.lengths, extra, 1);
  op.view_offset = c.offset + shift;
  op.src_box = Box{lead(src.offsets, extra, 0), lead(src.lengths, extra, 1)};
  op.dst_box = c.dst_box;
  op.transpose = c.transpose;
  return op;
}

uint64_t read_trailer(const char* p) {
  uint64_t v = 0;
  for (int i = static_cast<int>(kBucketTrailerBytes) - 1; i >= 0; --i)
    v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

}  // namespace

ReceivePipeline::ReceivePipeline(const Plan& plan, int global_rank,
                                 const std::vector<TensorView>& targets, const WireOptions& wire,
                                 const Capabilities& caps)
    : global_rank_(global_rank),
      trainer_world_(plan.trainer_world()),
      engine_world_(plan.engine_world()),
      broadcast_(plan.mode() == PlanMode::broadcast),
      wire_(wire),
      caps_(caps) {
  const bool broadcast = broadcast_;
  const int tp_rank = global_rank % plan.engine_tp();
  const auto& buckets = plan.buckets();
  for (int32_t b : plan.buckets_received_by(global_rank)) {
    RecvAction a;
    a.bucket = b;
    a.src = buckets[static_cast<size_t>(b)].src_rank;
    a.bytes = buckets[static_cast<size_t>(b)].bytes;
    if (broadcast) {
      for (const ApplyItem& ai : plan.apply_items(b, tp_rank)) {
        const Copy c = plan.resolve(ai, global_rank);
        a.ops.push_back(make_apply_op(c, targets.at(static_cast<size_t>(c.dst_param))));
      }
      a.slot_bytes = a.bytes;
    } else {
      compile_fragments(a, plan, targets);
    }
    slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.slot_bytes) + kBucketTrailerBytes);
    actions_.push_back(std::move(a));
  }
  // The trainers' order (publisher_pipeline.h): predicted start, then id.
  std::sort(actions_.begin(), actions_.end(), [&](const RecvAction& x, const RecvAction& y) {
    const auto& bx = buckets[static_cast<size_t>(x.bucket)];
    const auto& by = buckets[static_cast<size_t>(y.bucket)];
    return bx.start_s != by.start_s ? bx.start_s < by.start_s : x.bucket < y.bucket;
  });
}

FragmentRoute ReceivePipeline::direct_target(const Copy& c, const TensorView& target) const {
  if (c.dst_rank != global_rank_)
    fail(Errc::internal, "engine rank ", global_rank_,
         ": a bucket for it holds an item for engine rank ", c.dst_rank);
  // The packed item must be the param box in row-major order.
  if (c.transpose || c.view_box != c.hf_box || c.dst_box.rank() < c.hf_box.rank() ||
      c.dst_box.lengths != lead(c.hf_box.lengths, c.dst_box.rank() - c.hf_box.rank(), 1))
    return {};
  return direct_route(target, c.dst_box, caps_, wire_);
}

void ReceivePipeline::compile_fragments(RecvAction& a, const Plan& plan,
                                        const std::vector<TensorView>& targets) {
  auto target = [&](const Copy& c) -> const TensorView& {
    return targets.at(static_cast<size_t>(c.dst_param));
  };
  a.fragments = route_fragments(
      plan, a.bucket, wire_.direct_min_bytes,
      [&](const Copy& c) { return direct_target(c, target(c)); },
      [&](const Copy& c, int64_t shift) { a.ops.push_back(make_apply_op(c, target(c), shift)); },
      a.slot_bytes);
}

void ReceivePipeline::prepare(Transport& transport) {
  if (slot_bytes_ == 0 || slots_[0].data) return;
  for (Slot& s : slots_)
    static_cast<RegisteredHostBuffer&>(s) = allocate_registered_host(transport, slot_bytes_);
}

void ReceivePipeline::post(size_t k, Slot& slot, int64_t step, Transport& t) {
  if (k >= actions_.size()) return;
  const RecvAction& a = actions_[k];
  slot.posted_us = trace_now_us();
  const Tag tag = bucket_tag(step, a.bucket, 0);
  if (!broadcast_) {
    // In fragment order: the trainer posts them in that order (wire.h).
    for (const FragmentRoute& f : a.fragments) {
      const Buffer buffer =
          f.direct ? Buffer{f.direct, static_cast<size_t>(f.bytes), f.memory, f.device, nullptr}
                   : host_buffer(slot.data + f.slot_offset, static_cast<size_t>(f.bytes),
                                 slot.region.get());
      slot.requests.push_back(t.recv(a.src, tag, buffer));
    }
    if (wire_.checksums)
      slot.requests.push_back(
          t.recv(a.src, bucket_tag(step, a.bucket, 1),
                 host_buffer(slot.data + a.slot_bytes, kBucketTrailerBytes, slot.region.get())));
    return;
  }
  const Buffer buffer =
      host_buffer(slot.data, static_cast<size_t>(a.bytes) + kBucketTrailerBytes, slot.region.get());
  if (t.capabilities().native_broadcast) {
    // A collective: every engine rank and the root take part (publisher_pipeline.cpp).
    std::vector<int> ranks{a.src};
    for (int g = 0; g < engine_world_; ++g) ranks.push_back(trainer_world_ + g);
    slot.requests.push_back(t.broadcast(buffer, a.src, ranks, tag));
  } else {
    slot.requests.push_back(t.recv(a.src, tag, buffer));
  }
}

void ReceivePipeline::wait(Slot& slot, const std::function<void()>& poll,
                           Clock::time_point deadline) {
  auto last_poll = Clock::now();
  int spins = 0;
  size_t done = 0;  // requests complete in order of posting, mostly
  while (done < slot.requests.size()) {
    const Request& r = *slot.requests[done];
    if (slot.requests[done]->test()) {
      // Every message of a bucket has a size both sides derive from the plan:
      // a shorter one is a peer out of step with it, never data to apply.
      if (r.transferred() != r.bytes() && slot.error.empty())
        slot.error = cat("engine rank ", global_rank_, ": ", r.describe(), " brought ",
                         r.transferred(), " bytes, expected ", r.bytes(),
                         " (does the sender use the same plan and wire options?)");
      ++done;
      spins = 0;
      continue;
    }
    const auto now = Clock::now();
    if (now >= deadline)
      fail(Errc::timeout, "engine rank ", global_rank_, ": ", slot.requests[done]->describe(),
           " did not complete before the step timeout");
    if (now - last_poll >= std::chrono::milliseconds(1)) {
      last_poll = now;
      poll();
    }
    poll_pause(spins);
  }
}

std::pair<uint64_t, uint64_t> ReceivePipeline::checksums(const RecvAction& a, const char* data,
                                                         int64_t step) const {
  if (!wire_.checksums) return {0, 0};
  if (broadcast_)
    return {checksum64(data, static_cast<size_t>(a.bytes), static_cast<uint64_t>(step)),
            read_trailer(data + a.bytes)};
  uint64_t sum = 0;
  for (uint32_t i = 0; i < a.fragments.size(); ++i) {
    const FragmentRoute& f = a.fragments[i];
    const char* p = f.direct ? f.direct : data + f.slot_offset;
    sum = checksum_fold(sum, checksum64(p, static_cast<size_t>(f.bytes), fragment_seed(step, i)));
  }
  return {sum, read_trailer(data + a.slot_bytes)};
}

void ReceivePipeline::apply(const RecvAction& a, size_t first, size_t count, const char* data) {
  for (size_t i = first; i < first + count; ++i) {
    const ApplyOp& op = a.ops[i];
    if (op.target->memory == MemoryKind::host) {
      copy_strided(op.dst, op.dst_strides.data(), data + op.src_offset, op.src_strides.data(),
                   op.lengths.data(), static_cast<int>(op.lengths.size()), itemsize(op.dtype));
    } else {
      const TensorView packed =
          host_view(const_cast<char*>(data) + op.view_offset, op.dtype, op.view_lengths);
      const int r = static_cast<int>(op.target->shape.size());
      const TensorView dst = op.transpose ? transposed(*op.target, r - 2, r - 1) : *op.target;
      Box box = op.dst_box;
      if (op.transpose) {
        box.offsets = swap_last_two(box.offsets);
        box.lengths = swap_last_two(box.lengths);
      }
      copy_box(packed, op.src_box, dst, box);
    }
  }
}

ReceiveReport ReceivePipeline::run(int64_t step, Transport& transport,
                                   const std::function<void()>& poll, Clock::time_point deadline,
                                   StepPhases& phases, Tracer* tracer) {
  ReceiveReport report;
  post(0, slots_[0], step, transport);
  post(1, slots_[1], step, transport);
  for (size_t k = 0; k < actions_.size(); ++k) {
    Slot& slot = slots_[k % 2];
    const RecvAction& a = actions_[k];
    auto t = Clock::now();
    wait(slot, poll, deadline);
    phases.receive += seconds_since(t);
    if (tracer)
      tracer->complete(cat("bucket ", a.bucket), "wire", slot.posted_us, trace_now_us(),
                       {{"bucket", a.bucket}, {"bytes", a.bytes}, {"from", a.src}});
    slot.requests.clear();
    t = Clock::now();
    const auto [sum, sent] = checksums(a, slot.data, step);
    phases.verify += seconds_since(t);
    if (!slot.error.empty()) {
      // Not applied; the step goes on so that the senders do not stall.
      if (report.error.empty()) report.error = slot.error + "; the step is rejected";
      slot.error.clear();
      post(k + 2, slot, step, transport);
      continue;
    }
    report.bytes += static_cast<uint64_t>(a.bytes);
    for (const FragmentRoute& f : a.fragments)
      if (f.direct) report.bytes_direct += static_cast<uint64_t>(f.bytes);
    if (sum != sent) {
      if (report.error.empty())
        report.error = cat("engine rank ", global_rank_, ": bucket ", a.bucket, " of step ", step,
                           " from trainer rank ", a.src, " failed its checksum (computed ",
                           std::hex, sum, ", sent ", sent, std::dec, "); the step is rejected");
    } else {
      report.checksum = checksum_fold(report.checksum, sum);
      t = Clock::now();
      const int64_t apply_us = tracer ? trace_now_us() : 0;
      apply(a, 0, a.ops.size(), slot.data);
      phases.apply += seconds_since(t);
      if (tracer) tracer->complete(cat("apply ", a.bucket), "apply", apply_us, trace_now_us());
    }
    post(k + 2, slot, step, transport);
  }
  return report;
}

void ReceivePipeline::cancel_all() {
  for (Slot& s : slots_) {
    for (auto& r : s.requests) r->cancel();
    s.requests.clear();
  }
}

}  // namespace weightsync::engine
