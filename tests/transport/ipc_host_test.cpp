// Host memory that other processes can map, and "ipc_host": the cuda_ipc
// transport over it, so that cuda_ipc's protocol, sockets and liveness run
// the conformance suite between real processes on machines without a GPU.
//
// Every host TestBuffer comes from one memfd-backed arena per process: an
// allocation is exported as (the arena's descriptor, offset), passed over the
// control socket like a VMM chunk's POSIX-fd handle, and mapped by the
// sender with mmap. Allocations get serial ids, so a freed and reused address
// is a new allocation, as CU_POINTER_ATTRIBUTE_BUFFER_ID tells for CUDA.
#include "harness.h"
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
constexpr std::size_t kArenaBytes = std::size_t{32} << 30;  // virtual; pages come on first touch
constexpr uint32_t kArenaHandle = 100;

class Arena {
 public:
  Arena() {
    fd_ = ::memfd_create("weightsync-test-arena", MFD_CLOEXEC);
    if (fd_ < 0 || ::ftruncate(fd_, kArenaBytes) != 0)
      fail(Errc::io, "test arena: memfd of ", kArenaBytes, " bytes: ", std::strerror(errno));
    void* p =
        ::mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd_, 0);
    if (p == MAP_FAILED) fail(Errc::io, "test arena: mmap: ", std::strerror(errno));
    base_ = static_cast<char*>(p);
    free_[0] = kArenaBytes;
  }

  void* allocate(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    const std::size_t n = (std::max<std::size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
    auto it =
        std::find_if(free_.begin(), free_.end(), [&](const auto& f) { return f.second >= n; });
    if (it == free_.end()) fail(Errc::io, "test arena: no room for ", bytes, " bytes");
    const std::size_t offset = it->first, left = it->second - n;
    free_.erase(it);
    if (left) free_[offset + n] = left;
    used_[offset] = Used{n, ++serial_};
    return base_ + offset;
  }

  void release(void* p) {
    std::lock_guard lock(mutex_);
    const std::size_t offset = static_cast<char*>(p) - base_;
    auto it = used_.find(offset);
    if (it == used_.end()) return;
    std::size_t n = it->second.bytes;
    used_.erase(it);
    // Give the pages back (and zero them, as fresh memory is).
    ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                static_cast<off_t>(n));
    std::size_t start = offset;
    if (auto next = free_.find(offset + n); next != free_.end()) {
      n += next->second;
      free_.erase(next);
    }
    if (auto prev = free_.lower_bound(offset); prev != free_.begin()) {
      --prev;
      if (prev->first + prev->second == offset) {
        start = prev->first;
        n += prev->second;
        free_.erase(prev);
      }
    }
    free_[start] = n;
  }

  // The allocation holding `p`: (base, bytes, id, offset in the arena).
  bool find(const void* p, ipc::Piece& piece, std::size_t& offset) {
    std::lock_guard lock(mutex_);
    const auto* c = static_cast<const char*>(p);
    if (c < base_ || c >= base_ + kArenaBytes) return false;
    auto it = used_.upper_bound(static_cast<std::size_t>(c - base_));
    if (it == used_.begin()) return false;
    --it;
    if (static_cast<std::size_t>(c - base_) >= it->first + it->second.bytes) return false;
    offset = it->first;
    piece =
        ipc::Piece{reinterpret_cast<uintptr_t>(base_ + it->first), it->second.bytes, it->second.id};
    return true;
  }

  int fd() const { return fd_; }

 private:
  struct Used {
    std::size_t bytes;
    uint64_t id;
  };
  std::mutex mutex_;
  int fd_ = -1;
  char* base_ = nullptr;
  std::map<std::size_t, std::size_t> free_;  // offset -> bytes
  std::map<std::size_t, Used> used_;
  uint64_t serial_ = 0;
};

Arena& arena() {
  static Arena* a = new Arena;  // never destroyed: buffers may outlive static destruction
  return *a;
}

class ShmMapping final : public ipc::Mapping {
 public:
  ShmMapping(void* p, std::size_t bytes) : p_(p), bytes_(bytes) {}
  ~ShmMapping() override { ::munmap(p_, bytes_); }
  void* data() const override { return p_; }

 private:
  void* p_;
  std::size_t bytes_;
};

// Copies a slice per look, so that a message is "in flight" across several
// progress calls as a GPU copy is; the destructor finishes what is left.
class SlicedCopy final : public ipc::Copy {
 public:
  SlicedCopy(void* dst, const Buffer& src)
      : dst_(static_cast<char*>(dst)), src_(static_cast<const char*>(src.data)), n_(src.bytes) {}
  ~SlicedCopy() override {
    while (!done()) {
    }
  }
  bool done() override {
    const std::size_t step = std::min<std::size_t>(n_ - at_, 8u << 20);
    std::memcpy(dst_ + at_, src_ + at_, step);
    at_ += step;
    return at_ == n_;
  }

 private:
  char* dst_;
  const char* src_;
  std::size_t n_, at_ = 0;
};

