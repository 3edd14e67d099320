#include "delta_sender.h"

#include <weightsync/checksum.h>

#include "pipeline/item_copies.h"
#include "pipeline/loop.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace weightsync::trainer {
namespace {

using pipeline::addr;
using pipeline::kFrameHeaderBytes;

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

// Whether this step tries a delta: its receivers must hold the base, and a
// bucket whose last delta came out nearly whole goes whole for a few steps
// without trying (most of its elements change every step), then tries again.
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
  const int64_t encoded = frame_bytes - kFrameHeaderBytes;
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
// item's Copy appended): buckets with equal keys pack equal bytes (twins,
// DeltaBase).
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

}  // namespace

void DeltaSender::compile_p2p(SendAction& a, const Plan& plan,
                              const std::vector<TensorView>& tensors) {
  // One frame a bucket, its items packed behind the frame's header; those
  // that lie in place are diffed from there.
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
      add_quant(a.quant, c, tensor, -kFrameHeaderBytes);
    else
      pipeline::add_pack(in_place ? a.pack_in_place : a.pack, c, tensor, -kFrameHeaderBytes);
  }
  a.items = pipeline::frame_items(plan, a.bucket);
  // Twins share a base: one per bucket that packs other bytes.
  auto [twin, added] = twins_.try_emplace(std::move(key), bases_.size());
  if (added) bases_.emplace_back();
  a.delta_base = static_cast<int>(twin->second);
  bases_[twin->second].engines.push_back(a.dst_engine);
  frame_bytes_ =
      std::max(frame_bytes_, static_cast<size_t>(pipeline::frame_capacity(a.items, a.bytes)) +
                                 kBucketTrailerBytes);
}

