// Framework "derived" (layout_derived.cpp): the "derived" field of an engine
// config, parsed and written back.
#pragma once

#include <weightsync/engine_layout.h>

#include <nlohmann/json.hpp>

#include <memory>

namespace weightsync::engine {

// Errc::format / invalid_layout naming the tensor, rank, param or segment.
std::shared_ptr<const DerivedLayout> derived_from_json(const nlohmann::json& j, int tp);
nlohmann::json derived_to_json(const DerivedLayout& derived);

}  // namespace weightsync::engine
