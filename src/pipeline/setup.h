// The setup both ends of the data path share (Publisher and Subscriber
// ensure_ready): the layouts and plan options from the store when not given,
// the members, the rank's memory and CUDA device, the transport (its device
// set from the tensors), the plan, and the staging slots' memory checked
// against what the transport reaches, up front.
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/control.h>
#include <weightsync/engine_layout.h>
#include <weightsync/load_spec.h>
#include <weightsync/plan.h>
#include <weightsync/wire_options.h>

#include "transport/staging.h"

#include <nlohmann/json_fwd.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace weightsync::pipeline {

// Where a rank's tensors live: all in host memory, or all on one CUDA device.
struct RankMemory {
  MemoryKind memory = MemoryKind::host;
  int device = -1;   // CUDA ordinal when memory == cuda
  bool any = false;  // false: the rank holds no bytes (every tensor empty)
};

// "host memory", "CUDA device 1".
std::string memory_str(MemoryKind memory, int device);

// The memory of `tensors` (name(i) names tensor i in messages). A CUDA tensor
// registered without a device takes the device CUDA reports for its pointer.
// Errc::invalid_argument naming two params and where each lives when they
// are not all in one place; Errc::unsupported for CUDA tensors without CUDA.
RankMemory rank_memory(const std::vector<TensorView>& tensors,
                       const std::function<std::string(std::size_t)>& name, const std::string& who);

// The job's documents in the coordinator's store, all under "<job>/": their
// keys, written here once for every reader and writer.
struct JobKeys {
  std::string job;
  std::string trainer_layout() const;  // trainer rank 0's TrainerLayout JSON
  std::string engine_config() const;   // engine rank 0's EngineSpec JSON
  std::string plan_options() const;    // trainer rank 0's PublishedOptions JSON
  std::string transport() const;       // the prefix of the transport's address exchange
  // Elastic replicas: where an engine rank says it is ready to take part in
  // steps (its value: the member id of its process).
  std::string ready(int global_engine_rank) const;
};

// What trainer rank 0 publishes under JobKeys::plan_options: the options
// every process plans with, the wire options every rank follows, and for
// elastic replicas the replicas a step waits for. The JSON is PlanOptions'
// object with "wire" (WireOptions) and "elastic": {"min_replicas"} beside
// its fields.
struct PublishedOptions {
  PlanOptions plan;  // `replicas` empty: each step's membership sets them
  WireOptions wire;
  std::optional<int> min_replicas;  // set: elastic replicas (>= 1)

  nlohmann::json to_json() const;
  // Errc::format naming `what` (the store's key) for a malformed object;
  // WireOptions' and the enums' own errors otherwise.
  static PublishedOptions from_json(const nlohmann::json& j, const std::string& what);
};

// Trainer rank 0's documents: its layout and the published options (the
// engines plan from the same inputs).
void publish_trainer(control::Client& client, const std::string& job, const TrainerLayout& layout,
                     const PublishedOptions& options);

struct SetupSpec {
  std::string who;  // "trainer rank 2", "engine rank 5"
  bool trainer_side = true;
  int rank = 0;  // trainer rank, or global engine rank
  std::string job;
  std::string transport;
  std::optional<TrainerLayout> trainer;  // else trainer rank 0's from the store
  std::optional<EngineLayout> engine;    // else from engine rank 0's config in the store
  std::optional<PlanOptions> plan;       // else trainer rank 0's from the store
  RankMemory memory;
  std::chrono::milliseconds connect_timeout{60000};
};

struct DataPath {
  TrainerLayout trainer;
  EngineLayout engine;
  // Static jobs: the plan for every replica. Elastic replicas (trainer rank
  // 0's plan options say "elastic"): none; each step's plan follows its
  // membership, made from `options` with PlanOptions::replicas set.
  std::optional<Plan> plan;
  PlanOptions options;
  bool elastic = false;
  int min_replicas = 1;  // elastic: a step begins once this many replicas are ready
  WireOptions wire;      // trainer rank 0's: every rank follows them
  std::unique_ptr<Transport> transport;
  // Keeps `transport` progressing while the client waits (keep_progressing);
  // its owner destroys it before the transport.
  control::Client::Progress progress;
  int transport_rank = 0;
  RankMemory memory;
  SlotMemory slots = SlotMemory::host;
  int slot_device = -1;  // device slots' GPU
};

