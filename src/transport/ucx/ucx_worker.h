// RAII owners of the UCX objects one transport uses: a context with the TAG
// feature and one worker progressed from the caller's thread.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace weightsync::transport::ucx {

// Throws Errc::transport "<what>: <UCX status string>" unless status is UCS_OK.
void check(ucs_status_t status, const std::string& what);

class UcxWorker {
 public:
  // `settings`: UCX configuration entries without the UCX_ prefix (e.g.
  // {"TLS", "tcp,self"}); applied on top of the environment.
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
