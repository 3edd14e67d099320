// `weightsync bench export`: the distributed HF save (Publisher::save_hf) of
// the bench model from its trainer ranks, against a plain write of the same
// files from memory by the same processes to the same disk in the same run.
#include "cli.h"
#include "demo_run.h"
#include "demo_setup.h"
#include "export_job.h"

#include <nlohmann/json.hpp>

#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/plan.h>
#include <weightsync/publisher.h>
#include <weightsync/safetensors.h>
#include <weightsync/topology.h>

#include "core/writer_layout.h"
#include "demo_job.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <optional>

namespace weightsync::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kUsage =
    "usage: weightsync bench export [--json] [--size-gb G] [--mesh M] [--max-file-bytes N]\n"
    "                               [--bucket-bytes N] [--transport X] [--rounds K]\n"
    "                               [--dir D] [--timeout S] [--no-sync] [--buffered-io]\n"
    "       weightsync bench export --plan-only --hf-config F [--mesh M] [--max-file-bytes N]\n"
    "                               [--bucket-bytes N] [--json]\n\n"
    "Saves the bench model (Qwen3-MoE shaped, about G GB in BF16, default 1.0) as an HF\n"
    "checkpoint from its trainer ranks (mesh M, default ep=2,fsdp=2: 4 processes), the\n"
    "way `weightsync export` does: files of at most N bytes (default 134217728, so that\n"
    "every rank writes some), pieces moved between the ranks over X (default\n"
    "'ucx?peer_errors=off': UCX's shared memory on one host; plain 'ucx' asks UCX to\n"
    "report dead peers, which it does over TCP only, so it runs over TCP loopback) in\n"
    "buckets of --bucket-bytes (default: the save's).\n"
    "The reference, measured in the same processes and the same K rounds (default 3):\n"
    "a plain write of the same files (same keys, sizes and writer ranks) with the same\n"
    "writer, from memory already holding their bytes, nothing moving between ranks, to\n"
    "the same disk, twice: through the page cache, and bypassing it (O_DIRECT on whole\n"
    "aligned blocks) as the save does with fsync unless --buffered-io; the faster (by\n"
    "median) is the reference. All flush their files to the device (fsync; --no-sync:\n"
    "none). Each phase of a round (plain, plain direct, save) starts with its files\n"
    "removed and a sync; times are the slowest rank's, from a barrier. Prints the median\n"
    "GB/s of each and the ratio of the save to the reference (goal >= 0.8), CPU seconds\n"
    "of each, and checks the saved directory against the source, key by key, byte for\n"
    "byte. Files go under --dir (default: a fresh directory under $TMPDIR or /tmp,\n"
    "removed at the end unless the run failed).\n"
    "--json prints one object: save_gbps, plain_gbps (the reference), ratio_to_plain,\n"
    "plain_buffered_gbps, plain_direct_gbps, save_s_p50, plain_s_p50, save_cpu_s,\n"
    "plain_cpu_s, bytes, files, ranks, transport, direct_io, rounds, arena_mb,\n"
    "staging_mb, peak_rss_mb, verified.\n\n"
    "--plan-only: what every rank computes before a save moves a byte, for the model of\n"
    "HF config F on an XTuner-style trainer layout of mesh M (default ep=8,fsdp=32): the\n"
    "file layout, the writer layout (windows) and the plan; prints their sizes, times and\n"
    "the peak RSS of this one process.\n";

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// "" when every key of `source` is in `saved`, equal byte for byte.
std::string compare(const std::string& source, const std::string& saved) {
  const Checkpoint a = Checkpoint::open(source), b = Checkpoint::open(saved);
  if (a.keys() != b.keys()) return "the key sets differ";
  for (const std::string& k : a.keys()) {
    const TensorView x = a.view(k), y = b.view(k);
    if (x.dtype != y.dtype || x.shape != y.shape) return "dtype or shape of " + k;
    if (std::memcmp(x.data, y.data, x.nbytes()) != 0) return "bytes of " + k;
  }
  return "";
}

