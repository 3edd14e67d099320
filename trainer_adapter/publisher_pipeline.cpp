#include "publisher_pipeline.h"

#include <weightsync/checksum.h>
#include <weightsync/error.h>
#include <weightsync/trace.h>

#include <algorithm>
#include <cstring>
#include <thread>

namespace weightsync::trainer {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

PackOp make_pack_op(const Copy& c, const TensorView& tensor, int64_t base) {
  if (c.src_box.lengths != c.hf_box.lengths)
    fail(Errc::internal, "plan item of trainer param ", c.src_param, ": source box ",
         box_str(c.src_box), " and HF box ", box_str(c.hf_box), " differ in size");
  PackOp op;
  op.tensor = &tensor;
  op.src_box = c.src_box;
  op.lengths = c.src_box.lengths;
  op.dst_offset = c.offset - base;
  op.src_strides = tensor.effective_strides();
  op.dst_strides = contiguous_strides(op.lengths);
  int64_t first = 0;
  for (size_t d = 0; d < c.src_box.rank(); ++d) first += c.src_box.offsets[d] * op.src_strides[d];
  op.src =
      static_cast<const char*>(tensor.data) + first * static_cast<int64_t>(itemsize(tensor.dtype));
  return op;
}

void write_trailer(char* data, int64_t bytes, int64_t step) {
  uint64_t sum = checksum64(data, static_cast<size_t>(bytes), static_cast<uint64_t>(step));
  for (size_t i = 0; i < kBucketTrailerBytes; ++i, sum >>= 8)
    data[bytes + static_cast<int64_t>(i)] = static_cast<char>(sum & 0xff);
}

}  // namespace

SendPipeline::SendPipeline(const Plan& plan, int rank, const std::vector<TensorView>& tensors)
    : rank_(rank), trainer_world_(plan.trainer_world()), engine_world_(plan.engine_world()) {
  const bool broadcast = plan.mode() == PlanMode::broadcast;
  for (int32_t b : plan.buckets_sent_by(rank)) {
    SendAction a;
    a.kind = broadcast ? SendAction::Kind::root : SendAction::Kind::p2p;
    a.bucket = b;
    actions_.push_back(std::move(a));
  }
  if (broadcast) {
    for (int32_t b : plan.buckets_gathered_from(rank)) {
      if (plan.buckets()[static_cast<size_t>(b)].src_rank == rank) continue;
      SendAction a;
      a.kind = SendAction::Kind::holder;
      a.bucket = b;
      actions_.push_back(std::move(a));
    }
  }
  // One order for every process (see the header).
  const auto& buckets = plan.buckets();
  std::sort(actions_.begin(), actions_.end(), [&](const SendAction& x, const SendAction& y) {
    const auto& bx = buckets[static_cast<size_t>(x.bucket)];
    const auto& by = buckets[static_cast<size_t>(y.bucket)];
    return bx.start_s != by.start_s ? bx.start_s < by.start_s : x.bucket < y.bucket;
  });
  for (SendAction& a : actions_) {
    const Bucket& bucket = buckets[static_cast<size_t>(a.bucket)];
    a.bytes = bucket.bytes;
    a.dst_engine = bucket.dst_rank;
    a.root = bucket.src_rank;
    for (const GatherPart& part :
         broadcast ? plan.gather_parts(a.bucket) : std::vector<GatherPart>{}) {
      if (a.kind == SendAction::Kind::holder && part.src_rank == rank) {
        a.base = part.offset;
        a.bytes = part.bytes;
      } else if (a.kind == SendAction::Kind::root && part.src_rank != rank) {
        a.parts.push_back(part);
      }
    }
    for (const PlanItem& item : plan.items(a.bucket)) {
      const Copy c = plan.resolve(item);
      if (c.src_rank != rank) continue;
      a.ops.push_back(make_pack_op(c, tensors.at(static_cast<size_t>(c.src_param)), a.base));
    }
    slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.bytes) + kBucketTrailerBytes);
  }
}

void SendPipeline::prepare(Transport& transport) {
  native_broadcast_ = transport.capabilities().native_broadcast;
  if (slot_bytes_ == 0 || slots_[0].data) return;
  for (Slot& s : slots_) {
    static_cast<RegisteredHostBuffer&>(s) = allocate_registered_host(transport, slot_bytes_);
    s.requests.reserve(static_cast<size_t>(engine_world_ + trainer_world_));
    s.engines.reserve(static_cast<size_t>(engine_world_ + trainer_world_));
  }
}

void SendPipeline::pack(const SendAction& a, char* buffer) {
  for (const PackOp& op : a.ops) {
    char* dst = buffer + op.dst_offset;
    if (op.tensor->memory == MemoryKind::host) {
      copy_strided(dst, op.dst_strides.data(), op.src, op.src_strides.data(), op.lengths.data(),
                   static_cast<int>(op.lengths.size()), itemsize(op.tensor->dtype));
    } else {
      const TensorView packed = host_view(dst, op.tensor->dtype, op.lengths);
      copy_box(*op.tensor, op.src_box, packed, Box::full(op.lengths));
    }
  }
}

