#include "publisher_pipeline.h"

#include <weightsync/error.h>
#include <weightsync/trace.h>

#include "pipeline/item_copies.h"
#include "pipeline/wire.h"
#include "transport/staging.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>

namespace weightsync::trainer {
namespace {

using Clock = std::chrono::steady_clock;

using pipeline::seconds_since;

using pipeline::slot_event;

using pipeline::add_pack;
using pipeline::addr;

}  // namespace

SendPipeline::SendPipeline(const Plan& plan, int rank, const std::vector<TensorView>& tensors,
                           const WireOptions& wire, const Capabilities& caps,
                           const EngineLayout* engine)
    : rank_(rank),
      trainer_world_(plan.trainer_world()),
      engine_world_(plan.engine_world()),
      wire_(wire),
      caps_(caps),
      actions_(ordered_actions(plan, rank)),
      delta_(wire.checksums, plan.engine_world()) {
  for (SendAction& a : actions_) compile_action(a, plan, tensors);
  int64_t largest = 0;
  for (const SendAction& a : actions_) largest = std::max(largest, a.bytes);
  slots_.resize(slot_depth(slot_bytes_, largest, actions_.size(),
                           plan.mode() == PlanMode::broadcast, wire_, caps_));
  // Lent buckets: the loans each engine rank makes this rank, as the plan
  // lays them out (the engine rank derives the same).
  if (lending_possible(plan, wire_, caps_))
    loans_.compile(plan, actions_, tensors, engine,
                   caps_.cuda_memory ? MemoryKind::cuda : MemoryKind::host);
}

void SendPipeline::compile_action(SendAction& a, const Plan& plan,
                                  const std::vector<TensorView>& tensors) {
  if (a.kind == SendAction::Kind::p2p && wire_.delta) {
    // The frame's programs pack a.pack and a.quant; a whole step of host
    // tensors goes as fragments, packed by their own.
    delta_.compile_p2p(a, plan, tensors);
    compile_fragments(a, plan, tensors, wire_, caps_, a.whole_pack, a.whole_quant);
    slot_bytes_ = std::max(
        slot_bytes_,
        static_cast<size_t>(std::max(pipeline::kFrameHeaderBytes + a.bytes, a.packed_bytes)) +
            kBucketTrailerBytes);
    return;
  }
  if (a.kind == SendAction::Kind::p2p) {
    compile_fragments(a, plan, tensors, wire_, caps_, a.pack, a.quant);
    slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.packed_bytes) + kBucketTrailerBytes);
    return;
  }
  for (const PlanItem& item : plan.items(a.bucket)) {
    const Copy c = plan.resolve(item);
    if (c.src_rank != rank_) continue;
    add_pack(a.pack, c, tensors.at(static_cast<size_t>(c.src_param)), a.base);
  }
  slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.bytes) + kBucketTrailerBytes);
  if (a.kind == SendAction::Kind::root && wire_.delta) delta_.compile_root(a, plan);
}

void SendPipeline::prepare(Transport& transport, SlotMemory slots, int slot_device,
                           const pipeline::RankMemory& memory, Producer producer) {
  native_broadcast_ = transport.capabilities().native_broadcast;
  producer_ = producer;
  slot_memory_ = slots;
  if (slot_bytes_ == 0 || slots_[0].buffer.data) return;
  std::vector<const CopyProgram*> programs;
  for (const SendAction& a : actions_) programs.push_back(&a.pack);
  copier_.prepare(programs, memory, 2);
  device_quant_.clear();
  device_quant_.resize(actions_.size());
  if (copier_.on_gpu())
    for (size_t i = 0; i < actions_.size(); ++i)
      if (!actions_[i].quant.empty())
        device_quant_[i] = gpu::DeviceQuant(actions_[i].quant, memory.device);
  if (wire_.delta && native_broadcast_ &&
      std::any_of(actions_.begin(), actions_.end(),
                  [](const SendAction& a) { return a.kind != SendAction::Kind::p2p; }))
    fail(Errc::unsupported, "trainer rank ", rank_, ": delta sync in broadcast mode sends ",
         "frames whose size changes from step to step, which this transport's native ",
         "broadcast cannot take; use plan mode p2p, a transport without a native broadcast ",
         "(ucx, tcp), or no delta (docs/delta.md)");
  if (wire_.delta && slots == SlotMemory::device)
    fail(Errc::unsupported, "trainer rank ", rank_, ": delta sync encodes buckets on the host, ",
         "but this rank's slots are in device memory (its tensors are on a GPU and the transport ",
         "reaches device memory); run without delta, or over a transport to host memory");
  for (Slot& s : slots_) {
    s.buffer = allocate_staging(transport, slot_bytes_, slots, slot_device);
    if (delta_.frame_bytes() > 0)
      s.frame = allocate_staging(transport, delta_.frame_bytes(), SlotMemory::host, -1);
    s.posted.reserve(static_cast<size_t>(engine_world_ + trainer_world_));
  }
}

