// The memory side of cuda_ipc, behind a small interface so that the protocol
// (matching, queues, completions, liveness) runs unchanged over CUDA memory
// (cuda_memory.cpp) and, in the tests, over host memory shared between
// processes with memfd descriptors. The protocol never touches memory itself.
//
// Receiver side: locate() finds the allocation around a buffer, export_region()
// produces what a sender needs to map it. Sender side: import() maps such an
// export, copy() writes a buffer into mapped memory asynchronously.
#pragma once

#include <weightsync/backend/transport.h>

#include "ipc_socket.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace weightsync::transport::cuda_ipc {

// One allocation of an exported range. `id` tells a new allocation at a
// reused address from the old one (CU_POINTER_ATTRIBUTE_BUFFER_ID for CUDA).
struct Piece {
  uintptr_t base = 0;
  std::size_t bytes = 0;
  uint64_t id = 0;
  bool operator==(const Piece&) const = default;
};

// The memory a buffer lies in, as the exporting process sees it: a contiguous
// address range made of one or more allocations (a cudaMalloc block; the
// physical chunks of a VMM range such as PyTorch's expandable segments).
struct Located {
  uintptr_t base = 0;
  std::size_t bytes = 0;
  std::vector<Piece> pieces;  // in address order, covering [base, base + bytes)
  // The memory must not be freed while another process maps it (cudaIpc
  // handles: undefined in CUDA), so deregistering it waits for the senders
  // to unmap it. VMM chunks stay alive while mapped anywhere: no wait.
  bool unmap_before_free = false;
};

// What a sender needs to map a region: a backend-defined handle kind, handle
// bytes (a cudaIpcMemHandle_t, a table of chunks) and descriptors passed to
// the sender's process (POSIX-fd handles of VMM chunks; memfds in tests).
struct Export {
  uint32_t kind = 0;
  std::vector<uint8_t> handle;
  std::vector<UniqueFd> fds;
};

// A region mapped into the sender's address space; unmapped by the destructor.
class Mapping {
 public:
  virtual ~Mapping() = default;
  virtual void* data() const = 0;
};

// An asynchronous copy. done() throws an Error (Errc::transport) when it failed.
// The destructor of an unfinished copy waits for it: the source and the
// mapping must outlive what the device still does with them.
class Copy {
 public:
  virtual ~Copy() = default;
  virtual bool done() = 0;
};

class IpcMemory {
 public:
  virtual ~IpcMemory() = default;
  // The memory this backend moves (cuda for the real transport).
  virtual MemoryKind memory() const = 0;
  // Receiver: the allocation(s) holding [buffer.data, buffer.data + bytes).
  // Errc::unsupported for memory that cannot be shared, naming why.
  virtual Located locate(const Buffer& buffer) = 0;
  virtual Export export_region(const Located& region) = 0;
  // Sender: maps a region of `bytes` exported by another process.
  virtual std::unique_ptr<Mapping> import(uint32_t kind, const std::vector<uint8_t>& handle,
                                          std::vector<UniqueFd> fds, std::size_t bytes) = 0;
  // Sender: starts copying `src` to `dst` (inside a mapping).
  virtual std::unique_ptr<Copy> copy(void* dst, const Buffer& src) = 0;
  // True when copies finish in the order they were started (one stream): a
  // poll then stops at the first that runs, rather than asking each of
  // hundreds in flight on every pass.
  virtual bool copies_in_order() const { return false; }
  // Host memory for the data path's own buffers (Transport::allocate_host):
  // memory peers can map where this backend moves host memory (ipc_host);
  // the heap's elsewhere.
  virtual std::shared_ptr<char> allocate_host(std::size_t bytes);
};

}  // namespace weightsync::transport::cuda_ipc
