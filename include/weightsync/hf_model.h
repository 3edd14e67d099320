// The facts of a Hugging Face model that weightsync needs: its architecture
// family, sizes, and the list of tensors its checkpoint stores (names and
// unpadded shapes). Shared by trainer-layout generation, engine layouts and
// the tools that make random checkpoints.
#pragma once

#include <weightsync/dtype.h>
#include <weightsync/tensor.h>

#include <nlohmann/json_fwd.hpp>

#include <memory>
#include <string>
#include <vector>

namespace weightsync {

struct HfModelConfig {
  // Canonical family: "llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe",
  // "mixtral" or "deepseek_v3" (also Kimi-K2). Recognised from `model_type`
  // or from `architectures` (e.g. kimi_k2 + DeepseekV3ForCausalLM).
  std::string family;
  std::string model_type;     // as the config says
  DType dtype = DType::BF16;  // from torch_dtype / dtype; BF16 when absent

  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // dense MLP
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // qwen2 family

  // Mixture of experts (num_experts == 0: dense).
  int64_t num_experts = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;  // qwen2_moe
  int64_t n_shared_experts = 0;                 // deepseek_v3
  int64_t first_k_dense_replace = 0;            // deepseek_v3
  int64_t moe_layer_freq = 1;                   // deepseek_v3
  int64_t decoder_sparse_step = 1;              // qwen*_moe
  std::vector<int64_t> mlp_only_layers;         // qwen*_moe

  // Multi-head latent attention (deepseek_v3); q_lora_rank 0 means no q LoRA.
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;

  // The config as given (a null JSON for a config built field by field).
  const nlohmann::json& raw() const noexcept;
  void set_raw(nlohmann::json config);
  std::shared_ptr<const nlohmann::json> raw_;  // raw()'s; shared by copies

  // Errc::invalid_argument for an unknown architecture; Errc::format for a
  // missing or mistyped field (naming it).
  static HfModelConfig from_json(const nlohmann::json& config);
  static HfModelConfig load(const std::string& path);

  bool is_moe() const noexcept { return num_experts > 0; }
  bool is_moe_layer(int64_t layer) const;
};

struct HfTensorSpec {
  std::string key;
  Shape shape;
  DType dtype = DType::BF16;
};

// Every tensor of the main model's checkpoint (no MTP layers), in a stable
// order: embeddings, then layer by layer, then final norm and lm_head.
std::vector<HfTensorSpec> hf_tensors(const HfModelConfig& config);

// The routed-expert keys of one MoE layer: per expert, its gate (w1), up (w3)
// and down (w2) projection weight keys.
struct MoeLayerKeys {
  int64_t layer = 0;
  std::vector<std::string> gate, up, down;
};
std::vector<MoeLayerKeys> hf_moe_layers(const HfModelConfig& config);

}  // namespace weightsync