// With `local` (ipc_host?local=1), memory outside the arena is accepted too,
// exported as its address: reachable by transports of its own process only
// (which use their own memory directly), so that a whole Publisher and
// Subscriber, whose slots come from the heap, run in threads of one process.
constexpr uint32_t kLocalHandle = 101;

class HostShmMemory final : public ipc::IpcMemory {
 public:
  explicit HostShmMemory(bool local = false) : local_(local) {}
  MemoryKind memory() const override { return MemoryKind::host; }

  ipc::Located locate(const Buffer& b) override {
    ipc::Piece piece;
    std::size_t offset = 0;
    if (local_ && !arena().find(b.data, piece, offset)) {
      const auto base = reinterpret_cast<uintptr_t>(b.data);
      return ipc::Located{base, b.bytes, {ipc::Piece{base, b.bytes, 0}}, true};
    }
    if (!arena().find(b.data, piece, offset) ||
        reinterpret_cast<uintptr_t>(b.data) + b.bytes > piece.base + piece.bytes)
      fail(Errc::unsupported, "ipc_host: the ", b.bytes, "-byte buffer at ", b.data,
           " is not in the tests' shared arena");
    // As for cudaMalloc memory, so that deregistration's handshake (wait
    // until the senders unmapped it) runs between processes here too.
    return ipc::Located{piece.base, piece.bytes, {piece}, /*unmap_before_free=*/true};
  }

  ipc::Export export_region(const ipc::Located& where) override {
    ipc::Piece piece;
    std::size_t offset = 0;
    if (!arena().find(reinterpret_cast<const void*>(where.base), piece, offset)) {
      if (!local_) fail(Errc::internal, "ipc_host: exporting memory outside the arena");
      ipc::Export ex;
      ex.kind = kLocalHandle;
      return ex;
    }
    ipc::Export ex;
    ex.kind = kArenaHandle;
    ex.handle.resize(sizeof(offset));
    std::memcpy(ex.handle.data(), &offset, sizeof(offset));
    ex.fds.emplace_back(::fcntl(arena().fd(), F_DUPFD_CLOEXEC, 0));
    return ex;
  }

  std::unique_ptr<ipc::Mapping> import(uint32_t kind, const std::vector<uint8_t>& handle,
                                       std::vector<ipc::UniqueFd> fds, std::size_t bytes) override {
    std::size_t offset = 0;
    if (kind == kLocalHandle)
      fail(Errc::unsupported, "ipc_host: a peer's memory outside its arena cannot be mapped");
    if (kind != kArenaHandle || fds.size() != 1 || handle.size() != sizeof(offset))
      fail(Errc::protocol, "ipc_host: unexpected handle (kind ", kind, ")");
    std::memcpy(&offset, handle.data(), sizeof(offset));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0].get(),
                     static_cast<off_t>(offset));
    if (p == MAP_FAILED)
      fail(Errc::io, "ipc_host: mmap of the peer's arena: ", std::strerror(errno));
    return std::make_unique<ShmMapping>(p, bytes);
  }

  std::unique_ptr<ipc::Copy> copy(void* dst, const Buffer& src) override {
    return std::make_unique<SlicedCopy>(dst, src);
  }

 private:
  bool local_;
};

}  // namespace

void* shared_host_alloc(std::size_t bytes) {
  return arena().allocate(bytes);
}

void shared_host_free(void* p) {
  arena().release(p);
}

void register_test_transports() {
  static const bool registered = [] {
    register_transport("ipc_host", [](const TransportOptions& o) -> std::unique_ptr<Transport> {
      auto local = o.params.find("local");
      return std::make_unique<ipc::IpcTransport>(
          o, std::make_unique<HostShmMemory>(local != o.params.end() && local->second == "1"),
          "ipc_host");
    });
    return true;
  }();
  (void)registered;
}

TEST(IpcHostArena, ReusedAddressesAreNewAllocations) {
  void* a = shared_host_alloc(10000);
  HostShmMemory m;
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

// First contact checks what the peer published: another kernel (another
// machine) is unsupported, a socket nobody listens on is a dead peer.
TEST(IpcBootstrap, PeerOnAnotherMachineIsUnsupported) {
  TempDir dir;
  auto t = make_test_transport("ipc_host", dir.path, 0, 2);
  const std::string address = "1234\nnot-this-boot-id\n@weightsync-nowhere";
  make_file_store(dir.path)->set("t/cuda_ipc/address/1",
                                 std::vector<uint8_t>(address.begin(), address.end()));
  TestBuffer b(64, MemoryKind::host);
  require_error([&] { t->send(1, 1, b.buffer()); }, Errc::unsupported,
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
  require_error([&] { t->recv(1, 1, b.buffer()); }, Errc::peer_failure,
                {"receive from rank 1", "exited"});
  EXPECT_TRUE(t->peer_failed(1));
  require_error([&] { t->send(1, 1, b.buffer()); }, Errc::peer_failure, {"rank 1"});
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
  register_test_transports();
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
