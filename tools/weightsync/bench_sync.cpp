// `weightsync bench sync` (the default benchmark): sync latency of the demo's
// process setup on a model of about 1-2 GB, against two references measured
// in the same run: the raw transport ceiling (plain tagged transfers of the
// same bytes between the same processes) and the peer baseline
// (tools/bench/peer_baseline.py: gather to rank 0 + broadcast tensor by
// tensor with torch.distributed, as common RL frameworks do). With --device
// cuda the tensors live in GPU memory, the references are a device-to-device
// copy (and, over a host transport, a pinned device-to-host copy) of the same
// bytes, and the peers are PyTorch's way over CUDA IPC
// (tools/bench/peer_ipc_baseline.py) and, 1 -> 1, checkpoint-engine's
// colocated update (tools/bench/peer_checkpoint_engine.py); the stronger is
// the one to beat.
#include "bench_overhead.h"
#include "cli.h"
#include "demo_device.h"
#include "demo_procs.h"
#include "demo_run.h"
#include "demo_setup.h"

#include <nlohmann/json.hpp>

#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/load_spec.h>
#include <weightsync/plan.h>
#include <weightsync/safetensors.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>

#include <sys/wait.h>

namespace weightsync::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kUsage =
    "usage: weightsync bench [sync] [--json] [--trace F] [--steps K] [--size-gb G]\n"
    "                        [--checkpoint C --trainer T.json --engine E.json]\n"
    "                        [--mode p2p|broadcast] [--bucket-bytes N] [--no-peer]\n"
    "                        [--transport NAME] [--timeout S] [--work-dir D]\n"
    "                        [--no-checksums|--checksums] [--checksum-overhead]\n"
    "                        [--no-lend] [--device cpu|cuda] [--fp8]\n"
    "                        [--fp8-site sender|engine] [--metrics-overhead]\n"
    "                        [--delta [--no-delta-verify]]\n"
    "                        [--update random:F|adamw[:lr=X]]\n"
    "                        [--mesh M] [--tp N] [--replicas R]\n\n"
    "Syncs a Qwen3-MoE-shaped model of about G GB (default 1.0) from 4 trainer\n"
    "processes (ep=2 x fsdp=2) into 2 vLLM-layout replicas of tp=2 over UCX, K timed\n"
    "steps (default 5, after one warm-up step). Reports p50/p99 sync time, GB/s per\n"
    "engine rank, the phase breakdown, peak RSS per role and the publisher's staging\n"
    "memory vs the bucket size, against, in the same run: the raw transport ceiling\n"
    "(plain UCX tag transfers of the same bytes between the same processes) and the\n"
    "peer baseline (tools/bench/peer_baseline.py, found beside this command: its\n"
    "source tree or share/weightsync, under $WEIGHTSYNC_PYTHON, else the venv the\n"
    "command is installed in or the source tree's .venv, else python3 on the PATH).\n"
    "--json prints one object: sync_s_p50, sync_s_p99, engine_rank_gbps, raw_gbps,\n"
    "ratio_to_raw, peer_gbps, ratio_to_peer, peak_rss_mb, ...\n"
    "--transport applies to the sync and the raw ceiling alike, e.g.\n"
    "'ucx?tls=posix,sysv,cma,self' for UCX's shared-memory transports only (the\n"
    "default lets UCX choose, which on some hosts is TCP over loopback).\n"
    "--mesh M --tp N --replicas R: the generated job's shape instead: trainer mesh M\n"
    "(default ep=2,fsdp=2), R vLLM-layout replicas of tp=N (defaults 2 and 2). The\n"
    "colocated hybrid engine, one trainer rank and one engine rank per GPU:\n"
    "--mesh fsdp=1 --tp 1 --replicas 1 (1 -> 1); --mesh fsdp=2 --tp 1 --replicas 1\n"
    "(2 -> 1).\n"
    "Per-bucket checksums are on, as in the library; --no-checksums turns them off,\n"
    "--checksums extends them to CUDA tensors' device paths (checksums_gpu).\n"
    "--checksum-overhead: then the same job with checksums off and on, alternating,\n"
    "three times each; adds checksum_overhead (step p50 on / off).\n"
    "--no-lend: buckets travel as fragments even where the transport maps the engine's\n"
    "params (cuda_ipc: each bucket is otherwise one copy into them); buckets_lent says\n"
    "how many of a step's buckets were.\n"
    "--bucket-bytes defaults to 64 MiB; --steps to 5; --timeout (s per step) to 600.\n"
    "--checkpoint C --trainer T.json --engine E.json: the job of these files instead\n"
    "(as `weightsync demo` takes them; --size-gb then does not apply), e.g. a\n"
    "Megatron-Core trainer from `weightsync trainer-layout --style megatron`.\n"
    "--device cuda: every rank's tensors in GPU memory (rank r on GPU r modulo the\n"
    "GPUs; all on GPU 0 of a one-GPU machine), transport cuda_ipc by default. Adds\n"
    "d2d_gbps/ratio_to_d2d (a device-to-device copy of the engine rank's bytes),\n"
    "limit_gbps/ratio_to_limit (one device-to-device copy per tensor of the busiest\n"
    "engine rank: the one-copy limit line of a colocated sync),\n"
    "over a host transport pinned_gbps/ratio_to_pinned (a pinned device-to-host\n"
    "copy of them), and the peer baselines become PyTorch's way over CUDA IPC\n"
    "(tools/bench/peer_ipc_baseline.py) and, 1 -> 1, checkpoint-engine's colocated\n"
    "update (tools/bench/peer_checkpoint_engine.py; pip install checkpoint-engine),\n"
    "found and run the same way; ratio_to_peer is against the stronger (peer_name),\n"
    "peer.peers holds each one's result or why it did not run.\n"
    "--fp8: the engines are FP8 (\"quantization\": block FP8, docs/fp8.md): each\n"
    "step's BF16 weights become FP8 params and scales, quantized by the trainer ranks\n"
    "where they hold whole blocks (--fp8-site sender, the default: FP8 on the wire)\n"
    "or by the engine ranks (--fp8-site engine).\n"
    "--metrics-overhead: then the same job with the coordinator's Prometheus metrics\n"
    "off and on, alternating, twice each; adds metrics_overhead (step p50 off / on).\n"
    "--delta: delta sync (docs/delta.md). The job runs twice on the same versions,\n"
    "first a full sync (delta off), then with delta on; the numbers are the delta\n"
    "run's, and the --json object adds full (the full run's), bytes_ratio_to_full\n"
    "(wire bytes, delta over full, timed steps) and time_ratio_to_full (sync p50).\n"
    "No peer baseline. --no-delta-verify: delta buckets without their digest.\n"
    "--update random:F: versions that differ from the next in about a fraction F of\n"
    "their elements (default 0.02 with --delta; without, every byte changes).\n"
    "--update adamw[:lr=X]: with --delta, versions made by real torch.optim.AdamW\n"
    "steps (lr default 1e-5) on the model's bf16 shards, run by the Python package\n"
    "(tools/bench/python/bench.py delta); prints the fraction of elements changed.\n";

