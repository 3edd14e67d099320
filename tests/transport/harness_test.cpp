// The multi-process harness (see harness.h) and the peer entry point.
#include "harness.h"

#include "core/cuda/gpu.h"

#include <weightsync/store.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <thread>

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef WEIGHTSYNC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

extern char** environ;

namespace weightsync::transport_test {
namespace {

constexpr std::size_t kAlign = 64;

std::string self_exe() {
  return std::filesystem::read_symlink("/proc/self/exe").string();
}

// A peer process: WS_TP_SCENARIO names the scenario, WS_TP_TRANSPORT the
// transport, WS_TP_RANK / WS_TP_WORLD its place, WS_TP_STORE / WS_TP_PREFIX
// the bootstrap store.
int run_peer(const char* scenario) {
  try {
    const auto env = [](const char* name) {
      const char* v = std::getenv(name);
      if (!v) fail(Errc::invalid_argument, "peer: ", name, " not set");
      return std::string(v);
    };
    auto t = make_test_transport(env("WS_TP_TRANSPORT"), env("WS_TP_STORE"),
                                 std::stoi(env("WS_TP_RANK")), std::stoi(env("WS_TP_WORLD")),
                                 env("WS_TP_PREFIX"));
    ScenarioContext ctx{*t, memory_for(*t), nullptr};
    find_scenario(scenario)(ctx);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "transport test peer (" << scenario << ", rank " << std::getenv("WS_TP_RANK")
              << "): " << e.what() << std::endl;
    return 1;
  }
}

// Runs before GoogleTest's main in a spawned peer, and never returns there.
const bool peer_mode = [] {
  const char* scenario = std::getenv("WS_TP_SCENARIO");
  if (!scenario) return false;
  const int rc = run_peer(scenario);
  std::cerr.flush();
  std::_Exit(rc);
}();

}  // namespace

void require(bool condition, const std::string& message) {
  if (!condition) fail(Errc::internal, "check failed: ", message);
}

std::string require_error(const std::function<void()>& op, Errc code,
                          const std::vector<std::string>& parts) {
  try {
    op();
  } catch (const Error& e) {
    const std::string what = e.what();
    require(e.code() == code, cat("expected Errc::", errc_name(code),
                                  ", got Errc::", errc_name(e.code()), ": ", what));
    for (const auto& p : parts)
      require(what.find(p) != std::string::npos, cat("message '", what, "' lacks '", p, "'"));
    return what;
  }
  fail(Errc::internal, "check failed: expected Errc::", errc_name(code), ", nothing was thrown");
}

uint8_t pattern_byte(uint64_t seed, std::size_t i) {
  return static_cast<uint8_t>(i * 0x6F ^ (i >> 8) * 0x1D ^ (i >> 16) * 0x3 ^ seed * 0x5B ^
                              (seed >> 8) * 0x11);
}

TestBuffer::TestBuffer(std::size_t bytes, MemoryKind memory, std::size_t offset)
    : bytes_(bytes), memory_(memory) {
  const std::size_t total = (bytes + offset + kAlign) / kAlign * kAlign;
  if (memory == MemoryKind::host) {
    base_ = shared_host_alloc(total);  // other processes can map it (ipc_host_test.cpp)
  } else {
#ifdef WEIGHTSYNC_HAVE_CUDA
    if (cudaMalloc(&base_, total) != cudaSuccess) base_ = nullptr;
#endif
  }
  if (!base_) fail(Errc::io, "test buffer: cannot allocate ", total, " bytes");
  data_ = static_cast<char*>(base_) + offset;
}

TestBuffer::~TestBuffer() {
  if (memory_ == MemoryKind::host) shared_host_free(base_);
#ifdef WEIGHTSYNC_HAVE_CUDA
  else
    cudaFree(base_);
#endif
}

void TestBuffer::fill(uint64_t seed) {
  std::vector<uint8_t> host;
  uint8_t* p = static_cast<uint8_t*>(data_);
  if (memory_ != MemoryKind::host) {
    host.resize(bytes_);
    p = host.data();
  }
  for (std::size_t i = 0; i < bytes_; ++i) p[i] = pattern_byte(seed, i);
#ifdef WEIGHTSYNC_HAVE_CUDA
  // Complete on the device before returning: a transport copies on its own
  // stream, which nothing orders after this one (and a pageable-source
  // cudaMemcpy may return before the data has landed).
  if (memory_ != MemoryKind::host) {
    cudaMemcpy(data_, p, bytes_, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();
  }
#endif
}

void TestBuffer::zero() {
  if (memory_ == MemoryKind::host) std::memset(data_, 0, bytes_);
#ifdef WEIGHTSYNC_HAVE_CUDA
  else {
    cudaMemset(data_, 0, bytes_);
    cudaDeviceSynchronize();  // a late memset would wipe what a peer wrote
  }
#endif
}

void TestBuffer::write(const void* data, std::size_t n) {
  if (n > bytes_) fail(Errc::internal, "TestBuffer::write of ", n, " bytes into ", bytes_);
  if (memory_ == MemoryKind::host) std::memcpy(data_, data, n);
#ifdef WEIGHTSYNC_HAVE_CUDA
  else {
    cudaMemcpy(data_, data, n, cudaMemcpyHostToDevice);
    cudaDeviceSynchronize();  // complete before a transport reads it (see fill)
  }
#endif
}

void TestBuffer::copy_to(void* dst, std::size_t n) const {
  if (n > bytes_) fail(Errc::internal, "TestBuffer::copy_to of ", n, " bytes from ", bytes_);
  if (memory_ == MemoryKind::host) std::memcpy(dst, data_, n);
#ifdef WEIGHTSYNC_HAVE_CUDA
  else {
    cudaMemcpy(dst, data_, n, cudaMemcpyDeviceToDevice);
    cudaDeviceSynchronize();
  }
#endif
}

std::vector<uint8_t> TestBuffer::read() const {
  std::vector<uint8_t> out(bytes_);
  if (memory_ == MemoryKind::host) std::memcpy(out.data(), data_, bytes_);
#ifdef WEIGHTSYNC_HAVE_CUDA
  else
    cudaMemcpy(out.data(), data_, bytes_, cudaMemcpyDeviceToHost);
#endif
  return out;
}

std::size_t TestBuffer::differing(uint64_t seed, std::size_t n) const {
  std::vector<uint8_t> copy;
  const uint8_t* p = static_cast<const uint8_t*>(data_);
  if (memory_ != MemoryKind::host) {
    copy = read();
    p = copy.data();
  }
  std::size_t diff = 0;
  for (std::size_t i = 0; i < n; ++i) diff += p[i] != pattern_byte(seed, i);
  return diff;
}

bool TestBuffer::holds(uint64_t seed, std::size_t n) const {
  return differing(seed, n) == 0;
}

PeerProcesses::PeerProcesses(const std::string& scenario, const std::string& transport, int world,
                             const std::string& store_dir, const std::string& prefix) {
  const std::string exe = self_exe();
  for (int rank = 1; rank < world; ++rank) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e)
      if (std::strncmp(*e, "WS_TP_", 6) != 0) env.emplace_back(*e);
    env.push_back("WS_TP_SCENARIO=" + scenario);
    env.push_back("WS_TP_TRANSPORT=" + transport);
    env.push_back("WS_TP_RANK=" + std::to_string(rank));
    env.push_back("WS_TP_WORLD=" + std::to_string(world));
    env.push_back("WS_TP_STORE=" + store_dir);
    env.push_back("WS_TP_PREFIX=" + prefix);
    std::vector<char*> envp;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::string arg0 = exe;
    char* argv[] = {arg0.data(), nullptr};
    pid_t pid = 0;
    if (int rc = posix_spawn(&pid, exe.c_str(), nullptr, nullptr, argv, envp.data()); rc != 0)
      fail(Errc::io, "cannot spawn transport test peer rank ", rank, ": ", std::strerror(rc));
    pids_.push_back(pid);
    killed_.push_back(false);
  }
}

