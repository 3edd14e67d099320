// Trainer layouts generated from a Hugging Face config, as an XTuner-style
// FSDP2 (+ expert parallel) trainer holds its parameters.
//
// Naming (also in `weightsync trainer-layout --help`):
// - dense tensors: one param per HF key, named by the key; FSDP-sharded on
//   dim 0 over the mesh axis "fsdp" (replicated when there is none).
// - each MoE layer's routed experts become two fused params:
//   `<block>.experts.gate_up_proj` [E*2*I, H], keys e0.gate, e0.up, e1.gate,
//   ... (expert-major, gate before up), and `<block>.experts.down_proj`
//   [E*H, I], keys e0.down, e1.down, ...; fused_dim 0; sharded on dim 0 over
//   "ep" first, then "fsdp". <block> is `model.layers.L.mlp` (Mixtral:
//   `model.layers.L.block_sparse_moe`).
// - other mesh axes replicate every param.
#pragma once

#include <weightsync/hf_model.h>
#include <weightsync/load_spec.h>

#include <optional>
#include <string>
#include <string_view>

namespace weightsync {

inline constexpr std::string_view kFsdpAxis = "fsdp";
inline constexpr std::string_view kEpAxis = "ep";

struct TrainerLayoutOptions {
  std::optional<DType> dtype;  // the params' dtype; the config's when absent
};

// Errc::invalid_layout when the mesh is unusable (validate()).
TrainerLayout make_trainer_layout(const HfModelConfig& config, const Mesh& mesh,
                                  const TrainerLayoutOptions& options = {});

// "ep=2,fsdp=4" -> axes [ep, fsdp], shape [2, 4] (row-major, in the order
// given). Errc::invalid_argument for anything else: empty names, sizes that
// are not positive integers, repeated axes.
Mesh parse_mesh_spec(std::string_view spec);

}  // namespace weightsync
