// The CUDA runtime as the data path uses it: devices, non-blocking streams,
// events, device and pinned memory, and copy programs uploaded once and run
// as one kernel launch each. No CUDA header leaks from here (handles are
// void*), so callers compile alike with and without CUDA; without it every
// call that would touch a GPU fails with Errc::unsupported, and the queries
// (built_with_cuda, device_count) answer plainly.
#pragma once

#include "core/copy_program.h"
#include "core/delta_tables.h"

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace weightsync::fp8 {
class QuantProgram;
}

namespace weightsync::gpu {

bool built_with_cuda() noexcept;
// Usable CUDA devices: 0 without CUDA, a driver or a GPU (never throws).
int device_count() noexcept;
// Why no device can be used here ("" when one can), for skip and error messages.
std::string unavailable_reason();
// Errc::unsupported with unavailable_reason() unless a device can be used,
// naming `what` needed it.
void require_device(const std::string& what);

void set_device(int device);  // on the calling thread
void synchronize_device(int device);
// Waits for the work queued on `cuda_stream` (nullptr: the legacy default stream).
void synchronize_stream(void* cuda_stream);
// Waits for the work before a recorded `cuda_event` (a cudaEvent_t).
void synchronize_event(void* cuda_event);
// The device of a pointer CUDA knows (device memory, or managed memory), -1
// for host memory it does not know; pinned host memory counts as host.
int pointer_device(const void* p);

// A stream of its own on one device, created non-blocking: never the legacy
// default stream, so it neither waits for nor delays other streams' work.
class Stream {
 public:
  Stream() = default;
  explicit Stream(int device);
  ~Stream();
  Stream(Stream&& o) noexcept;
  Stream& operator=(Stream&& o) noexcept;

  void* handle() const noexcept { return stream_; }  // cudaStream_t
  int device() const noexcept { return device_; }
  explicit operator bool() const noexcept { return stream_ != nullptr; }
  void synchronize() const;
  // Later work on this stream waits for what was queued on `cuda_stream`
  // (a cudaStream_t) or up to `cuda_event` (a cudaEvent_t) so far.
  void wait_stream(void* cuda_stream) const;
  void wait_event(void* cuda_event) const;

 private:
  void* stream_ = nullptr;
  void* event_ = nullptr;  // for wait_stream
  int device_ = -1;
};

// Marks a point of a stream; ready() once the work before it finished.
class Event {
 public:
  Event() = default;
  explicit Event(int device);
  ~Event();
  Event(Event&& o) noexcept;
  Event& operator=(Event&& o) noexcept;

  void record(const Stream& stream);
  // True when nothing was recorded or the recorded work finished; throws
  // Errc::transport for a failed kernel or copy.
  bool ready() const;
  explicit operator bool() const noexcept { return event_ != nullptr; }

 private:
  void* event_ = nullptr;
  bool recorded_ = false;
};

enum class MemoryPlace : uint8_t { device, pinned };

// Device memory (cudaMalloc) or pinned host memory (cudaHostAlloc, mapped and
// portable: kernels on any device reach it at the same address), zeroed.
class Memory {
 public:
  Memory() = default;
  Memory(std::size_t bytes, MemoryPlace place, int device);
  ~Memory();
  Memory(Memory&& o) noexcept;
  Memory& operator=(Memory&& o) noexcept;

  char* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }
  MemoryPlace place() const noexcept { return place_; }

 private:
  char* data_ = nullptr;
  std::size_t bytes_ = 0;
  MemoryPlace place_ = MemoryPlace::device;
};

// Synchronous copies outside the data path (tests, tools, setup).
void copy_to_device(void* dst, const void* src, std::size_t bytes);
void copy_to_host(void* dst, const void* src, std::size_t bytes);
void copy_on_device(void* dst, const void* src, std::size_t bytes);

// Queues a plain copy of `bytes` between any memory CUDA reaches on `stream`.
void copy_async(void* dst, const void* src, std::size_t bytes, const Stream& stream);
// For benchmarks: the median seconds of `work` (which queues GPU work on the
// stream it is given) over `repeats` runs after one warm-up, timed with
// events on a stream of its own on `device`.
double time_gpu(const std::function<void(const Stream&)>& work, int device, int repeats);

class DeviceQuant;