// --plan-only: what every rank computes before a save moves a byte (the file
// layout, the writer layout and the plan), at any scale, without processes.
int plan_only(const Args& args) {
  const HfModelConfig config = HfModelConfig::load(args.require("hf-config"));
  const TrainerLayout layout =
      make_trainer_layout(config, parse_mesh_spec(args.get_or("mesh", "ep=8,fsdp=32")));
  const int64_t max_file = args.get_int("max-file-bytes", kDefaultMaxFileBytes);
  int64_t bucket = args.get_int("bucket-bytes", 0);
  if (bucket == 0) bucket = default_save_bucket_bytes(layout, int64_t{256} << 20);
  const auto t0 = std::chrono::steady_clock::now();
  const WriterLayout wl = make_writer_layout(layout, max_file, bucket);
  const auto t1 = std::chrono::steady_clock::now();
  std::optional<Plan> plan;
  if (!wl.windows.empty()) plan = make_plan(layout, wl.engine, Topology{}, {PlanMode::p2p, bucket});
  const auto t2 = std::chrono::steady_clock::now();
  const nlohmann::json out = {{"ranks", layout.mesh.world()},
                              {"keys", wl.files.keys.size()},
                              {"bytes", wl.files.total_bytes()},
                              {"files", wl.files.files.size()},
                              {"bucket_bytes", bucket},
                              {"windows", wl.windows.size()},
                              {"buckets", plan ? plan->buckets().size() : 0},
                              {"items", plan ? plan->items().size() : 0},
                              {"writer_layout_s", std::chrono::duration<double>(t1 - t0).count()},
                              {"plan_s", std::chrono::duration<double>(t2 - t1).count()},
                              {"peak_rss_mb", demo::peak_rss_mb()}};
  if (args.flag("json")) {
    std::cout << out.dump() << "\n";
    return 0;
  }
  std::printf(
      "%s, %lld ranks: %zu keys, %.4g GB in %zu files; %zu windows of at most %lld "
      "bytes, %zu buckets, %zu items\n",
      args.require("hf-config").c_str(), static_cast<long long>(layout.mesh.world()),
      wl.files.keys.size(), wl.files.total_bytes() / 1e9, wl.files.files.size(), wl.windows.size(),
      static_cast<long long>(bucket), out["buckets"].get<size_t>(), out["items"].get<size_t>());
  std::printf("writer layout %.3f s, plan %.3f s, peak RSS %.0f MB\n",
              out["writer_layout_s"].get<double>(), out["plan_s"].get<double>(),
              out["peak_rss_mb"].get<double>());
  return 0;
}

// The figures of a finished run: medians over the rounds of the slowest
// rank's times and of all ranks' CPU seconds, and each rank's memory.
nlohmann::json figures(const nlohmann::json& s) {
  std::vector<double> save_s, plain_s, direct_s, save_cpu, plain_cpu, direct_cpu;
  for (size_t i = 0; i < s["rounds"].size(); ++i) {
    save_s.push_back(s["rounds"][i]["seconds"].get<double>());
    plain_s.push_back(s["rounds"][i]["plain_seconds"].get<double>());
    direct_s.push_back(s["rounds"][i]["plain_direct_seconds"].get<double>());
    double sc = 0, pc = 0, dc = 0;
    for (const auto& r : s["per_rank"]) {
      const auto& row = r["stats"]["rounds"][i];
      sc += row["save"]["cpu_s"].get<double>();
      pc += row["plain_cpu_s"].get<double>();
      dc += row["plain_direct_cpu_s"].get<double>();
    }
    save_cpu.push_back(sc);
    plain_cpu.push_back(pc);
    direct_cpu.push_back(dc);
  }
  const double bytes = s["rounds"][0]["bytes"].get<double>();
  // The reference: the faster plain write, through the page cache or not.
  const bool direct_faster = median(direct_s) < median(plain_s);
  const double buffered_gbps = bytes / median(plain_s) / 1e9;
  const double direct_gbps = bytes / median(direct_s) / 1e9;
  const double save_gbps = bytes / median(save_s) / 1e9;
  const double plain_gbps = std::max(buffered_gbps, direct_gbps);
  double arena = 0, staging = 0, rss = 0;
  for (const auto& r : s["per_rank"]) {
    const auto& st = r["stats"]["rounds"].back()["save"];
    arena = std::max(arena, st["arena_bytes"].get<double>() / 1048576.0);
    staging = std::max(staging, st["staging_bytes"].get<double>() / 1048576.0);
    rss = std::max(rss, r["stats"]["peak_rss_mb"].get<double>());
  }
  return {{"save_gbps", save_gbps},
          {"plain_gbps", plain_gbps},
          {"ratio_to_plain", save_gbps / plain_gbps},
          {"plain_buffered_gbps", buffered_gbps},
          {"plain_direct_gbps", direct_gbps},
          {"plain_reference", direct_faster ? "direct" : "buffered"},
          {"save_s_p50", median(save_s)},
          {"plain_s_p50", direct_faster ? median(direct_s) : median(plain_s)},
          {"save_cpu_s", median(save_cpu)},
          {"plain_cpu_s", direct_faster ? median(direct_cpu) : median(plain_cpu)},
          {"plain_buffered_cpu_s", median(plain_cpu)},
          {"plain_direct_cpu_s", median(direct_cpu)},
          {"bytes", bytes},
          {"files", s["rounds"][0]["files"]},
          {"ranks", s["ranks"]},
          {"transport", s["transport"]},
          {"direct_io", s["direct_io"]},
          {"rounds", s["rounds"]},
          {"arena_mb", arena},
          {"staging_mb", staging},
          {"peak_rss_mb", rss}};
}

