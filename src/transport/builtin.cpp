#include "builtin.h"

#include "cuda_ipc/ipc_host_memory.h"

namespace weightsync::transport {

std::vector<BuiltinTransport> builtin_transports() {
  return {
#ifdef WEIGHTSYNC_HAVE_UCX
      {"ucx", make_ucx_transport},
#endif
#ifdef WEIGHTSYNC_HAVE_NCCL
      {"nccl", make_nccl_transport},
#endif
#ifdef WEIGHTSYNC_HAVE_CUDA
      {"cuda_ipc", make_cuda_ipc_transport},
#endif
      // cuda_ipc's stand-in over shared host memory: builds and runs everywhere.
      {"ipc_host", cuda_ipc::make_ipc_host_transport, cuda_ipc::shared_host_buffer},
      {"fault", make_fault_transport},
  };
}

}  // namespace weightsync::transport
