// Framework "vllm": the parameters vLLM's weight loaders fill, as the name
// tables of layout_rules.cpp give them (they use vLLM's names).
#include "engine_framework.h"
#include "layout_rules.h"

namespace weightsync::engine {
namespace {

std::vector<EngineRankLayout> vllm_ranks(const EngineConfig& c) {
  return rule_ranks(c, {});
}

}  // namespace

extern const Framework kVllm;
const Framework kVllm{.name = "vllm", .ranks = vllm_ranks};

}  // namespace weightsync::engine
