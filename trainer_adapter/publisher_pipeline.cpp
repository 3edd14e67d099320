#include "publisher_pipeline.h"

#include <weightsync/checksum.h>
#include <weightsync/error.h>
#include <weightsync/trace.h>

#include "pipeline/item_copies.h"
#include "pipeline/wire.h"
#include "transport/staging.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <map>

namespace weightsync::trainer {
namespace {

using Clock = std::chrono::steady_clock;

using pipeline::seconds_since;

using pipeline::slot_event;

// Steps a bucket goes whole, untried, after its delta came out nearly whole:
// 3, then twice as many after each try that came out nearly whole again, up
// to 24. A bucket whose elements all change every step is then seldom tried
// (each try and the step before it copy the bucket into its base), and one
// whose changes thin out is tried again within 24 steps.
constexpr int kWholeStepsBeforeRetry = 3;
constexpr int kMostWholeStepsBeforeRetry = 24;

// A delta came out (or looked) nearly whole: the steps to go whole.
void back_off(DeltaBase& d) {
  const int doubled = kWholeStepsBeforeRetry << d.whole_tries;
  d.skip_deltas = std::min(doubled, kMostWholeStepsBeforeRetry);
  if (doubled < kMostWholeStepsBeforeRetry) ++d.whole_tries;
}

// Delta sync, one bucket's choices (p2p post_frame, broadcast
// post_root_frame). Whether this step tries a delta: its receivers must hold
// the base, and a bucket whose last delta came out nearly whole goes whole
// for a few steps without trying (most of its elements change every step),
// then tries again.
bool try_delta(DeltaBase& d, bool receivers_hold_base) {
  const bool attempt = receivers_hold_base && d.skip_deltas == 0;
  if (d.skip_deltas > 0) --d.skip_deltas;
  return attempt;
}

// A look at 1/64 of the bytes first, unless the last delta was small: a
// delta that would come out nearly whole is not worth its encoding (the
// bytes themselves spare the engine its read-modify-write).
bool looks_nearly_whole(const DeltaBase& d, const SendAction& a, const char* const* next) {
  return !d.last_delta_small &&
         4 * pipeline::estimate_frame(a.items, next, d.last_sent.get()) >= 3 * a.bytes;
}

// After an encoding of `frame_bytes` (header included): whether it came out
// nearly whole; remembers whether it was small (the next step then encodes
// without a look first).
bool encoded_nearly_whole(DeltaBase& d, const SendAction& a, int64_t frame_bytes) {
  const int64_t encoded = frame_bytes - pipeline::kFrameHeaderBytes;
  d.last_delta_small = 4 * encoded < a.bytes;
  return 4 * encoded >= 3 * a.bytes;
}

// A whole step: its receivers hold its bytes once they commit it, so the
// base must hold them too, unless the next step will not try a delta (then
// the base is brought up to date on the step before a try). Sets
// d.last_step; true when the base must take this step's bytes (that is,
// the encoder did not already bring it up to date).
bool base_takes_whole(DeltaBase& d, int64_t step, bool base_is_next) {
  const bool keep = base_is_next || d.skip_deltas == 0;
  d.last_step = keep ? step : -1;
  return keep && !base_is_next;
}

// What a p2p bucket packs, item by item (the bucket's bytes, then each
// item's Copy appended): buckets with equal keys pack equal bytes (delta
// sync's twins, DeltaBase).
void add_to_packing_key(std::vector<int64_t>& key, const Copy& c) {
  auto add_box = [&](const Box& b) {
    key.push_back(static_cast<int64_t>(b.rank()));
    key.insert(key.end(), b.offsets.begin(), b.offsets.end());
    key.insert(key.end(), b.lengths.begin(), b.lengths.end());
  };
  key.insert(key.end(), {c.src_param, c.transpose, c.offset, static_cast<int64_t>(c.dtype), c.bytes,
                         c.fp8, static_cast<int64_t>(c.fp8_format)});
  add_box(c.src_box);
  add_box(c.hf_box);
  add_box(c.view_box);
}

using pipeline::add_pack;
using pipeline::addr;

// Appends the quantization of one plan item its sender quantizes (Copy::fp8):
// `c.src_box` of `tensor` into FP8 codes row-major at bucket offset c.offset
// - base, then its blocks' F32 scales row-major.
void add_quant(fp8::QuantProgram& program, const Copy& c, const TensorView& tensor, int64_t base) {
  const size_t n = c.src_box.rank(), h = c.hf_box.rank();
  if (!same_lengths_but_leading_ones(c.src_box.lengths, c.hf_box.lengths) || h != 2)
    fail(Errc::internal, "plan item of trainer param ", c.src_param, ": source box ",
         box_str(c.src_box), " and HF box ", box_str(c.hf_box), " differ in size");
  if (tensor.dtype != c.dtype)
    fail(Errc::invalid_argument, "trainer param ", c.src_param, " is ", dtype_name(tensor.dtype),
         ", its layout says ", dtype_name(c.dtype));
  const Shape strides = tensor.effective_strides();
  const auto item = static_cast<int64_t>(itemsize(tensor.dtype));
  int64_t first = 0;
  for (size_t d = 0; d < n; ++d) first += c.src_box.offsets[d] * strides[d];
  fp8::Region g;
  g.rows = c.hf_box.lengths[0];
  g.cols = c.hf_box.lengths[1];
  g.src = static_cast<int64_t>(addr(tensor.data)) + first * item;
  g.src_rs = n >= 2 ? strides[n - 2] : 0;
  g.src_cs = strides[n - 1];
  g.dst = c.offset - base;
  g.dst_rs = g.cols;
  g.dst_relative = true;
  g.scale = g.dst + g.rows * g.cols;
  g.scale_rs = (g.cols + fp8::kBlock - 1) / fp8::kBlock;
  if (g.rows > 0 && g.cols > 0) fp8::add_region(program, g, tensor.dtype, c.fp8_format);
}

// This rank's actions in the plan's order (see the header).
std::vector<SendAction> ordered_actions(const Plan& plan, int rank) {
  std::vector<SendAction> out;
  const bool broadcast = plan.mode() == PlanMode::broadcast;
  std::vector<int32_t> holder;
  if (broadcast)
    for (int32_t b : plan.buckets_gathered_from(rank)) holder.push_back(b);
  const auto& roots = plan.buckets_sent_by(rank);
  size_t r = 0, h = 0;
  while (r < roots.size() || h < holder.size()) {
    SendAction a;
    if (h == holder.size() || (r < roots.size() && roots[r] < holder[h])) {
      a.kind = broadcast ? SendAction::Kind::root : SendAction::Kind::p2p;
      a.bucket = roots[r++];
    } else {
      a.kind = SendAction::Kind::holder;
      a.bucket = holder[h++];
    }
    out.push_back(std::move(a));
  }
  return out;
}

}  // namespace

SendPipeline::SendPipeline(const Plan& plan, int rank, const std::vector<TensorView>& tensors,
                           const WireOptions& wire, const Capabilities& caps,
                           const EngineLayout* engine)
    : rank_(rank),
      trainer_world_(plan.trainer_world()),
      engine_world_(plan.engine_world()),
      wire_(wire),
      caps_(caps),
      actions_(ordered_actions(plan, rank)) {
  const bool broadcast = plan.mode() == PlanMode::broadcast;
  std::map<std::vector<int64_t>, size_t> twins;  // packing_key -> bases_ index
  for (SendAction& a : actions_) {
    const Bucket& bucket = plan.buckets()[static_cast<size_t>(a.bucket)];
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
    if (a.kind == SendAction::Kind::p2p && wire_.delta) {
      // One frame a bucket, its items packed behind the frame's header;
      // those that lie in place are diffed from there.
      std::vector<int64_t> key{a.bytes};
      for (const PlanItem& item : plan.items(a.bucket)) {
        const Copy c = plan.resolve(item);
        add_to_packing_key(key, c);
        const TensorView& tensor = tensors.at(static_cast<size_t>(c.src_param));
        const char* in_place =
            !c.fp8 && same_lengths_but_leading_ones(c.src_box.lengths, c.hf_box.lengths)
                ? pipeline::host_run(tensor, c.src_box)
                : nullptr;
        a.in_place.push_back(in_place);
        if (c.fp8)
          add_quant(a.quant, c, tensor, -pipeline::kFrameHeaderBytes);
        else
          add_pack(in_place ? a.pack_in_place : a.pack, c, tensor, -pipeline::kFrameHeaderBytes);
      }
      a.items = pipeline::frame_items(plan, a.bucket);
      // Twins share a base: one per bucket that packs other bytes.
      auto [twin, added] = twins.try_emplace(std::move(key), bases_.size());
      if (added) bases_.emplace_back();
      a.delta_base = static_cast<int>(twin->second);
      bases_[twin->second].engines.push_back(a.dst_engine);
      compile_fragments(a, plan, tensors, a.whole_pack, a.whole_quant);
      slot_bytes_ = std::max(
          slot_bytes_,
          static_cast<size_t>(std::max(pipeline::kFrameHeaderBytes + a.bytes, a.packed_bytes)) +
              kBucketTrailerBytes);
      frame_bytes_ =
          std::max(frame_bytes_, static_cast<size_t>(pipeline::frame_capacity(a.items, a.bytes)) +
                                     kBucketTrailerBytes);
      continue;
    }
    if (a.kind == SendAction::Kind::p2p) {
      compile_fragments(a, plan, tensors, a.pack, a.quant);
      slot_bytes_ =
          std::max(slot_bytes_, static_cast<size_t>(a.packed_bytes) + kBucketTrailerBytes);
      continue;
    }
    for (const PlanItem& item : plan.items(a.bucket)) {
      const Copy c = plan.resolve(item);
      if (c.src_rank != rank) continue;
      add_pack(a.pack, c, tensors.at(static_cast<size_t>(c.src_param)), a.base);
    }
    slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(a.bytes) + kBucketTrailerBytes);
    if (a.kind == SendAction::Kind::root && wire_.delta) {
      // The delta of the whole bucket, which the root holds once gathered,
      // with a digest for each engine template's part.
      a.items = pipeline::frame_items(plan, a.bucket);
      a.delta_base = static_cast<int>(bases_.size());
      bases_.emplace_back();
      for (int t = 0; t < plan.engine_templates(); ++t)
        a.reads.push_back(pipeline::template_reads(plan, a.bucket, t));
      frame_bytes_ =
          std::max(frame_bytes_, static_cast<size_t>(pipeline::frame_capacity(a.items, a.bytes) +
                                                     8 * static_cast<int64_t>(a.reads.size())) +
                                     kBucketTrailerBytes);
    }
  }
  int64_t largest = 0;
  for (const SendAction& a : actions_) largest = std::max(largest, a.bytes);
  slots_.resize(slot_depth(slot_bytes_, largest, actions_.size(), broadcast, wire_, caps_));
  // Lent buckets: the loans each engine rank makes this rank, as the plan
  // lays them out (the engine rank derives the same).
  lending_ = lending_possible(plan, wire_, caps_);
  if (!lending_) return;
  lend_memory_ = caps_.cuda_memory ? MemoryKind::cuda : MemoryKind::host;
  tensors_ = tensors;
  std::map<int, std::vector<int32_t>> lendable;  // by engine rank
  for (SendAction& a : actions_) {
    if (a.kind != SendAction::Kind::p2p || !lendable_bucket(plan, a.bucket)) continue;
    a.lendable = true;
    for (const PlanItem& item : plan.items(a.bucket)) a.lend_items.push_back(plan.resolve(item));
    lendable[a.dst_engine].push_back(a.bucket);
  }
  for (const auto& [g, buckets] : lendable) {
    Loan l;
    l.engine = g;
    l.params = lent_params(plan, buckets);
    // Without the engine's layout the loans are declined: no views.
    if (engine) {
      // What the engine rank lends: the tensors it receives into (an FP8
      // weight it quantizes itself: its staging of the trainer's dtype).
      const EngineRankLayout& rl = engine->rank_layout(g);
      const std::vector<DType> dtypes = received_dtypes(plan, plan.engine_template(g), rl);
      for (int p : l.params)
        l.targets.push_back(tensor_view(nullptr, dtypes.at(static_cast<size_t>(p)),
                                        rl.params.at(static_cast<size_t>(p)).shape, lend_memory_,
                                        -1));
    }
    loans_.push_back(std::move(l));
  }
}