void print_figures(const nlohmann::json& f) {
  std::printf("save: p50 %.3f s over %zu rounds, %.3f GB/s (%.4g GB in %d files, %d ranks)\n",
              f["save_s_p50"].get<double>(), f["rounds"].size(), f["save_gbps"].get<double>(),
              f["bytes"].get<double>() / 1e9, f["files"].get<int>(), f["ranks"].get<int>());
  std::printf("plain write of the same files: %.3f GB/s through the page cache, %.3f GB/s direct\n",
              f["plain_buffered_gbps"].get<double>(), f["plain_direct_gbps"].get<double>());
  std::printf("reference (the faster, %s): p50 %.3f s, %.3f GB/s -> ratio_to_plain %.2f\n",
              f["plain_reference"].get<std::string>().c_str(), f["plain_s_p50"].get<double>(),
              f["plain_gbps"].get<double>(), f["ratio_to_plain"].get<double>());
  std::printf("CPU seconds, all ranks: save %.3f (%s), plain %.3f buffered, %.3f direct\n",
              f["save_cpu_s"].get<double>(),
              f["direct_io"].get<bool>() ? "direct I/O" : "buffered I/O",
              f["plain_buffered_cpu_s"].get<double>(), f["plain_direct_cpu_s"].get<double>());
  std::printf("per rank (max): arena %.1f MiB, staging %.1f MiB, peak RSS %.0f MB\n",
              f["arena_mb"].get<double>(), f["staging_mb"].get<double>(),
              f["peak_rss_mb"].get<double>());
}

exporter::ExportJob bench_job(const Args& args, const demo::ModelFiles& model,
                              const std::string& dir) {
  exporter::ExportJob job;
  job.checkpoint = model.checkpoint;
  job.trainer = model.trainer;
  job.out = dir + "/saved";
  job.hf_config = dir + "/model/config.json";
  job.max_file_bytes = args.get_int("max-file-bytes", int64_t{128} << 20);
  job.bucket_bytes = args.get_int("bucket-bytes", 0);  // 0: the save's default
  // One host: UCX over shared memory (a dead rank is caught by the
  // coordinator's membership and the save's own abort, not by UCX).
  job.transport = args.get_or("transport", "ucx?peer_errors=off");
  job.sync = !args.flag("no-sync");
  job.direct_io = job.sync && !args.flag("buffered-io");  // as save_hf takes it
  job.timeout_ms = static_cast<int64_t>(args.get_double("timeout", 600) * 1000);
  job.rounds = static_cast<int>(args.get_int("rounds", 3));
  job.plain_dir = dir + "/plain";
  job.work_dir = dir + "/work";
  if (job.rounds < 1 || job.max_file_bytes <= 0 ||
      (job.bucket_bytes != 0 && job.bucket_bytes < 1024))
    fail(Errc::invalid_argument,
         "--rounds and --max-file-bytes must be positive, --bucket-bytes at least 1024");
  return job;
}

int run_bench_export(const std::vector<std::string>& argv) {
  Args args(argv, {"json", "no-sync", "plan-only", "buffered-io"},
            {"size-gb", "mesh", "max-file-bytes", "bucket-bytes", "transport", "rounds", "dir",
             "timeout", "hf-config"});
  if (args.flag("plan-only")) return plan_only(args);
  const std::string dir =
      args.has("dir") ? args.require("dir") : demo::make_temp_dir("bench-export");
  for (const char* sub : {"/model", "/work", "/plain"}) fs::create_directories(dir + sub);
  demo::ModelSetup setup;
  setup.hf_config = demo::bench_model_config(args.get_double("size-gb", 1.0));
  setup.mesh = args.get_or("mesh", "ep=2,fsdp=2");
  const demo::ModelFiles model = demo::write_model(dir + "/model", setup);
  const exporter::ExportJob job = bench_job(args, model, dir);
  std::cerr << "weightsync bench export: " << model.family << " model, " << model.tensors
            << " tensors, " << model.bytes / 1e9 << " GB; mesh " << setup.mesh << " over "
            << job.transport << ", files of at most " << job.max_file_bytes << " bytes, "
            << job.rounds << " rounds in " << dir << "\n";
  const nlohmann::json s = exporter::run_export(job);
  if (!s["ok"].get<bool>()) {
    std::cerr << "weightsync bench export: FAILED (files and logs kept in " << dir << ")\n"
              << s.dump(2) << "\n";
    return 1;
  }
  nlohmann::json out = figures(s);
  const std::string diff = compare(model.checkpoint, job.out);
  out["verified"] = diff.empty();
  if (args.flag("json")) {
    std::cout << out.dump() << "\n";
  } else {
    print_figures(out);
    std::printf("%s\n", diff.empty() ? "verified: every key equal to the source, byte for byte"
                                     : ("MISMATCH: " + diff).c_str());
  }
  // A directory of its own (about 3x the model: source, plain and saved
  // files) goes once the figures are in; one named by --dir stays.
  if (!args.has("dir") && diff.empty()) {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  return diff.empty() ? 0 : 1;
}

const BenchRegistrar registrar{{"export",
                                "distributed HF checkpoint save vs a plain write of the same files",
                                kUsage, run_bench_export}};

}  // namespace
}  // namespace weightsync::cli
