// Publisher: the trainer side of weightsync, linked into every trainer rank.
//
//   weightsync::PublisherOptions opt;
//   opt.coordinator = "10.0.0.1:29600";
//   opt.rank = rank;
//   opt.layout = weightsync::TrainerLayout::load("trainer.json");
//   weightsync::Publisher pub(opt);
//   for (auto& [name, t] : local_tensors) pub.register_tensor(name, t.data_ptr(), ...);
//   for (step...) { optimizer.step(); pub.push(step); }
//
// Every trainer rank registers its local shard of every parameter of its
// TrainerLayout (checked against the LoadSpec: name, dtype, local shape), then
// calls push(step) after each optimizer step. push returns once the
// coordinator decided the step: engines that applied every byte committed it.
//
// The first push connects the transport, fetches the engine config from the
// coordinator when the options carry none, computes the plan (cached until the
// layouts change) and allocates the staging buffers: two buckets per rank
// (pack bucket k+1 while bucket k is on the wire). Later pushes allocate no
// staging memory and recompute nothing.
//
// Errors: Errc::timeout when the step is not decided within step_timeout;
// Errc::peer_failure when the step was aborted (another trainer died or
// failed) or the coordinator is lost; Errc::mismatch / not_found /
// invalid_argument for registrations that do not match the layout. An engine
// that dies is dropped: the push still succeeds and the result lists it.
#pragma once

#include <weightsync/engine_layout.h>
#include <weightsync/hf_checkpoint.h>
#include <weightsync/load_spec.h>
#include <weightsync/plan.h>
#include <weightsync/tensor.h>
#include <weightsync/wire_options.h>

#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace weightsync {

class Tracer;

struct PublisherOptions {
  std::string coordinator;  // "HOST:PORT"
  std::string token;
  int rank = 0;          // trainer rank; the world is layout.mesh.world()
  TrainerLayout layout;  // every rank's layout (the same on every rank)
  // The engines' config (one, or groups of replicas); when absent, the one
  // engine rank 0 put in the store.
  std::optional<EngineSpec> engine;
  // "ucx", "nccl", or a wrapper such as "fault:ucx?corrupt_send=1&count=1".
  std::string transport = "ucx";
  // How the sync is planned (plan.h), rank 0's for every rank: p2p or
  // broadcast, the bucket size (at least 1024 bytes), and for FP8 engines
  // where their weights are quantized (on the trainer ranks where they hold
  // whole blocks, FP8 on the wire, or always on the engines). `replicas`
  // stays empty: a step serves the job's replicas (elastic: its membership's).
  PlanOptions plan;
  // Elastic engine replicas (docs/elastic.md); rank 0's hold.
  // Off: the engine config's replicas are the job's, all awaited before the
  // first push, and the plan covers them all (absent ones skipped). On: they
  // are slots that replicas fill and leave between steps. Before each push
  // trainer rank 0 picks the replicas whose every rank is ready (registered
  // and prepared), waits until at least min_replicas are, and begins the
  // step with the plan for them; the other ranks follow its choice. Every
  // process recomputes the plan when the membership changes (its id changes
  // with it), and a replica new to a step receives the whole version before
  // it serves. Not with NCCL (a communicator is fixed).
  bool elastic = false;
  int min_replicas = 1;
  // How buckets travel (wire_options.h): per-bucket checksums (on by default,
  // host paths; checksums_gpu for device paths too) and the smallest item sent
  // zero-copy. Rank 0's settings hold for everyone.
  WireOptions wire;
  // Delta sync (docs/delta.md): off, or auto: a bucket whose engine rank
  // committed the version this rank last sent it travels as the elements
  // that changed since (or whole, where that is about as small); any other
  // (a new or restarted engine rank, one that missed or failed a step) gets
  // the whole bytes. Broadcast mode: a delta when every engine rank holds
  // the base, one frame for all (not over a native broadcast: NCCL). Host
  // memory. Costs, on this rank, a copy of what it sends (p2p: its share of
  // the engine-dtype bytes; broadcast: the buckets it roots) and a second
  // pair of slots; on the engines, one bucket of scratch. Rank 0's setting
  // holds.
  DeltaMode delta = DeltaMode::off;
  // Delta steps: each delta bucket carries the checksum64 of the bytes the
  // engine must hold after applying it, which the engine checks before it
  // writes them; a mismatch fails that rank's step, and its next is whole.
  bool delta_verify = true;
  std::string job = "weightsync";  // store key prefix; one per job on a coordinator
  std::chrono::milliseconds connect_timeout{60000};  // coordinator, members, transport
  std::chrono::milliseconds step_timeout{120000};    // one push, end to end
  // A lost coordinator (it died, restarts, or the link broke) is reached
  // again for this long: the rank registers again as the same member, and
  // the store keys and plans it wrote are written again (docs/usage.md,
  // "The coordinator dies"). A push in flight then fails at once; the next
  // push waits for the coordinator within its step_timeout. 0: never.
  std::chrono::milliseconds coordinator_reconnect{300000};
  Tracer* tracer = nullptr;  // phases to a Chrome trace (not owned)

