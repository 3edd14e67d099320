// RAII owners of the UCX objects one transport uses: a context with the TAG
// feature and one worker progressed from the caller's thread; and the UCX
// configuration weightsync gives its own context (never the environment).
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace weightsync::transport::ucx {

// Throws Errc::transport "<what>: <UCX status string>" unless status is UCS_OK.
void check(ucs_status_t status, const std::string& what);

// weightsync's TCP tuning: (name, value) pairs in the form ucp_config_modify
// takes them (no UCX_ and no TCP_ prefix; see ucx_worker.cpp for why).
const std::vector<std::pair<std::string, std::string>>& tcp_tuning();

// Whether a UCX_TLS value (UCX syntax; "" means all) lets UCX open tcp.
bool selects_tcp(const std::string& tls);

// The UCX library this process runs with: the first libucp.so.0 the dynamic
// loader found (weightsync links UCX by its soname, so LD_LIBRARY_PATH or a
// libucp.so.0 loaded earlier picks it; docs/transports.md).
struct UcxLibrary {
  std::string version;      // "1.22.0", from ucp_get_version
  std::string path;         // the file libucp was loaded from
  std::string cuda_module;  // its libuct_cuda.so, "" when it has none
  // "UCX 1.22.0 (/path/libucp.so.0)"
  std::string describe() const;
  // Why CUDA memory cannot be moved by this library (for an error message):
  // built without CUDA, or its CUDA module found no driver or device; and
  // how to get one that can.
  std::string why_no_cuda() const;
};
const UcxLibrary& ucx_library();

class UcxWorker {
 public:
  // `settings`: UCX configuration entries without the UCX_ prefix (e.g.
  // {"TLS", "tcp,self"}), applied with ucp_config_modify to this context's
  // configuration only, on top of what UCX read from the environment.
  explicit UcxWorker(const std::map<std::string, std::string>& settings);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  ucp_context_h context() const { return context_; }
  ucp_worker_h worker() const { return worker_; }
  // The worker's address, for peers to create endpoints from.
  const std::vector<uint8_t>& address() const { return address_; }
  // True when UCX can move CUDA device memory in this build.
  bool cuda_memory() const { return cuda_memory_; }

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<uint8_t> address_;
  bool cuda_memory_ = false;
};

}  // namespace weightsync::transport::ucx