int64_t SendPipeline::send_frame(const SendAction& a, Slot& slot, const StagingBuffer& from,
                                 int64_t bytes, bool delta, int64_t step, int64_t pack_us) {
  slot.bucket = a.bucket;
  slot.bytes = bytes;
  slot.posted_us = pack_us;
  if (tracer_)
    tracer_->complete(cat("post ", a.bucket), "pack", pack_us, trace_now_us(),
                      {{"bucket", a.bucket}, {"bytes", bytes}, {"delta", delta}});
  slot.posted.add(
      loop_->transport().send(trainer_world_ + a.dst_engine, bucket_tag(step, a.bucket, 0),
                              from.buffer(0, static_cast<size_t>(bytes))),
      a.dst_engine);
  return bytes;
}

int64_t SendPipeline::post_frame(size_t index, int k, int64_t step, const std::vector<bool>& dead,
                                 PushPhases& phases) {
  const SendAction& a = actions_[index];
  Slot& slot = slots_[k];
  const int64_t pack_us = tracer_ ? trace_now_us() : 0;
  char* body = slot.buffer.data + pipeline::kFrameHeaderBytes;
  bool packed = false;  // the frame's layout is in the slot
  auto pack_frame = [&] {
    const auto start = Clock::now();
    if (copier_.on_gpu()) {
      pack_on_device(index, k);
    } else {
      quantize(index, k);
      pack(index, k);
    }
    phases.pack += seconds_since(start);
    packed = true;
  };
  const P2pFrame f = delta_.p2p_frame(a, step, dead, body, slot.frame.data, pack_frame, phases);
  if (f.delta) return send_frame(a, slot, slot.frame, f.bytes, true, step, pack_us);
  // The whole bytes: to an engine rank without the base, or for every twin.
  pipeline::FrameHeader h;
  h.step = step;
  if (!copier_.on_gpu()) {
    if (f.take) {
      const auto start = Clock::now();
      delta_.keep_base(a);
      phases.pack += seconds_since(start);
    }
    // The header alone, then the bucket's fragments, as without delta:
    // dense runs straight from the tensors into the params.
    h.fragments = true;
    pipeline::store_frame_header(slot.frame.data, h);
    const int64_t bytes = delta_.with_trailer(slot.frame.data, pipeline::kFrameHeaderBytes, step);
    slot.posted.add(
        loop_->transport().send(trainer_world_ + a.dst_engine, bucket_tag(step, a.bucket, 0),
                                slot.frame.buffer(0, static_cast<size_t>(bytes))),
        a.dst_engine);
    post_p2p(index, k, step, phases, true);
    return pipeline::kFrameHeaderBytes + a.bytes;
  }
  // CUDA tensors: the packed bucket behind the header, as one frame.
  if (!packed) pack_frame();
  const auto start = Clock::now();
  execute_host(a.pack_in_place, 0, addr(slot.buffer.data));
  if (f.take) delta_.keep_base(a, body);
  phases.pack += seconds_since(start);
  pipeline::store_frame_header(slot.buffer.data, h);
  return send_frame(
      a, slot, slot.buffer,
      delta_.with_trailer(slot.buffer.data, pipeline::kFrameHeaderBytes + a.bytes, step), false,
      step, pack_us);
}

