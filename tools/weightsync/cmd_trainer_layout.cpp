// `weightsync trainer-layout`: an XTuner-style trainer layout from an HF config.
#include "cli.h"

#include <weightsync/error.h>
#include <weightsync/trainer_layout.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

namespace weightsync::cli {
namespace {

const char* kUsage =
    "usage: weightsync trainer-layout --hf-config config.json --mesh ep=2,fsdp=4\n"
    "                                 [--dtype BF16] [--out F.json]\n\n"
    "Prints (or writes to F.json) the trainer layout JSON of an XTuner-style FSDP2 (+EP)\n"
    "trainer for the model of config.json (llama, qwen2, qwen3, qwen3_moe, qwen2_moe,\n"
    "mixtral, deepseek_v3, kimi_k2).\n\n"
    "  --mesh    named mesh axes with sizes, row-major in the order given. The axis\n"
    "            'fsdp' shards every param on dim 0; 'ep' shards the routed experts on\n"
    "            dim 0 (before fsdp); any other axis replicates.\n"
    "  --dtype   the params' dtype (safetensors name); default: the config's torch_dtype.\n\n"
    "Params:\n"
    "  dense tensors    one param per HF key, named by the key.\n"
    "  routed experts   per MoE layer, two params fused on dim 0:\n"
    "    <block>.experts.gate_up_proj  [E*2*I, H], keys experts.0.gate, experts.0.up,\n"
    "                                  experts.1.gate, ... (expert-major, gate first)\n"
    "    <block>.experts.down_proj     [E*H, I], keys experts.0.down, experts.1.down, ...\n"
    "    <block> is model.layers.L.mlp (Mixtral: model.layers.L.block_sparse_moe; its\n"
    "    gate/up/down are w1/w3/w2).\n"
    "  shared experts, routers and norms are dense params.\n";

int run_trainer_layout(const std::vector<std::string>& argv) {
  Args args(argv, {}, {"hf-config", "mesh", "dtype", "out"});
  const HfModelConfig config = HfModelConfig::load(args.require("hf-config"));
  const Mesh mesh = parse_mesh_spec(args.require("mesh"));
  TrainerLayoutOptions options;
  if (auto d = args.get("dtype")) {
    options.dtype = parse_dtype(*d);
    if (!options.dtype)
      fail(Errc::invalid_argument, "--dtype: unknown dtype '", *d,
           "' (expected a safetensors name such as BF16, F16, F32)");
  }
  const TrainerLayout layout = make_trainer_layout(config, mesh, options);
  const std::string text = layout.to_json().dump(2) + "\n";
  if (auto out = args.get("out")) {
    std::ofstream file(*out);
    file << text;
    file.close();
    if (!file) fail(Errc::io, "cannot write trainer layout to '", *out, "'");
    std::cerr << "weightsync trainer-layout: " << layout.params.size() << " params over "
              << mesh.world() << " ranks -> " << *out << "\n";
  } else {
    std::cout << text;
  }
  return 0;
}

const CommandRegistrar registrar{{"trainer-layout",
                                  "generate an XTuner-style trainer layout from an HF config",
                                  kUsage, run_trainer_layout}};

}  // namespace
}  // namespace weightsync::cli
