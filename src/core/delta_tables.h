// The tables a GPU applies delta encodings with (core/delta.h builds and
// checks them on the CPU; cuda/delta_kernel.cu only executes them). Plain
// structs, so that nvcc compiles them without the library's C++20 headers.
#pragma once

#include <cstdint>

namespace weightsync::delta {

// One chunk that changes elements: its record's table (list indices or run
// pairs) and values at `table` and `values` bytes into the frame the
// encodings lie in, its first element at `dst` bytes into the target memory.
struct PatchChunk {
  int64_t table = 0;
  int64_t values = 0;
  int64_t dst = 0;
  uint32_t kind = 0;   // ChunkKind: list, runs or dense (never unchanged)
  uint32_t count = 0;  // the record's count (list: elements; runs: runs)
  uint32_t elements = 0;
  uint32_t element_bytes = 0;
};

// One chunk of the digest: `bytes` bytes at `dst` bytes into the target
// memory, hashed with `seed` (chunk_seed of its item's seed).
struct HashChunk {
  int64_t dst = 0;
  int64_t bytes = 0;
  uint64_t seed = 0;
};

}  // namespace weightsync::delta