nlohmann::json box_json(const Box& b) {
  return {{"offsets", b.offsets}, {"lengths", b.lengths}};
}

// The peer baseline's input: the same checkpoint, each trainer rank's HF boxes
// and each engine rank's segments (so that python needs no layout logic).
nlohmann::json peer_job(const demo::JobSpec& job, int steps) {
  const TrainerLayout tl = TrainerLayout::load(job.trainer);
  const EngineLayout el = make_engine_layout(load_engine_spec(job.engine));
  const Checkpoint ckpt = Checkpoint::open(job.checkpoint);
  nlohmann::json pieces = nlohmann::json::array();
  for (int64_t r = 0; r < tl.mesh.world(); ++r) {
    nlohmann::json mine = nlohmann::json::array();
    for (const LoadSpec& spec : tl.params)
      for (const Piece& p : local_pieces(spec, tl.mesh, r))
        mine.push_back(
            {{"hf_key", spec.hf_keys[static_cast<size_t>(p.key)]}, {"hf_box", box_json(p.hf_box)}});
    pieces.push_back(mine);
  }
  nlohmann::json engines = nlohmann::json::array();
  for (int g = 0; g < el.world(); ++g) {
    nlohmann::json params = nlohmann::json::array();
    for (const EngineParam& p : el.rank_layout(g).params) {
      nlohmann::json segs = nlohmann::json::array();
      for (const Segment& s : p.segments)
        segs.push_back({{"hf_key", s.hf_key},
                        {"hf_box", box_json(s.hf_box)},
                        {"param_box", box_json(s.param_box)},
                        {"transpose", s.transpose}});
      params.push_back({{"name", p.name},
                        {"dtype", dtype_name(p.dtype)},
                        {"shape", p.shape},
                        {"segments", segs}});
    }
    engines.push_back(params);
  }
  nlohmann::json tensors = nlohmann::json::array();
  for (const auto& key : ckpt.keys()) {
    const auto& info = ckpt.info(key);
    tensors.push_back({{"key", key}, {"dtype", dtype_name(info.dtype)}, {"shape", info.shape}});
  }
  return {{"checkpoint", job.checkpoint},
          {"steps", steps},
          {"trainer_world", tl.mesh.world()},
          {"trainer_pieces", pieces},
          {"engine_world", el.world()},
          {"engine_ranks", engines},
          {"hf_tensors", tensors}};
}

// The peer baselines: for CPU jobs the gloo one; for CUDA jobs PyTorch's way
// over CUDA IPC and checkpoint-engine's colocated update (1 -> 1 only). Each
// runs under a python with torch (cli::find_data, cli::helper_python: found
// from the executable, whatever the working directory; installed copies
// included), or where its environment variable points.
struct PeerScript {
  std::string name, script, python, error;
};

