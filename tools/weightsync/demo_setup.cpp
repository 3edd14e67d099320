#include "demo_setup.h"

#include <nlohmann/json.hpp>

#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>

#include "core/random_checkpoint.h"

#include <cmath>
#include <fstream>

namespace weightsync::demo {
namespace {

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2);
  if (!out) fail(Errc::io, "cannot write ", path);
}

}  // namespace

nlohmann::json demo_model_config() {
  return {{"architectures", {"Qwen3MoeForCausalLM"}},
          {"model_type", "qwen3_moe"},
          {"hidden_size", 256},
          {"intermediate_size", 512},
          {"moe_intermediate_size", 128},
          {"num_experts", 8},
          {"num_experts_per_tok", 2},
          {"decoder_sparse_step", 1},
          {"mlp_only_layers", nlohmann::json::array()},
          {"num_hidden_layers", 4},
          {"num_attention_heads", 8},
          {"num_key_value_heads", 4},
          {"head_dim", 32},
          {"vocab_size", 4096},
          {"tie_word_embeddings", false},
          {"torch_dtype", "bfloat16"}};
}

nlohmann::json bench_model_config(double gigabytes) {
  // Per layer, in elements: attention 4*H*H (q, k, v, o at full heads) and
  // 8 experts of 3*H*(H/2); embeddings 2*V*H. H = 1024, V = 32768.
  nlohmann::json c = demo_model_config();
  const int64_t h = 1024, vocab = 32768, experts = 8, moe = 512;
  const int64_t per_layer = 4 * h * h + experts * 3 * h * moe + experts * h + 2 * 128;
  const int64_t fixed = 2 * vocab * h + h;
  const auto target = static_cast<int64_t>(gigabytes * 1e9 / 2.0);
  const int64_t layers = std::max<int64_t>(1, (target - fixed) / per_layer);
  c["hidden_size"] = h;
  c["intermediate_size"] = 2 * h;
  c["moe_intermediate_size"] = moe;
  c["num_experts"] = experts;
  c["num_hidden_layers"] = layers;
  c["num_attention_heads"] = 8;
  c["num_key_value_heads"] = 8;
  c["head_dim"] = 128;
  c["vocab_size"] = vocab;
  return c;
}

ModelFiles write_model(const std::string& dir, const ModelSetup& setup) {
  ModelFiles f;
  const HfModelConfig config = HfModelConfig::from_json(setup.hf_config);
  const auto tensors = hf_tensors(config);
  f.family = config.family;
  f.tensors = tensors.size();
  for (const auto& t : tensors) f.bytes += numel(t.shape) * static_cast<int64_t>(itemsize(t.dtype));
  f.checkpoint = dir + "/model.safetensors";
  RandomCheckpointOptions ro;
  ro.seed = setup.seed;
  write_random_checkpoint(f.checkpoint, tensors, ro);
  write_json(dir + "/config.json", setup.hf_config);
  f.trainer = dir + "/trainer.json";
  write_json(f.trainer, make_trainer_layout(config, parse_mesh_spec(setup.mesh)).to_json());
  f.engine = dir + "/engine.json";
  write_json(f.engine, {{"framework", "vllm"},
                        {"hf_config", "config.json"},
                        {"tp", setup.tp},
                        {"expert_parallel", setup.expert_parallel},
                        {"expert_placement", "linear"},
                        {"replicas", setup.replicas},
                        {"dtype", dtype_name(config.dtype)}});
  return f;
}

}  // namespace weightsync::demo
