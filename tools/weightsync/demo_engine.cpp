// The engine side of a demo/bench job: one process per engine rank holding
// its params (zero at start), a Subscriber applying every step, and a check
// of the params against the reference (the checkpoint materialized for this
// rank, with the step's version pattern on every byte the layout covers).
#include "demo_chaos.h"
#include "demo_device.h"
#include "demo_job.h"
#include "demo_raw.h"

#include <nlohmann/json.hpp>

#include "core/fp8.h"

#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/materialize.h>
#include <weightsync/safetensors.h>
#include <weightsync/subscriber.h>
#include <weightsync/trace.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>
#include <tuple>
#include <utility>

#include <unistd.h>

namespace weightsync::demo {
namespace {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

struct Param {
  WorkerTensor data;  // what the Subscriber writes (host copy: what is checked)
  std::unique_ptr<char[]> reference, mask;
  // FP8 weights: reference and mask hold the weight in its source dtype
  // (the checkpoint's), quantized at check time (a version's bytes differ
  // from the checkpoint's by an XOR before quantization, not after).
  DType source = DType::BF16;
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

// Which version a check expects.
struct Version {
  int64_t step = -1;  // < 0: never committed (zero)
  const JobSpec* job = nullptr;
};

// `bytes` of a param's reference (elements of `item` bytes) as version `v`
// holds them: XOR-ed with its pattern, or with its picks flipped (sparse
// versions), where `mask` says the checkpoint covers them.
std::vector<char> version_bytes(const char* reference, const char* mask, size_t bytes, size_t item,
                                const Version& v) {
  std::vector<char> out(reference, reference + bytes);
  if (v.job->update_fraction >= 0) {
    flip_picked(out.data(), bytes, item, mask, v.job->update_fraction, v.step + 1, v.job->steps);
    return out;
  }
  const uint8_t pattern = version_pattern(v.step, v.job->steps);
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<char>(out[i] ^ (pattern & mask[i]));
  return out;
}

// Mismatching bytes of param vs version `v`.
int64_t count_mismatches(const Param& p, DType dtype, const Version& v) {
  const auto* d = reinterpret_cast<const unsigned char*>(p.data.host());
  int64_t bad = 0;
  if (v.step < 0) {
    for (size_t i = 0; i < p.data.nbytes(); ++i) bad += d[i] != 0;
    return bad;
  }
  const auto expected =
      version_bytes(p.reference.get(), p.mask.get(), p.data.nbytes(), itemsize(dtype), v);
  for (size_t i = 0; i < p.data.nbytes(); ++i)
    bad += d[i] != static_cast<unsigned char>(expected[i]);
  return bad;
}

// FP8 weight w and its scale param: version `pattern` of the source bytes,
// quantized as materialize does, against what the Subscriber wrote.
int64_t count_fp8_mismatches(const EngineParam& w, const Param& p, const Param& scale,
                             const Version& v) {
  const bool never_committed = v.step < 0;
  const size_t n = w.shape.size();
  const int64_t rows = w.shape[n - 2], cols = w.shape[n - 1];
  const int64_t slices = rows * cols > 0 ? numel(w.shape) / (rows * cols) : 0;
  const size_t item = itemsize(p.source);
  const auto src_bytes = static_cast<size_t>(numel(w.shape)) * item;
  std::vector<char> src = never_committed
                              ? std::vector<char>(src_bytes)
                              : version_bytes(p.reference.get(), p.mask.get(), src_bytes, item, v);
  std::vector<uint8_t> q(static_cast<size_t>(numel(w.shape)), 0);
  std::vector<float> s(scale.data.nbytes() / sizeof(float), 0.0f);
  const int64_t per_slice = ((rows + 127) / 128) * ((cols + 127) / 128);
  if (!never_committed)
    for (int64_t i = 0; i < slices; ++i)
      fp8::quantize_tensor(src.data() + static_cast<size_t>(i * rows * cols) * item, p.source, rows,
                           cols, w.quant->scale, q.data() + i * rows * cols,
                           s.data() + i * per_slice);
  int64_t bad = 0;
  const auto* d = reinterpret_cast<const unsigned char*>(p.data.host());
  for (size_t i = 0; i < q.size(); ++i) bad += d[i] != q[i];
  bad += std::memcmp(scale.data.host(), s.data(), scale.data.nbytes()) != 0;
  return bad;
}

nlohmann::json check(const EngineRankLayout& layout, std::vector<Param>& params, int64_t version,
                     const JobSpec& job) {
  const Version v{version, &job};
  int64_t bad = 0;
  std::string first;
  for (auto& p : params) p.data.download();
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& spec = layout.params[i];
    if (spec.scale_of >= 0) continue;  // checked with its weight
    const int64_t n = spec.quant
                          ? count_fp8_mismatches(spec, params[i],
                                                 params[static_cast<size_t>(spec.scale_param)], v)
                          : count_mismatches(params[i], spec.dtype, v);
    if (n && first.empty()) first = layout.params[i].name;
    bad += n;
  }
  return {{"version", version}, {"ok", bad == 0}, {"bad_bytes", bad}, {"first_bad_param", first}};
}

void dump(const JobSpec& job, const EngineRankLayout& layout, std::vector<Param>& params,
          int replica, int rank) {
  std::filesystem::create_directories(job.dump_dir);
  std::vector<SafetensorsWriter::Entry> entries;
  for (const auto& p : layout.params) entries.push_back({p.name, p.dtype, p.shape});
  SafetensorsWriter w(cat(job.dump_dir, "/engine", replica, "-rank", rank, ".safetensors"),
                      entries);
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].data.download();
    w.write_tensor(layout.params[i].name, params[i].data.host(), params[i].data.nbytes());
  }
  w.finish();
}

