// Materialize (weightsync_core): an engine rank's parameters built straight
// from a checkpoint, the reference that every sync must reproduce byte for
// byte (`weightsync materialize`, the tests' expected bytes).
#pragma once

#include <weightsync/engine_layout.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace weightsync {

class Checkpoint;

// Checks that `checkpoint` holds every HF tensor that replica rank `rank`
// reads, with the shape the model config implies and the engine's dtype (no
// conversion; an FP8 weight reads BF16, F16 or F32 tensors): Errc::not_found
// naming a missing key; Errc::mismatch naming the key and both shapes or
// both dtypes.
void check_checkpoint(const Checkpoint& checkpoint, const EngineLayout& layout, int rank);

// Fills `param` (contiguous row-major, param.shape, param.dtype) into `dst`
// straight from the checkpoint; padding elements become zero. Checks each
// key's dtype and that its boxes fit (Errc::not_found / Errc::mismatch).
// Errc::invalid_argument for an FP8 weight or scale param (use the next).
void fill_param(const Checkpoint& checkpoint, const EngineParam& param, void* dst);
// Param `index` of `rank`, any param: an FP8 weight's bytes or a scale
// param's scales are the weight's blocks, from the checkpoint's BF16, F16 or
// F32 tensors, quantized (DESIGN.md "FP8 engines").
void fill_param(const Checkpoint& checkpoint, const EngineRankLayout& rank, size_t index,
                void* dst);

// Writes engine rank `rank`'s parameters (under the engine's names, in layout
// order) to the .safetensors file `out_path`, after check_checkpoint.
// `rank` may be any global rank 0..world()-1 (the replicas of a group are
// identical); anything else is Errc::invalid_argument. Streams:
// contiguous runs go from the checkpoint's mapping straight to the file, the
// rest through one reusable buffer. Returns the bytes of the data section.
uint64_t materialize(const Checkpoint& checkpoint, const EngineLayout& layout, int rank,
                     const std::string& out_path);

}  // namespace weightsync
