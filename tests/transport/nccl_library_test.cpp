// weightsync brings no shared NCCL or CUDA runtime of its own into a process
// (they would clash with PyTorch's): the CUDA runtime is linked statically
// and NCCL is loaded at run time, the copy already in the process first
// (src/transport/nccl/nccl_library.h). These run without a GPU.
#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include <dlfcn.h>
#include <link.h>

#ifdef WEIGHTSYNC_HAVE_NCCL
#include "transport/nccl/nccl_library.h"
#endif

namespace weightsync::transport_test {
namespace {

// The shared objects loaded before main(): the binary's DT_NEEDED closure,
// recorded at static initialization, before any test could dlopen anything.
std::vector<std::string> objects_at_startup() {
  std::vector<std::string> names;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        if (info->dlpi_name && *info->dlpi_name)
          static_cast<std::vector<std::string>*>(out)->push_back(info->dlpi_name);
        return 0;
      },
      &names);
  return names;
}
const std::vector<std::string> kStartupObjects = objects_at_startup();

TEST(SharedLibraries, NeitherNcclNorTheCudaRuntimeIsLinked) {
  ASSERT_FALSE(kStartupObjects.empty()) << "dl_iterate_phdr listed no shared object (libc?)";
  for (const std::string& name : kStartupObjects) {
    EXPECT_EQ(name.find("libnccl"), std::string::npos) << name << " is linked";
    EXPECT_EQ(name.find("libcudart"), std::string::npos) << name << " is linked";
  }
}

#ifdef WEIGHTSYNC_HAVE_NCCL

using transport::nccl::kMinNcclVersion;
using transport::nccl::load_nccl_library;
using transport::nccl::NcclLibrary;

TEST(NcclLibrary, NoLibraryIsUnsupportedNamingWhatWasTried) {
  const std::string name = "libnccl-weightsync-test-absent.so.2";
  try {
    load_nccl_library(name);
    FAIL() << name << " was loaded";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), Errc::unsupported) << what;
    EXPECT_NE(what.find("nccl transport"), std::string::npos) << what;
    EXPECT_NE(what.find(name + " is not loaded in this process"), std::string::npos) << what;
    EXPECT_NE(what.find("dlopen(\"" + name + "\") failed"), std::string::npos) << what;
    EXPECT_NE(what.find("LD_LIBRARY_PATH"), std::string::npos) << what;
  }
}

// The real libnccl.so.2 by the normal search, then the same file again, now
// found among the loaded objects (as PyTorch's would be).
TEST(NcclLibrary, LoadsByNameThenReusesTheLoadedOne) {
  const bool loaded_before = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD) != nullptr;
  NcclLibrary first;
  try {
    first = load_nccl_library("libnccl.so.2");
  } catch (const Error& e) {
    if (e.code() != Errc::unsupported) throw;
    GTEST_SKIP() << "no usable libnccl.so.2 on this machine: " << e.what();
  }
  EXPECT_EQ(first.reused, loaded_before);
  EXPECT_NE(first.path.find("libnccl"), std::string::npos) << first.path;
  EXPECT_GE(first.version, kMinNcclVersion);
  EXPECT_TRUE(first.get_error_string && first.get_last_error && first.get_unique_id &&
              first.comm_init_rank_config && first.comm_get_async_error && first.comm_abort &&
              first.comm_destroy && first.group_start && first.group_end && first.send &&
              first.recv && first.broadcast);
  EXPECT_NE(std::string(first.get_error_string(ncclInvalidArgument)).find("invalid argument"),
            std::string::npos);

  const NcclLibrary again = load_nccl_library("libnccl.so.2");
  EXPECT_TRUE(again.reused);
  EXPECT_EQ(again.path, first.path);
  EXPECT_EQ(again.send, first.send);
}

TEST(NcclLibrary, TheProcessLoadsItOnce) {
  const NcclLibrary* lib = nullptr;
  try {
    lib = &transport::nccl::nccl_library();
  } catch (const Error& e) {
    if (e.code() != Errc::unsupported) throw;
    GTEST_SKIP() << "no usable libnccl.so.2 on this machine: " << e.what();
  }
  EXPECT_EQ(&transport::nccl::nccl_library(), lib);
}

#else

TEST(NcclLibrary, NotBuilt) {
  GTEST_SKIP() << "weightsync was built without NCCL: no nccl transport";
}

#endif  // WEIGHTSYNC_HAVE_NCCL

}  // namespace
}  // namespace weightsync::transport_test
