// `weightsync bench delta`: the delta codec (core/delta.h) on the host,
// encoding a changed version against the previous one and applying it,
// against memcpy of the same dense bytes measured in the same run.
#include "cli.h"

#include <weightsync/error.h>

#include "core/cuda/gpu.h"
#include "core/delta.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <random>
#include <vector>

namespace weightsync::cli {
namespace {

constexpr const char* kUsage =
    "usage: weightsync bench delta [--mib N] [--update random:F] [--dtype bf16|fp8|f32]\n"
    "                              [--device cpu|cuda] [--repeats R] [--json]\n\n"
    "Delta-encodes about N MiB (default 256) of weights against their previous\n"
    "version, where a fraction F (default 0.02) of the elements changed at random,\n"
    "then applies the encoding to a copy of the previous version (checked equal to\n"
    "the new one). Prints the encoded bytes against the dense bytes, and the\n"
    "encoder's and the applier's throughput in dense bytes per second against\n"
    "memcpy of the same dense bytes (ratio_to_memcpy; the aim is >= 0.5). The\n"
    "encoder also brings the sender's copy of the receiver's bytes up to date.\n\n"
    "--device cuda also applies the encoding on GPU 0 as an engine rank with CUDA\n"
    "params does (docs/delta.md): the CPU checks it and builds the tables\n"
    "(tables_gbps), the frame and tables are uploaded, the patch and hash kernels\n"
    "run and the digest comes back (device_apply_gbps, checked against the host's),\n"
    "against a device-to-device copy of the same dense bytes (ratio_to_d2d; the aim\n"
    "is >= 0.5).\n";

struct Element {
  const char* name;
  int bytes;
};

double parse_fraction(const std::string& spec) {
  const std::string prefix = "random:";
  if (spec.rfind(prefix, 0) != 0)
    fail(Errc::invalid_argument, "--update must be random:F, got '", spec, "'");
  std::size_t used = 0;
  double f = -1;
  try {
    f = std::stod(spec.substr(prefix.size()), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != spec.size() - prefix.size() || !(f >= 0.0 && f <= 1.0))
    fail(Errc::invalid_argument, "--update random:F needs F in [0, 1], got '", spec, "'");
  return f;
}

// Seconds of `f` (median of `repeats`), `reset` run untimed before each.
template <typename Reset, typename F>
double timed(int repeats, Reset reset, F f) {
  std::vector<double> s;
  for (int i = 0; i < repeats; ++i) {
    reset();
    const auto start = std::chrono::steady_clock::now();
    f();
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(s.begin(), s.end());
  return s[s.size() / 2];
}

// The encoding applied on GPU 0 as an engine rank does it (the tables
// built on the CPU, then DeltaPatcher: upload, patch, hash, digest back),
// and a device-to-device copy of the same dense bytes.
nlohmann::json device_apply(const std::vector<uint8_t>& old, const std::vector<uint8_t>& next,
                            const std::vector<uint8_t>& enc, int64_t encoded, int element_bytes,
                            int repeats) {
  const int dev = 0;
  gpu::set_device(dev);
  const int64_t elements = static_cast<int64_t>(old.size()) / element_bytes;
  std::vector<delta::PatchChunk> patch;
  std::vector<delta::HashChunk> hash;
  const double tables_s = timed(
      repeats,
      [&] {
        patch.clear();
        hash.clear();
      },
      [&] {
        delta::patch_table(enc.data(), encoded, elements, element_bytes, "bench", 0, 0, patch);
        delta::hash_table(elements, element_bytes, 7, 0, hash);
      });
  gpu::Memory target(old.size(), gpu::MemoryPlace::device, dev);
  gpu::Memory copy(old.size(), gpu::MemoryPlace::device, dev);
  gpu::copy_to_device(target.data(), old.data(), old.size());
  gpu::DeltaPatcher patcher(dev);
  const auto base = reinterpret_cast<std::uintptr_t>(target.data());
  const auto* frame = reinterpret_cast<const char*>(enc.data());
  // A patch applied again writes the same bytes: the timed runs need no reset.
  const double apply_s = gpu::time_gpu(
      [&](const gpu::Stream& s) {
        patcher.run(s, frame, static_cast<size_t>(encoded), patch, hash, base);
      },
      dev, repeats);
  const gpu::Stream stream(dev);
  patcher.run(stream, frame, static_cast<size_t>(encoded), patch, hash, base);
  const uint64_t digest = patcher.digest(stream);
  std::vector<uint8_t> got(old.size());
  gpu::copy_to_host(got.data(), target.data(), got.size());
  if (got != next || digest != delta::digest(next.data(), elements, element_bytes, 7))
    fail(Errc::internal, "bench delta: the bytes (or the digest) the GPU applied differ from the ",
         "new version's");
  const double d2d_s = gpu::time_gpu(
      [&](const gpu::Stream& s) { gpu::copy_async(copy.data(), target.data(), old.size(), s); },
      dev, repeats);
  const double dense = static_cast<double>(old.size());
  return {{"tables_gbps", dense / tables_s / 1e9},
          {"device_apply_gbps", dense / apply_s / 1e9},
          {"d2d_gbps", dense / d2d_s / 1e9},
          {"device_apply_ratio_to_d2d", d2d_s / apply_s},
          {"device", "cuda:0"}};
}

int run_delta_bench(const std::vector<std::string>& argv) {
  Args args(argv, {"json"}, {"mib", "update", "dtype", "repeats", "device"});
  const std::string device = args.get_or("device", "cpu");
  if (device != "cpu" && device != "cuda")
    fail(Errc::invalid_argument, "--device must be cpu or cuda, got '", device, "'");
  if (device == "cuda") gpu::require_device("bench delta --device cuda");
  const int64_t mib = args.get_int("mib", 256);
  if (mib < 1 || mib > 16384) fail(Errc::invalid_argument, "--mib must be in [1, 16384]");
  const int repeats = static_cast<int>(args.get_int("repeats", 5));
  if (repeats < 1) fail(Errc::invalid_argument, "--repeats must be at least 1");
  const double fraction = parse_fraction(args.get_or("update", "random:0.02"));
  const std::string dtype = args.get_or("dtype", "bf16");
  Element el{"bf16", 2};
  if (dtype == "fp8")
    el = {"fp8", 1};
  else if (dtype == "f32")
    el = {"f32", 4};
  else if (dtype != "bf16")
    fail(Errc::invalid_argument, "--dtype must be bf16, fp8 or f32, got '", dtype, "'");

  const int64_t bytes = mib << 20, elements = bytes / el.bytes;
  std::vector<uint8_t> old(static_cast<size_t>(bytes));
  std::mt19937_64 rng(1);
  for (size_t i = 0; i + 8 <= old.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(&old[i], &v, 8);
  }
  // The new version: each element changed with probability `fraction`, in
  // its lowest byte (an optimizer's small step on a weight).
  std::vector<uint8_t> next = old;
  std::bernoulli_distribution pick(fraction);
  for (int64_t i = 0; i < elements; ++i)
    if (pick(rng)) next[static_cast<size_t>(i * el.bytes)] ^= 1;

  std::vector<uint8_t> base(old.size()), target(old.size());
  std::vector<uint8_t> enc(static_cast<size_t>(delta::max_encoded_bytes(elements, el.bytes)));
  int64_t encoded = 0;
  delta::EncodeStats stats;
  const double encode_s = timed(
      repeats, [&] { std::memcpy(base.data(), old.data(), old.size()); },
      [&] {
        stats = {};
        encoded = delta::encode(next.data(), base.data(), elements, el.bytes, enc.data(), &stats);
      });
  const double apply_s = timed(
      repeats, [&] { std::memcpy(target.data(), old.data(), old.size()); },
      [&] { delta::apply(enc.data(), encoded, target.data(), elements, el.bytes, "bench"); });
  if (target != next || base != next)
    fail(Errc::internal, "bench delta: the applied (or the sender's) bytes differ from the new ",
         "version");
  const double copy_s = timed(
      repeats, [] {}, [&] { std::memcpy(target.data(), next.data(), next.size()); });
  const double dense = static_cast<double>(bytes);
  nlohmann::json out = {
      {"dtype", el.name},
      {"dense_bytes", bytes},
      {"encoded_bytes", encoded},
      {"bytes_ratio_to_dense", static_cast<double>(encoded) / dense},
      {"changed_fraction", static_cast<double>(stats.changed) / static_cast<double>(elements)},
      {"chunks",
       {{"unchanged", stats.chunks[0]},
        {"list", stats.chunks[1]},
        {"runs", stats.chunks[2]},
        {"dense", stats.chunks[3]}}},
      {"encode_gbps", dense / encode_s / 1e9},
      {"apply_gbps", dense / apply_s / 1e9},
      {"memcpy_gbps", dense / copy_s / 1e9},
      {"encode_ratio_to_memcpy", copy_s / encode_s},
      {"apply_ratio_to_memcpy", copy_s / apply_s},
      {"verified", true}};
  if (device == "cuda") out.update(device_apply(old, next, enc, encoded, el.bytes, repeats));
  if (args.flag("json")) {
    std::cout << out.dump() << "\n";
    return 0;
  }
  std::printf("%s, %.1f MB, %.4f of the elements changed: encoded %.2f MB (%.4f of dense)\n",
              el.name, dense / 1e6, out["changed_fraction"].get<double>(),
              static_cast<double>(encoded) / 1e6, out["bytes_ratio_to_dense"].get<double>());
  std::printf("encode %8.2f GB/s, apply %8.2f GB/s, memcpy %8.2f GB/s -> %.2f, %.2f\n",
              out["encode_gbps"].get<double>(), out["apply_gbps"].get<double>(),
              out["memcpy_gbps"].get<double>(), out["encode_ratio_to_memcpy"].get<double>(),
              out["apply_ratio_to_memcpy"].get<double>());
  if (device == "cuda")
    std::printf("GPU: tables %8.2f GB/s (CPU), apply %8.2f GB/s, D2D copy %8.2f GB/s -> %.2f\n",
                out["tables_gbps"].get<double>(), out["device_apply_gbps"].get<double>(),
                out["d2d_gbps"].get<double>(), out["device_apply_ratio_to_d2d"].get<double>());
  return 0;
}

const BenchRegistrar registrar{
    {"delta", "the delta codec's encode and apply vs memcpy of the same dense bytes", kUsage,
     run_delta_bench}};

}  // namespace
}  // namespace weightsync::cli
