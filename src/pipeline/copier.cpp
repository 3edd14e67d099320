#include "pipeline/copier.h"

#include <weightsync/error.h>

#include "transport/staging.h"

namespace weightsync::pipeline {

void Copier::prepare(const std::vector<const CopyProgram*>& programs, const RankMemory& memory,
                     int slots) {
  memory_ = memory;
  gpu_ = memory.any && memory.memory == MemoryKind::cuda;
  if (!gpu_) return;
  use_device(memory);
  stream_ = gpu::Stream(memory.device);
  events_.clear();
  for (int s = 0; s < slots; ++s) events_.emplace_back(memory.device);
  programs_ = gpu::DevicePrograms(programs, memory.device);
}

void Copier::run(std::size_t index, const CopyProgram& program, std::uintptr_t src_base,
                 std::uintptr_t dst_base, int slot, std::size_t first, std::size_t count) {
  if (!gpu_) return execute_host(program, src_base, dst_base, first, count);
  run_with_quant(index, src_base, dst_base, slot, gpu::DeviceQuant(), 0);
}

void Copier::run_with_quant(std::size_t index, std::uintptr_t src_base, std::uintptr_t dst_base,
                            int slot, const gpu::DeviceQuant& quant, std::uintptr_t q_dst_base) {
  // User code between launches (an on_weights hook, the training loop) may
  // have made another device current; this stream lives on the rank's.
  gpu::set_device(memory_.device);
  programs_.launch_with_quant(index, stream_, src_base, dst_base, quant, 0, q_dst_base);
  events_.at(static_cast<std::size_t>(slot)).record(stream_);
}

bool Copier::done(int slot) const {
  return !gpu_ || events_.at(static_cast<std::size_t>(slot)).ready();
}

void Copier::wait(int slot, Loop& loop, const char* what) {
  if (!gpu_) return;
  loop.until([&] { return done(slot); },
             [&] { return cat(what, " on GPU ", memory_.device, " (slot ", slot, ")"); }, true);
}

void Copier::wait_all(Loop& loop, const char* what) {
  for (int s = 0; s < static_cast<int>(events_.size()); ++s) wait(s, loop, what);
}

void Copier::finish() {
  if (gpu_) stream_.synchronize();
}

void Copier::wait_for_producer(void* cuda_stream, void* cuda_event) const {
  if (!gpu_) return;
  if (cuda_event)
    gpu::synchronize_event(cuda_event);
  else if (cuda_stream)
    gpu::synchronize_stream(cuda_stream);
  else
    gpu::synchronize_device(memory_.device);
}

}  // namespace weightsync::pipeline
