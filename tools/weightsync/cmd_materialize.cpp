// `weightsync materialize`: one engine rank's parameters built straight from a
// checkpoint: the reference a weight sync must reproduce.
#include "cli.h"

#include <nlohmann/json.hpp>

#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>
#include <weightsync/materialize.h>
#include <weightsync/safetensors.h>

#include <chrono>
#include <cstdio>

namespace weightsync::cli {
namespace {

const char* kUsage =
    "usage: weightsync materialize --checkpoint C --engine E.json --rank R --out F\n\n"
    "Writes engine rank R's parameters, under the engine's names, to the\n"
    ".safetensors file F, straight from checkpoint C (a .safetensors file or an\n"
    "HF directory). R may be any global engine rank (the replicas of a group are\n"
    "identical). E may hold an array of engine configs (groups of replicas, ranks\n"
    "numbered group by group). Padding (vocab rows past vocab_size) is zero.\n";

int run(const std::vector<std::string>& argv) {
  Args args(argv, {}, {"checkpoint", "engine", "rank", "out"});
  const std::string out = args.require("out");
  const EngineLayout layout = make_engine_layout(load_engine_spec(args.require("engine")));
  const int64_t rank = args.get_int("rank", -1);
  if (!args.has("rank")) fail(Errc::invalid_argument, "missing required option --rank");
  if (rank < 0 || rank >= layout.world())
    fail(Errc::invalid_argument, "--rank ", rank, " is outside the engine's ", layout.world(),
         " ranks (", layout.num_replicas(), " replicas)");
  const Checkpoint ckpt = Checkpoint::open(args.require("checkpoint"));
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t bytes = materialize(ckpt, layout, static_cast<int>(rank), out);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr,
               "materialize: rank %lld (replica rank %lld): %zu params, %llu bytes -> %s "
               "(%.3f s)\n",
               static_cast<long long>(rank),
               static_cast<long long>(layout.rank_layout(static_cast<int>(rank)).rank),
               layout.rank_layout(static_cast<int>(rank)).params.size(),
               static_cast<unsigned long long>(bytes), out.c_str(), s);
  return 0;
}

const CommandRegistrar registrar{
    {"materialize", "build one engine rank's parameters from a checkpoint", kUsage, run}};

}  // namespace
}  // namespace weightsync::cli
