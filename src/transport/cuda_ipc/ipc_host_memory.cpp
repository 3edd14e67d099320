#include "ipc_host_memory.h"

#include <weightsync/error.h>

#include "ipc_memory.h"
#include "ipc_transport.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

namespace weightsync::transport::cuda_ipc {
namespace {

constexpr std::size_t kPage = 4096;
// Handle kinds: an arena allocation (descriptor + offset); memory of the
// exporting process itself (local=1), usable by that process only.
constexpr uint32_t kArenaHandle = 100;
constexpr uint32_t kLocalHandle = 101;

class Arena {
 public:
  Arena() {
    fd_ = ::memfd_create("weightsync-ipc-host", MFD_CLOEXEC);
    if (fd_ < 0 || ::ftruncate(fd_, static_cast<off_t>(kArenaBytes)) != 0)
      fail(Errc::io, "ipc_host: a memfd of ", kArenaBytes, " bytes: ", std::strerror(errno));
    void* p =
        ::mmap(nullptr, kArenaBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd_, 0);
    if (p == MAP_FAILED) fail(Errc::io, "ipc_host: mapping its arena: ", std::strerror(errno));
    base_ = static_cast<char*>(p);
    free_[0] = kArenaBytes;
  }

  void* allocate(std::size_t bytes) {
    std::lock_guard lock(mutex_);
    const std::size_t n = (std::max<std::size_t>(bytes, 1) + kPage - 1) / kPage * kPage;
    auto it =
        std::find_if(free_.begin(), free_.end(), [&](const auto& f) { return f.second >= n; });
    if (it == free_.end())
      fail(Errc::io, "ipc_host: no room for ", bytes, " bytes in its ", kArenaBytes, "-byte arena");
    const std::size_t offset = it->first, left = it->second - n;
    free_.erase(it);
    if (left) free_[offset + n] = left;
    used_[offset] = Used{n, ++serial_};
    return base_ + offset;
  }

