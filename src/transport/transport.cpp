// The transport registry and the parts of the interface every backend shares:
// bounded waits, request descriptions and the point-to-point broadcast.
#include <weightsync/backend/transport.h>
#include <weightsync/error.h>

#include <cstring>

#include "builtin.h"
#include "core/cuda/gpu.h"
#include "transport/staging.h"

#include <algorithm>
#include <mutex>
#include <new>
#include <thread>

namespace weightsync {
namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, TransportFactory> factories;
  std::map<std::string, HostAllocator> host_allocators;
  std::map<std::string, std::vector<std::string>> params;  // the built-in backends' ?keys
};

// Backends live in a static library, so self-registering globals in their
// files could be dropped by the linker; the registry adds the built-in ones
// from one table on first use instead.
Registry& registry() {
  static Registry* r = [] {
    auto* reg = new Registry;
    for (const auto& builtin : transport::builtin_transports()) {
      reg->factories.emplace(builtin.name, builtin.factory);
      if (builtin.host) reg->host_allocators.emplace(builtin.name, builtin.host);
      if (builtin.params) reg->params.emplace(builtin.name, *builtin.params);
    }
    return reg;
  }();
  return *r;
}

std::string hex(Tag tag) {
  std::ostringstream out;
  out << "0x" << std::hex << tag;
  return out.str();
}

// "fault:ucx?seed=3&corrupt_recv=1" -> name "fault:ucx", params {seed: 3, ...}.
void split_name_params(TransportOptions& options) {
  const auto q = options.name.find('?');
  if (q == std::string::npos) return;
  const std::string query = options.name.substr(q + 1);
  options.name.resize(q);
  size_t start = 0;
  while (start <= query.size()) {
    size_t end = query.find('&', start);
    if (end == std::string::npos) end = query.size();
    const std::string pair = query.substr(start, end - start);
    if (!pair.empty()) {
      const auto eq = pair.find('=');
      if (eq == std::string::npos || eq == 0)
        fail(Errc::invalid_argument, "transport '", options.name, "': option '", pair,
             "' is not key=value");
      options.params[pair.substr(0, eq)] = pair.substr(eq + 1);
    }
    start = end + 1;
  }
}

// Fan-out broadcast for backends without a collective: the root sends to every
// other rank, the others receive from the root.
class FanoutBroadcast final : public Request {
 public:
  FanoutBroadcast(Transport& t, const Buffer& buffer, int root, const std::vector<int>& ranks,
                  Tag tag)
      : Request(t.name(), Kind::broadcast, root, tag, buffer.bytes) {
    if (std::find(ranks.begin(), ranks.end(), root) == ranks.end())
      fail(Errc::invalid_argument, "broadcast over ", t.name(), ": root rank ", root,
           " is not among the ", ranks.size(), " ranks");
    if (t.rank() == root) {
      for (int r : ranks)
        if (r != root) parts_.push_back(t.send(r, tag, buffer));
    } else if (std::find(ranks.begin(), ranks.end(), t.rank()) != ranks.end()) {
      parts_.push_back(t.recv(root, tag, buffer));
    } else {
      fail(Errc::invalid_argument, "broadcast over ", t.name(), ": rank ", t.rank(),
           " is not among the ranks of the broadcast");
    }
  }
  bool test() override {
    bool done = true;
    for (auto& p : parts_) done = p->test() && done;
    return done;
  }
  void cancel() override {
    for (auto& p : parts_) p->cancel();
  }
  std::size_t transferred() const override { return bytes(); }

 private:
  std::vector<std::unique_ptr<Request>> parts_;
};

}  // namespace

bool MemoryRegion::contains(const Buffer& b) const {
  const auto* base = static_cast<const char*>(data_);
  const auto* p = static_cast<const char*>(b.data);
  return p >= base && b.bytes <= bytes_ && static_cast<std::size_t>(p - base) <= bytes_ - b.bytes;
}

std::string Request::describe() const {
  const char* what = kind_ == Kind::send     ? "send to"
                     : kind_ == Kind::recv   ? "receive from"
                     : kind_ == Kind::expose ? "memory lent to"
                     : kind_ == Kind::map    ? "mapping the memory of"
                                             : "broadcast from";
  return cat(what, " rank ", peer_, ", tag ", hex(tag_), ", ", bytes_, " bytes, over ", transport_);
}

void Transport::reconnect(int peer) {
  fail(Errc::unsupported, name(), ": cannot reconnect to rank ", peer,
       " (a new process took it); this backend keeps its peers for its lifetime");
}

std::unique_ptr<Request> Transport::expose(int peer, Tag, const std::vector<Buffer>&) {
  fail(Errc::unsupported, name(), ": cannot lend memory to rank ", peer,
       " (capabilities().maps_peer_memory is false; cuda_ipc can)");
}

std::unique_ptr<Request> Transport::map_exposed(int peer, Tag, std::vector<void*>*) {
  fail(Errc::unsupported, name(), ": cannot map the memory of rank ", peer,
       " (capabilities().maps_peer_memory is false; cuda_ipc can)");
}

std::size_t Request::wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int spins = 0;
  while (!test()) {
    if (std::chrono::steady_clock::now() >= deadline)
      fail(Errc::timeout, describe(), ": not complete after ", timeout.count(), " ms");
    poll_pause(spins);
  }
  return transferred();
}

void poll_pause(int& spins) {
  if (spins < 64)
    ++spins;
  else
    std::this_thread::sleep_for(std::chrono::microseconds(20));
}