void SendPipeline::compile_fragments(SendAction& a, const Plan& plan,
                                     const std::vector<TensorView>& tensors, CopyProgram& pack,
                                     fp8::QuantProgram& quant) {
  auto tensor = [&](const Copy& c) -> const TensorView& {
    return tensors.at(static_cast<size_t>(c.src_param));
  };
  std::vector<uint32_t> first_run;  // of each packed item, in pack.runs()
  a.fragments = route_fragments(
      plan, a.bucket, wire_.direct_min_bytes,
      [&](const Copy& c) {
        return same_lengths_but_leading_ones(c.src_box.lengths, c.hf_box.lengths)
                   ? direct_route(tensor(c), c.src_box, caps_, wire_)
                   : FragmentRoute{};
      },
      [&](const Copy& c, int64_t shift) {
        first_run.push_back(static_cast<uint32_t>(pack.size()));
        if (c.fp8)
          add_quant(quant, c, tensor(c), -shift);
        else
          add_pack(pack, c, tensor(c), -shift);
      },
      a.packed_bytes);
  first_run.push_back(static_cast<uint32_t>(pack.size()));
  // Items -> runs: a packed fragment runs its items' runs of the program.
  for (FragmentRoute& f : a.fragments) {
    if (f.direct) continue;
    const uint32_t begin = first_run[f.first_op], end = first_run[f.first_op + f.num_ops];
    f.first_op = begin;
    f.num_ops = end - begin;
  }
}

