// The engine layout data model (weightsync_core): how an inference engine's
// ranks compose their own parameters (under the engine's names) from Hugging
// Face tensors, the engine config they come from, their JSON and their
// coverage check. The layouts library generates them (make_engine_layout,
// layouts.h: reading an engine config resolves its framework there too);
// materialize.h builds a rank's parameters from a checkpoint.
#pragma once

#include <weightsync/box.h>
#include <weightsync/hf_model.h>

#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace weightsync {

// FP8 engines (DESIGN.md "FP8 engines"): linear weights held as F8_E4M3 with
// one F32 scale per block, quantized from the trainer's BF16/F16/F32 data as
// DeepGEMM's per_block_cast_to_fp8 (which vLLM uses) does.
enum class ScaleFormat : uint8_t {
  fp32,   // s = max(amax, 1e-4) / 448
  ue8m0,  // that s rounded up to a power of two (stored as F32 all the same)
};
std::string_view scale_format_name(ScaleFormat format) noexcept;

struct BlockQuant {
  int64_t block_rows = 128;  // weight_block_size[0], over the weight's rows (dim -2)
  int64_t block_cols = 128;  // weight_block_size[1], over its columns (dim -1)
  ScaleFormat scale = ScaleFormat::fp32;
  bool operator==(const BlockQuant&) const = default;
};

// `hf_box` of the HF tensor `hf_key` lands in `param_box` of the parameter.
// With `transpose`, the last two dims are swapped: param_box.lengths is
// hf_box.lengths with its last two entries exchanged.
// param_box may have MORE dims than hf_box: the extra dims lead and have
// length 1 (an expert's slot j in a fused [E_local, ...] parameter), e.g.
// hf_box [0:32, 0:64] of experts.5.gate_proj -> param_box [2:3, 0:32, 0:64].
struct Segment {
  std::string hf_key;
  Box hf_box;
  Box param_box;
  bool transpose = false;
};

// One engine parameter of one engine rank. Elements covered by no segment are
// padding (zero), e.g. vocab rows past vocab_size.
//
// FP8 engines: a quantized weight (dtype F8_E4M3) has `quant` set; its
// segments name HF tensors of a float dtype (BF16, F16, F32) whose blocks it
// holds quantized (every segment starts on a block boundary on both sides and
// ends on one or at the end of its dim). `scale_param` is the index, in its
// rank's params, of its scale param: F32, the weight's shape with the last two
// dims divided by the block size (rounded up), no segments (its values come
// from quantizing the weight), `scale_of` pointing back.
struct EngineParam {
  std::string name;
  DType dtype = DType::BF16;
  Shape shape;
  std::vector<Segment> segments;
  std::optional<BlockQuant> quant = std::nullopt;
  int32_t scale_param = -1;
  int32_t scale_of = -1;
};

struct EngineRankLayout {
  int rank = 0;  // rank inside its replica, 0..tp-1
  std::vector<EngineParam> params;
};

// Framework "derived": the layout a live engine derived from its own loader
// (python/weightsync/_derive.py traces the engine's load_weights on probe
// tensors) rather than from a family table: every rank's params, and the HF
// tensors (key, shape, dtype) they read. A model family weightsync has no
// table for syncs through it.
struct DerivedLayout {
  std::vector<HfTensorSpec> tensors;
  std::vector<EngineRankLayout> ranks;  // tp of them, rank r at index r
};

// The engine config JSON of DESIGN.md's contract: one group of identical
// replicas. Framework "hf": every rank holds every HF tensor whole under its
// HF name (an engine that loads weights through its own load_weights, or a
// checkpoint writer); tp then only counts the ranks of a replica.
struct EngineConfig {
  std::string framework = "vllm";  // "vllm" | "sglang" | "hf" | "derived"
  // Resolved from "hf_config" (path or inline). Framework "derived": kept as
  // given (raw, model_type) and never parsed (the family may have no table).
  HfModelConfig hf;
  int tp = 1;
  bool expert_parallel = false;
  std::string expert_placement = "linear";  // "linear" | "round_robin"
  int replicas = 1;
  DType dtype = DType::BF16;
  std::string moe_order = "w13";  // "w13" (gate first) or "w31" (SGLang: up first)
  // "quantization": {"method": "fp8", "weight_block_size": [128, 128],
  // "scale": "fp32" | "ue8m0"}: the linear weights that FP8 checkpoints store
  // in FP8 become F8_E4M3 params with scale params beside them (EngineParam);
  // every other param keeps `dtype`.
  std::optional<BlockQuant> quantization;
  // Framework "derived" (JSON field "derived": {"tensors": [{"key", "shape",
  // "dtype"}], "ranks": [rank layouts as rank_layout_to_json writes them]}).
  std::shared_ptr<const DerivedLayout> derived;

