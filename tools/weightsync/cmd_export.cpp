// `weightsync export`: a Hugging Face checkpoint directory written by the
// trainer ranks of a layout together (Publisher::save_hf), one process each.
#include "cli.h"
#include "demo_run.h"
#include "export_job.h"

#include <nlohmann/json.hpp>

#include <weightsync/error.h>
#include <weightsync/hf_checkpoint.h>
#include <weightsync/load_spec.h>
#include <weightsync/safetensors.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>

namespace weightsync::cli {
namespace {

constexpr const char* kUsage =
    "usage: weightsync export --checkpoint C --trainer T.json --out DIR [--hf-config F]\n"
    "                         [--max-file-bytes N] [--transport X] [--bucket-bytes N]\n"
    "                         [--timeout S] [--work-dir D] [--json] [--no-sync]\n"
    "                         [--buffered-io]\n\n"
    "Writes checkpoint C (a .safetensors file or an HF directory) as a Hugging Face\n"
    "checkpoint directory DIR, the way a sharded trainer saves one: one process per\n"
    "rank of the trainer layout T.json fills its shards from C (as `weightsync shard`\n"
    "cuts them), then the ranks save DIR together (Publisher::save_hf, docs/checkpoints.md):\n"
    "- DIR/model-0000i-of-0000N.safetensors: the keys in the layout's order, cut into\n"
    "  files of at most N bytes (--max-file-bytes, default 5000000000 as save_pretrained;\n"
    "  a bigger key gets a file of its own). Each file is written by one rank, chosen to\n"
    "  balance bytes and preferring a rank that holds its keys whole; the pieces it lacks\n"
    "  come from their holders over the transport, in buckets (--bucket-bytes; by default\n"
    "  about 1/32 of a rank's share, 1 to 64 MiB). --transport defaults to\n"
    "  'ucx?peer_errors=off' (shared memory on one host; a dead rank is caught by the\n"
    "  coordinator, not UCX, whose TCP transport can abort a survivor on a peer's death).\n"
    "- DIR/config.json: a copy of F (--hf-config), when given.\n"
    "- DIR/model.safetensors.index.json ({\"metadata\": {\"total_size\"}, \"weight_map\"}),\n"
    "  written last by rank 0, once every rank wrote its files: a directory without it\n"
    "  is not a checkpoint (an older index in DIR is removed first).\n"
    "Every file is flushed to the device (fsync) before the index is written, so not\n"
    "even a machine crash leaves a directory that looks complete; --no-sync leaves\n"
    "them to the page cache (as save_pretrained does). With fsync, whole aligned blocks of\n"
    "the files bypass the page cache (O_DIRECT, where the filesystem allows it), so that\n"
    "copying into it and writing it back do not take the CPU from the transfers;\n"
    "--buffered-io sends every byte through the page cache.\n"
    "Every key of C that the layout holds is written once, equal to C byte for byte (keys\n"
    "of C in no param of the layout cannot be written; a note on stderr names them).\n"
    "Prints the bytes, files and GB/s of the save (the slowest rank's time); --json\n"
    "prints one JSON object instead (ok, dir, keys, files, bytes, seconds, gbps,\n"
    "per_rank). --timeout (seconds, default 600) bounds each phase. Logs and per-rank\n"
    "stats go to --work-dir (default: a fresh temporary directory).\n"
    "Errors: a key of the layout missing from C, a shape or dtype other than the\n"
    "layout's, a rank that dies or fails (exit code 1); bad options (exit code 2).\n";

// The tests' failure drill, no option of the command: WEIGHTSYNC_TEST_KILL=R:N
// freezes rank R at its N-th send of the save (the fault transport's freeze
// point, armed in that rank's process only) and the command SIGKILLs it; the
// others fail with an error naming it, and DIR gets no index (exit code 1).
void parse_test_kill(const std::string& spec, exporter::ExportJob& job) {
  const auto colon = spec.find(':');
  try {
    if (colon == std::string::npos) throw std::invalid_argument(spec);
    job.kill_rank = std::stoi(spec.substr(0, colon));
    job.kill_after = std::stoll(spec.substr(colon + 1));
  } catch (const std::exception&) {
    fail(Errc::invalid_argument, "WEIGHTSYNC_TEST_KILL takes RANK:N (e.g. 2:3), got '", spec, "'");
  }
  if (job.kill_rank < 0 || job.kill_after < 1)
    fail(Errc::invalid_argument, "WEIGHTSYNC_TEST_KILL takes RANK >= 0 and N >= 1, got '", spec,
         "'");
}

// Keys of the checkpoint no trainer param holds: the ranks cannot write
// them. Said up front (stderr), so that a layout missing keys is no surprise.
void note_keys_outside(const exporter::ExportJob& job) {
  const TrainerLayout layout = TrainerLayout::load(job.trainer);
  std::set<std::string> held;
  for (const LoadSpec& p : layout.params) held.insert(p.hf_keys.begin(), p.hf_keys.end());
  std::vector<std::string> outside;
  for (const std::string& k : Checkpoint::open(job.checkpoint).keys())
    if (!held.count(k)) outside.push_back(k);
  if (outside.empty()) return;
  std::cerr << "weightsync export: note: " << outside.size() << " key(s) of " << job.checkpoint
            << " are in no param of " << job.trainer << " and are not written (e.g. '"
            << outside.front() << "')\n";
}

void print_report(const nlohmann::json& s, const exporter::ExportJob& job) {
  if (!s["ok"].get<bool>()) {
    std::cerr << "weightsync export: FAILED\n";
    for (const auto& r : s["per_rank"]) {
      std::cerr << "  rank " << r["rank"] << ": " << r["status"].get<std::string>();
      if (r.contains("stats") && r["stats"].contains("error"))
        std::cerr << ": " << r["stats"]["error"].get<std::string>();
      std::cerr << " (log " << r["log"].get<std::string>() << ")\n";
    }
    return;
  }
  const auto& round = s["rounds"].back();
  std::printf("weightsync export: %d ranks over %s -> %s\n", s["ranks"].get<int>(),
              job.transport.c_str(), job.out.c_str());
  std::printf("  %lld keys, %.4g GB in %d files (at most %lld bytes each)\n",
              static_cast<long long>(s["keys"].get<int64_t>()), round["bytes"].get<double>() / 1e9,
              round["files"].get<int>(), static_cast<long long>(job.max_file_bytes));
  std::printf("  saved in %.3f s: %.3f GB/s\n", round["seconds"].get<double>(),
              round["gbps"].get<double>());
  for (const auto& r : s["per_rank"]) {
    const auto& st = r["stats"]["rounds"].back()["save"];
    std::printf(
        "  rank %d: wrote %zu files, %.4g MB (%.4g MB from its own shards); sent %.4g MB, "
        "received %.4g MB; arena %.4g MB\n",
        r["rank"].get<int>(), st["files_written"].size(), st["bytes_written"].get<double>() / 1e6,
        st["bytes_local"].get<double>() / 1e6, st["bytes_sent"].get<double>() / 1e6,
        st["bytes_received"].get<double>() / 1e6, st["arena_bytes"].get<double>() / 1e6);
  }
}

int run_export_cmd(const std::vector<std::string>& argv) {
  Args args(argv, {"json", "no-sync", "buffered-io"},
            {"checkpoint", "trainer", "out", "hf-config", "max-file-bytes", "transport",
             "bucket-bytes", "timeout", "work-dir", "job", "rank"});
  if (args.has("job")) {
    // One rank of a job this command started (internal).
    std::ifstream in(args.require("job"));
    const auto j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded()) fail(Errc::format, "export job file '", args.require("job"), "'");
    return exporter::run_export_worker(exporter::ExportJob::from_json(j),
                                       static_cast<int>(args.get_int("rank", -1)));
  }
  exporter::ExportJob job;
  job.checkpoint = args.require("checkpoint");
  job.trainer = args.require("trainer");
  job.out = args.require("out");
  job.hf_config = args.get_or("hf-config", "");
  job.max_file_bytes = args.get_int("max-file-bytes", kDefaultMaxFileBytes);
  job.bucket_bytes = args.get_int("bucket-bytes", 0);  // 0: the save's default
  // UCX without peer-error reporting: shared memory on one host, whatever
  // UCX finds across hosts. A dead rank is caught by the coordinator's
  // membership and the save's abort; UCX 1.13's TCP transport, which
  // reporting would force, can abort a survivor on a peer's death.
  job.transport = args.get_or("transport", "ucx?peer_errors=off");
  job.sync = !args.flag("no-sync");
  job.direct_io = !args.flag("buffered-io");
  job.progress = !args.flag("json");  // on a terminal only (progress.h)
  job.timeout_ms = static_cast<int64_t>(args.get_double("timeout", 600) * 1000);
  if (job.max_file_bytes <= 0 || (args.has("bucket-bytes") && job.bucket_bytes < 1024) ||
      job.timeout_ms <= 0)
    fail(Errc::invalid_argument,
         "--max-file-bytes and --timeout must be positive, --bucket-bytes at least 1024");
  if (const char* kill = std::getenv("WEIGHTSYNC_TEST_KILL")) parse_test_kill(kill, job);
  if (!job.hf_config.empty() && !std::ifstream(job.hf_config))
    fail(Errc::invalid_argument, "--hf-config ", job.hf_config, ": cannot read it");
  if (args.has("work-dir")) {
    job.work_dir = args.require("work-dir");
    std::filesystem::create_directories(job.work_dir);
  } else {
    job.work_dir = demo::make_temp_dir("export");
  }
  note_keys_outside(job);
  nlohmann::json summary = exporter::run_export(job);
  summary["keys"] =
      make_hf_file_layout(TrainerLayout::load(job.trainer), job.max_file_bytes).keys.size();
  if (summary["ok"].get<bool>()) {
    const auto& round = summary["rounds"].back();
    for (const char* k : {"seconds", "bytes", "files", "gbps"}) summary[k] = round[k];
  }
  if (args.flag("json"))
    std::cout << summary.dump() << "\n";
  else
    print_report(summary, job);
  return summary["ok"].get<bool>() ? 0 : 1;
}

const CommandRegistrar registrar{
    {"export", "write an HF checkpoint directory from a trainer layout's ranks together", kUsage,
     run_export_cmd}};

}  // namespace
}  // namespace weightsync::cli
