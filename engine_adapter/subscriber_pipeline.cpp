#include "subscriber_pipeline.h"

#include <weightsync/checksum.h>
#include <weightsync/error.h>
#include <weightsync/trace.h>

#include "pipeline/item_copies.h"
#include "pipeline/wire.h"

#include "core/fp8.h"
#include "transport/staging.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <utility>

namespace weightsync::engine {
namespace {

using Clock = std::chrono::steady_clock;

// The copier's event for publish_staging, after the slots' two
// (pipeline::slot_event).
constexpr int kPublishSlot = 2;
using pipeline::slot_event;

using pipeline::seconds_since;

using pipeline::add_apply;
using pipeline::add_apply_fp8;
using pipeline::addr;

}  // namespace

ReceivePipeline::ReceivePipeline(const Plan& plan, int global_rank,
                                 const std::vector<TensorView>& params, bool staging,
                                 const pipeline::RankMemory& memory, const WireOptions& wire,
                                 Transport& transport)
    : global_rank_(global_rank),
      trainer_world_(plan.trainer_world()),
      engine_world_(plan.engine_world()),
      broadcast_(plan.mode() == PlanMode::broadcast),
      wire_(wire),
      caps_(transport.capabilities()),
      memory_(memory),
      delta_(plan, global_rank, memory, wire, copier_) {
  const std::vector<TensorView> targets = staging ? make_staging(params, transport) : params;
  // The plan's order, which the trainers follow (publisher_pipeline.h).
  for (int32_t b : plan.buckets_received_by(global_rank))
    actions_.push_back(compile_action(b, plan, targets));
  changed_.assign(params.size(), false);
  int64_t largest = 0;
  for (const RecvAction& a : actions_) largest = std::max(largest, a.bytes);
  slots_.resize(slot_depth(slot_bytes_, largest, actions_.size(), broadcast_, wire_, caps_));
  if (lending_possible(plan, wire_, caps_))
    lender_.plan(plan, actions_, targets, caps_.cuda_memory ? MemoryKind::cuda : MemoryKind::host);
}

RecvAction ReceivePipeline::compile_action(int32_t b, const Plan& plan,
                                           const std::vector<TensorView>& targets) {
  RecvAction a;
  a.bucket = b;
  a.src = plan.buckets()[static_cast<size_t>(b)].src_rank;
  a.bytes = plan.buckets()[static_cast<size_t>(b)].bytes;
  if (broadcast_) {
    std::vector<std::pair<int64_t, uint32_t>> writes;
    for (const ApplyItem& ai : plan.apply_items(b, plan.engine_template(global_rank_))) {
      const Copy c = plan.resolve(ai, global_rank_);
      add_apply(a.apply, c, targets.at(static_cast<size_t>(c.dst_param)), 0);
      writes.emplace_back(c.offset, static_cast<uint32_t>(c.dst_param));
    }
    a.slot_bytes = a.bytes;
    if (wire_.delta) delta_.compile_broadcast(a, plan, writes);
  } else {
    if (wire_.delta) delta_.compile_p2p(a, plan, targets);
    compile_fragments(a, plan, targets);
  }
  // A frame lands in the slot whole.
  slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.frame_bytes) + kBucketTrailerBytes);
  slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.slot_bytes) + kBucketTrailerBytes);
  std::sort(a.params.begin(), a.params.end());
  a.params.erase(std::unique(a.params.begin(), a.params.end()), a.params.end());
  return a;
}

void ReceivePipeline::mark_changed(const RecvAction& a) {
  for (uint32_t p : a.params) changed_[p] = true;
}

// Private copies of the params in their memory, and the program that
// publishes them.
std::vector<TensorView> ReceivePipeline::make_staging(const std::vector<TensorView>& params,
                                                      Transport& transport) {
  std::vector<TensorView> out;
  for (const TensorView& p : params) {
    StagingCopy copy;
    const size_t bytes = std::max<size_t>(p.nbytes(), 1);
    char* data = nullptr;
    if (p.memory == MemoryKind::cuda && p.numel() > 0) {
      copy.device = gpu::Memory(bytes, gpu::MemoryPlace::device, memory_.device);
      data = copy.device.data();
    } else {
      copy.host = transport.allocate_host(bytes);
      data = copy.host.get();
    }
    out.push_back(tensor_view(data, p.dtype, p.shape, p.memory, p.device));
    publish_.add(static_cast<int64_t>(addr(data)), contiguous_strides(p.shape),
                 static_cast<int64_t>(addr(p.data)), p.effective_strides(), p.shape,
                 itemsize(p.dtype));
    staging_.push_back(std::move(copy));
  }
  return out;
}