void SendPipeline::post(const SendAction& a, Slot& slot, int64_t step, Transport& t,
                        std::vector<bool>& dead, const std::function<void()>& poll,
                        PushPhases& phases) {
  const Buffer payload =
      host_buffer(slot.data, static_cast<size_t>(a.bytes) + kBucketTrailerBytes, slot.region.get());
  if (a.kind == SendAction::Kind::root) {
    // Post the other holders' parts first, so they land while we pack ours.
    for (const GatherPart& part : a.parts) {
      slot.requests.push_back(
          t.recv(part.src_rank, bucket_tag(step, a.bucket, 1),
                 host_buffer(slot.data + part.offset, static_cast<size_t>(part.bytes),
                             slot.region.get())));
      slot.engines.push_back(-1);
    }
  }
  const auto pack_start = Clock::now();
  const int64_t pack_us = tracer_ ? trace_now_us() : 0;
  pack(a, slot.data);
  phases.pack += seconds_since(pack_start);
  if (tracer_)
    tracer_->complete(cat("pack ", a.bucket), "pack", pack_us, trace_now_us(),
                      {{"bucket", a.bucket}, {"bytes", a.bytes}});
  if (a.kind == SendAction::Kind::root && !a.parts.empty()) {
    const auto gather_start = Clock::now();
    drain(slot, dead, poll, phases);
    phases.gather += seconds_since(gather_start);
  }
  write_trailer(slot.data, a.bytes, step);
  slot.bucket = a.bucket;
  slot.bytes = a.bytes;
  slot.posted_us = tracer_ ? trace_now_us() : 0;
  const Tag tag = bucket_tag(step, a.bucket, a.kind == SendAction::Kind::holder ? 1 : 0);
  if (a.kind == SendAction::Kind::p2p) {
    slot.requests.push_back(t.send(trainer_world_ + a.dst_engine, tag, payload));
    slot.engines.push_back(a.dst_engine);
  } else if (a.kind == SendAction::Kind::holder) {
    slot.requests.push_back(t.send(
        a.root, tag, host_buffer(slot.data, static_cast<size_t>(a.bytes), slot.region.get())));
    slot.engines.push_back(-1);
  } else if (native_broadcast_) {
    std::vector<int> ranks{rank_};
    for (int g = 0; g < engine_world_; ++g) ranks.push_back(trainer_world_ + g);
    slot.requests.push_back(t.broadcast(payload, rank_, ranks, tag));
    slot.engines.push_back(-1);
  } else {
    for (int g = 0; g < engine_world_; ++g) {
      if (dead[static_cast<size_t>(g)]) continue;
      slot.requests.push_back(t.send(trainer_world_ + g, tag, payload));
      slot.engines.push_back(g);
    }
  }
}

void SendPipeline::drain(Slot& slot, std::vector<bool>& dead, const std::function<void()>& poll,
                         PushPhases& phases) {
  auto last_poll = Clock::now();
  int spins = 0;
  while (!slot.requests.empty()) {
    for (size_t i = 0; i < slot.requests.size();) {
      const int g = slot.engines[i];
      bool done = false;
      if (g >= 0 && dead[static_cast<size_t>(g)]) {
        slot.requests[i]->cancel();
        done = true;
      } else {
        try {
          done = slot.requests[i]->test();
        } catch (const Error& e) {
          // An engine whose transfer fails (died, unreachable, endpoint
          // timeout) is dropped: the coordinator fails it, the others go on.
          // A failure towards a trainer (a gather part) fails the step.
          if (g < 0) throw;
          dead[static_cast<size_t>(g)] = true;
          done = true;
        }
      }
      if (done) {
        slot.requests.erase(slot.requests.begin() + static_cast<std::ptrdiff_t>(i));
        slot.engines.erase(slot.engines.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    if (slot.requests.empty()) {
      if (tracer_ && slot.bucket >= 0)
        tracer_->complete(cat("bucket ", slot.bucket), "wire", slot.posted_us, trace_now_us(),
                          {{"bucket", slot.bucket}, {"bytes", slot.bytes}});
      slot.bucket = -1;
      break;
    }
    const auto now = Clock::now();
    if (now >= deadline_)
      fail(Errc::timeout, "trainer rank ", rank_, ": ", slot.requests.front()->describe(),
           " did not complete before the step timeout");
    if (now - last_poll >= std::chrono::milliseconds(1)) {
      last_poll = now;
      poll();
    }
    // Ranks often outnumber cores (the demo runs 8 processes on 2): after a
    // short spin, give the core to the peer that must make progress.
    if (++spins > 64) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  (void)phases;
}

uint64_t SendPipeline::run(int64_t step, Transport& transport, std::vector<bool>& dead,
                           const std::function<void()>& poll, Clock::time_point deadline,
                           PushPhases& phases, Tracer* tracer) {
  deadline_ = deadline;
  tracer_ = tracer;
  uint64_t sent = 0;
  size_t k = 0;
  for (const SendAction& a : actions_) {
    if (a.kind == SendAction::Kind::p2p && dead[static_cast<size_t>(a.dst_engine)]) continue;
    Slot& slot = slots_[k++ % 2];
    const auto wire_start = Clock::now();
    drain(slot, dead, poll, phases);
    phases.wire += seconds_since(wire_start);
    post(a, slot, step, transport, dead, poll, phases);
    sent += static_cast<uint64_t>(a.bytes);
  }
  const auto wire_start = Clock::now();
  for (Slot& slot : slots_) drain(slot, dead, poll, phases);
  phases.wire += seconds_since(wire_start);
  return sent;
}

void SendPipeline::cancel_all() {
  for (Slot& slot : slots_) {
    for (auto& r : slot.requests) r->cancel();
    slot.requests.clear();
    slot.engines.clear();
  }
}

}  // namespace weightsync::trainer
