#include "delta_receiver.h"

#include <weightsync/checksum.h>

#include "pipeline/item_copies.h"

#include <algorithm>
#include <cstring>

namespace weightsync::engine {
namespace {

using pipeline::addr;
using pipeline::kFrameHeaderBytes;

// The reverse of a copy run: from where it writes to where it reads.
CopyRun reversed(const CopyRun& r) {
  CopyRun out = r;
  std::swap(out.src, out.dst);
  for (int d = 0; d < kCopyOuterDims; ++d) std::swap(out.src_stride[d], out.dst_stride[d]);
  return out;
}

}  // namespace

DeltaReceiver::DeltaReceiver(const Plan& plan, int global_rank, const pipeline::RankMemory& memory,
                             const WireOptions& wire, pipeline::Copier& copier)
    : global_rank_(global_rank),
      broadcast_(plan.mode() == PlanMode::broadcast),
      engine_template_(plan.engine_template(global_rank)),
      engine_templates_(plan.engine_templates()),
      checksums_(wire.checksums),
      memory_(memory),
      copier_(copier) {}

void DeltaReceiver::compile_p2p(RecvAction& a, const Plan& plan,
                                const std::vector<TensorView>& targets) {
  for (const PlanItem& item : plan.items(a.bucket)) {
    const Copy c = plan.resolve(item);
    const TensorView& target = targets.at(static_cast<size_t>(c.dst_param));
    check_item_rank(c, global_rank_);
    // Host params are patched by the CPU, CUDA ones by the patch kernel.
    char* in_place =
        !c.fp8 && pipeline::packed_as_dst_box(c) ? pipeline::dense_run(target, c.dst_box) : nullptr;
    a.in_place.push_back(in_place);
    a.item_params.push_back({static_cast<uint32_t>(c.dst_param)});
    if (c.fp8) a.item_params.back().push_back(static_cast<uint32_t>(c.scale_param));
    a.params.insert(a.params.end(), a.item_params.back().begin(), a.item_params.back().end());
    if (in_place) continue;
    if (c.fp8)
      pipeline::add_apply_fp8(a.frame_apply, c, target,
                              targets.at(static_cast<size_t>(c.scale_param)), 0);
    else
      pipeline::add_apply(a.frame_apply, c, target, 0);
  }
  for (const CopyRun& r : a.frame_apply.runs()) a.gather.add_run(reversed(r));
  a.items = pipeline::frame_items(plan, a.bucket);
  a.frame_bytes = pipeline::frame_capacity(a.items, a.bytes);
}

void DeltaReceiver::compile_broadcast(RecvAction& a, const Plan& plan,
                                      const std::vector<std::pair<int64_t, uint32_t>>& writes) {
  if (memory_.memory == MemoryKind::cuda) refuse_cuda_broadcast();
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
}

void DeltaReceiver::refuse_cuda_broadcast() const {
  fail(Errc::unsupported, "engine rank ", global_rank_, ": delta sync (the trainers' ",
       "delta=auto) in broadcast mode applies on the host so far, and this rank's params are on ",
       pipeline::memory_str(memory_.memory, memory_.device),
       "; use plan mode p2p, or run the trainers without delta (docs/delta.md)");
}

void DeltaReceiver::check(bool broadcast, bool native_broadcast, SlotMemory slots) const {
  if (broadcast && native_broadcast)
    fail(Errc::unsupported, "engine rank ", global_rank_, ": delta sync in broadcast mode ",
         "takes frames whose size changes from step to step, which this transport's native ",
         "broadcast cannot carry; use plan mode p2p, a transport without a native broadcast ",
         "(ucx, tcp), or no delta (docs/delta.md)");
  // The CPU reads a frame's header and checks its encodings where it lands.
  if (on_device() && slots == SlotMemory::device)
    fail(Errc::unsupported, "engine rank ", global_rank_, ": delta sync needs its frames in host ",
         "memory, but this rank's slots are in device memory (its params are on ",
         pipeline::memory_str(memory_.memory, memory_.device), " and the transport reaches ",
         "device memory); run without delta, or over a transport to host memory (ucx)");
}

void DeltaReceiver::prepare(int64_t most) {
  if (on_device()) {
    device_scratch_ =
        gpu::Memory(static_cast<size_t>(most), gpu::MemoryPlace::device, memory_.device);
    patcher_ = gpu::DeltaPatcher(memory_.device);
  } else {
    scratch_.reset(new char[static_cast<size_t>(most)]);
  }
}

std::string DeltaReceiver::what(const RecvAction& a, int64_t step) const {
  return cat("engine rank ", global_rank_, ": bucket ", a.bucket, " of step ", step,
             " from trainer rank ", a.src);
}

bool DeltaReceiver::header_only(const RecvAction& a, const char* frame, int64_t received,
                                int64_t step, std::string& error) const {
  // A delta frame holds a table entry per item and a whole frame the
  // bucket's bytes, so a message of exactly a header is one. A damaged one
  // rejects the step, but its fragments are received all the same, so that
  // the trainer does not stall.
  const int64_t trailer = checksums_ ? static_cast<int64_t>(kBucketTrailerBytes) : 0;
  if (received != kFrameHeaderBytes + trailer || !error.empty()) return false;
  const std::string w = what(a, step);
  try {
    if (trailer) {
      const uint64_t sum =
          checksum64(frame, static_cast<size_t>(kFrameHeaderBytes), static_cast<uint64_t>(step));
      if (sum != read_trailer(frame + kFrameHeaderBytes))
        fail(Errc::format, w, ": its header failed its checksum (computed ", std::hex, sum,
             ", sent ", read_trailer(frame + kFrameHeaderBytes), std::dec, ")");
    }
    const pipeline::FrameHeader h = pipeline::read_frame_header(frame, kFrameHeaderBytes, w);
    // An intact header of a delta (or whole) frame that came this short:
    // a frame cut short, which open() rejects; no fragments follow.
    if (!h.fragments) return false;
    if (h.step != step) fail(Errc::format, w, ": the frame says step ", h.step);
    // Every byte of it is checked: a whole bucket names no base and no digest.
    if (h.base != -1 || h.has_digest || h.digest != 0)
      fail(Errc::format, w, ": a whole bucket's header that names base ", h.base, " and digest ",
           std::hex, h.digest, std::dec);
  } catch (const Error& e) {
    if (e.code() != Errc::format) throw;
    error = e.what();
  }
  return true;
}

const char* DeltaReceiver::open(const RecvAction& a, size_t gather, int slot, const char* frame,
                                int64_t bytes, int64_t step, ReceiveReport& report,
                                std::vector<bool>& changed) {
  const std::string w = what(a, step);
  bytes = verify(frame, bytes, step, w, report);
  const pipeline::FrameHeader h = pipeline::read_frame_header(frame, bytes, w);
  if (h.step != step) fail(Errc::format, w, ": the frame says step ", h.step);
  if (!h.delta) {
    place_whole(a, frame + kFrameHeaderBytes, bytes, w);
    for (uint32_t p : a.params) changed[p] = true;
    return frame + kFrameHeaderBytes;
  }
  if (h.base != version_)
    fail(Errc::mismatch, w, ": a delta against version ", h.base,
         ", but this engine rank holds version ", version_);
  const char* packed = patch(a, gather, slot, frame, bytes, h, step, w);
  ++report.delta_buckets;
  for (size_t i = 0; i < a.items.size(); ++i)
    if (items_changed_[i])
      for (uint32_t p : a.item_params[i]) changed[p] = true;
  return packed;
}

int64_t DeltaReceiver::verify(const char* frame, int64_t bytes, int64_t step,
                              const std::string& what, ReceiveReport& report) const {
  if (!checksums_) return bytes;
  if (bytes < static_cast<int64_t>(kBucketTrailerBytes))
    fail(Errc::format, what, ": ", bytes, " bytes, too short for its checksum");
  bytes -= static_cast<int64_t>(kBucketTrailerBytes);
  const uint64_t sum = checksum64(frame, static_cast<size_t>(bytes), static_cast<uint64_t>(step));
  if (sum != read_trailer(frame + bytes))
    fail(Errc::format, what, " failed its checksum (computed ", std::hex, sum, ", sent ",
         read_trailer(frame + bytes), std::dec, ")");
  report.checksum = checksum_fold(report.checksum, sum);
  return bytes;
}

void DeltaReceiver::place_whole(const RecvAction& a, const char* packed, int64_t bytes,
                                const std::string& what) {
  if (bytes != kFrameHeaderBytes + a.bytes)
    fail(Errc::format, what, ": a whole bucket of ", bytes - kFrameHeaderBytes, " bytes, expected ",
         a.bytes, " (does the sender use the same plan?)");
  for (size_t i = 0; i < a.items.size(); ++i) {
    if (!a.in_place[i]) continue;
    const auto n = static_cast<size_t>(a.items[i].bytes);
    if (copier_.on_gpu())  // before the apply's event on the same stream
      gpu::copy_async(a.in_place[i], packed + a.items[i].offset, n, copier_.stream());
    else
      std::memcpy(a.in_place[i], packed + a.items[i].offset, n);
  }
}

const char* DeltaReceiver::patch(const RecvAction& a, size_t gather, int slot, const char* frame,
                                 int64_t bytes, const pipeline::FrameHeader& h, int64_t step,
                                 const std::string& what) {
  // The items in place are patched there; the others are gathered as the
  // targets hold them, patched, and applied once the digest of the result
  // (every item) checked out.
  uint64_t digest = 0, sent = h.digest;
  const char* packed = nullptr;
  if (copier_.on_gpu()) {
    // Patched and hashed on the device (p2p: broadcast is refused at setup).
    digest = patch_on_device(a, gather, slot, frame, bytes, step, h.has_digest, what);
    packed = device_scratch_.data();
  } else {
    digest = patch_on_host(a, frame, bytes, h, step, what, sent);
    packed = scratch_.get();
  }
  if (h.has_digest && digest != sent)
    fail(Errc::mismatch, what, ": after its delta the bucket hashes to ", std::hex, digest,
         ", the trainer's bytes to ", sent, std::dec,
         " (this rank's params are not the version the delta applies to, or the delta ",
         "was damaged)");
  return packed;
}

uint64_t DeltaReceiver::patch_on_host(const RecvAction& a, const char* frame, int64_t bytes,
                                      const pipeline::FrameHeader& h, int64_t step,
                                      const std::string& what, uint64_t& sent) {
  targets_.resize(a.items.size());
  for (size_t i = 0; i < a.items.size(); ++i)
    targets_[i] = a.in_place[i] ? a.in_place[i] : scratch_.get() + a.items[i].offset;
  execute_host(a.gather, 0, addr(scratch_.get()));
  uint64_t digest = 0;
  if (!broadcast_) {
    pipeline::apply_frame(a.items, frame, bytes, targets_.data(), what, step,
                          h.has_digest ? &digest : nullptr, &items_changed_);
    return digest;
  }
  // Every rank gets the whole bucket's delta but holds, and checks, only
  // what its template reads: the rest of scratch is left over.
  const int64_t digests = h.has_digest ? 8 * int64_t{engine_templates_} : 0;
  if (bytes < kFrameHeaderBytes + digests)
    fail(Errc::format, what, ": a delta frame of ", bytes, " bytes cannot hold the digests of its ",
         engine_templates_, " engine templates");
  if (h.has_digest) sent = read_le64(frame + kFrameHeaderBytes + 8 * engine_template_);
  pipeline::apply_frame(a.items, frame + digests, bytes - digests, targets_.data(), what, 0,
                        nullptr, &items_changed_);
  if (h.has_digest) digest = pipeline::reads_digest(a.reads, scratch_.get(), step);
  return digest;
}

uint64_t DeltaReceiver::patch_on_device(const RecvAction& a, size_t gather, int slot,
                                        const char* frame, int64_t bytes, int64_t step, bool digest,
                                        const std::string& what) {
  // Checked before anything is queued: a malformed frame changes nothing.
  target_addrs_.resize(a.items.size());
  for (size_t i = 0; i < a.items.size(); ++i)
    target_addrs_[i] = static_cast<int64_t>(
        addr(a.in_place[i] ? a.in_place[i] : device_scratch_.data() + a.items[i].offset));
  pipeline::frame_tables(a.items, frame, bytes, target_addrs_.data(), what, step, digest, tables_,
                         &items_changed_);
  // The packed bucket as the targets hold it, then the patch and the
  // digest, in order on the copier's stream.
  copier_.run(gather, a.gather, 0, addr(device_scratch_.data()), pipeline::slot_event(slot));
  patcher_.run(copier_.stream(), frame, static_cast<size_t>(bytes), tables_.patch, tables_.hash, 0);
  return digest ? patcher_.digest(copier_.stream()) : 0;
}

}  // namespace weightsync::engine
