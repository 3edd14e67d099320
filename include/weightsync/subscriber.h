// Subscriber: the engine side of weightsync, running inside every rank of an
// inference engine (vLLM / SGLang layouts).
//
//   weightsync::SubscriberOptions opt;
//   opt.coordinator = "10.0.0.1:29600";
//   opt.engine = weightsync::load_engine_config("engine.json");
//   opt.replica = replica; opt.rank = tp_rank;
//   opt.staging = true;  // a failed step leaves the served weights untouched
//   weightsync::Subscriber sub(opt);
//   for (auto& [name, p] : model.named_parameters()) sub.register_param(name, p.data_ptr(), ...);
//   sub.on_begin([&](int64_t) { scheduler.pause(); });
//   sub.on_end([&](int64_t) { model.process_weights_after_loading(); scheduler.resume(); });
//   sub.serve();  // until sub.stop()
//
// Each step: the coordinator announces (step, plan id); on_begin runs; buckets
// land straight in the registered params (dense runs, zero copy) or in a
// receive slot and are applied from there; in staging mode both go to a
// private copy instead. With checksums on (the trainers' WireOptions; the
// default), every bucket whose bytes pass through host memory is verified,
// summed as it is applied. The subscriber acks (step, bytes, checksum); on Commit
// the staging copy is copied into the params and version() moves to the step;
// on Abort nothing becomes visible in staging mode (without staging, the
// params may hold part of the failed step: the rank is then torn, see
// torn(); use staging where a failed step must leave the served weights
// intact). on_end runs after either. A bucket
// that fails its checksum fails the step for this rank: acked as failed, the
// coordinator aborts it here. A hook that throws never ends the process:
// on_begin failing fails the step on this rank (its data is still received so
// that no sender stalls; the ack names the hook and its error); on_end runs
// after the decision, so its failure is reported in StepOutcome::reason.
#pragma once

#include <weightsync/engine_layout.h>
#include <weightsync/load_spec.h>
#include <weightsync/plan.h>
#include <weightsync/tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace weightsync {

class Tracer;

struct SubscriberOptions {
  std::string coordinator;  // "HOST:PORT"
  std::string token;
  // Every engine of the job: one config, or groups of replicas (engine_layout.h).
  EngineSpec engine;
  int replica = 0;  // which replica this rank belongs to, over every group
  int rank = 0;     // rank inside the replica, 0..tp-1 of its group
  // The trainer's layout; when absent, the one trainer rank 0 put in the store.
  std::optional<TrainerLayout> trainer;
  std::string transport = "ucx";  // must match the trainers' (wrappers may differ)
  // Apply into a private copy, copied into the params on commit: an aborted
  // or corrupted step leaves the params as they were. Costs one copy of the
  // rank's params.
  bool staging = false;
  // load_weights mode (on_weights set): where the HF tensors handed to the
  // engine are assembled; -1: host memory, else this CUDA device.
  int weights_device = -1;
  std::string job = "weightsync";
  std::chrono::milliseconds connect_timeout{60000};
  std::chrono::milliseconds step_timeout{120000};  // from a step's begin to its decision
  // A lost coordinator (it died, restarts, or the link broke) is reached
  // again for this long; the rank registers again as the same member with
  // its version (docs/usage.md, "The coordinator dies"). 0: never.
  std::chrono::milliseconds coordinator_reconnect{300000};
  // The summary line of a parity check run before connecting (the Python
  // engine integrations' check of the layout against the live engine's
  // params, docs/fp8.md): registered with the coordinator, which shows it
  // per engine rank in `weightsync status`. "" when none was run.
  std::string parity;
  Tracer* tracer = nullptr;
};

struct StepPhases {
  double receive = 0;  // waiting for buckets to land
  double verify = 0;   // checksums
  double apply = 0;    // copying segments into params (or staging)
  double commit = 0;   // from ack to the coordinator's decision (+ staging copy)
};

struct StepOutcome {
  int64_t step = 0;
  bool committed = false;
  std::string reason;         // why not, when !committed; or why the on_end hook failed
  uint64_t bytes = 0;         // payload bytes received
  uint64_t bytes_direct = 0;  // of those, landed straight in the params (or staging), zero copy
  uint64_t buckets_lent = 0;  // buckets its trainers wrote into its lent params (WireOptions::lend)
  uint64_t checksum = 0;
  uint64_t delta_buckets = 0;   // delta sync: buckets that came as deltas (docs/delta.md)
  uint64_t weights_handed = 0;  // load_weights mode: HF tensors handed to on_weights
  double seconds = 0;           // StepBegin to decision
  StepPhases phases;
  // After this step the params hold part of a step that did not commit
  // (Subscriber::torn()).
  bool torn = false;
  // When torn and not committed: the sentence `reason` ends with that says
  // so ("engine rank N is torn: ..."), kept apart so that a layer that puts
  // the previous version back can drop it without parsing the reason.
  std::string torn_reason;
};

