#include "ucx_worker.h"

#include <weightsync/error.h>

#include <filesystem>
#include <memory>
#include <system_error>

#include <dlfcn.h>

namespace weightsync::transport::ucx {

void check(ucs_status_t status, const std::string& what) {
  if (status != UCS_OK) fail(Errc::transport, what, ": ", ucs_status_string(status));
}

namespace {

bool is_tcp_tuning(const std::string& name) {
  for (const auto& entry : tcp_tuning())
    if (entry.first == name) return true;
  return false;
}

struct ConfigDeleter {
  void operator()(ucp_config_t* c) const { ucp_config_release(c); }
};

std::unique_ptr<ucp_config_t, ConfigDeleter> read_config(
    const std::map<std::string, std::string>& settings) {
  ucp_config_t* raw = nullptr;
  check(ucp_config_read(nullptr, nullptr, &raw), "UCX: reading the configuration");
  std::unique_ptr<ucp_config_t, ConfigDeleter> config(raw);
  for (const auto& [name, value] : settings) {
    ucs_status_t status = ucp_config_modify(config.get(), name.c_str(), value.c_str());
    // Newer UCX (1.22 checked) knows tcp's fields by their full names only
    // and refuses the bare ones that 1.13 needs (see tcp_tuning).
    if (status == UCS_ERR_INVALID_PARAM && is_tcp_tuning(name))
      status = ucp_config_modify(config.get(), ("TCP_" + name).c_str(), value.c_str());
    check(status, cat("UCX: setting UCX_", name, "=", value));
  }
  return config;
}

}  // namespace

// UCX 1.13's rendezvous by PUT over TCP moves large messages at a fraction of
// the link; without PUT, rendezvous streams the data as active messages
// straight into the posted receive buffer. Larger receive segments and more
// polling per progress call keep many-to-many flows moving when ranks
// outnumber cores.
//
// These are transport-level (UCT) settings, yet they go through the context's
// own configuration, never the process environment: ucp_config_modify keeps a
// name it does not know as a "cached key" and applies it to every UCT
// transport the context opens whose configuration has a field of exactly that
// name. Of the transports UCX 1.13 ships (self, tcp, sysv, posix, cma, rc, dc,
// ud, rdmacm) only tcp has RX_SEG_SIZE, PUT_ENABLE and MAX_POLL (checked with
// ucs_config_parser_set_value over UCX's whole configuration table list; the
// endpoint's protocol thresholds, ucp_ep_print_info, equal those of the
// UCX_TCP_* environment variables). The prefixed names (TCP_RX_SEG_SIZE) are
// not recognised by 1.13 and come back as "invalid configurations". UCX warns
// about a cached key that no opened transport used, so they are given only
// when tcp can be in use (selects_tcp). UCX 1.22 (PyPI's libucx-cu13) is the
// other way round: it refuses the bare names as invalid parameters and takes
// TCP_RX_SEG_SIZE and the like as tcp's own fields, so a refused bare name is
// given again with the prefix (read_config), and one binary runs with both.
const std::vector<std::pair<std::string, std::string>>& tcp_tuning() {
  static const std::vector<std::pair<std::string, std::string>> tuning = {
      {"PUT_ENABLE", "n"}, {"RX_SEG_SIZE", "256K"}, {"MAX_POLL", "64"}};
  return tuning;
}

bool selects_tcp(const std::string& tls) {
  if (tls.empty()) return true;
  const bool exclude = tls[0] == '^';
  bool listed = false;
  size_t start = exclude ? 1 : 0;
  while (start <= tls.size()) {
    size_t end = tls.find(',', start);
    if (end == std::string::npos) end = tls.size();
    std::string tl = tls.substr(start, end - start);
    tl = tl.substr(0, tl.find(':'));  // "tcp:aux" names tcp too
    listed |= tl == "tcp" || (!exclude && tl == "all");
    start = end + 1;
  }
  return exclude ? !listed : listed;
}

const UcxLibrary& ucx_library() {
  static const UcxLibrary library = [] {
    UcxLibrary l;
    unsigned major = 0, minor = 0, release = 0;
    ucp_get_version(&major, &minor, &release);
    l.version = cat(major, ".", minor, ".", release);
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&ucp_get_version), &info) && info.dli_fname)
      l.path = info.dli_fname;
    // UCX loads its transport modules from "ucx/" beside libucp.
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!l.path.empty())
      for (const char* name : {"libuct_cuda.so.0", "libuct_cuda.so"}) {
        const fs::path module = fs::path(l.path).parent_path() / "ucx" / name;
        if (fs::exists(module, ec)) {
          l.cuda_module = module.string();
          break;
        }
      }
    return l;
  }();
  return library;
}

std::string UcxLibrary::describe() const {
  return cat("UCX ", version, " (", path.empty() ? std::string("location unknown") : path, ")");
}

std::string UcxLibrary::why_no_cuda() const {
  if (!cuda_module.empty())
    return cat(describe(), " has a CUDA module (", cuda_module,
               ") but reports no CUDA memory: no CUDA driver or GPU was found");
  return cat(describe(),
             " was built without CUDA. Use a UCX built with CUDA, such as PyPI's libucx-cu13: "
             "put its lib directory first in LD_LIBRARY_PATH, or in Python set "
             "WEIGHTSYNC_UCX=libucx before importing weightsync (docs/transports.md)");
}

UcxWorker::UcxWorker(const std::map<std::string, std::string>& settings) {
  auto config = read_config(settings);
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG;
  check(ucp_init(&params, config.get(), &context_), "UCX: ucp_init");

  // From here on the destructor does not run if we throw, so undo by hand.
  try {
    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    // One thread drives a transport at a time (see transport.h).
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    check(ucp_worker_create(context_, &wparams, &worker_), "UCX: ucp_worker_create");

    ucp_address_t* addr = nullptr;
    size_t len = 0;
    check(ucp_worker_get_address(worker_, &addr, &len), "UCX: ucp_worker_get_address");
    const auto* bytes = reinterpret_cast<const uint8_t*>(addr);
    address_.assign(bytes, bytes + len);
    ucp_worker_release_address(worker_, addr);

    ucp_context_attr_t attr{};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    check(ucp_context_query(context_, &attr), "UCX: ucp_context_query");
    cuda_memory_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  } catch (...) {
    if (worker_) ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
    throw;
  }
}

UcxWorker::~UcxWorker() {
  ucp_worker_destroy(worker_);
  ucp_cleanup(context_);
}

}  // namespace weightsync::transport::ucx
