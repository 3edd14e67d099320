// `weightsync bench plan`: plans the weight transfer of large MoE models at
// production scale and prints the planner's own time and memory next to the
// predicted transfer time and its lower bound (the reference, same run).
#include "cli.h"

#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/plan.h>

#include <nlohmann/json.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>

namespace weightsync::cli {
namespace {

namespace fs = std::filesystem;

const char* kUsage =
    "usage: weightsync bench plan [--json] [--topology X.json] [--configs DIR]\n"
    "                             [--bucket-bytes N] [--broadcast] [--dtype F8_E4M3]\n"
    "                             [--fp8] [--fp8-site sender|engine] [--case NAME]\n\n"
    "Plans, p2p, with trainer mesh ep=8,fsdp=32 (256 ranks, XTuner-style layout):\n"
    "  deepseek-v3: -> 16 vLLM replicas of tp=16 with expert parallel (256 engine ranks)\n"
    "  kimi-k2:     -> 8 vLLM replicas of tp=16 with expert parallel (128 engine ranks)\n"
    "and a Megatron-Core trainer (docs/megatron.md) of NeMo-RL's DeepSeek-V3 setup:\n"
    "  deepseek-v3-megatron: pp=16,tp=1,ep=16 (dp=16; 3 layers on the first stage, 2 on\n"
    "               the last: 256 ranks) -> the same 16 replicas of tp=16\n"
    "and prints per case: plan_s (planner wall time, one core; plan_cpu_s its CPU time),\n"
    "predicted_s and "
    "lower_bound_s of the transfer, their ratio, and the planner's peak RSS (each case\n"
    "runs in its own child process). --broadcast adds kimi-k2 in broadcast mode.\n"
    "Models come from DIR/models/<Name>/config.json (default: the configs/ shipped\n"
    "with this command, found beside it whatever the working directory).\n"
    "Topology default: 8 GPUs/node, 50 GB/s NIC per GPU.\n"
    "--dtype: the weights' dtype on both sides (default: the config's torch_dtype, BF16),\n"
    "except F8_E4M3, which is --fp8.\n"
    "--fp8 (or --dtype F8_E4M3): FP8 engines (block quantization, docs/fp8.md) fed by\n"
    "the trainer's BF16: the engines' F8_E4M3 weights and scale params, quantized by\n"
    "the trainer ranks where they hold whole 128 x 128 blocks (FP8 codes and scales on\n"
    "the wire) and by the engine ranks elsewhere (--fp8-site engine: everywhere).\n"
    "Each case then also prints the FP8 params quantized on each side and the wire\n"
    "bytes, against those of quantizing every FP8 param on the engines.\n"
    "--case NAME: only that case.\n"
    "Each case's planner CPU time is compared with the one recorded in\n"
    "tools/bench/plan_reference.json (found as the configs are; default options only):\n"
    "vs_recorded is their ratio, and a case over the file's slower_than (1.5 x) is\n"
    "reported on stderr and as \"slower_than_recorded\": true. The command still\n"
    "succeeds: a benchmark reports, it does not judge.\n";

struct BenchCase {
  std::string name, model_dir;
  int replicas = 1;
  PlanMode mode = PlanMode::p2p;
  bool megatron = false;  // else XTuner style, ep=8,fsdp=32
  bool fp8 = false;       // FP8 engines (block quantization)
  Fp8Site fp8_site = Fp8Site::sender;
};

// 256 Megatron-Core ranks as NeMo-RL trains DeepSeek-V3: pp=16, ep=16 over
// the 16 ranks of a stage (tp=1), 61 layers as 3 + 14 x 4 + 2.
TrainerLayout megatron_trainer(const HfModelConfig& hf, std::optional<DType> dtype) {
  MegatronOptions o;
  o.first_stage_layers = 3;
  o.last_stage_layers = 2;
  return make_megatron_layout(hf, parse_megatron_parallel("pp=16,tp=1,dp=16,ep=16"), o, dtype);
}

fs::path find_configs(const Args& args) {
  if (auto d = args.get("configs")) return *d;
  // Beside the command (source tree or share/weightsync), not the working directory.
  const std::string kimi = find_data("configs/models/Kimi-K2/config.json");
  if (kimi.empty())
    fail(Errc::not_found,
         "bench plan: cannot find configs/models/Kimi-K2/config.json beside this command "
         "(use --configs DIR or set WEIGHTSYNC_DATA_DIR)");
  return fs::path(kimi).parent_path().parent_path().parent_path();
}

nlohmann::json run_case(const BenchCase& c, const fs::path& configs, const Topology& topo,
                        int64_t bucket_bytes, std::optional<DType> dtype) {
  const HfModelConfig hf =
      HfModelConfig::load((configs / "models" / c.model_dir / "config.json").string());
  TrainerLayoutOptions xtuner;
  xtuner.dtype = dtype;
  const TrainerLayout trainer =
      c.megatron ? megatron_trainer(hf, dtype)
                 : make_trainer_layout(hf, parse_mesh_spec("ep=8,fsdp=32"), xtuner);
  EngineConfig ec;
  ec.hf = hf;
  ec.dtype = trainer.params.front().dtype;
  ec.tp = 16;
  ec.expert_parallel = true;
  ec.replicas = c.replicas;
  if (c.fp8) ec.quantization = BlockQuant{};
  const EngineLayout engine = make_engine_layout(ec);
  PlanOptions options;
  options.mode = c.mode;
  options.bucket_bytes = bucket_bytes;
  options.fp8_site = c.fp8_site;
  timespec c0{}, c1{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c0);
  const Plan plan = make_plan(trainer, engine, topo, options);
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &c1);
  nlohmann::json j = plan.summary_json();
  // CPU time of make_plan: wall time is inflated when other jobs share the cores.
  j["plan_cpu_s"] = static_cast<double>(c1.tv_sec - c0.tv_sec) + 1e-9 * (c1.tv_nsec - c0.tv_nsec);
  j["case"] = c.name;
  j["trainer"] = c.megatron ? "megatron pp=16,tp=1,dp=16,ep=16" : "xtuner ep=8,fsdp=32";
  j["ratio"] = plan.stats().predicted_s / plan.stats().lower_bound_s;
  j["dtype"] = std::string(dtype_name(ec.dtype));
  j["fp8_engines"] = c.fp8;
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  j["peak_rss_mib"] = static_cast<double>(ru.ru_maxrss) / 1024.0;
  return j;
}

// Runs one case in a child so that its peak RSS is its own.
nlohmann::json run_isolated(const BenchCase& c, const fs::path& configs, const Topology& topo,
                            int64_t bucket_bytes, std::optional<DType> dtype) {
  int fds[2];
  if (pipe(fds) != 0) fail(Errc::io, "bench plan: pipe failed");
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) fail(Errc::io, "bench plan: fork failed");
  if (pid == 0) {
    close(fds[0]);
    std::string out;
    try {
      out = run_case(c, configs, topo, bucket_bytes, dtype).dump();
    } catch (const std::exception& e) {
      out = nlohmann::json{{"case", c.name}, {"error", e.what()}}.dump();
    }
    for (size_t done = 0; done < out.size();) {
      const ssize_t n = write(fds[1], out.data() + done, out.size() - done);
      if (n <= 0) _exit(1);
      done += static_cast<size_t>(n);
    }
    _exit(0);
  }
  close(fds[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;)
    text.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (text.empty())
    fail(Errc::internal, "bench plan: case ", c.name, " died (status ", status, ")");
  return nlohmann::json::parse(text);
}

// The planner times recorded in the repository, so that a slower planner is
// noticed where it is measured (plans are remade whenever the fleet changes).
struct PlanReference {
  std::string path;
  nlohmann::json doc;  // null when not found
};

PlanReference load_reference() {
  PlanReference ref;
  ref.path = find_data("tools/bench/plan_reference.json");
  if (ref.path.empty()) {
    std::fprintf(stderr,
                 "bench plan: no tools/bench/plan_reference.json beside this command; "
                 "times are not compared\n");
    return ref;
  }
  std::ifstream in(ref.path);
  ref.doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (!ref.doc.is_object() || !ref.doc.contains("cases") || !ref.doc["cases"].is_object()) {
    std::fprintf(stderr, "bench plan: %s is not a reference (no \"cases\" object); ignored\n",
                 ref.path.c_str());
    ref.doc = nullptr;
  }
  return ref;
}

// Adds "recorded_s" and "vs_recorded" (CPU time: wall time counts other jobs
// on the core) and says so on stderr when the case is over the threshold.
void compare_to_reference(nlohmann::json& r, const PlanReference& ref) {
  if (ref.doc.is_null()) return;
  const nlohmann::json& cases = ref.doc["cases"];
  const std::string name = r["case"].get<std::string>();
  if (!cases.contains(name) || !cases[name].contains("plan_cpu_s")) return;
  const double recorded = cases[name]["plan_cpu_s"].get<double>();
  const double limit = ref.doc.value("slower_than", 1.5);
  const double ratio = r["plan_cpu_s"].get<double>() / recorded;
  r["recorded_s"] = recorded;
  r["vs_recorded"] = ratio;
  r["slower_than_recorded"] = ratio > limit;
  if (ratio > limit)
    std::fprintf(stderr,
                 "bench plan: %s planned in %.3f s of CPU, %.2f x the %.3f s recorded in %s "
                 "(commit %s, %s): slower than %.2f x\n",
                 name.c_str(), r["plan_cpu_s"].get<double>(), ratio, recorded, ref.path.c_str(),
                 ref.doc.value("commit", "?").c_str(), ref.doc.value("machine", "?").c_str(),
                 limit);
}

void print_case(const BenchCase& c, const nlohmann::json& r) {
  std::printf(
      "%-20s %-9s %4lld -> %4lld ranks  plan %.3f s (cpu %.3f s)  rss %6.1f MiB  "
      "buckets %6lld  predicted %.3f s  lower bound %.3f s  ratio %.4f\n",
      c.name.c_str(), r["mode"].get<std::string>().c_str(),
      static_cast<long long>(r["trainer_ranks"].get<int64_t>()),
      static_cast<long long>(r["engine_ranks"].get<int64_t>()), r["plan_s"].get<double>(),
      r["plan_cpu_s"].get<double>(), r["peak_rss_mib"].get<double>(),
      static_cast<long long>(r["buckets"].get<int64_t>()), r["predicted_s"].get<double>(),
      r["lower_bound_s"].get<double>(), r["ratio"].get<double>());
  if (r.contains("vs_recorded"))
    std::printf("%-20s cpu %.2f x the recorded %.3f s%s\n", "", r["vs_recorded"].get<double>(),
                r["recorded_s"].get<double>(),
                r["slower_than_recorded"].get<bool>() ? "  (SLOWER than recorded)" : "");
  if (r.contains("fp8")) {
    const auto& f = r["fp8"];
    std::printf(
        "%-20s FP8 params: %lld quantized by the senders, %lld by the engines; "
        "wire %.1f GB (all on the engines: %.1f GB, ratio %.3f)\n",
        "", static_cast<long long>(f["params_quantized_by_sender"].get<int64_t>()),
        static_cast<long long>(f["params_quantized_by_engine"].get<int64_t>()),
        f["wire_bytes"].get<double>() / 1e9, f["wire_bytes_engine_site"].get<double>() / 1e9,
        f["wire_bytes"].get<double>() / f["wire_bytes_engine_site"].get<double>());
  }
}

int run_bench_plan(const std::vector<std::string>& argv) {
  Args args(argv, {"json", "broadcast", "fp8"},
            {"topology", "configs", "bucket-bytes", "dtype", "fp8-site", "case"});
  std::optional<DType> dtype;
  bool fp8 = args.flag("fp8");
  if (auto d = args.get("dtype")) {
    dtype = parse_dtype(*d);
    if (!dtype) fail(Errc::invalid_argument, "--dtype: unknown dtype '", *d, "'");
    // FP8 weights come from quantizing the trainer's: FP8 engines.
    if (*dtype == DType::F8_E4M3) fp8 = true, dtype.reset();
  }
  const Fp8Site site = parse_fp8_site(args.get_or("fp8-site", "sender"));
  const fs::path configs = find_configs(args);
  const Topology topo = args.has("topology") ? Topology::load(*args.get("topology")) : Topology{};
  const int64_t bucket = args.get_int("bucket-bytes", PlanOptions{}.bucket_bytes);
  std::vector<BenchCase> cases = {{"deepseek-v3", "DeepSeek-V3", 16, PlanMode::p2p},
                                  {"deepseek-v3-megatron", "DeepSeek-V3", 16, PlanMode::p2p, true},
                                  {"kimi-k2", "Kimi-K2", 8, PlanMode::p2p}};
  if (args.flag("broadcast"))
    cases.push_back({"kimi-k2-broadcast", "Kimi-K2", 8, PlanMode::broadcast});
  for (BenchCase& c : cases) c.fp8 = fp8, c.fp8_site = site;
  if (auto only = args.get("case")) {
    std::erase_if(cases, [&](const BenchCase& c) { return c.name != *only; });
    if (cases.empty()) fail(Errc::invalid_argument, "bench plan: no case named '", *only, "'");
  }
  // The recorded times are of the default options (the cases as listed).
  const bool comparable = !args.has("topology") && !args.has("bucket-bytes") &&
                          !args.has("dtype") && !fp8 && !args.has("configs");
  const PlanReference ref = comparable ? load_reference() : PlanReference{};
  if (!comparable)
    std::fprintf(stderr,
                 "bench plan: options other than the recorded run's; times not compared "
                 "with tools/bench/plan_reference.json\n");
  nlohmann::json results = nlohmann::json::array();
  for (const BenchCase& c : cases) {
    nlohmann::json r = run_isolated(c, configs, topo, bucket, dtype);
    if (r.contains("error"))
      fail(Errc::internal, "bench plan: ", c.name, ": ", r["error"].get<std::string>());
    compare_to_reference(r, ref);
    if (!args.flag("json")) print_case(c, r);
    results.push_back(std::move(r));
  }
  if (args.flag("json"))
    std::cout
        << nlohmann::json{{"bench", "plan"}, {"topology", topo.name}, {"cases", results}}.dump()
        << "\n";
  return 0;
}

const BenchRegistrar registrar{
    {"plan", "planner time, memory and predicted transfer time at 1T-model scale", kUsage,
     run_bench_plan}};

}  // namespace
}  // namespace weightsync::cli
