// Refusing unknown fields of a JSON object: a misspelt option in a layout or
// config file is an error that names it, never silently ignored.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <initializer_list>
#include <string>
#include <string_view>

namespace weightsync {

// Errc::format naming `where`, the first field of `object` that is not in
// `accepted`, and the accepted ones ("trainer layout: param 'w': unknown
// field 'fused_dims' (accepted: name, hf_keys, ...)"). Nothing for a value
// that is not an object (its own checks say what it should be).
void check_fields(const nlohmann::json& object, std::initializer_list<std::string_view> accepted,
                  const std::string& where);

}  // namespace weightsync
