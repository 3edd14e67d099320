// `weightsync bench fp8`: the host FP8 block quantizer (core/fp8.h, what an
// FP8 engine rank runs after each step) on BF16 weights, against memcpy of
// the same BF16 bytes measured in the same run.
#include "cli.h"

#include <weightsync/error.h>

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
    "usage: weightsync bench fp8 [--mib N] [--repeats R] [--scale fp32|ue8m0] [--json]\n\n"
    "Quantizes about N MiB (default 256) of BF16 weights into E4M3 with one scale per\n"
    "128 x 128 block (the host quantizer of FP8 engines), as [4096, 4096] tensors and\n"
    "as [7168, 2048] tensors read through a strided source (every other column\n"
    "block of [7168, 4096]: a TP slice), and times each against memcpy of the same\n"
    "BF16 bytes (ratio_to_memcpy; the goal is >= 0.5). GB/s count BF16 bytes read.\n";

struct Shape2 {
  const char* name;
  int64_t rows, cols;  // the quantized tensor
  int64_t src_cols;    // its source's row length (> cols: a column slice)
};

nlohmann::json run_shape(const Shape2& s, int64_t target_bytes, ScaleFormat format, int repeats) {
  const int64_t src_bytes = s.rows * s.src_cols * 2, bytes = s.rows * s.cols * 2;
  const int64_t count = std::max<int64_t>(1, target_bytes / bytes);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<uint16_t> pattern(1 << 16);
  for (auto& v : pattern) {
    const float f = normal(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    v = static_cast<uint16_t>(u >> 16);
  }
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
    fp8::Region g;
    g.src = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(src.back().get()));
    g.src_rs = s.src_cols;
    g.dst = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(q.back().get()));
    g.dst_rs = s.cols;
    g.scale = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(scales.back().get()));
    g.scale_rs = (s.cols + 127) / 128;
    g.rows = s.rows;
    g.cols = s.cols;
    fp8::add_region(program, g, DType::BF16, format);
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
  Args args(argv, {"json"}, {"mib", "repeats", "scale"});
  const int64_t mib = args.get_int("mib", 256);
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
  for (const Shape2& s : shapes) rows.push_back(run_shape(s, mib << 20, format, repeats));
  const nlohmann::json out = {{"device", "cpu"}, {"scale", scale}, {"shapes", rows}};
  if (args.flag("json")) {
    std::cout << out.dump() << "\n";
    return 0;
  }
  for (const auto& r : rows)
    std::printf("%-24s %8.1f MB BF16: quantize %7.2f GB/s, memcpy %7.2f GB/s -> %.2f\n",
                r["shape"].get<std::string>().c_str(), r["bf16_bytes"].get<double>() / 1e6,
                r["gbps"].get<double>(), r["memcpy_gbps"].get<double>(),
                r["ratio_to_memcpy"].get<double>());
  return 0;
}

const BenchRegistrar registrar{{"fp8",
                                "the host FP8 block quantizer vs memcpy of the same BF16 bytes",
                                kUsage, run_fp8_bench}};

}  // namespace
}  // namespace weightsync::cli
