// WireOptions as JSON (trainer rank 0 publishes them with the plan options).
#include <weightsync/error.h>
#include <weightsync/wire_options.h>

#include <nlohmann/json.hpp>

namespace weightsync {

std::string_view delta_mode_name(DeltaMode mode) noexcept {
  return mode == DeltaMode::automatic ? "auto" : "off";
}

DeltaMode parse_delta_mode(std::string_view name) {
  if (name == "off") return DeltaMode::off;
  if (name == "auto") return DeltaMode::automatic;
  fail(Errc::invalid_argument, "delta: expected \"off\" or \"auto\", got \"", name, "\"");
}

nlohmann::json WireOptions::to_json() const {
  return {{"checksums", checksums},
          {"checksums_gpu", checksums_gpu},
          {"direct_min_bytes", direct_min_bytes},
          {"delta", delta},
          {"lend", lend}};
}

WireOptions WireOptions::from_json(const nlohmann::json& j) {
  WireOptions w;
  if (!j.is_object())
    fail(Errc::invalid_argument, "wire options: expected an object, got ", j.dump());
  if (j.contains("checksums")) {
    if (!j["checksums"].is_boolean())
      fail(Errc::invalid_argument, "wire options: \"checksums\" must be true or false, got ",
           j["checksums"].dump());
    w.checksums = j["checksums"].get<bool>();
  }
  if (j.contains("checksums_gpu")) {
    if (!j["checksums_gpu"].is_boolean())
      fail(Errc::invalid_argument, "wire options: \"checksums_gpu\" must be true or false, got ",
           j["checksums_gpu"].dump());
    w.checksums_gpu = j["checksums_gpu"].get<bool>();
  }
  if (j.contains("delta")) {
    if (!j["delta"].is_boolean())
      fail(Errc::invalid_argument, "wire options: \"delta\" must be true or false, got ",
           j["delta"].dump());
    w.delta = j["delta"].get<bool>();
  }
  if (j.contains("lend")) {
    if (!j["lend"].is_boolean())
      fail(Errc::invalid_argument, "wire options: \"lend\" must be true or false, got ",
           j["lend"].dump());
    w.lend = j["lend"].get<bool>();
  }
  if (j.contains("direct_min_bytes")) {
    if (!j["direct_min_bytes"].is_number_integer() || j["direct_min_bytes"].get<int64_t>() < 1)
      fail(Errc::invalid_argument,
           "wire options: \"direct_min_bytes\" must be a positive integer, got ",
           j["direct_min_bytes"].dump());
    w.direct_min_bytes = j["direct_min_bytes"].get<int64_t>();
  }
  return w;
}

}  // namespace weightsync
