// The engine side of a demo/bench job: one process per engine rank holding
// its params (zero at start), a Subscriber applying every step, and a check
// of the params against the reference (the checkpoint materialized for this
// rank, with the step's version pattern on every byte the layout covers).
#include "demo_job.h"
#include "demo_raw.h"

#include <weightsync/error.h>
#include <weightsync/safetensors.h>
#include <weightsync/subscriber.h>
#include <weightsync/trace.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

namespace weightsync::demo {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

struct Param {
  std::unique_ptr<char[]> data, reference, mask;
  TensorView view;
};

// The bytes of each param a checkpoint element lands on (0xFF) vs padding (0).
void fill_mask(const EngineParam& p, char* mask) {
  const TensorView m = host_view(mask, p.dtype, p.shape);
  for (const Segment& s : p.segments) {
    std::vector<char> ones(static_cast<size_t>(s.hf_box.numel()) * itemsize(p.dtype), '\xff');
    // The param may have leading length-1 dims the HF box lacks.
    Shape lengths = s.hf_box.lengths;
    lengths.insert(lengths.begin(), s.param_box.rank() - s.hf_box.rank(), 1);
    const TensorView src = host_view(ones.data(), p.dtype, lengths);
    const int r = static_cast<int>(p.shape.size());
    Box dst_box = s.param_box;
    if (s.transpose) {
      std::swap(dst_box.offsets[r - 1], dst_box.offsets[r - 2]);
      std::swap(dst_box.lengths[r - 1], dst_box.lengths[r - 2]);
    }
    copy_box(src, Box::full(lengths), s.transpose ? transposed(m, r - 2, r - 1) : m, dst_box);
  }
}

// Mismatching bytes of param vs version `pattern` (nullopt reference: zero).
int64_t count_mismatches(const Param& p, uint8_t pattern, bool never_committed) {
  const auto* d = reinterpret_cast<const unsigned char*>(p.data.get());
  const auto* r = reinterpret_cast<const unsigned char*>(p.reference.get());
  const auto* m = reinterpret_cast<const unsigned char*>(p.mask.get());
  int64_t bad = 0;
  for (size_t i = 0; i < p.view.nbytes(); ++i) {
    const unsigned char expected = never_committed ? 0 : (r[i] ^ (pattern & m[i]));
    bad += d[i] != expected;
  }
  return bad;
}

nlohmann::json check(const EngineRankLayout& layout, const std::vector<Param>& params,
                     int64_t version, int64_t final_step) {
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t n =
        count_mismatches(params[i], version_pattern(version, final_step), version < 0);
    if (n && first.empty()) first = layout.params[i].name;
    bad += n;
  }
  return {{"version", version}, {"ok", bad == 0}, {"bad_bytes", bad}, {"first_bad_param", first}};
}

void dump(const JobSpec& job, const EngineRankLayout& layout, const std::vector<Param>& params,
          int replica, int rank) {
  std::filesystem::create_directories(job.dump_dir);
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& p : layout.params) entries.push_back({p.name, p.dtype, p.shape});
  SafetensorsWriter w(cat(job.dump_dir, "/engine", replica, "-rank", rank, ".safetensors"),
                      entries);
  for (size_t i = 0; i < params.size(); ++i)
    w.write_tensor(layout.params[i].name, params[i].data.get(), params[i].view.nbytes());
  w.finish();
}

nlohmann::json outcome_json(const StepOutcome& o) {
  return {{"step", o.step},
          {"committed", o.committed},
          {"reason", o.reason},
          {"bytes", o.bytes},
          {"bytes_direct", o.bytes_direct},
          {"seconds", o.seconds},
          {"phases",
           {{"receive", o.phases.receive},
            {"verify", o.phases.verify},
            {"apply", o.phases.apply},
            {"commit", o.phases.commit}}}};
}

}  // namespace

