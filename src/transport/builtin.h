// The backends and wrappers compiled into this build, for the registry.
#pragma once

#include <weightsync/backend/transport.h>

#include <optional>
#include <string>
#include <vector>

namespace weightsync::transport {

struct BuiltinTransport {
  std::string name;
  TransportFactory factory;
  HostAllocator host = {};  // allocate_host_memory's, where not the heap's
  // The ?params it reads; make_transport refuses any other. A key ending in
  // '*' accepts every key with that prefix (UCX_* goes to UCX, which refuses
  // names it does not know). None for a wrapper, which checks its own keys
  // and hands the rest to its inner transport.
  std::optional<std::vector<std::string>> params = std::nullopt;
};

std::vector<BuiltinTransport> builtin_transports();

// The keys the built-in transport `name` accepts, joined for a message
// ("cuda, keepalive_interval, ..."); empty when `name` has no list (a
// wrapper, or a backend registered with register_transport).
std::string accepted_params(const std::string& name);
// Errc::invalid_argument naming `key`, `transport` (the name as the user wrote
// it) and the accepted keys, unless backend `backend` accepts `key`;
// `wrapper_keys`, when given, are listed as the wrapper's.
void check_param(const std::string& transport, const std::string& backend, const std::string& key,
                 const std::string& wrapper_keys = "");

// Each backend folder defines its factory; builtin.cpp lists those built.
std::unique_ptr<Transport> make_ucx_transport(const TransportOptions& options);
std::unique_ptr<Transport> make_nccl_transport(const TransportOptions& options);
std::unique_ptr<Transport> make_cuda_ipc_transport(const TransportOptions& options);
std::unique_ptr<Transport> make_fault_transport(const TransportOptions& options);

}  // namespace weightsync::transport
