// `weightsync bench fp8`: the host FP8 block quantizer (core/fp8.h, what an
// FP8 engine rank runs after each step) on BF16 weights, against memcpy of
// the same BF16 bytes measured in the same run.
#include "cli.h"

#include <weightsync/error.h>

#include "core/cuda/gpu.h"
#include "core/fp8.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <memory>
#include <random>
#include <vector>

namespace weightsync::cli {
namespace {

constexpr const char* kUsage =
    "usage: weightsync bench fp8 [--device cpu|cuda] [--mib N] [--repeats R]\n"
    "                            [--scale fp32|ue8m0] [--json]\n\n"
    "Quantizes about N MiB (default 256) of BF16 weights into E4M3 with one scale per\n"
    "128 x 128 block (the host quantizer of FP8 engines), as [4096, 4096] tensors and\n"
    "as [7168, 2048] tensors read through a strided source (every other column\n"
    "block of [7168, 4096]: a TP slice), and times each against memcpy of the same\n"
    "BF16 bytes (ratio_to_memcpy; the goal is >= 0.5). GB/s count BF16 bytes read.\n"
    "--device cuda: the same tensors in GPU memory, quantized by the CUDA kernel\n"
    "(one launch for all of them, as a bucket's), against a device-to-device copy\n"
    "of the same BF16 bytes (ratio_to_d2d; the goal is >= 0.7); N defaults to 1024.\n"
    "Both check the kernel's bytes against the host quantizer's on the first tensor.\n";

struct Shape2 {
  const char* name;
  int64_t rows, cols;  // the quantized tensor
  int64_t src_cols;    // its source's row length (> cols: a column slice)
};

std::vector<uint16_t> bf16_pattern() {
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<uint16_t> pattern(1 << 16);
  for (auto& v : pattern) {
    const float f = normal(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    v = static_cast<uint16_t>(u >> 16);
  }
  return pattern;
}

int64_t addr(const void* p) {
  return static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(p));
}

// Appends the quantization of one tensor of shape s (its source rows
// s.src_cols apart) at `src` into dense codes at `q` and scales at `scales`.
void add_tensor(fp8::QuantProgram& program, const Shape2& s, const void* src, const void* q,
                const void* scales, ScaleFormat format) {
  fp8::Region g;
  g.src = addr(src);
  g.src_rs = s.src_cols;
  g.dst = addr(q);
  g.dst_rs = s.cols;
  g.scale = addr(scales);
  g.scale_rs = (s.cols + 127) / 128;
  g.rows = s.rows;
  g.cols = s.cols;
  fp8::add_region(program, g, DType::BF16, format);
}

// The CUDA kernel on `count` tensors of shape s in GPU 0's memory (one
// allocation each side), one launch for all, against a device-to-device copy
// of the same BF16 bytes; the first tensor's codes and scales are checked
// against the host quantizer.
nlohmann::json run_shape_cuda(const Shape2& s, int64_t target_bytes, ScaleFormat format,
                              int repeats) {
  const int64_t src_bytes = s.rows * s.src_cols * 2, bytes = s.rows * s.cols * 2;
  const int64_t count = std::max<int64_t>(1, target_bytes / bytes);
  const int64_t bcols = (s.cols + 127) / 128, nscales = ((s.rows + 127) / 128) * bcols;
  const std::vector<uint16_t> pattern = bf16_pattern();
  std::vector<uint16_t> host(static_cast<size_t>(src_bytes / 2));
  for (size_t e = 0; e < host.size(); ++e) host[e] = pattern[(e * 7919) & 0xFFFF];
  gpu::Memory src(static_cast<size_t>(src_bytes * count), gpu::MemoryPlace::device, 0);
  gpu::Memory q(static_cast<size_t>(s.rows * s.cols * count), gpu::MemoryPlace::device, 0);
  gpu::Memory scales(static_cast<size_t>(nscales * 4 * count), gpu::MemoryPlace::device, 0);
  fp8::QuantProgram program;
  for (int64_t i = 0; i < count; ++i) {
    gpu::copy_to_device(src.data() + i * src_bytes, host.data(), static_cast<size_t>(src_bytes));
    add_tensor(program, s, src.data() + i * src_bytes, q.data() + i * s.rows * s.cols,
               scales.data() + i * nscales * 4, format);
  }
  const gpu::DeviceQuant kernel(program, 0);
  const double quant_s =
      gpu::time_gpu([&](const gpu::Stream& st) { kernel.launch(st, 0, 0); }, 0, repeats);
  // The kernel's bytes against the host quantizer's (first tensor).
  std::vector<uint16_t> dense(static_cast<size_t>(s.rows * s.cols));
  for (int64_t r = 0; r < s.rows; ++r)
    std::memcpy(&dense[static_cast<size_t>(r * s.cols)], &host[static_cast<size_t>(r * s.src_cols)],
                static_cast<size_t>(s.cols * 2));
  std::vector<uint8_t> want_q(dense.size()), got_q(dense.size());
  std::vector<float> want_s(static_cast<size_t>(nscales)), got_s(want_s.size());
  fp8::quantize_tensor(dense.data(), DType::BF16, s.rows, s.cols, format, want_q.data(),
                       want_s.data());
  gpu::copy_to_host(got_q.data(), q.data(), got_q.size());
  gpu::copy_to_host(got_s.data(), scales.data(), got_s.size() * 4);
  const bool same =
      want_q == got_q && std::memcmp(want_s.data(), got_s.data(), got_s.size() * 4) == 0;
  if (!same)
    fail(Errc::internal, "bench fp8 --device cuda: the kernel's codes or scales of ", s.name,
         " differ from the host quantizer's");
  // A device-to-device copy of the same BF16 bytes.
  gpu::Memory a(static_cast<size_t>(bytes * count), gpu::MemoryPlace::device, 0);
  gpu::Memory b(static_cast<size_t>(bytes * count), gpu::MemoryPlace::device, 0);
  const double copy_s = gpu::time_gpu(
      [&](const gpu::Stream& st) {
        gpu::copy_async(b.data(), a.data(), static_cast<size_t>(bytes * count), st);
      },
      0, repeats);
  const double total = static_cast<double>(bytes * count);
  return {{"shape", s.name},
          {"tensors", count},
          {"bf16_bytes", bytes * count},
          {"gbps", total / quant_s / 1e9},
          {"d2d_gbps", total / copy_s / 1e9},
          {"ratio_to_d2d", copy_s / quant_s},
          {"verified", same}};
}

nlohmann::json run_shape(const Shape2& s, int64_t target_bytes, ScaleFormat format, int repeats) {
  const int64_t src_bytes = s.rows * s.src_cols * 2, bytes = s.rows * s.cols * 2;
  const int64_t count = std::max<int64_t>(1, target_bytes / bytes);
  const std::vector<uint16_t> pattern = bf16_pattern();
  std::vector<std::unique_ptr<uint16_t[]>> src;
  std::vector<std::unique_ptr<uint8_t[]>> q;
  std::vector<std::unique_ptr<float[]>> scales;
  const int64_t nscales = ((s.rows + 127) / 128) * ((s.cols + 127) / 128);
  fp8::QuantProgram program;
  for (int64_t i = 0; i < count; ++i) {
    src.emplace_back(new uint16_t[static_cast<size_t>(src_bytes / 2)]);
    for (int64_t e = 0; e < src_bytes / 2; ++e)
      src.back()[static_cast<size_t>(e)] = pattern[static_cast<size_t>(e) & 0xFFFF];
    q.emplace_back(new uint8_t[static_cast<size_t>(s.rows * s.cols)]());
    scales.emplace_back(new float[static_cast<size_t>(nscales)]());
    add_tensor(program, s, src.back().get(), q.back().get(), scales.back().get(), format);
  }
  // memcpy of the same BF16 bytes: the dense sources into another buffer.
  std::unique_ptr<char[]> a(new char[static_cast<size_t>(bytes * count)]);
  std::unique_ptr<char[]> b(new char[static_cast<size_t>(bytes * count)]);
  std::memset(a.get(), 1, static_cast<size_t>(bytes * count));
  std::memset(b.get(), 2, static_cast<size_t>(bytes * count));
  const double quant_s = median_seconds([&] { fp8::execute_quant_host(program, 0, 0); }, repeats);
  const double copy_s = median_seconds(
      [&] { std::memcpy(b.get(), a.get(), static_cast<size_t>(bytes * count)); }, repeats);
  const double total = static_cast<double>(bytes * count);
  return {{"shape", s.name},
          {"tensors", count},
          {"bf16_bytes", bytes * count},
          {"gbps", total / quant_s / 1e9},
          {"memcpy_gbps", total / copy_s / 1e9},
          {"ratio_to_memcpy", copy_s / quant_s}};
}

int run_fp8_bench(const std::vector<std::string>& argv) {
  Args args(argv, {"json"}, {"mib", "repeats", "scale", "device"});
  const std::string device = args.get_or("device", "cpu");
  if (device != "cpu" && device != "cuda")
    fail(Errc::invalid_argument, "--device must be cpu or cuda, got '", device, "'");
  const bool cuda = device == "cuda";
  if (cuda && gpu::device_count() == 0)
    fail(Errc::unsupported, "bench fp8 --device cuda: no GPU (", gpu::unavailable_reason(), ")");
  const int64_t mib = args.get_int("mib", cuda ? 1024 : 256);
  if (mib < 1 || mib > 16384) fail(Errc::invalid_argument, "--mib must be in [1, 16384]");
  const int repeats = static_cast<int>(args.get_int("repeats", 5));
  if (repeats < 1) fail(Errc::invalid_argument, "--repeats must be at least 1");
  const std::string scale = args.get_or("scale", "fp32");
  if (scale != "fp32" && scale != "ue8m0")
    fail(Errc::invalid_argument, "--scale must be fp32 or ue8m0, got '", scale, "'");
  const ScaleFormat format = scale == "ue8m0" ? ScaleFormat::ue8m0 : ScaleFormat::fp32;
  const Shape2 shapes[] = {{"dense_4096x4096", 4096, 4096, 4096},
                           {"column_slice_7168x2048", 7168, 2048, 4096}};
  nlohmann::json rows = nlohmann::json::array();
  for (const Shape2& s : shapes)
    rows.push_back(cuda ? run_shape_cuda(s, mib << 20, format, repeats)
                        : run_shape(s, mib << 20, format, repeats));
  const nlohmann::json out = {{"device", device}, {"scale", scale}, {"shapes", rows}};
  if (args.flag("json")) {
    std::cout << out.dump() << "\n";
    return 0;
  }
  const char* ref = cuda ? "d2d" : "memcpy";
  const std::string ref_gbps = cat(ref, "_gbps"), ratio = cat("ratio_to_", ref);
  for (const auto& r : rows)
    std::printf("%-24s %8.1f MB BF16: quantize %8.2f GB/s, %s %8.2f GB/s -> %.2f\n",
                r["shape"].get<std::string>().c_str(), r["bf16_bytes"].get<double>() / 1e6,
                r["gbps"].get<double>(), ref, r[ref_gbps].get<double>(), r[ratio].get<double>());
  return 0;
}

const BenchRegistrar registrar{{"fp8",
                                "the host FP8 block quantizer vs memcpy of the same BF16 bytes",
                                kUsage, run_fp8_bench}};

}  // namespace
}  // namespace weightsync::cli