class Subscriber {
 public:
  explicit Subscriber(SubscriberOptions options);  // connects to the coordinator
  ~Subscriber();
  Subscriber(const Subscriber&) = delete;
  Subscriber& operator=(const Subscriber&) = delete;

  // Registers engine parameter `name` of this rank (must stay valid and in
  // place). Errc::not_found for a name the engine layout lacks for this rank;
  // Errc::mismatch naming the param for another dtype or shape.
  void register_param(const std::string& name, const TensorView& param);
  void register_param(const std::string& name, void* data, DType dtype, const Shape& shape,
                      MemoryKind memory = MemoryKind::host, int device = -1);

  void on_begin(std::function<void(int64_t step)> hook);
  void on_end(std::function<void(int64_t step)> hook);

  // load_weights mode, for ranks of a framework-"hf" group (every HF tensor
  // whole): no params are registered; as buckets land, each HF tensor is
  // handed whole to `hook`, in batches (the tensors that one bucket
  // completed), as vLLM's and SGLang's model.load_weights take them. The
  // views are valid during the call only (their memory is reused: the engine
  // copies them, as load_weights does). Then `loaded` runs (e.g.
  // process_weights_after_loading), before the ack: if either throws, the
  // step fails on this rank. Set before the first step.
  // With `changed_only`, a delta sync step (PublisherOptions::delta) hands
  // only the tensors that may have changed since the version the rank holds
  // (a bucket brought them whole, or its delta changed one of their
  // elements); the engine keeps the others as it took them before. For
  // engines that take a subset (SGLang's weight-update session, a plain
  // load_weights); vLLM's layerwise reload rebuilds a layer from what it is
  // handed, so it takes every tensor (the default).
  using WeightsHook = std::function<void(
      int64_t step, const std::vector<std::pair<std::string, TensorView>>& tensors)>;
  void on_weights(WeightsHook hook, bool changed_only = false);
  void on_loaded(std::function<void(int64_t step)> hook);

  // Connects the transport, computes the plan and allocates staging now (the
  // first run_step does it otherwise). Every param must be registered; waits
  // for the trainers to register (connect_timeout).
  void prepare();

  // Waits up to `wait` for the next step to begin, then runs it to its
  // decision. nullopt when no step began in time. Throws Errc::peer_failure
  // when the coordinator is lost.
  [[nodiscard]] std::optional<StepOutcome> run_step(std::chrono::milliseconds wait);
  // run_step until stop() (from another thread or a hook).
  void serve();
  void stop();

  int64_t version() const;  // last committed step, -1 before the first
  // True while the params may hold a mix: a step that did not commit began
  // writing them (no staging: its buckets land in the params as they
  // arrive, so once its receives are posted; in load_weights mode, once the
  // engine took some of its tensors). version() is
  // then the last committed step, but the params are not that version whole.
  // Cleared by the next commit (every element is written by every step).
  // Never set with staging: a failed step leaves the params untouched.
  bool torn() const;
  // The engine put this rank's last committed version back whole by its own
  // means after failed step `step` wrote part of it (weightsync's vLLM and
  // SGLang layers reload the version they kept): torn() is false again and
  // the coordinator stops listing the rank torn. Call it between steps, on
  // the thread that runs run_step. Errc::peer_failure when the coordinator
  // cannot be told (torn() is false here all the same).
  void restored(int64_t step);
  // The engine now serves committed step `step` (a staged version's apply
  // ended): the coordinator's status shows it and since when, with
  // `requests`, each request running at the swap (the engine's request id)
  // -> the index of its first token made by `step`. Errc::peer_failure when
  // the coordinator cannot be told; Errc::protocol when `step` is not a
  // step this rank committed. False, telling nothing, where the coordinator
  // is older than the request. Waits at most `wait` for the answer (the
  // engine may be paused meanwhile).
  bool applied(int64_t step, const std::map<std::string, int64_t>& requests = {},
               std::chrono::milliseconds wait = std::chrono::milliseconds(2000));
  // The coordinator moved (a restarted one on another address): the rank
  // reconnects there. coordinator(): where it connects now.
  void set_coordinator(const std::string& address);
  std::string coordinator() const;
  int global_rank() const;  // among every group's engine ranks (replica * tp + rank with one)
  int live_trainers();      // trainers currently registered with the coordinator
  const EngineRankLayout& layout() const;
  const Plan& plan() const;  // after the first step began

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace weightsync
