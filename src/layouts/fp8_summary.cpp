// FP8 engines in one line (layouts.h: fp8_source, fp8_summary): what
// `weightsync engine-layout` and the engine integrations report.
#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include "engine_framework.h"
#include "layout_rules.h"

#include <algorithm>

namespace weightsync {

std::string fp8_source(const EngineConfig& config) {
  if (!config.quantization) return "";
  const engine::Framework& f = engine::find_framework(config.framework);
  if (f.fp8 && engine::read_checkpoint_fp8(config.hf.raw()))
    return cat("the model's quantization_config, as ", f.fp8->engine, " reads it");
  return "the engine config's \"quantization\"";
}

std::string fp8_summary(const EngineRankLayout& rank) {
  int fp8 = 0, linear = 0;
  std::optional<ScaleFormat> scale;
  bool mixed = false;
  for (const EngineParam& p : rank.params) {
    if (p.scale_of >= 0) continue;
    if (p.quant) {
      ++fp8;
      ++linear;
      if (scale && *scale != p.quant->scale) mixed = true;
      scale = p.quant->scale;
      continue;
    }
    const bool is_linear = p.shape.size() >= 2 && !p.segments.empty() &&
                           std::all_of(p.segments.begin(), p.segments.end(), [](const Segment& s) {
                             return engine::fp8_linear_key(s.hf_key);
                           });
    if (is_linear) ++linear;
  }
  if (fp8 == 0) return "";
  return cat(fp8, " of ", linear, " linear weights FP8, scales ",
             mixed ? "mixed" : scale_format_name(*scale));
}

}  // namespace weightsync
