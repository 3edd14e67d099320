// The name tables of the engines' weight loaders: which HF tensors make which
// engine parameter, and how each is split. Facts (vLLM first, SGLang next):
// - vLLM stacks q/k/v into qkv_proj and gate/up into gate_up_proj
//   (stacked_params_mapping in models/llama.py, qwen2.py, ...), keeps norms,
//   routers and q_norm/k_norm replicated, and fuses routed experts into
//   experts.w13_weight / experts.w2_weight (FusedMoE.make_expert_params_mapping).
// - MLA with q_lora_rank: vLLM merges q_a_proj and kv_a_proj_with_mqa into
//   fused_qkv_a_proj (replicated); SGLang names the same fusion
//   fused_qkv_a_proj_with_mqa (framework_sglang.cpp renames it).
// - DeepSeek's shared experts: vLLM's default keeps them a separate
//   DeepseekV2MLP module (mlp.shared_experts.gate_up_proj / down_proj, tensor
//   parallel); only ROCm AITER's shared-expert fusion folds them into the
//   fused experts. SGLang's default is the same separate module.
// - Qwen2-MoE: shared_expert is a gate_up/down MLP, shared_expert_gate a
//   replicated [1, H] linear.
// - vLLM allocates DeepSeek's gate.e_score_correction_bias in float32; here
//   every parameter takes the engine config's dtype (checkpoint dtype, no
//   conversion), so a sync moves that bias in the checkpoint's dtype.
// Adding an architecture: add its HF names to these tables.
#include "layout_rules.h"

#include <weightsync/error.h>

#include <algorithm>
#include <array>
#include <set>

