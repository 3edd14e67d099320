#include "pipeline/setup.h"

#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/topology.h>

#include "core/cuda/gpu.h"
#include "pipeline/loop.h"
#include "pipeline/wire.h"
#include "transport/staging.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <limits>

namespace weightsync::pipeline {
namespace {

// The JSON under `key` of the job's store, Errc::format naming the key when
// it is no JSON.
nlohmann::json fetch_json(control::Client& client, const std::string& who, const std::string& key,
                          Clock::time_point deadline) {
  const auto blob = client.get(key, left_until(deadline));
  auto j = nlohmann::json::parse(blob.begin(), blob.end(), nullptr, false);
  if (j.is_discarded()) fail(Errc::format, who, ": the store's '", key, "' is not JSON");
  return j;
}

// Trainer rank 0's published options, Errc::format naming `who` and the key
// when they are malformed.
PublishedOptions fetch_options(control::Client& client, const std::string& who,
                               const std::string& job, Clock::time_point deadline) {
  const std::string key = JobKeys{job}.plan_options();
  const nlohmann::json j = fetch_json(client, who, key, deadline);
  try {
    return PublishedOptions::from_json(j, cat("the store's '", key, "'"));
  } catch (const Error& e) {
    if (e.code() != Errc::format) throw;
    fail(Errc::format, who, ": ", e.what());
  }
}

DataPath open(control::Client& client, const SetupSpec& spec) {
  const auto deadline = Clock::now() + spec.connect_timeout;
  const JobKeys keys{spec.job};
  DataPath dp;
  dp.memory = spec.memory;
  dp.trainer =
      spec.trainer
          ? *spec.trainer
          : TrainerLayout::from_json(fetch_json(client, spec.who, keys.trainer_layout(), deadline));
  dp.engine = spec.engine ? *spec.engine
                          : make_engine_layout(engine_spec_from_json(
                                fetch_json(client, spec.who, keys.engine_config(), deadline), "."));
  const PublishedOptions published = fetch_options(client, spec.who, spec.job, deadline);
  dp.wire = published.wire;
  dp.options = spec.plan ? *spec.plan : published.plan;
  // Elastic replicas: rank 0's word, which every process follows.
  if (published.min_replicas) {
    dp.elastic = true;
    dp.min_replicas = *published.min_replicas;
    if (dp.min_replicas > dp.engine.num_replicas())
      fail(Errc::invalid_argument, spec.who, ": elastic replicas: min_replicas ", dp.min_replicas,
           " exceeds the engine config's ", dp.engine.num_replicas(), " replica slots");
  }
  // Static jobs wait for every engine rank; elastic ones for the trainers
  // only (engine replicas come and go between steps).
  client.wait_members(static_cast<int>(dp.trainer.mesh.world()), dp.elastic ? 0 : dp.engine.world(),
                      left_until(deadline));
  // NCCL's communicator is made once for every rank, which must all be there.
  if (dp.elastic && spec.transport.find("nccl") != std::string::npos)
    fail(Errc::unsupported, spec.who, ": elastic replicas need a transport that takes new ",
         "processes in (ucx, cuda_ipc), not '", spec.transport,
         "': an NCCL communicator is fixed at its creation");
  const int trainers = static_cast<int>(dp.trainer.mesh.world());
  dp.transport_rank = spec.trainer_side ? spec.rank : trainers + spec.rank;
  TransportEnd end =
      open_transport(client, spec.transport, keys.transport(), dp.transport_rank,
                     trainers + dp.engine.world(), trainers, spec.memory, left_until(deadline));
  dp.transport = std::move(end.transport);
  dp.progress = std::move(end.progress);
  if (!dp.elastic) dp.plan = make_plan(dp.trainer, dp.engine, Topology{}, dp.options);
  // Up front: slots the transport cannot reach would fail deep inside a step.
  choose_slots(dp.memory, dp.transport->capabilities(), dp.wire, spec.who, spec.transport, dp.slots,
               dp.slot_device);
  return dp;
}

}  // namespace

void choose_slots(const RankMemory& memory, const Capabilities& caps, const WireOptions& wire,
                  const std::string& who, const std::string& transport, SlotMemory& slots,
                  int& slot_device) {
  if (memory.any)
    slots = choose_slot_memory(memory.memory, caps, wire, who, transport);
  else
    slots = caps.host_memory ? SlotMemory::host : SlotMemory::device;
  slot_device = slots == SlotMemory::device ? memory.device : -1;
}

PublishedPlan fetch_published_plan(control::Client& client, const std::string& job,
                                   const std::string& who, std::chrono::milliseconds wait) {
  const auto deadline = Clock::now() + wait;
  PublishedPlan out;
  out.trainer =
      TrainerLayout::from_json(fetch_json(client, who, JobKeys{job}.trainer_layout(), deadline));
  PublishedOptions published = fetch_options(client, who, job, deadline);
  out.options = published.plan;
  out.wire = published.wire;
  return out;
}

std::string JobKeys::trainer_layout() const {
  return job + "/layout/trainer";
}
std::string JobKeys::engine_config() const {
  return job + "/layout/engine";
}
std::string JobKeys::plan_options() const {
  return job + "/plan_options";
}
std::string JobKeys::transport() const {
  return job + "/transport";
}
std::string JobKeys::ready(int global_engine_rank) const {
  return cat(job, "/ready/", global_engine_rank);
}

nlohmann::json PublishedOptions::to_json() const {
  nlohmann::json j = plan.to_json();
  j["wire"] = wire.to_json();
  if (min_replicas) j["elastic"] = {{"min_replicas", *min_replicas}};
  return j;
}

PublishedOptions PublishedOptions::from_json(const nlohmann::json& j, const std::string& what) {
  PublishedOptions out;
  try {
    out.plan = PlanOptions::from_json(j);
  } catch (const Error& e) {
    if (e.code() != Errc::format) throw;
    fail(Errc::format, what, " ", e.what());
  }
  out.wire = WireOptions::from_json(j.value("wire", nlohmann::json::object()));
  if (j.contains("elastic")) {
    const auto& e = j["elastic"];
    if (!e.is_object() || !e.contains("min_replicas") || !e["min_replicas"].is_number_integer() ||
        e["min_replicas"].get<int64_t>() < 1)
      fail(Errc::format, what,
           " has an \"elastic\" without an integer \"min_replicas\" >= 1: ", j.dump());
    out.min_replicas = e["min_replicas"].get<int>();
  }
  return out;
}

void publish_trainer(control::Client& client, const std::string& job, const TrainerLayout& layout,
                     const PublishedOptions& options) {
  const JobKeys keys{job};
  const std::string trainer = layout.to_json().dump();
  client.set(keys.trainer_layout(), std::vector<uint8_t>(trainer.begin(), trainer.end()));
  const std::string published = options.to_json().dump();
  client.set(keys.plan_options(), std::vector<uint8_t>(published.begin(), published.end()));
}

std::string memory_str(MemoryKind memory, int device) {
  return memory == MemoryKind::host ? std::string("host memory") : cat("CUDA device ", device);
}

RankMemory rank_memory(const std::vector<TensorView>& tensors,
                       const std::function<std::string(std::size_t)>& name,
                       const std::string& who) {
  RankMemory out;
  std::size_t first = std::numeric_limits<std::size_t>::max();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const TensorView& t = tensors[i];
    if (t.numel() == 0) continue;
    int device = -1;
    if (t.memory == MemoryKind::cuda) {
      gpu::require_device(cat(who, ": param '", name(i), "' in CUDA memory"));
      const int known = gpu::pointer_device(t.data);
      device = t.device >= 0 ? t.device : known;
      if (known < 0 || known != device)
        fail(Errc::invalid_argument, who, ": param '", name(i), "' is registered as ",
             memory_str(MemoryKind::cuda, device), " but CUDA ",
             known < 0 ? std::string("does not know its address as device memory")
                       : cat("places it on device ", known));
    }
    if (first == std::numeric_limits<std::size_t>::max()) {
      first = i;
      out = RankMemory{t.memory, device, true};
      continue;
    }
    if (t.memory != out.memory || device != out.device)
      fail(Errc::invalid_argument, who, ": params '", name(first), "' (",
           memory_str(out.memory, out.device), ") and '", name(i), "' (",
           memory_str(t.memory, device),
           ") are in different places; a rank's tensors must all be in host memory or all on "
           "one CUDA device");
  }
  return out;
}

