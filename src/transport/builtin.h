// The backends and wrappers compiled into this build, for the registry.
#pragma once

#include <weightsync/backend/transport.h>

#include <string>
#include <vector>

namespace weightsync::transport {

struct BuiltinTransport {
  std::string name;
  TransportFactory factory;
  HostAllocator host = {};  // allocate_host_memory's, where not the heap's
};

std::vector<BuiltinTransport> builtin_transports();

// Each backend folder defines its factory; builtin.cpp lists those built.
std::unique_ptr<Transport> make_ucx_transport(const TransportOptions& options);
std::unique_ptr<Transport> make_nccl_transport(const TransportOptions& options);
std::unique_ptr<Transport> make_cuda_ipc_transport(const TransportOptions& options);
std::unique_ptr<Transport> make_fault_transport(const TransportOptions& options);

}  // namespace weightsync::transport
