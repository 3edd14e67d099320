// Engine layout rules as data: how each engine parameter is composed from HF
// tensors. rules_for() maps a model's HF tensor list to a list of rules by
// name tables (layout_rules.cpp); build_param() turns one rule into one
// rank's parameter (layout_build.cpp).
#pragma once

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
};

// Shapes of the HF tensors by key.
using HfShapes = std::map<std::string, Shape, std::less<>>;

// Every rule of the model under `config.framework`'s names, in HF order.
// Errc::invalid_layout when an HF tensor has no rule (a family this table
// does not know yet).
std::vector<Rule> rules_for(const EngineConfig& config, const HfShapes& shapes,
                            const std::vector<HfTensorSpec>& tensors);

// One rank's parameter for `rule`; Errc::invalid_layout when tp does not
// divide what the rule splits.
EngineParam build_param(const Rule& rule, const EngineConfig& config, const HfShapes& shapes,
                        int rank);

}  // namespace weightsync::engine
