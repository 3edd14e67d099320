// End to end into FP8 engines: BF16 trainer ranks sync into engine configs
// with "quantization" over UCX (the real `weightsync demo`, one process per
// rank); the engine ranks quantize what lands. Every engine checks each
// committed version (a different XOR pattern of the checkpoint each step)
// against that version quantized, FP8 bytes and scales; the last version's
// dumps must equal `weightsync materialize` of the checkpoint bit for bit.
#include "e2e/e2e_helpers.h"

#include <nlohmann/json.hpp>

#include <weightsync/backend/transport.h>
#include <weightsync/layouts.h>

#include <gtest/gtest.h>

#include <algorithm>

namespace weightsync::e2e {
namespace {

// make_model's engine config with FP8 quantization added.
Model fp8_model(const std::string& name, const std::string& mesh, int tp, int replicas, bool ep,
                const std::string& scale) {
  Model m = make_model(name, mesh, tp, replicas, ep);
  nlohmann::json engine = read_json(m.engine);
  engine["quantization"] = {{"method", "fp8"}, {"weight_block_size", {128, 128}}, {"scale", scale}};
  std::ofstream(m.engine, std::ios::trunc) << engine.dump();
  return m;
}

// Returns the demo's summary (empty after a failed assertion).
nlohmann::json sync_and_compare(const Model& m, int engines, int steps,
                                std::vector<std::string> extra) {
  nlohmann::json out;
  [&] {
    const std::string dump = m.dir + "/dump";
    const std::string summary = m.dir + "/summary.json";
    std::vector<std::string> args{"demo",
                                  "--checkpoint",
                                  m.checkpoint,
                                  "--trainer",
                                  m.trainer,
                                  "--engine",
                                  m.engine,
                                  "--summary",
                                  summary,
                                  "--timeout",
                                  "60",
                                  "--work-dir",
                                  m.dir + "/work",
                                  "--dump",
                                  dump,
                                  "--steps",
                                  std::to_string(steps)};
    args.insert(args.end(), extra.begin(), extra.end());
    const CliRun run = run_cli(args);
    ASSERT_EQ(run.exit_code, 0) << run.output;
    const nlohmann::json s = read_json(summary);
    ASSERT_TRUE(s.is_object()) << run.output;
    EXPECT_TRUE(s["ok"].get<bool>()) << run.output;
    ASSERT_EQ(s["steps"].size(), static_cast<size_t>(steps)) << run.output;
    for (const auto& row : s["steps"]) {
      EXPECT_EQ(row["committed"].size(), static_cast<size_t>(engines)) << "step " << row["step"];
      EXPECT_EQ(row["verified"].size(), static_cast<size_t>(engines)) << "step " << row["step"];
    }
    const EngineLayout layout = make_engine_layout(load_engine_spec(m.engine));
    int fp8_params = 0;
    for (const auto& p : layout.ranks[0].params) fp8_params += p.dtype == DType::F8_E4M3;
    ASSERT_GT(fp8_params, 0) << "the engine config holds no FP8 param";
    for (int g = 0; g < engines; ++g) {
      const std::string file = dump_file(dump, layout, g);
      EXPECT_EQ(compare_with_materialize(m, file, g), "") << file;
    }
    out = s;
  }();
  return out;
}

int64_t wire_bytes(const nlohmann::json& summary) {
  int64_t total = 0;
  for (const auto& row : summary["steps"]) total += row["engine_bytes_total"].get<int64_t>();
  return total;
}

TEST(E2EFp8, LlamaTp2P2pSmallBuckets) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  // Buckets of 64 KiB split the weights (a 512 x 320 BF16 qkv is 320 KiB).
  const Model m = fp8_model("tiny-fp8-llama", "fsdp=2", 2, 1, false, "fp32");
  sync_and_compare(m, 2, 3, {"--bucket-bytes", "65536"});
}

TEST(E2EFp8, Qwen3MoeExpertParallelBroadcastStagingUe8m0) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  const Model m = fp8_model("tiny-fp8-qwen3-moe", "ep=2,fsdp=1", 2, 1, true, "ue8m0");
  sync_and_compare(m, 2, 3, {"--mode", "broadcast", "--staging", "--bucket-bytes", "131072"});
}

