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
#include <weightsync/load_spec.h>
#include <weightsync/plan.h>
#include <weightsync/tensor.h>
#include <weightsync/wire.h>

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
  // The engines' config; when absent, the one engine rank 0 put in the store.
  std::optional<EngineConfig> engine;
  // "ucx", "nccl", or a wrapper such as "fault:ucx?corrupt_send=1&count=1".
  std::string transport = "ucx";
  PlanMode mode = PlanMode::p2p;
  int64_t bucket_bytes = int64_t{256} << 20;
  // How buckets travel (wire.h): per-bucket checksums (off by default) and
  // the smallest item sent zero-copy. Rank 0's settings hold for everyone.
  WireOptions wire;
  std::string job = "weightsync";  // store key prefix; one per job on a coordinator
  std::chrono::milliseconds connect_timeout{60000};  // coordinator, members, transport
  std::chrono::milliseconds step_timeout{120000};    // one push, end to end
  Tracer* tracer = nullptr;                          // phases to a Chrome trace (not owned)
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
  double seconds = 0;         // push(), call to return
  PushPhases phases;
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
  // The same on a background thread; one push at a time.
  std::future<PushResult> push_async(int64_t step);

  // The plan (computed on the first push; Errc::invalid_argument before).
  const Plan& plan() const;
  int rank() const;
  // Bytes of staging memory this publisher allocated (about 2 x bucket).
  std::size_t staging_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightsync
