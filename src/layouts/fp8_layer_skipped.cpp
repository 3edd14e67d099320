// The engines' is_layer_skipped, as data in, decision out (fp8_checkpoint.h):
// which of an engine's linear modules its Fp8Config leaves unquantized.
// vLLM 0.32: quantization/utils/quant_utils.py; SGLang 0.5.23:
// layers/quantization/utils.py. Both split a fused module into the
// checkpoint's parts (Python's str.replace of its last component), require
// the parts to agree, and treat modules whose name mentions "experts" apart.
#include "fp8_checkpoint.h"

#include <weightsync/error.h>

#include <optional>

namespace weightsync::engine {

const std::vector<std::string>& vllm_ignored(const CheckpointFp8& ckpt) {
  if (ckpt.ignored_layers && !ckpt.ignored_layers->empty()) return *ckpt.ignored_layers;
  return ckpt.modules_to_not_convert;
}

std::vector<std::string> sglang_ignored(const CheckpointFp8& ckpt) {
  const auto& given = ckpt.ignored_layers ? *ckpt.ignored_layers : ckpt.modules_to_not_convert;
  std::vector<std::string> out;
  for (const std::string& name : given) {
    const std::string base = name.rfind("model.", 0) == 0 ? name.substr(6) : name;
    out.push_back(base);
    out.push_back("model." + base);
  }
  return out;
}

std::string module_of_param(std::string_view param) {
  const size_t dot = param.rfind('.');
  return std::string(dot == std::string_view::npos ? param : param.substr(0, dot));
}

namespace {

bool matches(const std::string& prefix, const std::vector<std::string>& ignored, MatchMode mode) {
  for (const std::string& layer : ignored) {
    switch (mode) {
      case MatchMode::exact:
        if (prefix == layer) return true;
        break;
      case MatchMode::substring:
        if (prefix.find(layer) != std::string::npos) return true;
        break;
      case MatchMode::suffix:
        if (prefix == layer ||
            (prefix.size() > layer.size() &&
             prefix.compare(prefix.size() - layer.size(), layer.size(), layer) == 0 &&
             prefix[prefix.size() - layer.size() - 1] == '.'))
          return true;
        break;
    }
  }
  return false;
}

[[noreturn]] void mixed_parts(std::string_view engine, const std::string& module,
                              const std::string& listed, const std::string& unlisted) {
  fail(Errc::invalid_layout, engine, " refuses this model: of the parts of fused module '", module,
       "', '", listed, "' is listed unquantized and '", unlisted,
       "' is not (all parts of a fused module must have the same precision)");
}

// Python's str.replace: every occurrence.
std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

}  // namespace

bool vllm_layer_skipped(const std::string& module, const std::vector<std::string>& ignored,
                        const FusedModules& fused, MatchMode mode, std::string_view engine) {
  const size_t dot = module.rfind('.');
  const std::string proj = dot == std::string::npos ? module : module.substr(dot + 1);
  auto parts = fused.find(proj);
  // A fused module listed under its own (fused) name is skipped whole.
  if (parts != fused.end() && matches(module, ignored, mode)) return true;
  if (parts != fused.end()) {
    std::optional<bool> skipped;
    std::string first;
    for (const std::string& part : parts->second) {
      const std::string shard = replace_all(module, proj, part);
      const bool s = matches(shard, ignored, mode);
      if (!skipped) {
        skipped = s;
        first = shard;
      } else if (*skipped != s) {
        mixed_parts(engine, module, *skipped ? first : shard, *skipped ? shard : first);
      }
    }
    return skipped.value_or(false);
  }
  if (module.find("experts") != std::string::npos && mode == MatchMode::exact) {
    // Expert layers: skipped when an ignored name that mentions experts
    // contains the module's name (e.g. "…mlp.experts.0.gate_proj").
    for (const std::string& layer : ignored)
      if (layer.find("experts") != std::string::npos && layer.find(module) != std::string::npos)
        return true;
    return false;
  }
  return matches(module, ignored, mode);
}

namespace {

// SGLang's _module_path_match: on dotted module-path boundaries.
bool path_match(std::string ignored, std::string prefix) {
  while (!ignored.empty() && ignored.back() == '.') ignored.pop_back();
  while (!prefix.empty() && prefix.back() == '.') prefix.pop_back();
  if (ignored == prefix || prefix.rfind(ignored + ".", 0) == 0) return true;
  return ("." + prefix + ".").find("." + ignored + ".") != std::string::npos;
}

bool any_path_match(const std::vector<std::string>& ignored, const std::string& prefix) {
  for (const std::string& i : ignored)
    if (path_match(i, prefix)) return true;
  return false;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  for (const std::string& x : v)
    if (x == s) return true;
  return false;
}

}  // namespace

bool sglang_layer_skipped(const std::string& module, const std::vector<std::string>& ignored,
                          const FusedModules& fused, std::string_view engine) {
  static const FusedModules kFallback{{"qkv_proj", {"q_proj", "k_proj", "v_proj"}},
                                      {"gate_up_proj", {"gate_proj", "up_proj"}}};
  const size_t dot = module.rfind('.');
  const std::string proj = dot == std::string::npos ? module : module.substr(dot + 1);
  const FusedModules& effective = fused.count(proj) ? fused : kFallback;
  if (auto parts = effective.find(proj); parts != effective.end()) {
    std::optional<bool> skipped;
    std::string first;
    for (const std::string& part : parts->second) {
      const std::string shard = replace_all(module, proj, part);
      const bool s = any_path_match(ignored, shard);
      if (!skipped) {
        skipped = s;
        first = shard;
      } else if (*skipped != s) {
        mixed_parts(engine, module, *skipped ? first : shard, *skipped ? shard : first);
      }
    }
    return skipped.value_or(false);
  }
  bool skipped = any_path_match(ignored, module);
  if (module.find("gate_up_proj") != std::string::npos) {
    if (contains(ignored, replace_all(module, "gate_up_proj", "gate_proj")) &&
        contains(ignored, replace_all(module, "gate_up_proj", "up_proj")))
      skipped = true;
  } else if (module.find("experts") != std::string::npos) {
    for (const std::string& layer : ignored)
      if (layer.find("experts") != std::string::npos && layer.find(module) != std::string::npos)
        skipped = true;
  }
  return skipped;
}

}  // namespace weightsync::engine