  void release(void* p) {
    std::lock_guard lock(mutex_);
    if (!inside(p)) return;
    const std::size_t offset = static_cast<std::size_t>(static_cast<char*>(p) - base_);
    auto it = used_.find(offset);
    if (it == used_.end()) return;
    std::size_t n = it->second.bytes;
    used_.erase(it);
    // The pages go back (and read as zero, as fresh memory does).
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

  // The allocation holding `p`, and its offset in the arena.
  bool find(const void* p, Piece& piece, std::size_t& offset) {
    std::lock_guard lock(mutex_);
    if (!inside(p)) return false;
    const auto at = static_cast<std::size_t>(static_cast<const char*>(p) - base_);
    auto it = used_.upper_bound(at);
    if (it == used_.begin()) return false;
    --it;
    if (at >= it->first + it->second.bytes) return false;
    offset = it->first;
    piece = Piece{reinterpret_cast<uintptr_t>(base_ + it->first), it->second.bytes, it->second.id};
    return true;
  }

  int fd() const { return fd_; }

 private:
  bool inside(const void* p) const {
    const auto* c = static_cast<const char*>(p);
    return c >= base_ && c < base_ + kArenaBytes;
  }
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

class ArenaMapping final : public Mapping {
 public:
  ArenaMapping(void* p, std::size_t bytes) : p_(p), bytes_(bytes) {}
  ~ArenaMapping() override { ::munmap(p_, bytes_); }
  void* data() const override { return p_; }

 private:
  void* p_;
  std::size_t bytes_;
};

// A process's own memory (local=1): used where it is.
class LocalMapping final : public Mapping {
 public:
  explicit LocalMapping(void* p) : p_(p) {}
  void* data() const override { return p_; }

 private:
  void* p_;
};

// Copies a slice per look, so that a message stays in flight across several
// progress calls as a GPU copy does; the destructor finishes what is left.
class SlicedCopy final : public Copy {
 public:
  SlicedCopy(void* dst, const Buffer& src)
      : dst_(static_cast<char*>(dst)), src_(static_cast<const char*>(src.data)), n_(src.bytes) {}
  ~SlicedCopy() override {
    while (!done()) {
    }
  }
  bool done() override {
    const std::size_t step = std::min<std::size_t>(n_ - at_, kSliceBytes);
    if (step) std::memcpy(dst_ + at_, src_ + at_, step);
    at_ += step;
    return at_ == n_;
  }

 private:
  static constexpr std::size_t kSliceBytes = std::size_t{8} << 20;
  char* dst_;
  const char* src_;
  std::size_t n_, at_ = 0;
};

class HostShmMemory final : public IpcMemory {
 public:
  explicit HostShmMemory(bool local) : local_(local) {}
  MemoryKind memory() const override { return MemoryKind::host; }

  Located locate(const Buffer& b) override {
    Piece piece;
    std::size_t offset = 0;
    if (arena().find(b.data, piece, offset)) {
      if (reinterpret_cast<uintptr_t>(b.data) + b.bytes > piece.base + piece.bytes)
        fail(Errc::unsupported, "ipc_host: the ", b.bytes, "-byte buffer at ", b.data,
             " runs past the end of its shared allocation (", piece.bytes, " bytes at ",
             reinterpret_cast<const void*>(piece.base), ")");
      // As for cudaMalloc memory, so that deregistration's handshake (wait
      // until the senders unmapped it) runs between processes here too.
      return Located{piece.base, piece.bytes, {piece}, /*unmap_before_free=*/true};
    }
    if (local_) {
      const auto base = reinterpret_cast<uintptr_t>(b.data);
      return Located{base, b.bytes, {Piece{base, b.bytes, 0}}, true};
    }
    fail(Errc::unsupported, "ipc_host: the ", b.bytes, "-byte buffer at ", b.data,
         " is not shared host memory (ipc_host, the host stand-in of cuda_ipc, takes memory "
         "from its arena: weightsync's shared host allocation, as cuda_ipc takes cudaMalloc "
         "memory)");
  }

  Export export_region(const Located& where) override {
    Piece piece;
    std::size_t offset = 0;
    Export ex;
    if (!arena().find(reinterpret_cast<const void*>(where.base), piece, offset)) {
      if (!local_) fail(Errc::internal, "ipc_host: exporting memory outside its arena");
      ex.kind = kLocalHandle;
      return ex;
    }
    ex.kind = kArenaHandle;
    ex.handle.resize(sizeof(offset));
    std::memcpy(ex.handle.data(), &offset, sizeof(offset));
    const int fd = ::fcntl(arena().fd(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
      fail(Errc::io, "ipc_host: duplicating its arena's descriptor: ", std::strerror(errno));
    ex.fds.emplace_back(fd);
    return ex;
  }

  std::unique_ptr<Mapping> import(uint32_t kind, const std::vector<uint8_t>& handle,
                                  std::vector<UniqueFd> fds, std::size_t bytes) override {
    if (kind == kLocalHandle)
      fail(Errc::unsupported,
           "ipc_host: the peer's memory is its own (local=1), not shared: it cannot be mapped");
    std::size_t offset = 0;
    if (kind != kArenaHandle || fds.size() != 1 || handle.size() != sizeof(offset))
      fail(Errc::protocol, "ipc_host: unexpected handle (kind ", kind, ", ", handle.size(),
           " bytes, ", fds.size(), " descriptors)");
    std::memcpy(&offset, handle.data(), sizeof(offset));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0].get(),
                     static_cast<off_t>(offset));
    if (p == MAP_FAILED)
      fail(Errc::io, "ipc_host: mapping ", bytes,
           " bytes of the peer's arena: ", std::strerror(errno));
    return std::make_unique<ArenaMapping>(p, bytes);
  }

  std::unique_ptr<Copy> copy(void* dst, const Buffer& src) override {
    return std::make_unique<SlicedCopy>(dst, src);
  }

  std::shared_ptr<char> allocate_host(std::size_t bytes) override {
    return shared_host_buffer(bytes);
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

std::shared_ptr<char> shared_host_buffer(std::size_t bytes) {
  return std::shared_ptr<char>(static_cast<char*>(shared_host_alloc(bytes)), shared_host_free);
}

bool in_shared_host(const void* p, std::size_t bytes) {
  Piece piece;
  std::size_t offset = 0;
  return arena().find(p, piece, offset) &&
         reinterpret_cast<uintptr_t>(p) + bytes <= piece.base + piece.bytes;
}

std::unique_ptr<IpcMemory> make_shared_host_memory(bool local) {
  return std::make_unique<HostShmMemory>(local);
}

std::unique_ptr<Transport> make_ipc_host_transport(const TransportOptions& options) {
  const auto local = options.params.find("local");
  return std::make_unique<IpcTransport>(
      options, make_shared_host_memory(local != options.params.end() && local->second == "1"),
      "ipc_host");
}

}  // namespace weightsync::transport::cuda_ipc
