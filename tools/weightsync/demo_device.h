// Where a demo/bench job's tensors live (--device cpu|cuda). With cuda every
// rank's tensors are in GPU memory: rank r of the job's transport world on
// GPU r modulo the GPUs here, so on a one-GPU machine every process shares
// GPU 0 (the colocated setup). The demo keeps a host copy of each tensor to
// fill, change and check it; the device copy is what the library sees.
// Over ipc_host (cuda_ipc's host stand-in) an engine rank's host tensors are
// in its shared arena, as a cuda_ipc engine's are in cudaMalloc memory: the
// trainers write into them, and they can be lent.
#pragma once

#include "demo_job.h"

#include "core/cuda/gpu.h"

#include <weightsync/tensor.h>

#include <memory>
#include <string>

namespace weightsync::demo {

// Checks a --device value: "cpu", or "cuda" where a GPU can be used
// (Errc::unsupported naming `flag` and why not); Errc::invalid_argument
// for anything else.
void check_device(const std::string& device, const std::string& flag);

bool on_gpu(const JobSpec& job);
// The GPU of the process of transport rank `rank`.
int gpu_of(int rank);

class WorkerTensor {
 public:
  // Zeroed; `gpu` < 0: host memory only, allocated for receiving over
  // `transport` when one is named (allocate_host_memory: ipc_host's shared
  // arena), else from the heap.
  WorkerTensor(DType dtype, const Shape& shape, int gpu, const std::string& transport = "");

  char* host() const noexcept { return host_.get(); }
  TensorView host_view() const;
  // What the Publisher or Subscriber is given: the device copy, or the host one.
  const TensorView& view() const noexcept { return view_; }
  std::size_t nbytes() const noexcept { return view_.nbytes(); }
  void upload();    // host copy -> device copy (no-op on the host)
  void download();  // device copy -> host copy (no-op on the host)

 private:
  std::shared_ptr<char> host_;
  gpu::Memory device_;
  TensorView view_;
};

}  // namespace weightsync::demo
