// Framework "derived": the rank layouts a live engine derived from its own
// loader (python/weightsync/_derive.py), carried whole in the engine config's
// "derived" field. The HF config is kept as given: the family needs no name
// table, and the layout, coming from outside, is checked for coverage.
#include "engine_framework.h"

#include <weightsync/error.h>

#include <nlohmann/json.hpp>

namespace weightsync::engine {
namespace {

void read_derived(const nlohmann::json& j, EngineConfig& c) {
  auto it = j.find("derived");
  if (it == j.end() || it->is_null())
    fail(Errc::format, "engine config: framework \"derived\" needs field 'derived'");
  c.derived = derived_layout_from_json(*it, c.tp);
}

std::vector<EngineRankLayout> derived_ranks(const EngineConfig& c) {
  if (!c.derived || c.derived->ranks.size() != static_cast<size_t>(c.tp))
    fail(Errc::invalid_layout, "engine config: framework \"derived\" needs tp=", c.tp,
         " derived rank layouts");
  return c.derived->ranks;
}

}  // namespace

extern const Framework kDerived;
const Framework kDerived{.name = "derived",
                         .any_model = true,
                         .quantizable = false,
                         .checked_for_coverage = true,
                         .read = read_derived,
                         .ranks = derived_ranks};

}  // namespace weightsync::engine
