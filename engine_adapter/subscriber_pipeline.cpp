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
#include <cstring>
#include <map>
#include <optional>
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
      engine_template_(plan.engine_template(global_rank)),
      engine_templates_(plan.engine_templates()),
      wire_(wire),
      caps_(transport.capabilities()),
      memory_(memory) {
  const std::vector<TensorView> targets = staging ? make_staging(params, transport) : params;
  const int engine_template = plan.engine_template(global_rank);
  const auto& buckets = plan.buckets();
  // The plan's order, which the trainers follow (publisher_pipeline.h).
  for (int32_t b : plan.buckets_received_by(global_rank)) {
    RecvAction a;
    a.bucket = b;
    a.src = buckets[static_cast<size_t>(b)].src_rank;
    a.bytes = buckets[static_cast<size_t>(b)].bytes;
    if (broadcast_) {
      std::vector<std::pair<int64_t, uint32_t>> writes;
      for (const ApplyItem& ai : plan.apply_items(b, engine_template)) {
        const Copy c = plan.resolve(ai, global_rank);
        add_apply(a.apply, c, targets.at(static_cast<size_t>(c.dst_param)), 0);
        writes.emplace_back(c.offset, static_cast<uint32_t>(c.dst_param));
      }
      a.slot_bytes = a.bytes;
      if (wire_.delta) compile_broadcast_frame(a, plan, writes);
    } else if (wire_.delta) {
      compile_frame(a, plan, targets);
      compile_fragments(a, plan, targets);
      slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.frame_bytes) + kBucketTrailerBytes);
    } else {
      compile_fragments(a, plan, targets);
    }
    slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.slot_bytes) + kBucketTrailerBytes);
    std::sort(a.params.begin(), a.params.end());
    a.params.erase(std::unique(a.params.begin(), a.params.end()), a.params.end());
    actions_.push_back(std::move(a));
  }
  changed_.assign(params.size(), false);
  int64_t largest = 0;
  for (const RecvAction& a : actions_) largest = std::max(largest, a.bytes);
  slots_.resize(slot_depth(slot_bytes_, largest, actions_.size(), broadcast_, wire_, caps_));
  if (lending_possible(plan, wire_, caps_)) plan_loans(plan, targets);
}

void ReceivePipeline::plan_loans(const Plan& plan, const std::vector<TensorView>& targets) {
  lend_memory_ = caps_.cuda_memory ? MemoryKind::cuda : MemoryKind::host;
  std::map<int, std::vector<int32_t>> lendable;  // by trainer rank
  std::vector<bool> is_lendable;                 // by action
  for (const RecvAction& a : actions_) {
    is_lendable.push_back(lendable_bucket(plan, a.bucket));
    if (is_lendable.back()) lendable[a.src].push_back(a.bucket);
  }
  std::map<int, int> loan_of;  // trainer rank -> loans_ index
  for (const auto& [src, buckets] : lendable) {
    Loan l;
    l.src = src;
    bool able = true;
    for (int p : lent_params(plan, buckets)) {
      const TensorView& t = targets.at(static_cast<size_t>(p));
      able =
          able && t.memory == lend_memory_ && t.effective_strides() == contiguous_strides(t.shape);
      l.buffers.push_back(
          Buffer{t.numel() > 0 ? t.data : nullptr, t.nbytes(), t.memory, t.device, nullptr});
    }
    if (!able) l.buffers.clear();  // lends nothing: the trainer rank sends fragments
    loan_of[src] = static_cast<int>(loans_.size());
    loans_.push_back(std::move(l));
  }
  // Each lendable bucket rides on its trainer rank's loan.
  for (size_t k = 0; k < actions_.size(); ++k)
    if (is_lendable[k]) actions_[k].loan = loan_of.at(actions_[k].src);
}

