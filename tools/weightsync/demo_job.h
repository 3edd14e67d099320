// A sync job as `weightsync demo`, `weightsync bench` and the e2e tests run
// it: a parent process (with the coordinator embedded) and one worker process
// per trainer rank and engine rank, all re-executions of this binary
// (`weightsync worker --job FILE --role trainer|engine --rank R`).
//
// Versions: the job syncs `steps` versions of the checkpoint. Version s < steps
// is the checkpoint with every byte XOR-ed with version_pattern(s) (nonzero),
// so it differs from the checkpoint in every tensor; version `steps` is the
// checkpoint itself. Engines verify their params bit-exactly against the
// version of every committed step.
//
// Sparse versions (`update_fraction` >= 0, as delta jobs use): version s <
// steps is version s + 1 with the lowest bit of the elements picked for step
// s + 1 flipped (pick_elements: about that fraction of them); so consecutive
// versions differ in those elements only, and version `steps` is the
// checkpoint.
#pragma once

#include <weightsync/engine_layout.h>
#include <weightsync/load_spec.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace weightsync::demo {

// Kills a worker at a chosen point: its `after`-th transport operation of
// kind `op` ("send" or "recv"), counted from 1 over the whole job. The worker
// freezes there (the fault transport's freeze_send / freeze_recv) and the
// demo SIGKILLs it from outside (ProcessGroup, kill_when_stopped).
struct KillSpec {
  std::string role;  // "trainer" | "engine"; empty: nobody dies
  int rank = -1;     // trainer rank or global engine rank
  std::string op = "send";
  int64_t after = 0;
};

struct JobSpec {
  std::string checkpoint;  // a .safetensors file or HF directory
  std::string trainer;     // trainer layout JSON path
  std::string engine;      // engine config JSON path
  int steps = 3;
  std::string mode = "p2p";
  std::string transport = "ucx";
  // Per global engine rank, a transport name overriding `transport` (e.g. a
  // fault wrapper); "" keeps the default.
  std::vector<std::string> engine_transport;
  std::vector<std::string> trainer_transport;  // the same per trainer rank
  int64_t bucket_bytes = int64_t{256} << 20;
  std::string fp8_site = "sender";  // FP8 engines: where weights are quantized
  int64_t timeout_ms = 120000;      // per step; connection setup gets the same
  bool staging = false;
  bool checksums = true;        // per-bucket checksums on the wire (WireOptions)
  bool checksums_gpu = false;   // WireOptions::checksums_gpu
  bool lend = true;             // WireOptions::lend
  bool delta = false;           // PublisherOptions::delta auto
  bool delta_verify = true;     // PublisherOptions::delta_verify
  double update_fraction = -1;  // sparse versions of about this fraction (-1: every byte)
  bool verify = true;           // engines check every committed step bit-exactly
  std::string dump_dir;         // engines write engine<e>-rank<r>.safetensors here
  std::string work_dir;         // stats, traces and logs of the workers
  bool trace = false;
  std::string coordinator;
  std::string token;
  KillSpec kill;
  bool restart_killed = false;  // start the killed rank again at once (it rejoins)
  int64_t step_gap_ms = 0;      // trainers pause this long before each step after the first
  // Publisher/SubscriberOptions::coordinator_reconnect of the workers. 0 by
  // default: a demo worker's process ends when its coordinator is gone (a
  // supervisor starts it again as a new member; tests/netns' scenarios).
  int64_t coordinator_reconnect_ms = 0;
  int raw_rounds = 0;          // bench: plain transport transfers of the plan's link bytes
  int metrics_port = -1;       // the parent's coordinator: Prometheus metrics (-1: off)
  bool progress = false;       // the parent shows the steps decided on a terminal
  std::string device = "cpu";  // where every rank's tensors live: "cpu" or "cuda" (demo_device.h)
  // Elastic replicas (PublisherOptions::elastic): the engine config's
  // replicas are slots; `join` (replica -> step) starts a replica's processes
  // once the step before that one was decided, `leave` (replica -> step)
  // makes them leave after that step.
  bool elastic = false;
  int min_replicas = 1;
  std::map<int, int> join, leave;
  // The chaos soak (demo --chaos, demo_chaos.h): non-empty, the folder where
  // the parent releases each step (go-<step>), ends the job (stop), and the
  // workers report (ready-<role>-<rank>-<pid>, <role>-<rank>.jsonl). Its
  // workers go on after a failed step and serve until told to stop.
  std::string chaos_dir;

  nlohmann::json to_json() const;
  static JobSpec from_json(const nlohmann::json& j);
  static JobSpec load(const std::string& path);
  void save(const std::string& path) const;

  std::string stats_path(const std::string& role, int rank) const;
  std::string trace_path(const std::string& role, int rank) const;
};

// The XOR byte of version `step` (0 for the final version).
uint8_t version_pattern(int64_t step, int64_t final_step);
// XORs every byte of [data, data + bytes) with `pattern`.
void xor_bytes(void* data, std::size_t bytes, uint8_t pattern);
// Sparse versions: flips the lowest bit of every element (of `item` bytes,
// at most 8) of [data, data + bytes) picked for an odd number of the steps
// first..last. An element is picked for step j when a hash of its value
// without that bit, and of j, falls below `fraction`: the choice survives
// the flip, so the trainer's shards and the engine's params, laid out
// apart, pick alike. `mask` (or null): only elements whose first mask byte
// is nonzero (covered by the checkpoint) take part.
void flip_picked(void* data, std::size_t bytes, std::size_t item, const void* mask, double fraction,
                 int64_t first, int64_t last);

// The fraction F of an --update random:F option (`option` names it in
// errors): Errc::invalid_argument unless 0 < F <= 1.
double parse_update_fraction(const std::string& text, const std::string& option);
// Peak resident memory of this process in MiB (VmHWM), 0 if unknown.
double peak_rss_mb();

// Worker entry points (demo_worker.cpp, demo_engine.cpp); return exit codes.
int run_trainer_worker(const JobSpec& job, int rank);
int run_engine_worker(const JobSpec& job, int global_rank);

// `transport` with the fault that freezes its rank when posting its
// `after`-th operation of kind `op` ("send" or "recv"): the failure drills'
// victim, which the drill then kills from outside. Arms this process's
// freeze points (a test hook, off by default: transport/fault/freeze_points.h),
// so it is called in the victim's process only.
std::string with_freeze(const std::string& transport, const std::string& op, int64_t after);

}  // namespace weightsync::demo
