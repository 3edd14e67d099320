// `weightsync bench layout`: how fast LoadSpec geometry is at scale. Builds
// the trainer layout of a large MoE model (DeepSeek-V3 by default) on a big
// mesh, then computes local_pieces for every param on every rank, as the
// planner does. The reference, measured in the same run, is local_shape for
// the same (param, rank) pairs: the cost of walking the shards alone.
#include "cli.h"

#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>

namespace weightsync::cli {
namespace {

const char* kUsage =
    "usage: weightsync bench layout [--hf-config config.json] [--mesh ep=8,fsdp=32] [--json]\n\n"
    "Times make_trainer_layout and then local_pieces for every param on every rank\n"
    "(one core). Default model: DeepSeek-V3 (built in; --hf-config overrides).\n"
    "Reference: local_shape over the same (param, rank) pairs, in the same run.\n";

// DeepSeek-V3's config.json facts, so the benchmark runs from any directory.
nlohmann::json deepseek_v3_config() {
  return {{"architectures", {"DeepseekV3ForCausalLM"}},
          {"model_type", "deepseek_v3"},
          {"hidden_size", 7168},
          {"intermediate_size", 18432},
          {"moe_intermediate_size", 2048},
          {"n_routed_experts", 256},
          {"n_shared_experts", 1},
          {"first_k_dense_replace", 3},
          {"moe_layer_freq", 1},
          {"num_hidden_layers", 61},
          {"num_attention_heads", 128},
          {"num_key_value_heads", 128},
          {"q_lora_rank", 1536},
          {"kv_lora_rank", 512},
          {"qk_nope_head_dim", 128},
          {"qk_rope_head_dim", 64},
          {"v_head_dim", 128},
          {"vocab_size", 129280},
          {"tie_word_embeddings", false},
          {"torch_dtype", "bfloat16"}};
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run_layout_bench(const std::vector<std::string>& argv) {
  Args args(argv, {"json"}, {"hf-config", "mesh"});
  const HfModelConfig config = args.has("hf-config")
                                   ? HfModelConfig::load(*args.get("hf-config"))
                                   : HfModelConfig::from_json(deepseek_v3_config());
  const Mesh mesh = parse_mesh_spec(args.get_or("mesh", "ep=8,fsdp=32"));

  auto t0 = std::chrono::steady_clock::now();
  const TrainerLayout layout = make_trainer_layout(config, mesh);
  const double build_s = seconds_since(t0);

  t0 = std::chrono::steady_clock::now();
  int64_t pieces = 0, hf_keys = 0;
  for (int64_t rank = 0; rank < mesh.world(); ++rank)
    for (const LoadSpec& spec : layout.params) pieces += local_pieces(spec, mesh, rank).size();
  const double pieces_s = seconds_since(t0);

  t0 = std::chrono::steady_clock::now();
  int64_t elements = 0;
  for (int64_t rank = 0; rank < mesh.world(); ++rank)
    for (const LoadSpec& spec : layout.params) elements += numel(local_shape(spec, mesh, rank));
  const double shape_s = seconds_since(t0);
  for (const LoadSpec& spec : layout.params) hf_keys += spec.hf_keys.size();

  const double total_s = build_s + pieces_s;
  const double ratio = shape_s > 0 ? pieces_s / shape_s : 0.0;
  if (args.flag("json")) {
    nlohmann::json j = {{"benchmark", "layout"},
                        {"model", config.model_type},
                        {"mesh", layout.to_json()["mesh"]},
                        {"ranks", mesh.world()},
                        {"params", layout.params.size()},
                        {"hf_keys", hf_keys},
                        {"pieces", pieces},
                        {"local_elements", elements},
                        {"build_s", build_s},
                        {"pieces_s", pieces_s},
                        {"total_s", total_s},
                        {"s_per_rank", pieces_s / static_cast<double>(mesh.world())},
                        {"reference_local_shape_s", shape_s},
                        {"pieces_vs_reference", ratio}};
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf("layout bench: %s, mesh %s (%lld ranks), %zu params, %lld hf keys\n",
              config.model_type.c_str(), args.get_or("mesh", "ep=8,fsdp=32").c_str(),
              static_cast<long long>(mesh.world()), layout.params.size(),
              static_cast<long long>(hf_keys));
  std::printf("  make_trainer_layout        %.4f s\n", build_s);
  std::printf("  local_pieces, all ranks    %.4f s  (%lld pieces, %.2e s per rank)\n", pieces_s,
              static_cast<long long>(pieces), pieces_s / static_cast<double>(mesh.world()));
  std::printf("  total                      %.4f s\n", total_s);
  std::printf("  reference: local_shape     %.4f s  (local_pieces / local_shape = %.2fx)\n",
              shape_s, ratio);
  return 0;
}

const BenchRegistrar registrar{{"layout",
                                "LoadSpec geometry at scale: layout + local_pieces on every rank",
                                kUsage, run_layout_bench}};

}  // namespace
}  // namespace weightsync::cli
