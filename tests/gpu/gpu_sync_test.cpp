// End to end on the GPU: `weightsync demo --device cuda` (every rank's tensors
// in GPU memory, one process per rank, several sharing a GPU) syncs the e2e
// suite's architectures CUDA to CUDA over cuda_ipc (device slots) and over UCX
// (pinned host slots). The engines check every committed step bit for bit;
// the demo's versions differ from each other in every byte (demo_job.h), so a
// step that moved nothing could not pass. Also: a killed engine leaves the
// others committing, delta sync into CUDA params (sparse versions; the
// patch and hash kernels), and NCCL with one rank per process where the
// machine has the GPUs for it.
#include "e2e/e2e_helpers.h"
#include "gpu/gpu_test_util.h"

#include <nlohmann/json.hpp>

#include <weightsync/backend/transport.h>
#include <weightsync/layouts.h>
#include "pipeline/wire.h"

namespace weightsync::gpu_test {
namespace {

using e2e::Model;

using e2e::Demo;
using e2e::ints;

Demo run_demo(const Model& m, const std::string& transport, std::vector<std::string> extra,
              const std::string& dump = "") {
  extra.insert(extra.begin(), {"--device", "cuda", "--transport", transport, "--timeout", "120"});
  return e2e::run_model_demo(m, extra, dump, 600);
}

void expect_all_good(const Model& m, const Demo& d, int engines, const std::string& dump) {
  ASSERT_EQ(d.run.exit_code, 0) << d.run.output;
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  std::vector<int> all(static_cast<size_t>(engines));
  for (int g = 0; g < engines; ++g) all[static_cast<size_t>(g)] = g;
  for (const auto& row : d.summary["steps"]) {
    EXPECT_EQ(ints(row["committed"]), all) << "step " << row["step"];
    EXPECT_EQ(ints(row["verified"]), all) << "step " << row["step"];
  }
  const EngineConfig config = load_engine_config(m.engine);
  for (int g = 0; g < engines; ++g) {
    const std::string file = dump + "/engine" + std::to_string(g / config.tp) + "-rank" +
                             std::to_string(g % config.tp) + ".safetensors";
    EXPECT_EQ(e2e::compare_with_materialize(m, file, g), "") << file;
  }
}

struct Arch {
  const char* label;
  const char* model;
  const char* mesh;
  int tp, replicas;
  bool expert_parallel;
  std::vector<std::string> options;
};

const Arch kArchs[] = {
    {"qwen3_moe_broadcast",
     "tiny-qwen3-moe",
     "ep=2,fsdp=2",
     2,
     2,
     false,
     {"--mode", "broadcast", "--bucket-bytes", "4096", "--steps", "2"}},
    {"llama_uneven_p2p",
     "tiny-llama",
     "fsdp=3",
     2,
     1,
     false,
     {"--bucket-bytes", "2048", "--steps", "3"}},
    {"qwen2_broadcast_staging",
     "tiny-qwen2",
     "fsdp=3",
     2,
     1,
     false,
     {"--mode", "broadcast", "--staging", "--steps", "2"}},
    {"deepseek_v3_expert_parallel",
     "tiny-deepseek-v3",
     "ep=2,fsdp=2",
     2,
     1,
     true,
     {"--bucket-bytes", "8192", "--steps", "2"}},
};

struct Case {
  std::string transport;  // "cuda_ipc" (device slots) or "ucx" (pinned slots)
  Arch arch;
};

// So that test listings show the case, not the struct's bytes.
void PrintTo(const Case& c, std::ostream* out) {
  *out << c.transport << " " << c.arch.label;
}

class GpuSync : public ::testing::TestWithParam<Case> {};

TEST_P(GpuSync, CudaToCudaBitExactAfterEveryStep) {
  REQUIRE_GPU();
  const Case& c = GetParam();
  REQUIRE_TRANSPORT(c.transport);
  const Model m = e2e::make_model(c.arch.model, c.arch.mesh, c.arch.tp, c.arch.replicas,
                                  c.arch.expert_parallel);
  const std::string dump = m.dir + "/dump";
  const auto d = run_demo(m, c.transport, c.arch.options, dump);
  expect_all_good(m, d, c.arch.tp * c.arch.replicas, dump);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const char* t : {"cuda_ipc", "ucx"})
    for (const Arch& a : kArchs) out.push_back({t, a});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Architectures, GpuSync, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.transport + "_" + info.param.arch.label;
                         });

