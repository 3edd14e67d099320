// gpu.h over the CUDA runtime (built when CUDA was found).
#include "core/cuda/gpu.h"

#include <weightsync/error.h>

#include "core/cuda/copy_kernel.h"
#include "core/cuda/delta_kernel.h"
#include "core/cuda/quant_kernel.h"
#include "core/fp8.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace weightsync::gpu {
namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(Errc::transport, what, ": ", cudaGetErrorString(e));
}

cudaStream_t stream_of(const Stream& s) {
  return static_cast<cudaStream_t>(s.handle());
}

// True when a CUDA context is current on the calling thread (it chose a
// device, or did CUDA work). cudaGetDevice cannot tell: it answers 0 either
// way. The driver's cuCtxGetCurrent, reached through the runtime (no link to
// libcuda), can; unknown counts as current.
bool context_current() {
  using GetCurrent = int (*)(void**);
  static const GetCurrent get = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &p, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      return GetCurrent{nullptr};
    return reinterpret_cast<GetCurrent>(p);
  }();
  if (!get) return true;
  void* ctx = nullptr;
  return get(&ctx) == 0 && ctx != nullptr;  // CUDA_SUCCESS; not initialized: none
}

// Pins the calling thread to `device` for the scope, then restores the
// previous device, unless the thread had none: setting device 0 back on a
// thread that never chose one would create a context there (about 0.5 GB on
// GPU 0 of a multi-GPU node where this rank works on another).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    const bool had_context = context_current();
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (device >= 0 && device != previous_) {
      check(cudaSetDevice(device), "cudaSetDevice");
      restore_ = had_context;
    }
  }
  ~DeviceScope() {
    if (restore_) cudaSetDevice(previous_);
  }

 private:
  int previous_ = 0;
  bool restore_ = false;
};

kernel::Run device_run(const CopyRun& r) {
  kernel::Run out{};
  out.src = r.src;
  out.dst = r.dst;
  out.bytes = r.bytes;
  out.count0 = r.count[0];
  out.count1 = r.count[1];
  for (int k = 0; k < kCopyOuterDims; ++k) {
    out.src_stride[k] = r.src_stride[k];
    out.dst_stride[k] = r.dst_stride[k];
  }
  return out;
}

kernel::Task device_task(const CopyTask& t) {
  return {t.run, t.vec, t.rows, t.vecs_per_row, t.tile, t.row, t.offset};
}

unsigned grid_bound(int device) {
  if (device < 0) check(cudaGetDevice(&device), "cudaGetDevice");
  unsigned blocks = 0;
  check(kernel::max_resident_blocks(device, &blocks), "sizing the copy kernel's grid");
  return blocks;
}

}  // namespace

bool built_with_cuda() noexcept {
  return true;
}

int device_count() noexcept {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess)
    return cat("no usable GPU here (cudaGetDeviceCount: ", cudaGetErrorString(e), ")");
  return n > 0 ? "" : "no CUDA device present";
}

void require_device(const std::string& what) {
  const std::string why = unavailable_reason();
  if (!why.empty()) fail(Errc::unsupported, what, " needs a GPU: ", why);
}

void set_device(int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
}

void synchronize_device(int device) {
  DeviceScope scope(device);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

void synchronize_stream(void* cuda_stream) {
  check(cudaStreamSynchronize(static_cast<cudaStream_t>(cuda_stream)), "cudaStreamSynchronize");
}

void synchronize_event(void* cuda_event) {
  check(cudaEventSynchronize(static_cast<cudaEvent_t>(cuda_event)), "cudaEventSynchronize");
}

int pointer_device(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();  // an unknown pointer leaves a sticky-free error behind
    return -1;
  }
  return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

Stream::Stream(int device) : device_(device) {
  DeviceScope scope(device);
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  cudaEvent_t e = nullptr;
  if (cudaError_t err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming); err != cudaSuccess) {
    cudaStreamDestroy(s);
    check(err, "cudaEventCreate");
  }
  stream_ = s;
  event_ = e;
}