  // ---- GPU data path: CUDA tensors (docs/usage.md) ----
  // Before a push reads CUDA tensors it waits for the work that produced them:
  // the work before `producer_event` (a cudaEvent_t recorded after the
  // optimizer step) when set, else all work queued on `producer_stream` (a
  // cudaStream_t) when set, else, by default, the whole device
  // (cudaDeviceSynchronize at the start of every push). Not owned.
  void* producer_stream = nullptr;
  void* producer_event = nullptr;
};

// Where a push spent its time (seconds, this rank).
struct PushPhases {
  double begin = 0;   // begin_step with the coordinator
  double pack = 0;    // copying local shards into buckets
  double gather = 0;  // broadcast roots: waiting for the other holders' parts
  double wire = 0;    // waiting for sends to complete (data on the wire)
  double commit = 0;  // waiting for the coordinator's decision
};

struct PushResult {
  int64_t step = 0;
  std::vector<int> committed;                       // engine ranks that committed, ascending
  std::vector<std::pair<int, std::string>> failed;  // engine rank, reason
  uint64_t bytes_sent = 0;                          // payload bytes this rank put on the wire
  uint64_t bytes_direct = 0;  // of those, sent straight from the registered tensors (zero copy)
  // Of its buckets, those written straight into the engine's lent params
  // (WireOptions::lend: one copy, no staging on either side).
  uint64_t buckets_lent = 0;
  // Delta sync: buckets sent as deltas, and the bytes those buckets hold
  // whole (bytes_sent counts what went on the wire).
  uint64_t delta_buckets = 0;
  uint64_t delta_bytes_whole = 0;
  // Delta sync: host memory this rank keeps as its buckets' bases (what
  // their engine ranks hold); buckets that go alike to several replicas
  // share one (docs/delta.md).
  uint64_t delta_base_bytes = 0;
  double seconds = 0;  // push(), call to return
  PushPhases phases;
  std::string plan_id;        // the step's plan
  std::vector<int> replicas;  // elastic replicas: the step's membership (else empty)
};

// Publisher::save_hf (docs/checkpoints.md). Every rank passes the same
// max_file_bytes and bucket_bytes (checked against rank 0's).
struct SaveHfOptions {
  int64_t max_file_bytes = kDefaultMaxFileBytes;  // files of at most this (a bigger key alone)
  std::string config;  // a config.json to copy beside the weights; "": none
  // Buckets of the save: a writer's keys are cut into windows of this size,
  // and no bucket spans two; its disk starts once its first window arrived.
  // 0: about 1/32 of a writer's share of the model, within [1 MiB, the
  // publisher's bucket_bytes / 4]. Beyond its shards a rank holds four
  // slots and the keys being assembled: a few windows and the largest tensor.
  int64_t bucket_bytes = 0;
  std::string transport;                 // "": the publisher's
  std::chrono::milliseconds timeout{0};  // the whole save; 0: the publisher's step_timeout
  // Flush every file to the device (fsync) before the index is written, and
  // the index after: then not even a machine crash leaves a directory that
  // looks complete. false: the files may sit in the page cache when save_hf
  // returns (as save_pretrained leaves them); a crashed process still never
  // leaves an index.
  bool sync = true;
  // With `sync`: whole aligned blocks of the files bypass the page cache
  // (O_DIRECT): no copy into it and no writeback after, so the CPU stays
  // with the transfers (SafetensorsWriter::use_direct_io; filesystems that
  // refuse O_DIRECT get the page cache). false, or without `sync` (the files
  // are then left to the page cache, which returns sooner): every byte
  // through the page cache.
  bool direct_io = true;
};

