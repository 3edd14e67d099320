#include "ucx_worker.h"

#include <weightsync/error.h>

#include <memory>

namespace weightsync::transport::ucx {

void check(ucs_status_t status, const std::string& what) {
  if (status != UCS_OK) fail(Errc::transport, what, ": ", ucs_status_string(status));
}

namespace {

struct ConfigDeleter {
  void operator()(ucp_config_t* c) const { ucp_config_release(c); }
};

std::unique_ptr<ucp_config_t, ConfigDeleter> read_config(
    const std::map<std::string, std::string>& settings) {
  ucp_config_t* raw = nullptr;
  check(ucp_config_read(nullptr, nullptr, &raw), "UCX: reading the configuration");
  std::unique_ptr<ucp_config_t, ConfigDeleter> config(raw);
  for (const auto& [name, value] : settings)
    check(ucp_config_modify(config.get(), name.c_str(), value.c_str()),
          cat("UCX: setting UCX_", name, "=", value));
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
// when tcp can be in use (selects_tcp).
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