void SendPipeline::pack(size_t index, int slot, size_t first, size_t count) {
  const SendAction& a = actions_[index];
  if (a.pack.empty()) return;
  copier_.run(index, a.pack, 0, addr(slots_[slot].buffer.data), slot_event(slot), first, count);
}

void SendPipeline::pack_on_device(size_t index, int slot) {
  const std::uintptr_t slot_base = addr(slots_[slot].buffer.data);
  copier_.run_with_quant(index, 0, slot_base, slot_event(slot), device_quant_[index], slot_base);
  copier_.wait(slot_event(slot), *loop_, "packing bucket");
}

void SendPipeline::quantize(size_t index, int slot) {
  const SendAction& a = actions_[index];
  if (a.quant.empty()) return;
  fp8::execute_quant_host(a.quant, 0, addr(slots_[slot].buffer.data));
}

void SendPipeline::post_p2p(size_t index, int k, int64_t step, PushPhases& phases,
                            bool whole_frame) {
  const SendAction& a = actions_[index];
  Slot& slot = slots_[k];
  Transport& t = loop_->transport();
  const int peer = trainer_world_ + a.dst_engine;
  const Tag tag = bucket_tag(step, a.bucket, 0);
  // Delta sync's whole steps pack with the fragments' own programs (the
  // action's pack and quant lay out the frame).
  const CopyProgram& pack_program = whole_frame ? a.whole_pack : a.pack;
  const fp8::QuantProgram& quant = whole_frame ? a.whole_quant : a.quant;
  const int64_t pack_us = tracer_ ? trace_now_us() : 0;
  const auto pack_start = Clock::now();
  if (copier_.on_gpu()) {
    pack_on_device(index, k);  // its sends wait for it
  } else if (!quant.empty()) {
    // FP8 engines: the bucket's quantized items first (their fragments go
    // out after every pack below).
    fp8::execute_quant_host(quant, 0, addr(slot.buffer.data));
  }
  double pack_s = copier_.on_gpu() || !quant.empty() ? seconds_since(pack_start) : 0;
  // The bucket's checksum, summed as it is packed (wire.h); 0 on the wire
  // where its bytes are in device memory.
  const bool summed = wire_.checksums && host_readable(a);
  WireSum sums;
  int64_t total = 0;
  slot.bucket = a.bucket;
  slot.bytes = a.bytes;
  slot.posted_us = pack_us;
  for (uint32_t i = 0; i < a.fragments.size(); ++i) {
    const FragmentRoute& f = a.fragments[i];
    Buffer buffer{const_cast<char*>(f.direct), static_cast<size_t>(f.bytes), f.memory, f.device,
                  nullptr};
    // On the host each fragment goes out as soon as it is packed.
    const auto start = Clock::now();
    if (f.direct) {
      bytes_direct_ += static_cast<uint64_t>(f.bytes);
      if (summed) sums += wire_sum(f.direct, static_cast<size_t>(f.bytes), f.offset);
    } else {
      sums += pack_fragment(pack_program, slot.buffer.data, f, summed);
      buffer = slot.buffer.buffer(static_cast<size_t>(f.slot_offset), buffer.bytes);
    }
    pack_s += seconds_since(start);
    total += f.bytes;
    // Posted in fragment order: the receiver matches them in that order.
    slot.posted.add(t.send(peer, tag, buffer), a.dst_engine);
  }
  phases.pack += pack_s;
  if (tracer_)
    tracer_->complete(
        cat("post ", a.bucket), "pack", pack_us, trace_now_us(),
        {{"bucket", a.bucket}, {"bytes", a.bytes}, {"fragments", a.fragments.size()}});
  if (!wire_.checksums) return;
  store_trailer(slot.buffer.data + a.packed_bytes, summed ? bucket_checksum(sums, total, step) : 0);
  slot.posted.add(
      t.send(peer, bucket_tag(step, a.bucket, 1),
             slot.buffer.buffer(static_cast<size_t>(a.packed_bytes), kBucketTrailerBytes)),
      a.dst_engine);
}

