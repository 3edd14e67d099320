// `weightsync export` and `weightsync bench export`: a parent process (with
// the coordinator embedded) and one worker process per trainer rank, each a
// re-execution of this binary (`weightsync export --job FILE --rank R`). A
// worker fills its shards from the checkpoint as the demo's trainers do
// (fill_local_tensor), then the workers save the directory together
// (Publisher::save_hf). The bench adds, in the same processes and rounds, a
// plain write of the same files from memory (the disk's ceiling).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace weightsync::exporter {

struct ExportJob {
  std::string checkpoint;  // a .safetensors file or HF directory
  std::string trainer;     // trainer layout JSON
  std::string out;         // the checkpoint directory to write
  std::string hf_config;   // copied as out/config.json; "": none
  int64_t max_file_bytes = 5'000'000'000;
  int64_t bucket_bytes = 0;  // 0: the save's default
  std::string transport = "ucx";
  int64_t timeout_ms = 600000;
  int kill_rank = -1;  // this rank SIGKILLs itself at its kill_after-th send of the save
  int64_t kill_after = 0;
  bool sync = true;         // SaveHfOptions::sync (and the plain writes alike)
  bool direct_io = true;    // SaveHfOptions::direct_io
  int rounds = 1;           // saves (bench: each after a plain write)
  std::string plain_dir;    // bench: where the plain writes go; "": none
  std::string work_dir;     // job file, logs, per-rank stats
  std::string coordinator;  // set by the parent
  std::string token;
  bool progress = false;  // the parent shows the save's progress on a terminal (progress.h)

  nlohmann::json to_json() const;
  static ExportJob from_json(const nlohmann::json& j);
  std::string stats_path(int rank) const;
};

// Runs the job: spawns the workers, waits, gathers their stats. The summary
// has "ok", "ranks" (each worker's stats or its failure), and per round the
// save's seconds (slowest rank), "bytes", "files", "gbps"; with plain writes
// also "plain_seconds" and "plain_gbps".
// With job.progress, a terminal shows the bytes on disk of job.out against
// the checkpoint's bytes while the workers run.
nlohmann::json run_export(ExportJob job);

// One worker (the hidden `weightsync export --job F --rank R`); exit code.
int run_export_worker(const ExportJob& job, int rank);

}  // namespace weightsync::exporter
