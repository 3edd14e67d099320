// Engine layouts: how an inference engine's ranks compose their own
// parameters (under the engine's names) from Hugging Face tensors.
#pragma once

#include <weightsync/box.h>
#include <weightsync/hf_model.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace weightsync {

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
struct EngineParam {
  std::string name;
  DType dtype = DType::BF16;
  Shape shape;
  std::vector<Segment> segments;
};

struct EngineRankLayout {
  int rank = 0;  // rank inside its replica, 0..tp-1
  std::vector<EngineParam> params;
};

// The engine config JSON of DESIGN.md's contract.
struct EngineConfig {
  std::string framework = "vllm";  // "vllm" | "sglang"
  HfModelConfig hf;                // resolved from "hf_config" (path or inline)
  int tp = 1;
  bool expert_parallel = false;
  std::string expert_placement = "linear";  // "linear" | "round_robin"
  int replicas = 1;
  DType dtype = DType::BF16;
  std::string moe_order = "w13";  // "w13" (gate first) or "w31" (SGLang: up first)

  // `base_dir` resolves a relative hf_config path.
  static EngineConfig from_json(const nlohmann::json& j, const std::string& base_dir);
  static EngineConfig load(const std::string& path);
  nlohmann::json to_json() const;
};

// The layouts of one replica (all replicas are identical). Global engine rank
// g = replica * tp + rank.
struct EngineLayout {
  EngineConfig config;
  std::vector<EngineRankLayout> ranks;  // size tp

  int world() const noexcept { return config.tp * config.replicas; }
  const EngineRankLayout& rank_layout(int global_rank) const {
    return ranks.at(static_cast<size_t>(global_rank % config.tp));
  }
};

// Derives every rank's parameters from the config (engine_adapter/). Throws
// Errc::invalid_layout when tp does not divide what the engine requires.
EngineLayout make_engine_layout(const EngineConfig& config);

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

// The global expert ids held by replica rank `rank`, in local order (local
// slot j holds expert result[j]); every expert when expert_parallel is off.
std::vector<int64_t> local_experts(const EngineConfig& config, int rank);

// Rows of a vocab-parallel tensor after padding to a multiple of 64.
int64_t padded_vocab(int64_t vocab_size);

class Checkpoint;

// Checks that `checkpoint` holds every HF tensor that replica rank `rank`
// reads, with the shape the model config implies and the engine's dtype (no
// conversion): Errc::not_found naming a missing key; Errc::mismatch naming
// the key and both shapes or both dtypes.
void check_checkpoint(const Checkpoint& checkpoint, const EngineLayout& layout, int rank);

// Fills `param` (contiguous row-major, param.shape, param.dtype) into `dst`
// straight from the checkpoint; padding elements become zero. Checks each
// key's dtype and that its boxes fit (Errc::not_found / Errc::mismatch).
void fill_param(const Checkpoint& checkpoint, const EngineParam& param, void* dst);

// Writes engine rank `rank`'s parameters (under the engine's names, in layout
// order) to the .safetensors file `out_path`, after check_checkpoint.
// `rank` may be any global rank 0..world()-1: replicas are identical, so it
// is reduced modulo tp; anything else is Errc::invalid_argument. Streams:
// contiguous runs go from the checkpoint's mapping straight to the file, the
// rest through one reusable buffer. Returns the bytes of the data section.
uint64_t materialize(const Checkpoint& checkpoint, const EngineLayout& layout, int rank,
                     const std::string& out_path);

}  // namespace weightsync
