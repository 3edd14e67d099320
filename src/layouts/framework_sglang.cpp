// Framework "sglang": SGLang's parameters. Its loaders fuse as vLLM's do,
// under vLLM's names but one (DeepSeek's MLA q_a/kv_a fusion), and its
// flashinfer_cutlass MoE backend stores the experts' up half first
// ("moe_order": "w31"). With an FP8 quantization_config in the model's
// config, the FP8 modules are those SGLang 0.5.23 builds with its Fp8Config
// (fp8_checkpoint.h): the *_proj linears and the fused experts (its routers
// take no quant config: Qwen3-MoE's gate is built without it, DeepSeek's
// MoEGate is a plain parameter), less those its is_layer_skipped leaves
// unquantized, with the model class's packed_modules_mapping (DeepSeek's
// fused_qkv_a_proj_with_mqa; qkv_proj and gate_up_proj from SGLang's fallback
// table elsewhere).
#include "engine_framework.h"
#include "layout_rules.h"

namespace weightsync::engine {
namespace {

constexpr std::string_view kEngine = "SGLang 0.5.23";

FusedModules sglang_fused(const HfModelConfig& hf) {
  FusedModules m;
  if (hf.family == "deepseek_v3" && hf.q_lora_rank > 0)
    m["fused_qkv_a_proj_with_mqa"] = {"q_a_proj", "kv_a_proj_with_mqa"};
  if (hf.family == "qwen3_moe") {
    m["qkv_proj"] = {"q_proj", "k_proj", "v_proj"};
    m["gate_up_proj"] = {"gate_proj", "up_proj"};
  }
  return m;
}

bool sglang_skipped(const std::string& module, const CheckpointFp8& ckpt,
                    const FusedModules& fused) {
  return sglang_layer_skipped(module, sglang_ignored(ckpt), fused, kEngine);
}

const Fp8Selection kSglangFp8{kEngine, nullptr, sglang_fused, sglang_skipped};

std::vector<EngineRankLayout> sglang_ranks(const EngineConfig& c) {
  static const Renames kRenames{
      {"self_attn.fused_qkv_a_proj.weight", "self_attn.fused_qkv_a_proj_with_mqa.weight"}};
  return rule_ranks(c, kRenames, &kSglangFp8);
}

}  // namespace

extern const Framework kSglang;
const Framework kSglang{
    .name = "sglang", .takes_w31 = true, .fp8 = &kSglangFp8, .ranks = sglang_ranks};

}  // namespace weightsync::engine
