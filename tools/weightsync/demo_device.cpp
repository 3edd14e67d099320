#include "demo_device.h"

#include <weightsync/error.h>

#include <weightsync/backend/transport.h>

#include <algorithm>

namespace weightsync::demo {

void check_device(const std::string& device, const std::string& flag) {
  if (device == "cpu") return;
  if (device != "cuda")
    fail(Errc::invalid_argument, flag, ": expected cpu or cuda, got '", device, "'");
  gpu::require_device(flag + " " + device);
}

bool on_gpu(const JobSpec& job) {
  return job.device == "cuda";
}

int gpu_of(int rank) {
  return rank % std::max(1, gpu::device_count());
}

WorkerTensor::WorkerTensor(DType dtype, const Shape& shape, int gpu, const std::string& transport) {
  const size_t bytes = std::max<size_t>(static_cast<size_t>(numel(shape)) * itemsize(dtype), 1);
  if (gpu < 0 && !transport.empty())
    host_ = allocate_host_memory(transport, bytes);
  else
    host_ = std::shared_ptr<char>(new char[bytes](), std::default_delete<char[]>());
  view_ = weightsync::host_view(host_.get(), dtype, shape);
  if (gpu < 0) return;
  device_ = gpu::Memory(bytes, gpu::MemoryPlace::device, gpu);
  view_ = tensor_view(device_.data(), dtype, shape, MemoryKind::cuda, gpu);
}

TensorView WorkerTensor::host_view() const {
  return weightsync::host_view(host_.get(), view_.dtype, view_.shape);
}

void WorkerTensor::upload() {
  if (device_.data()) gpu::copy_to_device(device_.data(), host_.get(), nbytes());
}

void WorkerTensor::download() {
  if (device_.data()) gpu::copy_to_host(host_.get(), device_.data(), nbytes());
}

}  // namespace weightsync::demo
