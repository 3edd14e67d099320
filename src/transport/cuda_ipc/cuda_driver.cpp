#include "cuda_driver.h"

#include <weightsync/error.h>

namespace weightsync::transport::cuda_ipc {
namespace {

// The driver ABI these entry points are typed for (cudaTypedefs.h's PFN_*_vN).
constexpr unsigned kDriverAbi = 12000;

template <class Fn>
void load(Fn& fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status{};
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &p, kDriverAbi, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || !p)
    fail(Errc::unsupported, "cuda_ipc: the CUDA driver has no entry point ", symbol, " (",
         cudaGetErrorString(err), ")");
  fn = reinterpret_cast<Fn>(p);
}

Driver load_driver() {
  Driver d;
  load(d.cuGetErrorString, "cuGetErrorString");
  load(d.cuMemGetAddressRange, "cuMemGetAddressRange");
  load(d.cuPointerGetAttributes, "cuPointerGetAttributes");
  load(d.cuMemRetainAllocationHandle, "cuMemRetainAllocationHandle");
  load(d.cuMemRelease, "cuMemRelease");
  load(d.cuMemExportToShareableHandle, "cuMemExportToShareableHandle");
  load(d.cuMemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  load(d.cuMemGetAllocationPropertiesFromHandle, "cuMemGetAllocationPropertiesFromHandle");
  load(d.cuMemGetAllocationGranularity, "cuMemGetAllocationGranularity");
  load(d.cuMemAddressReserve, "cuMemAddressReserve");
  load(d.cuMemAddressFree, "cuMemAddressFree");
  load(d.cuMemMap, "cuMemMap");
  load(d.cuMemUnmap, "cuMemUnmap");
  load(d.cuMemSetAccess, "cuMemSetAccess");
  return d;
}

}  // namespace

const Driver& driver() {
  static const Driver d = load_driver();
  return d;
}

void check_cu(CUresult result, const std::string& what) {
  if (result == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (driver().cuGetErrorString(result, &text) != CUDA_SUCCESS || !text) text = "unknown error";
  fail(Errc::transport, what, ": ", text, " (CUresult ", static_cast<int>(result), ")");
}

void check_cuda(cudaError_t result, const std::string& what) {
  if (result != cudaSuccess)
    fail(Errc::transport, what, ": ", cudaGetErrorName(result), ": ", cudaGetErrorString(result));
}

DeviceGuard::DeviceGuard(int device) : device_(device) {
  check_cuda(cudaGetDevice(&previous_), "cuda_ipc: cudaGetDevice");
  if (previous_ != device_) check_cuda(cudaSetDevice(device_), "cuda_ipc: cudaSetDevice");
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0 && previous_ != device_) cudaSetDevice(previous_);
}

}  // namespace weightsync::transport::cuda_ipc
