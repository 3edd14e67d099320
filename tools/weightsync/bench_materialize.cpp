// `weightsync bench materialize`: how close building one engine rank from a
// checkpoint comes to memory bandwidth. A ~2 GB random checkpoint of a
// Llama-shaped model is built once and cached under /tmp; with the page cache
// warm, one engine rank is materialized into memory and into a file, against
// plain memcpy of the same bytes and plain write() of them to a new file,
// all measured in the same run.
#include "cli.h"

#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/materialize.h>
#include <weightsync/safetensors.h>

#include "core/random_checkpoint.h"

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <vector>

namespace weightsync::cli {
namespace {

namespace fs = std::filesystem;

const char* kUsage =
    "usage: weightsync bench materialize [--bytes N] [--tp T] [--rank R] [--repeat K]\n"
    "                                    [--cache-dir D] [--out-dir D] [--json]\n\n"
    "Materializes engine rank R (default 0) of a vLLM tp=T (default 2) engine from a\n"
    "cached random checkpoint of about N bytes (default 2e9, a Llama-shaped model;\n"
    "built once under --cache-dir, default /tmp/weightsync-bench), page cache warm.\n"
    "Best of K runs (default 3) of, over the rank's bytes:\n"
    "  memcpy between pre-touched buffers (the reference),\n"
    "  materialize into memory (fill_param per param into a reused buffer),\n"
    "  plain write() of the bytes to a new file in --out-dir (default /dev/shm):\n"
    "    the floor of any file output (new page-cache pages),\n"
    "  materialize to a file in --out-dir (removed after).\n"
    "Ratios are against memcpy (goal >= 0.5).\n";

// A Llama-shaped model of about `bytes` BF16 bytes: embeddings plus as many
// layers as fit.
nlohmann::json bench_model(int64_t bytes) {
  const int64_t h = 2048, inter = 8192, vocab = 32000, heads = 16, kv = 4, hd = h / heads;
  const int64_t layer = 2 * (2 * h * h + 2 * kv * hd * h + 3 * h * inter + 2 * h);
  const int64_t fixed = 2 * (2 * vocab * h + h);
  const int64_t layers = std::max<int64_t>(1, (bytes - fixed) / layer);
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"hidden_size", h},
          {"intermediate_size", inter},
          {"num_hidden_layers", layers},
          {"num_attention_heads", heads},
          {"num_key_value_heads", kv},
          {"vocab_size", vocab},
          {"tie_word_embeddings", false},
          {"torch_dtype", "bfloat16"}};
}

// The cached checkpoint, rebuilt when absent or not what the config says.
std::string cached_checkpoint(const HfModelConfig& hf, int64_t bytes, const std::string& dir) {
  const std::string path = dir + "/materialize-" + std::to_string(bytes) + ".safetensors";
  const auto tensors = hf_tensors(hf);
  if (fs::exists(path)) {
    try {
      const Checkpoint ckpt = Checkpoint::open(path);
      bool same = ckpt.keys().size() == tensors.size();
      for (size_t i = 0; same && i < tensors.size(); ++i)
        same = ckpt.contains(tensors[i].key) && ckpt.info(tensors[i].key).shape == tensors[i].shape;
      if (same) return path;
    } catch (const Error&) {
      // Rebuilt below.
    }
  }
  fs::create_directories(dir);
  std::fprintf(stderr, "bench materialize: writing a %.2f GB checkpoint to %s (once)\n",
               static_cast<double>(bytes) / 1e9, path.c_str());
  write_random_checkpoint(path, tensors, {1, 0, 0});
  return path;
}

// Touches every page of every tensor: page cache and this process's mapping.
uint64_t warm(const Checkpoint& ckpt) {
  uint64_t sum = 0;
  for (const auto& key : ckpt.keys()) {
    const TensorView v = ckpt.view(key);
    const auto* p = static_cast<const unsigned char*>(v.data);
    for (size_t i = 0; i < v.nbytes(); i += 4096) sum += p[i];
  }
  return sum;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Best time of `repeat` runs of `f`.
template <class F>
double best_of(int repeat, F&& f) {
  double best = 1e30;
  for (int i = 0; i < repeat; ++i) {
    const double t0 = now_s();
    f();
    best = std::min(best, now_s() - t0);
  }
  return best;
}

struct Figures {
  uint64_t bytes = 0;
  double memcpy_s = 0, memory_s = 0, write_s = 0, file_s = 0;
  double gbps(double s) const { return static_cast<double>(bytes) / s / 1e9; }
};

// The four timings: memcpy (the reference), materialize into reused
// in-memory buffers (fill_param per param), plain write() of the same bytes
// to a new file in out_dir (the floor of any file output), and materialize
// to a file.
Figures measure(const Checkpoint& ckpt, const EngineLayout& layout, int rank,
                const std::string& out, int repeat) {
  Figures f;
  const EngineRankLayout& params = layout.rank_layout(rank);
  for (const auto& p : params.params) f.bytes += numel(p.shape) * itemsize(p.dtype);
  std::vector<char> src(f.bytes, 1), dst(f.bytes, 0);  // touched: no page faults while timed
  f.memcpy_s = best_of(repeat, [&] { std::memcpy(dst.data(), src.data(), f.bytes); });
  f.memory_s = best_of(repeat, [&] {
    size_t at = 0;
    for (const auto& p : params.params) {
      fill_param(ckpt, p, dst.data() + at);
      at += static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype);
    }
  });
  f.write_s = best_of(repeat, [&] {
    SafetensorsWriter w(out, {{"bytes", DType::U8, {static_cast<int64_t>(f.bytes)}}});
    for (size_t at = 0; at < f.bytes; at += 64u << 20)
      w.write(src.data() + at, std::min<size_t>(64u << 20, f.bytes - at));
    w.finish();
    fs::remove(out);
  });
  f.file_s = best_of(repeat, [&] {
    materialize(ckpt, layout, rank, out);
    fs::remove(out);
  });
  return f;
}