FragmentRoute ReceivePipeline::direct_target(const Copy& c, const TensorView& target) const {
  check_item_rank(c, global_rank_);
  // The packed item must be the param box in row-major order.
  if (!pipeline::packed_as_dst_box(c)) return {};
  return direct_route(target, c.dst_box, caps_, wire_);
}

void ReceivePipeline::compile_fragments(RecvAction& a, const Plan& plan,
                                        const std::vector<TensorView>& targets) {
  auto target = [&](const Copy& c) -> const TensorView& {
    return targets.at(static_cast<size_t>(c.dst_param));
  };
  std::vector<uint32_t> first_run;  // by op (packed item): its first run of a.apply
  std::vector<bool> whole;          // by op: its apply reads its packed box whole
  a.fragments = route_fragments(
      plan, a.bucket, wire_.direct_min_bytes,
      [&](const Copy& c) { return direct_target(c, target(c)); },
      [&](const Copy& c, int64_t shift) {
        first_run.push_back(static_cast<uint32_t>(a.apply.size()));
        whole.push_back(c.view_box == c.hf_box);
        if (c.fp8) return add_apply_fp8(a.apply, c, target(c), targets.at(c.scale_param), shift);
        add_apply(a.apply, c, target(c), shift);
      },
      a.slot_bytes);
  first_run.push_back(static_cast<uint32_t>(a.apply.size()));
  fuse_fragments(a, first_run, whole);
}

void ReceivePipeline::prepare(Transport& transport, SlotMemory slots, int slot_device) {
  if (slots_[0].buffer.data) return;
  slot_memory_ = slots;
  if (wire_.delta) delta_.check(broadcast_, transport.capabilities().native_broadcast, slots);
  const bool device_delta = wire_.delta && delta_.on_device();
  std::vector<const CopyProgram*> programs;
  for (const RecvAction& a : actions_) programs.push_back(&a.apply);
  programs.push_back(&publish_);
  if (device_delta) {  // gather_index(k), then frame_apply_index(k)
    for (const RecvAction& a : actions_) programs.push_back(&a.gather);
    for (const RecvAction& a : actions_) programs.push_back(&a.frame_apply);
  }
  copier_.prepare(programs, memory_, 3);
  lender_.register_memory(transport);
  if (slot_bytes_ == 0) return;
  for (Slot& s : slots_) s.buffer = allocate_staging(transport, slot_bytes_, slots, slot_device);
  if (wire_.delta) {
    int64_t most = 1;
    for (const RecvAction& a : actions_) most = std::max(most, a.bytes);
    delta_.prepare(most);
  }
}

void ReceivePipeline::post(size_t k, int s, int64_t step, Transport& t) {
  if (k >= actions_.size()) return;
  const RecvAction& a = actions_[k];
  Slot& slot = slots_[s];
  slot.posted_us = trace_now_us();
  const Tag tag = bucket_tag(step, a.bucket, 0);
  slot.fragments = false;
  if (lender_.lent(a)) {
    // The trainer rank writes the bucket into the params; this says it did.
    slot.posted.add(
        t.recv(a.src, tag, Buffer{nullptr, 0, lender_.memory(), memory_.device, nullptr}));
    return;
  }
  if (wire_.delta) {  // a frame (broadcast: never a native broadcast, see prepare)
    slot.posted.add(t.recv(a.src, tag, slot.buffer.buffer(0, slot_bytes_)));
    return;
  }
  if (!broadcast_) return post_fragments(a, slot, step, t);
  const Buffer buffer = slot.buffer.buffer(0, static_cast<size_t>(a.bytes) + kBucketTrailerBytes);
  if (t.capabilities().native_broadcast) {
    // A collective: every engine rank and the root take part (publisher_pipeline.cpp).
    std::vector<int> ranks{a.src};
    for (int g = 0; g < engine_world_; ++g) ranks.push_back(trainer_world_ + g);
    slot.posted.add(t.broadcast(buffer, a.src, ranks, tag));
  } else {
    slot.posted.add(t.recv(a.src, tag, buffer));
  }
}

