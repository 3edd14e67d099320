// The engine config JSON of DESIGN.md's contract: parsing with typed field
// checks (Errc::format naming the field), value checks (Errc::invalid_layout)
// and the inverse, to_json (hf_config inline).
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>

#include <filesystem>
#include <fstream>

namespace weightsync {
namespace {

using nlohmann::json;

const json* field(const json& j, const char* name) {
  auto it = j.find(name);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

std::string get_string(const json& j, const char* name, const std::string& fallback) {
  const json* v = field(j, name);
  if (!v) return fallback;
  if (!v->is_string())
    fail(Errc::format, "engine config: field '", name, "' must be a string, got ", v->dump());
  return v->get<std::string>();
}

int get_int(const json& j, const char* name, int fallback) {
  const json* v = field(j, name);
  if (!v) return fallback;
  if (!v->is_number_integer())
    fail(Errc::format, "engine config: field '", name, "' must be an integer, got ", v->dump());
  const int64_t x = v->get<int64_t>();
  if (x < 1 || x > (1 << 20))
    fail(Errc::invalid_layout, "engine config: '", name, "' must be a positive integer, got ", x);
  return static_cast<int>(x);
}

bool get_bool(const json& j, const char* name, bool fallback) {
  const json* v = field(j, name);
  if (!v) return fallback;
  if (!v->is_boolean())
    fail(Errc::format, "engine config: field '", name, "' must be a boolean, got ", v->dump());
  return v->get<bool>();
}

// A path to a config.json, or to the HF model directory holding it.
HfModelConfig load_hf_config(const std::string& path, const std::string& base_dir) {
  std::filesystem::path p(path);
  if (p.is_relative() && !base_dir.empty()) p = std::filesystem::path(base_dir) / p;
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) p /= "config.json";
  if (!std::filesystem::exists(p, ec))
    fail(Errc::not_found, "engine config: hf_config '", p.string(), "' does not exist");
  return HfModelConfig::load(p.string());
}

}  // namespace

EngineConfig EngineConfig::from_json(const json& j, const std::string& base_dir) {
  if (!j.is_object()) fail(Errc::format, "engine config: expected a JSON object");
  EngineConfig c;
  c.framework = get_string(j, "framework", "");
  if (c.framework != "vllm" && c.framework != "sglang")
    fail(Errc::invalid_layout, "engine config: framework '", c.framework,
         "' is not supported (expected \"vllm\" or \"sglang\")");
  const json* hf = field(j, "hf_config");
  if (!hf) fail(Errc::format, "engine config: missing field 'hf_config' (a path or an object)");
  if (hf->is_string())
    c.hf = load_hf_config(hf->get<std::string>(), base_dir);
  else if (hf->is_object())
    c.hf = HfModelConfig::from_json(*hf);
  else
    fail(Errc::format, "engine config: field 'hf_config' must be a path or an object");
  if (!field(j, "tp")) fail(Errc::format, "engine config: missing field 'tp'");
  c.tp = get_int(j, "tp", 1);
  c.replicas = get_int(j, "replicas", 1);
  c.expert_parallel = get_bool(j, "expert_parallel", false);
  c.expert_placement = get_string(j, "expert_placement", "linear");
  if (c.expert_placement != "linear" && c.expert_placement != "round_robin")
    fail(Errc::invalid_layout, "engine config: expert_placement '", c.expert_placement,
         "' is not supported (expected \"linear\" or \"round_robin\")");
  const std::string dtype = get_string(j, "dtype", "");
  c.dtype = dtype.empty() ? c.hf.dtype : dtype_from_name(dtype, "engine config field 'dtype'");
  c.moe_order = get_string(j, "moe_order", "w13");
  if (c.moe_order != "w13" && c.moe_order != "w31")
    fail(Errc::invalid_layout, "engine config: moe_order '", c.moe_order,
         "' is not supported (expected \"w13\" or \"w31\")");
  if (c.moe_order == "w31" && c.framework != "sglang")
    fail(Errc::invalid_layout, "engine config: moe_order \"w31\" is an SGLang option; ",
         c.framework, " stores w13 (gate first)");
  return c;
}

EngineConfig EngineConfig::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(Errc::io, "engine config: cannot open '", path, "'");
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail(Errc::format, "engine config '", path, "': not valid JSON");
  try {
    return from_json(j, std::filesystem::path(path).parent_path().string());
  } catch (const Error& e) {
    throw Error(e.code(), cat(path, ": ", e.what()));
  }
}

json EngineConfig::to_json() const {
  json j = {{"framework", framework},
            {"hf_config", hf.raw},
            {"tp", tp},
            {"expert_parallel", expert_parallel},
            {"expert_placement", expert_placement},
            {"replicas", replicas},
            {"dtype", std::string(dtype_name(dtype))}};
  if (moe_order != "w13") j["moe_order"] = moe_order;
  return j;
}

}  // namespace weightsync