PeerProcesses::~PeerProcesses() {
  for (std::size_t i = 0; i < pids_.size(); ++i) {
    if (pids_[i] <= 0) continue;
    ::kill(pids_[i], SIGKILL);
    ::waitpid(pids_[i], nullptr, 0);
  }
}

void PeerProcesses::kill(int rank) {
  const std::size_t i = static_cast<std::size_t>(rank - 1);
  require(i < pids_.size() && pids_[i] > 0, cat("no running peer rank ", rank));
  ::kill(pids_[i], SIGKILL);
  killed_[i] = true;
}

std::string PeerProcesses::join(std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::string failures;
  for (std::size_t i = 0; i < pids_.size(); ++i) {
    const int rank = static_cast<int>(i) + 1;
    int status = 0;
    pid_t r = 0;
    while ((r = ::waitpid(pids_[i], &status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(10ms);
    if (r == 0) {
      failures += cat("rank ", rank, " did not exit within ", timeout.count(), " s; ");
      continue;  // the destructor kills it
    }
    pids_[i] = 0;
    if (killed_[i]) continue;
    if (WIFSIGNALED(status))
      failures += cat("rank ", rank, " died of signal ", WTERMSIG(status), "; ");
    else if (WEXITSTATUS(status) != 0)
      failures += cat("rank ", rank, " exited with status ", WEXITSTATUS(status),
                      " (its error is on stderr); ");
  }
  return failures;
}

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "ws-transport-XXXXXX").string();
  if (!::mkdtemp(tmpl.data())) fail(Errc::io, "mkdtemp ", tmpl, ": ", std::strerror(errno));
  path = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
}

std::string not_built_reason(const std::string& name) {
  std::string base = name.substr(0, name.find('?'));
  while (base.rfind("fault:", 0) == 0) base = base.substr(std::strlen("fault:"));
  const auto built = transport_names();
  if (std::find(built.begin(), built.end(), base) != built.end()) return "";
  // The build option that decides each backend (WEIGHTSYNC_WITH_*).
  static const std::map<std::string, std::string> needs{
      {"cuda_ipc", "CUDA"}, {"nccl", "NCCL"}, {"ucx", "UCX"}};
  const auto it = needs.find(base);
  if (it == needs.end()) return cat("there is no '", base, "' transport in this build");
  return cat("weightsync was built without ", it->second, ": no ", base, " transport");
}

MemoryKind memory_for(const Transport& t) {
  return t.capabilities().host_memory ? MemoryKind::host : MemoryKind::cuda;
}

std::unique_ptr<Transport> make_test_transport(const std::string& name, const std::string& dir,
                                               int rank, int world, const std::string& prefix) {
  // The store outlives the transport's bootstrap: transports keep a pointer
  // for their first contact with each peer.
  static std::vector<std::unique_ptr<Store>> stores;
  stores.push_back(make_file_store(dir));
  TransportOptions o;
  o.name = name;
  o.store = stores.back().get();
  o.prefix = prefix;
  o.rank = rank;
  o.world = world;
  o.bootstrap_timeout = 60s;
  // NCCL takes one GPU per rank (it refuses two ranks of one communicator on
  // one GPU); the conformance suite skips worlds larger than the GPU count.
  if (name.rfind("nccl", 0) == 0) o.device = rank % std::max(1, gpu::device_count());
  return make_transport(o);
}

std::string run_scenario(const std::string& scenario, const std::string& transport, int world) {
  TempDir dir;
  PeerProcesses peers(scenario, transport, world, dir.path, "t");
  {
    auto t = make_test_transport(transport, dir.path, 0, world);
    ScenarioContext ctx{*t, memory_for(*t), [&](int r) { peers.kill(r); }};
    find_scenario(scenario)(ctx);
  }
  return peers.join(std::chrono::seconds(120));
}

}  // namespace weightsync::transport_test