void SendPipeline::prepare(Transport& transport, SlotMemory slots, int slot_device,
                           const pipeline::RankMemory& memory, Producer producer) {
  native_broadcast_ = transport.capabilities().native_broadcast;
  producer_ = producer;
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
    if (frame_bytes_ > 0) s.frame = allocate_staging(transport, frame_bytes_, SlotMemory::host, -1);
    s.posted.reserve(static_cast<size_t>(engine_world_ + trainer_world_));
  }
}

uint64_t SendPipeline::delta_base_bytes() const {
  uint64_t bytes = 0;
  for (const DeltaBase& d : bases_)
    if (d.last_sent) bytes += static_cast<uint64_t>(d.bytes);
  return bytes;
}

void SendPipeline::keep_base(SendAction& a, const char* packed) {
  DeltaBase& d = bases_[static_cast<size_t>(a.delta_base)];
  if (!d.last_sent) {
    d.last_sent.reset(new char[static_cast<size_t>(std::max<int64_t>(a.bytes, 1))]);
    d.bytes = a.bytes;
  }
  if (packed) {
    std::memcpy(d.last_sent.get(), packed, static_cast<size_t>(a.bytes));
    return;
  }
  // The frame's programs write at bucket offset + header from their base.
  const std::uintptr_t base = addr(d.last_sent.get()) - pipeline::kFrameHeaderBytes;
  if (!a.quant.empty()) fp8::execute_quant_host(a.quant, 0, base);
  execute_host(a.pack, 0, base);
  execute_host(a.pack_in_place, 0, base);
}

