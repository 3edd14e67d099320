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
void check_coverage(const EngineLayout& layout);

}  // namespace weightsync