std::unique_ptr<Request> Transport::broadcast(const Buffer& buffer, int root,
                                              const std::vector<int>& ranks, Tag tag) {
  return std::make_unique<FanoutBroadcast>(*this, buffer, root, ranks, tag);
}

void wait_all(const std::vector<std::unique_ptr<Request>>& requests,
              std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& r : requests) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    r->wait(std::max(left, std::chrono::milliseconds(0)));
  }
}

void register_transport(const std::string& name, TransportFactory factory) {
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  r.factories[name] = std::move(factory);
  r.params.erase(name);  // a replaced backend reads its own keys
}

namespace transport {

std::string accepted_params(const std::string& name) {
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  const auto it = r.params.find(name);
  if (it == r.params.end()) return "";
  std::string out;
  for (const auto& key : it->second) out += (out.empty() ? "" : ", ") + key;
  return out.empty() ? "none" : out;
}

void check_param(const std::string& transport, const std::string& backend, const std::string& key,
                 const std::string& wrapper_keys) {
  {
    auto& r = registry();
    std::lock_guard lock(r.mutex);
    const auto it = r.params.find(backend);
    if (it == r.params.end()) return;  // a backend of the user's reads its own
    for (const auto& accepted : it->second) {
      const bool prefix = !accepted.empty() && accepted.back() == '*';
      if (prefix ? key.rfind(accepted.substr(0, accepted.size() - 1), 0) == 0 : key == accepted)
        return;
    }
  }
  const std::string wrapper = transport.substr(0, transport.find(':'));
  fail(Errc::invalid_argument, "transport '", transport, "': unknown option '", key, "' (",
       wrapper_keys.empty() ? "" : cat(wrapper, " takes ", wrapper_keys, "; "), backend, " takes ",
       accepted_params(backend), ")");
}

}  // namespace transport

void register_host_allocator(const std::string& name, HostAllocator allocate) {
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  r.host_allocators[name] = std::move(allocate);
}

std::shared_ptr<char> allocate_host_memory(const std::string& name, std::size_t bytes) {
  // The transport that moves the bytes: past the wrappers, before the ?params.
  std::string base = name.substr(0, name.find('?'));
  if (const auto colon = base.rfind(':'); colon != std::string::npos) base = base.substr(colon + 1);
  HostAllocator allocate;
  {
    auto& r = registry();
    std::lock_guard lock(r.mutex);
    if (auto it = r.host_allocators.find(base); it != r.host_allocators.end())
      allocate = it->second;
  }
  return allocate ? allocate(bytes) : heap_host_buffer(bytes);
}

std::vector<std::string> transport_names() {
  auto& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& [name, f] : r.factories) names.push_back(name);
  return names;
}

std::unique_ptr<Transport> make_transport(TransportOptions options) {
  split_name_params(options);
  if (!options.store)
    fail(Errc::invalid_argument, "transport '", options.name, "': no Store given for bootstrap");
  if (options.world < 1 || options.rank < 0 || options.rank >= options.world)
    fail(Errc::invalid_argument, "transport '", options.name, "': rank ", options.rank,
         " outside world of size ", options.world);
  // A wrapper is registered under the part before the first ':'.
  const std::string key = options.name.substr(0, options.name.find(':'));
  TransportFactory factory;
  {
    auto& r = registry();
    std::lock_guard lock(r.mutex);
    auto it = r.factories.find(key);
    if (it == r.factories.end()) {
      std::string known;
      for (const auto& [name, f] : r.factories) known += (known.empty() ? "" : ", ") + name;
      fail(Errc::invalid_argument, "unknown transport '", options.name, "' (built: ", known, ")");
    }
    factory = it->second;
  }
  for (const auto& [param, value] : options.params)
    transport::check_param(options.name, key, param);
  return factory(options);
}

const char* slot_memory_name(SlotMemory memory) noexcept {
  switch (memory) {
    case SlotMemory::host:
      return "host";
    case SlotMemory::pinned:
      return "pinned";
    case SlotMemory::device:
      return "device";
  }
  return "?";
}

Buffer StagingBuffer::buffer(std::size_t offset, std::size_t n) const {
  const bool on_device = memory == SlotMemory::device;
  return Buffer{data + offset, n, on_device ? MemoryKind::cuda : MemoryKind::host,
                on_device ? device : -1, region.get()};
}

std::shared_ptr<char> heap_host_buffer(std::size_t bytes) {
  constexpr std::size_t kAlign = 4096;
  const std::size_t n = std::max<std::size_t>(bytes, 1);
  void* p = ::operator new[](n, std::align_val_t{kAlign});
  std::memset(p, 0, n);
  return std::shared_ptr<char>(static_cast<char*>(p),
                               [](char* q) { ::operator delete[](q, std::align_val_t{kAlign}); });
}

std::shared_ptr<char> Transport::allocate_host(std::size_t bytes) {
  return heap_host_buffer(bytes);
}

StagingBuffer allocate_staging(Transport& transport, std::size_t bytes, SlotMemory memory,
                               int device) {
  StagingBuffer b;
  b.memory = memory;
  b.bytes = bytes;
  if (memory == SlotMemory::host) {
    std::shared_ptr<char> raw = transport.allocate_host(bytes);
    b.data = raw.get();
    b.owner = std::move(raw);
  } else {
    auto mem = std::make_shared<gpu::Memory>(
        bytes, memory == SlotMemory::device ? gpu::MemoryPlace::device : gpu::MemoryPlace::pinned,
        device);
    b.data = mem->data();
    b.device = memory == SlotMemory::device ? device : -1;
    b.owner = std::move(mem);
  }
  b.region = transport.register_memory(b.buffer(0, bytes));
  return b;
}

}  // namespace weightsync
