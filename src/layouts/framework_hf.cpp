// Framework "hf": every HF tensor whole, under its own name, on every rank
// (an engine that loads the checkpoint's tensors as they are); with FP8, the
// linear weights as an FP8 checkpoint stores them (the weight and its
// "<key>_scale_inv").
#include "engine_framework.h"
#include "layout_rules.h"

namespace weightsync::engine {
namespace {

std::vector<EngineRankLayout> hf_ranks(const EngineConfig& c) {
  const auto tensors = hf_tensors(c.hf);
  std::vector<EngineRankLayout> ranks(static_cast<size_t>(c.tp));
  for (int r = 0; r < c.tp; ++r) {
    EngineRankLayout& rank = ranks[static_cast<size_t>(r)];
    rank.rank = r;
    rank.params.reserve(tensors.size());
    for (const HfTensorSpec& t : tensors) {
      const Box whole = Box::full(t.shape);
      rank.params.push_back({t.key, c.dtype, t.shape, {{t.key, whole, whole, false}}});
      if (!c.quantization || t.shape.size() != 2 || !fp8_linear_key(t.key)) continue;
      const auto index = static_cast<int32_t>(rank.params.size() - 1);
      const HfShapes one{{t.key, t.shape}};
      rank.params.push_back(
          make_quantized(rank.params.back(), *c.quantization, one, r, c.tp, index));
    }
  }
  return ranks;
}

}  // namespace

extern const Framework kHf;
const Framework kHf{.name = "hf", .ranks = hf_ranks};

}  // namespace weightsync::engine
