#include <weightsync/error.h>
#include <weightsync/json_fields.h>

#include <nlohmann/json.hpp>

#include <algorithm>

namespace weightsync {

void check_fields(const nlohmann::json& object, std::initializer_list<std::string_view> accepted,
                  const std::string& where) {
  if (!object.is_object()) return;
  for (const auto& [key, value] : object.items()) {
    if (std::find(accepted.begin(), accepted.end(), key) != accepted.end()) continue;
    std::string list;
    for (std::string_view a : accepted) list += cat(list.empty() ? "" : ", ", a);
    fail(Errc::format, where, ": unknown field '", key, "' (accepted: ", list, ")");
  }
}

}  // namespace weightsync
