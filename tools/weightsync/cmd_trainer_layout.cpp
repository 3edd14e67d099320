// `weightsync trainer-layout`: a trainer layout (XTuner, transformers or
// Megatron-Core style) from an HF config.
#include "cli.h"

#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

namespace weightsync::cli {
namespace {

const char* kUsage =
    "usage: weightsync trainer-layout --hf-config config.json --mesh ep=2,fsdp=4\n"
    "                                 [--style xtuner|transformers] [--dtype BF16] [--out "
    "F.json]\n"
    "       weightsync trainer-layout --style megatron --hf-config config.json\n"
    "                                 --mesh pp=P,tp=T,dp=D[,cp=C][,ep=E,etp=N]\n"
    "                                 [--vocab-divisible-by 128] [--pp-first-layers N]\n"
    "                                 [--pp-last-layers N] [--dtype BF16] [--out F.json]\n\n"
    "Prints (or writes to F.json) the trainer layout JSON of an FSDP2 (+EP) trainer for\n"
    "the model of config.json (llama, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral,\n"
    "deepseek_v3, kimi_k2), or of a Megatron-Core trainer (--style megatron).\n\n"
    "  --mesh    named mesh axes with sizes, row-major in the order given. The axis\n"
    "            'fsdp' shards every param on dim 0; 'ep' shards the routed experts on\n"
    "            dim 0 (before fsdp); any other axis replicates.\n"
    "  --dtype   the params' dtype (safetensors name); default: the config's torch_dtype.\n"
    "  --style   xtuner (default) or transformers: how the params are named and shaped.\n\n"
    "Params, --style xtuner:\n"
    "  dense tensors    one param per HF key, named by the key.\n"
    "  routed experts   per MoE layer, two params fused on dim 0:\n"
    "    <block>.experts.gate_up_proj  [E*2*I, H], keys experts.0.gate, experts.0.up,\n"
    "                                  experts.1.gate, ... (expert-major, gate first)\n"
    "    <block>.experts.down_proj     [E*H, I], keys experts.0.down, experts.1.down, ...\n"
    "    <block> is model.layers.L.mlp (Mixtral: model.layers.L.block_sparse_moe; its\n"
    "    gate/up/down are w1/w3/w2).\n"
    "  shared experts, routers and norms are dense params.\n\n"
    "Params, --style transformers (as transformers >= 5 holds the model in memory, e.g.\n"
    "the named_parameters() of an FSDP2-wrapped AutoModelForCausalLM):\n"
    "  dense tensors    named by the HF key (Mixtral: block_sparse_moe. is mlp.).\n"
    "  routed experts   per MoE layer, two params stacked on dim 0 (LoadSpec stack_dim 0):\n"
    "    model.layers.L.mlp.experts.gate_up_proj  [E, 2*I, H], per expert gate then up\n"
    "    model.layers.L.mlp.experts.down_proj     [E, H, I]\n"
    "    sharded on dim 0 (experts) over 'ep' first, then 'fsdp'.\n\n"
    "Params, --style megatron (llama, qwen2, qwen3, qwen3_moe, mixtral, deepseek_v3): as\n"
    "Megatron-Core holds them with Transformer Engine layers, each rank's named_parameters()\n"
    "(docs/megatron.md). --mesh gives Megatron's parallel sizes (absent ones 1; etp defaults\n"
    "to tp); ranks in Megatron's order tp-cp-ep-dp-pp.\n"
    "  stages           layers split over pp as Megatron-Core does (--pp-first-layers and\n"
    "                   --pp-last-layers: num_layers_in_first/last_pipeline_stage); a\n"
    "                   stage's params carry stage {pp, s} and local names decoder.layers.{l}.\n"
    "  attention        self_attention.linear_qkv.weight: per query group [q heads; k; v],\n"
    "                   rows cut in tp equal blocks (whole groups, or blocks of a group when\n"
    "                   tp > groups); linear_proj tp on dim 1; MLA: linear_q_down_proj,\n"
    "                   linear_q_up_proj, linear_kv_down_proj, linear_kv_up_proj.\n"
    "  mlp              linear_fc1 [gate; up] with tp rank r holding [gate_r; up_r];\n"
    "                   linear_fc2 tp on dim 1; experts: mlp.experts.linear_fc1.weight{e},\n"
    "                   linear_fc2.weight{e} for local expert e (EP rank r: global expert\n"
    "                   r*E/ep + e), etp inside; router, shared_experts.\n"
    "  vocab            embedding / output_layer padded to a multiple of\n"
    "                   --vocab-divisible-by x tp (default 128; 0: no padding).\n"
    "  mesh             pp, then the ranks of a stage as row-major axes (dense: dp, cp, tp;\n"
    "                   MoE: <dense>_<expert> parts such as dp_edp, dp_ep, tp_etp).\n";

int run_trainer_layout(const std::vector<std::string>& argv) {
  Args args(argv, {},
            {"hf-config", "mesh", "dtype", "out", "style", "vocab-divisible-by", "pp-first-layers",
             "pp-last-layers"});
  const HfModelConfig config = HfModelConfig::load(args.require("hf-config"));
  const Mesh mesh = parse_mesh_spec(args.require("mesh"));
  TrainerLayoutOptions options;
  if (auto d = args.get("dtype")) {
    options.dtype = parse_dtype(*d);
    if (!options.dtype)
      fail(Errc::invalid_argument, "--dtype: unknown dtype '", *d,
           "' (expected a safetensors name such as BF16, F16, F32)");
  }
  if (auto style = args.get("style")) options.style = parse_trainer_layout_style(*style);
  const bool megatron = options.style == TrainerLayoutStyle::megatron;
  for (const char* o : {"vocab-divisible-by", "pp-first-layers", "pp-last-layers"})
    if (args.has(o) && !megatron)
      fail(Errc::invalid_argument, "--", o, " applies to --style megatron only");
  options.megatron.vocab_divisible_by = args.get_int("vocab-divisible-by", 128);
  if (args.has("pp-first-layers"))
    options.megatron.first_stage_layers = args.get_int("pp-first-layers", 0);
  if (args.has("pp-last-layers"))
    options.megatron.last_stage_layers = args.get_int("pp-last-layers", 0);
  const TrainerLayout layout = make_trainer_layout(config, mesh, options);
  const std::string text = layout.to_json().dump(2) + "\n";
  if (auto out = args.get("out")) {
    std::ofstream file(*out);
    file << text;
    file.close();
    if (!file) fail(Errc::io, "cannot write trainer layout to '", *out, "'");
    std::cerr << "weightsync trainer-layout: " << layout.params.size() << " params over "
              << layout.mesh.world() << " ranks -> " << *out << "\n";
  } else {
    std::cout << text;
  }
  return 0;
}

const CommandRegistrar registrar{
    {"trainer-layout",
     "generate a trainer layout (XTuner, transformers or Megatron style) from an HF config", kUsage,
     run_trainer_layout}};

}  // namespace
}  // namespace weightsync::cli
