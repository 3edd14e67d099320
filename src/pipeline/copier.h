// Runs a pipeline's copy programs (core/copy_program.h) where its tensors
// are: plain loops on the host for host tensors; for CUDA tensors one kernel
// launch per program on the pipeline's own non-blocking stream, with an event
// per staging slot saying when that slot's copies finished (a send is posted
// only after its pack completed, a slot is reused and a step acked only after
// its applies completed on the device).
#pragma once

#include "core/copy_program.h"
#include "core/cuda/gpu.h"
#include "pipeline/loop.h"
#include "pipeline/setup.h"
#include "transport/staging.h"

#include <cstdint>
#include <vector>

namespace weightsync::pipeline {

// The copier event a pipeline's staging slot `slot` uses: one per slot
// parity. Each pack or apply is waited for before the next starts, so two
// events serve any number of slots.
inline int slot_event(int slot) {
  return slot % 2;
}

class Copier {
 public:
  // Uploads `programs` (kept by the caller, indexed as run() indexes them) to
  // the rank's device for CUDA tensors; nothing to do for host ones.
  void prepare(const std::vector<const CopyProgram*>& programs, const RankMemory& memory,
               int slots);
  bool on_gpu() const noexcept { return gpu_; }
  const RankMemory& memory() const noexcept { return memory_; }
  // The stream the GPU copies run on (other work ordered with them).
  const gpu::Stream& stream() const noexcept { return stream_; }

  // Host: runs runs [first, first + count) of `program` now. GPU: launches
  // the whole program `index` and records `slot`'s event after it.
  void run(std::size_t index, const CopyProgram& program, std::uintptr_t src_base,
           std::uintptr_t dst_base, int slot, std::size_t first = 0,
           std::size_t count = static_cast<std::size_t>(-1));
  // GPU only: program `index` and the FP8 quantize program `quant` (sources
  // absolute, codes and scales at q_dst_base + ...; may be empty) as one
  // launch, then `slot`'s event.
  void run_with_quant(std::size_t index, std::uintptr_t src_base, std::uintptr_t dst_base, int slot,
                      const gpu::DeviceQuant& quant, std::uintptr_t q_dst_base);
  // True once `slot`'s launched copies finished (always on the host).
  bool done(int slot) const;
  // Waits for `slot`'s copies through `loop`, driving the transport meanwhile.
  void wait(int slot, Loop& loop, const char* what);
  void wait_all(Loop& loop, const char* what);
  // Blocks until everything launched so far finished (outside a step's loop).
  void finish();

  // Before a step reads the tensors: waits for the producer's work on them,
  // the event when given, else the stream when given, else the whole device.
  void wait_for_producer(void* cuda_stream, void* cuda_event) const;

 private:
  RankMemory memory_;
  bool gpu_ = false;
  gpu::Stream stream_;
  std::vector<gpu::Event> events_;
  gpu::DevicePrograms programs_;
};

}  // namespace weightsync::pipeline
