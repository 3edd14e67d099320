#include "subscriber_fp8.h"

#include <weightsync/error.h>

#include "pipeline/wire.h"

namespace weightsync::engine {
namespace {

int64_t addr(const void* p) {
  return static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(p));
}

// The quantization of FP8 param `p` from its staging tensor (`data`, of
// dtype `src`, contiguous) into `weight` and `scale`: a region per slice of
// its leading dimensions.
void add_slices(fp8::QuantProgram& program, const EngineParam& p, const TensorView& weight,
                const TensorView& scale, const char* data, DType src) {
  const size_t n = p.shape.size();
  const int64_t rows = p.shape[n - 2], cols = p.shape[n - 1];
  const int64_t slices = rows * cols > 0 ? numel(p.shape) / (rows * cols) : 0;
  const Shape ws = weight.effective_strides(), ss = scale.effective_strides();
  for (int64_t s = 0; s < slices; ++s) {
    // The slice's leading index and its offsets in each tensor.
    int64_t w_off = 0, s_off = 0;
    for (size_t d = n - 2, rest = static_cast<size_t>(s); d-- > 0;
         rest /= static_cast<size_t>(p.shape[d])) {
      const auto idx = static_cast<int64_t>(rest % static_cast<size_t>(p.shape[d]));
      w_off += idx * ws[d];
      s_off += idx * ss[d];
    }
    fp8::Region g;
    g.src = addr(data) + s * rows * cols * static_cast<int64_t>(itemsize(src));
    g.src_rs = cols;
    g.dst = addr(weight.data) + w_off;  // F8: one byte per element
    g.dst_rs = ws[n - 2];
    g.dst_cs = ws[n - 1];
    g.scale = addr(scale.data) + s_off * 4;
    g.scale_rs = ss[n - 2];
    g.scale_cs = ss[n - 1];
    g.rows = rows;
    g.cols = cols;
    if (rows > 0 && cols > 0) fp8::add_region(program, g, src, p.quant->scale);
  }
}

}  // namespace

bool has_fp8(const EngineRankLayout& layout) {
  for (const EngineParam& p : layout.params)
    if (p.quant) return true;
  return false;
}

Fp8Staging::Fp8Staging(const Plan& plan, int engine_template, const EngineRankLayout& layout,
                       const std::vector<TensorView>& params, Transport& transport,
                       const std::string& who)
    : targets_(params) {
  const std::vector<DType> received = received_dtypes(plan, engine_template, layout);
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const EngineParam& p = layout.params[i];
    // Quantized by the senders: its codes and scales land in place.
    if (!p.quant || p.segments.empty() || plan.fp8_on_sender(engine_template, static_cast<int>(i)))
      continue;
    const TensorView& weight = params.at(i);
    const TensorView& scale = params.at(static_cast<size_t>(p.scale_param));
    int device = -1;
    for (const TensorView* t : {&weight, &scale})
      if (t->memory == MemoryKind::cuda && t->numel() > 0)
        device = t->device >= 0 ? t->device : gpu::pointer_device(t->data);
    if (device >= 0 && (weight.memory != MemoryKind::cuda || scale.memory != MemoryKind::cuda))
      fail(Errc::invalid_argument, who, ": FP8 param '", p.name, "' and its scale param '",
           layout.params.at(static_cast<size_t>(p.scale_param)).name,
           "' are in different places (host memory and CUDA)");
    if (staged_ > 0 && device != device_)
      fail(Errc::invalid_argument, who, ": FP8 params on ", device_ < 0 ? "the host" : "CUDA",
           " and '", p.name, "' on ", device < 0 ? "the host" : "CUDA",
           ": a rank's params must be in one place");
    device_ = device;
    const DType src = received[i];
    const auto bytes = static_cast<size_t>(numel(p.shape)) * itemsize(src);
    // Zeroed: elements no segment covers stay zero, as materialize fills them.
    char* data = nullptr;
    if (device >= 0) {
      device_buffers_.emplace_back(std::max<size_t>(bytes, 1), gpu::MemoryPlace::device, device);
      data = device_buffers_.back().data();
      targets_[i] = tensor_view(data, src, p.shape, MemoryKind::cuda, device);
    } else {
      buffers_.push_back(transport.allocate_host(std::max<size_t>(bytes, 1)));
      data = buffers_.back().get();
      targets_[i] = tensor_view(data, src, p.shape, MemoryKind::host, -1);
    }
    add_slices(program_, p, weight, scale, data, src);
    ++staged_;
    staged_bytes_ += static_cast<int64_t>(bytes);
  }
  if (device_ >= 0 && !program_.empty()) {
    device_program_ = gpu::DeviceQuant(program_, device_);
    stream_ = gpu::Stream(device_);
  }
}

void Fp8Staging::quantize() const {
  if (device_ < 0) return fp8::execute_quant_host(program_, 0, 0);
  // The pipeline's applies into the staging tensors completed before run()
  // returned (and the publish before publish_staging() did).
  gpu::set_device(device_);
  device_program_.launch(stream_, 0, 0);
  stream_.synchronize();
}

}  // namespace weightsync::engine
