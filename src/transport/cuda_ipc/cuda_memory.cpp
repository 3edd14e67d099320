// CUDA memory for cuda_ipc: finding, exporting and importing allocations, and
// the sender's copies. Two kinds of handles:
// - cudaMalloc memory: a cudaIpcMemHandle_t of the allocation's base, opened
//   by the sender with cudaIpcOpenMemHandle (peer access enabled lazily).
// - cuMem (VMM) ranges such as PyTorch's expandable segments, made of
//   physical chunks mapped side by side: one POSIX file descriptor per chunk
//   (cuMemExportToShareableHandle), passed over the control socket; the
//   sender imports each, maps them side by side into one reserved range and
//   grants its device access.
// Memory from stream-ordered pools (cudaMallocAsync) and managed memory are
// refused with Errc::unsupported.
#include "cuda_driver.h"
#include "ipc_memory.h"
#include "ipc_transport.h"

#include <weightsync/error.h>

#include "builtin.h"

#include <algorithm>
#include <cstring>
#include <map>

namespace weightsync::transport::cuda_ipc {
namespace {

enum HandleKind : uint32_t { kLegacyIpc = 1, kVmmPosixFd = 2 };

// What the driver says about an address. Each field is zeroed and wide
// enough for the attribute's type (booleans, enums, ids, pointers).
struct PointerInfo {
  uint64_t type = 0, managed = 0, legacy = 0, buffer_id = 0, pool = 0, handle_types = 0;
};

PointerInfo pointer_info(uintptr_t addr) {
  PointerInfo i;
  CUpointer_attribute attrs[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                 CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                 CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                 CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                 CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                                 CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES};
  void* data[] = {&i.type, &i.managed, &i.legacy, &i.buffer_id, &i.pool, &i.handle_types};
  check_cu(driver().cuPointerGetAttributes(6, attrs, data, static_cast<CUdeviceptr>(addr)),
           cat("cuda_ipc: cuPointerGetAttributes(0x", std::hex, addr, ")"));
  return i;
}

Piece allocation_at(uintptr_t addr, uint64_t buffer_id) {
  CUdeviceptr base = 0;
  size_t size = 0;
  check_cu(driver().cuMemGetAddressRange(&base, &size, static_cast<CUdeviceptr>(addr)),
           cat("cuda_ipc: cuMemGetAddressRange(0x", std::hex, addr, ")"));
  return Piece{static_cast<uintptr_t>(base), size, buffer_id};
}

// A VMM chunk's identity: its buffer id, and the physical allocation mapped
// there. An allocator that unmaps a chunk and maps a new one at the same
// address (PyTorch's expandable segments release memory so) changes it.
uint64_t vmm_identity(uintptr_t base, uint64_t buffer_id) {
  CUmemGenericAllocationHandle h = 0;
  check_cu(driver().cuMemRetainAllocationHandle(&h, reinterpret_cast<void*>(base)),
           "cuda_ipc: cuMemRetainAllocationHandle");
  driver().cuMemRelease(h);
  return buffer_id ^ (static_cast<uint64_t>(h) * 0x9E3779B97F4A7C15ull);
}

// Why memory cannot be shared, or "" when it can (as the first piece says).
std::string unshareable(const PointerInfo& i) {
  if (i.managed) return "managed (cudaMallocManaged) memory";
  if (i.type != CU_MEMORYTYPE_DEVICE)
    return i.type == CU_MEMORYTYPE_HOST ? "host memory" : "not memory CUDA knows";
  if (i.pool) return "from a stream-ordered pool (cudaMallocAsync), which has no per-buffer handle";
  if (!i.legacy && !(i.handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
    return "a cuMem (VMM) allocation created without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR "
           "in requestedHandleTypes, so it cannot be exported";
  return "";
}

// cudaIpcOpenMemHandle refuses a handle this process has open already, so
// opened handles are shared by every mapping of them.
class LegacyOpen {
 public:
  LegacyOpen(const cudaIpcMemHandle_t& h, int device) : device_(device) {
    DeviceGuard g(device_);
    check_cuda(cudaIpcOpenMemHandle(&ptr_, h, cudaIpcMemLazyEnablePeerAccess),
               "cuda_ipc: cudaIpcOpenMemHandle");
  }
  ~LegacyOpen() {
    DeviceGuard g(device_);
    cudaIpcCloseMemHandle(ptr_);
  }
  void* ptr() const { return ptr_; }

 private:
  void* ptr_ = nullptr;
  int device_;
};

class LegacyMapping final : public Mapping {
 public:
  explicit LegacyMapping(std::shared_ptr<LegacyOpen> open) : open_(std::move(open)) {}
  void* data() const override { return open_->ptr(); }

 private:
  std::shared_ptr<LegacyOpen> open_;
};

// A reserved address range with the exporter's chunks mapped into it.
class VmmMapping final : public Mapping {
 public:
  VmmMapping(std::size_t bytes, std::size_t align, int device) : bytes_(bytes), device_(device) {
    DeviceGuard g(device_);
    check_cu(driver().cuMemAddressReserve(&va_, bytes_, align, 0, 0),
             cat("cuda_ipc: cuMemAddressReserve of ", bytes_, " bytes"));
  }
  ~VmmMapping() override {
    DeviceGuard g(device_);
    for (const auto& [offset, size] : mapped_) driver().cuMemUnmap(va_ + offset, size);
    driver().cuMemAddressFree(va_, bytes_);
  }
  void map(std::size_t offset, std::size_t size, CUmemGenericAllocationHandle h) {
    check_cu(driver().cuMemMap(va_ + offset, size, 0, h, 0),
             cat("cuda_ipc: cuMemMap of ", size, " bytes at offset ", offset));
    mapped_.emplace_back(offset, size);
  }
  void grant(int device) {
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check_cu(driver().cuMemSetAccess(va_, bytes_, &access, 1),
             cat("cuda_ipc: cuMemSetAccess for GPU ", device,
                 " (the exporter's GPU must be this one or reachable by peer access)"));
  }
  void* data() const override { return reinterpret_cast<void*>(va_); }

 private:
  CUdeviceptr va_ = 0;
  std::size_t bytes_;
  int device_;
  std::vector<std::pair<std::size_t, std::size_t>> mapped_;
};

// An allocation handle held for a scope (retained or imported).
struct HeldHandle {
  CUmemGenericAllocationHandle h = 0;
  ~HeldHandle() {
    if (h) driver().cuMemRelease(h);
  }
};

struct ChunkEntry {
  uint64_t offset;
  uint64_t bytes;
};

class CudaCopy final : public Copy {
 public:
  CudaCopy(cudaEvent_t event, int device, std::size_t bytes)
      : event_(event), device_(device), bytes_(bytes) {}
  ~CudaCopy() override {
    DeviceGuard g(device_);
    if (!finished_) cudaEventSynchronize(event_);
    cudaEventDestroy(event_);
  }
  bool done() override {
    if (finished_) return true;
    const cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return false;
    finished_ = true;
    check_cuda(e, cat("cuda_ipc: the copy of ", bytes_, " bytes into the receiver's memory"));
    return true;
  }

 private:
  cudaEvent_t event_;
  int device_;
  std::size_t bytes_;
  bool finished_ = false;
};

class CudaMemory final : public IpcMemory {
 public:
  explicit CudaMemory(int device);
  ~CudaMemory() override;
  MemoryKind memory() const override { return MemoryKind::cuda; }
  Located locate(const Buffer& buffer) override;
  Export export_region(const Located& region) override;
  std::unique_ptr<Mapping> import(uint32_t kind, const std::vector<uint8_t>& handle,
                                  std::vector<UniqueFd> fds, std::size_t bytes) override;
  std::unique_ptr<Copy> copy(void* dst, const Buffer& src) override;
  bool copies_in_order() const override { return true; }  // all on stream_

 private:
  std::unique_ptr<Mapping> import_legacy(const std::vector<uint8_t>& handle);
  std::unique_ptr<Mapping> import_vmm(const std::vector<uint8_t>& handle, std::vector<UniqueFd> fds,
                                      std::size_t bytes);

  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  std::map<std::vector<uint8_t>, std::weak_ptr<LegacyOpen>> opened_;
};

CudaMemory::CudaMemory(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess)
    fail(Errc::unsupported,
         "cuda_ipc transport: no usable GPU here (cudaGetDeviceCount: ", cudaGetErrorString(err),
         ")");
  if (count == 0) fail(Errc::unsupported, "cuda_ipc transport: no CUDA device present");
  if (device >= count)
    fail(Errc::invalid_argument, "cuda_ipc transport: device ", device, " but only ", count,
         " present");
  if (device < 0) check_cuda(cudaGetDevice(&device), "cuda_ipc: cudaGetDevice");
  device_ = device;
  driver();  // every entry point present, or unsupported now rather than mid-step
  DeviceGuard g(device_);
  check_cuda(cudaFree(nullptr), "cuda_ipc: initialising the CUDA context");
  // Its own non-blocking stream: copies never wait for (or block) the legacy
  // default stream or the caller's streams.
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
             "cuda_ipc: cudaStreamCreateWithFlags");
}

CudaMemory::~CudaMemory() {
  DeviceGuard g(device_);
  cudaStreamSynchronize(stream_);
  cudaStreamDestroy(stream_);
}

Located CudaMemory::locate(const Buffer& b) {
  DeviceGuard g(device_);
  const auto data = reinterpret_cast<uintptr_t>(b.data);
  const uintptr_t end = data + std::max<std::size_t>(b.bytes, 1);
  const PointerInfo first = pointer_info(data);
  if (auto why = unshareable(first); !why.empty())
    fail(Errc::unsupported, "cuda_ipc: the ", b.bytes, "-byte buffer at ", b.data,
         " cannot be shared with another process: ", why);
  Located where;
  where.pieces.push_back(allocation_at(data, first.buffer_id));
  if (!first.legacy)
    where.pieces.back().id = vmm_identity(where.pieces.back().base, first.buffer_id);
  // A VMM range is a row of separately allocated chunks: follow the buffer
  // across them. A cudaMalloc block is one allocation and must hold it all.
  for (uintptr_t at = where.pieces.back().base + where.pieces.back().bytes; at < end;
       at = where.pieces.back().base + where.pieces.back().bytes) {
    const PointerInfo next = pointer_info(at);
    if (first.legacy || next.legacy || !unshareable(next).empty())
      fail(Errc::invalid_argument, "cuda_ipc: the ", b.bytes, "-byte buffer at ", b.data,
           " runs past the end of its allocation at 0x", std::hex, at,
           " into memory that is not the same cuMem range");
    where.pieces.push_back(allocation_at(at, next.buffer_id));
    where.pieces.back().id = vmm_identity(where.pieces.back().base, next.buffer_id);
  }
  where.base = where.pieces.front().base;
  where.unmap_before_free = first.legacy != 0;
  where.bytes = where.pieces.back().base + where.pieces.back().bytes - where.base;
  return where;
}

Export CudaMemory::export_region(const Located& region) {
  DeviceGuard g(device_);
  Export ex;
  if (pointer_info(region.base).legacy) {
    cudaIpcMemHandle_t h;
    check_cuda(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(region.base)),
               cat("cuda_ipc: cudaIpcGetMemHandle of a ", region.bytes, "-byte allocation"));
    ex.kind = kLegacyIpc;
    ex.handle.assign(reinterpret_cast<const uint8_t*>(&h),
                     reinterpret_cast<const uint8_t*>(&h) + sizeof(h));
    return ex;
  }
  ex.kind = kVmmPosixFd;
  for (const Piece& p : region.pieces) {
    HeldHandle held;
    check_cu(driver().cuMemRetainAllocationHandle(&held.h, reinterpret_cast<void*>(p.base)),
             "cuda_ipc: cuMemRetainAllocationHandle");
    int fd = -1;
    check_cu(driver().cuMemExportToShareableHandle(&fd, held.h,
                                                   CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
             cat("cuda_ipc: cuMemExportToShareableHandle of a ", p.bytes, "-byte chunk"));
    ex.fds.emplace_back(fd);
    const ChunkEntry c{p.base - region.base, p.bytes};
    const auto* raw = reinterpret_cast<const uint8_t*>(&c);
    ex.handle.insert(ex.handle.end(), raw, raw + sizeof(c));
  }
  return ex;
}

std::unique_ptr<Mapping> CudaMemory::import(uint32_t kind, const std::vector<uint8_t>& handle,
                                            std::vector<UniqueFd> fds, std::size_t bytes) {
  if (kind == kLegacyIpc && fds.empty()) return import_legacy(handle);
  if (kind == kVmmPosixFd) return import_vmm(handle, std::move(fds), bytes);
  fail(Errc::protocol, "cuda_ipc: unknown handle kind ", kind, " with ", fds.size(),
       " descriptors");
}

std::unique_ptr<Mapping> CudaMemory::import_legacy(const std::vector<uint8_t>& handle) {
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof(h))
    fail(Errc::protocol, "cuda_ipc: a cudaIpc handle of ", handle.size(), " bytes, expected ",
         sizeof(h));
  std::memcpy(&h, handle.data(), sizeof(h));
  std::shared_ptr<LegacyOpen> open = opened_[handle].lock();
  if (!open) {
    open = std::make_shared<LegacyOpen>(h, device_);
    opened_[handle] = open;
  }
  std::erase_if(opened_, [](const auto& kv) { return kv.second.expired(); });
  return std::make_unique<LegacyMapping>(std::move(open));
}

std::unique_ptr<Mapping> CudaMemory::import_vmm(const std::vector<uint8_t>& handle,
                                                std::vector<UniqueFd> fds, std::size_t bytes) {
  if (handle.size() != fds.size() * sizeof(ChunkEntry) || fds.empty())
    fail(Errc::protocol, "cuda_ipc: a VMM handle table of ", handle.size(), " bytes for ",
         fds.size(), " descriptors");
  DeviceGuard g(device_);
  std::vector<HeldHandle> imported(fds.size());
  for (std::size_t i = 0; i < fds.size(); ++i)
    check_cu(driver().cuMemImportFromShareableHandle(
                 &imported[i].h, reinterpret_cast<void*>(static_cast<intptr_t>(fds[i].get())),
                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
             cat("cuda_ipc: cuMemImportFromShareableHandle of chunk ", i));
  CUmemAllocationProp prop{};
  check_cu(driver().cuMemGetAllocationPropertiesFromHandle(&prop, imported[0].h),
           "cuda_ipc: cuMemGetAllocationPropertiesFromHandle");
  std::size_t granularity = 0;
  check_cu(
      driver().cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
      "cuda_ipc: cuMemGetAllocationGranularity");
  auto mapping = std::make_unique<VmmMapping>(bytes, granularity, device_);
  for (std::size_t i = 0; i < fds.size(); ++i) {
    ChunkEntry c;
    std::memcpy(&c, handle.data() + i * sizeof(c), sizeof(c));
    if (c.offset + c.bytes > bytes)
      fail(Errc::protocol, "cuda_ipc: VMM chunk ", i, " ends at byte ", c.offset + c.bytes,
           " of a ", bytes, "-byte region");
    mapping->map(c.offset, c.bytes, imported[i].h);
  }
  mapping->grant(device_);
  return mapping;  // the mappings hold the chunks; our handles are released
}

std::unique_ptr<Copy> CudaMemory::copy(void* dst, const Buffer& src) {
  DeviceGuard g(device_);
  cudaEvent_t event = nullptr;
  check_cuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cuda_ipc: cudaEventCreate");
  auto copy = std::make_unique<CudaCopy>(event, device_, src.bytes);
  check_cuda(cudaMemcpyAsync(dst, src.data, src.bytes, cudaMemcpyDefault, stream_),
             cat("cuda_ipc: cudaMemcpyAsync of ", src.bytes, " bytes"));
  check_cuda(cudaEventRecord(event, stream_), "cuda_ipc: cudaEventRecord");
  return copy;
}

}  // namespace

}  // namespace weightsync::transport::cuda_ipc

namespace weightsync::transport {

std::unique_ptr<Transport> make_cuda_ipc_transport(const TransportOptions& options) {
  return std::make_unique<cuda_ipc::IpcTransport>(
      options, std::make_unique<cuda_ipc::CudaMemory>(options.device), "cuda_ipc");
}

}  // namespace weightsync::transport
