// Models for the demo and the benchmark: a Hugging Face config (embedded in
// the binary), a random checkpoint of it written as a real .safetensors file,
// a generated trainer layout and an engine config, all in one directory.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace weightsync::demo {

struct ModelFiles {
  std::string checkpoint;  // <dir>/model.safetensors
  std::string trainer;     // <dir>/trainer.json
  std::string engine;      // <dir>/engine.json
  std::string family;
  int64_t bytes = 0;  // checkpoint payload
  size_t tensors = 0;
};

struct ModelSetup {
  nlohmann::json hf_config;
  std::string mesh = "ep=2,fsdp=2";  // trainer mesh (make_trainer_layout)
  int tp = 2;
  int replicas = 2;
  bool expert_parallel = false;
  uint64_t seed = 1;
};

ModelFiles write_model(const std::string& dir, const ModelSetup& setup);

// The demo's model: Qwen3-MoE shaped, about 12 MB in BF16.
nlohmann::json demo_model_config();
// The benchmark's model: the same family scaled to about `gigabytes` GB.
nlohmann::json bench_model_config(double gigabytes);

}  // namespace weightsync::demo
