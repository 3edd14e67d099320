// The data path's staging memory and waits over a transport: internals that
// the pipeline, the adapters and the command's drills share (see
// docs/architecture.md), not user API.
#pragma once

#include <weightsync/backend/transport.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace weightsync {

// Where a staging slot of the data path lives (DESIGN.md "GPU data path"):
// plain page-aligned host memory (host tensors), pinned host memory (CUDA
// tensors over a transport that reaches host memory only: device-to-host at
// PCIe speed, never pageable), or device memory (CUDA tensors over a
// transport that reaches it: NCCL, CUDA IPC). pipeline/wire.h chooses.
enum class SlotMemory : uint8_t { host, pinned, device };
const char* slot_memory_name(SlotMemory memory) noexcept;  // "host", "pinned", "device"

// A staging buffer of the data path: zeroed memory where `memory` says,
// registered with a transport, allocated once and reused every step. Members
// are destroyed region first, then the memory.
struct StagingBuffer {
  std::shared_ptr<void> owner;  // the allocation; `data` lies inside it
  char* data = nullptr;         // page-aligned (host, pinned) or 256-byte aligned (device)
  std::size_t bytes = 0;
  SlotMemory memory = SlotMemory::host;
  int device = -1;  // CUDA ordinal of device memory
  std::unique_ptr<MemoryRegion> region;

  // [data + offset, data + offset + n) as a transport buffer (pinned memory is
  // host memory to a transport).
  Buffer buffer(std::size_t offset, std::size_t n) const;
};
// Host memory from the heap: `bytes` zeroed, page-aligned (so that
// registration covers whole pages). Transport::allocate_host's default.
std::shared_ptr<char> heap_host_buffer(std::size_t bytes);
// Host slots come from transport.allocate_host (memory its peers can map,
// where it maps host memory). Errc::unsupported for pinned or device memory
// without CUDA.
StagingBuffer allocate_staging(Transport& transport, std::size_t bytes, SlotMemory memory,
                               int device);

// The polling loops' pause between two looks at a pending request: busy
// polling for the first 64 looks (lowest latency), then a 20 us sleep each
// time, so that when ranks outnumber cores the peer that must make progress
// gets the core (yielding instead halved `weightsync bench` with 8 processes
// on 2 cores). `spins` counts the looks of one wait; reset it on progress.
void poll_pause(int& spins);

// Waits for every request (in order, each with what is left of `timeout`).
void wait_all(const std::vector<std::unique_ptr<Request>>& requests,
              std::chrono::milliseconds timeout);

}  // namespace weightsync
