// `weightsync shard`: one trainer rank's local tensors, cut from a checkpoint.
#include "cli.h"

#include <nlohmann/json.hpp>

#include <weightsync/error.h>
#include <weightsync/load_spec.h>
#include <weightsync/safetensors.h>

#include <iostream>

namespace weightsync::cli {
namespace {

const char* kUsage =
    "usage: weightsync shard --checkpoint C --trainer T.json --rank R --out F.safetensors\n\n"
    "Writes trainer rank R's local tensors, as the trainer layout T.json places them, cut\n"
    "straight from checkpoint C (a .safetensors file or an HF directory). Each tensor is\n"
    "stored under its LoadSpec name, in the LoadSpec's dtype, with the rank's local shape\n"
    "(empty shards included with their zero-sized shape); padding is zero-filled.\n\n"
    "Errors: a key missing from C, a key whose shape or dtype differs from the layout,\n"
    "a rank outside the trainer mesh.\n";

int run_shard(const std::vector<std::string>& argv) {
  Args args(argv, {}, {"checkpoint", "trainer", "rank", "out"});
  args.require("rank");
  const int64_t rank = args.get_int("rank", -1);
  const TrainerLayout layout = TrainerLayout::load(args.require("trainer"));
  const Checkpoint checkpoint = Checkpoint::open(args.require("checkpoint"));
  const std::string out = args.require("out");
  write_rank_shard(checkpoint, layout, rank, out);
  std::cerr << "weightsync shard: rank " << rank << " of " << layout.mesh.world() << ", "
            << layout.params.size() << " tensors -> " << out << "\n";
  return 0;
}

const CommandRegistrar registrar{
    {"shard", "write one trainer rank's local tensors from a checkpoint", kUsage, run_shard}};

}  // namespace
}  // namespace weightsync::cli