int64_t SendPipeline::post_frame(size_t index, int k, int64_t step, const std::vector<bool>& dead,
                                 PushPhases& phases) {
  SendAction& a = actions_[index];
  DeltaBase& d = bases_[static_cast<size_t>(a.delta_base)];
  Slot& slot = slots_[k];
  const int64_t pack_us = tracer_ ? trace_now_us() : 0;
  auto holds = [&](int g, int64_t version) {
    return static_cast<size_t>(g) < held_.size() && held_[static_cast<size_t>(g)] == version;
  };
  // One frame (`bytes` of `from`): a delta, or a whole bucket behind its header.
  auto send_frame = [&](const StagingBuffer& from, int64_t bytes, bool delta) {
    if (delta) {
      ++delta_buckets_;
      delta_bytes_whole_ += static_cast<uint64_t>(a.bytes);
    }
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
  };
  bool packed = false;  // the frame's layout is in the slot
  bool take = false;    // the base takes this step's bytes (the encoder did not)
  char* body = slot.buffer.data + pipeline::kFrameHeaderBytes;
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
  if (d.decided != runs_) {
    // The first twin this step: a delta when one of the twins' engine ranks
    // holds the base; those that do not get the whole bytes.
    d.decided = runs_;
    d.delta = false;
    d.left = static_cast<int>(d.engines.size()) - 1;
    std::vector<char>().swap(d.frame);  // a twin's engine died before it took the last one
    const bool held = d.last_sent && d.last_step >= 0 &&
                      std::any_of(d.engines.begin(), d.engines.end(), [&](int g) {
                        return !dead[static_cast<size_t>(g)] && holds(g, d.last_step);
                      });
    bool base_is_next = false;  // the encoder brought the base up to this step
    if (try_delta(d, held)) {
      pack_frame();
      const auto encode_start = Clock::now();  // counted as packing
      // Each item's new bytes: in place, or packed in the slot.
      std::vector<const char*>& next = next_;
      next.resize(a.items.size());
      for (size_t i = 0; i < a.items.size(); ++i)
        next[i] = a.in_place[i] ? a.in_place[i] : body + a.items[i].offset;
      // A delta that would come out nearly whole goes whole instead: straight
      // from the tensors into the params, without a copy.
      if (!looks_nearly_whole(d, a, next.data())) {
        uint64_t digest = 0;
        const int64_t n =
            pipeline::encode_frame(a.items, next.data(), d.last_sent.get(), slot.frame.data,
                                   nullptr, step, delta_verify_ ? &digest : nullptr);
        base_is_next = true;
        if (!encoded_nearly_whole(d, a, n)) {
          pipeline::FrameHeader h;
          h.step = step;
          h.delta = true;
          h.base = d.last_step;
          h.has_digest = delta_verify_;
          h.digest = digest;
          pipeline::store_frame_header(slot.frame.data, h);
          const int64_t bytes = with_trailer(slot.frame.data, n, step);
          d.delta = true;
          d.whole_tries = 0;
          d.frame_base = d.last_step;
          d.last_step = step;
          if (d.left > 0) d.frame.assign(slot.frame.data, slot.frame.data + bytes);
          phases.pack += seconds_since(encode_start);
          if (holds(a.dst_engine, d.frame_base)) return send_frame(slot.frame, bytes, true);
        }
      }
      phases.pack += seconds_since(encode_start);
      if (!d.delta) back_off(d);
    }
    if (!d.delta) take = base_takes_whole(d, step, base_is_next);
  } else {
    --d.left;
    // A twin encoded this step's delta: the same frame goes here.
    const bool same_frame = d.delta && holds(a.dst_engine, d.frame_base);
    const auto bytes = static_cast<int64_t>(d.frame.size());
    if (same_frame) std::memcpy(slot.frame.data, d.frame.data(), d.frame.size());
    if (d.left <= 0) std::vector<char>().swap(d.frame);  // the last twin took it
    if (same_frame) return send_frame(slot.frame, bytes, true);
  }
  // The whole bytes: to an engine rank without the base, or for every twin.
  pipeline::FrameHeader h;
  h.step = step;
  if (!copier_.on_gpu()) {
    if (take) {
      const auto start = Clock::now();
      keep_base(a);
      phases.pack += seconds_since(start);
    }
    // The header alone, then the bucket's fragments, as without delta:
    // dense runs straight from the tensors into the params.
    h.fragments = true;
    post_p2p(index, k, step, phases, &h);
    return pipeline::kFrameHeaderBytes + a.bytes;
  }
  // CUDA tensors: the packed bucket behind the header, as one frame.
  if (!packed) pack_frame();
  const auto start = Clock::now();
  execute_host(a.pack_in_place, 0, addr(slot.buffer.data));
  if (take) keep_base(a, body);
  phases.pack += seconds_since(start);
  pipeline::store_frame_header(slot.buffer.data, h);
  return send_frame(slot.buffer,
                    with_trailer(slot.buffer.data, pipeline::kFrameHeaderBytes + a.bytes, step),
                    false);
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
                            const pipeline::FrameHeader* header) {
  const SendAction& a = actions_[index];
  Slot& slot = slots_[k];
  Transport& t = loop_->transport();
  const int peer = trainer_world_ + a.dst_engine;
  const Tag tag = bucket_tag(step, a.bucket, 0);
  // Delta sync's whole steps pack with the fragments' own programs (the
  // action's pack and quant lay out the frame).
  const CopyProgram& pack_program = header ? a.whole_pack : a.pack;
  const fp8::QuantProgram& quant = header ? a.whole_quant : a.quant;
  if (header) {
    pipeline::store_frame_header(slot.frame.data, *header);
    const int64_t bytes = with_trailer(slot.frame.data, pipeline::kFrameHeaderBytes, step);
    slot.posted.add(t.send(peer, tag, slot.frame.buffer(0, static_cast<size_t>(bytes))),
                    a.dst_engine);
  }
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
      if (!copier_.on_gpu()) {
        // On the host each fragment goes out as soon as it is packed.
        const auto start = Clock::now();
        execute_host(pack_program, 0, addr(slot.buffer.data), f.first_op, f.num_ops);
        pack_s += seconds_since(start);
      }
      buffer = slot.buffer.buffer(static_cast<size_t>(f.slot_offset), buffer.bytes);
    }
    if (wire_.checksums)
      sum = checksum_fold(sum, checksum64(buffer.data, buffer.bytes, fragment_seed(step, i)));
    // Posted in fragment order: the receiver matches them in that order.
    slot.posted.add(t.send(peer, tag, buffer), a.dst_engine);
  }
  phases.pack += pack_s;
  if (tracer_)
    tracer_->complete(
        cat("post ", a.bucket), "pack", pack_us, trace_now_us(),
        {{"bucket", a.bucket}, {"bytes", a.bytes}, {"fragments", a.fragments.size()}});
  if (!wire_.checksums) return;
  char* trailer = slot.buffer.data + a.packed_bytes;
  store_trailer(trailer, sum);
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
    store_trailer(
        slot.buffer.data + a.bytes,
        checksum64(slot.buffer.data, static_cast<size_t>(a.bytes), static_cast<uint64_t>(step)));
  slot.bucket = a.bucket;
  slot.bytes = a.bytes;
  slot.posted_us = tracer_ ? trace_now_us() : 0;
  if (!root) {
    slot.posted.add(t.send(a.root, bucket_tag(step, a.bucket, 1),
                           slot.buffer.buffer(0, static_cast<size_t>(a.bytes))));
    return a.bytes;
  }
  const Tag tag = bucket_tag(step, a.bucket, 0);
  const Buffer payload = slot.buffer.buffer(0, static_cast<size_t>(a.bytes) + kBucketTrailerBytes);
  if (native_broadcast_) {
    std::vector<int> ranks{rank_};
    for (int g = 0; g < engine_world_; ++g) ranks.push_back(trainer_world_ + g);
    slot.posted.add(t.broadcast(payload, rank_, ranks, tag));
    return a.bytes;
  }
  send_to_engines(slot, tag, payload, dead);
  return a.bytes;
}

