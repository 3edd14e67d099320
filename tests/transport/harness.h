// Multi-process harness for the transport tests. A test runs rank 0 of a
// scenario in the test process and spawns ranks 1..world-1 as separate
// processes: the test binary itself, started with WS_TP_* variables in its
// environment, which runs the scenario from a static initializer (before
// GoogleTest starts) and exits 0 on success or 1 with the error on stderr.
// Ranks bootstrap through a file store in a fresh temp directory.
//
// Scenarios are plain functions run by every rank, branching on the rank;
// a failed check throws (require()), which the parent reports as a test
// failure and a peer turns into a non-zero exit status.
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/error.h>

#include <sys/types.h>
#include <chrono>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace weightsync::transport_test {

using namespace std::chrono_literals;

// A transport configuration: a name for make_transport (with ?params).
struct TransportSpec {
  std::string label;  // the test-name suffix, e.g. "ucx_tcp"
  std::string name;   // e.g. "ucx?tls=tcp,self"
  bool big = false;   // also run the 1 GiB transfer
};
// So that test listings show the transport, not the struct's bytes.
inline void PrintTo(const TransportSpec& spec, std::ostream* out) {
  *out << spec.name;
}

struct ScenarioContext {
  Transport& transport;
  MemoryKind memory;                        // host, or cuda where host is unsupported
  std::function<void(int rank)> kill_peer;  // rank 0 only: SIGKILL that rank
};

using Scenario = void (*)(ScenarioContext&);
// Every scenario a peer may be asked to run, by name.
Scenario find_scenario(const std::string& name);

// Throws Errc::internal with `message` unless `condition`.
void require(bool condition, const std::string& message);
// Runs `op`, requires that it throws an Error of code `code` whose message
// contains each of `parts`; returns that message.
std::string require_error(const std::function<void()>& op, Errc code,
                          const std::vector<std::string>& parts);

// A buffer of host or CUDA memory, at `offset` bytes past an aligned start.
class TestBuffer {
 public:
  TestBuffer(std::size_t bytes, MemoryKind memory, std::size_t offset = 0);
  ~TestBuffer();
  TestBuffer(const TestBuffer&) = delete;
  TestBuffer& operator=(const TestBuffer&) = delete;

  Buffer buffer() const { return Buffer{data_, bytes_, memory_, -1, nullptr}; }
  std::size_t size() const { return bytes_; }
  // Fills with a pattern derived from `seed`; zero() fills with zeros.
  void fill(uint64_t seed);
  void zero();
  // Copies `n` bytes from host memory to the start.
  void write(const void* data, std::size_t n);
  std::vector<uint8_t> read() const;
  // Copies the first `n` bytes to `dst`, memory of the same kind (a peer's
  // lent memory, mapped: a device address for CUDA), and waits for the copy.
  void copy_to(void* dst, std::size_t n) const;
  // True when the first `n` bytes hold the pattern of `seed`.
  bool holds(uint64_t seed, std::size_t n) const;
  // Number of bytes among the first `n` that differ from the pattern.
  std::size_t differing(uint64_t seed, std::size_t n) const;

 private:
  std::size_t bytes_;
  MemoryKind memory_;
  void* base_ = nullptr;
  void* data_ = nullptr;
};

uint8_t pattern_byte(uint64_t seed, std::size_t i);

// Ranks 1..world-1 of a scenario as child processes.
class PeerProcesses {
 public:
  PeerProcesses(const std::string& scenario, const std::string& transport, int world,
                const std::string& store_dir, const std::string& prefix);
  ~PeerProcesses();  // SIGKILLs the ones still running
  void kill(int rank);
  // Waits (bounded) for every peer to exit; returns "" when all exited 0,
  // else a description of the failures (SIGKILLed ones count as expected).
  std::string join(std::chrono::seconds timeout);

 private:
  std::vector<pid_t> pids_;  // index rank - 1
  std::vector<bool> killed_;
};

// A temp directory removed at destruction.
struct TempDir {
  TempDir();
  ~TempDir();
  std::string path;
};

// Runs `scenario` over `transport` with `world` ranks; returns the failures
// ("" on success). Throws what rank 0 threw.
std::string run_scenario(const std::string& scenario, const std::string& transport, int world);

// Host memory of TestBuffers: page-granular allocations from a memfd arena,
// so that another process can map them (ipc_host_test.cpp).
void* shared_host_alloc(std::size_t bytes);
void shared_host_free(void* p);

// Why the transport `name` (with its ?params; behind fault: wrappers, the
// inner one) is not in this build, e.g. "weightsync was built without CUDA:
// no cuda_ipc transport"; "" when it is built in. Tests skip with it.
std::string not_built_reason(const std::string& name);

// The memory the scenarios use with `t`: host where it takes host memory.
MemoryKind memory_for(const Transport& t);

// Creates a transport for rank `rank` of `world` over a file store in `dir`.
std::unique_ptr<Transport> make_test_transport(const std::string& name, const std::string& dir,
                                               int rank, int world,
                                               const std::string& prefix = "t");

}  // namespace weightsync::transport_test
