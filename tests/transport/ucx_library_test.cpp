// Which UCX the process runs with, and what the UCX transport does about CUDA
// memory with it. weightsync links UCX by its soname, so the library is the
// one the loader found: Debian's 1.13 (no CUDA) here, or PyPI's libucx-cu13
// (1.22, built with CUDA) when its lib directory comes first in
// LD_LIBRARY_PATH. CTest runs this binary's UCX cases both ways
// (UcxWheel.TransportSuite, tests/transport/extra.cmake), and then
// WEIGHTSYNC_TEST_UCX_DIR names the directory the library must come from.
#include "harness.h"
#include "transport/ucx/ucx_worker.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

namespace weightsync::transport_test {
namespace {

using transport::ucx::ucx_library;

class UcxLibrary : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto names = transport_names();
    if (std::find(names.begin(), names.end(), "ucx") == names.end())
      GTEST_SKIP() << not_built_reason("ucx");
  }
  TempDir dir;
};

TEST_F(UcxLibrary, NamesTheVersionAndTheFileItWasLoadedFrom) {
  const auto& lib = ucx_library();
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  EXPECT_EQ(lib.version, cat(major, ".", minor, ".", release));
  ASSERT_FALSE(lib.path.empty());
  EXPECT_NE(std::filesystem::path(lib.path).filename().string().find("libucp.so"),
            std::string::npos)
      << lib.path;
  EXPECT_TRUE(std::filesystem::exists(lib.path)) << lib.path;
  if (const char* expected = std::getenv("WEIGHTSYNC_TEST_UCX_DIR")) {
    const auto dir = std::filesystem::canonical(expected);
    const auto file = std::filesystem::canonical(lib.path);
    EXPECT_EQ(file.parent_path(), dir) << "loaded " << file << ", expected a UCX from " << dir;
  }
  auto t = make_test_transport("ucx?tls=tcp,self", dir.path, 0, 1);
  EXPECT_EQ(t->capabilities().library, lib.describe());
  EXPECT_NE(lib.describe().find(lib.version), std::string::npos);
}

TEST_F(UcxLibrary, CudaRequiredWhereUcxCannotNamesTheLibraryAndWhy) {
  auto probe = make_test_transport("ucx?tls=tcp,self", dir.path, 0, 1);
  if (probe->capabilities().cuda_memory)
    GTEST_SKIP() << "this UCX moves CUDA memory here: " << probe->capabilities().library;
  probe.reset();
  const auto& lib = ucx_library();
  // Built without CUDA (Debian's): the way to one that has it. With a CUDA
  // module but no driver or GPU (libucx-cu13 on this machine): that.
  const std::string why = lib.cuda_module.empty() ? "libucx-cu13" : "no CUDA driver or GPU";
  require_error([&] { make_test_transport("ucx?tls=tcp,self&cuda=require", dir.path, 0, 1); },
                Errc::unsupported, {"cuda=require", "UCX " + lib.version, lib.path, why});
  // "auto" (the default) still works, for host memory, and says why not on
  // the first CUDA buffer.
  auto t = make_test_transport("ucx?tls=tcp,self&cuda=auto", dir.path, 0, 1);
  EXPECT_FALSE(t->capabilities().cuda_memory);
  Buffer device{reinterpret_cast<void*>(0x1000), 64, MemoryKind::cuda, 0, nullptr};
  require_error([&] { (void)t->send(0, 0, device); }, Errc::unsupported,
                {"send to rank 0", "64 bytes in CUDA memory", lib.path, why});
  require_error([&] { t->register_memory(device); }, Errc::unsupported,
                {"64 bytes of CUDA memory", lib.path, why});
}

TEST_F(UcxLibrary, CudaOffKeepsGpuTensorsOnHostSlotsAndSaysSo) {
  auto t = make_test_transport("ucx?tls=tcp,self&cuda=off", dir.path, 0, 1);
  EXPECT_FALSE(t->capabilities().cuda_memory);
  EXPECT_TRUE(t->capabilities().host_memory);
  Buffer device{reinterpret_cast<void*>(0x1000), 64, MemoryKind::cuda, 0, nullptr};
  require_error([&] { t->register_memory(device); }, Errc::unsupported, {"cuda=off"});
}

TEST_F(UcxLibrary, UnknownCudaModeIsRefused) {
  require_error([&] { make_test_transport("ucx?tls=tcp,self&cuda=yes", dir.path, 0, 1); },
                Errc::invalid_argument, {"cuda=yes", "auto, require or off"});
}

}  // namespace
}  // namespace weightsync::transport_test