TEST(GpuSyncFailures, EngineKilledMidStepLeavesTheOthersCommitting) {
  REQUIRE_GPU();
  REQUIRE_TRANSPORT("cuda_ipc");
  const Model m = e2e::make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const auto d =
      run_demo(m, "cuda_ipc",
               {"--staging", "--steps", "3", "--bucket-bytes", "4096", "--kill", "engine:3:2"});
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0);
  const auto& steps = d.summary["steps"];
  EXPECT_EQ(ints(steps[0]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  for (int s = 1; s < 3; ++s) {
    EXPECT_EQ(ints(steps[s]["committed"]), (std::vector<int>{0, 1, 2})) << "step " << s + 1;
    EXPECT_EQ(ints(steps[s]["verified"]), (std::vector<int>{0, 1, 2})) << "step " << s + 1;
  }
  for (const auto& c : d.summary["children"])
    if (c["label"] == "engine 3")
      EXPECT_NE(c["status"].get<std::string>().find("signal 9"), std::string::npos);
    else
      EXPECT_EQ(c["status"], "exit 0") << c["label"];
}

// Delta sync into CUDA params (docs/delta.md): the frames land in pinned
// host slots (UCX), the CPU checks them and builds the tables, the patch and
// hash kernels apply them on the device. Version 1 goes whole, the later
// ones as deltas of about 2 % of the elements; every engine rank bit-exact
// after every step, on a p2p MoE job in 2 replicas and an uneven dense one.
TEST(GpuSyncDelta, CudaParamsTakeDeltasBitExact) {
  REQUIRE_GPU();
  REQUIRE_TRANSPORT("ucx");
  struct Job {
    const char *model, *mesh;
    int tp, replicas;
    bool expert_parallel;
  };
  for (const Job& j : {Job{"tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2, false},
                       Job{"tiny-llama", "fsdp=3", 2, 1, false}}) {
    SCOPED_TRACE(j.model);
    const Model m = e2e::make_model(j.model, j.mesh, j.tp, j.replicas, j.expert_parallel);
    const std::string dump = m.dir + "/dump";
    const auto d = run_demo(
        m, "ucx", {"--delta", "--update", "random:0.02", "--steps", "3", "--bucket-bytes", "8192"},
        dump);
    expect_all_good(m, d, j.tp * j.replicas, dump);
    const auto& steps = d.summary["steps"];
    ASSERT_EQ(steps.size(), 3u) << d.run.output;
    EXPECT_EQ(steps[0]["delta_buckets"].get<int>(), 0) << "version 1 goes whole";
    for (size_t s = 1; s < 3; ++s)
      EXPECT_GT(steps[s]["delta_buckets"].get<int>(), 0) << "step " << s + 1;
  }
}

// A delta frame damaged on its way to engine rank 1 (one byte, no
// checksums): the CPU's checks of the frame or the digest the kernel
// computes reject step 2 for that rank's replica; step 3 goes whole to it
// and every rank is bit-exact.
TEST(GpuSyncDelta, DamagedDeltaIsCaughtAndTheNextStepGoesWhole) {
  REQUIRE_GPU();
  REQUIRE_TRANSPORT("ucx");
  const Model m = e2e::make_model("tiny-qwen3-moe", "ep=2,fsdp=2", 2, 2);
  const Plan plan = e2e::plan_of(m, "p2p", 4096);
  const Tag tag = bucket_tag(2, plan.buckets_received_by(1).at(0), 0);
  const std::string dump = m.dir + "/dump";
  const auto d = run_demo(
      m, "ucx",
      {"--delta", "--no-checksums", "--steps", "3", "--bucket-bytes", "4096", "--engine-transport",
       "1:fault:ucx?corrupt_recv=1&count=1&tag=" + std::to_string(tag)},
      dump);
  ASSERT_TRUE(d.summary.is_object()) << d.run.output;
  EXPECT_NE(d.run.exit_code, 0) << "a rejected step must fail the demo";
  const auto& steps = d.summary["steps"];
  EXPECT_EQ(ints(steps[1]["committed"]), (std::vector<int>{2, 3}));
  EXPECT_GT(steps[1]["delta_buckets"].get<int>(), 0);
  EXPECT_EQ(ints(steps[2]["committed"]), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(ints(steps[2]["verified"]), (std::vector<int>{0, 1, 2, 3}));
  for (int g = 0; g < 4; ++g) {
    const std::string file =
        dump + "/engine" + std::to_string(g / 2) + "-rank" + std::to_string(g % 2) + ".safetensors";
    EXPECT_EQ(e2e::compare_with_materialize(m, file, g), "") << file;
  }
}

// Broadcast plans with delta sync apply on the host only: CUDA params are
// refused at setup, naming the rank and what to do instead.
TEST(GpuSyncDelta, BroadcastDeltaIntoCudaParamsIsRefusedClearly) {
  REQUIRE_GPU();
  REQUIRE_TRANSPORT("ucx");
  const Model m = e2e::make_model("tiny-llama", "fsdp=2", 1, 1);
  const auto d = run_demo(m, "ucx", {"--mode", "broadcast", "--delta", "--steps", "2"});
  EXPECT_NE(d.run.exit_code, 0);
  EXPECT_NE(d.run.output.find("in broadcast mode applies on the host so far"), std::string::npos)
      << d.run.output;
}

// One GPU per rank: 2 trainer ranks and one engine rank (tp=1).
TEST(GpuSyncNccl, PublisherAndSubscriberRunAStepEndToEnd) {
  REQUIRE_TRANSPORT("nccl");
  REQUIRE_GPUS(3);
  for (const char* mode : {"p2p", "broadcast"}) {
    const Model m = e2e::make_model("tiny-llama", "fsdp=2", 1, 1);
    const std::string dump = m.dir + "/dump";
    const auto d = run_demo(m, "nccl", {"--mode", mode, "--steps", "2"}, dump);
    expect_all_good(m, d, 1, dump);
  }
}

}  // namespace
}  // namespace weightsync::gpu_test
