// The layout generators (weightsync_layouts, src/layouts/): from a model's
// Hugging Face config and a parallelism to the layout data model that core
// defines and plans from (engine_layout.h; TrainerLayout in load_spec.h).
// Engine layouts come from an engine framework's rules (one file each,
// src/layouts/framework_<name>.cpp); trainer layouts from a trainer style
// (src/layouts/trainer_layout_<style>.cpp).
//
// Trainer style xtuner, as an XTuner-style FSDP2 (+ expert parallel) trainer
// holds its parameters (also in `weightsync trainer-layout --help`):
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

#include <weightsync/engine_layout.h>
#include <weightsync/hf_model.h>
#include <weightsync/load_spec.h>

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace weightsync {

// ---- Engine layouts

// Engine configs from JSON (EngineConfig in engine_layout.h): the framework is
// found in this library's registry, which checks its options. `base_dir`
// resolves a relative hf_config path; the load_ forms read a file and name it
// in errors. Errc::format / invalid_layout / unsupported naming the field (and
// the group, for a spec: one config or an array of them).
EngineConfig engine_config_from_json(const nlohmann::json& j, const std::string& base_dir);
EngineConfig load_engine_config(const std::string& path);
EngineSpec engine_spec_from_json(const nlohmann::json& j, const std::string& base_dir);
EngineSpec load_engine_spec(const std::string& path);

// Derives every rank's parameters from the config, by its framework's rules;
// with a spec, every group's (EngineLayout::groups). Throws
// Errc::invalid_layout when tp does not divide what the engine requires.
EngineLayout make_engine_layout(const EngineConfig& config);
EngineLayout make_engine_layout(const EngineSpec& spec);

// FP8 engines: where the engine config's quantization comes from —
// "the model's quantization_config" (frameworks that read it as their engine
// does: "vllm", "sglang"), "the engine config's \"quantization\"", or "" when
// the engine is not quantized.
std::string fp8_source(const EngineConfig& config);

// One line on what a rank holds in FP8: "N of M linear weights FP8, scales
// <format>" (M: every weight an FP8 checkpoint may store in FP8 — the
// quantized ones and the unquantized params whose HF tensors are such
// weights); "" for a rank with no FP8 param.
std::string fp8_summary(const EngineRankLayout& rank);

// The global expert ids held by replica rank `rank`, in local order (local
// slot j holds expert result[j]); every expert when expert_parallel is off.
std::vector<int64_t> local_experts(const EngineConfig& config, int rank);

// Rows of a vocab-parallel tensor after padding to a multiple of 64.
int64_t padded_vocab(int64_t vocab_size);

// ---- Trainer layouts

inline constexpr std::string_view kFsdpAxis = "fsdp";
inline constexpr std::string_view kEpAxis = "ep";

// How the trainer names and holds its params:
// - xtuner: as above (each MoE layer's experts fused on dim 0).
// - transformers: as transformers >= 5 holds the model in memory: dense
//   params keep their HF names (Mixtral's `block_sparse_moe.` is `mlp.`) and
//   each MoE layer's experts are stacked, `model.layers.L.mlp.experts.
//   gate_up_proj` [E, 2I, H] (per expert gate then up, fused on dim 1) and
//   `...experts.down_proj` [E, H, I] (LoadSpec stack_dim 0), sharded on dim 0
//   over "ep" first, then "fsdp".
// - megatron: as Megatron-Core holds the model (Transformer Engine layer
//   spec): every rank's params on its pipeline stage, under the stage's
//   local names; see make_megatron_layout below and docs/megatron.md.
enum class TrainerLayoutStyle { xtuner, transformers, megatron };
std::string_view trainer_layout_style_name(TrainerLayoutStyle style) noexcept;
TrainerLayoutStyle parse_trainer_layout_style(std::string_view name);  // Errc::invalid_argument

// Megatron-Core's parallel sizes. Ranks are numbered in Megatron's default
// order, "tp-cp-ep-dp-pp" (tp fastest, pp slowest): the dense part as
// tp x cp x dp per stage, the experts as etp x ep x edp over the same ranks.
struct MegatronParallel {
  int64_t pp = 1, tp = 1, dp = 1, cp = 1, ep = 1;
  int64_t etp = 0;  // expert tensor parallel; 0: tp (Megatron-Core's default)

  int64_t world() const noexcept { return pp * tp * cp * dp; }
  int64_t expert_tp() const noexcept { return etp > 0 ? etp : tp; }
};

// "pp=2,tp=2,dp=1[,cp=C][,ep=E,etp=N]" (parse_mesh_spec's syntax): the sizes
// by name, absent ones 1 (etp: tp). Errc::invalid_argument naming an unknown
// name.
MegatronParallel parse_megatron_parallel(std::string_view spec);
MegatronParallel megatron_parallel(const Mesh& sizes);

// What Megatron-Core is configured with beyond the parallel sizes.
struct MegatronOptions {
  // make_vocab_size_divisible_by: embedding and output rows padded to a
  // multiple of it x tp (Megatron-LM's default 128); 0: no padding
  // (Megatron-Bridge's default, should_pad_vocab False).
  int64_t vocab_divisible_by = 128;
  // num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage.
  std::optional<int64_t> first_stage_layers, last_stage_layers;
};

struct TrainerLayoutOptions {
  std::optional<DType> dtype;  // the params' dtype; the config's when absent
  TrainerLayoutStyle style = TrainerLayoutStyle::xtuner;
  MegatronOptions megatron;  // style megatron only
};

// The HF keys of a param that transformers >= 5 holds in memory as `name`
// with `shape`, for a model of `model_type`: stacked experts
// (`*.experts.gate_up_proj` [E, 2I, H], `*.experts.down_proj` [E, H, I]) map
// to their per-expert keys (Mixtral: `block_sparse_moe.experts.{e}.w1/w3/w2`);
// Mixtral's `mlp.` params to `block_sparse_moe.`; anything else to `name`.
struct TransformersParam {
  std::vector<std::string> hf_keys;
  std::optional<int> fused_dim;
  std::optional<int> stack_dim;
};
TransformersParam transformers_param(std::string_view model_type, const std::string& name,
                                     const Shape& shape);

// Errc::invalid_layout when the mesh is unusable (validate()). Style megatron
// reads `mesh` as Megatron's parallel sizes (megatron_parallel) and builds
// the layout's own mesh (make_megatron_layout).
TrainerLayout make_trainer_layout(const HfModelConfig& config, const Mesh& mesh,
                                  const TrainerLayoutOptions& options = {});

// The layout of a Megatron-Core trainer of `config` (llama, qwen2, qwen3,
// qwen3_moe, mixtral, deepseek_v3; Errc::unsupported for the others).
// - Mesh: axis "pp" (slowest), then the stage's ranks in Megatron's order as
//   row-major axes. Dense models: "dp", "cp" (when cp > 1), "tp". MoE models:
//   the common refinement of tp x cp x dp and etp x ep x edp, each axis named
//   "<dense part>_<expert part>" (e.g. pp=2,tp=2,dp=4,ep=4,etp=1 gives
//   pp, dp_edp, dp_ep, tp_ep); Errc::invalid_layout where the two have no
//   row-major refinement.
// - Params of stage s carry stage {"pp", s} (none when pp == 1) and their
//   local layer index, `decoder.layers.{local}.`; the embedding on the first
//   stage, decoder.final_layernorm and output_layer on the last.
// - Errc::invalid_layout where Megatron-Core refuses the configuration
//   (uneven stages, heads or FFN rows not divisible by tp, query groups
//   neither a multiple nor a divisor of tp, experts not divisible by ep,
//   expert FFN rows by etp, etp x ep not dividing a stage).
TrainerLayout make_megatron_layout(const HfModelConfig& config, const MegatronParallel& parallel,
                                   const MegatronOptions& options = {},
                                   std::optional<DType> dtype = std::nullopt);
// Rows of Megatron's embedding / output layer: vocab_size padded to a
// multiple of divisible_by x tp (0: none; then tp must divide it).
int64_t megatron_padded_vocab(int64_t vocab_size, int64_t tp, int64_t divisible_by);
// Transformer layers per pipeline stage, by Megatron-Core's rules.
std::vector<int64_t> megatron_stage_layers(int64_t num_layers, int64_t pp,
                                           const MegatronOptions& options);

// "ep=2,fsdp=4" -> axes [ep, fsdp], shape [2, 4] (row-major, in the order
// given). Errc::invalid_argument for anything else: empty names, sizes that
// are not positive integers, repeated axes.
Mesh parse_mesh_spec(std::string_view spec);

}  // namespace weightsync
