// FP8 engines on the GPU: `weightsync demo --device cuda` into an FP8 engine
// config, over cuda_ipc and UCX, quantized by the kernel on both sites: by
// the trainer ranks while packing (fsdp=2 of this model holds whole blocks:
// FP8 on the wire) and by the engine ranks after each step. Each committed step is checked by
// the engines (that version quantized on the host), the final dumps against
// `weightsync materialize`.
#include "e2e/e2e_helpers.h"
#include "gpu/gpu_test_util.h"

#include <nlohmann/json.hpp>

#include <weightsync/backend/transport.h>

#include <fstream>

namespace weightsync::gpu_test {
namespace {

TEST(GpuFp8Sync, CudaEnginesQuantizeBitExactlyAfterEveryStep) {
  REQUIRE_GPU();
  for (const char* site : {"sender", "engine"})
    for (const char* transport : {"cuda_ipc", "ucx"}) {
      SCOPED_TRACE(std::string("FP8 site ") + site);
      const auto built = transport_names();
      if (std::find(built.begin(), built.end(), transport) == built.end()) continue;
      const e2e::Model m = e2e::make_model("tiny-fp8-qwen3-moe", "fsdp=2", 2, 1);
      nlohmann::json engine = e2e::read_json(m.engine);
      engine["quantization"] = {{"method", "fp8"}, {"weight_block_size", {128, 128}}};
      std::ofstream(m.engine, std::ios::trunc) << engine.dump();
      const std::string dump = m.dir + "/dump", summary = m.dir + "/summary.json";
      const auto run = e2e::run_cli(
          {"demo",       "--device",  "cuda",    "--transport",    transport,       "--checkpoint",
           m.checkpoint, "--trainer", m.trainer, "--engine",       m.engine,        "--summary",
           summary,      "--timeout", "120",     "--work-dir",     m.dir + "/work", "--dump",
           dump,         "--steps",   "3",       "--bucket-bytes", "131072",        "--fp8-site",
           site},
          600);
      ASSERT_EQ(run.exit_code, 0) << transport << ": " << run.output;
      const nlohmann::json s = e2e::read_json(summary);
      ASSERT_EQ(s["steps"].size(), 3u) << run.output;
      for (const auto& row : s["steps"]) EXPECT_EQ(row["verified"].size(), 2u) << transport;
      for (int g = 0; g < 2; ++g)
        EXPECT_EQ(e2e::compare_with_materialize(
                      m, dump + "/engine0-rank" + std::to_string(g) + ".safetensors", g),
                  "")
            << transport << " engine rank " << g;
    }
}

}  // namespace
}  // namespace weightsync::gpu_test