int64_t SendPipeline::with_trailer(char* at, int64_t bytes, int64_t step) const {
  if (!wire_.checksums) return bytes;
  store_trailer(at + bytes,
                checksum64(at, static_cast<size_t>(bytes), static_cast<uint64_t>(step)));
  return bytes + static_cast<int64_t>(kBucketTrailerBytes);
}

void SendPipeline::send_to_engines(Slot& slot, Tag tag, const Buffer& buffer,
                                   std::vector<bool>& dead) {
  Transport& t = loop_->transport();
  for (int g = 0; g < engine_world_; ++g) {
    if (dead[static_cast<size_t>(g)]) continue;
    try {
      slot.posted.add(t.send(trainer_world_ + g, tag, buffer), g);
    } catch (const Error&) {
      // Refused at posting (known dead, endpoint timeout, unreachable): that
      // engine is dropped, as a failed transfer is in drain(); the others
      // get the bucket.
      dead[static_cast<size_t>(g)] = true;
    }
  }
}

int64_t SendPipeline::post_root_frame(size_t index, int k, int64_t step, std::vector<bool>& dead,
                                      PushPhases& phases) {
  SendAction& a = actions_[index];
  DeltaBase& d = bases_[static_cast<size_t>(a.delta_base)];
  Slot& slot = slots_[k];
  const Tag tag = bucket_tag(step, a.bucket, 0);
  const char* packed = slot.buffer.data;
  auto send_all = [&](const Buffer& buffer) { send_to_engines(slot, tag, buffer, dead); };
  slot.bucket = a.bucket;
  slot.posted_us = tracer_ ? trace_now_us() : 0;
  const auto start = Clock::now();
  // Every engine rank gets the one frame: a delta only when each of them
  // (the ranks this step serves) holds the version of the base.
  bool base_held = d.last_sent && d.last_step >= 0;
  for (int g = 0; g < engine_world_ && base_held; ++g)
    if (!dead[static_cast<size_t>(g)] &&
        (static_cast<size_t>(g) >= held_.size() || held_[static_cast<size_t>(g)] != d.last_step))
      base_held = false;
  const bool attempt = try_delta(d, base_held);
  pipeline::FrameHeader h;
  h.step = step;
  bool base_is_next = false;
  if (attempt) {
    std::vector<const char*>& next = next_;
    next.resize(a.items.size());
    for (size_t i = 0; i < a.items.size(); ++i) next[i] = packed + a.items[i].offset;
    if (!looks_nearly_whole(d, a, next.data())) {
      const int64_t digests = delta_verify_ ? 8 * static_cast<int64_t>(a.reads.size()) : 0;
      const int64_t n = pipeline::encode_frame(a.items, next.data(), d.last_sent.get(),
                                               slot.frame.data + digests);
      base_is_next = true;
      if (!encoded_nearly_whole(d, a, n)) {
        h.delta = true;
        h.base = d.last_step;
        h.has_digest = delta_verify_;
        d.whole_tries = 0;
        pipeline::store_frame_header(slot.frame.data, h);
        for (size_t r = 0; digests > 0 && r < a.reads.size(); ++r)
          store_le64(slot.frame.data + pipeline::kFrameHeaderBytes + 8 * r,
                     pipeline::reads_digest(a.reads[r], packed, step));
        const int64_t bytes = with_trailer(slot.frame.data, digests + n, step);
        ++delta_buckets_;
        delta_bytes_whole_ += static_cast<uint64_t>(a.bytes);
        d.last_step = step;
        slot.bytes = bytes;
        phases.pack += seconds_since(start);
        send_all(slot.frame.buffer(0, static_cast<size_t>(bytes)));
        return bytes;
      }
    }
    back_off(d);
  }
  // The whole bytes.
  if (base_takes_whole(d, step, base_is_next)) keep_base(a, packed);
  phases.pack += seconds_since(start);
  // The header alone, then the bucket as without delta.
  h.fragments = true;
  pipeline::store_frame_header(slot.frame.data, h);
  send_all(slot.frame.buffer(
      0, static_cast<size_t>(with_trailer(slot.frame.data, pipeline::kFrameHeaderBytes, step))));
  if (wire_.checksums)
    store_trailer(
        slot.buffer.data + a.bytes,
        checksum64(slot.buffer.data, static_cast<size_t>(a.bytes), static_cast<uint64_t>(step)));
  slot.bytes = a.bytes;
  send_all(slot.buffer.buffer(0, static_cast<size_t>(a.bytes) + kBucketTrailerBytes));
  return pipeline::kFrameHeaderBytes + a.bytes;
}