std::vector<PeerScript> peer_scripts(const demo::JobSpec& job) {
  struct Known {
    const char *name, *env, *path;
  };
  const std::vector<Known> known =
      demo::on_gpu(job)
          ? std::vector<Known>{{"torch-ipc", "WEIGHTSYNC_PEER_IPC_BASELINE",
                                "tools/bench/peer_ipc_baseline.py"},
                               {"checkpoint-engine", "WEIGHTSYNC_PEER_CHECKPOINT_ENGINE",
                                "tools/bench/peer_checkpoint_engine.py"}}
          : std::vector<Known>{
                {"gloo", "WEIGHTSYNC_PEER_BASELINE", "tools/bench/peer_baseline.py"}};
  std::vector<PeerScript> out;
  for (const Known& k : known) {
    PeerScript s;
    s.name = k.name;
    const char* env = std::getenv(k.env);
    s.script = env ? std::string(env) : find_data(k.path);
    if (s.script.empty())
      s.error = cat(k.path, " not found beside ", demo::self_exe(),
                    " (source tree or share/weightsync; or set WEIGHTSYNC_DATA_DIR)");
    s.python = helper_python();
    if (s.error.empty() && (s.python.empty() || !fs::exists(s.python)))
      s.error = cat("no python for the peer baseline (", s.python.empty() ? "none" : s.python,
                    demo::on_gpu(job) ? "; set WEIGHTSYNC_PYTHON to one with a CUDA torch)" : ")");
    out.push_back(std::move(s));
  }
  return out;
}

nlohmann::json run_one_peer(const demo::JobSpec& job, const PeerScript& peer,
                            const std::string& path) {
  if (!peer.error.empty()) return {{"name", peer.name}, {"error", peer.error}};
  const std::string log = cat(job.work_dir, "/peer-", peer.name, ".log");
  const std::string cmd =
      cat("timeout 1800 ", peer.python, " ", peer.script, " --job ", path, " 2>", log);
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return {{"name", peer.name}, {"error", "cannot start the peer baseline"}};
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  const int status = ::pclose(pipe);
  auto j = nlohmann::json::parse(out, nullptr, false);
  if (status != 0 || j.is_discarded() || !j.is_object()) {
    const std::string how = WIFEXITED(status)     ? cat("exit ", WEXITSTATUS(status))
                            : WIFSIGNALED(status) ? cat("signal ", WTERMSIG(status))
                                                  : cat("status ", status);
    // The script's last line says why (a missing package, the wrong shape).
    std::string last;
    std::ifstream in(log);
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) last = line;
    return {{"name", peer.name},
            {"error", cat("peer baseline ", peer.name, " failed (", how, ")",
                          last.empty() ? "" : ": ", last, "; see ", log)}};
  }
  j["name"] = peer.name;
  return j;
}

// The peer to beat among `all` (each a peer's result or its error): the one
// with the most GB/s per engine rank, with every peer's result under
// "peers"; when none ran, an error naming each one's.
nlohmann::json strongest_peer(const nlohmann::json& all) {
  nlohmann::json best;
  std::string errors;
  for (const auto& p : all) {
    if (p.contains("error")) {
      errors += cat(errors.empty() ? "" : "; ", p["error"].get<std::string>());
      continue;
    }
    if (best.is_null() || p.value("engine_rank_gbps", 0.0) > best.value("engine_rank_gbps", 0.0))
      best = p;
  }
  if (best.is_null()) best = {{"error", errors}};
  best["peers"] = all;
  return best;
}

// Every peer of the job, and the strongest (the most GB/s per engine rank)
// as the one to beat; an error naming each when none ran.
nlohmann::json run_peer(const demo::JobSpec& job, int steps) {
  const std::string path = job.work_dir + "/peer_job.json";
  std::ofstream(path, std::ios::trunc) << peer_job(job, steps).dump();
  nlohmann::json all = nlohmann::json::array();
  for (const PeerScript& s : peer_scripts(job)) all.push_back(run_one_peer(job, s, path));
  return strongest_peer(all);
}

nlohmann::json raw_result(const demo::JobRun& run) {
  // A round ends when the slowest engine rank has everything.
  std::vector<double> rounds;
  int64_t busiest = 0;
  for (const auto& e : run.engines) {
    if (!e.is_object() || !e.contains("raw")) continue;
    busiest = std::max(busiest, e["raw"]["bytes"].get<int64_t>());
    const auto& s = e["raw"]["seconds"];
    rounds.resize(std::max(rounds.size(), s.size()), 0.0);
    for (size_t i = 0; i < s.size(); ++i) rounds[i] = std::max(rounds[i], s[i].get<double>());
  }
  const double p50 = percentile(rounds, 0.5);
  std::string memory = "host", library;
  for (const auto& e : run.engines)
    if (e.is_object() && e.contains("raw")) {
      memory = e["raw"].value("memory", memory);
      library = e["raw"].value("library", library);
    }
  return {{"seconds_p50", p50},
          {"engine_rank_bytes", busiest},
          {"memory", memory},
          {"library", library},
          {"gbps", p50 > 0 ? static_cast<double>(busiest) / p50 / 1e9 : 0.0}};
}