TEST(E2EFp8, SenderAndEngineQuantizationGiveTheSameBytesAndTheSenderHalvesTheWire) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  // ep=2 x fsdp=1: every trainer rank holds whole weights, so with the
  // default site every FP8 param travels quantized; the other run quantizes
  // them all on the engines. Each must verify every step and match
  // materialize; the FP8 weights (most of the model) cross in half the bytes.
  const Model m = fp8_model("tiny-fp8-deepseek-v3", "ep=2,fsdp=1", 2, 1, false, "fp32");
  const nlohmann::json sender = sync_and_compare(m, 2, 3, {"--fp8-site", "sender"});
  const nlohmann::json engine = sync_and_compare(m, 2, 3, {"--fp8-site", "engine"});
  ASSERT_TRUE(sender.is_object() && engine.is_object());
  const int64_t s = wire_bytes(sender), e = wire_bytes(engine);
  std::printf("wire bytes over 3 steps: %lld quantized by the senders, %lld by the engines\n",
              static_cast<long long>(s), static_cast<long long>(e));
  EXPECT_GT(s, 0);
  EXPECT_LT(static_cast<double>(s), 0.7 * static_cast<double>(e))
      << "sender-quantized " << s << " bytes, engine-quantized " << e;
  // What the plan predicts, exactly: 3 steps of the plan's bytes.
  const Plan plan = make_plan(TrainerLayout::load(m.trainer),
                              make_engine_layout(load_engine_spec(m.engine)), Topology{}, {});
  EXPECT_EQ(s, 3 * plan.stats().bytes_total);
  EXPECT_EQ(e, 3 * plan.stats().bytes_total_engine_site);
}

// Delta sync into FP8 engines: quantized by the senders (FP8 codes and
// scales diffed as bytes) or on the engines (the source bytes diffed; in
// p2p and broadcast plans), codes and scales bit-exact every step; the
// later steps move a small part.
TEST(E2EFp8, DeltaSyncKeepsCodesAndScalesBitExact) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  const std::pair<const char*, const char*> cases[] = {
      {"sender", "p2p"}, {"engine", "p2p"}, {"engine", "broadcast"}};
  for (const auto& [site, mode] : cases) {
    SCOPED_TRACE(std::string(site) + " site, " + mode);
    // ep=2 x fsdp=1: whole blocks on every trainer rank (the sender site quantizes all).
    const Model m = fp8_model("tiny-fp8-qwen3-moe", "ep=2,fsdp=1", 2, 1, true, "fp32");
    const nlohmann::json s =
        sync_and_compare(m, 2, 3,
                         {"--fp8-site", site, "--mode", mode, "--delta", "--update", "random:0.02",
                          "--bucket-bytes", "131072"});
    if (!s.is_object()) continue;
    const auto& steps = s["steps"];
    const auto whole = steps[0]["engine_bytes_total"].get<int64_t>();
    for (size_t k = 1; k < 3; ++k) {
      EXPECT_GT(steps[k]["delta_buckets"].get<int>(), 0) << "step " << k + 1;
      EXPECT_LT(steps[k]["engine_bytes_total"].get<int64_t>() * 2, whole) << "step " << k + 1;
    }
    std::printf("FP8 engines, %s-site quantization, %s, delta: %lld bytes whole, then %lld, %lld\n",
                site, mode, static_cast<long long>(whole),
                static_cast<long long>(steps[1]["engine_bytes_total"].get<int64_t>()),
                static_cast<long long>(steps[2]["engine_bytes_total"].get<int64_t>()));
  }
}

TEST(E2EFp8, DeepseekV3Tp2TwoReplicas) {
  if (!have_ucx()) GTEST_SKIP() << "weightsync was built without UCX";
  const Model m = fp8_model("tiny-fp8-deepseek-v3", "fsdp=2", 2, 2, false, "fp32");
  sync_and_compare(m, 4, 2, {"--bucket-bytes", "262144"});
}

}  // namespace
}  // namespace weightsync::e2e
