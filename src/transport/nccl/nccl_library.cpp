#include "nccl_library.h"

#include <weightsync/error.h>

#include <dlfcn.h>
#include <link.h>

#include <memory>
#include <mutex>

namespace weightsync::transport::nccl {
namespace {

std::string dl_error() {
  const char* e = dlerror();
  return e ? e : "no reason given";
}

// "2.28.9" from ncclGetVersion's code (X*1000+Y*100+Z before 2.9).
std::string version_str(int code) {
  if (code >= 10000) return cat(code / 10000, ".", code % 10000 / 100, ".", code % 100);
  return cat(code / 1000, ".", code % 1000 / 100, ".", code % 100);
}

// Closes a handle unless release()d: a library that turned out unusable is
// let go again (its refcount, or the whole file if this call loaded it).
struct Handle {
  void* h = nullptr;
  ~Handle() {
    if (h) dlclose(h);
  }
  void* release() {
    void* p = h;
    h = nullptr;
    return p;
  }
};

template <class Fn>
void resolve(void* handle, const NcclLibrary& lib, const char* symbol, Fn& out) {
  dlerror();
  void* p = dlsym(handle, symbol);
  if (!p)
    fail(Errc::unsupported, "nccl transport: ", lib.path, " has no ", symbol, " (", dl_error(),
         "); weightsync needs NCCL ", version_str(kMinNcclVersion), " or newer");
  out = reinterpret_cast<Fn>(p);
}

}  // namespace

NcclLibrary load_nccl_library(const std::string& soname) {
  NcclLibrary lib;
  Handle handle;
  // A libnccl already in the process (PyTorch's) first: a second one, of
  // another version, is what this whole file exists to avoid.
  handle.h = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);
  lib.reused = handle.h != nullptr;
  if (!handle.h) {
    dlerror();
    // RTLD_LOCAL: its symbols do not become the process's for later loads.
    handle.h = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle.h)
      fail(Errc::unsupported, "nccl transport: no NCCL library: ", soname,
           " is not loaded in this process (dlopen with RTLD_NOLOAD), and dlopen(\"", soname,
           "\") failed: ", dl_error(),
           ". Install NCCL (libnccl2, or the nvidia-nccl wheel that PyTorch brings, with torch "
           "imported first) or put its directory in LD_LIBRARY_PATH");
  }
  link_map* map = nullptr;
  lib.path = dlinfo(handle.h, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name && *map->l_name
                 ? map->l_name
                 : soname;

  resolve(handle.h, lib, "ncclGetVersion", lib.get_version);
  if (ncclResult_t r = lib.get_version(&lib.version); r != ncclSuccess)
    fail(Errc::unsupported, "nccl transport: ncclGetVersion of ", lib.path, " failed (ncclResult ",
         static_cast<int>(r), ")");
  if (lib.version < kMinNcclVersion)
    fail(Errc::unsupported, "nccl transport: ", lib.path, " is NCCL ", version_str(lib.version),
         "; weightsync needs NCCL ", version_str(kMinNcclVersion), " or newer");
  resolve(handle.h, lib, "ncclGetErrorString", lib.get_error_string);
  resolve(handle.h, lib, "ncclGetLastError", lib.get_last_error);
  resolve(handle.h, lib, "ncclGetUniqueId", lib.get_unique_id);
  resolve(handle.h, lib, "ncclCommInitRankConfig", lib.comm_init_rank_config);
  resolve(handle.h, lib, "ncclCommGetAsyncError", lib.comm_get_async_error);
  resolve(handle.h, lib, "ncclCommAbort", lib.comm_abort);
  resolve(handle.h, lib, "ncclCommDestroy", lib.comm_destroy);
  resolve(handle.h, lib, "ncclGroupStart", lib.group_start);
  resolve(handle.h, lib, "ncclGroupEnd", lib.group_end);
  resolve(handle.h, lib, "ncclSend", lib.send);
  resolve(handle.h, lib, "ncclRecv", lib.recv);
  resolve(handle.h, lib, "ncclBroadcast", lib.broadcast);
  // Never closed: NCCL keeps threads and state for the life of the process,
  // and communicators may outlive any one transport.
  handle.release();
  return lib;
}

const NcclLibrary& nccl_library() {
  static std::mutex mutex;
  static std::unique_ptr<const NcclLibrary> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (!loaded) loaded = std::make_unique<const NcclLibrary>(load_nccl_library("libnccl.so.2"));
  return *loaded;
}

}  // namespace weightsync::transport::nccl