void SendPipeline::drain(Slot& slot, std::vector<bool>& dead) {
  pipeline::DrainHooks hooks;
  hooks.dropped = [&](int g) { return dead[static_cast<size_t>(g)]; };
  // An engine whose transfer fails (died, unreachable, endpoint timeout) is
  // dropped: the coordinator fails it, the others go on. A failure towards a
  // trainer (a gather part) fails the step.
  hooks.failed = [&](int g, const Error&) {
    if (g < 0) throw;
    dead[static_cast<size_t>(g)] = true;
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
  bytes_direct_ = 0;
  buckets_lent_ = 0;
  delta_buckets_ = delta_bytes_whole_ = 0;
  ++runs_;
  if (lending_) begin_loans(step, transport, dead);
  auto lent = [&](const SendAction& a) {
    return a.lendable && std::any_of(loans_.begin(), loans_.end(), [&](const Loan& l) {
             return l.lent && l.engine == a.dst_engine;
           });
  };
  size_t k = 0;
  for (size_t i = 0; i < actions_.size(); ++i) {
    const SendAction& a = actions_[i];
    const bool p2p = a.kind == SendAction::Kind::p2p;
    if (p2p && dead[static_cast<size_t>(a.dst_engine)]) continue;
    const bool lend = p2p && lent(a);
    // A lent copy's message goes before this rank may wait on an engine.
    if (!lend) settle_lent(step, dead);
    const int s = static_cast<int>(k++ % slots_.size());
    const auto wire_start = Clock::now();
    drain(slots_[s], dead);
    phases.wire += seconds_since(wire_start);
    // The drain may have learned of the engine's death.
    if (p2p && dead[static_cast<size_t>(a.dst_engine)]) continue;
    try {
      if (lend) {
        post_lent(i, s, step, dead, phases);
        sent += static_cast<uint64_t>(a.bytes);
        continue;
      }
      if (p2p && wire_.delta) {
        sent += static_cast<uint64_t>(post_frame(i, s, step, dead, phases));
        continue;
      }
      sent += static_cast<uint64_t>(post(i, s, step, dead, phases));
    } catch (const Error&) {
      // A send to an engine refused at posting (known dead, endpoint timeout,
      // unreachable) drops that engine, as a failed transfer does in drain().
      if (!p2p) throw;
      dead[static_cast<size_t>(a.dst_engine)] = true;
      continue;
    }
  }
  settle_lent(step, dead);
  const auto wire_start = Clock::now();
  for (Slot& slot : slots_) drain(slot, dead);
  phases.wire += seconds_since(wire_start);
  loop_ = nullptr;
  return sent;
}

void SendPipeline::cancel_all() {
  launched_.reset();  // its copy wrote into the engine's params; the step is abandoned
  for (Loan& l : loans_) l.map.reset();
  for (Slot& slot : slots_) slot.posted.cancel_all();
}

void SendPipeline::begin_loans(int64_t step, Transport& t, std::vector<bool>& dead) {
  // The loans are used only where this rank's copies can write the lent
  // memory: its tensors are in the transport's memory.
  const pipeline::RankMemory& memory = copier_.memory();
  const bool usable = memory.any && memory.memory == lend_memory_;
  for (Loan& l : loans_) {
    l.lent = false;
    l.map.reset();
    if (dead[static_cast<size_t>(l.engine)]) continue;
    const bool take = usable && l.targets.size() == l.params.size();
    try {
      l.map =
          t.map_exposed(trainer_world_ + l.engine, lend_tag(step), take ? &l.addresses : nullptr);
    } catch (const Error&) {
      dead[static_cast<size_t>(l.engine)] = true;  // refused at posting, as a send would be
    }
  }
  bool changed = false;
  for (Loan& l : loans_) {
    if (!l.map) continue;
    const std::optional<Error> failure = loop_->settle(*l.map, [&] {
      return cat("the loan of engine rank ", l.engine, " (", l.map->describe(), ")");
    });
    l.map.reset();
    if (failure) {
      // Gone: dropped as a failed send drops it. Not mapped (an import
      // failed): the engine rank learned it too, and takes fragments.
      if (failure->code() == Errc::peer_failure) dead[static_cast<size_t>(l.engine)] = true;
      continue;
    }
    // Declined (no addresses asked for) or lent nothing: fragments.
    if (l.addresses.empty()) continue;
    if (l.addresses.size() != l.params.size())
      fail(Errc::mismatch, "trainer rank ", rank_, ": step ", step, ": engine rank ", l.engine,
           " lent ", l.addresses.size(), " params, where the plan has ", l.params.size(),
           " (do both sides use the same plan?)");
    l.lent = true;
    if (l.addresses != l.compiled_for) {
      compile_loan(l);
      changed = true;
    }
  }
  if (!changed) return;
  std::vector<const CopyProgram*> programs;
  for (const SendAction& a : actions_) programs.push_back(&a.lent);
  lent_copier_.prepare(programs, memory, 2);
}

void SendPipeline::compile_loan(Loan& l) {
  for (size_t i = 0; i < l.params.size(); ++i) l.targets[i].data = l.addresses[i];
  for (SendAction& a : actions_) {
    if (!a.lendable || a.dst_engine != l.engine) continue;
    a.lent = CopyProgram();
    for (const Copy& c : a.lend_items) {
      const auto at = std::lower_bound(l.params.begin(), l.params.end(), c.dst_param);
      pipeline::add_pack_apply(a.lent, c, tensors_.at(static_cast<size_t>(c.src_param)),
                               l.targets[static_cast<size_t>(at - l.params.begin())]);
    }
  }
  l.compiled_for = l.addresses;
}

void SendPipeline::post_lent(size_t index, int k, int64_t step, std::vector<bool>& dead,
                             PushPhases& phases) {
  const SendAction& a = actions_[index];
  const auto start = Clock::now();
  lent_event_ ^= 1;
  lent_copier_.run(index, a.lent, 0, 0, lent_event_);
  Slot& slot = slots_[k];
  slot.bucket = a.bucket;
  slot.bytes = a.bytes;
  slot.posted_us = tracer_ ? trace_now_us() : 0;
  phases.pack += seconds_since(start);
  // The copy before it ran meanwhile; its message goes now.
  settle_lent(step, dead);
  launched_ = Launched{index, k, lent_event_};
}

void SendPipeline::settle_lent(int64_t step, std::vector<bool>& dead) {
  if (!launched_) return;
  const Launched l = *launched_;
  launched_.reset();
  const SendAction& a = actions_[l.index];
  lent_copier_.wait(l.event, *loop_, "writing a bucket into lent params");
  if (tracer_)
    tracer_->complete(cat("lend ", a.bucket), "pack", slots_[l.slot].posted_us, trace_now_us(),
                      {{"bucket", a.bucket}, {"bytes", a.bytes}, {"engine", a.dst_engine}});
  // Zero bytes: the bucket is in the params already.
  try {
    slots_[l.slot].posted.add(
        loop_->transport().send(trainer_world_ + a.dst_engine, bucket_tag(step, a.bucket, 0),
                                Buffer{nullptr, 0, lend_memory_, copier_.memory().device, nullptr}),
        a.dst_engine);
  } catch (const Error&) {
    dead[static_cast<size_t>(a.dst_engine)] = true;  // refused at posting, as in run()
    return;
  }
  bytes_direct_ += static_cast<uint64_t>(a.bytes);
  ++buckets_lent_;
}

}  // namespace weightsync::trainer
