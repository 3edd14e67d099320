// The bucket checksum on the sending side (pipeline/wire.h): summed inside
// the pack's copies (core/copy_program.h execute_host_sum), so that it
// costs no pass over the packed bytes; a read of its own only for bytes
// that no copy of this rank touches (zero-copy fragments, quantized items,
// a CUDA pack into pinned slots).
#include "publisher_pipeline.h"

#include "pipeline/item_copies.h"
#include "pipeline/wire.h"

namespace weightsync::trainer {

bool SendPipeline::host_readable(const SendAction& a) const {
  for (const FragmentRoute& f : a.fragments) {
    if (f.direct ? f.memory != MemoryKind::host : slot_memory_ == SlotMemory::device) return false;
  }
  return true;
}

WireSum SendPipeline::pack_fragment(const CopyProgram& program, char* slot, const FragmentRoute& f,
                                    bool summed) {
  const std::uintptr_t base = pipeline::addr(slot);
  if (!copier_.on_gpu()) {
    if (summed && f.fused)
      return execute_host_sum(program, 0, base, PackedSide::dst, f.slot_offset - f.offset,
                              f.first_op, f.num_ops);
    execute_host(program, 0, base, f.first_op, f.num_ops);
  }
  if (!summed) return {};
  return wire_sum(slot + f.slot_offset, static_cast<size_t>(f.bytes),
                  static_cast<uint64_t>(f.offset));
}

uint64_t SendPipeline::slot_checksum(const Slot& slot, int64_t bytes, int64_t step) const {
  if (slot_memory_ == SlotMemory::device) return 0;
  return bucket_checksum(wire_sum(slot.buffer.data, static_cast<size_t>(bytes), 0), bytes, step);
}

}  // namespace weightsync::trainer