namespace weightsync::engine {
namespace {

// Several HF tensors of one layer fused into one engine parameter (named as
// vLLM names it; a framework renames it through its Renames).
struct FusedRule {
  std::string_view param;
  Split split;
  std::array<std::string_view, 3> keys;  // "" for unused entries
};

constexpr std::array<FusedRule, 6> kFused{{
    {"self_attn.qkv_proj.weight",
     Split::qkv,
     {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"}},
    {"self_attn.qkv_proj.bias",
     Split::qkv,
     {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}},
    {"self_attn.fused_qkv_a_proj.weight",
     Split::replicated,
     {"self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", ""}},
    {"mlp.gate_up_proj.weight", Split::column, {"mlp.gate_proj.weight", "mlp.up_proj.weight", ""}},
    {"mlp.shared_expert.gate_up_proj.weight",
     Split::column,
     {"mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight", ""}},
    {"mlp.shared_experts.gate_up_proj.weight",
     Split::column,
     {"mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight", ""}},
}};

// One HF tensor of a layer kept under its own name.
struct SingleRule {
  std::string_view key;
  Split split;
};

constexpr std::array<SingleRule, 17> kSingle{{
    {"input_layernorm.weight", Split::replicated},
    {"post_attention_layernorm.weight", Split::replicated},
    {"self_attn.q_norm.weight", Split::replicated},
    {"self_attn.k_norm.weight", Split::replicated},
    {"self_attn.o_proj.weight", Split::row},
    {"self_attn.q_proj.weight", Split::column},  // MLA without q LoRA
    {"self_attn.q_a_layernorm.weight", Split::replicated},
    {"self_attn.kv_a_layernorm.weight", Split::replicated},
    {"self_attn.q_b_proj.weight", Split::column},
    {"self_attn.kv_b_proj.weight", Split::column},
    {"self_attn.kv_a_proj_with_mqa.weight", Split::replicated},  // MLA without q LoRA
    {"mlp.down_proj.weight", Split::row},
    {"mlp.shared_expert.down_proj.weight", Split::row},
    {"mlp.shared_experts.down_proj.weight", Split::row},
    {"mlp.gate.weight", Split::replicated},  // routers
    {"block_sparse_moe.gate.weight", Split::replicated},
    {"mlp.gate.e_score_correction_bias", Split::replicated},
}};

constexpr std::array<SingleRule, 3> kTopLevel{{
    {"model.embed_tokens.weight", Split::vocab},
    {"lm_head.weight", Split::vocab},
    {"model.norm.weight", Split::replicated},
}};

constexpr std::array<SingleRule, 1> kLayerExtra{{
    {"mlp.shared_expert_gate.weight", Split::replicated},
}};

// "model.layers.12.mlp.gate.weight" -> ("model.layers.12.", "mlp.gate.weight").
bool split_layer_key(const std::string& key, std::string& prefix, std::string& suffix) {
  static const std::string kLayers = "model.layers.";
  if (key.rfind(kLayers, 0) != 0) return false;
  const size_t dot = key.find('.', kLayers.size());
  if (dot == std::string::npos) return false;
  prefix = key.substr(0, dot + 1);
  suffix = key.substr(dot + 1);
  return true;
}

std::optional<Split> single_split(std::string_view suffix) {
  for (const auto& r : kSingle)
    if (r.key == suffix) return r.split;
  for (const auto& r : kLayerExtra)
    if (r.key == suffix) return r.split;
  return std::nullopt;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace

bool fp8_linear_key(std::string_view key) {
  if (ends_with(key, "_proj.weight")) return true;
  // DeepSeek's MLA: kv_a_proj_with_mqa (fused with q_a_proj in vLLM's
  // fused_qkv_a_proj) is FP8 in DeepSeek-V3's and Kimi-K2's checkpoints.
  if (ends_with(key, ".kv_a_proj_with_mqa.weight")) return true;
  // Mixtral's experts: block_sparse_moe.experts.{e}.w1/w2/w3.weight.
  return key.find(".experts.") != std::string_view::npos &&
         (ends_with(key, ".w1.weight") || ends_with(key, ".w2.weight") ||
          ends_with(key, ".w3.weight"));
}

std::string scale_param_name(const std::string& weight) {
  return weight + "_scale_inv";
}

std::string_view split_name(Split split) {
  switch (split) {
    case Split::replicated:
      return "replicated";
    case Split::column:
      return "column";
    case Split::row:
      return "row";
    case Split::vocab:
      return "vocab";
    case Split::qkv:
      return "qkv";
    case Split::experts_w13:
      return "experts_w13";
    case Split::experts_w2:
      return "experts_w2";
  }
  return "?";
}

namespace {

// The fused-experts rules of each MoE layer, keyed by the first gate key.
std::map<std::string, std::vector<Rule>> expert_rules(const HfModelConfig& hf) {
  std::map<std::string, std::vector<Rule>> out;
  for (const auto& layer : hf_moe_layers(hf)) {
    const std::string& first = layer.gate.front();
    // The engine keeps the HF block name: "mlp." or Mixtral's "block_sparse_moe.".
    const std::string block = first.substr(0, first.find("experts."));
    Rule w13{block + "experts.w13_weight", Split::experts_w13, layer.gate};
    w13.keys.insert(w13.keys.end(), layer.up.begin(), layer.up.end());
    Rule w2{block + "experts.w2_weight", Split::experts_w2, layer.down};
    out[first] = {std::move(w13), std::move(w2)};
  }
  return out;
}

}  // namespace

namespace {

// Which rules are FP8 (rules_for).
void mark_quantized(std::vector<Rule>& rules, const EngineConfig& config, const Fp8Selection* fp8) {
  const auto ckpt = fp8 ? read_checkpoint_fp8(config.hf.raw()) : std::nullopt;
  const FusedModules fused = ckpt ? fp8->fused(config.hf) : FusedModules{};
  for (Rule& r : rules) {
    const bool linear = r.split != Split::vocab &&
                        std::all_of(r.keys.begin(), r.keys.end(),
                                    [](const std::string& k) { return fp8_linear_key(k); });
    if (!ckpt) {
      r.quantized = linear;
      continue;
    }
    const std::string module = module_of_param(r.param);
    const bool takes_quant = linear || (fp8->extra && fp8->extra(config.hf, module));
    r.quantized = takes_quant && !fp8->skipped(module, *ckpt, fused);
  }
}

}  // namespace

std::vector<Rule> rules_for(const EngineConfig& config, const HfShapes& shapes,
                            const std::vector<HfTensorSpec>& tensors, const Renames& renames,
                            const Fp8Selection* fp8) {
  std::vector<Rule> rules;
  std::set<std::string> consumed;
  auto experts = expert_rules(config.hf);
  for (const auto& layer : hf_moe_layers(config.hf)) {
    for (const auto* list : {&layer.gate, &layer.up, &layer.down})
      for (const auto& k : *list)
        if (k != layer.gate.front()) consumed.insert(k);
  }
  for (const auto& t : tensors) {
    if (consumed.count(t.key)) continue;
    if (auto it = experts.find(t.key); it != experts.end()) {
      for (auto& r : it->second) rules.push_back(std::move(r));
      consumed.insert(t.key);
      continue;
    }
    bool done = false;
    for (const auto& r : kTopLevel) {
      if (r.key != t.key) continue;
      rules.push_back({t.key, r.split, {t.key}});
      done = true;
    }
    std::string prefix, suffix;
    if (!done && split_layer_key(t.key, prefix, suffix)) {
      for (const auto& f : kFused) {
        if (std::find(f.keys.begin(), f.keys.end(), suffix) == f.keys.end()) continue;
        std::vector<std::string> keys;
        for (auto k : f.keys)
          if (!k.empty() && shapes.count(prefix + std::string(k)))
            keys.push_back(prefix + std::string(k));
        if (keys.size() != static_cast<size_t>(std::count_if(f.keys.begin(), f.keys.end(),
                                                             [](auto k) { return !k.empty(); })))
          continue;  // not all parts present: e.g. MLA's q_proj without k/v
        const auto renamed = renames.find(f.param);
        const std::string_view name = renamed != renames.end() ? renamed->second : f.param;
        for (const auto& k : keys) consumed.insert(k);
        rules.push_back({prefix + std::string(name), f.split, std::move(keys)});
        done = true;
        break;
      }
      if (!done) {
        if (auto split = single_split(suffix)) {
          rules.push_back({t.key, *split, {t.key}});
          done = true;
        }
      }
    }
    if (!done)
      fail(Errc::invalid_layout, "engine layout (", config.framework, ", ", config.hf.family,
           "): no rule places HF tensor '", t.key, "'");
  }
  if (config.quantization) mark_quantized(rules, config, fp8);
  return rules;
}

}  // namespace weightsync::engine
