// XTuner-style trainer layouts from HF configs (see trainer_layout.h).
#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include "trainer_layout_internal.h"

#include <charconv>
#include <set>
#include <unordered_map>

namespace weightsync {
namespace {

std::vector<ShardSpec> dim0_shards(const Mesh& mesh, bool expert) {
  std::vector<ShardSpec> shards;
  // EP before FSDP on the same dim, as torch orders FSDP2 over EP.
  if (expert && mesh.axis_index(kEpAxis) >= 0) shards.push_back({0, std::string(kEpAxis), 1});
  if (mesh.axis_index(kFsdpAxis) >= 0) shards.push_back({0, std::string(kFsdpAxis), 1});
  return shards;
}

// "model.layers.3.mlp.experts.0.gate_proj.weight" -> "model.layers.3.mlp.experts"
std::string experts_prefix(const std::string& key) {
  const auto pos = key.rfind(".experts.");
  if (pos == std::string::npos)
    fail(Errc::internal, "expert key '", key, "' has no '.experts.' component");
  return key.substr(0, pos + 8);
}

// The two fused params of one MoE layer.
void add_moe_params(TrainerLayout& layout, MoeLayerKeys moe, const Shape& gate_shape,
                    const Shape& down_shape, DType dtype) {
  const int64_t e = static_cast<int64_t>(moe.gate.size());
  const std::string prefix = experts_prefix(moe.gate.at(0));
  LoadSpec gate_up;
  gate_up.name = prefix + ".gate_up_proj";
  for (int64_t x = 0; x < e; ++x) {
    gate_up.hf_keys.push_back(std::move(moe.gate[x]));
    gate_up.hf_keys.push_back(std::move(moe.up[x]));
  }
  gate_up.fused_dim = 0;
  gate_up.global_shape = {e * 2 * gate_shape[0], gate_shape[1]};
  gate_up.origin_shape = gate_up.global_shape;
  gate_up.dtype = dtype;
  gate_up.shards = dim0_shards(layout.mesh, true);
  LoadSpec down;
  down.name = prefix + ".down_proj";
  down.hf_keys = std::move(moe.down);
  down.fused_dim = 0;
  down.global_shape = {e * down_shape[0], down_shape[1]};
  down.origin_shape = down.global_shape;
  down.dtype = dtype;
  down.shards = dim0_shards(layout.mesh, true);
  // The contract forbids fused_dim with one key (a one-expert down_proj).
  if (e == 1) down.fused_dim.reset();
  layout.params.push_back(std::move(gate_up));
  layout.params.push_back(std::move(down));
}

}  // namespace

TrainerLayout make_trainer_layout(const HfModelConfig& config, const Mesh& mesh,
                                  const TrainerLayoutOptions& options) {
  if (options.style == TrainerLayoutStyle::megatron)
    return make_megatron_layout(config, megatron_parallel(mesh), options.megatron, options.dtype);
  TrainerLayout layout;
  layout.mesh = mesh;
  const DType dtype = options.dtype.value_or(config.dtype);
  std::vector<HfTensorSpec> tensors = hf_tensors(config);
  std::vector<MoeLayerKeys> moe_layers = hf_moe_layers(config);
  // Pass 1: the MoE layer of every expert tensor (-1: dense) and each layer's
  // expert shapes. Views into moe_layers keep the lookup free of copies; big
  // models have tens of thousands of expert keys.
  size_t expert_keys = 0;
  for (const MoeLayerKeys& moe : moe_layers) expert_keys += 3 * moe.gate.size();
  std::unordered_map<std::string_view, int64_t> expert_layer;
  expert_layer.reserve(expert_keys);
  for (size_t l = 0; l < moe_layers.size(); ++l)
    for (const auto* keys : {&moe_layers[l].gate, &moe_layers[l].up, &moe_layers[l].down})
      for (const std::string& k : *keys) expert_layer.emplace(k, static_cast<int64_t>(l));
  std::vector<int64_t> layer_of(tensors.size(), -1);
  std::vector<Shape> gate_shape(moe_layers.size()), down_shape(moe_layers.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    auto it = expert_layer.find(tensors[i].key);
    if (it == expert_layer.end()) continue;
    layer_of[i] = it->second;
    const MoeLayerKeys& moe = moe_layers[it->second];
    if (tensors[i].key == moe.gate.front()) gate_shape[it->second] = tensors[i].shape;
    if (tensors[i].key == moe.down.front()) down_shape[it->second] = tensors[i].shape;
  }
  expert_layer.clear();  // its views die with the moves below
  // Pass 2: a layer's fused params take the place of its first expert tensor.
  std::vector<bool> emitted(moe_layers.size(), false);
  layout.params.reserve(tensors.size() - expert_keys + 2 * moe_layers.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    HfTensorSpec& t = tensors[i];
    if (layer_of[i] >= 0) {
      if (emitted[layer_of[i]]) continue;
      emitted[layer_of[i]] = true;
      add_moe_params(layout, std::move(moe_layers[layer_of[i]]), gate_shape[layer_of[i]],
                     down_shape[layer_of[i]], dtype);
      continue;
    }
    LoadSpec spec;
    spec.name = t.key;
    spec.hf_keys = {std::move(t.key)};
    spec.global_shape = t.shape;
    spec.origin_shape = std::move(t.shape);
    spec.dtype = dtype;
    if (!spec.global_shape.empty()) spec.shards = dim0_shards(mesh, false);
    layout.params.push_back(std::move(spec));
  }
  if (options.style == TrainerLayoutStyle::transformers) to_transformers_style(layout, config);
  layout.validate();
  return layout;
}

Mesh parse_mesh_spec(std::string_view spec) {
  Mesh mesh;
  std::set<std::string> seen;
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t comma = std::min(spec.find(',', pos), spec.size());
    const std::string_view item = spec.substr(pos, comma - pos);
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos || eq == 0)
      fail(Errc::invalid_argument, "mesh '", spec, "': expected AXIS=SIZE items separated by ",
           "commas (e.g. ep=2,fsdp=4), got '", item, "'");
    const std::string axis(item.substr(0, eq));
    const std::string_view size = item.substr(eq + 1);
    int64_t n = 0;
    auto [p, ec] = std::from_chars(size.data(), size.data() + size.size(), n);
    if (ec != std::errc() || p != size.data() + size.size() || n <= 0)
      fail(Errc::invalid_argument, "mesh '", spec, "': axis '", axis,
           "' needs a positive integer size, got '", size, "'");
    if (!seen.insert(axis).second)
      fail(Errc::invalid_argument, "mesh '", spec, "': axis '", axis, "' given twice");
    mesh.axes.push_back(axis);
    mesh.shape.push_back(n);
    pos = comma + 1;
  }
  return mesh;
}

}  // namespace weightsync