// The tensors of the limit line: the params of the engine rank that holds
// the most bytes, each a multiple of 256 bytes apart (as allocators place
// them).
std::vector<size_t> limit_tensors(const std::string& engine) {
  const EngineLayout layout = make_engine_layout(load_engine_spec(engine));
  std::vector<size_t> best;
  size_t best_total = 0;
  for (int g = 0; g < layout.world(); ++g) {
    std::vector<size_t> sizes;
    size_t total = 0;
    for (const EngineParam& p : layout.rank_layout(g).params) {
      const auto b = static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype);
      if (b == 0) continue;
      sizes.push_back(b);
      total += b;
    }
    if (total > best_total) best = std::move(sizes), best_total = total;
  }
  return best;
}

// A CUDA job's references, measured on GPU 0 after the job: a device-to-device
// copy of one engine rank's bytes; the one-copy limit line of a colocated
// sync (DESIGN.md "GPU data path"), one device-to-device copy per tensor of
// the busiest engine rank, as PyTorch's per-tensor dst.copy_(src) makes it;
// and, when the transport staged through pinned host memory, a pinned
// device-to-host copy of the bytes.
nlohmann::json gpu_references(int64_t bytes, const std::string& slot_memory,
                              const std::vector<size_t>& tensors) {
  const auto n = static_cast<size_t>(std::max<int64_t>(bytes, 1));
  nlohmann::json out;
  gpu::Memory src(n, gpu::MemoryPlace::device, 0), dst(n, gpu::MemoryPlace::device, 0);
  const double d2d_s = gpu::time_gpu(
      [&](const gpu::Stream& s) { gpu::copy_async(dst.data(), src.data(), n, s); }, 0, 10);
  out["d2d_gbps"] = static_cast<double>(bytes) / d2d_s / 1e9;
  size_t span = 0, total = 0;
  for (size_t b : tensors) span += (b + 255) / 256 * 256, total += b;
  if (total > 0) {
    gpu::Memory from(span, gpu::MemoryPlace::device, 0), to(span, gpu::MemoryPlace::device, 0);
    const double limit_s = gpu::time_gpu(
        [&](const gpu::Stream& s) {
          size_t at = 0;
          for (size_t b : tensors) {
            gpu::copy_async(to.data() + at, from.data() + at, b, s);
            at += (b + 255) / 256 * 256;
          }
        },
        0, 10);
    out["limit_gbps"] = static_cast<double>(total) / limit_s / 1e9;
    out["limit_tensors"] = tensors.size();
  }
  if (slot_memory == "pinned") {
    gpu::Memory pinned(n, gpu::MemoryPlace::pinned, 0);
    const double d2h_s = gpu::time_gpu(
        [&](const gpu::Stream& s) { gpu::copy_async(pinned.data(), src.data(), n, s); }, 0, 5);
    out["pinned_gbps"] = static_cast<double>(bytes) / d2h_s / 1e9;
  }
  return out;
}

nlohmann::json bench_result(const demo::JobSpec& job, const demo::JobRun& run,
                            const nlohmann::json& summary, const nlohmann::json& peer) {
  std::vector<double> sync;
  int64_t rank_bytes = 0;
  int64_t lent = 0;  // the last timed step's buckets written into lent params
  nlohmann::json phases = nlohmann::json::array();
  for (const auto& row : summary["steps"]) {
    if (row["step"].get<int64_t>() == 1) continue;  // warm-up
    sync.push_back(row["sync_s"].get<double>());
    lent = row.value("buckets_lent", int64_t{0});
    rank_bytes = std::max(rank_bytes, row["engine_rank_bytes"].get<int64_t>());
    phases.push_back(row["phases"]);
  }
  int64_t wire_bytes = 0;  // every engine rank's, the timed steps'
  for (const auto& row : summary["steps"])
    if (row["step"].get<int64_t>() != 1) wire_bytes += row["engine_bytes_total"].get<int64_t>();
  const double p50 = percentile(sync, 0.5), p99 = percentile(sync, 0.99);
  const double gbps = p50 > 0 ? static_cast<double>(rank_bytes) / p50 / 1e9 : 0;
  const auto raw = raw_result(run);
  double rss_t = 0, rss_e = 0, staging = 0;
  for (const auto& t : run.trainers)
    if (t.is_object()) {
      rss_t = std::max(rss_t, t.value("peak_rss_mb", 0.0));
      staging = std::max(staging, t.value("staging_bytes", 0.0));
    }
  for (const auto& e : run.engines)
    if (e.is_object()) rss_e = std::max(rss_e, e.value("peak_rss_mb", 0.0));
  const double raw_gbps = raw["gbps"].get<double>();
  const double peer_gbps = peer.value("engine_rank_gbps", 0.0);
  return {{"ok", summary["ok"]},
          {"steps", sync.size()},
          {"sync_s", sync},
          {"sync_s_p50", p50},
          {"sync_s_p99", p99},
          {"engine_rank_bytes", rank_bytes},
          {"wire_bytes", wire_bytes},
          {"engine_rank_gbps", gbps},
          {"raw_gbps", raw_gbps},
          {"raw_s_p50", raw["seconds_p50"]},
          {"ratio_to_raw", raw_gbps > 0 ? gbps / raw_gbps : 0.0},
          {"peer_gbps", peer_gbps},
          {"peer_s_p50", peer.value("sync_s_p50", 0.0)},
          {"ratio_to_peer", peer_gbps > 0 ? gbps / peer_gbps : 0.0},
          {"peer_name", peer.value("name", std::string())},
          {"peer", peer},
          {"phases", phases},
          {"peak_rss_mb", {{"trainer", rss_t}, {"engine", rss_e}}},
          {"bucket_bytes", job.bucket_bytes},
          {"checksums", job.checksums},
          {"checksums_gpu", job.checksums_gpu},
          {"lend", job.lend},
          {"buckets_lent", lent},
          {"delta", job.delta},
          {"delta_verify", job.delta_verify},
          {"update_fraction", job.update_fraction},
          {"transport", job.transport},
          {"publisher_staging_bytes", staging},
          {"publisher_extra_x_bucket", staging / static_cast<double>(job.bucket_bytes)},
          {"device", job.device},
          {"slot_memory", raw["memory"]},
          {"transport_library", raw.value("library", std::string())}};
}

