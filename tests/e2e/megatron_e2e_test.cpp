// Megatron-Core trainers end to end, with real processes: trainer ranks in
// Megatron's layout (`weightsync trainer-layout --style megatron`: grouped
// QKV, per-rank [gate; up], padded vocab, pipeline stages, expert TP) fill
// their params from a checkpoint as `weightsync shard` cuts them, then
// - `weightsync demo` syncs versions into vLLM engines of tp=2 and tp=4
//   (direct) beside a framework-"hf" replica (load_weights mode: whole HF
//   tensors), every engine rank checked bit for bit after every step, each
//   step carrying different bytes (the demo XORs every version but the last
//   with its own pattern), and the dumps equal `materialize`;
// - `weightsync export` saves an HF checkpoint directory from the same
//   trainers, equal to the source key by key, byte for byte.
// The trainers fill their params through the layout itself, so these check
// the machinery (segments, stages, expert grids through the planner,
// publisher, subscribers and save); that the layout is Megatron's own is
// checked against an independent reference in tests/python
// (test_megatron_layout.py, test_e2e_megatron.py).
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <weightsync/backend/transport.h>
#include <weightsync/layouts.h>

#include <gtest/gtest.h>

#include <algorithm>

namespace weightsync::e2e {
namespace {

struct MegatronCase {
  std::string name, model, parallel;
  nlohmann::json engines;  // engine groups (the model's hf_config is filled in)
  std::string mode = "p2p";
};

void PrintTo(const MegatronCase& c, std::ostream* os) {
  *os << c.name;
}

// The model's random checkpoint, a Megatron trainer layout of it (made by the
// CLI, as a user would) and the engine groups.
Model megatron_model(const MegatronCase& c) {
  Model m = make_model(c.model, "fsdp=1", 1, 1);
  const CliRun layout = run_cli({"trainer-layout", "--style", "megatron", "--hf-config",
                                 config_path(c.model), "--mesh", c.parallel, "--out", m.trainer});
  if (layout.exit_code != 0) throw std::runtime_error("trainer-layout failed: " + layout.output);
  nlohmann::json groups = c.engines;
  for (auto& g : groups) {
    g["hf_config"] = config_path(c.model);
    g["dtype"] = dtype_name(HfModelConfig::load(config_path(c.model)).dtype);
  }
  std::ofstream(m.engine) << groups.dump();
  return m;
}

nlohmann::json engine(const char* framework, int tp, int replicas, bool ep = false) {
  return {{"framework", framework},
          {"tp", tp},
          {"replicas", replicas},
          {"expert_parallel", ep},
          {"expert_placement", "linear"}};
}

class MegatronSync : public ::testing::TestWithParam<MegatronCase> {};

TEST_P(MegatronSync, EveryEngineRankBitExactAfterEveryStep) {
  REQUIRE_UCX();
  const MegatronCase& c = GetParam();
  const Model m = megatron_model(c);
  const TrainerLayout trainer = TrainerLayout::load(m.trainer);
  ASSERT_EQ(trainer.mesh.axes.front(), "pp");
  const std::string dump = m.dir + "/dump", summary = m.dir + "/summary.json";
  const int steps = 3;
  const CliRun run = run_cli({"demo",          "--checkpoint", m.checkpoint,
                              "--trainer",     m.trainer,      "--engine",
                              m.engine,        "--steps",      std::to_string(steps),
                              "--mode",        c.mode,         "--bucket-bytes",
                              "4096",          "--summary",    summary,
                              "--timeout",     "60",           "--work-dir",
                              m.dir + "/work", "--dump",       dump});
  ASSERT_EQ(run.exit_code, 0) << run.output;
  const nlohmann::json s = read_json(summary);
  ASSERT_TRUE(s.is_object()) << run.output;
  EXPECT_TRUE(s["ok"].get<bool>());
  const EngineLayout layout = make_engine_layout(load_engine_spec(m.engine));
  std::vector<int> all(static_cast<size_t>(layout.world()));
  for (int g = 0; g < layout.world(); ++g) all[static_cast<size_t>(g)] = g;
  ASSERT_EQ(s["steps"].size(), static_cast<size_t>(steps));
  for (const auto& row : s["steps"]) {
    EXPECT_EQ(row["committed"].get<std::vector<int>>(), all) << "step " << row["step"];
    EXPECT_EQ(row["verified"].get<std::vector<int>>(), all) << "step " << row["step"];
  }
  // Every pipeline stage's ranks sent bytes (a stage that sent nothing would
  // leave its layers at zero, which the checks above would catch too).
  const Plan plan = plan_of(m, c.mode, 4096);
  const auto& sent = plan.stats().bytes_per_trainer_rank;
  const int64_t per_stage = trainer.mesh.world() / trainer.mesh.shape[0];
  for (int64_t st = 0; st < trainer.mesh.shape[0]; ++st) {
    int64_t bytes = 0;
    for (int64_t r = st * per_stage; r < (st + 1) * per_stage; ++r)
      bytes += sent[static_cast<size_t>(r)];
    EXPECT_GT(bytes, 0) << "stage " << st;
  }
  for (int g = 0; g < layout.world(); ++g) {
    const std::string file = dump_file(dump, layout, g);
    EXPECT_EQ(compare_with_materialize(m, file, g), "") << file;
  }
  std::filesystem::remove_all(m.dir);
}

INSTANTIATE_TEST_SUITE_P(
    Trainers, MegatronSync,
    ::testing::Values(
        // The case: pp=2 x tp=2 into vLLM tp=2 and tp=4 (4 > the 2
        // query groups: vLLM replicates KV heads) and a load_weights replica.
        MegatronCase{"llama_pp2_tp2",
                     "tiny-llama",
                     "pp=2,tp=2",
                     {engine("vllm", 2, 1), engine("vllm", 4, 1), engine("hf", 1, 1)}},
        // Tied embeddings (the last stage's copy sends nothing), QKV biases,
        // dp replicas, broadcast mode.
        MegatronCase{"qwen2_tied_pp2_tp2_dp2",
                     "tiny-qwen2",
                     "pp=2,tp=2,dp=2",
                     {engine("vllm", 2, 1), engine("hf", 1, 1)},
                     "broadcast"},
        // Three stages of one layer, experts over ep=2 with expert TP 1
        // beside attention TP 2, into an expert-parallel vLLM replica.
        MegatronCase{"qwen3_moe_pp3_tp2_ep2_etp1",
                     "tiny-qwen3-moe",
                     "pp=3,tp=2,ep=2,etp=1",
                     {engine("vllm", 2, 1, true), engine("hf", 1, 1)}},
        // MLA, a dense first layer, shared experts, expert bias.
        MegatronCase{"deepseek_v3_pp3_tp2_ep2",
                     "tiny-deepseek-v3",
                     "pp=3,tp=2,ep=2,etp=1",
                     {engine("vllm", 2, 1), engine("hf", 1, 1)}}),
    [](const ::testing::TestParamInfo<MegatronCase>& info) { return info.param.name; });

// The same trainers save an HF checkpoint (`weightsync export`): every key of
// the source once, equal byte for byte, whatever the file limit.
class MegatronSave : public ::testing::TestWithParam<MegatronCase> {};

TEST_P(MegatronSave, DirectoryEqualsTheSource) {
  REQUIRE_UCX();
  const MegatronCase& c = GetParam();
  const Model m = megatron_model(c);
  for (const char* limit : {"3000", "5000000000"}) {
    SCOPED_TRACE(limit);
    const std::string out = m.dir + "/out";
    const CliRun run = run_cli({"export", "--checkpoint", m.checkpoint, "--trainer", m.trainer,
                                "--out", out, "--max-file-bytes", limit, "--bucket-bytes", "4096",
                                "--timeout", "60", "--work-dir", m.dir + "/work", "--json"});
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const Checkpoint a = Checkpoint::open(m.checkpoint), b = Checkpoint::open(out);
    ASSERT_EQ(a.keys(), b.keys());
    for (const std::string& k : a.keys()) {
      const TensorView x = a.view(k), y = b.view(k);
      ASSERT_EQ(x.dtype, y.dtype) << k;
      ASSERT_EQ(x.shape, y.shape) << k;
      EXPECT_EQ(std::memcmp(x.data, y.data, x.nbytes()), 0) << "bytes of " << k;
    }
    EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors.index.json"));
  }
  std::filesystem::remove_all(m.dir);
}

INSTANTIATE_TEST_SUITE_P(
    Trainers, MegatronSave,
    ::testing::Values(
        MegatronCase{"llama_pp2_tp2", "tiny-llama", "pp=2,tp=2", {}},
        MegatronCase{"qwen2_tied_pp2_tp2_dp2", "tiny-qwen2", "pp=2,tp=2,dp=2", {}},
        MegatronCase{
            "qwen3_moe_tp2_dp2_ep2_etp2", "tiny-qwen3-moe", "pp=1,tp=2,dp=2,ep=2,etp=2", {}},
        MegatronCase{"deepseek_v3_pp3_tp2_ep2", "tiny-deepseek-v3", "pp=3,tp=2,ep=2,etp=1", {}}),
    [](const ::testing::TestParamInfo<MegatronCase>& info) { return info.param.name; });

}  // namespace
}  // namespace weightsync::e2e