// What a Publisher and a Subscriber hold alike: their control client, the
// registration of their tensors, and their end of the data path once set up
// (take). Their Impl derives from it; members declared after it (pipelines,
// staging) go first on destruction, before the transport and the client.
struct Endpoint {
  std::unique_ptr<control::Client> client;
  std::map<std::string, std::size_t, std::less<>> index;  // param name -> layout index
  std::vector<bool> registered;
  std::unique_ptr<Transport> transport;
  control::Client::Progress progress;  // of `transport`, in the client's waits
  std::optional<Plan> plan;
  bool ready = false;  // set up (ensure_ready done)
  // What later plans and pipelines are made from (elastic replicas: a plan
  // per membership).
  PlanOptions plan_options;
  bool elastic = false;
  int min_replicas = 1;
  WireOptions wire;
  RankMemory memory;
  SlotMemory slots = SlotMemory::host;
  int slot_device = -1;
  int64_t current_step = -1;

  // Takes `dp`'s transport, its progress and the settings above (not its
  // layouts or plan, which each side keeps in its own way).
  void take(DataPath& dp);
  // Releases the transport: its progress first, then the transport itself.
  void close_transport();
};

// Checks a tensor being registered against what its layout says, naming
// `who` and the param. `says`: where the dtype comes from ("its LoadSpec
// says"); `shape_says`: where the shape does ("rank 2's local shape is").
// `written`: the tensor is written into (an engine's param), so its elements
// must not overlap. Errc::mismatch or Errc::invalid_argument.
void check_registered(const std::string& who, const std::string& name, const TensorView& tensor,
                      DType dtype, const Shape& shape, const std::string& says,
                      const std::string& shape_says, bool written);

// A transport and its progress in the client's waits (keep_progressing);
// the progress goes first on destruction.
struct TransportEnd {
  std::unique_ptr<Transport> transport;
  control::Client::Progress progress;
};

// Creates transport `name` for `rank` of `world`, its addresses exchanged
// under `prefix` of the client's store, on the device of `memory` (GPU
// backends bind to it), and keeps it progressing while the client waits.
// Every data path opens its transport here: the sync's (open_data_path) and
// save_hf's.
// Ranks below `trainers` are trainer ranks, the others engine ranks from 0:
// the transport learns each peer's incarnation (member id) from the
// coordinator's membership (TransportOptions::incarnation_of).
TransportEnd open_transport(control::Client& client, const std::string& name,
                            const std::string& prefix, int rank, int world, int trainers,
                            const RankMemory& memory, std::chrono::milliseconds bootstrap_timeout);

// Sets up this rank's end of the data path. Every failure is a
// weightsync::Error naming `who` (malformed JSON in the store included).
DataPath open_data_path(control::Client& client, const SetupSpec& spec);

// The slots of a rank whose tensors are in `memory`, for `wire` over a
// transport of `caps`: host, pinned or device memory (choose_slot_memory;
// checksums need slots the host reads), and device slots' GPU (else -1).
void choose_slots(const RankMemory& memory, const Capabilities& caps, const WireOptions& wire,
                  const std::string& who, const std::string& transport, SlotMemory& slots,
                  int& slot_device);

// What trainer rank 0 publishes in the job's store now: a trainer process
// that took rank 0 over publishes its own layout and plan options, which may
// differ from its predecessor's (another bucket size, say).
struct PublishedPlan {
  TrainerLayout trainer;
  PlanOptions options;
  WireOptions wire;
};
PublishedPlan fetch_published_plan(control::Client& client, const std::string& job,
                                   const std::string& who, std::chrono::milliseconds wait);

// Registers `transport`'s progress with the client's waits (a decision, a
// store key, an event), so that a rank blocked there still completes what
// its transport owes its peers (Client::while_waiting). Errors are left to
// the transport's requests, which report them.
[[nodiscard]] control::Client::Progress keep_progressing(control::Client& client,
                                                         Transport& transport);

// Eager endpoints to every other rank (`below` > 0: to ranks below it only,
// e.g. the trainers where engine replicas come and go), so that the first
// step times only the sync.
void connect_peers(Transport& transport, int below = 0);

// Where later GPU work of this thread goes: the rank's device (no-op for host memory).
void use_device(const RankMemory& memory);

}  // namespace weightsync::pipeline
