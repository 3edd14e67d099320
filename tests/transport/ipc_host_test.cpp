// "ipc_host" (src/transport/cuda_ipc/ipc_host_memory.h): the cuda_ipc
// transport over host memory that processes map from each other, so that
// cuda_ipc's protocol, sockets and liveness run the conformance suite
// between real processes on machines without a GPU. Every host TestBuffer
// comes from its arena (shared_host_alloc), so that another process can map
// it.
#include "harness.h"
#include "transport/cuda_ipc/ipc_host_memory.h"
#include "transport/cuda_ipc/ipc_memory.h"
#include "transport/cuda_ipc/ipc_socket.h"
#include "transport/cuda_ipc/ipc_transport.h"

#include <weightsync/store.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace weightsync::transport_test {
namespace {

namespace ipc = weightsync::transport::cuda_ipc;

constexpr std::size_t kPage = 4096;

}  // namespace

void* shared_host_alloc(std::size_t bytes) {
  return ipc::shared_host_alloc(bytes);
}

void shared_host_free(void* p) {
  ipc::shared_host_free(p);
}

TEST(IpcHostArena, ReusedAddressesAreNewAllocations) {
  void* a = shared_host_alloc(10000);
  auto memory = ipc::make_shared_host_memory(false);
  ipc::IpcMemory& m = *memory;
  const auto first = m.locate(Buffer{static_cast<char*>(a) + 5000, 100, MemoryKind::host});
  EXPECT_EQ(first.base, reinterpret_cast<uintptr_t>(a));
  EXPECT_EQ(first.bytes, 3 * kPage);
  shared_host_free(a);
  void* b = shared_host_alloc(10000);
  ASSERT_EQ(a, b) << "first fit reuses the freed range";
  const auto second = m.locate(Buffer{b, 100, MemoryKind::host});
  EXPECT_NE(first.pieces[0].id, second.pieces[0].id);
  shared_host_free(b);
  std::vector<char> heap(100);
  EXPECT_THROW(m.locate(Buffer{heap.data(), 100, MemoryKind::host}), Error);
}

// Memory for tensors received over a transport: from ipc_host's arena where
// ipc_host moves the bytes (also behind a wrapper), from the heap elsewhere;
// zeroed and page-aligned either way.
TEST(IpcHostArena, AllocateHostMemoryComesFromTheArenaForIpcHostOnly) {
  for (const char* name : {"ipc_host", "fault:ipc_host?seed=3", "ucx?tls=tcp", "nccl"}) {
    SCOPED_TRACE(name);
    const auto p = allocate_host_memory(name, 10000);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p.get()) % kPage, 0u);
    EXPECT_TRUE(std::all_of(p.get(), p.get() + 10000, [](char c) { return c == 0; }));
    EXPECT_EQ(ipc::in_shared_host(p.get(), 10000),
              std::string(name).find("ipc_host") != std::string::npos);
  }
}

// First contact checks what the peer published: another kernel (another
// machine) is unsupported, a socket nobody listens on is a dead peer.
TEST(IpcBootstrap, PeerOnAnotherMachineIsUnsupported) {
  TempDir dir;
  auto t = make_test_transport("ipc_host", dir.path, 0, 2);
  const std::string address = "1234\nnot-this-boot-id\n@weightsync-nowhere";
  make_file_store(dir.path)->set("t/cuda_ipc/address/1",
                                 std::vector<uint8_t>(address.begin(), address.end()));
  TestBuffer b(64, MemoryKind::host);
  require_error([&] { (void)t->send(1, 1, b.buffer()); }, Errc::unsupported,
                {"rank 1", "another kernel", "one node"});
  EXPECT_FALSE(t->peer_failed(1));
}

