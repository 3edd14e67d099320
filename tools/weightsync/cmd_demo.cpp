// `weightsync demo`: a complete sync job on this machine, every rank its own
// process, over the real transport. Without arguments: the embedded
// Qwen3-MoE-shaped model. With --checkpoint/--trainer/--engine: the given
// files (DESIGN.md contract), optionally dumping every engine rank's params.
#include "cli.h"
#include "demo_chaos.h"
#include "demo_device.h"
#include "demo_run.h"
#include "demo_setup.h"

#include <nlohmann/json.hpp>

#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/load_spec.h>
#include <weightsync/plan.h>
#include <weightsync/topology.h>
#include "pipeline/wire.h"

#include <charconv>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

namespace weightsync::cli {
namespace {

constexpr const char* kUsage =
    "usage: weightsync demo [options]\n\n"
    "Syncs K versions of a checkpoint from trainer processes into engine processes\n"
    "over the transport, then checks every engine rank's params bit for bit.\n"
    "Versions before K differ from the checkpoint in every tensor (every byte\n"
    "XOR-ed with a per-version pattern); version K is the checkpoint itself.\n\n"
    "Without --checkpoint: an embedded Qwen3-MoE-shaped model (random weights,\n"
    "written to a temporary .safetensors file), 4 trainer ranks (ep=2 x fsdp=2),\n"
    "2 vLLM-layout engine replicas of tp=2 (expert parallel off), 3 steps.\n\n"
    "options:\n"
    "  --checkpoint C       .safetensors file or HF directory (with --trainer, --engine)\n"
    "  --trainer T.json     trainer layout\n"
    "  --engine E.json      engine config\n"
    "  --steps K            versions to sync (default 3)\n"
    "  --mode p2p|broadcast (default p2p)\n"
    "  --fp8-site sender|engine  FP8 engine configs: quantize on the trainer ranks\n"
    "                       where they hold whole 128 x 128 blocks (default; FP8 on\n"
    "                       the wire, p2p only) or always on the engine ranks\n"
    "  --dump DIR           each engine rank writes DIR/engine<e>-rank<r>.safetensors\n"
    "                       after the last step (its params under the engine's names)\n"
    "  --device cpu|cuda    where every rank's tensors live (default cpu); with cuda\n"
    "                       in GPU memory, rank r of the transport world on GPU r\n"
    "                       modulo the GPUs here (all on GPU 0 of a one-GPU machine)\n"
    "  --transport NAME     ucx (default; cuda_ipc with --device cuda), nccl,\n"
    "                       ipc_host (cuda_ipc's protocol over host memory the\n"
    "                       processes map: its stand-in without a GPU), or a\n"
    "                       wrapper like fault:ucx?...\n"
    "  --bucket-bytes N     bucket size (default 268435456)\n"
    "  --timeout S          seconds per step, and for setup (default 120)\n"
    "  --trace F            write a Chrome trace (Perfetto) of every process's phases\n"
    "  --staging            engines apply into a copy swapped in at commit\n"
    "  --no-checksums       skip the per-bucket checksums (on by default: a bucket\n"
    "                       that does not arrive as sent fails its engine's step)\n"
    "  --checksums          verify the buckets of CUDA tensors too (by default their\n"
    "                       device paths go unchecked; this stages them through\n"
    "                       pinned host memory, WireOptions::checksums_gpu)\n"
    "  --no-lend            buckets travel as fragments even where the transport maps\n"
    "                       the engines' memory (cuda_ipc, ipc_host)\n"
    "  --delta              delta sync (PublisherOptions::delta auto, docs/delta.md);\n"
    "                       the versions then differ as --update says\n"
    "  --update random:F    sparse versions: each differs from the next in about a\n"
    "                       fraction F of the elements (their lowest bit; default\n"
    "                       0.02 with --delta); version K is still the checkpoint\n"
    "  --no-verify          skip the per-step bit-exact checks\n"
    "  --json               print the summary as one JSON object\n"
    "  --summary F          also write the summary JSON to F\n"
    "  --work-dir D         logs, stats and job files here (default: a temp dir)\n"
    "  --kill ROLE:RANK:STEP   kill that rank (trainer rank or global engine rank)\n"
    "                       halfway through STEP's transfers (failure drills)\n"
    "  --restart            with --kill engine:...: start that engine again at once;\n"
    "                       the new process rejoins at a later step\n"
    "  --step-gap S         trainers pause S seconds between steps, as training would\n"
    "                       (default 0; 1 with --restart)\n"
    "  --engine-transport G:NAME  engine rank G uses transport NAME (e.g. a fault\n"
    "                       wrapper corrupting what it receives)\n"
    "  --elastic            elastic replicas: the engine config's replicas are slots\n"
    "                       that replicas join and leave between steps; each step\n"
    "                       serves the replicas ready when it begins (its own plan)\n"
    "  --min-replicas N     elastic: a step waits for N ready replicas (default 1)\n"
    "  --join R:STEP[,...]  elastic: replica R's processes start once the step\n"
    "                       before STEP was decided (scale out)\n"
    "  --leave R:STEP[,...] elastic: replica R's processes leave after STEP (scale in)\n"
    "  --chaos SEED         chaos soak: one fault (or none) per step from a schedule\n"
    "                       drawn from SEED (printed first): SIGKILL a trainer, an\n"
    "                       engine or the coordinator (each its own process; a new\n"
    "                       one takes over), a bucket corrupted or truncated (fault\n"
    "                       transport), a rank stalled (SIGSTOP); checks after every\n"
    "                       step that every rank reporting version k holds k bit for\n"
    "                       bit, no rank serves a mix, no step outlives its bound,\n"
    "                       every failure is in status and the metrics with its\n"
    "                       reason; at the end every live rank holds the last\n"
    "                       committed version. Prints a table (--json: in \"table\").\n"
    "                       Default 20 steps, --timeout 10. Not with --kill,\n"
    "                       --restart, --elastic, --delta, --update, --dump, --trace,\n"
    "                       --engine-transport, --no-verify, broadcast or cuda\n"
    "  --schedule-only      with --chaos: print the schedule (JSON with --json), run nothing\n\n"
    "Exit code 0 only if every engine rank committed every step and matched the\n"
    "reference after each one (elastic: every rank of each step's replicas, and\n"
    "every replica that joined served).\n";

int parse_int(const std::string& text, const char* option) {
  int v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size())
    fail(Errc::invalid_argument, option, " expects an integer, got '", text, "'");
  return v;
}

// Operations of kind `op` that `role` rank posts per step, from the plan.
int64_t ops_per_step(const Plan& plan, const std::string& role, int rank, const WireOptions& wire) {
  if (plan.mode() == PlanMode::p2p) {
    int64_t n = 0;
    for (int32_t b : role == "engine" ? plan.buckets_received_by(rank) : plan.buckets_sent_by(rank))
      n += bucket_messages(plan, b, wire);
    return n;
  }
  // Broadcast: with delta sync, a whole bucket is a header, then the bucket.
  const int64_t per_bucket = wire.delta ? 2 : 1;
  if (role == "engine")
    return per_bucket * static_cast<int64_t>(plan.buckets_received_by(rank).size());
  const auto roots = static_cast<int64_t>(plan.buckets_sent_by(rank).size());
  int64_t holder = 0;
  for (int32_t b : plan.buckets_gathered_from(rank))
    holder += plan.buckets()[static_cast<size_t>(b)].src_rank != rank;
  return per_bucket * roots * plan.engine_world() + holder;
}

demo::KillSpec parse_kill(const std::string& spec, const demo::JobSpec& job) {
  const auto a = spec.find(':'), b = spec.rfind(':');
  if (a == std::string::npos || a == b)
    fail(Errc::invalid_argument, "--kill expects ROLE:RANK:STEP, got '", spec, "'");
  demo::KillSpec k;
  k.role = spec.substr(0, a);
  if (k.role != "trainer" && k.role != "engine")
    fail(Errc::invalid_argument, "--kill: role must be trainer or engine, got '", k.role, "'");
  k.rank = parse_int(spec.substr(a + 1, b - a - 1), "--kill RANK");
  const int step = parse_int(spec.substr(b + 1), "--kill STEP");
  if (step < 1 || step > job.steps)
    fail(Errc::invalid_argument, "--kill: step ", step, " is not among steps 1..", job.steps);
  PlanOptions po;
  po.mode = parse_plan_mode(job.mode);
  po.bucket_bytes = job.bucket_bytes;
  po.fp8_site = parse_fp8_site(job.fp8_site);
  po.same_buckets_per_replica = job.delta;  // as the publisher plans
  const Plan plan = make_plan(TrainerLayout::load(job.trainer),
                              make_engine_layout(load_engine_spec(job.engine)), Topology{}, po);
  WireOptions wire;
  wire.checksums = job.checksums;
  wire.delta = job.delta;
  const int64_t n = ops_per_step(plan, k.role, k.rank, wire);
  k.op = k.role == "engine" ? "recv" : "send";
  k.after = (step - 1) * n + n / 2 + 1;
  if (job.delta && step > 1) {
    // Step 1 goes whole; a later bucket is one message as a delta (to each
    // engine rank, broadcast), more when it goes whole. Counted as deltas,
    // so that a kill at step 2 lands in step 2 (at a later step K: in step
    // K or, after whole steps, before).
    WireOptions as_delta = wire;
    as_delta.delta = false;  // what ops_per_step counts for one message a bucket
    const int64_t per_step =
        plan.mode() == PlanMode::p2p
            ? static_cast<int64_t>((k.role == "engine" ? plan.buckets_received_by(k.rank)
                                                       : plan.buckets_sent_by(k.rank))
                                       .size())
            : ops_per_step(plan, k.role, k.rank, as_delta);
    k.after = n + (step - 2) * per_step + per_step / 2 + 1;
  }
  return k;
}

void describe_default(std::ostream& out, const demo::ModelFiles& m, const demo::JobSpec& job) {
  out << "weightsync demo: " << m.family << " model, " << m.tensors << " tensors, " << m.bytes / 1e6
      << " MB (BF16, random weights)\n"
      << "  trainers: 4 ranks, mesh ep=2 x fsdp=2 (one process each)\n"
      << "  engines:  2 vLLM-layout replicas x tp=2, expert parallel off (one process each)\n"
      << "  " << job.mode << " over " << job.transport << " (tensors in "
      << (job.device == "cuda" ? "GPU" : "host") << " memory), bucket " << job.bucket_bytes
      << " bytes, " << job.steps << " steps; checking every engine rank bit-exactly after "
      << "each step\n";
}

// The job the options describe; writes the embedded model when no
// --checkpoint is given (returned in `model`).
demo::JobSpec job_from_args(const Args& args, std::optional<demo::ModelFiles>& model) {
  demo::JobSpec job;
  job.steps = static_cast<int>(args.get_int("steps", 3));
  if (job.steps < 1) fail(Errc::invalid_argument, "--steps must be at least 1");
  job.mode = args.get_or("mode", "p2p");
  parse_plan_mode(job.mode);
  job.device = args.get_or("device", "cpu");
  demo::check_device(job.device, "--device");
  job.transport = args.get_or("transport", job.device == "cuda" ? "cuda_ipc" : "ucx");
  job.bucket_bytes = args.get_int("bucket-bytes", int64_t{256} << 20);
  job.fp8_site = args.get_or("fp8-site", "sender");
  parse_fp8_site(job.fp8_site);
  job.timeout_ms = static_cast<int64_t>(args.get_double("timeout", 120) * 1000);
  job.staging = args.flag("staging");
  job.checksums = !args.flag("no-checksums");
  job.checksums_gpu = args.flag("checksums");
  if (args.flag("checksums") && args.flag("no-checksums"))
    fail(Errc::invalid_argument, "--checksums and --no-checksums: pick one");
  job.lend = !args.flag("no-lend");
  job.delta = args.flag("delta");
  if (auto u = args.get("update"))
    job.update_fraction = demo::parse_update_fraction(*u, "--update");
  else if (job.delta)
    job.update_fraction = 0.02;
  job.verify = !args.flag("no-verify");
  job.dump_dir = args.get_or("dump", "");
  job.trace = args.has("trace");
  job.work_dir = args.has("work-dir") ? args.require("work-dir") : demo::make_temp_dir("demo");
  std::filesystem::create_directories(job.work_dir);
  if (args.has("checkpoint")) {
    job.checkpoint = std::filesystem::absolute(args.require("checkpoint")).string();
    job.trainer = std::filesystem::absolute(args.require("trainer")).string();
    job.engine = std::filesystem::absolute(args.require("engine")).string();
  } else {
    if (args.has("trainer") || args.has("engine"))
      fail(Errc::invalid_argument, "--trainer and --engine need --checkpoint");
    demo::ModelSetup setup;
    setup.hf_config = demo::demo_model_config();
    model = demo::write_model(job.work_dir, setup);
    job.checkpoint = model->checkpoint;
    job.trainer = model->trainer;
    job.engine = model->engine;
  }
  if (auto et = args.get("engine-transport")) {
    const auto colon = et->find(':');
    if (colon == std::string::npos)
      fail(Errc::invalid_argument, "--engine-transport expects G:NAME, got '", *et, "'");
    const auto g = static_cast<size_t>(parse_int(et->substr(0, colon), "--engine-transport G"));
    job.engine_transport.resize(g + 1);
    job.engine_transport[g] = et->substr(colon + 1);
  }
  if (auto k = args.get("kill")) job.kill = parse_kill(*k, job);
  job.restart_killed = args.flag("restart");
  // A restarted engine needs a moment to start and register: by default the
  // trainers then pace their steps as a training loop would.
  job.step_gap_ms =
      static_cast<int64_t>(args.get_double("step-gap", job.restart_killed ? 1.0 : 0.0) * 1000);
  if (job.step_gap_ms < 0) fail(Errc::invalid_argument, "--step-gap must be >= 0");
  if (job.restart_killed && job.kill.role != "engine")
    fail(Errc::invalid_argument, "--restart needs --kill engine:RANK:STEP");
  job.elastic = args.flag("elastic");
  job.min_replicas = static_cast<int>(args.get_int("min-replicas", 1));
  const int slots = make_engine_layout(load_engine_spec(job.engine)).num_replicas();
  auto replica_steps = [&](const char* option, std::map<int, int>& out) {
    const auto text = args.get(option);
    if (!text) return;
    if (!job.elastic) fail(Errc::invalid_argument, "--", option, " needs --elastic");
    std::stringstream list(*text);
    for (std::string item; std::getline(list, item, ',');) {
      const auto colon = item.find(':');
      if (colon == std::string::npos)
        fail(Errc::invalid_argument, "--", option, " expects R:STEP[,R:STEP...], got '", *text,
             "'");
      const int r = parse_int(item.substr(0, colon), "replica");
      const int step = parse_int(item.substr(colon + 1), "step");
      if (r < 0 || r >= slots || step < 2 || step > job.steps)
        fail(Errc::invalid_argument, "--", option, " ", item, ": replica must be in 0..", slots - 1,
             " and step in 2..", job.steps);
      out[r] = step;
    }
  };
  replica_steps("join", job.join);
  replica_steps("leave", job.leave);
  if (job.elastic && (job.min_replicas < 1 || job.min_replicas > slots))
    fail(Errc::invalid_argument, "--min-replicas must be in 1..", slots, " (the replica slots)");
  return job;
}

// `--chaos SEED`: the soak of demo_chaos.h on the job the other options describe.
int run_chaos(const Args& args) {
  const std::string seed_text = args.require("chaos");
  const int seed_int = parse_int(seed_text, "--chaos");
  if (seed_int < 0) fail(Errc::invalid_argument, "--chaos SEED must be >= 0");
  const auto seed = static_cast<uint64_t>(seed_int);
  for (const char* o : {"kill", "join", "leave", "min-replicas", "update", "dump", "trace",
                        "engine-transport", "step-gap"})
    if (args.has(o))
      fail(Errc::invalid_argument, "--chaos decides the faults itself: it does not take --", o);
  for (const char* o : {"restart", "elastic", "delta", "no-verify"})
    if (args.flag(o))
      fail(Errc::invalid_argument, "--chaos decides the faults itself: it does not take --", o);
  if (args.get_or("mode", "p2p") != "p2p")
    fail(Errc::invalid_argument, "--chaos runs p2p only (its faults target p2p buckets)");
  if (args.get_or("device", "cpu") != "cpu")
    fail(Errc::invalid_argument, "--chaos runs with --device cpu only");
  std::optional<demo::ModelFiles> model;
  demo::JobSpec job = job_from_args(args, model);
  if (!args.has("steps")) job.steps = 20;
  if (job.steps > 0x7FFF) fail(Errc::invalid_argument, "--chaos: at most 32767 steps");
  if (!args.has("timeout")) job.timeout_ms = 10000;
  const bool json = args.flag("json");
  nlohmann::json summary;
  if (args.flag("schedule-only")) {
    // The same targets the soak draws from (the plan's buckets per rank).
    summary = {{"seed", seed}, {"steps", job.steps}};
    summary["schedule"] = demo::chaos::schedule_json(
        demo::chaos::make_schedule(seed, job.steps, demo::chaos::targets_of(job)));
    if (json) {
      std::cout << summary.dump() << "\n";
    } else {
      for (const auto& f : summary["schedule"])
        if (f["fault"] != "none")
          std::cout << "step " << f["step"].get<int>() << ": " << f["what"].get<std::string>()
                    << "\n";
    }
    if (!args.has("work-dir")) std::filesystem::remove_all(job.work_dir);
    return 0;
  }
  if (!json) {
    if (model) describe_default(std::cout, *model, job);
    std::cout << "chaos soak: seed " << seed << ", " << job.steps << " steps, step timeout "
              << job.timeout_ms / 1000.0 << " s" << (job.staging ? ", staging" : "") << "\n"
              << std::flush;
  }
  summary = demo::chaos::run_soak(job, seed, json);
  if (auto f = args.get("summary")) std::ofstream(*f, std::ios::trunc) << summary.dump(2);
  const bool ok = summary["ok"].get<bool>();
  if (json) {
    std::cout << summary.dump() << "\n";
  } else {
    demo::chaos::print_table(std::cout, summary);
    std::cout << (ok ? std::string("OK: every invariant held after every step\n")
                     : "FAILED (logs in " + job.work_dir + ")\n");
  }
  if (ok && !args.has("work-dir")) std::filesystem::remove_all(job.work_dir);
  return ok ? 0 : 1;
}

int run_demo(const std::vector<std::string>& argv) {
  Args args(argv,
            {"staging", "checksums", "no-checksums", "no-lend", "restart", "no-verify", "json",
             "elastic", "delta", "schedule-only"},
            {"checkpoint", "trainer",
             "engine",     "steps",
             "mode",       "dump",
             "transport",  "bucket-bytes",
             "timeout",    "trace",
             "summary",    "work-dir",
             "kill",       "engine-transport",
             "step-gap",   "device",
             "fp8-site",   "min-replicas",
             "join",       "leave",
             "update",     "chaos"});
  if (args.has("chaos")) return run_chaos(args);
  if (args.flag("schedule-only")) fail(Errc::invalid_argument, "--schedule-only needs --chaos");
  std::optional<demo::ModelFiles> model;
  const demo::JobSpec job = job_from_args(args, model);
  if (!args.flag("json")) {
    if (model)
      describe_default(std::cout, *model, job);
    else
      std::cout << "weightsync demo: " << job.checkpoint << ", " << job.steps << " steps, "
                << job.mode << " over " << job.transport << "\n";
    std::cout.flush();
  }
  const auto run = demo::run_job(job, args.get_or("trace", ""));
  auto summary = demo::summarize(job, run);
  summary["work_dir"] = job.work_dir;
  if (auto f = args.get("summary")) std::ofstream(*f, std::ios::trunc) << summary.dump(2);
  if (args.flag("json")) {
    std::cout << summary.dump() << "\n";
  } else {
    demo::print_summary(std::cout, summary);
    if (job.trace) std::cout << "trace: " << args.require("trace") << "\n";
    if (!job.dump_dir.empty()) std::cout << "dumped engine params to " << job.dump_dir << "\n";
    const char* good =
        !job.verify   ? (job.elastic ? "OK: every rank of each step's replicas committed it (not "
                                       "checked: --no-verify); every replica that joined served\n"
                                     : "OK: every engine rank committed every step (not checked: "
                                       "--no-verify)\n")
        : job.elastic ? "OK: every rank of each step's replicas committed it and matched the "
                        "reference bit for bit; every replica that joined served\n"
                      : "OK: every engine rank committed every step and matched the reference "
                        "bit for bit\n";
    std::cout << (summary["ok"].get<bool>() ? std::string(good)
                                            : "FAILED (logs in " + job.work_dir + ")\n");
  }
  const bool ok = summary["ok"].get<bool>();
  if (ok && !args.has("work-dir")) std::filesystem::remove_all(job.work_dir);
  return ok ? 0 : 1;
}

const CommandRegistrar registrar{
    {"demo", "sync a model from trainer processes into engine processes, check bit-exactly", kUsage,
     run_demo}};

}  // namespace
}  // namespace weightsync::cli
