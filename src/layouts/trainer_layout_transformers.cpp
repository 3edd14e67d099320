// Trainer layouts as transformers >= 5 holds a model in memory (see
// trainer_layout.h): stacked MoE experts, Mixtral's block renamed.
#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include "trainer_layout_internal.h"

namespace weightsync {
namespace {

constexpr std::string_view kGateUp = ".experts.gate_up_proj";
constexpr std::string_view kDown = ".experts.down_proj";

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

// Replaces the first `from` in `s` by `to` (no-op when absent).
std::string replace_first(std::string s, std::string_view from, std::string_view to) {
  if (auto pos = s.find(from); pos != std::string::npos) s.replace(pos, from.size(), to);
  return s;
}

// On disk, Mixtral's MoE block is `block_sparse_moe.`; transformers >= 5
// calls it `mlp.` in memory.
constexpr std::string_view kMixtralDiskBlock = ".block_sparse_moe.";
constexpr std::string_view kMemoryBlock = ".mlp.";

// The per-expert keys of a stacked expert param `name` (ending in `tail`).
std::vector<std::string> expert_keys(bool mixtral, const std::string& name, std::string_view tail,
                                     int64_t experts, std::initializer_list<const char*> parts) {
  // "model.layers.3.mlp.experts.gate_up_proj" -> "model.layers.3.mlp.experts."
  std::string prefix = name.substr(0, name.size() - tail.size()) + ".experts.";
  if (mixtral) prefix = replace_first(prefix, kMemoryBlock, kMixtralDiskBlock);
  std::vector<std::string> keys;
  keys.reserve(static_cast<size_t>(experts) * parts.size());
  for (int64_t e = 0; e < experts; ++e)
    for (const char* part : parts) keys.push_back(cat(prefix, e, ".", part, ".weight"));
  return keys;
}

}  // namespace

std::string_view trainer_layout_style_name(TrainerLayoutStyle style) noexcept {
  switch (style) {
    case TrainerLayoutStyle::transformers:
      return "transformers";
    case TrainerLayoutStyle::megatron:
      return "megatron";
    case TrainerLayoutStyle::xtuner:
      break;
  }
  return "xtuner";
}

TrainerLayoutStyle parse_trainer_layout_style(std::string_view name) {
  if (name == "xtuner") return TrainerLayoutStyle::xtuner;
  if (name == "transformers") return TrainerLayoutStyle::transformers;
  if (name == "megatron") return TrainerLayoutStyle::megatron;
  fail(Errc::invalid_argument, "unknown trainer layout style '", name,
       "' (expected xtuner, transformers or megatron)");
}

TransformersParam transformers_param(std::string_view model_type, const std::string& name,
                                     const Shape& shape) {
  const bool mixtral = model_type == "mixtral";
  TransformersParam p;
  if (ends_with(name, kGateUp) && shape.size() == 3) {
    if (shape[1] % 2 != 0)
      fail(Errc::invalid_layout, "param '", name, "': ", shape_str(shape),
           " is not [E, 2*I, H] (gate and up of equal rows)");
    p.hf_keys = expert_keys(mixtral, name, kGateUp, shape[0],
                            mixtral ? std::initializer_list<const char*>{"w1", "w3"}
                                    : std::initializer_list<const char*>{"gate_proj", "up_proj"});
    p.fused_dim = 1;
    p.stack_dim = 0;
    return p;
  }
  if (ends_with(name, kDown) && shape.size() == 3) {
    p.hf_keys = expert_keys(mixtral, name, kDown, shape[0], {mixtral ? "w2" : "down_proj"});
    p.stack_dim = 0;
    return p;
  }
  p.hf_keys = {mixtral && name.starts_with("model.layers.")
                   ? replace_first(name, kMemoryBlock, kMixtralDiskBlock)
                   : name};
  return p;
}

// Rewrites an XTuner-style layout (fused experts [E*2*I, H] and [E*H, I],
// keys expert-major) into transformers' names and stacked shapes. The keys
// keep their order: per expert, gate then up.
void to_transformers_style(TrainerLayout& layout, const HfModelConfig& config) {
  const bool mixtral = config.family == "mixtral";
  for (LoadSpec& p : layout.params) {
    if (mixtral) p.name = replace_first(p.name, kMixtralDiskBlock, kMemoryBlock);
    const bool gate_up = ends_with(p.name, kGateUp), down = ends_with(p.name, kDown);
    if (!gate_up && !down) continue;
    const auto experts = static_cast<int64_t>(p.hf_keys.size()) / (gate_up ? 2 : 1);
    const Shape fused = p.global_shape;
    p.global_shape = {experts, fused[0] / experts, fused[1]};
    p.origin_shape = p.global_shape;
    p.stack_dim = 0;
    p.fused_dim = gate_up ? std::optional<int>(1) : std::nullopt;
  }
}

}  // namespace weightsync
