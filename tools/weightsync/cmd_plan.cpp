// `weightsync plan`: the transfer plan from a trainer layout to an engine
// config, with its bytes per link, buckets and predicted time.
#include "cli.h"

#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/plan.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <sstream>

namespace weightsync::cli {
namespace {

const char* kUsage =
    "usage: weightsync plan --trainer T.json --engine E.json [--topology X.json]\n"
    "                       [--mode p2p|broadcast] [--bucket-bytes N] [--json] [--items]\n"
    "                       [--fp8-site sender|engine] [--replicas R,R,...]\n"
    "                       [--verify]\n\n"
    "Plans moving the trainer's weights (layout T.json) into every rank of the engine\n"
    "(config E.json): which trainer rank sends which HF boxes to which engine rank, in\n"
    "buckets of at most N bytes (default 268435456), in schedule order.\n\n"
    "  --topology  nodes, NICs and link speeds (configs/topologies/*.json); default:\n"
    "              8 GPUs per node, one 50 GB/s NIC per GPU, 450 GB/s NVLink, trainer and\n"
    "              engines on separate nodes.\n"
    "  --mode      p2p (default): each engine rank receives exactly its params' bytes;\n"
    "              broadcast: buckets of whole HF tensors gathered at a rotating root\n"
    "              trainer rank and broadcast to every engine rank.\n"
    "  --fp8-site  FP8 engine configs: quantize on the trainer ranks where they hold\n"
    "              whole 128 x 128 blocks (sender, default; FP8 on the wire, p2p only)\n"
    "              or on the engine ranks (engine). The summary's \"fp8\" object gives\n"
    "              the params quantized on each side and the wire bytes in both forms.\n"
    "  --replicas  elastic replicas (docs/elastic.md): plan for these global replica\n"
    "              indices only (the step's membership); the others receive nothing,\n"
    "              and the plan id is that membership's.\n"
    "  --json      print one JSON object: plan_id, mode, bytes_total,\n"
    "              bytes_per_engine_rank {min,max}, bytes_per_trainer_rank {min,max},\n"
    "              buckets, predicted_s, lower_bound_s, plan_s, ...\n"
    "  --items     print every copy item as one JSON object per line (the summary then\n"
    "              goes to stderr).\n"
    "  --verify    check the plan independently (exact cover, bytes per rank, buckets);\n"
    "              exit 1 with the reason if it fails.\n";

std::string gib(int64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f GiB", static_cast<double>(bytes) / (1 << 30));
  return buf;
}

void print_summary(std::ostream& out, const Plan& plan, const nlohmann::json& j) {
  const auto& st = plan.stats();
  out << "plan " << plan.plan_id_hex() << " (" << plan_mode_name(plan.mode())
      << "): " << plan.trainer_world() << " trainer ranks -> " << plan.engine_world()
      << " engine ranks\n"
      << "  bytes total          " << gib(st.bytes_total) << "\n"
      << "  per engine rank      " << gib(j["bytes_per_engine_rank"]["min"].get<int64_t>())
      << " .. " << gib(j["bytes_per_engine_rank"]["max"].get<int64_t>()) << "\n"
      << "  per trainer rank     " << gib(j["bytes_per_trainer_rank"]["min"].get<int64_t>())
      << " .. " << gib(j["bytes_per_trainer_rank"]["max"].get<int64_t>()) << "\n"
      << "  buckets              " << plan.buckets().size() << " (at most "
      << plan.options().bucket_bytes << " bytes), " << j["items"].get<int64_t>() << " items\n"
      << "  predicted            " << st.predicted_s << " s (lower bound " << st.lower_bound_s
      << " s, ratio " << (st.lower_bound_s > 0 ? st.predicted_s / st.lower_bound_s : 0) << ")\n"
      << "  planned in           " << st.plan_s << " s\n";
  if (j.contains("fp8"))
    out << "  FP8 params           " << st.fp8_params_sender << " quantized by the senders, "
        << st.fp8_params_engine << " by the engines; on the wire " << gib(st.bytes_total)
        << " (all on the engines: " << gib(st.bytes_total_engine_site) << ")\n";
  if (j.contains("verified")) out << "  verified             exact cover, bytes per rank\n";
}

int run_plan(const std::vector<std::string>& argv) {
  Args args(argv, {"json", "items", "verify"},
            {"trainer", "engine", "topology", "mode", "bucket-bytes", "fp8-site", "replicas"});
  if (!args.positional().empty())
    fail(Errc::invalid_argument, "plan: unexpected argument '", args.positional()[0], "'");
  if (args.flag("items") && args.flag("json"))
    fail(Errc::invalid_argument,
         "plan: --items (JSON lines) and --json (one object) both want stdout; use one");
  const TrainerLayout trainer = TrainerLayout::load(args.require("trainer"));
  const EngineLayout engine = make_engine_layout(load_engine_spec(args.require("engine")));
  const Topology topology =
      args.has("topology") ? Topology::load(*args.get("topology")) : Topology{};
  PlanOptions options;
  options.mode = parse_plan_mode(args.get_or("mode", "p2p"));
  options.bucket_bytes = args.get_int("bucket-bytes", options.bucket_bytes);
  options.fp8_site = parse_fp8_site(args.get_or("fp8-site", "sender"));
  if (auto list = args.get("replicas")) {
    std::stringstream in(*list);
    for (std::string r; std::getline(in, r, ',');) {
      try {
        size_t used = 0;
        options.replicas.push_back(std::stoi(r, &used));
        if (used != r.size()) throw std::invalid_argument(r);
      } catch (const std::exception&) {
        fail(Errc::invalid_argument, "--replicas expects integers R,R,..., got '", *list, "'");
      }
    }
  }
  const Plan plan = make_plan(trainer, engine, topology, options);
  nlohmann::json j = plan.summary_json();
  j["topology"] = topology.name;
  if (args.flag("verify")) {
    verify_plan(plan, trainer, engine);
    j["verified"] = true;
  }
  if (args.flag("items")) plan.write_items_jsonl(std::cout);
  std::ostream& out = args.flag("items") ? std::cerr : std::cout;
  if (args.flag("json"))
    out << j.dump() << "\n";
  else
    print_summary(out, plan, j);
  return 0;
}

const CommandRegistrar registrar{
    {"plan", "plan a weight transfer (bytes per link, buckets, predicted time)", kUsage, run_plan}};

}  // namespace
}  // namespace weightsync::cli