// CUDA jobs: GB/s against a device-to-device copy of the same bytes, and
// over a host transport against a pinned device-to-host copy.
void add_gpu_ratios(nlohmann::json& r, const std::string& engine) {
  if (r["device"] != "cuda") return;
  const auto ref = gpu_references(r["engine_rank_bytes"].get<int64_t>(), r["slot_memory"],
                                  limit_tensors(engine));
  const double gbps = r["engine_rank_gbps"].get<double>();
  r["d2d_gbps"] = ref["d2d_gbps"];
  r["ratio_to_d2d"] = gbps / ref["d2d_gbps"].get<double>();
  if (ref.contains("limit_gbps")) {
    r["limit_gbps"] = ref["limit_gbps"];
    r["limit_tensors"] = ref["limit_tensors"];
    r["ratio_to_limit"] = gbps / ref["limit_gbps"].get<double>();
  }
  if (ref.contains("pinned_gbps")) {
    r["pinned_gbps"] = ref["pinned_gbps"];
    r["ratio_to_pinned"] = gbps / ref["pinned_gbps"].get<double>();
  }
}

void print_human(const nlohmann::json& r) {
  std::printf("sync: p50 %.3f s, p99 %.3f s over %zu steps; %.3f GB/s per engine rank (%.1f MB)\n",
              r["sync_s_p50"].get<double>(), r["sync_s_p99"].get<double>(),
              r["steps"].get<size_t>(), r["engine_rank_gbps"].get<double>(),
              r["engine_rank_bytes"].get<double>() / 1e6);
  if (!r["transport_library"].get<std::string>().empty() || r["device"] == "cuda")
    std::printf("transport %s%s%s, receive slots in %s memory\n",
                r["transport"].get<std::string>().c_str(),
                r["transport_library"].get<std::string>().empty() ? "" : " over ",
                r["transport_library"].get<std::string>().c_str(),
                r["slot_memory"].get<std::string>().c_str());
  std::printf("raw transport ceiling: %.3f GB/s per engine rank -> ratio_to_raw %.2f\n",
              r["raw_gbps"].get<double>(), r["ratio_to_raw"].get<double>());
  if (r.contains("d2d_gbps"))
    std::printf("device-to-device copy of those bytes: %.1f GB/s -> ratio_to_d2d %.2f\n",
                r["d2d_gbps"].get<double>(), r["ratio_to_d2d"].get<double>());
  if (r.contains("limit_gbps"))
    std::printf(
        "one copy per tensor (%zu tensors, the limit line): %.1f GB/s -> ratio_to_limit %.2f\n",
        r["limit_tensors"].get<size_t>(), r["limit_gbps"].get<double>(),
        r["ratio_to_limit"].get<double>());
  if (r.contains("pinned_gbps"))
    std::printf("pinned device-to-host copy of them: %.1f GB/s -> ratio_to_pinned %.2f\n",
                r["pinned_gbps"].get<double>(), r["ratio_to_pinned"].get<double>());
  if (r["peer"].contains("error") && !r["peer"].contains("peers"))
    std::printf("peer baseline: %s\n", r["peer"]["error"].get<std::string>().c_str());
  for (const auto& p : r["peer"].value("peers", nlohmann::json::array())) {
    if (p.contains("error")) {
      std::printf("peer %s: %s\n", p.value("name", "?").c_str(),
                  p["error"].get<std::string>().c_str());
      continue;
    }
    const double gbps = p.value("engine_rank_gbps", 0.0);
    std::printf("peer %s (%s): %.3f s/step, %.3f GB/s -> ratio %.2f%s\n",
                p.value("name", "?").c_str(), p.value("method", "").c_str(),
                p.value("sync_s_p50", 0.0), gbps,
                gbps > 0 ? r["engine_rank_gbps"].get<double>() / gbps : 0.0,
                p.value("name", "") == r["peer"].value("name", "-") ? " (ratio_to_peer)" : "");
  }
  std::printf(
      "peak RSS: trainer %.0f MB, engine %.0f MB; publisher staging %.0f MB = %.2f x "
      "bucket\n",
      r["peak_rss_mb"]["trainer"].get<double>(), r["peak_rss_mb"]["engine"].get<double>(),
      r["publisher_staging_bytes"].get<double>() / 1e6,
      r["publisher_extra_x_bucket"].get<double>());
  for (const auto& p : r["phases"])
    std::printf(
        "  phases (ms): pack %.1f, gather %.1f, wire %.1f, receive wait %.1f, apply %.1f, "
        "commit %.1f\n",
        p["pack"].get<double>() * 1e3, p["gather"].get<double>() * 1e3,
        p["wire"].get<double>() * 1e3, p["receive_wait"].get<double>() * 1e3,
        p["apply"].get<double>() * 1e3, p["commit"].get<double>() * 1e3);
}