  // Read by engine_config_from_json / load_engine_config (layouts.h: reading
  // finds the framework in the layouts' registry).
  nlohmann::json to_json() const;
};

// Every engine of a job: groups of replicas, each group with its own config
// (e.g. vLLM replicas synced in place beside replicas that take HF tensors
// through load_weights, framework "hf"). JSON: one engine config (one group)
// or an array of them. Global engine ranks number the groups in order,
// replica-major inside each; so do global replica indices.
struct EngineSpec {
  std::vector<EngineConfig> groups;

  EngineSpec() = default;
  EngineSpec(EngineConfig one) : groups{std::move(one)} {}  // NOLINT: one group

  // Read by engine_spec_from_json / load_engine_spec (layouts.h).
  nlohmann::json to_json() const;  // an object for one group, else an array
};

// A group's place among all engine ranks.
struct EngineGroup {
  EngineConfig config;
  int first_rank = 0;      // global engine rank of its replica 0, rank 0
  int first_replica = 0;   // global replica index of its replica 0
  int first_template = 0;  // EngineLayout::ranks index of its rank 0
};

// The rank layouts of every group (the replicas of a group are identical).
// With one group: global engine rank g = replica * tp + rank.
struct EngineLayout {
  EngineConfig config;                  // the first group's config
  std::vector<EngineRankLayout> ranks;  // each group's tp rank layouts, in group order
  std::vector<EngineGroup> groups;      // in order (make_engine_layout fills it)

  int world() const noexcept;
  int num_replicas() const noexcept;
  // The group holding global engine rank `global_rank` (Errc::invalid_argument
  // when out of range), and the index in `ranks` of its layout.
  const EngineGroup& group_of(int global_rank) const;
  int template_of(int global_rank) const;
  const EngineRankLayout& rank_layout(int global_rank) const {
    return ranks.at(static_cast<size_t>(template_of(global_rank)));
  }
  // Global engine rank of rank `rank` of global replica `replica`;
  // Errc::invalid_argument naming the range when either is out of it.
  int global_rank(int replica, int rank) const;
};

// The HF tensors an engine group reads: the derived layout's, else the
// family's (hf_tensors).
std::vector<HfTensorSpec> engine_hf_tensors(const EngineConfig& config);

// One rank's layout as JSON ({"rank", "params": [{"name", "dtype", "shape",
// "segments": [{"hf_key", "hf_box": {"offsets", "lengths"}, "param_box",
// "transpose"}]}]}; FP8 params name their scale param) and back.
// rank_layout_from_json takes unquantized params only: Errc::format naming
// the param and the field for anything malformed.
nlohmann::json rank_layout_to_json(const EngineRankLayout& rank);
EngineRankLayout rank_layout_from_json(const nlohmann::json& j);
// The "derived" field of an engine config of framework "derived":
// {"tensors": [{"key", "shape", "dtype"}], "ranks": [tp rank layouts]}.
// Errc::format naming the field, Errc::invalid_layout when the ranks are not
// tp layouts in rank order.
std::shared_ptr<const DerivedLayout> derived_layout_from_json(const nlohmann::json& j, int tp);
nlohmann::json derived_layout_to_json(const DerivedLayout& derived);

// Checks that the segments of every parameter write each element at most once,
// stay inside the parameter and the HF tensor shapes, and that every element
// is either written or padding; throws Errc::invalid_layout naming the param.
// Also checks that, over the replica's ranks, every HF tensor the layout uses
// is covered whole (box arithmetic, no per-element bitmaps).
void check_coverage(const EngineLayout& layout);

// The sub-box of s.hf_box that lands in `param_sub` (a sub-box of
// s.param_box), in HF coordinates; and the reverse. They handle transpose and
// the leading length-1 expert dims.
Box segment_hf_sub_box(const Segment& s, const Box& param_sub);
Box segment_param_sub_box(const Segment& s, const Box& hf_sub);

}  // namespace weightsync
