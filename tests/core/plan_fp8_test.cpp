// Plans into FP8 engines: quantized on the engine, a quantized weight
// receives its trainer's BF16 (or F16, F32) bytes, every element once, in
// both plan modes; quantized on the senders (p2p, where every item of the
// param holds whole 128 x 128 blocks) its FP8 codes and block scales; a
// trainer dtype the quantizer cannot take is a clear error naming the param
// and the key.
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>
#include <weightsync/plan.h>
#include <weightsync/topology.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace weightsync {
namespace {

HfModelConfig model(const std::string& name) {
  return HfModelConfig::load(std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/" + name +
                             "/config.json");
}

EngineLayout fp8_engine(const HfModelConfig& config, int tp, bool ep) {
  EngineConfig c;
  c.framework = "vllm";
  c.hf = config;
  c.tp = tp;
  c.expert_parallel = ep;
  c.replicas = 2;
  c.dtype = config.dtype;
  c.quantization = BlockQuant{};
  return make_engine_layout(c);
}

TEST(Fp8Plan, QuantizedWeightsReceiveTheTrainersBytes) {
  for (const char* name : {"tiny-fp8-llama", "tiny-fp8-qwen3-moe", "tiny-fp8-deepseek-v3"})
    for (PlanMode mode : {PlanMode::p2p, PlanMode::broadcast}) {
      const HfModelConfig config = model(name);
      const TrainerLayout trainer = make_trainer_layout(config, parse_mesh_spec("fsdp=3"));
      const EngineLayout engine = fp8_engine(config, 2, mode == PlanMode::p2p);
      const Plan plan = make_plan(trainer, engine, Topology{}, {mode, 64 << 10, Fp8Site::engine});
      EXPECT_NO_THROW(verify_plan(plan, trainer, engine)) << name;
      EXPECT_EQ(plan.stats().fp8_params_sender, 0) << name;
      EXPECT_GT(plan.stats().fp8_params_engine, 0) << name;
      EXPECT_EQ(plan.stats().bytes_total, plan.stats().bytes_total_engine_site) << name;
      // Each engine rank receives 2 bytes (BF16) per element its segments
      // cover, FP8 weights included; scale params receive nothing.
      for (int g = 0; g < engine.world(); ++g) {
        int64_t elements = 0, fp8 = 0;
        for (const EngineParam& p : engine.rank_layout(g).params)
          for (const Segment& s : p.segments) {
            elements += s.hf_box.numel();
            if (p.quant) fp8 += s.hf_box.numel();
          }
        ASSERT_GT(fp8, 0) << name;
        if (mode == PlanMode::p2p)
          EXPECT_EQ(plan.stats().bytes_per_engine_rank.at(static_cast<size_t>(g)), 2 * elements)
              << name << " engine rank " << g;
      }
    }
}

// The bytes a sender-quantized segment puts on the wire: one per element and
// four per (whole or edge) block.
int64_t fp8_bytes(const Box& b) {
  return b.numel() + 4 * ((b.lengths[0] + 127) / 128) * ((b.lengths[1] + 127) / 128);
}

struct SiteCount {
  int64_t sender_items = 0, engine_items = 0;
};

// Checks every item of a p2p plan: a sender-quantized one is on block
// boundaries of its segment and weighs fp8_bytes; others their BF16 bytes.
SiteCount check_items(const Plan& plan, const EngineLayout& engine, const std::string& what) {
  SiteCount n;
  for (const PlanItem& item : plan.items()) {
    const Copy c = plan.resolve(item);
    const int t = plan.engine_template(c.dst_rank);
    const EngineParam& p =
        engine.rank_layout(c.dst_rank).params.at(static_cast<size_t>(c.dst_param));
    EXPECT_EQ(c.fp8, plan.fp8_on_sender(t, c.dst_param)) << what << " " << p.name;
    if (!c.fp8) {
      ++n.engine_items;
      EXPECT_EQ(c.bytes, 2 * c.hf_box.numel()) << what << " " << p.name;
      continue;
    }
    ++n.sender_items;
    EXPECT_TRUE(p.quant.has_value()) << what << " " << p.name;
    EXPECT_EQ(c.bytes, fp8_bytes(c.hf_box)) << what << " " << p.name;
    EXPECT_EQ(c.scale_param, p.scale_param) << what << " " << p.name;
    const size_t r = c.dst_box.rank();
    for (size_t d = r - 2; d < r; ++d) {
      EXPECT_EQ(c.dst_box.offsets[d] % 128, 0)
          << what << " " << p.name << " " << box_str(c.dst_box);
      EXPECT_EQ(c.scale_box.offsets[d], c.dst_box.offsets[d] / 128) << what << " " << p.name;
      EXPECT_EQ(c.scale_box.lengths[d], (c.dst_box.lengths[d] + 127) / 128)
          << what << " " << p.name;
    }
  }
  return n;
}

TEST(Fp8Plan, SendersHoldingWholeBlocksQuantizeAndHalveTheWireBytes) {
  // fsdp=1 x ep=2: every trainer rank holds whole tensors (dense params are
  // replicated over ep), so every FP8 param can be quantized by its sender.
  for (const char* name : {"tiny-fp8-llama", "tiny-fp8-qwen3-moe", "tiny-fp8-deepseek-v3"}) {
    const HfModelConfig config = model(name);
    const TrainerLayout trainer = make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=1"));
    const EngineLayout engine = fp8_engine(config, 2, false);
    const Plan plan = make_plan(trainer, engine, Topology{}, {PlanMode::p2p, 64 << 10});
    ASSERT_NO_THROW(verify_plan(plan, trainer, engine)) << name;
    EXPECT_EQ(plan.stats().fp8_params_engine, 0) << name;
    EXPECT_GT(plan.stats().fp8_params_sender, 0) << name;
    const SiteCount n = check_items(plan, engine, name);
    EXPECT_GT(n.sender_items, 0) << name;
    // Per engine rank: FP8 codes + scales for FP8 params, BF16 for the rest.
    int64_t engine_site_total = 0;
    for (int g = 0; g < engine.world(); ++g) {
      int64_t want = 0, bf16 = 0, quant_elems = 0;
      for (const EngineParam& p : engine.rank_layout(g).params)
        for (const Segment& s : p.segments) {
          want += p.quant ? fp8_bytes(s.hf_box) : 2 * s.hf_box.numel();
          bf16 += 2 * s.hf_box.numel();
          if (p.quant) quant_elems += s.hf_box.numel();
        }
      EXPECT_EQ(plan.stats().bytes_per_engine_rank.at(static_cast<size_t>(g)), want) << name;
      // The FP8 params' share of the wire is about half of their BF16 bytes.
      EXPECT_LT(want, bf16 - quant_elems + quant_elems / 50) << name;
      engine_site_total += bf16;
    }
    EXPECT_EQ(plan.stats().bytes_total_engine_site, engine_site_total) << name;
    // The same layouts with engine-side quantization: the source bytes.
    const Plan engine_site =
        make_plan(trainer, engine, Topology{}, {PlanMode::p2p, 64 << 10, Fp8Site::engine});
    EXPECT_EQ(engine_site.stats().bytes_total, engine_site_total) << name;
    EXPECT_NE(engine_site.plan_id(), plan.plan_id()) << name;
    EXPECT_EQ(check_items(engine_site, engine, name).sender_items, 0) << name;
  }
}

TEST(Fp8Plan, ParamsWithItemsInsideABlockAreQuantizedOnTheEngine) {
  // fsdp=3 cuts rows at multiples of ceil(rows / 3), mostly inside blocks;
  // fsdp=8 of a deepseek-v3 mixes both kinds of params in one plan.
  for (const char* mesh : {"fsdp=3", "fsdp=8"}) {
    const HfModelConfig config = model("tiny-fp8-deepseek-v3");
    const TrainerLayout trainer = make_trainer_layout(config, parse_mesh_spec(mesh));
    const EngineLayout engine = fp8_engine(config, 2, false);
    const Plan plan = make_plan(trainer, engine, Topology{}, {PlanMode::p2p, 64 << 10});
    ASSERT_NO_THROW(verify_plan(plan, trainer, engine)) << mesh;
    EXPECT_GT(plan.stats().fp8_params_engine, 0) << mesh;
    check_items(plan, engine, mesh);
  }
}

TEST(Fp8Plan, SmallBucketsCutQuantizedItemsIntoWholeBlockRows) {
  const HfModelConfig config = model("tiny-fp8-qwen3-moe");
  const TrainerLayout trainer = make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=1"));
  const EngineLayout engine = fp8_engine(config, 1, false);
  // 80 KiB: a 128-row slab of a 512-column weight (64 KiB of codes) fits, the
  // whole [256, 512] or [512, 256] weight not.
  const Plan plan = make_plan(trainer, engine, Topology{}, {PlanMode::p2p, 80 << 10});
  ASSERT_NO_THROW(verify_plan(plan, trainer, engine));
  int split = 0;
  for (const PlanItem& item : plan.items()) {
    const Copy c = plan.resolve(item);
    if (!c.fp8 || item.split_len == 0) continue;
    ++split;
    EXPECT_EQ(item.split_lo % 128, 0) << box_str(c.hf_box);
  }
  EXPECT_GT(split, 0) << "no quantized item was cut";
  check_items(plan, engine, "80 KiB buckets");
  // A bucket too small for one row of blocks is refused, naming the key.
  try {
    make_plan(trainer, engine, Topology{}, {PlanMode::p2p, 40 << 10});
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(m.find("FP8 blocks"), std::string::npos) << m;
    EXPECT_NE(m.find("'model."), std::string::npos) << m;
  }
}

TEST(Fp8Plan, BroadcastQuantizesOnTheEngines) {
  const HfModelConfig config = model("tiny-fp8-llama");
  const TrainerLayout trainer = make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=1"));
  const EngineLayout engine = fp8_engine(config, 2, false);
  const Plan plan = make_plan(trainer, engine, Topology{}, {PlanMode::broadcast, 64 << 10});
  ASSERT_NO_THROW(verify_plan(plan, trainer, engine));
  EXPECT_EQ(plan.stats().fp8_params_sender, 0);
  EXPECT_GT(plan.stats().fp8_params_engine, 0);
  const nlohmann::json j = plan.summary_json();
  ASSERT_TRUE(j.contains("fp8"));
  EXPECT_EQ(j["fp8"]["params_quantized_by_sender"], 0);
  EXPECT_EQ(parse_fp8_site("engine"), Fp8Site::engine);
  EXPECT_THROW(parse_fp8_site("trainer"), Error);
}

TEST(Fp8Plan, ATrainerDtypeTheQuantizerCannotTakeIsRefused) {
  const HfModelConfig config = model("tiny-fp8-llama");
  TrainerLayout trainer = make_trainer_layout(config, parse_mesh_spec("fsdp=2"));
  for (LoadSpec& p : trainer.params)
    if (p.name == "model.layers.1.self_attn.o_proj.weight") p.dtype = DType::I32;
  try {
    make_plan(trainer, fp8_engine(config, 2, false), Topology{}, {});
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.code(), Errc::invalid_layout);
    EXPECT_NE(m.find("'model.layers.1.self_attn.o_proj.weight'"), std::string::npos) << m;
    EXPECT_NE(m.find("I32"), std::string::npos) << m;
    EXPECT_NE(m.find("BF16, F16 or F32"), std::string::npos) << m;
  }
}

}  // namespace
}  // namespace weightsync