control::Client::Progress keep_progressing(control::Client& client, Transport& transport) {
  return client.while_waiting([&transport] {
    try {
      transport.progress();
    } catch (const Error&) {
    }
  });
}

TransportEnd open_transport(control::Client& client, const std::string& name,
                            const std::string& prefix, int rank, int world, int trainers,
                            const RankMemory& memory, std::chrono::milliseconds bootstrap_timeout) {
  TransportOptions t;
  t.name = name;
  t.store = &client;
  t.prefix = prefix;
  t.rank = rank;
  t.world = world;
  t.incarnation = client.member_id();
  t.incarnation_of = [&client, trainers](int peer) -> uint64_t {
    const bool trainer = peer < trainers;
    const int rank = trainer ? peer : peer - trainers;
    for (const auto& m : client.members())
      if (m.rank == rank && m.role == (trainer ? control::Role::trainer : control::Role::engine))
        return m.id;
    return 0;
  };
  // GPU backends work on the tensors' device (NCCL binds its communicator to it).
  t.device = memory.memory == MemoryKind::cuda ? memory.device : -1;
  t.bootstrap_timeout = bootstrap_timeout;
  use_device(memory);
  TransportEnd end;
  end.transport = make_transport(t);
  end.progress = keep_progressing(client, *end.transport);
  return end;
}