void ReceivePipeline::begin_loans(int64_t step, Transport& t, pipeline::Loop& loop) {
  for (Loan& l : loans_) {
    l.lent = false;
    l.expose = t.expose(l.src, lend_tag(step), l.buffers);
  }
  for (Loan& l : loans_) {
    const std::optional<Error> failure = loop.settle(*l.expose, [&] {
      return cat("the loan to trainer rank ", l.src, " (", l.expose->describe(), ")");
    });
    // What the trainer rank mapped: nothing where this rank's transport
    // lent nothing (a fault wrapper answers loans that way).
    const std::size_t mapped = failure ? 0 : l.expose->transferred();
    l.expose.reset();
    // Declined, or the trainer rank could not map it: fragments, which the
    // trainer rank knows to send. A dead trainer fails the step.
    if (failure && failure->code() == Errc::peer_failure) throw *failure;
    l.lent = !failure && !l.buffers.empty() && mapped > 0;
  }
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
  if (c.dst_rank != global_rank_)
    fail(Errc::internal, "engine rank ", global_rank_,
         ": a bucket for it holds an item for engine rank ", c.dst_rank);
  // The packed item must be the param box in row-major order.
  if (!pipeline::packed_as_dst_box(c)) return {};
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
      [&](const Copy& c, int64_t shift) {
        if (c.fp8) return add_apply_fp8(a.apply, c, target(c), targets.at(c.scale_param), shift);
        add_apply(a.apply, c, target(c), shift);
      },
      a.slot_bytes);
}

// The reverse of a copy run: from where it writes to where it reads.
static CopyRun reversed(const CopyRun& r) {
  CopyRun out = r;
  std::swap(out.src, out.dst);
  for (int d = 0; d < kCopyOuterDims; ++d) std::swap(out.src_stride[d], out.dst_stride[d]);
  return out;
}

void ReceivePipeline::compile_frame(RecvAction& a, const Plan& plan,
                                    const std::vector<TensorView>& targets) {
  for (const PlanItem& item : plan.items(a.bucket)) {
    const Copy c = plan.resolve(item);
    const TensorView& target = targets.at(static_cast<size_t>(c.dst_param));
    (void)direct_target(c, target);  // checks the rank
    // Host params are patched by the CPU, CUDA ones by the patch kernel.
    char* in_place =
        !c.fp8 && pipeline::packed_as_dst_box(c) ? pipeline::dense_run(target, c.dst_box) : nullptr;
    a.in_place.push_back(in_place);
    a.item_params.push_back({static_cast<uint32_t>(c.dst_param)});
    if (c.fp8) a.item_params.back().push_back(static_cast<uint32_t>(c.scale_param));
    a.params.insert(a.params.end(), a.item_params.back().begin(), a.item_params.back().end());
    if (in_place) continue;
    if (c.fp8)
      add_apply_fp8(a.frame_apply, c, target, targets.at(static_cast<size_t>(c.scale_param)), 0);
    else
      add_apply(a.frame_apply, c, target, 0);
  }
  for (const CopyRun& r : a.frame_apply.runs()) a.gather.add_run(reversed(r));
  a.items = pipeline::frame_items(plan, a.bucket);
  a.frame_bytes = pipeline::frame_capacity(a.items, a.bytes);
}