void DeltaSender::compile_root(SendAction& a, const Plan& plan) {
  // The delta of the whole bucket, which the root holds once gathered, with
  // a digest for each engine template's part.
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

void DeltaSender::begin_run() {
  ++runs_;
  delta_buckets_ = delta_bytes_whole_ = 0;
}

uint64_t DeltaSender::base_bytes() const {
  uint64_t bytes = 0;
  for (const DeltaBase& d : bases_)
    if (d.last_sent) bytes += static_cast<uint64_t>(d.bytes);
  return bytes;
}

void DeltaSender::count_delta(const SendAction& a) {
  ++delta_buckets_;
  delta_bytes_whole_ += static_cast<uint64_t>(a.bytes);
}

P2pFrame DeltaSender::p2p_frame(const SendAction& a, int64_t step, const std::vector<bool>& dead,
                                const char* body, char* frame, const std::function<void()>& pack,
                                PushPhases& phases) {
  DeltaBase& d = bases_[static_cast<size_t>(a.delta_base)];
  if (d.decided == runs_) return next_twin(a, d, frame);
  return first_twin(a, d, step, dead, body, frame, pack, phases);
}

P2pFrame DeltaSender::first_twin(const SendAction& a, DeltaBase& d, int64_t step,
                                 const std::vector<bool>& dead, const char* body, char* frame,
                                 const std::function<void()>& pack, PushPhases& phases) {
  // A delta when one of the twins' engine ranks holds the base; those that
  // do not get the whole bytes.
  d.decided = runs_;
  d.delta = false;
  d.left = static_cast<int>(d.engines.size()) - 1;
  std::vector<char>().swap(d.frame);  // a twin's engine died before it took the last one
  const bool held = d.last_sent && d.last_step >= 0 &&
                    std::any_of(d.engines.begin(), d.engines.end(), [&](int g) {
                      return !dead[static_cast<size_t>(g)] && holds(g, d.last_step);
                    });
  P2pFrame out;
  bool base_is_next = false;  // the encoder brought the base up to this step
  if (try_delta(d, held)) {
    pack();
    const auto encode_start = std::chrono::steady_clock::now();  // counted as packing
    const int64_t bytes = encode_p2p(a, d, step, body, frame, base_is_next);
    phases.pack += pipeline::seconds_since(encode_start);
    if (bytes > 0 && holds(a.dst_engine, d.frame_base)) {
      count_delta(a);
      out.delta = true;
      out.bytes = bytes;
      return out;
    }
    if (!d.delta) back_off(d);
  }
  if (!d.delta) out.take = base_takes_whole(d, step, base_is_next);
  return out;
}

int64_t DeltaSender::encode_p2p(const SendAction& a, DeltaBase& d, int64_t step, const char* body,
                                char* frame, bool& base_is_next) {
  // Each item's new bytes: in place, or packed in the slot.
  next_.resize(a.items.size());
  for (size_t i = 0; i < a.items.size(); ++i)
    next_[i] = a.in_place[i] ? a.in_place[i] : body + a.items[i].offset;
  // A delta that would come out nearly whole goes whole instead: straight
  // from the tensors into the params, without a copy.
  if (looks_nearly_whole(d, a, next_.data())) return 0;
  uint64_t digest = 0;
  const int64_t n = pipeline::encode_frame(a.items, next_.data(), d.last_sent.get(), frame, nullptr,
                                           step, verify_ ? &digest : nullptr);
  base_is_next = true;
  if (encoded_nearly_whole(d, a, n)) return 0;
  pipeline::FrameHeader h;
  h.step = step;
  h.delta = true;
  h.base = d.last_step;
  h.has_digest = verify_;
  h.digest = digest;
  pipeline::store_frame_header(frame, h);
  const int64_t bytes = with_trailer(frame, n, step);
  d.delta = true;
  d.whole_tries = 0;
  d.frame_base = d.last_step;
  d.last_step = step;
  if (d.left > 0) d.frame.assign(frame, frame + bytes);
  return bytes;
}

P2pFrame DeltaSender::next_twin(const SendAction& a, DeltaBase& d, char* frame) {
  --d.left;
  // A twin encoded this step's delta: the same frame goes here.
  const bool same_frame = d.delta && holds(a.dst_engine, d.frame_base);
  P2pFrame out;
  if (same_frame) {
    std::memcpy(frame, d.frame.data(), d.frame.size());
    count_delta(a);
    out.delta = true;
    out.bytes = static_cast<int64_t>(d.frame.size());
  }
  if (d.left <= 0) std::vector<char>().swap(d.frame);  // the last twin took it
  return out;
}

int64_t DeltaSender::root_frame(const SendAction& a, int64_t step, const std::vector<bool>& dead,
                                const char* packed, char* frame) {
  DeltaBase& d = bases_[static_cast<size_t>(a.delta_base)];
  // Every engine rank gets the one frame: a delta only when each of them
  // (the ranks this step serves) holds the version of the base.
  bool base_held = d.last_sent && d.last_step >= 0;
  for (int g = 0; g < engine_world_ && base_held; ++g)
    if (!dead[static_cast<size_t>(g)] && !holds(g, d.last_step)) base_held = false;
  bool base_is_next = false;
  if (try_delta(d, base_held)) {
    const int64_t bytes = encode_root(a, d, step, packed, frame, base_is_next);
    if (bytes > 0) {
      count_delta(a);
      return bytes;
    }
    back_off(d);
  }
  if (base_takes_whole(d, step, base_is_next)) keep_base(a, packed);
  return 0;
}

int64_t DeltaSender::encode_root(const SendAction& a, DeltaBase& d, int64_t step,
                                 const char* packed, char* frame, bool& base_is_next) {
  next_.resize(a.items.size());
  for (size_t i = 0; i < a.items.size(); ++i) next_[i] = packed + a.items[i].offset;
  if (looks_nearly_whole(d, a, next_.data())) return 0;
  const int64_t digests = verify_ ? 8 * static_cast<int64_t>(a.reads.size()) : 0;
  const int64_t n =
      pipeline::encode_frame(a.items, next_.data(), d.last_sent.get(), frame + digests);
  base_is_next = true;
  if (encoded_nearly_whole(d, a, n)) return 0;
  pipeline::FrameHeader h;
  h.step = step;
  h.delta = true;
  h.base = d.last_step;
  h.has_digest = verify_;
  d.whole_tries = 0;
  pipeline::store_frame_header(frame, h);
  for (size_t r = 0; digests > 0 && r < a.reads.size(); ++r)
    store_le64(frame + kFrameHeaderBytes + 8 * r, pipeline::reads_digest(a.reads[r], packed, step));
  d.last_step = step;
  return with_trailer(frame, digests + n, step);
}

void DeltaSender::keep_base(const SendAction& a, const char* packed) {
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
  const std::uintptr_t base = addr(d.last_sent.get()) - kFrameHeaderBytes;
  if (!a.quant.empty()) fp8::execute_quant_host(a.quant, 0, base);
  execute_host(a.pack, 0, base);
  execute_host(a.pack_in_place, 0, base);
}

int64_t DeltaSender::with_trailer(char* at, int64_t bytes, int64_t step) const {
  if (!checksums_) return bytes;
  store_trailer(at + bytes,
                checksum64(at, static_cast<size_t>(bytes), static_cast<uint64_t>(step)));
  return bytes + static_cast<int64_t>(kBucketTrailerBytes);
}

}  // namespace weightsync::trainer