// Copy programs of one pipeline on one device: their runs and tasks uploaded
// once into one allocation; each launch runs one whole program as one kernel.
class DevicePrograms {
 public:
  DevicePrograms() = default;
  // `chunk_bytes` 0: each program's tasks sized by task_chunk_bytes.
  DevicePrograms(const std::vector<const CopyProgram*>& programs, int device,
                 int64_t chunk_bytes = 0);

  std::size_t size() const noexcept { return spans_.size(); }
  // Runs program `index` on `stream` (asynchronously): reads at src_base +
  // run.src, writes at dst_base + run.dst; bases aligned to 16 bytes.
  void launch(std::size_t index, const Stream& stream, std::uintptr_t src_base,
              std::uintptr_t dst_base) const;
  // As launch(), and every block of `quant` in the same kernel launch (its
  // sources at q_src_base + part.src where relative, its codes and scales at
  // q_dst_base + ...): a sender's bucket, whose quantized items and packed
  // items occupy disjoint bytes of the slot. An empty `quant`: launch().
  void launch_with_quant(std::size_t index, const Stream& stream, std::uintptr_t src_base,
                         std::uintptr_t dst_base, const DeviceQuant& quant,
                         std::uintptr_t q_src_base, std::uintptr_t q_dst_base) const;

 private:
  struct Span {
    std::size_t first_run = 0, first_task = 0, num_tasks = 0;
  };
  Memory table_;
  std::size_t tasks_offset_ = 0;  // bytes into table_ where the tasks begin
  std::vector<Span> spans_;
  unsigned blocks_ = 0;  // grid bound: a few blocks per multiprocessor
};

// An FP8 quantize program (core/fp8.h) uploaded once to `device`; each
// launch runs every tile as one kernel (one CUDA block per 128 x 128 block),
// with fp8_math.h's arithmetic: the host quantizer's bytes.
class DeviceQuant {
 public:
  DeviceQuant() = default;
  DeviceQuant(const fp8::QuantProgram& program, int device);
  bool empty() const noexcept { return num_blocks_ == 0; }
  void launch(const Stream& stream, std::uintptr_t src_base, std::uintptr_t dst_base) const;

 private:
  friend class DevicePrograms;  // launch_with_quant
  Memory table_;
  std::size_t parts_offset_ = 0, blocks_offset_ = 0;  // bytes into table_
  unsigned num_blocks_ = 0;
};

// Applies delta frames to device memory: the frame and its tables (built
// and checked on the CPU: pipeline::frame_tables, core/delta.h) uploaded,
// one kernel patching the targets, one hashing them (cuda/delta_kernel.cu).
// Its device buffers grow to the largest frame and tables it was given.
class DeltaPatcher {
 public:
  DeltaPatcher() = default;
  explicit DeltaPatcher(int device);
  DeltaPatcher(DeltaPatcher&&) noexcept = default;
  DeltaPatcher& operator=(DeltaPatcher&&) noexcept = default;

  // Queues on `stream`: the upload of `frame_bytes` bytes at `frame` (host
  // memory, read before this returns or by the stream's copy) and of the
  // tables, the patch of the memory at target_base + chunk.dst, and the
  // hash of the `hash` chunks. Call between a stream's runs only: a run
  // reuses the buffers of the one before.
  void run(const Stream& stream, const char* frame, std::size_t frame_bytes,
           const std::vector<delta::PatchChunk>& patch, const std::vector<delta::HashChunk>& hash,
           std::uintptr_t target_base);
  // The digest sum of the last run's hash chunks: waits for `stream`.
  uint64_t digest(const Stream& stream) const;

 private:
  int device_ = -1;
  unsigned blocks_ = 0;
  Memory frame_, patch_, hash_;
  Memory sum_;       // the device's sum
  Memory sum_host_;  // pinned, where it lands
};

// Runs `program` once, after the work queued so far on `after_stream` (a
// cudaStream_t; nullptr: the legacy default stream), on a stream of its own,
// and waits for it. It uploads a temporary table: for one-off copies such as
// copy_box, never for the per-step data path.
void run_once(const CopyProgram& program, int device, void* after_stream, std::uintptr_t src_base,
              std::uintptr_t dst_base);

}  // namespace weightsync::gpu
