// cuda_ipc on a GPU, beyond the conformance suite and ipc_scenarios_test.cpp:
// receives into a cuMem (VMM) range of several physical chunks, as PyTorch's
// expandable segments make them (POSIX-fd handles passed between processes),
// and the memory it refuses, naming the operation and why. Skipped, with the
// reason, where no GPU is usable.
#include "harness.h"

#include <gtest/gtest.h>

#include <algorithm>

#ifdef WEIGHTSYNC_HAVE_CUDA
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#endif

namespace weightsync::transport_test {

namespace {

constexpr auto kWait = std::chrono::milliseconds(60000);

// A world of one over cuda_ipc, or the reason there is none here: not built
// (no CUDA), or no usable GPU.
std::unique_ptr<Transport> gpu_transport(const TempDir& dir, std::string& why) {
  why = not_built_reason("cuda_ipc");
  if (!why.empty()) return nullptr;
  try {
    return make_test_transport("cuda_ipc", dir.path, 0, 1, "gpu");
  } catch (const Error& e) {
    if (e.code() != Errc::unsupported) throw;
    why = e.what();
    return nullptr;
  }
}

#define SKIP_WITHOUT_GPU(t, dir)     \
  std::string why_;                  \
  auto t = gpu_transport(dir, why_); \
  if (!t) GTEST_SKIP() << why_;

#ifdef WEIGHTSYNC_HAVE_CUDA

template <class Fn>
Fn entry(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      !p)
    fail(Errc::unsupported, "no driver entry point ", name);
  return reinterpret_cast<Fn>(p);
}

void check_cu(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) fail(Errc::transport, what, " failed: CUresult ", static_cast<int>(r));
}

// A reserved range with `chunks` physical allocations of the minimum
// granularity mapped side by side, exportable as POSIX file descriptors.
class VmmRange {
 public:
  explicit VmmRange(int chunks) {
    int device = 0;
    cudaGetDevice(&device);
    cudaFree(nullptr);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    check_cu(entry<PFN_cuMemGetAllocationGranularity_v10020>("cuMemGetAllocationGranularity")(
                 &chunk, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
             "cuMemGetAllocationGranularity");
    bytes = chunk * chunks;
    check_cu(entry<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve")(&va_, bytes, 0, 0, 0),
             "cuMemAddressReserve");
    for (int i = 0; i < chunks; ++i) map_chunk(i);
  }
  // Gives chunk i back and maps a new physical allocation at its address, as
  // PyTorch's expandable segments do when they release and regrow memory.
  void remap(int i) {
    cudaDeviceSynchronize();
    check_cu(entry<PFN_cuMemUnmap_v10020>("cuMemUnmap")(va_ + i * chunk, chunk), "cuMemUnmap");
    map_chunk(i);
  }
  ~VmmRange() {
    cudaDeviceSynchronize();
    entry<PFN_cuMemUnmap_v10020>("cuMemUnmap")(va_, bytes);
    entry<PFN_cuMemAddressFree_v10020>("cuMemAddressFree")(va_, bytes);
  }
  char* data() const { return reinterpret_cast<char*>(va_); }
  std::vector<uint8_t> read(std::size_t offset, std::size_t n) const {
    std::vector<uint8_t> out(n);
    cudaMemcpy(out.data(), data() + offset, n, cudaMemcpyDeviceToHost);
    return out;
  }
  std::size_t chunk = 0;
  std::size_t bytes = 0;

 private:
  void map_chunk(int i) {
    CUmemGenericAllocationHandle h = 0;
    check_cu(entry<PFN_cuMemCreate_v10020>("cuMemCreate")(&h, chunk, &prop, 0), "cuMemCreate");
    check_cu(entry<PFN_cuMemMap_v10020>("cuMemMap")(va_ + i * chunk, chunk, 0, h, 0), "cuMemMap");
    entry<PFN_cuMemRelease_v10020>("cuMemRelease")(h);  // the mapping holds it
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    check_cu(entry<PFN_cuMemSetAccess_v10020>("cuMemSetAccess")(va_ + i * chunk, chunk, &access, 1),
             "cuMemSetAccess");
    cudaMemset(data() + i * chunk, 0, chunk);
    cudaDeviceSynchronize();  // before any receive into it is posted
  }
  CUmemAllocationProp prop{};
  CUdeviceptr va_ = 0;
};

#endif  // WEIGHTSYNC_HAVE_CUDA

// Runs everywhere (not labelled gpu): cuda_ipc exists exactly in CUDA builds,
// and without a usable GPU its creation says so.
TEST(CudaIpcBuild, RegisteredWithCudaAndUnsupportedWithoutAGpu) {
  const auto names = transport_names();
  const bool built = std::find(names.begin(), names.end(), "cuda_ipc") != names.end();
#ifdef WEIGHTSYNC_HAVE_CUDA
  EXPECT_TRUE(built);
#else
  EXPECT_FALSE(built);
  EXPECT_EQ(not_built_reason("cuda_ipc"),
            "weightsync was built without CUDA: no cuda_ipc transport");
  GTEST_SKIP() << not_built_reason("cuda_ipc");
#endif
  TempDir dir;
  std::string why;
  if (gpu_transport(dir, why)) GTEST_SKIP() << "a GPU is usable here; the no-GPU path is not";
  EXPECT_NE(why.find("cuda_ipc"), std::string::npos) << why;
  EXPECT_NE(why.find("GPU"), std::string::npos) << why;
}

TEST(CudaIpc, CapabilitiesAreDeviceMemoryOnly) {
  TempDir dir;
  SKIP_WITHOUT_GPU(t, dir);
  const Capabilities c = t->capabilities();
  EXPECT_TRUE(c.cuda_memory);
  EXPECT_FALSE(c.host_memory);
  EXPECT_FALSE(c.native_broadcast);
  EXPECT_EQ(t->name(), "cuda_ipc");
}

TEST(CudaIpc, HostBuffersAreRefusedNamingTheOperation) {
  TempDir dir;
  SKIP_WITHOUT_GPU(t, dir);
  std::vector<char> host(64);
  const Buffer b = host_buffer(host.data(), host.size());
  require_error([&] { (void)t->send(0, 1, b); }, Errc::unsupported,
                {"send to rank 0", "host memory"});
  require_error([&] { (void)t->recv(0, 1, b); }, Errc::unsupported,
                {"receive from rank 0", "host memory"});
  require_error([&] { t->register_memory(b); }, Errc::unsupported, {"register", "host memory"});
}

#ifdef WEIGHTSYNC_HAVE_CUDA

TEST(CudaIpc, StreamOrderedPoolMemoryIsRefusedAtRegistration) {
  TempDir dir;
  SKIP_WITHOUT_GPU(t, dir);
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(&p, 1 << 20, nullptr), cudaSuccess);
  cudaStreamSynchronize(nullptr);
  const Buffer b{p, 1 << 20, MemoryKind::cuda, 0, nullptr};
  require_error([&] { t->register_memory(b); }, Errc::unsupported, {"cudaMallocAsync"});
  cudaFreeAsync(p, nullptr);
  cudaStreamSynchronize(nullptr);
}

