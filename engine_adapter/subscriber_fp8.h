// FP8 engines on the engine rank (DESIGN.md "FP8 engines"): unless its
// senders quantize it (Plan::fp8_on_sender), the plan sends a quantized
// weight in its trainer's dtype (BF16, F16 or F32); the receive
// pipeline lands those bytes in a staging tensor of that dtype, one per FP8
// param, kept here in the params' memory (host ones from the transport's
// allocate_host, so that it can land and lend into them); quantize() then
// writes every FP8 param and its scale param from them: the host quantizer
// (core/fp8.h) for host params, one kernel launch (gpu::DeviceQuant, the
// same arithmetic) for CUDA params. Either gives the bytes `weightsync
// materialize` writes.
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/engine_layout.h>
#include <weightsync/plan.h>
#include <weightsync/tensor.h>

#include "core/cuda/gpu.h"
#include "core/fp8.h"

#include <memory>
#include <string>
#include <vector>

namespace weightsync::engine {

class Fp8Staging {
 public:
  // `params`: the rank's registered params, by layout index, all in host
  // memory or all on one CUDA device (pipeline::rank_memory checked).
  // `engine_template`: the rank's (Plan::engine_template); params the plan
  // quantizes on the senders (Plan::fp8_on_sender) are not staged.
  Fp8Staging(const Plan& plan, int engine_template, const EngineRankLayout& layout,
             const std::vector<TensorView>& params, Transport& transport, const std::string& who);

  bool empty() const noexcept { return staged_ == 0; }
  // The tensors the receive pipeline writes: each FP8 weight's staging
  // tensor in its place, every other param as registered.
  const std::vector<TensorView>& targets() const noexcept { return targets_; }
  // Quantizes every staged weight into its FP8 param and scale param.
  void quantize() const;
  int64_t staged_bytes() const noexcept { return staged_bytes_; }

 private:
  std::vector<TensorView> targets_;
  std::vector<std::shared_ptr<char>> buffers_;
  std::vector<gpu::Memory> device_buffers_;
  fp8::QuantProgram program_;
  int device_ = -1;  // the params' CUDA device; -1: host
  gpu::DeviceQuant device_program_;
  gpu::Stream stream_;
  int staged_ = 0;
  int64_t staged_bytes_ = 0;
};

// True when the rank's layout holds FP8 params.
bool has_fp8(const EngineRankLayout& layout);

}  // namespace weightsync::engine
