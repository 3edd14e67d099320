// gpu.h for a build without CUDA: queries answer "none"; anything that would
// touch a GPU fails with Errc::unsupported.
#include "core/cuda/gpu.h"

#include <weightsync/error.h>

namespace weightsync::gpu {
namespace {

[[noreturn]] void no_cuda(const char* what) {
  fail(Errc::unsupported, what, ": weightsync was built without CUDA (WEIGHTSYNC_WITH_CUDA)");
}

}  // namespace

bool built_with_cuda() noexcept {
  return false;
}
int device_count() noexcept {
  return 0;
}
std::string unavailable_reason() {
  return "weightsync was built without CUDA (WEIGHTSYNC_WITH_CUDA)";
}
void require_device(const std::string& what) {
  fail(Errc::unsupported, what, " needs a GPU: ", unavailable_reason());
}
void set_device(int) {
  no_cuda("set_device");
}
void synchronize_device(int) {
  no_cuda("synchronize_device");
}
void synchronize_stream(void*) {
  no_cuda("synchronize_stream");
}
void synchronize_event(void*) {
  no_cuda("synchronize_event");
}
int pointer_device(const void*) {
  return -1;
}

Stream::Stream(int) {
  no_cuda("a CUDA stream");
}
Stream::~Stream() = default;
Stream::Stream(Stream&&) noexcept = default;
Stream& Stream::operator=(Stream&&) noexcept = default;
void Stream::synchronize() const {}
void Stream::wait_stream(void*) const {}
void Stream::wait_event(void*) const {}

Event::Event(int) {
  no_cuda("a CUDA event");
}
Event::~Event() = default;
Event::Event(Event&&) noexcept = default;
Event& Event::operator=(Event&&) noexcept = default;
void Event::record(const Stream&) {
  no_cuda("a CUDA event");
}
bool Event::ready() const {
  return true;
}

Memory::Memory(std::size_t, MemoryPlace, int) {
  no_cuda("device or pinned memory");
}
Memory::~Memory() = default;
Memory::Memory(Memory&&) noexcept = default;
Memory& Memory::operator=(Memory&&) noexcept = default;

void copy_to_device(void*, const void*, std::size_t) {
  no_cuda("a copy to the device");
}
void copy_to_host(void*, const void*, std::size_t) {
  no_cuda("a copy from the device");
}
void copy_on_device(void*, const void*, std::size_t) {
  no_cuda("a copy on the device");
}

void copy_async(void*, const void*, std::size_t, const Stream&) {
  no_cuda("a copy on a stream");
}
double time_gpu(const std::function<void(const Stream&)>&, int, int) {
  no_cuda("timing GPU work");
}

DevicePrograms::DevicePrograms(const std::vector<const CopyProgram*>&, int, int64_t) {
  no_cuda("copy programs on the GPU");
}
void DevicePrograms::launch(std::size_t, const Stream&, std::uintptr_t, std::uintptr_t) const {
  no_cuda("copy programs on the GPU");
}

void run_once(const CopyProgram&, int, void*, std::uintptr_t, std::uintptr_t) {
  no_cuda("a copy in CUDA memory");
}

void DevicePrograms::launch_with_quant(std::size_t, const Stream&, std::uintptr_t, std::uintptr_t,
                                       const DeviceQuant&, std::uintptr_t, std::uintptr_t) const {
  no_cuda("DevicePrograms::launch_with_quant");
}

DeviceQuant::DeviceQuant(const fp8::QuantProgram&, int) {
  no_cuda("DeviceQuant");
}
void DeviceQuant::launch(const Stream&, std::uintptr_t, std::uintptr_t) const {
  no_cuda("DeviceQuant::launch");
}

DeltaPatcher::DeltaPatcher(int) {
  no_cuda("delta frames applied on the GPU");
}
void DeltaPatcher::run(const Stream&, const char*, std::size_t,
                       const std::vector<delta::PatchChunk>&, const std::vector<delta::HashChunk>&,
                       std::uintptr_t) {
  no_cuda("delta frames applied on the GPU");
}
uint64_t DeltaPatcher::digest(const Stream&) const {
  no_cuda("delta frames applied on the GPU");
}

}  // namespace weightsync::gpu
