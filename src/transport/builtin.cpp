#include "builtin.h"

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
      {"fault", make_fault_transport},
  };
}

}  // namespace weightsync::transport
