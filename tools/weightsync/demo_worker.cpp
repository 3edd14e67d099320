// The trainer side of a demo/bench job: one process per trainer rank holding
// its local shards (read from the checkpoint as `weightsync shard` would),
// turning them into each step's version and pushing it.
#include "demo_chaos.h"
#include "demo_device.h"
#include "demo_job.h"
#include "demo_raw.h"

#include <nlohmann/json.hpp>

#include <weightsync/control.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/publisher.h>
#include <weightsync/safetensors.h>
#include <weightsync/trace.h>

#include <fstream>
#include <iostream>
#include <thread>

#include <unistd.h>

namespace weightsync::demo {
namespace {

using Millis = std::chrono::milliseconds;

// This rank's shards as `weightsync shard` would write them, in the job's
// memory (each trainer rank on GPU gpu_of(rank) for a CUDA job): those of
// layout.rank_params(rank), in that order (a pipeline stage holds its own).
std::vector<WorkerTensor> load_shards(const JobSpec& job, const Checkpoint& ckpt,
                                      const TrainerLayout& layout, int rank) {
  std::vector<WorkerTensor> out;
  for (size_t p : layout.rank_params(rank)) {
    const LoadSpec& spec = layout.params[p];
    WorkerTensor t(spec.dtype, local_shape(spec, layout.mesh, rank),
                   on_gpu(job) ? gpu_of(rank) : -1);
    fill_local_tensor(ckpt, spec, layout.mesh, rank, t.host_view());
    t.upload();
    out.push_back(std::move(t));
  }
  return out;
}

nlohmann::json push_json(const PushResult& r) {
  nlohmann::json failed = nlohmann::json::array();
  for (const auto& [rank, why] : r.failed) failed.push_back({{"rank", rank}, {"reason", why}});
  return {{"step", r.step},
          {"ok", true},
          {"seconds", r.seconds},
          {"bytes_sent", r.bytes_sent},
          {"bytes_direct", r.bytes_direct},
          {"buckets_lent", r.buckets_lent},
          {"delta_buckets", r.delta_buckets},
          {"delta_bytes_whole", r.delta_bytes_whole},
          {"delta_base_bytes", r.delta_base_bytes},
          {"committed", r.committed},
          {"plan_id", r.plan_id},
          {"replicas", r.replicas},
          {"failed", failed},
          {"phases",
           {{"begin", r.phases.begin},
            {"pack", r.phases.pack},
            {"gather", r.phases.gather},
            {"wire", r.phases.wire},
            {"commit", r.phases.commit}}}};
}

std::string with_kill(const JobSpec& job, std::string transport, const std::string& role,
                      int rank) {
  if (job.kill.role != role || job.kill.rank != rank) return transport;
  return with_freeze(transport, job.kill.op, job.kill.after);
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2);
  if (!out) fail(Errc::io, "cannot write ", path);
}

}  // namespace

std::unique_ptr<control::Client> observer_client(const JobSpec& job, Millis timeout) {
  control::ClientOptions c;
  c.address = job.coordinator;
  c.token = job.token;
  c.role = control::Role::observer;
  c.connect_timeout = timeout;
  return std::make_unique<control::Client>(c);
}

std::string worker_transport(const JobSpec& job, const std::string& role, int rank) {
  std::string t = job.transport;
  const auto& own = role == "engine" ? job.engine_transport : job.trainer_transport;
  if (rank < static_cast<int>(own.size()) && !own[static_cast<size_t>(rank)].empty())
    t = own[static_cast<size_t>(rank)];
  return with_kill(job, t, role, rank);
}

namespace {

// The chaos soak's trainer (demo_chaos.h): from the first step not yet
// released, each step when the parent releases it; a failed push is
// reported and the next step goes on.
int run_chaos_steps(const JobSpec& job, Publisher& pub, std::vector<WorkerTensor>& shards,
                    int rank) {
  const std::string& dir = job.chaos_dir;
  const int first = chaos::first_step(dir);
  chaos::touch(chaos::ready_path(dir, "trainer", rank, ::getpid()));
  uint8_t applied = 0;  // the XOR pattern the shards hold now
  for (int s = first; s <= job.steps && chaos::wait_for_go(dir, s); ++s) {
    const double began_at = chaos::unix_seconds();
    const uint8_t target = version_pattern(s, job.steps);
    for (auto& t : shards) {
      xor_bytes(t.host(), t.nbytes(), applied ^ target);
      t.upload();
    }
    applied = target;
    nlohmann::json line;
    try {
      line = push_json(pub.push(s));
    } catch (const Error& e) {
      std::cerr << "trainer rank " << rank << ": step " << s << ": error [" << errc_name(e.code())
                << "]: " << e.what() << "\n";
      line = {{"step", s}, {"ok", false}, {"error", e.what()}, {"code", errc_name(e.code())}};
    }
    line["began_at"] = began_at;
    line["ended_at"] = chaos::unix_seconds();
    chaos::append_line(chaos::report_path(dir, "trainer", rank), line);
  }
  return 0;
}

}  // namespace

