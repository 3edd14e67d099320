// Copy programs: the pack of a bucket on the trainer and its apply on the
// engine as one table of strided runs, built once per plan on the CPU and run
// every step (DESIGN.md "GPU data path"). One executor runs a table: plain
// loops on the host (execute_host), one batched-copy kernel launch on the GPU
// (cuda/gpu.h, DeviceCopyPrograms). The kernel only executes what this file
// computes: the runs and, for the GPU, their cut into tasks (copy_tasks).
//
// Addresses are byte offsets from two bases given at execution: a pack reads
// registered tensors (base 0: the offsets are addresses) and writes into a
// staging slot (base: the slot), an apply the reverse. So one table serves
// both slots of a pipeline.
#pragma once

#include <weightsync/tensor.h>

#include "core/wire_sum.h"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace weightsync {

inline constexpr int kCopyOuterDims = 3;

// `count[0] * count[1] * count[2]` runs of `bytes` contiguous bytes each: run
// (i0, i1, i2) starts at src + sum(i_k * src_stride[k]) and lands at
// dst + sum(i_k * dst_stride[k]); dim 0 is the innermost. Strides in bytes.
struct CopyRun {
  int64_t src = 0;
  int64_t dst = 0;
  int64_t bytes = 0;
  int64_t count[kCopyOuterDims] = {1, 1, 1};
  int64_t src_stride[kCopyOuterDims] = {0, 0, 0};
  int64_t dst_stride[kCopyOuterDims] = {0, 0, 0};

  int64_t rows() const noexcept { return count[0] * count[1] * count[2]; }
  int64_t total_bytes() const noexcept { return rows() * bytes; }
};

class CopyProgram {
 public:
  // Appends the copy of a strided block of `lengths` elements of `itemsize`
  // bytes; strides in elements per side, `src`/`dst` byte offsets from the
  // bases of execution. Dims of length 1 are dropped and dims contiguous on
  // both sides merged (so a dense block is one run); a block left with more
  // than kCopyOuterDims outer dims becomes several runs. Errc::invalid_argument
  // for mismatched ranks or a negative length.
  void add(int64_t src, const Shape& src_strides, int64_t dst, const Shape& dst_strides,
           const Shape& lengths, std::size_t itemsize);
  // Appends a run as is (tests, and callers that built one).
  void add_run(const CopyRun& run);

  const std::vector<CopyRun>& runs() const noexcept { return runs_; }
  std::size_t size() const noexcept { return runs_.size(); }
  bool empty() const noexcept { return runs_.empty(); }
  int64_t bytes() const noexcept { return bytes_; }  // payload of every run

 private:
  std::vector<CopyRun> runs_;
  int64_t bytes_ = 0;
};

// Runs runs [first, first + count) of `program` on the host, reading at
// src_base + run.src and writing at dst_base + run.dst (bases as integers, so
// that base 0 with absolute offsets is well defined).
void execute_host(const CopyProgram& program, std::uintptr_t src_base, std::uintptr_t dst_base,
                  std::size_t first = 0,
                  std::size_t count = std::numeric_limits<std::size_t>::max());

// Which side of a program holds the packed bytes a bucket's checksum is
// over (core/wire_sum.h): the destination of a pack, the source of an apply.
enum class PackedSide : uint8_t { dst, src };

// execute_host, summing the bytes it moves in the same pass: each byte at
// its packed position, its offset on `side` (run.dst or run.src) minus
// `origin`. The sums are those of the packed bytes where the runs cover
// each of them once (runs_bytes tells).
WireSum execute_host_sum(const CopyProgram& program, std::uintptr_t src_base,
                         std::uintptr_t dst_base, PackedSide side, int64_t origin,
                         std::size_t first = 0,
                         std::size_t count = std::numeric_limits<std::size_t>::max());

// The bytes runs [first, first + count) of `program` move.
int64_t runs_bytes(const CopyProgram& program, std::size_t first = 0,
                   std::size_t count = std::numeric_limits<std::size_t>::max());

// ---- the GPU's cut of a program (computed and tested on the CPU) ----------
//
// A task is the work of one thread block: `rows` consecutive rows (flattened
// (i0, i1, i2) index, i0 fastest) of run `run` from `row` on, bytes
// [offset, offset + bytes) of each, moved `vec` bytes per access. Big runs
// are cut into several single-row tasks, small ones grouped, so that every
// task moves about `chunk_bytes`: many small pieces and a few huge ones keep
// the whole grid busy in one launch.
//
// A transpose (rows of one vector each, adjacent along dim 0 on one side and
// along dim 1 on the other) is cut into tiles instead: a tile task (`tile`
// 1: the source is contiguous along dim 0, the destination along dim 1; 2:
// the other way) moves the kTileElements x kTileElements rows (fewer at the
// edges) from i0, i1 on, at i2 (`row` = i0 + count0 * (i1 + count1 * i2)),
// through shared memory so that both its reads and its writes are
// coalesced; `rows` is its element count, vecs_per_row 1, vec the element.
struct CopyTask {
  uint32_t run = 0;
  uint32_t vec = 1;   // 16, 8, 4, 2 or 1: the widest access every address allows
  uint32_t rows = 1;  // rows * (bytes / vec) < 2^32
  uint32_t vecs_per_row = 0;
  uint32_t tile = 0;  // 0: rows; 1 or 2: a transpose tile (above)
  int64_t row = 0;
  int64_t offset = 0;
};

inline constexpr int64_t kTileElements = 32;

// 1 or 2 when `run` is a transpose cut into tiles (CopyTask::tile), else 0.
uint32_t transpose_tile_kind(const CopyRun& run);

inline constexpr int64_t kDefaultChunkBytes = int64_t{64} << 10;

// The task size for a program of `bytes` run by `blocks` resident blocks: about
// four tasks per block (so that blocks finish together), within [16 KiB,
// 256 KiB] (small enough to balance, big enough that a task's setup is noise).
int64_t task_chunk_bytes(int64_t bytes, unsigned blocks);

// The widest access (16, 8, 4, 2 or 1 bytes) that every address of `run`
// allows when both bases are aligned to 16 bytes.
uint32_t run_vector_bytes(const CopyRun& run);

// Cuts every run of `program` into tasks of about `chunk_bytes` (a multiple of
// 16, at least 16).
std::vector<CopyTask> copy_tasks(const CopyProgram& program,
                                 int64_t chunk_bytes = kDefaultChunkBytes);

// Runs `tasks` on the host exactly as the kernel does (same index arithmetic),
// so that the cut is tested where no GPU is.
void execute_tasks_host(const CopyProgram& program, const std::vector<CopyTask>& tasks,
                        std::uintptr_t src_base, std::uintptr_t dst_base);

}  // namespace weightsync
