// Framework "vllm": the parameters vLLM's weight loaders fill, as the name
// tables of layout_rules.cpp give them (they use vLLM's names). With an FP8
// quantization_config in the model's config, the FP8 modules are those vLLM
// 0.32 builds with its Fp8Config (fp8_checkpoint.h): every LinearBase and
// RoutedExperts module constructed with the quant config (the *_proj
// linears, the fused experts, and Qwen3-MoE's router GateLinear, which
// qwen3_moe.py passes quant_config), less those is_layer_skipped leaves
// unquantized, matched "exact" against packed_modules_mapping of the model
// class. The models' hf_to_vllm_mapper hold stacked renames only, which
// get_rename_mapper drops: the ignored names are used as written.
#include "engine_framework.h"
#include "layout_rules.h"

namespace weightsync::engine {
namespace {

constexpr std::string_view kEngine = "vLLM 0.32";

bool vllm_extra(const HfModelConfig& hf, std::string_view module) {
  constexpr std::string_view kRouter = ".mlp.gate";
  return hf.family == "qwen3_moe" && module.size() > kRouter.size() &&
         module.substr(module.size() - kRouter.size()) == kRouter;
}

// packed_modules_mapping of each model class as its __init__ leaves it.
FusedModules vllm_fused(const HfModelConfig& hf) {
  const std::vector<std::string> qkv{"q_proj", "k_proj", "v_proj"};
  const std::vector<std::string> gate_up{"gate_proj", "up_proj"};
  const std::string& f = hf.family;
  if (f == "deepseek_v3") {
    FusedModules m{{"gate_up_proj", gate_up}};
    // fuse_qkv_a_proj: q_lora_rank present (use_mha needs no MLA dims).
    if (hf.q_lora_rank > 0) m["fused_qkv_a_proj"] = {"q_a_proj", "kv_a_proj_with_mqa"};
    return m;
  }
  FusedModules m{{"qkv_proj", qkv}};
  if (f == "mixtral") return m;
  if (f == "qwen3_moe") {
    if (!hf.mlp_only_layers.empty()) m["gate_up_proj"] = gate_up;
    return m;
  }
  if (f == "qwen2_moe") {
    if (!hf.mlp_only_layers.empty() || hf.shared_expert_intermediate_size > 0)
      m["gate_up_proj"] = gate_up;
    return m;
  }
  m["gate_up_proj"] = gate_up;  // llama, qwen2, qwen3
  return m;
}

bool vllm_skipped(const std::string& module, const CheckpointFp8& ckpt, const FusedModules& fused) {
  return vllm_layer_skipped(module, vllm_ignored(ckpt), fused, MatchMode::exact, kEngine);
}

const Fp8Selection kVllmFp8{kEngine, vllm_extra, vllm_fused, vllm_skipped};

std::vector<EngineRankLayout> vllm_ranks(const EngineConfig& c) {
  return rule_ranks(c, {}, &kVllmFp8);
}

}  // namespace

extern const Framework kVllm;
const Framework kVllm{.name = "vllm", .fp8 = &kVllmFp8, .ranks = vllm_ranks};

}  // namespace weightsync::engine
