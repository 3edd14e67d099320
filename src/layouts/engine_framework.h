// Engine frameworks: how one replica of an engine of a kind holds a model's
// weights. Each framework is one file (framework_<name>.cpp) defining a
// Framework; the registry (engine_frameworks.cpp) lists them, one line each.
// The engine config reader (engine_config.cpp) and make_engine_layout
// (layout_build.cpp) find them by name and know no framework themselves.
#pragma once

#include "fp8_checkpoint.h"

#include <weightsync/engine_layout.h>

#include <nlohmann/json_fwd.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace weightsync::engine {

struct Framework {
  std::string_view name;
  // The HF config is kept as given (its family unchecked: the layout does not
  // come from the name tables), which then must be an object, and the config
  // must state its 'dtype'.
  bool any_model = false;
  // Stores the routed experts' gate and up halves up first ("moe_order":
  // "w31", SGLang's flashinfer_cutlass backend); every framework takes "w13".
  bool takes_w31 = false;
  // Takes "quantization" (block FP8).
  bool quantizable = true;
  // Reads the model's quantization_config as this engine does
  // (fp8_checkpoint.h): the engine config's "quantization" is then optional
  // and must agree with it. nullptr: "quantization" alone says (as written).
  const Fp8Selection* fp8 = nullptr;
  // Its layouts come from outside (not from the name tables): make_engine_layout
  // checks their coverage (every segment in bounds, no overlap).
  bool checked_for_coverage = false;
  // Reads the framework's own fields of an engine config into `c`, after the
  // shared ones (nullptr: none). Errc::format naming the field. (to_json
  // writes every EngineConfig field there is, `derived` among them.)
  void (*read)(const nlohmann::json& j, EngineConfig& c) = nullptr;
  // The rank layouts of one replica: c.tp of them, rank r at index r, with
  // FP8 scale params where c.quantization says. Errc::invalid_layout naming
  // what tp must divide, or what the layout lacks.
  std::vector<EngineRankLayout> (*ranks)(const EngineConfig& c) = nullptr;
};

// The framework registered under `name`; Errc::invalid_layout naming the
// registered ones otherwise.
const Framework& find_framework(std::string_view name);

// Value checks of a config against its framework (Errc::invalid_layout):
// tp and replicas positive, moe_order one the framework stores.
void check_framework_options(const Framework& f, const EngineConfig& c);

}  // namespace weightsync::engine