TEST(IpcBootstrap, PeerWhoseSocketIsGoneIsAPeerFailure) {
  TempDir dir;
  auto t = make_test_transport("ipc_host", dir.path, 0, 2);
  std::string socket;
  {
    ipc::Listener gone("");
    socket = gone.address();
  }
  const std::string address = "1234\n" + ipc::boot_id() + "\n" + socket;
  make_file_store(dir.path)->set("t/cuda_ipc/address/1",
                                 std::vector<uint8_t>(address.begin(), address.end()));
  TestBuffer b(64, MemoryKind::host);
  require_error([&] { (void)t->recv(1, 1, b.buffer()); }, Errc::peer_failure,
                {"receive from rank 1", "exited"});
  EXPECT_TRUE(t->peer_failed(1));
  require_error([&] { (void)t->send(1, 1, b.buffer()); }, Errc::peer_failure, {"rank 1"});
}

TEST(IpcBootstrap, PeerThatNeverPublishesTimesOut) {
  TempDir dir;
  TransportOptions o;
  auto store = make_file_store(dir.path);
  o.name = "ipc_host";
  o.store = store.get();
  o.prefix = "t";
  o.world = 2;
  o.bootstrap_timeout = std::chrono::milliseconds(200);
  auto t = make_transport(o);
  TestBuffer b(64, MemoryKind::host);
  require_error([&] { t->connect(1); }, Errc::timeout, {"t/cuda_ipc/address/1"});
}

TEST(IpcBootstrap, TwoTransportsInOneProcess) {
  TempDir dir;
  auto t0 = make_test_transport("ipc_host", dir.path, 0, 2);
  auto t1 = make_test_transport("ipc_host", dir.path, 1, 2);
  TestBuffer out(1 << 20, MemoryKind::host), in(1 << 20, MemoryKind::host);
  out.fill(7);
  in.zero();
  auto r = t0->recv(1, 9, in.buffer());
  auto s = t1->send(0, 9, out.buffer());
  // One thread drives both, each through its own requests.
  bool received = false, sent = false;
  for (int i = 0; i < 1000000 && !(received && sent); ++i) {
    received = r->test();
    sent = s->test();
  }
  ASSERT_TRUE(received && sent);
  EXPECT_EQ(r->transferred(), 1u << 20);
  EXPECT_TRUE(in.holds(7, 1 << 20));
}

// A sender that completes its sends and destroys its transport at once:
// each completion reaches the receiver, also when the last one and the end
// of file land while the receiver reads the one before (it looked at the
// closed connection before the last packet, and failed the receive).
TEST(IpcBootstrap, SenderThatExitsRightAfterItsSendsLeavesThemComplete) {
  constexpr int kRounds = 200;
  constexpr std::size_t kLarge = 1 << 20;
  int failures = 0;
  std::string first;
  for (int round = 0; round < kRounds; ++round) {
    TempDir dir;
    auto t0 = make_test_transport("ipc_host", dir.path, 0, 2);
    auto t1 = make_test_transport("ipc_host", dir.path, 1, 2);
    TestBuffer small_out(1, MemoryKind::host), small_in(1, MemoryKind::host);
    TestBuffer large_out(kLarge, MemoryKind::host), large_in(kLarge, MemoryKind::host);
    small_out.fill(uint64_t(round));
    large_out.fill(uint64_t(round) + 1);
    small_in.zero();
    large_in.zero();
    auto r_small = t0->recv(1, 4, small_in.buffer());
    auto r_large = t0->recv(1, 5, large_in.buffer());
    std::string sender_error;
    std::thread sender([&] {
      try {
        auto s_small = t1->send(0, 4, small_out.buffer());
        auto s_large = t1->send(0, 5, large_out.buffer());
        s_small->wait(std::chrono::seconds(10));
        s_large->wait(std::chrono::seconds(10));
      } catch (const Error& e) {
        sender_error = e.what();
      }
      t1.reset();
    });
    try {
      r_small->wait(std::chrono::seconds(10));
      r_large->wait(std::chrono::seconds(10));
      if (!small_in.holds(uint64_t(round), 1) || !large_in.holds(uint64_t(round) + 1, kLarge))
        throw Error(Errc::internal, "a received message holds other bytes than were sent");
    } catch (const Error& e) {
      if (!failures++) first = cat("round ", round, ": ", e.what());
    }
    sender.join();
    if (!sender_error.empty() && !failures++) first = cat("round ", round, ": ", sender_error);
  }
  EXPECT_EQ(failures, 0) << first;
}

}  // namespace weightsync::transport_test