Stream::~Stream() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
  if (stream_) cudaStreamDestroy(static_cast<cudaStream_t>(stream_));
}

Stream::Stream(Stream&& o) noexcept
    : stream_(std::exchange(o.stream_, nullptr)),
      event_(std::exchange(o.event_, nullptr)),
      device_(o.device_) {}

Stream& Stream::operator=(Stream&& o) noexcept {
  if (this != &o) {
    this->~Stream();
    new (this) Stream(std::move(o));
  }
  return *this;
}

void Stream::synchronize() const {
  check(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_)), "cudaStreamSynchronize");
}

void Stream::wait_stream(void* cuda_stream) const {
  auto e = static_cast<cudaEvent_t>(event_);
  check(cudaEventRecord(e, static_cast<cudaStream_t>(cuda_stream)), "cudaEventRecord(producer)");
  wait_event(e);
}

void Stream::wait_event(void* cuda_event) const {
  check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_),
                            static_cast<cudaEvent_t>(cuda_event), 0),
        "cudaStreamWaitEvent");
}

Event::Event(int device) {
  DeviceScope scope(device);
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  event_ = e;
}

Event::~Event() {
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
}

Event::Event(Event&& o) noexcept
    : event_(std::exchange(o.event_, nullptr)), recorded_(std::exchange(o.recorded_, false)) {}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    this->~Event();
    new (this) Event(std::move(o));
  }
  return *this;
}

void Event::record(const Stream& stream) {
  check(cudaEventRecord(static_cast<cudaEvent_t>(event_), stream_of(stream)), "cudaEventRecord");
  recorded_ = true;
}

bool Event::ready() const {
  if (!recorded_) return true;
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event_));
  if (e == cudaErrorNotReady) return false;
  check(e, "a copy on the GPU failed (cudaEventQuery)");
  return true;
}

Memory::Memory(std::size_t bytes, MemoryPlace place, int device) : bytes_(bytes), place_(place) {
  DeviceScope scope(device);
  void* p = nullptr;
  const std::size_t n = std::max<std::size_t>(bytes, 1);
  if (place == MemoryPlace::device) {
    if (cudaError_t e = cudaMalloc(&p, n); e != cudaSuccess)
      fail(Errc::io, "cannot allocate ", bytes, " bytes of device memory on GPU ", device, ": ",
           cudaGetErrorString(e));
    // cudaMemset returns before it runs, on the legacy stream, which the
    // pipelines' non-blocking streams (and peers writing over IPC) do not
    // wait for: finish it here, before anyone else writes the memory.
    if (cudaError_t e = cudaMemset(p, 0, n); e != cudaSuccess) {
      cudaFree(p);
      fail(Errc::transport, "cudaMemset: ", cudaGetErrorString(e));
    }
    check(cudaStreamSynchronize(nullptr), "synchronizing the zeroing of device memory");
  } else {
    if (cudaError_t e = cudaHostAlloc(&p, n, cudaHostAllocPortable | cudaHostAllocMapped);
        e != cudaSuccess)
      fail(Errc::io, "cannot allocate ", bytes,
           " bytes of pinned host memory: ", cudaGetErrorString(e));
    std::memset(p, 0, n);
  }
  data_ = static_cast<char*>(p);
}

Memory::~Memory() {
  if (!data_) return;
  if (place_ == MemoryPlace::device)
    cudaFree(data_);
  else
    cudaFreeHost(data_);
}

