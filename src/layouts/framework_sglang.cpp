// Framework "sglang": SGLang's parameters. Its loaders fuse as vLLM's do,
// under vLLM's names but one (DeepSeek's MLA q_a/kv_a fusion), and its
// flashinfer_cutlass MoE backend stores the experts' up half first
// ("moe_order": "w31").
#include "engine_framework.h"
#include "layout_rules.h"

namespace weightsync::engine {
namespace {

std::vector<EngineRankLayout> sglang_ranks(const EngineConfig& c) {
  static const Renames kRenames{
      {"self_attn.fused_qkv_a_proj.weight", "self_attn.fused_qkv_a_proj_with_mqa.weight"}};
  return rule_ranks(c, kRenames);
}

}  // namespace

extern const Framework kSglang;
const Framework kSglang{.name = "sglang", .takes_w31 = true, .ranks = sglang_ranks};

}  // namespace weightsync::engine