// A broadcast bucket: the root gathers the other holders' parts and packs its
// own, then broadcasts; a holder packs its part and sends it to the root.
int64_t SendPipeline::post(size_t index, int k, int64_t step, std::vector<bool>& dead,
                           PushPhases& phases) {
  const SendAction& a = actions_[index];
  if (a.kind == SendAction::Kind::p2p) {
    post_p2p(index, k, step, phases);
    return a.bytes;
  }
  Slot& slot = slots_[k];
  Transport& t = loop_->transport();
  const bool root = a.kind == SendAction::Kind::root;
  if (root) {
    // Post the other holders' parts first, so they land while we pack ours.
    for (const GatherPart& part : a.parts)
      slot.posted.add(t.recv(
          part.src_rank, bucket_tag(step, a.bucket, 1),
          slot.buffer.buffer(static_cast<size_t>(part.offset), static_cast<size_t>(part.bytes))));
  }
  const auto pack_start = Clock::now();
  const int64_t pack_us = tracer_ ? trace_now_us() : 0;
  pack(index, k);
  copier_.wait(slot_event(k), *loop_, "packing bucket");
  phases.pack += seconds_since(pack_start);
  if (tracer_)
    tracer_->complete(cat("pack ", a.bucket), "pack", pack_us, trace_now_us(),
                      {{"bucket", a.bucket}, {"bytes", a.bytes}});
  if (root && !a.parts.empty()) {
    const auto gather_start = Clock::now();
    drain(slot, dead);
    phases.gather += seconds_since(gather_start);
  }
  if (root && wire_.delta) return post_root_frame(index, k, step, dead, phases);
  if (wire_.checksums)
    store_trailer(slot.buffer.data + a.bytes, slot_checksum(slot, a.bytes, step));
  slot.bucket = a.bucket;
  slot.bytes = a.bytes;
  slot.posted_us = tracer_ ? trace_now_us() : 0;
  if (root)
    post_root(a, slot, step, dead);
  else
    slot.posted.add(t.send(a.root, bucket_tag(step, a.bucket, 1),
                           slot.buffer.buffer(0, static_cast<size_t>(a.bytes))));
  return a.bytes;
}

void SendPipeline::post_root(const SendAction& a, Slot& slot, int64_t step,
                             std::vector<bool>& dead) {
  const Tag tag = bucket_tag(step, a.bucket, 0);
  const Buffer payload = slot.buffer.buffer(0, static_cast<size_t>(a.bytes) + kBucketTrailerBytes);
  if (!native_broadcast_) return send_to_engines(slot, tag, payload, dead);
  std::vector<int> ranks{rank_};
  for (int g = 0; g < engine_world_; ++g) ranks.push_back(trainer_world_ + g);
  slot.posted.add(loop_->transport().broadcast(payload, rank_, ranks, tag));
}

void SendPipeline::send_to_engines(Slot& slot, Tag tag, const Buffer& buffer,
                                   std::vector<bool>& dead) {
  Transport& t = loop_->transport();
  int posted = 0;
  for (int g = 0; g < engine_world_; ++g) {
    if (dead[static_cast<size_t>(g)]) continue;
    try {
      slot.posted.add(t.send(trainer_world_ + g, tag, buffer), g);
      ++posted;
    } catch (const Error& e) {
      // Refused at posting (known dead, endpoint timeout, unreachable): that
      // engine is dropped, as a failed transfer is in drain(); the others
      // get the bucket.
      slot.unsent = true;
      drop_engine(g, e, dead, cat("sending bucket ", slot.bucket));
    }
  }
  if (posted == 0) slot.unsent = true;
}

