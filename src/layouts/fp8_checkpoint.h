// FP8 as the checkpoint says (DESIGN.md "FP8: what the checkpoint says"): the
// model's quantization_config read as vLLM's and SGLang's Fp8Config read it,
// the engine config's "quantization" checked against it, and each engine's
// own rule for which linear modules stay unquantized (its is_layer_skipped).
#pragma once

#include <weightsync/engine_layout.h>

#include <nlohmann/json_fwd.hpp>

#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace weightsync::engine {

// A model's FP8 quantization_config: the fields the engines' Fp8Config read.
struct CheckpointFp8 {
  BlockQuant quant;              // weight_block_size; ue8m0 where scale_fmt says so
  bool scale_fmt_ue8m0 = false;  // "scale_fmt": "ue8m0" (DeepSeek-V3.x checkpoints)
  // The modules left unquantized, as written: "ignored_layers" (set when the
  // key is there, null read as empty) and "modules_to_not_convert". The
  // engines pick between them differently (vllm_ignored, sglang_ignored).
  std::optional<std::vector<std::string>> ignored_layers;
  std::vector<std::string> modules_to_not_convert;
};

// The ignored list vLLM 0.32 uses: ignored_layers, or modules_to_not_convert
// where ignored_layers is absent, null or empty.
const std::vector<std::string>& vllm_ignored(const CheckpointFp8& ckpt);

// The ignored list SGLang 0.5.23 uses: the first of ignored_layers and
// modules_to_not_convert that is there (a null or empty ignored_layers hides
// the other), each name both with and without its "model." prefix.
std::vector<std::string> sglang_ignored(const CheckpointFp8& ckpt);

// The FP8 quantization_config of an HF config.json (raw JSON); nullopt when it
// has none. Errc::unsupported naming the field for what weightsync cannot hold
// (another quant_method, no weight_block_size: per-tensor FP8, a block other
// than 128 x 128, fmt other than e4m3, an unknown scale_fmt, a static
// activation_scheme with blocks, which vLLM refuses too); Errc::format for a
// mistyped field.
std::optional<CheckpointFp8> read_checkpoint_fp8(const nlohmann::json& hf_config);

// The engine config's "quantization" as written: the block quantization and
// whether "scale" was given (absent, the checkpoint's scale_fmt decides).
struct EngineQuantField {
  BlockQuant quant;
  bool scale_given = false;
};

// What the engine holds: the checkpoint's quantization where the model's config
// has one (the engine config's field, when given, must agree: Errc::invalid_layout
// naming both values otherwise), else the engine config's field (the
// engine's config is then the only source, as before quantization_config was
// read). A scale of "ue8m0" where the checkpoint's are FP32 is a choice of the
// engine (DeepGEMM on Blackwell) and agrees; "fp32" where the checkpoint says
// "ue8m0" does not.
std::optional<BlockQuant> reconcile_fp8(const std::optional<EngineQuantField>& engine,
                                        const std::optional<CheckpointFp8>& checkpoint);

// How vLLM and SGLang match a module name against the ignored list.
enum class MatchMode { exact, substring, suffix };

// A fused module's name (its last component) -> the checkpoint modules it
// holds, as the engine's packed_modules_mapping says for the model.
using FusedModules = std::map<std::string, std::vector<std::string>, std::less<>>;

// How one engine (a framework at the versions tested) picks its FP8 linear
// modules when the model's config carries an FP8 quantization_config.
struct Fp8Selection {
  std::string_view engine;  // "vLLM 0.32", named in errors
  // Modules the engine builds with the quant config beyond the linear weights
  // of fp8_linear_key (vLLM 0.32: Qwen3-MoE's router GateLinear).
  bool (*extra)(const HfModelConfig& hf, std::string_view module) = nullptr;
  // The engine's packed_modules_mapping for the model.
  FusedModules (*fused)(const HfModelConfig& hf) = nullptr;
  // The engine's is_layer_skipped for `module` (its name in the engine);
  // Errc::invalid_layout where the engine refuses (a fused module whose parts
  // disagree), naming the module and the parts.
  bool (*skipped)(const std::string& module, const CheckpointFp8& ckpt,
                  const FusedModules& fused) = nullptr;
};

// vLLM 0.32's is_layer_skipped (quantization/utils/quant_utils.py) for
// Fp8Config (match mode "exact" for every model weightsync lays out).
bool vllm_layer_skipped(const std::string& module, const std::vector<std::string>& ignored,
                        const FusedModules& fused, MatchMode mode, std::string_view engine);

// SGLang 0.5.23's is_layer_skipped (layers/quantization/utils.py): names
// match on dotted module-path boundaries; a fused module not in `fused` is
// split by SGLang's fallback table (qkv_proj, gate_up_proj).
bool sglang_layer_skipped(const std::string& module, const std::vector<std::string>& ignored,
                          const FusedModules& fused, std::string_view engine);

// The module an engine param belongs to: "…qkv_proj.weight" -> "…qkv_proj",
// "…mlp.experts.w13_weight" -> "…mlp.experts".
std::string module_of_param(std::string_view param);

}  // namespace weightsync::engine