void ReceivePipeline::post_fragments(const RecvAction& a, Slot& slot, int64_t step, Transport& t) {
  const Tag tag = bucket_tag(step, a.bucket, 0);
  // In fragment order: the trainer posts them in that order (wire.h).
  for (const FragmentRoute& f : a.fragments) {
    const Buffer buffer =
        f.direct
            ? Buffer{f.direct, static_cast<size_t>(f.bytes), f.memory, f.device, nullptr}
            : slot.buffer.buffer(static_cast<size_t>(f.slot_offset), static_cast<size_t>(f.bytes));
    slot.posted.add(t.recv(a.src, tag, buffer));
  }
  if (wire_.checksums)
    slot.posted.add(
        t.recv(a.src, bucket_tag(step, a.bucket, 1),
               slot.buffer.buffer(static_cast<size_t>(a.slot_bytes), kBucketTrailerBytes)));
}

// Waits for bucket k's messages in slot `s`; a message that came short is
// recorded in the slot's error.
void ReceivePipeline::receive(size_t k, int s, int64_t step, pipeline::Loop& loop,
                              StepPhases& phases, Tracer* tracer) {
  Slot& slot = slots_[s];
  const RecvAction& a = actions_[k];
  const auto t = Clock::now();
  pipeline::DrainHooks hooks;
  // Every message of a bucket has a size both sides derive from the plan:
  // a shorter one is a peer out of step with it, never data to apply.
  hooks.done = [&](const Request& r) {
    // A frame says its size itself (settle_frame checks it).
    if (wire_.delta && !slot.fragments) {
      slot.received = static_cast<int64_t>(r.transferred());
      return;
    }
    if (r.transferred() != r.bytes() && slot.error.empty())
      slot.error = cat("engine rank ", global_rank_, ": ", r.describe(), " brought ",
                       r.transferred(), " bytes, expected ", r.bytes(),
                       " (does the sender use the same plan and wire options?)");
  };
  slot.posted.drain(loop, hooks);
  if (wire_.delta && delta_.header_only(a, slot.buffer.data, slot.received, step, slot.error)) {
    // Whole bytes: the fragments after the header (broadcast: the bucket).
    slot.fragments = true;
    if (broadcast_)
      slot.posted.add(loop.transport().recv(
          a.src, bucket_tag(step, a.bucket, 0),
          slot.buffer.buffer(0, static_cast<size_t>(a.bytes) + kBucketTrailerBytes)));
    else
      post_fragments(a, slot, step, loop.transport());
    slot.posted.drain(loop, hooks);
  }
  phases.receive += seconds_since(t);
  if (tracer)
    tracer->complete(cat("bucket ", a.bucket), "wire", slot.posted_us, trace_now_us(),
                     {{"bucket", a.bucket}, {"bytes", a.bytes}, {"from", a.src}});
}

// Applies bucket k as it landed in slot `s` and verifies it (apply_bucket).
// A bad bucket is reported; the step goes on so that the senders do not
// stall.
void ReceivePipeline::settle(size_t k, int s, int64_t step, pipeline::Loop& loop,
                             ReceiveReport& report, StepPhases& phases, Tracer* tracer) {
  Slot& slot = slots_[s];
  if (wire_.delta && !slot.fragments) return settle_frame(k, s, step, loop, report, phases);
  const RecvAction& a = actions_[k];
  if (lender_.lent(a)) return settle_lent(k, slot, report);
  // A message that came short is never applied.
  if (reject(slot, report)) return;
  report.bytes +=
      static_cast<uint64_t>(a.bytes + (slot.fragments ? pipeline::kFrameHeaderBytes : 0));
  for (const FragmentRoute& f : a.fragments)
    if (f.direct) report.bytes_direct += static_cast<uint64_t>(f.bytes);
  const int64_t apply_us = tracer ? trace_now_us() : 0;
  // The slot is posted again only once the apply that reads it is done.
  const auto [sum, sent] = apply_bucket(k, s, step, loop, phases);
  if (sum != sent) {
    if (report.error.empty())
      report.error = cat("engine rank ", global_rank_, ": bucket ", a.bucket, " of step ", step,
                         " from trainer rank ", a.src, " failed its checksum: expected ", std::hex,
                         sent, " (the trainer's), got ", sum, std::dec, "; the step is rejected");
    return;
  }
  report.checksum = checksum_fold(report.checksum, sum);
  mark_changed(a);
  if (tracer) tracer->complete(cat("apply ", a.bucket), "apply", apply_us, trace_now_us());
  if (on_bucket_ && report.error.empty()) on_bucket_(k);
}

