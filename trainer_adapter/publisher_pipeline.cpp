#include "publisher_pipeline.h"

#include <weightsync/checksum.h>
#include <weightsync/error.h>
#include <weightsync/trace.h>
#include <weightsync/wire.h>

#include <algorithm>
#include <cstring>

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

// The 8-byte little-endian trailer holding `sum` (checksum.h).
void store_trailer(char* at, uint64_t sum) {
  for (size_t i = 0; i < kBucketTrailerBytes; ++i, sum >>= 8) at[i] = static_cast<char>(sum & 0xff);
}

}  // namespace

SendPipeline::SendPipeline(const Plan& plan, int rank, const std::vector<TensorView>& tensors,
                           const WireOptions& wire, const Capabilities& caps)
    : rank_(rank),
      trainer_world_(plan.trainer_world()),
      engine_world_(plan.engine_world()),
      wire_(wire),
      caps_(caps) {
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
    if (a.kind == SendAction::Kind::p2p) {
      compile_fragments(a, plan, tensors);
      slot_bytes_ =
          std::max(slot_bytes_, static_cast<size_t>(a.packed_bytes) + kBucketTrailerBytes);
      continue;
    }
    for (const PlanItem& item : plan.items(a.bucket)) {
      const Copy c = plan.resolve(item);
      if (c.src_rank != rank) continue;
      a.ops.push_back(make_pack_op(c, tensors.at(static_cast<size_t>(c.src_param)), a.base));
    }
    slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.bytes) + kBucketTrailerBytes);
  }
}