TEST(CudaIpc, ReceivesIntoAVmmRangeAcrossItsChunks) {
  TempDir dir;
  SKIP_WITHOUT_GPU(t, dir);
  t.reset();
  const std::string failures = run_scenario("cuda_ipc_vmm", "cuda_ipc", 2);
  EXPECT_EQ(failures, "");
}

#endif  // WEIGHTSYNC_HAVE_CUDA

}  // namespace

// Rank 0 receives into a three-chunk VMM range: a message across all three
// chunks at an offset, one inside the last chunk, one through the registered
// range, and one after the middle chunk was replaced by a new allocation.
// Rank 1 sends from ordinary cudaMalloc memory.
void cuda_ipc_vmm(ScenarioContext& c) {
#ifdef WEIGHTSYNC_HAVE_CUDA
  Transport& t = c.transport;
  if (t.rank() == 1) {
    VmmRange probe(1);  // only for the chunk size both sides use
    const std::size_t chunk = probe.chunk;
    const std::size_t sizes[] = {chunk + 100, 1000, 2 * chunk, chunk + 100};
    for (int i = 0; i < 4; ++i) {
      TestBuffer out(sizes[i], MemoryKind::cuda);
      out.fill(60 + i);
      t.send(0, 60 + i, out.buffer())->wait(kWait);
    }
  } else {
    VmmRange range(3);
    const std::size_t chunk = range.chunk;
    struct Case {
      std::size_t offset, bytes;
      bool registered;
    } cases[] = {{chunk - 50, chunk + 100, false},
                 {2 * chunk + 10, 1000, false},
                 {chunk / 2, 2 * chunk, true},
                 {chunk - 50, chunk + 100, false}};
    auto region = t.register_memory(Buffer{range.data(), range.bytes, MemoryKind::cuda, 0});
    for (int i = 0; i < 4; ++i) {
      const Case& k = cases[i];
      // The last message finds the middle chunk replaced: it must land in the
      // new memory, not in a stale mapping of the old chunk.
      if (i == 3) range.remap(1);
      Buffer b{range.data() + k.offset, k.bytes, MemoryKind::cuda, 0,
               k.registered ? region.get() : nullptr};
      require(t.recv(1, 60 + i, b)->wait(kWait) == k.bytes, cat("VMM message ", i, " size"));
      const auto got = range.read(k.offset, k.bytes);
      for (std::size_t j = 0; j < k.bytes; ++j)
        if (got[j] != pattern_byte(60 + i, j))
          require(false, cat("VMM message ", i, ": byte ", j, " of ", k.bytes, " differs"));
    }
  }
  TestBuffer b(1, MemoryKind::cuda);
  b.zero();
  if (t.rank() == 0)
    t.send(1, 0xB1E, b.buffer())->wait(kWait);
  else
    t.recv(0, 0xB1E, b.buffer())->wait(kWait);
#else
  fail(Errc::unsupported, "cuda_ipc_vmm needs a build with CUDA");
#endif
}

}  // namespace weightsync::transport_test
