// The engine config JSON of DESIGN.md's contract: parsing with typed field
// checks (Errc::format naming the field) and value checks
// (Errc::invalid_layout) against the config's framework (engine_framework.h).
// The inverse, to_json, is core's (src/core/engine_layout_json.cpp).
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/json_fields.h>
#include <weightsync/layouts.h>

#include "engine_framework.h"
#include "fp8_checkpoint.h"

#include <nlohmann/json.hpp>

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

// "quantization": {"method": "fp8", "weight_block_size": [128, 128],
// "scale": "fp32" | "ue8m0"}; null or absent: none.
std::optional<engine::EngineQuantField> get_quantization(const json& j) {
  const json* q = field(j, "quantization");
  if (!q) return std::nullopt;
  if (!q->is_object())
    fail(Errc::format, "engine config: field 'quantization' must be an object, got ", q->dump());
  for (const auto& [k, v] : q->items())
    if (k != "method" && k != "weight_block_size" && k != "scale")
      fail(Errc::format, "engine config: unknown field 'quantization.", k,
           "' (expected method, weight_block_size, scale)");
  const std::string method = get_string(*q, "method", "");
  if (method != "fp8")
    fail(Errc::invalid_layout, "engine config: quantization method '", method,
         "' is not supported (expected \"fp8\")");
  engine::EngineQuantField field_out;
  BlockQuant& out = field_out.quant;
  if (const json* b = field(*q, "weight_block_size")) {
    if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() ||
        !(*b)[1].is_number_integer())
      fail(Errc::format, "engine config: 'quantization.weight_block_size' must be two integers, ",
           "got ", b->dump());
    out.block_rows = (*b)[0].get<int64_t>();
    out.block_cols = (*b)[1].get<int64_t>();
    // Every FP8 checkpoint these engines load (DeepSeek-V3, Kimi-K2, Qwen3-FP8)
    // and DeepGEMM's kernels use 128 x 128 blocks; the kernels here do too.
    if (out.block_rows != 128 || out.block_cols != 128)
      fail(Errc::invalid_layout, "engine config: quantization.weight_block_size ", b->dump(),
           " is not supported (only [128, 128])");
  }
  field_out.scale_given = field(*q, "scale") != nullptr;
  const std::string scale = get_string(*q, "scale", "fp32");
  if (scale == "ue8m0")
    out.scale = ScaleFormat::ue8m0;
  else if (scale != "fp32")
    fail(Errc::invalid_layout, "engine config: quantization.scale '", scale,
         "' is not supported (expected \"fp32\" or \"ue8m0\")");
  return field_out;
}

// The quantization the engine holds: the model's quantization_config where
// the framework reads it as its engine does (the field must then agree),
// else the field alone.
std::optional<BlockQuant> quantization_of(const engine::Framework& framework, const json& j,
                                          const HfModelConfig& hf) {
  const auto given = get_quantization(j);
  if (given && !framework.quantizable)
    fail(Errc::unsupported, "engine config: framework \"", framework.name, "\" with quantization");
  if (!framework.fp8) return given ? std::optional<BlockQuant>(given->quant) : std::nullopt;
  return engine::reconcile_fp8(given, engine::read_checkpoint_fp8(hf.raw()));
}

}  // namespace

EngineConfig engine_config_from_json(const json& j, const std::string& base_dir) {
  if (!j.is_object()) fail(Errc::format, "engine config: expected a JSON object");
  // "lora": an adapter job's adapter (read by the Python integrations,
  // weightsync.lora).
  check_fields(j,
               {"framework", "hf_config", "tp", "replicas", "expert_parallel", "expert_placement",
                "dtype", "moe_order", "quantization", "derived", "lora"},
               "engine config");
  EngineConfig c;
  c.framework = get_string(j, "framework", "");
  const engine::Framework& framework = engine::find_framework(c.framework);
  const json* hf = field(j, "hf_config");
  if (!hf) fail(Errc::format, "engine config: missing field 'hf_config' (a path or an object)");
  if (framework.any_model) {
    // Kept as given: the layout does not come from the family's name tables.
    if (!hf->is_object())
      fail(Errc::format, "engine config: framework \"", framework.name,
           "\" takes 'hf_config' inline (an object)");
    c.hf.set_raw(*hf);
    c.hf.model_type = hf->value("model_type", std::string());
  } else if (hf->is_string()) {
    c.hf = load_hf_config(hf->get<std::string>(), base_dir);
  } else if (hf->is_object()) {
    c.hf = HfModelConfig::from_json(*hf);
  } else {
    fail(Errc::format, "engine config: field 'hf_config' must be a path or an object");
  }
  if (!field(j, "tp")) fail(Errc::format, "engine config: missing field 'tp'");
  c.tp = get_int(j, "tp", 1);
  c.replicas = get_int(j, "replicas", 1);
  c.expert_parallel = get_bool(j, "expert_parallel", false);
  c.expert_placement = get_string(j, "expert_placement", "linear");
  if (c.expert_placement != "linear" && c.expert_placement != "round_robin")
    fail(Errc::invalid_layout, "engine config: expert_placement '", c.expert_placement,
         "' is not supported (expected \"linear\" or \"round_robin\")");
  const std::string dtype = get_string(j, "dtype", "");
  if (dtype.empty() && framework.any_model)
    fail(Errc::format, "engine config: framework \"", framework.name, "\" needs 'dtype'");
  c.dtype = dtype.empty() ? c.hf.dtype : dtype_from_name(dtype, "engine config field 'dtype'");
  c.moe_order = get_string(j, "moe_order", "w13");
  engine::check_framework_options(framework, c);
  c.quantization = quantization_of(framework, j, c.hf);
  if (framework.read) framework.read(j, c);
  return c;
}

namespace {

// Parses the file at `path` with `parse(json, base_dir)`, naming the file in errors.
template <class T, class Parse>
T load_file(const std::string& path, Parse parse) {
  std::ifstream in(path);
  if (!in) fail(Errc::io, "engine config: cannot open '", path, "'");
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail(Errc::format, "engine config '", path, "': not valid JSON");
  try {
    return parse(j, std::filesystem::path(path).parent_path().string());
  } catch (const Error& e) {
    throw Error(e.code(), cat(path, ": ", e.what()));
  }
}

}  // namespace

EngineConfig load_engine_config(const std::string& path) {
  return load_file<EngineConfig>(path, &engine_config_from_json);
}

EngineSpec engine_spec_from_json(const json& j, const std::string& base_dir) {
  if (!j.is_array()) return EngineSpec(engine_config_from_json(j, base_dir));
  if (j.empty()) fail(Errc::format, "engine config: an empty array (expected engine configs)");
  EngineSpec spec;
  for (size_t i = 0; i < j.size(); ++i) {
    try {
      spec.groups.push_back(engine_config_from_json(j[i], base_dir));
    } catch (const Error& e) {
      throw Error(e.code(), cat("engine group ", i, ": ", e.what()));
    }
  }
  return spec;
}

EngineSpec load_engine_spec(const std::string& path) {
  return load_file<EngineSpec>(path, &engine_spec_from_json);
}

}  // namespace weightsync