void ReceivePipeline::settle_lent(size_t k, Slot& slot, ReceiveReport& report) {
  // In the params already: its trainer rank's copy completed before it said
  // so.
  if (reject(slot, report)) return;
  const RecvAction& a = actions_[k];
  report.bytes += static_cast<uint64_t>(a.bytes);
  report.bytes_direct += static_cast<uint64_t>(a.bytes);
  ++report.buckets_lent;
  mark_changed(a);
  if (on_bucket_ && report.error.empty()) on_bucket_(k);
}

bool ReceivePipeline::reject(Slot& slot, ReceiveReport& report) {
  if (slot.error.empty()) return false;
  if (report.error.empty()) report.error = slot.error + "; the step is rejected";
  slot.error.clear();
  return true;
}

void ReceivePipeline::settle_frame(size_t k, int s, int64_t step, pipeline::Loop& loop,
                                   ReceiveReport& report, StepPhases& phases) {
  Slot& slot = slots_[s];
  const RecvAction& a = actions_[k];
  std::string error;
  try {
    auto t = Clock::now();
    const char* packed =
        delta_.open(a, gather_index(k), s, slot.buffer.data, slot.received, step, report, changed_);
    phases.verify += seconds_since(t);
    report.bytes += static_cast<uint64_t>(slot.received);
    t = Clock::now();
    const CopyProgram& apply = broadcast_ ? a.apply : a.frame_apply;
    // GPU: run even when empty, for the slot's event after the copies queued above.
    if (!apply.empty() || copier_.on_gpu())
      copier_.run(broadcast_ ? k : frame_apply_index(k), apply, addr(packed), 0, slot_event(s));
    copier_.wait(slot_event(s), loop, "applying bucket");
    phases.apply += seconds_since(t);
  } catch (const Error& e) {
    // A bad frame rejects the step; a wait that was abandoned ends it.
    if (e.code() != Errc::format && e.code() != Errc::mismatch) throw;
    error = e.what();
  }
  if (!error.empty() || !slot.error.empty()) {
    if (report.error.empty())
      report.error = (slot.error.empty() ? error : slot.error) + "; the step is rejected";
    slot.error.clear();
    return;
  }
  if (on_bucket_ && report.error.empty()) on_bucket_(k);
}

ReceiveReport ReceivePipeline::run(int64_t step, Transport& transport,
                                   const std::function<void()>& poll, Clock::time_point deadline,
                                   StepPhases& phases, Tracer* tracer) {
  pipeline::use_device(memory_);  // this thread may be new
  pipeline::Loop loop(cat("engine rank ", global_rank_), transport, poll, deadline);
  ReceiveReport report;
  changed_.assign(changed_.size(), false);
  if (!lender_.empty()) lender_.begin(step, transport, loop);
  const size_t depth = slots_.size();
  for (size_t s = 0; s < depth; ++s) post(s, static_cast<int>(s), step, transport);
  for (size_t k = 0; k < actions_.size(); ++k) {
    const int s = static_cast<int>(k % depth);
    receive(k, s, step, loop, phases, tracer);
    settle(k, s, step, loop, report, phases, tracer);
    post(k + depth, s, step, transport);
  }
  return report;
}

void ReceivePipeline::publish_staging() {
  if (publish_.empty()) return;
  pipeline::use_device(memory_);
  copier_.run(actions_.size(), publish_, 0, 0, kPublishSlot);
  copier_.finish();
}

void ReceivePipeline::cancel_all() {
  lender_.cancel();
  for (Slot& s : slots_) s.posted.cancel_all();
  // An apply still running reads a slot that the next step's receives would
  // refill: let it finish first.
  copier_.finish();
}

}  // namespace weightsync::engine