int64_t SendPipeline::post_root_frame(size_t index, int k, int64_t step, std::vector<bool>& dead,
                                      PushPhases& phases) {
  const SendAction& a = actions_[index];
  Slot& slot = slots_[k];
  const Tag tag = bucket_tag(step, a.bucket, 0);
  slot.bucket = a.bucket;
  slot.posted_us = tracer_ ? trace_now_us() : 0;
  const auto start = Clock::now();
  const int64_t delta = delta_.root_frame(a, step, dead, slot.buffer.data, slot.frame.data);
  phases.pack += seconds_since(start);
  if (delta > 0) {
    slot.bytes = delta;
    send_to_engines(slot, tag, slot.frame.buffer(0, static_cast<size_t>(delta)), dead);
    return delta;
  }
  // The whole bytes: the header alone, then the bucket as without delta.
  pipeline::FrameHeader h;
  h.step = step;
  h.fragments = true;
  pipeline::store_frame_header(slot.frame.data, h);
  const int64_t header = delta_.with_trailer(slot.frame.data, pipeline::kFrameHeaderBytes, step);
  send_to_engines(slot, tag, slot.frame.buffer(0, static_cast<size_t>(header)), dead);
  if (wire_.checksums)
    store_trailer(slot.buffer.data + a.bytes, slot_checksum(slot, a.bytes, step));
  slot.bytes = a.bytes;
  send_to_engines(slot, tag,
                  slot.buffer.buffer(0, static_cast<size_t>(a.bytes) + kBucketTrailerBytes), dead);
  return pipeline::kFrameHeaderBytes + a.bytes;
}

void SendPipeline::drop_engine(int g, const Error& error, std::vector<bool>& dead,
                               const std::string& what) {
  if (dead[static_cast<size_t>(g)]) return;
  dead[static_cast<size_t>(g)] = true;
  if (engine_failed_)
    engine_failed_(g, cat("trainer rank ", rank_, ": ", what, " to engine rank ", g,
                          " failed: ", error.what()));
}

void SendPipeline::uncount(Slot& slot) {
  unsent_ += slot.counted;
  slot.counted = 0;
}

void SendPipeline::drain(Slot& slot, std::vector<bool>& dead) {
  pipeline::DrainHooks hooks;
  hooks.dropped = [&](int g) {
    if (!dead[static_cast<size_t>(g)]) return false;
    uncount(slot);
    return true;
  };
  // An engine whose transfer fails (died, unreachable, endpoint timeout) is
  // dropped and reported at once: the coordinator fails it and tells it to
  // stop, the others go on. A failure towards a trainer (a gather part)
  // fails the step.
  hooks.failed = [&](int g, const Error& e) {
    if (g < 0) throw;
    uncount(slot);
    drop_engine(g, e, dead, cat("sending bucket ", slot.bucket));
  };
  slot.posted.drain(*loop_, hooks);
  if (tracer_ && slot.bucket >= 0)
    tracer_->complete(cat("bucket ", slot.bucket), "wire", slot.posted_us, trace_now_us(),
                      {{"bucket", slot.bucket}, {"bytes", slot.bytes}});
  slot.bucket = -1;
}

