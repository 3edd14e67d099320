// Plans into FP8 engines: a quantized weight receives its trainer's BF16
// (or F16, F32) bytes, every element once, in both plan modes; the engine
// counts those bytes; a trainer dtype the quantizer cannot take is a clear
// error naming the param and the key.
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/hf_model.h>
#include <weightsync/plan.h>
#include <weightsync/topology.h>
#include <weightsync/trainer_layout.h>

#include <gtest/gtest.h>

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
      const Plan plan = make_plan(trainer, engine, Topology{}, {mode, 64 << 10});
      EXPECT_NO_THROW(verify_plan(plan, trainer, engine)) << name;
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
