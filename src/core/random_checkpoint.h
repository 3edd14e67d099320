// Random checkpoints for tests, demos and benchmarks: the tensors of a model
// (hf_tensors) filled with seeded pseudo-random values, written as one
// .safetensors file or as an HF directory with model.safetensors.index.json.
// Private to the build: the command (demo, benchmarks) and the tests include
// it; it is no part of the installed API.
//
// Contents are a pure function of (seed, key, element index, version), so a
// reader can recompute any element without the file. Float elements are
// finite, of magnitude in [2^-8, 1) and random sign. Two versions v1 != v2
// differ in EVERY element when (v1 - v2) mod kVersionPeriod != 0: the demo
// relies on this to make each step's weights differ from the final ones.
#pragma once

#include <weightsync/hf_model.h>

#include <cstdint>
#include <string>
#include <vector>

namespace weightsync {

// Versions repeat with this period (the smallest field any dtype varies:
// F8_E4M3's 3 exponent + 3 mantissa bits). BOOL only alternates (period 2).
inline constexpr uint64_t kVersionPeriod = 64;

struct RandomCheckpointOptions {
  uint64_t seed = 0;
  uint64_t version = 0;
  // 0: a single file at `path` (which should end in .safetensors). N >= 1: an
  // HF directory at `path` with N files model-0000i-of-0000N.safetensors plus
  // model.safetensors.index.json, tensors split in order by bytes.
  int num_files = 0;
};

// Writes the checkpoint, streaming through a reusable buffer (memory stays
// small whatever the model size). Errc::io when the path cannot be written,
// Errc::invalid_argument for duplicate keys or num_files < 0.
void write_random_checkpoint(const std::string& path, const std::vector<HfTensorSpec>& tensors,
                             const RandomCheckpointOptions& options = {});

// Fills `count` elements starting at flat element `first` of tensor `key`
// into `out` (count * itemsize(dtype) bytes), exactly as the checkpoint
// writer does.
void fill_random(std::string_view key, DType dtype, uint64_t seed, uint64_t version, int64_t first,
                 int64_t count, void* out);

}  // namespace weightsync
