// The model's quantization_config and the engine config's "quantization":
// one source of truth (fp8_checkpoint.h). Facts of vLLM 0.32's Fp8Config
// (quantization/fp8.py), the class vLLM picks for quant_method "fp8":
// weight_block_size absent means per-tensor FP8; blocks need
// activation_scheme "dynamic"; scale_fmt is not read (vLLM decides UE8M0 from
// the GPU). SGLang 0.5.23's Fp8Config reads the same keys and scale_fmt (its
// "ue8m0" activations), and takes "mxfp8" methods (blocks of 1 x 32, which
// weightsync does not lay out yet).
#include "fp8_checkpoint.h"

#include <weightsync/error.h>

#include <nlohmann/json.hpp>

namespace weightsync::engine {
namespace {

using nlohmann::json;

constexpr const char* kWhere = "model config: quantization_config";

const json* field(const json& j, const char* name) {
  auto it = j.find(name);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

std::string string_field(const json& q, const char* name) {
  const json* v = field(q, name);
  if (!v) return "";
  if (!v->is_string()) fail(Errc::format, kWhere, ".", name, " must be a string, got ", v->dump());
  return v->get<std::string>();
}

std::vector<std::string> list_field(const json& q, const char* name) {
  const json* v = field(q, name);
  if (!v) return {};
  if (!v->is_array())
    fail(Errc::format, kWhere, ".", name, " must be a list of module names, got ", v->dump());
  std::vector<std::string> out;
  for (const json& e : *v) {
    if (!e.is_string())
      fail(Errc::format, kWhere, ".", name, " must be a list of module names, got ", e.dump());
    out.push_back(e.get<std::string>());
  }
  return out;
}

void read_block(const json& q, CheckpointFp8& out) {
  const json* b = field(q, "weight_block_size");
  if (!b)
    fail(Errc::unsupported, kWhere,
         " has no weight_block_size: per-tensor FP8, which weightsync does not quantize (it "
         "holds block FP8 of 128 x 128)");
  if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() ||
      !(*b)[1].is_number_integer())
    fail(Errc::format, kWhere, ".weight_block_size must be two integers, got ", b->dump());
  out.quant.block_rows = (*b)[0].get<int64_t>();
  out.quant.block_cols = (*b)[1].get<int64_t>();
  if (out.quant.block_rows != 128 || out.quant.block_cols != 128)
    fail(Errc::unsupported, kWhere, ".weight_block_size ", b->dump(),
         " is not supported (only [128, 128])");
}

std::string block_str(const BlockQuant& q) {
  return cat("[", q.block_rows, ", ", q.block_cols, "]");
}

}  // namespace

std::optional<CheckpointFp8> read_checkpoint_fp8(const json& hf_config) {
  if (!hf_config.is_object()) return std::nullopt;
  const json* q = field(hf_config, "quantization_config");
  if (!q) return std::nullopt;
  if (!q->is_object()) fail(Errc::format, kWhere, " must be an object, got ", q->dump());
  const std::string method = string_field(*q, "quant_method");
  if (method != "fp8")
    fail(Errc::unsupported, kWhere, ".quant_method '", method,
         "' is not supported (weightsync holds block FP8: \"fp8\")");
  CheckpointFp8 out;
  read_block(*q, out);
  const std::string act = string_field(*q, "activation_scheme");
  if (!act.empty() && act != "dynamic")
    fail(Errc::unsupported, kWhere, ".activation_scheme '", act,
         "' with weight_block_size (vLLM 0.32 takes blocks with \"dynamic\" only)");
  const std::string fmt = string_field(*q, "fmt");
  if (!fmt.empty() && fmt != "e4m3")
    fail(Errc::unsupported, kWhere, ".fmt '", fmt, "' is not supported (expected \"e4m3\")");
  const std::string scale_fmt = string_field(*q, "scale_fmt");
  if (scale_fmt == "ue8m0") {
    out.scale_fmt_ue8m0 = true;
    out.quant.scale = ScaleFormat::ue8m0;
  } else if (!scale_fmt.empty()) {
    fail(Errc::unsupported, kWhere, ".scale_fmt '", scale_fmt,
         "' is not supported (expected \"ue8m0\" or none)");
  }
  if (q->contains("ignored_layers")) out.ignored_layers = list_field(*q, "ignored_layers");
  out.modules_to_not_convert = list_field(*q, "modules_to_not_convert");
  return out;
}

std::optional<BlockQuant> reconcile_fp8(const std::optional<EngineQuantField>& engine,
                                        const std::optional<CheckpointFp8>& checkpoint) {
  if (!checkpoint) return engine ? std::optional<BlockQuant>(engine->quant) : std::nullopt;
  BlockQuant out = checkpoint->quant;
  if (!engine) return out;
  const BlockQuant& e = engine->quant;
  if (e.block_rows != out.block_rows || e.block_cols != out.block_cols)
    fail(Errc::invalid_layout, "engine config: quantization.weight_block_size ", block_str(e),
         " disagrees with the model config's quantization_config.weight_block_size ",
         block_str(out));
  if (!engine->scale_given) return out;
  if (e.scale == ScaleFormat::fp32 && checkpoint->scale_fmt_ue8m0)
    fail(Errc::invalid_layout,
         "engine config: quantization.scale \"fp32\" disagrees with the model config's "
         "quantization_config.scale_fmt \"ue8m0\" (the checkpoint's scales are powers of two)");
  out.scale = e.scale;
  return out;
}

}  // namespace weightsync::engine
