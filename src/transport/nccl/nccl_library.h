// NCCL, loaded at run time instead of linked.
//
// weightsync shares its process with PyTorch, which brings its own libnccl
// (from the nvidia-nccl wheel), usually newer than the system's. Linking
// libnccl.so.2 would let whichever of the two the loader met first serve
// both, and torch then fails to import (undefined symbol ncclCommResume) when
// weightsync was imported first. So only nccl.h is used at build time, and
// the functions the transport calls are resolved from libnccl.so.2:
//   1. the libnccl.so.2 already loaded in the process, if any (dlopen with
//      RTLD_NOLOAD, matched by its soname): PyTorch's, when torch was
//      imported first, so both use one NCCL;
//   2. otherwise dlopen("libnccl.so.2"), the dynamic loader's normal search
//      (LD_LIBRARY_PATH, the ld.so cache, the system directories).
// The library, once found, stays loaded for the life of the process.
#pragma once

#include <nccl.h>

#include <string>

namespace weightsync::transport::nccl {

// The NCCL entry points the transport uses, typed by nccl.h's declarations.
struct NcclLibrary {
  std::string path;     // the file the functions come from
  bool reused = false;  // it was already loaded (step 1 above)
  int version = 0;      // ncclGetVersion, e.g. 22809 for 2.28.9

  decltype(&::ncclGetVersion) get_version = nullptr;
  decltype(&::ncclGetErrorString) get_error_string = nullptr;
  decltype(&::ncclGetLastError) get_last_error = nullptr;
  decltype(&::ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&::ncclCommInitRankConfig) comm_init_rank_config = nullptr;
  decltype(&::ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&::ncclCommAbort) comm_abort = nullptr;
  decltype(&::ncclCommDestroy) comm_destroy = nullptr;
  decltype(&::ncclGroupStart) group_start = nullptr;
  decltype(&::ncclGroupEnd) group_end = nullptr;
  decltype(&::ncclSend) send = nullptr;
  decltype(&::ncclRecv) recv = nullptr;
  decltype(&::ncclBroadcast) broadcast = nullptr;
};

// The oldest NCCL with everything above (non-blocking communicators with
// ncclCommInitRankConfig came in 2.14).
constexpr int kMinNcclVersion = 21400;

// The process's NCCL, found by the lookup order above on the first call.
// Throws Errc::unsupported, naming what was tried, when no libnccl.so.2 can
// be loaded, or when it lacks a function or is older than kMinNcclVersion;
// a later call tries again.
const NcclLibrary& nccl_library();

// The same lookup for the library `soname` (tests: a name that does not
// exist shows the failure). Each call resolves anew; nothing is unloaded.
NcclLibrary load_nccl_library(const std::string& soname);

}  // namespace weightsync::transport::nccl
