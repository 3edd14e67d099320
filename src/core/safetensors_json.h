// Private to src/core: JSON parsing for safetensors headers and checkpoint
// indexes that rejects duplicate object keys. nlohmann keeps the last of two
// equal keys silently, which would let a header name two byte ranges for one
// tensor; the safetensors spec forbids duplicates, so we refuse them.
#pragma once

#include <nlohmann/json.hpp>

#include <string_view>

namespace weightsync::detail {

// Parses `text` as JSON. Errc::format naming `file` (and the key, for a
// duplicate) when it is not JSON or an object holds the same key twice.
nlohmann::json parse_json_no_duplicates(std::string_view text, std::string_view file);

}  // namespace weightsync::detail
