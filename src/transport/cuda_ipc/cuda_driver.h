// The CUDA driver calls cuda_ipc needs (allocation ranges, VMM export and
// import), reached through the runtime's driver entry points instead of
// linking libcuda: a build with CUDA must still load and run its CPU tests
// on machines without a driver, where libcuda.so.1 does not exist.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <string>

namespace weightsync::transport::cuda_ipc {

struct Driver {
  PFN_cuGetErrorString_v6000 cuGetErrorString = nullptr;
  PFN_cuMemGetAddressRange_v3020 cuMemGetAddressRange = nullptr;
  PFN_cuPointerGetAttributes_v7000 cuPointerGetAttributes = nullptr;
  PFN_cuMemRetainAllocationHandle_v11000 cuMemRetainAllocationHandle = nullptr;
  PFN_cuMemRelease_v10020 cuMemRelease = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle = nullptr;
  PFN_cuMemGetAllocationPropertiesFromHandle_v10020 cuMemGetAllocationPropertiesFromHandle =
      nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity = nullptr;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve = nullptr;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree = nullptr;
  PFN_cuMemMap_v10020 cuMemMap = nullptr;
  PFN_cuMemUnmap_v10020 cuMemUnmap = nullptr;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess = nullptr;
};

// Loaded on first use; Errc::unsupported when the driver lacks an entry point.
const Driver& driver();

// Errc::transport "<what>: <CUDA's error name and text>" unless success.
void check_cu(CUresult result, const std::string& what);
void check_cuda(cudaError_t result, const std::string& what);

// Makes `device` current for a scope (the caller's thread may have another).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
  int device_;
};

}  // namespace weightsync::transport::cuda_ipc