int run_trainer_worker(const JobSpec& job, int rank) {
  const Millis timeout(job.timeout_ms);
  const Checkpoint ckpt = Checkpoint::open(job.checkpoint);
  const TrainerLayout layout = TrainerLayout::load(job.trainer);
  check_checkpoint(ckpt, layout);
  auto shards = load_shards(job, ckpt, layout, rank);
  std::unique_ptr<Tracer> tracer;
  if (job.trace) tracer = std::make_unique<Tracer>(cat("trainer ", rank), rank);

  PublisherOptions opt;
  opt.coordinator = job.coordinator;
  opt.token = job.token;
  opt.rank = rank;
  opt.layout = layout;
  opt.engine = load_engine_spec(job.engine);
  opt.transport = worker_transport(job, "trainer", rank);
  opt.plan.mode = parse_plan_mode(job.mode);
  opt.plan.bucket_bytes = job.bucket_bytes;
  opt.plan.fp8_site = parse_fp8_site(job.fp8_site);
  opt.wire.checksums = job.checksums;
  opt.wire.checksums_gpu = job.checksums_gpu;
  opt.wire.lend = job.lend;
  opt.delta = job.delta ? DeltaMode::automatic : DeltaMode::off;
  opt.delta_verify = job.delta_verify;
  opt.elastic = job.elastic;
  opt.min_replicas = job.min_replicas;
  opt.connect_timeout = timeout;
  opt.step_timeout = timeout;
  opt.coordinator_reconnect = Millis(job.coordinator_reconnect_ms);
  opt.tracer = tracer.get();
  Publisher pub(opt);
  const std::vector<size_t> held = layout.rank_params(rank);
  for (size_t i = 0; i < shards.size(); ++i)
    pub.register_tensor(layout.params[held[i]].name, shards[i].view());
  pub.prepare();
  if (!job.chaos_dir.empty()) return run_chaos_steps(job, pub, shards, rank);
  auto observer = observer_client(job, timeout);
  const int trainers = static_cast<int>(layout.mesh.world());

  nlohmann::json stats = {{"role", "trainer"}, {"rank", rank}};
  if (job.raw_rounds > 0)
    stats["raw"] = run_raw_rounds(job, pub.plan(), *observer, "trainer", rank);
  nlohmann::json steps = nlohmann::json::array();
  uint8_t applied = 0;  // the XOR pattern the shards hold now
  int rc = 0;
  for (int s = 1; s <= job.steps; ++s) {
    if (job.update_fraction >= 0) {
      // Sparse versions: from the checkpoint (version `steps`) down to
      // version 1 at first, then each step's picks.
      for (size_t i = 0; i < shards.size(); ++i) {
        flip_picked(shards[i].host(), shards[i].nbytes(), itemsize(layout.params[held[i]].dtype),
                    nullptr, job.update_fraction, s == 1 ? 2 : s, s == 1 ? job.steps : s);
        shards[i].upload();
      }
    } else {
      const uint8_t target = version_pattern(s, job.steps);
      for (auto& t : shards) {
        xor_bytes(t.host(), t.nbytes(), applied ^ target);
        t.upload();
      }
      applied = target;
    }
    try {
      // Ranks start a step together, as after a synchronous optimizer step
      // (which --step-gap stands in for).
      if (s > 1 && job.step_gap_ms > 0) std::this_thread::sleep_for(Millis(job.step_gap_ms));
      observer->barrier(cat("step ", s), trainers, timeout);
      steps.push_back(push_json(pub.push(s)));
    } catch (const Error& e) {
      std::cerr << "trainer rank " << rank << ": step " << s << ": error [" << errc_name(e.code())
                << "]: " << e.what() << "\n";
      steps.push_back({{"step", s}, {"ok", false}, {"error", e.what()}});
      rc = 1;
      break;
    }
  }
  stats["steps"] = steps;
  stats["staging_bytes"] = pub.staging_bytes();
  stats["bucket_bytes"] = job.bucket_bytes;
  stats["peak_rss_mb"] = peak_rss_mb();
  write_json(job.stats_path("trainer", rank), stats);
  if (tracer) tracer->write(job.trace_path("trainer", rank));
  return rc;
}

}  // namespace weightsync::demo