// The bucket_bytes of a save whose SaveHfOptions::bucket_bytes is 0, for a
// publisher of `publisher_bucket` bytes.
int64_t default_save_bucket_bytes(const TrainerLayout& layout, int64_t publisher_bucket);

struct SaveHfResult {
  std::string dir;
  int files = 0;             // files of the checkpoint
  uint64_t total_bytes = 0;  // its payload (metadata.total_size)
  // This rank:
  std::vector<std::string> files_written;  // full paths
  uint64_t bytes_written = 0;              // payload of its files
  uint64_t bytes_local = 0;                // of those, from its own shards (nothing moved)
  uint64_t bytes_sent = 0;                 // to the other writers
  uint64_t bytes_received = 0;             // from the other ranks
  std::size_t arena_bytes = 0;             // where its keys were assembled
  std::size_t staging_bytes = 0;           // its four bucket slots
  double disk_wait_s = 0;                  // transfers waiting for its disk writes
  double disk_s = 0;                       // its disk thread writing (and flushing)
  double disk_cpu_s = 0;                   // CPU time of that thread
  double data_cpu_s = 0;                   // CPU time of the thread moving the buckets
  double seconds = 0;                      // the call, end to end:
  double setup_s = 0;   // options agreed, writer layout, plan, transport connected
  double data_s = 0;    // its transfers and its files written
  double finish_s = 0;  // the other ranks' files, the index (rank 0)
};

class Publisher {
 public:
  explicit Publisher(PublisherOptions options);  // connects to the coordinator
  ~Publisher();
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  // Registers this rank's local tensor of parameter `name`. It must stay valid
  // (and not move) for the publisher's lifetime. Errc::not_found for a name the
  // layout lacks; Errc::mismatch naming the param for a dtype or local shape
  // other than its LoadSpec gives; host memory, or CUDA with a CUDA build.
  void register_tensor(const std::string& name, const TensorView& tensor);
  void register_tensor(const std::string& name, void* data, DType dtype, const Shape& shape,
                       MemoryKind memory = MemoryKind::host, int device = -1);

  // Connects the transport to every peer, computes the plan and allocates
  // the staging buffers now, so that the first push times only the sync (the
  // first push does it otherwise). Every param must be registered.
  void prepare();

  // Sends this rank's part of version `step` (steps increase) and returns when
  // the coordinator decided it. Every param must be registered first.
  PushResult push(int64_t step);
  // The same on a background thread; one push at a time. The future is the
  // only way to learn whether the step committed or why it failed.
  [[nodiscard]] std::future<PushResult> push_async(int64_t step);

  // Writes the registered shards as a Hugging Face checkpoint directory
  // `dir`: a collective of every trainer rank (DESIGN.md "HF checkpoints").
  // The keys are cut into files (make_hf_file_layout); each file's writer
  // rank receives the pieces it lacks from their holders over the transport,
  // in buckets (a plan from the trainer layout to the writers), and streams
  // its files (tmp + rename); rank 0 writes model.safetensors.index.json
  // last, once every rank wrote its files, and every rank returns after
  // that. On failure no index is written (an older one in `dir` is removed
  // first): Errc::peer_failure naming the rank that died or failed,
  // Errc::timeout, Errc::io; the registered tensors are only read. Needs no
  // engine. Not concurrent with push.
  SaveHfResult save_hf(const std::string& dir, const SaveHfOptions& options = {});
  // Fills the registered shards from the checkpoint `dir` (an HF directory
  // or one .safetensors file), this rank alone: load_local_tensors
  // (hf_checkpoint.h). Errors name the key, the rank and the file.
  LoadReport load_hf(const std::string& dir);

  // The plan (computed on the first push; Errc::invalid_argument before).
  // Elastic replicas: the last push's plan.
  const Plan& plan() const;
  int rank() const;
  // The coordinator moved (a restarted one on another address): this rank
  // reconnects there. coordinator(): where it connects now.
  void set_coordinator(const std::string& address);
  std::string coordinator() const;
  // Bytes of staging memory this publisher allocated: its bucket slots, at
  // most about 2 x bucket (more slots when they are small; a few bytes each
  // when every fragment goes straight from its tensor).
  std::size_t staging_bytes() const;

 private:
  struct Impl;
  struct SaveRun;  // one save_hf call (publisher_checkpoint.cpp)
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightsync
