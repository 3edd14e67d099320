// The batched strided copy: one launch runs a whole copy program (a bucket's
// pack or apply). Each block takes tasks in turn (grid-stride); a task is a
// chunk of one big run or a group of small runs of one run family, moved with
// the widest access its addresses allow (16-byte vectors when aligned). The
// tables and their cut are computed and tested on the CPU (copy_program.h,
// execute_tasks_host mirrors the arithmetic here).
#include "copy_device.cuh"
#include "copy_kernel.h"

namespace weightsync::gpu::kernel {
namespace {

using copy_dev::kThreads;

__global__ void __launch_bounds__(kThreads)
    copy_program_kernel(const Run* __restrict__ runs, const Task* __restrict__ tasks,
                        unsigned num_tasks, std::uintptr_t src_base, std::uintptr_t dst_base) {
  copy_dev::run_tasks(runs, tasks, num_tasks, blockIdx.x, gridDim.x, src_base, dst_base);
}

}  // namespace

cudaError_t max_resident_blocks(int device, unsigned* blocks) {
  int sms = 0, per_sm = 0;
  cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, copy_program_kernel, kThreads, 0);
  if (e == cudaSuccess)
    *blocks = static_cast<unsigned>((sms > 0 ? sms : 1) * (per_sm > 0 ? per_sm : 1));
  return e;
}

cudaError_t launch_copy(const Run* runs, const Task* tasks, unsigned num_tasks,
                        std::uintptr_t src_base, std::uintptr_t dst_base, unsigned blocks,
                        cudaStream_t stream) {
  if (num_tasks == 0) return cudaSuccess;
  const unsigned grid = blocks < num_tasks ? blocks : num_tasks;
  // cudaGetLastError reports any earlier failure of this thread (e.g. an IPC
  // handle of a dead peer, already handled): clear it, so that what follows
  // speaks of this launch only.
  (void)cudaGetLastError();
  copy_program_kernel<<<grid, kThreads, 0, stream>>>(runs, tasks, num_tasks, src_base, dst_base);
  return cudaGetLastError();
}

}  // namespace weightsync::gpu::kernel