// The coordinator's metrics cost nothing measurable: the same job with
// metrics off and on, alternating, `rounds` times each; the ratio is the
// median step time off over on (1: no cost; below 1: metrics slow steps).
nlohmann::json metrics_overhead(demo::JobSpec job, int rounds) {
  job.raw_rounds = 0;
  std::vector<double> off, on;
  for (int round = 0; round < 2 * rounds; ++round) {
    job.metrics_port = round % 2 ? 0 : -1;
    const auto run = demo::run_job(job, "");
    const auto summary = demo::summarize(job, run);
    if (!summary["ok"].get<bool>())
      return {{"error", summary.value("error", std::string("a run failed"))}};
    for (const auto& row : summary["steps"])
      if (row["step"].get<int64_t>() > 1) (round % 2 ? on : off).push_back(row["sync_s"]);
  }
  const double p50_off = percentile(off, 0.5), p50_on = percentile(on, 0.5);
  return {{"rounds", rounds},
          {"sync_s_p50_off", p50_off},
          {"sync_s_p50_on", p50_on},
          {"ratio", p50_on > 0 ? p50_off / p50_on : 0.0}};
}

// --update adamw[:lr=X]: real AdamW steps need torch, so the Python package
// runs that job (tools/bench/python/bench.py delta, found as the peer baselines
// are), on the same model shape.
int run_adamw_bench(const Args& args, const std::string& update, int steps, double gb, bool delta) {
  if (!delta) fail(Errc::invalid_argument, "--update adamw is for --delta");
  if (args.has("checkpoint") || args.get_or("mode", "p2p") != "p2p" || args.flag("fp8") ||
      args.get_or("device", "cpu") != "cpu")
    fail(Errc::invalid_argument,
         "--update adamw runs the generated model, p2p, in host memory (no --checkpoint, "
         "--mode, --fp8 or --device)");
  const std::string python = helper_python();
  if (python.empty() || !fs::exists(python))
    fail(Errc::not_found, "--update adamw needs a python with torch and weightsync (set ",
         "WEIGHTSYNC_PYTHON)");
  const std::string script = find_data("tools/bench/python/bench.py");
  if (script.empty())
    fail(Errc::not_found, "tools/bench/python/bench.py not found beside ", demo::self_exe(),
         " (source tree or share/weightsync; or set WEIGHTSYNC_DATA_DIR)");
  std::string cmd = cat(python, " '", script, "' delta --update '", update, "' --size-gb ", gb,
                        " --steps ", steps, " --transport '", args.get_or("transport", "ucx"),
                        "' --bucket-bytes ", args.get_int("bucket-bytes", int64_t{64} << 20));
  if (args.flag("no-delta-verify")) cmd += " --no-delta-verify";
  if (args.flag("json")) cmd += " --json";
  std::fflush(stdout);
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) fail(Errc::io, "cannot start ", cmd);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  const int status = ::pclose(pipe);
  std::cout << out << std::flush;
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail(Errc::internal, "bench sync --update adamw: ", cmd, " failed (",
         WIFEXITED(status) ? cat("exit ", WEXITSTATUS(status)) : cat("status ", status), ")");
  return 0;
}