void ReceivePipeline::compile_broadcast_frame(
    RecvAction& a, const Plan& plan, const std::vector<std::pair<int64_t, uint32_t>>& writes) {
  if (memory_.memory == MemoryKind::cuda) refuse_cuda_broadcast_delta();
  a.items = pipeline::frame_items(plan, a.bucket);
  a.in_place.assign(a.items.size(), nullptr);
  // An apply item reads a part of the bucket item it lies in.
  a.item_params.assign(a.items.size(), {});
  std::vector<std::pair<int64_t, size_t>> starts;  // (offset, item), by offset
  for (size_t i = 0; i < a.items.size(); ++i) starts.emplace_back(a.items[i].offset, i);
  std::sort(starts.begin(), starts.end());
  for (const auto& [offset, param] : writes) {
    const auto it = std::upper_bound(starts.begin(), starts.end(),
                                     std::pair<int64_t, size_t>{offset, a.items.size()});
    const size_t i = it == starts.begin() ? a.items.size() : std::prev(it)->second;
    if (i == a.items.size() || offset >= a.items[i].offset + a.items[i].bytes)
      fail(Errc::internal, "engine rank ", global_rank_, ": an apply item of bucket ", a.bucket,
           " at offset ", offset, " lies in none of its items");
    a.item_params[i].push_back(param);
    a.params.push_back(param);
  }
  for (const CopyRun& r : a.apply.runs()) a.gather.add_run(reversed(r));
  a.reads = pipeline::template_reads(plan, a.bucket, engine_template_);
  a.frame_bytes = pipeline::frame_capacity(a.items, a.bytes) + 8 * int64_t{engine_templates_};
  slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.frame_bytes) + kBucketTrailerBytes);
}

void ReceivePipeline::refuse_cuda_broadcast_delta() const {
  fail(Errc::unsupported, "engine rank ", global_rank_, ": delta sync (the trainers' ",
       "delta=auto) in broadcast mode applies on the host so far, and this rank's params are on ",
       pipeline::memory_str(memory_.memory, memory_.device),
       "; use plan mode p2p, or run the trainers without delta (docs/delta.md)");
}

void ReceivePipeline::prepare(Transport& transport, SlotMemory slots, int slot_device) {
  if (slots_[0].buffer.data) return;
  if (wire_.delta && broadcast_ && transport.capabilities().native_broadcast)
    fail(Errc::unsupported, "engine rank ", global_rank_, ": delta sync in broadcast mode ",
         "takes frames whose size changes from step to step, which this transport's native ",
         "broadcast cannot carry; use plan mode p2p, a transport without a native broadcast ",
         "(ucx, tcp), or no delta (docs/delta.md)");
  const bool device_delta = wire_.delta && memory_.memory == MemoryKind::cuda;
  // The CPU reads a frame's header and checks its encodings where it lands.
  if (device_delta && slots == SlotMemory::device)
    fail(Errc::unsupported, "engine rank ", global_rank_, ": delta sync needs its frames in host ",
         "memory, but this rank's slots are in device memory (its params are on ",
         pipeline::memory_str(memory_.memory, memory_.device), " and the transport reaches ",
         "device memory); run without delta, or over a transport to host memory (ucx)");
  std::vector<const CopyProgram*> programs;
  for (const RecvAction& a : actions_) programs.push_back(&a.apply);
  programs.push_back(&publish_);
  if (device_delta) {  // gather_index(k), then frame_apply_index(k)
    for (const RecvAction& a : actions_) programs.push_back(&a.gather);
    for (const RecvAction& a : actions_) programs.push_back(&a.frame_apply);
  }
  copier_.prepare(programs, memory_, 3);
  if (lent_regions_.empty())
    for (Loan& l : loans_) {
      try {
        for (Buffer& b : l.buffers) {
          if (b.bytes == 0) continue;
          lent_regions_.push_back(transport.register_memory(b));
          b.region = lent_regions_.back().get();
        }
      } catch (const Error& e) {
        // Memory the transport cannot share (e.g. from a CUDA memory pool):
        // this loan lends nothing, and its buckets come as fragments.
        if (e.code() != Errc::unsupported) throw;
        l.buffers.clear();
      }
    }
  if (slot_bytes_ == 0) return;
  for (Slot& s : slots_) s.buffer = allocate_staging(transport, slot_bytes_, slots, slot_device);
  if (wire_.delta) {
    int64_t most = 1;
    for (const RecvAction& a : actions_) most = std::max(most, a.bytes);
    if (device_delta) {
      device_scratch_ =
          gpu::Memory(static_cast<size_t>(most), gpu::MemoryPlace::device, memory_.device);
      patcher_ = gpu::DeltaPatcher(memory_.device);
    } else {
      scratch_.reset(new char[static_cast<size_t>(most)]);
    }
  }
}

