// Helpers shared by the engine tests: model configs from configs/models and
// engine configs built in code.
#pragma once

#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include <gtest/gtest.h>

#include <string>

namespace weightsync::testing {

inline std::string model_config_path(const std::string& name) {
  return std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/" + name + "/config.json";
}

inline HfModelConfig model(const std::string& name) {
  return HfModelConfig::load(model_config_path(name));
}

inline EngineConfig engine(const std::string& model_name, int tp, bool ep = false,
                           const std::string& placement = "linear",
                           const std::string& framework = "vllm") {
  EngineConfig c;
  c.framework = framework;
  c.hf = model(model_name);
  c.tp = tp;
  c.expert_parallel = ep;
  c.expert_placement = placement;
  c.dtype = c.hf.dtype;
  return c;
}

inline const EngineParam& param(const EngineLayout& layout, int rank, const std::string& name) {
  for (const auto& p : layout.ranks.at(static_cast<size_t>(rank)).params)
    if (p.name == name) return p;
  throw Error(Errc::not_found, "test: no param " + name);
}

inline bool has_param(const EngineLayout& layout, int rank, const std::string& name) {
  for (const auto& p : layout.ranks.at(static_cast<size_t>(rank)).params)
    if (p.name == name) return true;
  return false;
}

// Runs `f` and returns the Errc of the weightsync::Error it throws.
template <class F>
::testing::AssertionResult throws_errc(F&& f, Errc want, const std::string& needle = "") {
  try {
    f();
  } catch (const Error& e) {
    if (e.code() != want)
      return ::testing::AssertionFailure() << "threw " << errc_name(e.code()) << " (" << e.what()
                                           << "), wanted " << errc_name(want);
    if (!needle.empty() && std::string(e.what()).find(needle) == std::string::npos)
      return ::testing::AssertionFailure()
             << "message '" << e.what() << "' lacks '" << needle << "'";
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

}  // namespace weightsync::testing
