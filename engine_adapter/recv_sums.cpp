// The bucket checksum on the receiving side (pipeline/wire.h): summed
// inside the apply's copies (core/copy_program.h execute_host_sum), which
// read every packed byte anyway; a read of its own only for bytes that no
// copy of this rank touches (zero-copy fragments, a packed box applied in
// part) and for CUDA params, whose apply runs on the GPU.
#include "subscriber_pipeline.h"

#include "pipeline/item_copies.h"
#include "pipeline/wire.h"

namespace weightsync::engine {
namespace {

using Clock = std::chrono::steady_clock;
using pipeline::addr;
using pipeline::seconds_since;
using pipeline::slot_event;

}  // namespace

void ReceivePipeline::fuse_fragments(RecvAction& a, const std::vector<uint32_t>& first_run,
                                     const std::vector<bool>& whole) {
  for (FragmentRoute& f : a.fragments) {
    if (f.direct) continue;
    bool reads_all = true;
    for (uint32_t op = f.first_op; op < f.first_op + f.num_ops; ++op)
      reads_all = reads_all && whole[op];
    const uint32_t begin = first_run[f.first_op], end = first_run[f.first_op + f.num_ops];
    f.first_op = begin;
    f.num_ops = end - begin;
    f.fused = reads_all && runs_bytes(a.apply, begin, end - begin) == f.bytes;
  }
}

bool ReceivePipeline::host_readable(const RecvAction& a) const {
  if (broadcast_) return slot_memory_ != SlotMemory::device;
  for (const FragmentRoute& f : a.fragments)
    if (f.direct ? f.memory != MemoryKind::host : slot_memory_ == SlotMemory::device) return false;
  return true;
}

uint64_t ReceivePipeline::read_checksum(const RecvAction& a, const char* data, int64_t step) const {
  if (broadcast_)
    return bucket_checksum(wire_sum(data, static_cast<size_t>(a.bytes), 0), a.bytes, step);
  WireSum sums;
  int64_t total = 0;
  for (const FragmentRoute& f : a.fragments) {
    sums += wire_sum(f.direct ? f.direct : data + f.slot_offset, static_cast<size_t>(f.bytes),
                     static_cast<uint64_t>(f.offset));
    total += f.bytes;
  }
  return bucket_checksum(sums, total, step);
}

std::pair<uint64_t, uint64_t> ReceivePipeline::apply_bucket(size_t k, int s, int64_t step,
                                                            pipeline::Loop& loop,
                                                            StepPhases& phases) {
  const RecvAction& a = actions_[k];
  char* data = slots_[static_cast<size_t>(s)].buffer.data;
  const uint64_t sent =
      wire_.checksums ? read_trailer(data + (broadcast_ ? a.bytes : a.slot_bytes)) : 0;
  const bool check = sent != 0 && host_readable(a);
  auto t = Clock::now();
  if (check && !broadcast_ && !copier_.on_gpu()) {
    WireSum sums;
    int64_t total = 0;
    for (const FragmentRoute& f : a.fragments) {
      total += f.bytes;
      if (f.direct) {
        sums += wire_sum(f.direct, static_cast<size_t>(f.bytes), static_cast<uint64_t>(f.offset));
      } else if (f.fused) {
        sums += execute_host_sum(a.apply, addr(data), 0, PackedSide::src, f.slot_offset - f.offset,
                                 f.first_op, f.num_ops);
      } else {
        sums += wire_sum(data + f.slot_offset, static_cast<size_t>(f.bytes),
                         static_cast<uint64_t>(f.offset));
        execute_host(a.apply, addr(data), 0, f.first_op, f.num_ops);
      }
    }
    phases.apply += seconds_since(t);
    return {bucket_checksum(sums, total, step), sent};
  }
  // Checked (where it is) before it is applied: a bad bucket is not.
  const uint64_t sum = check ? read_checksum(a, data, step) : sent;
  phases.verify += seconds_since(t);
  if (sum != sent) return {sum, sent};
  t = Clock::now();
  if (!a.apply.empty()) copier_.run(k, a.apply, addr(data), 0, slot_event(s));
  copier_.wait(slot_event(s), loop, "applying bucket");
  phases.apply += seconds_since(t);
  return {sum, sent};
}

}  // namespace weightsync::engine
