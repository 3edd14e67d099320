#include "builtin.h"

#include "cuda_ipc/ipc_host_memory.h"

namespace weightsync::transport {

std::vector<BuiltinTransport> builtin_transports() {
  return {
#ifdef WEIGHTSYNC_HAVE_UCX
      {"ucx",
       make_ucx_transport,
       {},
       std::vector<std::string>{"cuda", "keepalive_interval", "peer_errors", "tls", "UCX_*"}},
#endif
#ifdef WEIGHTSYNC_HAVE_NCCL
      {"nccl", make_nccl_transport, {}, std::vector<std::string>{}},
#endif
#ifdef WEIGHTSYNC_HAVE_CUDA
      {"cuda_ipc", make_cuda_ipc_transport, {}, std::vector<std::string>{"socket_dir"}},
#endif
      // cuda_ipc's stand-in over shared host memory: builds and runs everywhere.
      {"ipc_host", cuda_ipc::make_ipc_host_transport, cuda_ipc::shared_host_buffer,
       std::vector<std::string>{"local", "socket_dir"}},
      {"fault", make_fault_transport},
  };
}

}  // namespace weightsync::transport
