// "ipc_host": the cuda_ipc transport over host memory, its stand-in where no
// GPU is (docs/transports.md). The protocol, sockets, liveness and lending
// run unchanged; the memory side is host memory that the processes of one
// node map from each other, as CUDA IPC maps device memory:
//
// - Every process has one arena: a memfd of kArenaBytes (virtual; pages come
//   on first touch and go back when freed), mapped once. Its allocations are
//   page-granular, zeroed, and carry serial ids, so that a freed and reused
//   address is a new allocation, as CU_POINTER_ATTRIBUTE_BUFFER_ID tells for
//   CUDA. A receiver exports an allocation as (the arena's descriptor, its
//   offset), passed over the control socket like a VMM chunk's POSIX-fd
//   handle; the sender maps it with mmap and copies into it a slice per
//   progress call, so that a message is in flight across several calls as a
//   GPU copy is.
// - Memory must come from the arena to be received into or lent, as device
//   memory must come from cudaMalloc: shared_host_alloc() for what the
//   caller allocates itself (`weightsync demo --transport ipc_host` puts
//   every rank's tensors there), Transport::allocate_host() for the data
//   path's own staging. Other memory is refused with Errc::unsupported
//   naming the buffer; with params["local"] = "1" it is accepted inside its
//   own process (self-sends, a Publisher and Subscribers as threads of one
//   process), as cuda_ipc uses a process's own memory directly.
#pragma once

#include <weightsync/backend/transport.h>

#include "ipc_memory.h"

#include <cstddef>
#include <memory>

namespace weightsync::transport::cuda_ipc {

// The arena's size, in bytes of address space.
inline constexpr std::size_t kArenaBytes = std::size_t{64} << 30;

// `bytes` (at least one page) of zeroed arena memory; Errc::io when the arena
// has no room. Freed with shared_host_free.
void* shared_host_alloc(std::size_t bytes);
// Gives an allocation's pages back (they read as zero when reused). Memory
// not from the arena is ignored.
void shared_host_free(void* p);
// The same, owned: freed when the last copy of the pointer goes.
std::shared_ptr<char> shared_host_buffer(std::size_t bytes);
// True when [p, p + bytes) lies inside one arena allocation.
bool in_shared_host(const void* p, std::size_t bytes);

// The memory side of ipc_host (`local`: params["local"] == "1").
std::unique_ptr<IpcMemory> make_shared_host_memory(bool local);
std::unique_ptr<Transport> make_ipc_host_transport(const TransportOptions& options);

}  // namespace weightsync::transport::cuda_ipc
