// `weightsync engine-layout`: what each engine rank holds, under the engine's
// names, derived from an engine config (and checked with check_coverage).
#include "cli.h"

#include <nlohmann/json.hpp>

#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include <cstdio>
#include <iostream>

namespace weightsync::cli {
namespace {

const char* kUsage =
    "usage: weightsync engine-layout --engine E.json [--rank R] [--json]\n\n"
    "Derives the engine's parameters per rank (vLLM / SGLang weight-loader rules; \"hf\":\n"
    "every HF tensor whole) and checks that the segments cover every parameter exactly once.\n"
    "  --engine E.json  engine config (framework, hf_config, tp, expert_parallel, ...), or an\n"
    "                   array of them: groups of replicas, ranks numbered group by group\n"
    "  --rank R         only global engine rank R\n"
    "  --json           the full layout with every segment, as JSON\n"
    "Default output: per rank, each parameter's dtype, shape, segment count and bytes.\n"
    "FP8 engines: the quantization comes from the model's quantization_config (vllm,\n"
    "sglang: which modules are FP8 as that engine decides) or the engine config's\n"
    "\"quantization\"; each rank ends with \"N of M linear weights FP8, scales <format>\".\n";

void print_rank(const EngineRankLayout& rank) {
  uint64_t total = 0;
  std::printf("rank %d: %zu params\n", rank.rank, rank.params.size());
  std::printf("  %-58s %-7s %-22s %5s %14s\n", "param", "dtype", "shape", "segs", "bytes");
  for (const auto& p : rank.params) {
    const uint64_t bytes = static_cast<uint64_t>(numel(p.shape)) * itemsize(p.dtype);
    total += bytes;
    std::printf("  %-58s %-7s %-22s %5zu %14llu\n", p.name.c_str(),
                std::string(dtype_name(p.dtype)).c_str(), shape_str(p.shape).c_str(),
                p.segments.size(), static_cast<unsigned long long>(bytes));
  }
  std::printf("  total: %llu bytes (%.3f GiB)\n", static_cast<unsigned long long>(total),
              static_cast<double>(total) / (1ull << 30));
  if (const std::string fp8 = fp8_summary(rank); !fp8.empty()) std::printf("  %s\n", fp8.c_str());
}

int run(const std::vector<std::string>& argv) {
  Args args(argv, {"json"}, {"engine", "rank"});
  const EngineSpec spec = load_engine_spec(args.require("engine"));
  const EngineLayout layout = make_engine_layout(spec);
  check_coverage(layout);
  std::vector<const EngineRankLayout*> ranks;
  if (args.has("rank")) {
    const int64_t r = args.get_int("rank", 0);
    if (r < 0 || r >= layout.world())
      fail(Errc::invalid_argument, "--rank ", r, " is outside the engine's ", layout.world(),
           " ranks");
    ranks.push_back(&layout.rank_layout(static_cast<int>(r)));
  } else {
    for (const auto& r : layout.ranks) ranks.push_back(&r);
  }
  if (args.flag("json")) {
    nlohmann::json out = {{"config", spec.to_json()}, {"ranks", nlohmann::json::array()}};
    for (const auto* r : ranks) {
      nlohmann::json j = rank_layout_to_json(*r);
      if (const std::string fp8 = fp8_summary(*r); !fp8.empty()) j["fp8_summary"] = fp8;
      out["ranks"].push_back(std::move(j));
    }
    std::cout << out.dump() << "\n";
    return 0;
  }
  for (const EngineGroup& g : layout.groups) {
    const EngineConfig& c = g.config;
    std::printf("%s %s (%s): tp=%d replicas=%d expert_parallel=%s", c.framework.c_str(),
                c.hf.family.c_str(), c.hf.model_type.c_str(), c.tp, c.replicas,
                c.expert_parallel ? "on" : "off");
    if (c.expert_parallel) std::printf(" placement=%s", c.expert_placement.c_str());
    if (c.quantization)
      std::printf(" quantization=fp8 blocks %lldx%lld scale=%s (from %s)",
                  static_cast<long long>(c.quantization->block_rows),
                  static_cast<long long>(c.quantization->block_cols),
                  std::string(scale_format_name(c.quantization->scale)).c_str(),
                  fp8_source(c).c_str());
    std::printf(" moe_order=%s; engine ranks %d..%d; coverage ok\n", c.moe_order.c_str(),
                g.first_rank, g.first_rank + c.tp * c.replicas - 1);
  }
  for (const auto* r : ranks) print_rank(*r);
  return 0;
}

const CommandRegistrar registrar{
    {"engine-layout", "show an engine's per-rank parameters (vLLM/SGLang layouts)", kUsage, run}};

}  // namespace
}  // namespace weightsync::cli