void SendPipeline::compile_fragments(SendAction& a, const Plan& plan,
                                     const std::vector<TensorView>& tensors) {
  auto tensor = [&](const Copy& c) -> const TensorView& {
    return tensors.at(static_cast<size_t>(c.src_param));
  };
  a.fragments = route_fragments(
      plan, a.bucket, wire_.direct_min_bytes,
      [&](const Copy& c) {
        return c.src_box.lengths == c.hf_box.lengths
                   ? direct_route(tensor(c), c.src_box, caps_, wire_)
                   : FragmentRoute{};
      },
      [&](const Copy& c, int64_t shift) { a.ops.push_back(make_pack_op(c, tensor(c), -shift)); },
      a.packed_bytes);
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

void SendPipeline::pack(const SendAction& a, size_t first, size_t count, char* buffer) {
  for (size_t i = first; i < first + count; ++i) {
    const PackOp& op = a.ops[i];
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

void SendPipeline::post_p2p(const SendAction& a, Slot& slot, int64_t step, Transport& t,
                            PushPhases& phases) {
  const int peer = trainer_world_ + a.dst_engine;
  const Tag tag = bucket_tag(step, a.bucket, 0);
  const int64_t pack_us = tracer_ ? trace_now_us() : 0;
  double pack_s = 0;
  uint64_t sum = 0;
  slot.bucket = a.bucket;
  slot.bytes = a.bytes;
  slot.posted_us = pack_us;
  for (uint32_t i = 0; i < a.fragments.size(); ++i) {
    const FragmentRoute& f = a.fragments[i];
    Buffer buffer{const_cast<char*>(f.direct), static_cast<size_t>(f.bytes), f.memory, f.device,
                  nullptr};
    if (f.direct) {
      bytes_direct_ += static_cast<uint64_t>(f.bytes);
    } else {
      const auto pack_start = Clock::now();
      pack(a, f.first_op, f.num_ops, slot.data);
      pack_s += seconds_since(pack_start);
      buffer = host_buffer(slot.data + f.slot_offset, buffer.bytes, slot.region.get());
    }
    if (wire_.checksums)
      sum = checksum_fold(sum, checksum64(buffer.data, buffer.bytes, fragment_seed(step, i)));
    // Posted in fragment order: the receiver matches them in that order.
    slot.requests.push_back(t.send(peer, tag, buffer));
    slot.engines.push_back(a.dst_engine);
  }
  phases.pack += pack_s;
  if (tracer_)
    tracer_->complete(
        cat("post ", a.bucket), "pack", pack_us, trace_now_us(),
        {{"bucket", a.bucket}, {"bytes", a.bytes}, {"fragments", a.fragments.size()}});
  if (!wire_.checksums) return;
  char* trailer = slot.data + a.packed_bytes;
  store_trailer(trailer, sum);
  slot.requests.push_back(t.send(peer, bucket_tag(step, a.bucket, 1),
                                 host_buffer(trailer, kBucketTrailerBytes, slot.region.get())));
  slot.engines.push_back(a.dst_engine);
}

void SendPipeline::post(const SendAction& a, Slot& slot, int64_t step, Transport& t,
                        std::vector<bool>& dead, const std::function<void()>& poll,
                        PushPhases& phases) {
  if (a.kind == SendAction::Kind::p2p) return post_p2p(a, slot, step, t, phases);
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
  pack(a, 0, a.ops.size(), slot.data);
  phases.pack += seconds_since(pack_start);
  if (tracer_)
    tracer_->complete(cat("pack ", a.bucket), "pack", pack_us, trace_now_us(),
                      {{"bucket", a.bucket}, {"bytes", a.bytes}});
  if (a.kind == SendAction::Kind::root && !a.parts.empty()) {
    const auto gather_start = Clock::now();
    drain(slot, dead, poll, phases);
    phases.gather += seconds_since(gather_start);
  }
  if (wire_.checksums)
    store_trailer(slot.data + a.bytes,
                  checksum64(slot.data, static_cast<size_t>(a.bytes), static_cast<uint64_t>(step)));
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
  size_t head = 0;  // requests before `head` are finished; they mostly finish in order
  while (head < slot.requests.size()) {
    const int g = slot.engines[head];
    bool done = false;
    if (g >= 0 && dead[static_cast<size_t>(g)]) {
      slot.requests[head]->cancel();
      done = true;
    } else {
      try {
        done = slot.requests[head]->test();
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
      ++head;
      spins = 0;
      continue;
    }
    const auto now = Clock::now();
    if (now >= deadline_)
      fail(Errc::timeout, "trainer rank ", rank_, ": ", slot.requests[head]->describe(),
           " did not complete before the step timeout");
    if (now - last_poll >= std::chrono::milliseconds(1)) {
      last_poll = now;
      poll();
    }
    poll_pause(spins);
  }
  if (tracer_ && slot.bucket >= 0)
    tracer_->complete(cat("bucket ", slot.bucket), "wire", slot.posted_us, trace_now_us(),
                      {{"bucket", slot.bucket}, {"bytes", slot.bytes}});
  slot.bucket = -1;
  slot.requests.clear();
  slot.engines.clear();
  (void)phases;
}

uint64_t SendPipeline::run(int64_t step, Transport& transport, std::vector<bool>& dead,
                           const std::function<void()>& poll, Clock::time_point deadline,
                           PushPhases& phases, Tracer* tracer) {
  deadline_ = deadline;
  tracer_ = tracer;
  uint64_t sent = 0;
  bytes_direct_ = 0;
  size_t k = 0;
  for (const SendAction& a : actions_) {
    if (a.kind == SendAction::Kind::p2p && dead[static_cast<size_t>(a.dst_engine)]) continue;
    Slot& slot = slots_[k++ % 2];
    const auto wire_start = Clock::now();
    drain(slot, dead, poll, phases);
    phases.wire += seconds_since(wire_start);
    // The drain may have learned of the engine's death.
    if (a.kind == SendAction::Kind::p2p && dead[static_cast<size_t>(a.dst_engine)]) continue;
    try {
      post(a, slot, step, transport, dead, poll, phases);
    } catch (const Error&) {
      // A send to an engine refused at posting (known dead, endpoint timeout,
      // unreachable) drops that engine, as a failed transfer does in drain().
      if (a.kind != SendAction::Kind::p2p) throw;
      dead[static_cast<size_t>(a.dst_engine)] = true;
      continue;
    }
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