namespace {

// Zeroed params, plus the reference (materialize) and coverage mask to check them.
std::vector<Param> make_params(const JobSpec& job, const EngineRankLayout& rl) {
  std::vector<Param> params;
  std::optional<Checkpoint> ckpt;
  if (job.verify) ckpt = Checkpoint::open(job.checkpoint);
  for (const EngineParam& p : rl.params) {
    Param q;
    const size_t bytes =
        std::max<size_t>(static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype), 1);
    q.data.reset(new char[bytes]());
    q.view = host_view(q.data.get(), p.dtype, p.shape);
    if (job.verify) {
      q.reference.reset(new char[bytes]());
      q.mask.reset(new char[bytes]());
      fill_param(*ckpt, p, q.reference.get());
      fill_mask(p, q.mask.get());
    }
    params.push_back(std::move(q));
  }
  return params;
}

SubscriberOptions subscriber_options(const JobSpec& job, const EngineConfig& config, int global,
                                     Tracer* tracer) {
  SubscriberOptions opt;
  opt.coordinator = job.coordinator;
  opt.token = job.token;
  opt.engine = config;
  opt.replica = global / config.tp;
  opt.rank = global % config.tp;
  opt.trainer = TrainerLayout::load(job.trainer);
  opt.transport = worker_transport(job, "engine", global);
  opt.staging = job.staging;
  opt.connect_timeout = Millis(job.timeout_ms);
  opt.step_timeout = Millis(job.timeout_ms);
  opt.tracer = tracer;
  return opt;
}

// Runs steps until the last one, or until the trainers are gone; checks the
// params after every committed step. Fills stats["steps"] and ["checks"].
bool serve_steps(const JobSpec& job, Subscriber& sub, const EngineRankLayout& rl,
                 const std::vector<Param>& params, nlohmann::json& stats) {
  nlohmann::json steps = nlohmann::json::array(), checks = nlohmann::json::array();
  bool ok = true;
  const auto deadline = Clock::now() + Millis(job.timeout_ms) * (job.steps + 1);
  while (Clock::now() < deadline) {
    auto o = sub.run_step(Millis(300));
    if (!o) {
      if (sub.live_trainers() == 0) break;  // the trainers are gone: no more steps
      continue;
    }
    steps.push_back(outcome_json(*o));
    if (o->committed && job.verify) {
      checks.push_back(check(rl, params, o->step, job.steps));
      ok &= checks.back()["ok"].get<bool>();
    }
    if (o->step >= job.steps) break;
  }
  stats["steps"] = steps;
  stats["checks"] = checks;
  return ok;
}

}  // namespace

int run_engine_worker(const JobSpec& job, int global) {
  register_kill_transport();
  const EngineConfig config = EngineConfig::load(job.engine);
  const EngineLayout layout = make_engine_layout(config);
  const EngineRankLayout& rl = layout.rank_layout(global);
  const std::vector<Param> params = make_params(job, rl);
  std::unique_ptr<Tracer> tracer;
  if (job.trace) tracer = std::make_unique<Tracer>(cat("engine ", global), 1000 + global);
  Subscriber sub(subscriber_options(job, config, global, tracer.get()));
  for (size_t i = 0; i < params.size(); ++i) sub.register_param(rl.params[i].name, params[i].view);
  sub.prepare();

  nlohmann::json stats = {{"role", "engine"}, {"rank", global}, {"replica", global / config.tp}};
  if (job.raw_rounds > 0) {
    auto observer = observer_client(job, Millis(job.timeout_ms));
    stats["raw"] = run_raw_rounds(job, sub.plan(), *observer, "engine", global);
  }
  bool ok = serve_steps(job, sub, rl, params, stats);
  stats["version"] = sub.version();
  // With staging, whatever happened, the params are exactly the version held.
  if (job.verify && job.staging) {
    stats["final_check"] = check(rl, params, sub.version(), job.steps);
    ok &= stats["final_check"]["ok"].get<bool>();
  }
  if (!job.dump_dir.empty()) dump(job, rl, params, global / config.tp, global % config.tp);
  stats["peak_rss_mb"] = peak_rss_mb();
  stats["ok"] = ok;
  std::ofstream(job.stats_path("engine", global), std::ios::trunc) << stats.dump(2);
  if (tracer) tracer->write(job.trace_path("engine", global));
  if (!ok) std::cerr << "engine rank " << global << ": params differ from the reference\n";
  return ok ? 0 : 1;
}

}  // namespace weightsync::demo