void ReceivePipeline::post(size_t k, int s, int64_t step, Transport& t) {
  if (k >= actions_.size()) return;
  const RecvAction& a = actions_[k];
  Slot& slot = slots_[s];
  slot.posted_us = trace_now_us();
  const Tag tag = bucket_tag(step, a.bucket, 0);
  slot.fragments = false;
  if (lent(a)) {
    // The trainer rank writes the bucket into the params; this says it did.
    slot.posted.add(t.recv(a.src, tag, Buffer{nullptr, 0, lend_memory_, memory_.device, nullptr}));
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

bool ReceivePipeline::header_only(const RecvAction& a, Slot& slot, int64_t step) {
  // A delta frame holds a table entry per item and a whole frame the
  // bucket's bytes, so a message of exactly a header is one. A damaged one
  // rejects the step, but its fragments are received all the same, so that
  // the trainer does not stall.
  const int64_t trailer = wire_.checksums ? static_cast<int64_t>(kBucketTrailerBytes) : 0;
  if (slot.received != pipeline::kFrameHeaderBytes + trailer || !slot.error.empty()) return false;
  const std::string what = cat("engine rank ", global_rank_, ": bucket ", a.bucket, " of step ",
                               step, " from trainer rank ", a.src);
  try {
    const char* frame = slot.buffer.data;
    if (trailer) {
      const uint64_t sum = checksum64(frame, static_cast<size_t>(pipeline::kFrameHeaderBytes),
                                      static_cast<uint64_t>(step));
      if (sum != read_trailer(frame + pipeline::kFrameHeaderBytes))
        fail(Errc::format, what, ": its header failed its checksum (computed ", std::hex, sum,
             ", sent ", read_trailer(frame + pipeline::kFrameHeaderBytes), std::dec, ")");
    }
    const pipeline::FrameHeader h =
        pipeline::read_frame_header(frame, pipeline::kFrameHeaderBytes, what);
    // An intact header of a delta (or whole) frame that came this short:
    // a frame cut short, which settle_frame rejects; no fragments follow.
    if (!h.fragments) return false;
    if (h.step != step) fail(Errc::format, what, ": the frame says step ", h.step);
    // Every byte of it is checked: a whole bucket names no base and no digest.
    if (h.base != -1 || h.has_digest || h.digest != 0)
      fail(Errc::format, what, ": a whole bucket's header that names base ", h.base, " and digest ",
           std::hex, h.digest, std::dec);
  } catch (const Error& e) {
    if (e.code() != Errc::format) throw;
    slot.error = e.what();
  }
  return true;
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
  if (wire_.delta && header_only(a, slot, step)) {
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

// Verifies bucket k as it landed in slot `s` and applies it. A bad bucket is
// reported, not applied; the step goes on so that the senders do not stall.
void ReceivePipeline::settle(size_t k, int s, int64_t step, pipeline::Loop& loop,
                             ReceiveReport& report, StepPhases& phases, Tracer* tracer) {
  Slot& slot = slots_[s];
  if (wire_.delta && !slot.fragments) return settle_frame(k, s, step, loop, report, phases);
  const RecvAction& a = actions_[k];
  if (lent(a)) {
    // In the params already: its trainer rank's copy completed before it
    // said so.
    if (!slot.error.empty()) {
      if (report.error.empty()) report.error = slot.error + "; the step is rejected";
      slot.error.clear();
      return;
    }
    report.bytes += static_cast<uint64_t>(a.bytes);
    report.bytes_direct += static_cast<uint64_t>(a.bytes);
    ++report.buckets_lent;
    mark_changed(a);
    if (on_bucket_ && report.error.empty()) on_bucket_(k);
    return;
  }
  auto t = Clock::now();
  const auto [sum, sent] = checksums(a, slot.buffer.data, step);
  phases.verify += seconds_since(t);
  if (!slot.error.empty()) {
    if (report.error.empty()) report.error = slot.error + "; the step is rejected";
    slot.error.clear();
    return;
  }
  report.bytes +=
      static_cast<uint64_t>(a.bytes + (slot.fragments ? pipeline::kFrameHeaderBytes : 0));
  for (const FragmentRoute& f : a.fragments)
    if (f.direct) report.bytes_direct += static_cast<uint64_t>(f.bytes);
  if (sum != sent) {
    if (report.error.empty())
      report.error = cat("engine rank ", global_rank_, ": bucket ", a.bucket, " of step ", step,
                         " from trainer rank ", a.src, " failed its checksum (computed ", std::hex,
                         sum, ", sent ", sent, std::dec, "); the step is rejected");
    return;
  }
  report.checksum = checksum_fold(report.checksum, sum);
  t = Clock::now();
  const int64_t apply_us = tracer ? trace_now_us() : 0;
  if (!a.apply.empty()) copier_.run(k, a.apply, addr(slot.buffer.data), 0, slot_event(s));
  // The slot is posted again only once the apply that reads it is done.
  copier_.wait(slot_event(s), loop, "applying bucket");
  phases.apply += seconds_since(t);
  mark_changed(a);
  if (tracer) tracer->complete(cat("apply ", a.bucket), "apply", apply_us, trace_now_us());
  if (on_bucket_ && report.error.empty()) on_bucket_(k);
}

void ReceivePipeline::settle_frame(size_t k, int s, int64_t step, pipeline::Loop& loop,
                                   ReceiveReport& report, StepPhases& phases) {
  Slot& slot = slots_[s];
  const RecvAction& a = actions_[k];
  const std::string what = cat("engine rank ", global_rank_, ": bucket ", a.bucket, " of step ",
                               step, " from trainer rank ", a.src);
  const char* frame = slot.buffer.data;
  int64_t bytes = slot.received;
  std::string error;
  try {
    auto t = Clock::now();
    if (wire_.checksums) {
      if (bytes < static_cast<int64_t>(kBucketTrailerBytes))
        fail(Errc::format, what, ": ", bytes, " bytes, too short for its checksum");
      bytes -= static_cast<int64_t>(kBucketTrailerBytes);
      const uint64_t sum =
          checksum64(frame, static_cast<size_t>(bytes), static_cast<uint64_t>(step));
      if (sum != read_trailer(frame + bytes))
        fail(Errc::format, what, " failed its checksum (computed ", std::hex, sum, ", sent ",
             read_trailer(frame + bytes), std::dec, ")");
      report.checksum = checksum_fold(report.checksum, sum);
    }
    const pipeline::FrameHeader h = pipeline::read_frame_header(frame, bytes, what);
    if (h.step != step) fail(Errc::format, what, ": the frame says step ", h.step);
    const char* packed = frame + pipeline::kFrameHeaderBytes;
    if (!h.delta) {
      if (bytes != pipeline::kFrameHeaderBytes + a.bytes)
        fail(Errc::format, what, ": a whole bucket of ", bytes - pipeline::kFrameHeaderBytes,
             " bytes, expected ", a.bytes, " (does the sender use the same plan?)");
      for (size_t i = 0; i < a.items.size(); ++i) {
        if (!a.in_place[i]) continue;
        const auto n = static_cast<size_t>(a.items[i].bytes);
        if (copier_.on_gpu())  // before the apply's event on the same stream
          gpu::copy_async(a.in_place[i], packed + a.items[i].offset, n, copier_.stream());
        else
          std::memcpy(a.in_place[i], packed + a.items[i].offset, n);
      }
      mark_changed(a);
    } else {
      if (h.base != version_)
        fail(Errc::mismatch, what, ": a delta against version ", h.base,
             ", but this engine rank holds version ", version_);
      // The items in place are patched there; the others are gathered as
      // the targets hold them, patched, and applied once the digest of the
      // result (every item) checked out.
      uint64_t digest = 0, sent = h.digest;
      if (copier_.on_gpu()) {
        // Patched and hashed on the device (p2p: broadcast is refused at setup).
        digest = patch_on_device(k, s, frame, bytes, step, h.has_digest, what);
        packed = device_scratch_.data();
      } else {
        targets_.resize(a.items.size());
        for (size_t i = 0; i < a.items.size(); ++i)
          targets_[i] = a.in_place[i] ? a.in_place[i] : scratch_.get() + a.items[i].offset;
        execute_host(a.gather, 0, addr(scratch_.get()));
        if (broadcast_) {
          // Every rank gets the whole bucket's delta but holds, and checks,
          // only what its template reads: the rest of scratch is left over.
          const int64_t digests = h.has_digest ? 8 * int64_t{engine_templates_} : 0;
          if (bytes < pipeline::kFrameHeaderBytes + digests)
            fail(Errc::format, what, ": a delta frame of ", bytes,
                 " bytes cannot hold the digests of its ", engine_templates_, " engine templates");
          if (h.has_digest)
            sent = read_le64(frame + pipeline::kFrameHeaderBytes + 8 * engine_template_);
          pipeline::apply_frame(a.items, frame + digests, bytes - digests, targets_.data(), what, 0,
                                nullptr, &items_changed_);
          if (h.has_digest) digest = pipeline::reads_digest(a.reads, scratch_.get(), step);
        } else {
          pipeline::apply_frame(a.items, frame, bytes, targets_.data(), what, step,
                                h.has_digest ? &digest : nullptr, &items_changed_);
        }
        packed = scratch_.get();
      }
      if (h.has_digest && digest != sent)
        fail(Errc::mismatch, what, ": after its delta the bucket hashes to ", std::hex, digest,
             ", the trainer's bytes to ", sent, std::dec,
             " (this rank's params are not the version the delta applies to, or the delta ",
             "was damaged)");
      ++report.delta_buckets;
      for (size_t i = 0; i < a.items.size(); ++i)
        if (items_changed_[i])
          for (uint32_t p : a.item_params[i]) changed_[p] = true;
    }
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

uint64_t ReceivePipeline::patch_on_device(size_t k, int s, const char* frame, int64_t bytes,
                                          int64_t step, bool digest, const std::string& what) {
  const RecvAction& a = actions_[k];
  // Checked before anything is queued: a malformed frame changes nothing.
  target_addrs_.resize(a.items.size());
  for (size_t i = 0; i < a.items.size(); ++i)
    target_addrs_[i] = static_cast<int64_t>(
        addr(a.in_place[i] ? a.in_place[i] : device_scratch_.data() + a.items[i].offset));
  pipeline::frame_tables(a.items, frame, bytes, target_addrs_.data(), what, step, digest, tables_,
                         &items_changed_);
  // The packed bucket as the targets hold it, then the patch and the
  // digest, in order on the copier's stream.
  copier_.run(gather_index(k), a.gather, 0, addr(device_scratch_.data()), slot_event(s));
  patcher_.run(copier_.stream(), frame, static_cast<size_t>(bytes), tables_.patch, tables_.hash, 0);
  return digest ? patcher_.digest(copier_.stream()) : 0;
}

ReceiveReport ReceivePipeline::run(int64_t step, Transport& transport,
                                   const std::function<void()>& poll, Clock::time_point deadline,
                                   StepPhases& phases, Tracer* tracer) {
  pipeline::use_device(memory_);  // this thread may be new
  pipeline::Loop loop(cat("engine rank ", global_rank_), transport, poll, deadline);
  ReceiveReport report;
  changed_.assign(changed_.size(), false);
  if (!loans_.empty()) begin_loans(step, transport, loop);
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
  for (Loan& l : loans_) l.expose.reset();
  for (Slot& s : slots_) s.posted.cancel_all();
  // An apply still running reads a slot that the next step's receives would
  // refill: let it finish first.
  copier_.finish();
}

}  // namespace weightsync::engine