int run_bench(const std::vector<std::string>& argv) {
  Args args(argv, {"json"}, {"bytes", "tp", "rank", "repeat", "cache-dir", "out-dir"});
  const int64_t bytes = args.get_int("bytes", 2'000'000'000);
  const int repeat = static_cast<int>(std::max<int64_t>(1, args.get_int("repeat", 3)));
  if (bytes < (1 << 20)) fail(Errc::invalid_argument, "--bytes must be at least 1 MiB");
  EngineConfig config;
  config.framework = "vllm";
  config.hf = HfModelConfig::from_json(bench_model(bytes));
  config.tp = static_cast<int>(args.get_int("tp", 2));
  config.dtype = config.hf.dtype;
  const int rank = static_cast<int>(args.get_int("rank", 0));
  const EngineLayout layout = make_engine_layout(config);
  if (rank < 0 || rank >= layout.world())
    fail(Errc::invalid_argument, "--rank ", rank, " outside tp=", config.tp);
  const std::string ckpt_path =
      cached_checkpoint(config.hf, bytes, args.get_or("cache-dir", "/tmp/weightsync-bench"));
  const Checkpoint ckpt = Checkpoint::open(ckpt_path);
  const uint64_t checksum = warm(ckpt);
  const std::string out_dir = args.get_or("out-dir", fs::exists("/dev/shm") ? "/dev/shm" : "/tmp");
  const std::string out =
      out_dir + "/weightsync-bench-materialize-" + std::to_string(::getpid()) + ".safetensors";
  const Figures f = measure(ckpt, layout, rank, out, repeat);
  const double ratio_file = f.memcpy_s / f.file_s, ratio_memory = f.memcpy_s / f.memory_s;
  if (args.flag("json")) {
    std::cout << nlohmann::json{{"benchmark", "materialize"},
                                {"checkpoint_bytes", fs::file_size(ckpt_path)},
                                {"layers", config.hf.num_layers},
                                {"tp", config.tp},
                                {"rank", rank},
                                {"rank_bytes", f.bytes},
                                {"memcpy_gbps", f.gbps(f.memcpy_s)},
                                {"materialize_gbps", f.gbps(f.file_s)},
                                {"ratio", ratio_file},
                                {"materialize_memory_gbps", f.gbps(f.memory_s)},
                                {"ratio_memory", ratio_memory},
                                {"file_write_gbps", f.gbps(f.write_s)},
                                {"ratio_vs_file_write", f.write_s / f.file_s},
                                {"out_dir", out_dir},
                                {"repeat", repeat},
                                {"warm_checksum", checksum}}
                     .dump()
              << "\n";
    return 0;
  }
  std::printf("materialize bench: llama-shaped, %lld layers, checkpoint %s (%.2f GB, warm)\n",
              static_cast<long long>(config.hf.num_layers), ckpt_path.c_str(),
              static_cast<double>(fs::file_size(ckpt_path)) / 1e9);
  std::printf("  engine vllm tp=%d, rank %d: %.3f GB; best of %d\n", config.tp, rank,
              static_cast<double>(f.bytes) / 1e9, repeat);
  std::printf("  memcpy (reference)           %7.3f s  %6.2f GB/s\n", f.memcpy_s,
              f.gbps(f.memcpy_s));
  std::printf("  materialize into memory      %7.3f s  %6.2f GB/s  ratio %.2f\n", f.memory_s,
              f.gbps(f.memory_s), ratio_memory);
  std::printf("  plain write() to %-11s %7.3f s  %6.2f GB/s  ratio %.2f (file floor)\n",
              out_dir.c_str(), f.write_s, f.gbps(f.write_s), f.memcpy_s / f.write_s);
  std::printf(
      "  materialize to file          %7.3f s  %6.2f GB/s  ratio %.2f (%.2f of the floor)\n",
      f.file_s, f.gbps(f.file_s), ratio_file, f.write_s / f.file_s);
  return 0;
}

const BenchRegistrar registrar{{"materialize",
                                "materialize one engine rank from a cached ~2 GB checkpoint vs "
                                "memcpy",
                                kUsage, run_bench}};

}  // namespace
}  // namespace weightsync::cli