int run_sync_bench(const std::vector<std::string>& argv) {
  Args args(argv,
            {"json", "no-peer", "checksums", "no-checksums", "checksum-overhead", "no-lend", "fp8",
             "metrics-overhead", "delta", "no-delta-verify"},
            {"trace", "steps", "size-gb", "mode", "bucket-bytes", "timeout", "work-dir",
             "transport", "device", "checkpoint", "trainer", "engine", "fp8-site", "update", "mesh",
             "tp", "replicas"});
  const int steps = static_cast<int>(args.get_int("steps", 5));
  if (steps < 1) fail(Errc::invalid_argument, "--steps must be at least 1");
  const double gb = args.get_double("size-gb", 1.0);
  if (gb <= 0 || gb > 64) fail(Errc::invalid_argument, "--size-gb must be in (0, 64]");
  demo::JobSpec job;
  job.steps = steps + 1;
  job.mode = args.get_or("mode", "p2p");
  job.device = args.get_or("device", "cpu");
  demo::check_device(job.device, "--device");
  job.transport = args.get_or("transport", demo::on_gpu(job) ? "cuda_ipc" : "ucx");
  job.bucket_bytes = args.get_int("bucket-bytes", int64_t{64} << 20);
  job.timeout_ms = static_cast<int64_t>(args.get_double("timeout", 600) * 1000);
  job.verify = false;
  job.checksums = !args.flag("no-checksums");
  job.checksums_gpu = args.flag("checksums");
  if (args.flag("checksums") && args.flag("no-checksums"))
    fail(Errc::invalid_argument, "--checksums and --no-checksums: pick one");
  job.lend = !args.flag("no-lend");
  const bool delta = args.flag("delta");
  job.delta_verify = !args.flag("no-delta-verify");
  if (auto u = args.get("update"); u && u->rfind("adamw", 0) == 0) {
    for (const char* shape : {"mesh", "tp", "replicas"})
      if (args.has(shape))
        fail(Errc::invalid_argument, "--", shape, " does not apply to --update adamw");
    return run_adamw_bench(args, *u, steps, gb, delta);
  }
  if (auto u = args.get("update"))
    job.update_fraction = demo::parse_update_fraction(*u, "--update");
  else if (delta)
    job.update_fraction = 0.02;
  job.fp8_site = args.get_or("fp8-site", "sender");
  parse_fp8_site(job.fp8_site);
  job.raw_rounds = 3;
  job.progress = !args.flag("json");  // steps decided, on a terminal only
  job.trace = args.has("trace");
  job.work_dir = args.has("work-dir") ? args.require("work-dir") : demo::make_temp_dir("bench");
  fs::create_directories(job.work_dir);
  demo::ModelFiles model;
  if (args.has("checkpoint") || args.has("trainer") || args.has("engine")) {
    for (const char* generated : {"size-gb", "mesh", "tp", "replicas"})
      if (args.has(generated))
        fail(Errc::invalid_argument, "--", generated,
             " is for the generated model, not with --checkpoint");
    model.checkpoint = fs::absolute(args.require("checkpoint")).string();
    model.trainer = fs::absolute(args.require("trainer")).string();
    model.engine = fs::absolute(args.require("engine")).string();
    const Checkpoint ckpt = Checkpoint::open(model.checkpoint);
    check_checkpoint(ckpt, TrainerLayout::load(model.trainer));
    for (const auto& key : ckpt.keys())
      model.bytes +=
          numel(ckpt.info(key).shape) * static_cast<int64_t>(itemsize(ckpt.info(key).dtype));
    model.tensors = ckpt.keys().size();
    model.family = load_engine_spec(model.engine).groups.front().hf.family;
  } else {
    demo::ModelSetup setup;
    setup.hf_config = demo::bench_model_config(gb);
    setup.mesh = args.get_or("mesh", setup.mesh);
    setup.tp = static_cast<int>(args.get_int("tp", setup.tp));
    setup.replicas = static_cast<int>(args.get_int("replicas", setup.replicas));
    if (setup.tp < 1 || setup.replicas < 1)
      fail(Errc::invalid_argument, "--tp and --replicas must be at least 1");
    model = demo::write_model(job.work_dir, setup);
  }
  job.checkpoint = model.checkpoint;
  job.trainer = model.trainer;
  job.engine = model.engine;
  if (args.flag("fp8")) {
    if (args.has("engine"))
      fail(Errc::invalid_argument,
           "--fp8 is for the generated model; with --engine, put \"quantization\" in the engine "
           "config (docs/fp8.md)");
    // FP8 engines, quantized where --fp8-site says (docs/fp8.md).
    nlohmann::json engine = nlohmann::json::parse(std::ifstream(job.engine));
    engine["quantization"] = {{"method", "fp8"}, {"weight_block_size", {128, 128}}};
    std::ofstream(job.engine, std::ios::trunc) << engine.dump();
  }
  if (!args.flag("json")) {
    const TrainerLayout tl = TrainerLayout::load(job.trainer);
    std::string engines;
    for (const EngineConfig& g : load_engine_spec(job.engine).groups)
      engines += cat(engines.empty() ? "" : " + ", g.replicas, " ", g.framework, " x tp=", g.tp,
                     g.quantization ? " FP8" : "");
    std::printf(
        "weightsync bench sync: %s model, %.2f GB, %lld trainer ranks -> %s, "
        "%s over %s, tensors in %s memory, bucket %lld bytes, checksums %s\n",
        model.family.c_str(), static_cast<double>(model.bytes) / 1e9,
        static_cast<long long>(tl.mesh.world()), engines.c_str(), job.mode.c_str(),
        job.transport.c_str(), demo::on_gpu(job) ? "GPU" : "host",
        static_cast<long long>(job.bucket_bytes),
        !job.checksums      ? "off"
        : job.checksums_gpu ? "on (device paths too)"
                            : "on");
  }
  std::fflush(stdout);
  // --delta: the full sync of the same versions first, its own reference.
  nlohmann::json full;
  if (delta) {
    const auto full_run = demo::run_job(job, "");
    const auto full_summary = demo::summarize(job, full_run);
    if (!full_summary["ok"].get<bool>()) {
      if (!args.flag("json")) demo::print_summary(std::cout, full_summary);
      fail(Errc::internal, "bench sync --delta: the full-sync reference run failed: ",
           full_summary.value("error", std::string("see its summary")));
    }
    full = bench_result(job, full_run, full_summary, {{"error", "skipped (--delta)"}});
    job.delta = true;
  }
  const auto run = demo::run_job(job, args.get_or("trace", ""));
  const auto summary = demo::summarize(job, run);
  const nlohmann::json peer =
      args.flag("no-peer") || delta
          ? nlohmann::json{{"error", delta ? "skipped (--delta)" : "skipped (--no-peer)"}}
          : run_peer(job, std::min(steps, 3));
  auto result = bench_result(job, run, summary, peer);
  if (delta) {
    const double full_bytes = full["wire_bytes"].get<double>();
    const double full_s = full["sync_s_p50"].get<double>();
    result["full"] = {{"sync_s", full["sync_s"]},
                      {"sync_s_p50", full_s},
                      {"sync_s_p99", full["sync_s_p99"]},
                      {"wire_bytes", full["wire_bytes"]},
                      {"engine_rank_bytes", full["engine_rank_bytes"]}};
    result["bytes_ratio_to_full"] =
        full_bytes > 0 ? result["wire_bytes"].get<double>() / full_bytes : 0.0;
    result["time_ratio_to_full"] = full_s > 0 ? result["sync_s_p50"].get<double>() / full_s : 0.0;
  }
  result["model_bytes"] = model.bytes;
  result["trainer_ranks"] = TrainerLayout::load(job.trainer).mesh.world();
  result["engine_ranks"] = make_engine_layout(load_engine_spec(job.engine)).world();
  if (args.flag("metrics-overhead") && summary["ok"].get<bool>())
    result["metrics_overhead"] = metrics_overhead(job, 2);
  if (args.flag("checksum-overhead") && summary["ok"].get<bool>())
    result["checksum_overhead"] = checksum_overhead(job, 3);
  // Not ok: which step, which rank, and why (demo::summarize).
  for (const char* key : {"error", "failures"})
    if (summary.contains(key)) result[key] = summary[key];
  add_gpu_ratios(result, job.engine);
  if (args.flag("json")) {
    std::cout << result.dump() << "\n";
  } else {
    print_human(result);
    if (delta)
      std::printf(
          "delta sync, versions differing in about %.4g of their elements: %.3f MB on the wire "
          "vs %.3f MB full -> bytes_ratio_to_full %.4f; sync p50 %.4f s vs %.4f s full -> "
          "time_ratio_to_full %.3f\n",
          job.update_fraction, result["wire_bytes"].get<double>() / 1e6,
          result["full"]["wire_bytes"].get<double>() / 1e6,
          result["bytes_ratio_to_full"].get<double>(), result["sync_s_p50"].get<double>(),
          result["full"]["sync_s_p50"].get<double>(), result["time_ratio_to_full"].get<double>());
    if (result.contains("metrics_overhead")) {
      const auto& m = result["metrics_overhead"];
      if (m.contains("error"))
        std::printf("metrics overhead: %s\n", m["error"].get<std::string>().c_str());
      else
        std::printf(
            "metrics overhead: step p50 %.4f s with the coordinator's metrics off, %.4f s on "
            "-> ratio %.3f (off / on, %d rounds each)\n",
            m["sync_s_p50_off"].get<double>(), m["sync_s_p50_on"].get<double>(),
            m["ratio"].get<double>(), m["rounds"].get<int>());
    }
    if (result.contains("checksum_overhead")) print_checksum_overhead(result["checksum_overhead"]);
    if (!summary["ok"].get<bool>()) demo::print_summary(std::cout, summary);
  }
  if (summary["ok"].get<bool>() && !args.has("work-dir")) fs::remove_all(job.work_dir);
  return summary["ok"].get<bool>() ? 0 : 1;
}

const BenchRegistrar registrar{
    {"sync", "sync latency vs the raw transport and the peer baseline", kUsage, run_sync_bench}};

}  // namespace
}  // namespace weightsync::cli