Memory::Memory(Memory&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      bytes_(std::exchange(o.bytes_, 0)),
      place_(o.place_) {}

Memory& Memory::operator=(Memory&& o) noexcept {
  if (this != &o) {
    this->~Memory();
    new (this) Memory(std::move(o));
  }
  return *this;
}

void copy_to_device(void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

void copy_to_host(void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

void copy_on_device(void* dst, const void* src, std::size_t bytes) {
  check(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy on device");
}

void copy_async(void* dst, const void* src, std::size_t bytes, const Stream& stream) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_of(stream)), "cudaMemcpyAsync");
}

double time_gpu(const std::function<void(const Stream&)>& work, int device, int repeats) {
  DeviceScope scope(device);
  const Stream stream(device);
  cudaEvent_t begin = nullptr, end = nullptr;
  check(cudaEventCreate(&begin), "cudaEventCreate");
  check(cudaEventCreate(&end), "cudaEventCreate");
  std::vector<float> ms;
  try {
    work(stream);  // warm-up: module load, first-touch of the memory
    stream.synchronize();
    for (int r = 0; r < std::max(1, repeats); ++r) {
      check(cudaEventRecord(begin, stream_of(stream)), "cudaEventRecord");
      work(stream);
      check(cudaEventRecord(end, stream_of(stream)), "cudaEventRecord");
      check(cudaEventSynchronize(end), "cudaEventSynchronize");
      float t = 0;
      check(cudaEventElapsedTime(&t, begin, end), "cudaEventElapsedTime");
      ms.push_back(t);
    }
  } catch (...) {
    cudaEventDestroy(begin);
    cudaEventDestroy(end);
    throw;
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2] / 1e3;
}

DevicePrograms::DevicePrograms(const std::vector<const CopyProgram*>& programs, int device,
                               int64_t chunk_bytes) {
  blocks_ = grid_bound(device);
  std::vector<kernel::Run> runs;
  std::vector<kernel::Task> tasks;
  for (const CopyProgram* p : programs) {
    Span s;
    s.first_run = runs.size();
    s.first_task = tasks.size();
    for (const CopyRun& r : p->runs()) runs.push_back(device_run(r));
    const int64_t chunk = chunk_bytes > 0 ? chunk_bytes : task_chunk_bytes(p->bytes(), blocks_);
    for (const CopyTask& t : copy_tasks(*p, chunk)) tasks.push_back(device_task(t));
    s.num_tasks = tasks.size() - s.first_task;
    spans_.push_back(s);
  }
  tasks_offset_ = (runs.size() * sizeof(kernel::Run) + 255) / 256 * 256;
  const std::size_t bytes = tasks_offset_ + tasks.size() * sizeof(kernel::Task);
  if (bytes == 0) return;
  table_ = Memory(bytes, MemoryPlace::device, device);
  copy_to_device(table_.data(), runs.data(), runs.size() * sizeof(kernel::Run));
  copy_to_device(table_.data() + tasks_offset_, tasks.data(), tasks.size() * sizeof(kernel::Task));
  // A pageable host-to-device copy may return before it lands; the kernels
  // that read the table run on other (non-blocking) streams.
  check(cudaStreamSynchronize(nullptr), "synchronizing the copy-program table upload");
}

void DevicePrograms::launch(std::size_t index, const Stream& stream, std::uintptr_t src_base,
                            std::uintptr_t dst_base) const {
  launch_with_quant(index, stream, src_base, dst_base, DeviceQuant(), 0, 0);
}

void DevicePrograms::launch_with_quant(std::size_t index, const Stream& stream,
                                       std::uintptr_t src_base, std::uintptr_t dst_base,
                                       const DeviceQuant& quant, std::uintptr_t q_src_base,
                                       std::uintptr_t q_dst_base) const {
  const Span& s = spans_.at(index);
  if (s.num_tasks == 0 && quant.empty()) return;
  if (s.num_tasks > 0 && (src_base % 16 != 0 || dst_base % 16 != 0))
    fail(Errc::internal, "copy program: bases ", src_base, " and ", dst_base,
         " are not aligned to 16 bytes");
  const auto* runs = reinterpret_cast<const kernel::Run*>(table_.data()) + s.first_run;
  const auto* tasks =
      reinterpret_cast<const kernel::Task*>(table_.data() + tasks_offset_) + s.first_task;
  const auto num_tasks = static_cast<unsigned>(s.num_tasks);
  if (quant.empty()) {
    check(
        kernel::launch_copy(runs, tasks, num_tasks, src_base, dst_base, blocks_, stream_of(stream)),
        "launching the copy kernel");
    return;
  }
  kernel::QuantArgs q;
  q.tiles = reinterpret_cast<const kernel::QuantTile*>(quant.table_.data());
  q.parts = reinterpret_cast<const kernel::QuantPart*>(quant.table_.data() + quant.parts_offset_);
  q.blocks =
      reinterpret_cast<const kernel::QuantBlock*>(quant.table_.data() + quant.blocks_offset_);
  q.num_blocks = quant.num_blocks_;
  q.src_base = q_src_base;
  q.dst_base = q_dst_base;
  check(kernel::launch_pack_quant(runs, tasks, num_tasks, src_base, dst_base, blocks_, q,
                                  stream_of(stream)),
        "launching the fused copy and FP8 quantize kernel");
}

void run_once(const CopyProgram& program, int device, void* after_stream, std::uintptr_t src_base,
              std::uintptr_t dst_base) {
  const DevicePrograms table({&program}, device);
  Stream stream(device);
  stream.wait_stream(after_stream);  // nullptr: the legacy default stream's work so far
  table.launch(0, stream, src_base, dst_base);
  stream.synchronize();  // the table is freed on return
}

DeviceQuant::DeviceQuant(const fp8::QuantProgram& program, int device) {
  std::vector<kernel::QuantTile> tiles;
  std::vector<kernel::QuantPart> parts;
  std::vector<kernel::QuantBlock> blocks;
  for (const fp8::QuantTile& t : program.tiles()) {
    kernel::QuantTile k{};
    k.dst = t.dst;
    k.dst_row_stride = t.dst_row_stride;
    k.dst_col_stride = t.dst_col_stride;
    k.scale = t.scale;
    k.scale_stride = t.scale_stride;
    k.rows = t.rows;
    k.cols = t.cols;
    k.first_part = t.first_part;
    k.num_parts = t.num_parts;
    k.src_dtype = t.src_dtype == DType::F32 ? 2 : t.src_dtype == DType::F16 ? 1 : 0;
    k.ue8m0 = t.format == ScaleFormat::ue8m0;
    k.relative = t.relative;
    for (int64_t j = 0; j < t.blocks(); ++j)
      blocks.push_back({static_cast<unsigned>(tiles.size()), static_cast<unsigned>(j)});
    tiles.push_back(k);
  }
  for (const fp8::QuantPart& p : program.parts())
    parts.push_back(
        {p.src, p.row_stride, p.col_stride, p.row0, p.rows, p.col0, p.cols, p.relative ? 1 : 0});
  if (blocks.size() > 0x7FFFFFFFu)
    fail(Errc::unsupported, "FP8 quantize program of ", blocks.size(), " blocks (at most 2^31)");
  num_blocks_ = static_cast<unsigned>(blocks.size());
  if (blocks.empty()) return;
  const auto align = [](std::size_t b) { return (b + 255) / 256 * 256; };
  parts_offset_ = align(tiles.size() * sizeof(kernel::QuantTile));
  blocks_offset_ = parts_offset_ + align(parts.size() * sizeof(kernel::QuantPart));
  table_ = Memory(blocks_offset_ + blocks.size() * sizeof(kernel::QuantBlock), MemoryPlace::device,
                  device);
  copy_to_device(table_.data(), tiles.data(), tiles.size() * sizeof(kernel::QuantTile));
  copy_to_device(table_.data() + parts_offset_, parts.data(),
                 parts.size() * sizeof(kernel::QuantPart));
  copy_to_device(table_.data() + blocks_offset_, blocks.data(),
                 blocks.size() * sizeof(kernel::QuantBlock));
  check(cudaStreamSynchronize(nullptr), "synchronizing the FP8 quantize table upload");
}

void DeviceQuant::launch(const Stream& stream, std::uintptr_t src_base,
                         std::uintptr_t dst_base) const {
  if (num_blocks_ == 0) return;
  check(kernel::launch_quant(
            reinterpret_cast<const kernel::QuantTile*>(table_.data()),
            reinterpret_cast<const kernel::QuantPart*>(table_.data() + parts_offset_),
            reinterpret_cast<const kernel::QuantBlock*>(table_.data() + blocks_offset_),
            num_blocks_, src_base, dst_base, stream_of(stream)),
        "launching the FP8 quantize kernel");
}

DeltaPatcher::DeltaPatcher(int device)
    : device_(device),
      sum_(sizeof(uint64_t), MemoryPlace::device, device),
      sum_host_(sizeof(uint64_t), MemoryPlace::pinned, device) {
  DeviceScope scope(device);
  check(kernel::max_resident_blocks(device, &blocks_), "sizing the delta patch grid");
}

namespace {

// `m` holds at least `bytes` (its contents are not kept).
void reserve(Memory& m, std::size_t bytes, int device) {
  if (m.bytes() < bytes) m = Memory(std::max(bytes, m.bytes() * 2), MemoryPlace::device, device);
}

}  // namespace

void DeltaPatcher::run(const Stream& stream, const char* frame, std::size_t frame_bytes,
                       const std::vector<delta::PatchChunk>& patch,
                       const std::vector<delta::HashChunk>& hash, std::uintptr_t target_base) {
  if (device_ < 0) fail(Errc::internal, "DeltaPatcher: run before it was made for a device");
  DeviceScope scope(device_);
  // A buffer the stream's last run may still read is replaced only once it is done.
  const std::size_t patch_bytes = patch.size() * sizeof(delta::PatchChunk);
  const std::size_t hash_bytes = hash.size() * sizeof(delta::HashChunk);
  if (frame_.bytes() < frame_bytes || patch_.bytes() < patch_bytes || hash_.bytes() < hash_bytes)
    stream.synchronize();
  reserve(frame_, frame_bytes, device_);
  reserve(patch_, patch_bytes, device_);
  reserve(hash_, hash_bytes, device_);
  const cudaStream_t s = stream_of(stream);
  if (frame_bytes > 0)
    check(cudaMemcpyAsync(frame_.data(), frame, frame_bytes, cudaMemcpyHostToDevice, s),
          "uploading a delta frame");
  if (patch_bytes > 0)
    check(cudaMemcpyAsync(patch_.data(), patch.data(), patch_bytes, cudaMemcpyHostToDevice, s),
          "uploading a delta patch table");
  if (hash_bytes > 0)
    check(cudaMemcpyAsync(hash_.data(), hash.data(), hash_bytes, cudaMemcpyHostToDevice, s),
          "uploading a delta hash table");
  check(cudaMemsetAsync(sum_.data(), 0, sizeof(uint64_t), s), "clearing the delta digest");
  check(kernel::launch_delta_patch(reinterpret_cast<const delta::PatchChunk*>(patch_.data()),
                                   static_cast<unsigned>(patch.size()),
                                   reinterpret_cast<std::uintptr_t>(frame_.data()), target_base,
                                   blocks_, s),
        "launching the delta patch kernel");
  check(kernel::launch_delta_hash(reinterpret_cast<const delta::HashChunk*>(hash_.data()),
                                  static_cast<unsigned>(hash.size()), target_base,
                                  reinterpret_cast<unsigned long long*>(sum_.data()), s),
        "launching the delta hash kernel");
  check(cudaMemcpyAsync(sum_host_.data(), sum_.data(), sizeof(uint64_t), cudaMemcpyDeviceToHost, s),
        "reading the delta digest");
}

uint64_t DeltaPatcher::digest(const Stream& stream) const {
  stream.synchronize();
  uint64_t v = 0;
  std::memcpy(&v, sum_host_.data(), sizeof v);
  return v;
}

}  // namespace weightsync::gpu
