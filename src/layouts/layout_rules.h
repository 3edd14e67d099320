// Engine layout rules as data: how each engine parameter is composed from HF
// tensors. rules_for() maps a model's HF tensor list to a list of rules by
// name tables (layout_rules.cpp); build_param() turns one rule into one
// rank's parameter (layout_build.cpp).
#pragma once

#include "fp8_checkpoint.h"

#include <weightsync/engine_layout.h>

#include <map>
#include <string>
#include <vector>

namespace weightsync::engine {

enum class Split {
  replicated,   // every rank: the whole keys, stacked on dim 0
  column,       // each key's dim-0 slice of the rank, stacked on dim 0
  row,          // each key's dim-1 slice of the rank
  vocab,        // rows padded to a multiple of 64, then split on dim 0
  qkv,          // keys q, k, v: q heads by rank, KV heads by group (replicated when nkv < tp)
  experts_w13,  // keys: the E gate keys then the E up keys -> [E_local, 2*I/tp, H]
  experts_w2,   // keys: the E down keys -> [E_local, H, I/tp]
};

std::string_view split_name(Split split);

struct Rule {
  std::string param;  // the engine's parameter name
  Split split;
  std::vector<std::string> keys;  // HF keys, in stacking order
  bool quantized = false;         // FP8 engines: an F8_E4M3 weight with a scale param
};

// A linear weight that FP8 checkpoints store in FP8 (DESIGN.md "FP8
// engines"): the *_proj weights (DeepSeek's kv_a_proj_with_mqa among them)
// and Mixtral's experts' w1/w2/w3; not embeddings, lm_head, norms, routers,
// biases or Qwen2-MoE's shared_expert_gate (a plain torch Linear in vLLM).
bool fp8_linear_key(std::string_view key);

// The name of a quantized weight's scale param: vLLM's and the FP8
// checkpoints' "<weight>_scale_inv" ("...qkv_proj.weight_scale_inv",
// "...experts.w13_weight_scale_inv").
std::string scale_param_name(const std::string& weight);

// Shapes of the HF tensors by key.
using HfShapes = std::map<std::string, Shape, std::less<>>;

// Parameter names a framework gives differently from the tables (vLLM's
// names): the name after "model.layers.N." -> the framework's.
using Renames = std::map<std::string, std::string, std::less<>>;

// Every rule of the model, in HF order, its params named as the tables name
// them with `renames` applied. Errc::invalid_layout when an HF tensor has no
// rule (a family this table does not know yet). With config.quantization,
// the quantized rules: where the model's config carries quantization_config
// and `fp8` is given, the engine's own choice (fp8_checkpoint.h: its modules
// that take the quant config, less those its is_layer_skipped leaves
// unquantized); otherwise every fp8_linear_key weight.
std::vector<Rule> rules_for(const EngineConfig& config, const HfShapes& shapes,
                            const std::vector<HfTensorSpec>& tensors, const Renames& renames,
                            const Fp8Selection* fp8 = nullptr);

// The rank layouts of one replica from the tables (frameworks "vllm" and
// "sglang"): the checks of what tp must divide, then every rule's param on
// each rank, with FP8 scale params where the config says.
std::vector<EngineRankLayout> rule_ranks(const EngineConfig& config, const Renames& renames,
                                         const Fp8Selection* fp8 = nullptr);

// One rank's parameter for `rule`; Errc::invalid_layout when tp does not
// divide what the rule splits.
EngineParam build_param(const Rule& rule, const EngineConfig& config, const HfShapes& shapes,
                        int rank);

// FP8 engines: turns `weight` (built for a quantized rule, at index `index`
// of its rank's params) into an F8_E4M3 weight and returns its scale param.
// Errc::invalid_layout, naming the param, key, rank and boxes, where a part
// does not start on a block boundary on both sides or ends inside a block
// that is not the last of its dim (vLLM refuses those layouts too).
EngineParam make_quantized(EngineParam& weight, const BlockQuant& quant, const HfShapes& shapes,
                           int rank, int tp, int32_t index);

}  // namespace weightsync::engine