uint64_t SendPipeline::run(int64_t step, Transport& transport, std::vector<bool>& dead,
                           const std::function<void()>& poll, Clock::time_point deadline,
                           PushPhases& phases, Tracer* tracer) {
  pipeline::use_device(copier_.memory());  // this thread may be new (push_async)
  copier_.wait_for_producer(producer_.stream, producer_.event);
  pipeline::Loop loop(cat("trainer rank ", rank_), transport, poll, deadline);
  loop_ = &loop;
  tracer_ = tracer;
  uint64_t sent = 0;
  unsent_ = 0;
  bytes_direct_ = 0;
  buckets_lent_ = 0;
  delta_.begin_run();
  if (loans_.active())
    loans_.begin(step, rank_, trainer_world_, actions_, copier_.memory(), loop, dead);
  size_t k = 0;
  for (size_t i = 0; i < actions_.size(); ++i) {
    const SendAction& a = actions_[i];
    const bool p2p = a.kind == SendAction::Kind::p2p;
    if (p2p && dead[static_cast<size_t>(a.dst_engine)]) continue;
    const bool lend = p2p && loans_.lent(a);
    // A lent copy's message goes before this rank may wait on an engine.
    if (!lend) settle_lent(step, dead);
    const int s = static_cast<int>(k++ % slots_.size());
    const auto wire_start = Clock::now();
    drain(slots_[s], dead);
    phases.wire += seconds_since(wire_start);
    // The drain may have learned of the engine's death.
    if (p2p && dead[static_cast<size_t>(a.dst_engine)]) continue;
    slots_[s].counted = 0;
    slots_[s].unsent = false;
    try {
      const uint64_t bytes = post_action(i, s, step, lend, dead, phases);
      if (a.kind == SendAction::Kind::holder) {
        sent += bytes;  // a gather part: its failure fails the step
      } else if (!slots_[s].unsent) {
        sent += bytes;
        slots_[s].counted = bytes;
      }
    } catch (const Error& e) {
      // A send to an engine refused at posting (known dead, endpoint timeout,
      // unreachable) drops that engine, as a failed transfer does in drain().
      if (!p2p) throw;
      drop_engine(a.dst_engine, e, dead, cat("sending bucket ", a.bucket));
    }
  }
  settle_lent(step, dead);
  const auto wire_start = Clock::now();
  for (Slot& slot : slots_) drain(slot, dead);
  phases.wire += seconds_since(wire_start);
  loop_ = nullptr;
  return sent - std::min(sent, unsent_);
}

uint64_t SendPipeline::post_action(size_t index, int s, int64_t step, bool lend,
                                   std::vector<bool>& dead, PushPhases& phases) {
  const SendAction& a = actions_[index];
  if (lend) {
    post_lent(index, s, step, dead, phases);
    return static_cast<uint64_t>(a.bytes);
  }
  if (a.kind == SendAction::Kind::p2p && wire_.delta)
    return static_cast<uint64_t>(post_frame(index, s, step, dead, phases));
  return static_cast<uint64_t>(post(index, s, step, dead, phases));
}

void SendPipeline::cancel_all() {
  loans_.cancel();
  for (Slot& slot : slots_) slot.posted.cancel_all();
}

void SendPipeline::post_lent(size_t index, int k, int64_t step, std::vector<bool>& dead,
                             PushPhases& phases) {
  const SendAction& a = actions_[index];
  const auto start = Clock::now();
  const std::optional<LentCopy> before = loans_.launch(index, a, k);
  Slot& slot = slots_[k];
  slot.bucket = a.bucket;
  slot.bytes = a.bytes;
  slot.posted_us = tracer_ ? trace_now_us() : 0;
  phases.pack += seconds_since(start);
  // The copy before it ran meanwhile; its message goes now.
  if (before) settle_lent(*before, step, dead);
}

void SendPipeline::settle_lent(int64_t step, std::vector<bool>& dead) {
  if (const std::optional<LentCopy> copy = loans_.take_launched()) settle_lent(*copy, step, dead);
}

void SendPipeline::settle_lent(const LentCopy& copy, int64_t step, std::vector<bool>& dead) {
  const SendAction& a = actions_[copy.index];
  loans_.wait(copy, *loop_);
  if (tracer_)
    tracer_->complete(cat("lend ", a.bucket), "pack", slots_[copy.slot].posted_us, trace_now_us(),
                      {{"bucket", a.bucket}, {"bytes", a.bytes}, {"engine", a.dst_engine}});
  // Zero bytes: the bucket is in the params already.
  try {
    slots_[copy.slot].posted.add(
        loop_->transport().send(
            trainer_world_ + a.dst_engine, bucket_tag(step, a.bucket, 0),
            Buffer{nullptr, 0, loans_.memory(), copier_.memory().device, nullptr}),
        a.dst_engine);
  } catch (const Error& e) {
    // Refused at posting, as in run(): the bucket did not reach its engine.
    uncount(slots_[copy.slot]);
    drop_engine(a.dst_engine, e, dead, cat("sending lent bucket ", a.bucket));
    return;
  }
  bytes_direct_ += static_cast<uint64_t>(a.bytes);
  ++buckets_lent_;
}

}  // namespace weightsync::trainer
