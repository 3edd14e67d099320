// Test support for the planner: random layouts of tiny models and an
// element-level simulation of a plan (pack every bucket, apply it) that
// checks the result with its own per-element bookkeeping.
#pragma once

#include <weightsync/engine_layout.h>
#include <weightsync/plan.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace weightsync::test {

// configs/models/<name>/config.json of the source tree.
std::string model_config_path(const std::string& name);
// The tiny models the property tests draw from.
const std::vector<std::string>& tiny_models();

// A random engine config for `model` that make_engine_layout accepts.
EngineConfig random_engine_config(const std::string& model, std::mt19937_64& rng);
// A random trainer layout of `model`: an XTuner-style layout over a random
// mesh, then each param's shards redrawn at random (dims, axes, interleave)
// with random tail padding where that stays valid.
TrainerLayout random_trainer_layout(const std::string& model, std::mt19937_64& rng);

struct SimResult {
  std::vector<int64_t> bytes_in;  // by global engine rank, from the buckets
  int64_t model_bytes = 0;        // bytes of every HF key an engine segment reads
};

// Packs every bucket from simulated trainer tensors (each element holds its
// HF identity) and applies it into simulated engine params; fails the current
// test (gtest) on any element written twice, not written, written with the
// wrong data, or read from a source that does not hold it.
SimResult simulate(const Plan& plan, const TrainerLayout& trainer, const EngineLayout& engine);

}  // namespace weightsync::test