nlohmann::json outcome_json(const StepOutcome& o) {
  return {{"step", o.step},
          {"committed", o.committed},
          {"reason", o.reason},
          {"bytes", o.bytes},
          {"delta_buckets", o.delta_buckets},
          {"bytes_direct", o.bytes_direct},
          {"buckets_lent", o.buckets_lent},
          {"seconds", o.seconds},
          {"phases",
           {{"receive", o.phases.receive},
            {"verify", o.phases.verify},
            {"apply", o.phases.apply},
            {"commit", o.phases.commit}}}};
}

}  // namespace

namespace {

// Zeroed params (on GPU `gpu`, or in host memory for -1, allocated for
// receiving over `transport`), plus the reference (materialize) and coverage
// mask to check them.
std::vector<Param> make_params(const JobSpec& job, const EngineRankLayout& rl, int gpu,
                               const std::string& transport) {
  std::vector<Param> params;
  std::optional<Checkpoint> ckpt;
  if (job.verify) ckpt = Checkpoint::open(job.checkpoint);
  for (const EngineParam& p : rl.params) {
    Param q{WorkerTensor(p.dtype, p.shape, gpu, transport), nullptr, nullptr};
    // An FP8 weight's reference: the weight unquantized, in the checkpoint's dtype.
    EngineParam plain = p;
    if (p.quant && job.verify) {
      plain.quant.reset();
      plain.scale_param = -1;
      plain.dtype = ckpt->info(p.segments.front().hf_key).dtype;
      q.source = plain.dtype;
    }
    const size_t bytes =
        std::max<size_t>(static_cast<size_t>(numel(p.shape)) * itemsize(plain.dtype), 1);
    if (job.verify && p.scale_of < 0) {
      q.reference.reset(new char[bytes]());
      q.mask.reset(new char[bytes]());
      fill_param(*ckpt, plain, q.reference.get());
      fill_mask(plain, q.mask.get());
    }
    params.push_back(std::move(q));
  }
  return params;
}

// Global engine rank -> (global replica, rank inside it), group by group.
std::pair<int, int> replica_rank(const EngineLayout& layout, int global) {
  const EngineGroup& g = layout.group_of(global);
  const int in_group = global - g.first_rank;
  return {g.first_replica + in_group / g.config.tp, in_group % g.config.tp};
}

SubscriberOptions subscriber_options(const JobSpec& job, const EngineSpec& spec,
                                     const EngineLayout& layout, int global, Tracer* tracer) {
  SubscriberOptions opt;
  opt.coordinator = job.coordinator;
  opt.token = job.token;
  opt.engine = spec;
  std::tie(opt.replica, opt.rank) = replica_rank(layout, global);
  opt.trainer = TrainerLayout::load(job.trainer);
  opt.transport = worker_transport(job, "engine", global);
  opt.staging = job.staging;
  opt.connect_timeout = Millis(job.timeout_ms);
  opt.step_timeout = Millis(job.timeout_ms);
  opt.coordinator_reconnect = Millis(job.coordinator_reconnect_ms);
  opt.tracer = tracer;
  return opt;
}

// Runs steps until the last one, or until the trainers are gone; checks the
// params after every committed step. Fills stats["steps"] and ["checks"].
bool serve_steps(const JobSpec& job, Subscriber& sub, const EngineRankLayout& rl,
                 std::vector<Param>& params, nlohmann::json& stats, Clock::time_point started,
                 int replica) {
  // Elastic replicas: this replica leaves (scale in) after that step.
  const auto leave = job.leave.find(replica);
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
    // How long this process took to serve weights: from its start to the
    // end of its first committed step (a new or restarted rank catching up).
    if (o->committed && !stats.contains("first_commit_s"))
      stats["first_commit_s"] = std::chrono::duration<double>(Clock::now() - started).count();
    if (o->committed && job.verify) {
      checks.push_back(check(rl, params, o->step, job));
      ok &= checks.back()["ok"].get<bool>();
    }
    if (o->step >= job.steps) break;
    if (leave != job.leave.end() && o->step >= leave->second) {
      stats["left_after_step"] = o->step;
      break;
    }
  }
  stats["steps"] = steps;
  stats["checks"] = checks;
  return ok;
}