DataPath open_data_path(control::Client& client, const SetupSpec& spec) {
  try {
    return open(client, spec);
  } catch (const nlohmann::json::exception& e) {
    // Never a foreign exception out of setup: callers clean up on Error.
    fail(Errc::format, spec.who, ": setting up the data path: ", e.what());
  }
}

void connect_peers(Transport& transport, int below) {
  const int end = below > 0 ? std::min(below, transport.world()) : transport.world();
  for (int peer = 0; peer < end; ++peer)
    if (peer != transport.rank()) transport.connect(peer);
}

void Endpoint::take(DataPath& dp) {
  transport = std::move(dp.transport);
  progress = std::move(dp.progress);
  plan_options = dp.options;
  elastic = dp.elastic;
  min_replicas = dp.min_replicas;
  wire = dp.wire;
  memory = dp.memory;
  slots = dp.slots;
  slot_device = dp.slot_device;
}

void Endpoint::close_transport() {
  progress = {};
  transport.reset();
}

void check_registered(const std::string& who, const std::string& name, const TensorView& tensor,
                      DType dtype, const Shape& shape, const std::string& says,
                      const std::string& shape_says, bool written) {
  if (tensor.dtype != dtype)
    fail(Errc::mismatch, who, ": param '", name, "' registered as ", dtype_name(tensor.dtype),
         " but ", says, " ", dtype_name(dtype));
  if (tensor.shape != shape)
    fail(Errc::mismatch, who, ": param '", name, "' registered with shape ",
         shape_str(tensor.shape), " but ", shape_says, " ", shape_str(shape));
  if (!tensor.data && tensor.numel() > 0)
    fail(Errc::invalid_argument, who, ": param '", name, "' registered with a null pointer");
  if (written && !tensor.is_non_overlapping())
    fail(Errc::invalid_argument, who, ": param '", name, "' has strides ",
         shape_str(tensor.effective_strides()), " for shape ", shape_str(tensor.shape),
         ": its elements overlap in memory, so writes into it would collide (an expanded or ",
         "broadcast view?); register the tensor that owns the memory");
}

void use_device(const RankMemory& memory) {
  if (memory.memory == MemoryKind::cuda) gpu::set_device(memory.device);
}

}  // namespace weightsync::pipeline
