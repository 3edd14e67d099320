// `weightsync bench copy`: the copy-program executor alone (a bucket's pack)
// on the patterns of DESIGN.md's calibration, against a plain copy of the
// same bytes measured in the same run: a device-to-device copy on the GPU
// (--device cuda: one kernel launch per program), memcpy on the host.
#include "cli.h"
#include "demo_device.h"

#include <weightsync/error.h>

#include "core/copy_program.h"
#include "core/cuda/gpu.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <memory>
#include <vector>

namespace weightsync::cli {
namespace {

constexpr const char* kUsage =
    "usage: weightsync bench copy [--device cpu|cuda] [--mib N] [--repeats R] [--json]\n\n"
    "Packs about N MiB (default 512) of BF16 pieces into a contiguous slot with one\n"
    "copy program per pattern, and times it against a plain copy of the same bytes:\n"
    "  column_quarters  column quarter-slices of [R, 4096] tensors (2 KiB runs)\n"
    "  row_slices       contiguous 8 MiB slices\n"
    "  column_256b      256-byte column runs of [R, 512] tensors\n"
    "  small_pieces     16 KiB pieces, each a tensor of its own\n"
    "  transpose        a [4096, 4096] tensor packed transposed (element runs)\n"
    "--device cuda: one kernel launch per program vs a device-to-device copy\n"
    "(ratio_to_d2d); cpu: the host executor vs memcpy (ratio_to_memcpy).\n";

struct Pattern {
  const char* name;
  int64_t rows, cols;     // each source tensor, BF16
  int64_t col_lo, col_n;  // the packed columns of every row
  bool transpose = false;
};

// The program packing `tensors` sources of pattern `p` (src base 0: the
// offsets are the sources' addresses) back to back into a slot.
CopyProgram pack_program(const Pattern& p, const std::vector<char*>& sources) {
  CopyProgram program;
  int64_t at = 0;
  for (char* src : sources) {
    const auto base = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(src));
    if (p.transpose) {
      program.add(base, {1, p.cols}, at, {p.rows, 1}, {p.cols, p.rows}, 2);
      at += p.rows * p.cols * 2;
      continue;
    }
    program.add(base + p.col_lo * 2, {p.cols, 1}, at, {p.col_n, 1}, {p.rows, p.col_n}, 2);
    at += p.rows * p.col_n * 2;
  }
  return program;
}

// Sources and slot in `cuda` (GPU 0) or host memory; returns GB/s of the
// program and of the plain copy.
nlohmann::json run_pattern(const Pattern& p, int64_t target_bytes, bool cuda, int repeats) {
  const int64_t tensor_bytes = p.rows * p.cols * 2;
  const int64_t packed = p.transpose ? tensor_bytes : p.rows * p.col_n * 2;
  const int64_t count = std::max<int64_t>(1, target_bytes / packed);
  std::vector<gpu::Memory> device;
  std::vector<std::unique_ptr<char[]>> host;
  std::vector<char*> sources;
  auto alloc = [&](int64_t bytes) -> char* {
    if (cuda) {
      device.emplace_back(static_cast<size_t>(bytes), gpu::MemoryPlace::device, 0);
      return device.back().data();
    }
    host.emplace_back(new char[static_cast<size_t>(bytes)]());
    std::memset(host.back().get(), 1, static_cast<size_t>(bytes));
    return host.back().get();
  };
  for (int64_t i = 0; i < count; ++i) sources.push_back(alloc(tensor_bytes));
  const int64_t bytes = packed * count;
  char* slot = alloc(bytes);
  char* other = alloc(bytes);
  const CopyProgram program = pack_program(p, sources);
  const auto slot_base = reinterpret_cast<std::uintptr_t>(slot);
  double program_s = 0, plain_s = 0;
  if (cuda) {
    const gpu::DevicePrograms table({&program}, 0);
    program_s =
        gpu::time_gpu([&](const gpu::Stream& s) { table.launch(0, s, 0, slot_base); }, 0, repeats);
    plain_s = gpu::time_gpu(
        [&](const gpu::Stream& s) { gpu::copy_async(other, slot, static_cast<size_t>(bytes), s); },
        0, repeats);
  } else {
    program_s = median_seconds([&] { execute_host(program, 0, slot_base); }, repeats);
    plain_s =
        median_seconds([&] { std::memcpy(other, slot, static_cast<size_t>(bytes)); }, repeats);
  }
  const double gbps = static_cast<double>(bytes) / program_s / 1e9;
  const double plain = static_cast<double>(bytes) / plain_s / 1e9;
  return {{"pattern", p.name},      {"bytes", bytes},
          {"runs", program.size()}, {"gbps", gbps},
          {"plain_gbps", plain},    {cuda ? "ratio_to_d2d" : "ratio_to_memcpy", gbps / plain}};
}

int run_copy_bench(const std::vector<std::string>& argv) {
  Args args(argv, {"json"}, {"device", "mib", "repeats"});
  const std::string device = args.get_or("device", "cpu");
  demo::check_device(device, "--device");
  const int64_t mib = args.get_int("mib", 512);
  if (mib < 1 || mib > 16384) fail(Errc::invalid_argument, "--mib must be in [1, 16384]");
  const int repeats = static_cast<int>(args.get_int("repeats", 10));
  if (repeats < 1) fail(Errc::invalid_argument, "--repeats must be at least 1");
  const bool cuda = device == "cuda";
  const Pattern patterns[] = {
      {"column_quarters", 4096, 4096, 1024, 1024},
      {"row_slices", 1024, 4096, 0, 4096},  // 8 MiB tensors, whole: one run each
      {"column_256b", 8192, 512, 128, 128},
      {"small_pieces", 1, 8192, 0, 8192},
      {"transpose", 4096, 4096, 0, 0, true},
  };
  nlohmann::json rows = nlohmann::json::array();
  for (const Pattern& p : patterns) rows.push_back(run_pattern(p, mib << 20, cuda, repeats));
  const nlohmann::json out = {{"device", device}, {"patterns", rows}};
  if (args.flag("json")) {
    std::cout << out.dump() << "\n";
    return 0;
  }
  for (const auto& r : rows)
    std::printf("%-16s %8.1f MB in %6zu runs: %8.1f GB/s, plain copy %8.1f GB/s -> %.2f\n",
                r["pattern"].get<std::string>().c_str(), r["bytes"].get<double>() / 1e6,
                r["runs"].get<size_t>(), r["gbps"].get<double>(), r["plain_gbps"].get<double>(),
                r[cuda ? "ratio_to_d2d" : "ratio_to_memcpy"].get<double>());
  return 0;
}

const BenchRegistrar registrar{
    {"copy", "the copy-program executor (a bucket's pack) vs a plain copy of the same bytes",
     kUsage, run_copy_bench}};

}  // namespace
}  // namespace weightsync::cli