// The chaos soak's engine rank (demo_chaos.h): serves steps until the parent
// says stop. After every step it reports the outcome, the version and torn
// flag it holds, and its params against that version's reference (unless
// torn: then they hold part of a step by design); at the stop, the same for
// what it holds last.
void serve_chaos(const JobSpec& job, Subscriber& sub, const EngineRankLayout& rl,
                 std::vector<Param>& params, int global) {
  const std::string& dir = job.chaos_dir;
  const std::string report = chaos::report_path(dir, "engine", global);
  chaos::touch(chaos::ready_path(dir, "engine", global, ::getpid()));
  auto held = [&](nlohmann::json line) {
    line["version"] = sub.version();
    line["torn"] = sub.torn();
    line["pid"] = ::getpid();
    if (job.verify && !sub.torn()) line["check"] = check(rl, params, sub.version(), job);
    return line;
  };
  while (!std::filesystem::exists(chaos::stop_path(dir))) {
    const auto o = sub.run_step(Millis(200));
    if (o) chaos::append_line(report, held(outcome_json(*o)));
  }
  chaos::append_line(report, held({{"final", true}}));
}

}  // namespace

int run_engine_worker(const JobSpec& job, int global) {
  const auto started = Clock::now();
  const EngineSpec spec = load_engine_spec(job.engine);
  const EngineLayout layout = make_engine_layout(spec);
  const EngineRankLayout& rl = layout.rank_layout(global);
  const auto [replica, rank] = replica_rank(layout, global);
  const int trainers = static_cast<int>(TrainerLayout::load(job.trainer).mesh.world());
  std::vector<Param> params = make_params(job, rl, on_gpu(job) ? gpu_of(trainers + global) : -1,
                                          worker_transport(job, "engine", global));
  std::unique_ptr<Tracer> tracer;
  if (job.trace) tracer = std::make_unique<Tracer>(cat("engine ", global), 1000 + global);
  Subscriber sub(subscriber_options(job, spec, layout, global, tracer.get()));
  for (size_t i = 0; i < params.size(); ++i)
    sub.register_param(rl.params[i].name, params[i].data.view());
  const auto prepare_start = Clock::now();
  sub.prepare();

  nlohmann::json stats = {{"role", "engine"}, {"rank", global}, {"replica", replica}};
  // Subscriber::prepare alone: transport, plan, pipeline (ready_s adds the
  // process start and this worker's reference for its checks).
  stats["prepare_s"] = std::chrono::duration<double>(Clock::now() - prepare_start).count();
  // From the process's start to registered, params allocated, plan made and
  // the pipeline prepared.
  stats["ready_s"] = std::chrono::duration<double>(Clock::now() - started).count();
  if (job.raw_rounds > 0) {
    auto observer = observer_client(job, Millis(job.timeout_ms));
    stats["raw"] = run_raw_rounds(job, sub.plan(), *observer, "engine", global);
  }
  if (!job.chaos_dir.empty()) {
    serve_chaos(job, sub, rl, params, global);
    return 0;
  }
  bool ok = serve_steps(job, sub, rl, params, stats, started, replica);
  stats["version"] = sub.version();
  // With staging, whatever happened, the params are exactly the version held.
  if (job.verify && job.staging) {
    stats["final_check"] = check(rl, params, sub.version(), job);
    ok &= stats["final_check"]["ok"].get<bool>();
  }
  if (!job.dump_dir.empty()) dump(job, rl, params, replica, rank);
  stats["peak_rss_mb"] = peak_rss_mb();
  stats["ok"] = ok;
  std::ofstream(job.stats_path("engine", global), std::ios::trunc) << stats.dump(2);
  if (tracer) tracer->write(job.trace_path("engine", global));
  if (!ok) std::cerr << "engine rank " << global << ": params differ from the reference\n";
  return ok ? 0 : 1;
}

}  // namespace weightsync::demo
