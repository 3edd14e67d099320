// From rules to one rank's parameters, and the checks of what tp must divide.
#include "engine_framework.h"
#include "layout_rules.h"

#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include <algorithm>

namespace weightsync {

int64_t padded_vocab(int64_t vocab_size) {
  // vLLM's and SGLang's DEFAULT_VOCAB_PADDING_SIZE.
  constexpr int64_t kPad = 64;
  return (vocab_size + kPad - 1) / kPad * kPad;
}

std::vector<int64_t> local_experts(const EngineConfig& config, int rank) {
  const int64_t e = config.hf.num_experts;
  std::vector<int64_t> out;
  if (!config.expert_parallel) {
    for (int64_t x = 0; x < e; ++x) out.push_back(x);
    return out;
  }
  const int64_t ep = config.tp;
  if (config.expert_placement == "round_robin") {
    for (int64_t x = rank; x < e; x += ep) out.push_back(x);
    return out;
  }
  // linear: contiguous, the first E % ep ranks take one more.
  const int64_t base = e / ep, extra = e % ep;
  const int64_t start = rank * base + std::min<int64_t>(rank, extra);
  const int64_t count = base + (rank < extra ? 1 : 0);
  for (int64_t x = start; x < start + count; ++x) out.push_back(x);
  return out;
}

namespace engine {
namespace {

const Shape& shape_of(const HfShapes& shapes, const std::string& key) {
  auto it = shapes.find(key);
  if (it == shapes.end()) fail(Errc::internal, "engine layout: no HF tensor '", key, "'");
  return it->second;
}

[[noreturn]] void indivisible(const std::string& param, int tp, const char* what, int64_t n,
                              const std::string& key) {
  fail(Errc::invalid_layout, "engine param '", param, "': tp=", tp, " does not divide ", what, " (",
       n, ") of HF tensor '", key, "'");
}

// Appends `hf_box` of `key` at `row` of dim 0 of the parameter.
void stack(EngineParam& p, const std::string& key, Box hf_box, int64_t row) {
  Box param_box{Shape(hf_box.rank(), 0), hf_box.lengths};
  param_box.offsets[0] = row;
  p.segments.push_back({key, std::move(hf_box), std::move(param_box), false});
}

// The rows [begin, begin+len) of a tensor of `shape` as a box.
Box rows(const Shape& shape, int64_t begin, int64_t len) {
  Box b = Box::full(shape);
  b.offsets[0] = begin;
  b.lengths[0] = len;
  return b;
}

void build_stacked(EngineParam& p, const Rule& r, const HfShapes& shapes, int tp, int rank) {
  int64_t row = 0;
  for (const auto& key : r.keys) {
    const Shape& s = shape_of(shapes, key);
    int64_t begin = 0, len = s[0];
    if (r.split == Split::column) {
      if (s[0] % tp != 0) indivisible(p.name, tp, "dim 0", s[0], key);
      len = s[0] / tp;
      begin = rank * len;
    }
    stack(p, key, rows(s, begin, len), row);
    row += len;
  }
  p.shape = shape_of(shapes, r.keys.front());
  p.shape[0] = row;
}

void build_row(EngineParam& p, const Rule& r, const HfShapes& shapes, int tp, int rank) {
  const std::string& key = r.keys.front();
  const Shape& s = shape_of(shapes, key);
  if (s.size() != 2) fail(Errc::internal, "engine layout: row split of non-matrix '", key, "'");
  if (s[1] % tp != 0) indivisible(p.name, tp, "dim 1", s[1], key);
  const int64_t per = s[1] / tp;
  p.shape = {s[0], per};
  p.segments.push_back({key, Box{{0, rank * per}, {s[0], per}}, Box{{0, 0}, {s[0], per}}, false});
}

void build_vocab(EngineParam& p, const Rule& r, const HfShapes& shapes, int tp, int rank) {
  const std::string& key = r.keys.front();
  const Shape& s = shape_of(shapes, key);
  const int64_t padded = padded_vocab(s[0]);
  if (padded % tp != 0) indivisible(p.name, tp, "the padded vocab", padded, key);
  const int64_t per = padded / tp, lo = rank * per, hi = std::min(s[0], lo + per);
  p.shape = s;
  p.shape[0] = per;
  if (hi > lo) stack(p, key, rows(s, lo, hi - lo), 0);  // rows past the vocab: zero padding
}

void build_qkv(EngineParam& p, const Rule& r, const EngineConfig& c, const HfShapes& shapes,
               int rank) {
  const int tp = c.tp;
  const int64_t d = c.hf.head_dim;
  const Shape& qs = shape_of(shapes, r.keys[0]);
  const int64_t nh = qs[0] / d, nkv = shape_of(shapes, r.keys[1])[0] / d;
  if (nh % tp != 0) indivisible(p.name, tp, "num_attention_heads", nh, r.keys[0]);
  if (nkv >= tp ? nkv % tp != 0 : tp % nkv != 0)
    fail(Errc::invalid_layout, "engine param '", p.name, "': num_key_value_heads ", nkv,
         " and tp=", tp, " must divide one another");
  const int64_t q_heads = nh / tp;
  // With fewer KV heads than ranks, tp/nkv consecutive ranks share one head.
  const int64_t kv_heads = nkv >= tp ? nkv / tp : 1;
  const int64_t kv_first = nkv >= tp ? rank * kv_heads : rank / (tp / nkv);
  stack(p, r.keys[0], rows(qs, rank * q_heads * d, q_heads * d), 0);
  int64_t row = q_heads * d;
  for (int i = 1; i < 3; ++i) {
    stack(p, r.keys[i], rows(shape_of(shapes, r.keys[i]), kv_first * d, kv_heads * d), row);
    row += kv_heads * d;
  }
  p.shape = qs;
  p.shape[0] = row;
}

// Fused experts: the rank's experts (all, or its EP share), each the rank's
// slice of the intermediate dim (MoE tp is 1 under expert parallel).
void build_experts(EngineParam& p, const Rule& r, const EngineConfig& c, const HfShapes& shapes,
                   int rank) {
  const bool w13 = r.split == Split::experts_w13;
  const int64_t e = static_cast<int64_t>(r.keys.size()) / (w13 ? 2 : 1);
  const int moe_tp = c.expert_parallel ? 1 : c.tp;
  const int moe_rank = c.expert_parallel ? 0 : rank;
  const Shape& s = shape_of(shapes, r.keys.front());  // gate/up [I, H]; down [H, I]
  const int64_t inter = w13 ? s[0] : s[1], hidden = w13 ? s[1] : s[0];
  if (inter % moe_tp != 0)
    indivisible(p.name, moe_tp, "moe_intermediate_size", inter, r.keys.front());
  const int64_t ip = inter / moe_tp, i0 = moe_rank * ip;
  const auto experts = local_experts(c, rank);
  p.shape = w13 ? Shape{static_cast<int64_t>(experts.size()), 2 * ip, hidden}
                : Shape{static_cast<int64_t>(experts.size()), hidden, ip};
  // SGLang's "w31" kernels want up (w3) before gate (w1).
  const bool up_first = c.moe_order == "w31";
  for (size_t j = 0; j < experts.size(); ++j) {
    const int64_t x = experts[j];
    if (x >= e) fail(Errc::internal, "engine layout: expert ", x, " of ", e, " in ", p.name);
    const int64_t slot = static_cast<int64_t>(j);
    if (w13) {
      const int64_t gate_row = up_first ? ip : 0, up_row = up_first ? 0 : ip;
      p.segments.push_back(
          {r.keys[x], Box{{i0, 0}, {ip, hidden}}, Box{{slot, gate_row, 0}, {1, ip, hidden}}});
      p.segments.push_back(
          {r.keys[e + x], Box{{i0, 0}, {ip, hidden}}, Box{{slot, up_row, 0}, {1, ip, hidden}}});
    } else {
      p.segments.push_back(
          {r.keys[x], Box{{0, i0}, {hidden, ip}}, Box{{slot, 0, 0}, {1, hidden, ip}}});
    }
  }
}

}  // namespace

EngineParam build_param(const Rule& r, const EngineConfig& c, const HfShapes& shapes, int rank) {
  EngineParam p;
  p.name = r.param;
  p.dtype = c.dtype;
  switch (r.split) {
    case Split::replicated:
    case Split::column:
      build_stacked(p, r, shapes, c.tp, rank);
      break;
    case Split::row:
      build_row(p, r, shapes, c.tp, rank);
      break;
    case Split::vocab:
      build_vocab(p, r, shapes, c.tp, rank);
      break;
    case Split::qkv:
      build_qkv(p, r, c, shapes, rank);
      break;
    case Split::experts_w13:
    case Split::experts_w2:
      build_experts(p, r, c, shapes, rank);
      break;
  }
  return p;
}

namespace {

void require_divides(int tp, int64_t n, const char* what) {
  if (n % tp != 0)
    fail(Errc::invalid_layout, "engine config: tp=", tp, " does not divide ", what, " (", n, ")");
}

// The config-level facts tp must divide, named as the HF config names them
// (build_param re-checks each tensor as a backstop).
void validate(const EngineConfig& c) {
  const HfModelConfig& hf = c.hf;
  const int tp = c.tp;
  if (c.expert_placement != "linear" && c.expert_placement != "round_robin")
    fail(Errc::invalid_layout, "engine config: unknown expert_placement '", c.expert_placement,
         "'");
  require_divides(tp, hf.num_heads, "num_attention_heads");
  if (hf.family != "deepseek_v3") {
    const int64_t nkv = hf.num_kv_heads;
    if (nkv >= tp ? nkv % tp != 0 : tp % nkv != 0)
      fail(Errc::invalid_layout, "engine config: num_key_value_heads (", nkv, ") and tp=", tp,
           " must divide one another");
  }
  bool has_dense = false;
  for (int64_t l = 0; l < hf.num_layers; ++l) has_dense = has_dense || !hf.is_moe_layer(l);
  if (has_dense) require_divides(tp, hf.intermediate_size, "intermediate_size");
  if (hf.is_moe() && !c.expert_parallel)
    require_divides(tp, hf.moe_intermediate_size, "moe_intermediate_size");
  if (hf.is_moe() && c.expert_parallel && hf.num_experts < tp)
    fail(Errc::invalid_layout, "engine config: expert_parallel over tp=", tp, " ranks needs at ",
         "least ", tp, " experts, the model has ", hf.num_experts);
  if (hf.shared_expert_intermediate_size > 0)
    require_divides(tp, hf.shared_expert_intermediate_size, "shared_expert_intermediate_size");
  if (hf.n_shared_experts > 0)
    require_divides(tp, hf.n_shared_experts * hf.moe_intermediate_size,
                    "n_shared_experts * moe_intermediate_size");
  if (padded_vocab(hf.vocab_size) % tp != 0)
    fail(Errc::invalid_layout, "engine config: tp=", tp, " does not divide the vocab padded to ",
         "a multiple of 64 (", hf.vocab_size, " -> ", padded_vocab(hf.vocab_size), ")");
}

// Appends the param of `rule` for rank `r`, and with FP8 its scale param.
void add_param(EngineRankLayout& rank, const Rule& rule, const EngineConfig& c,
               const HfShapes& shapes, int r) {
  rank.params.push_back(build_param(rule, c, shapes, r));
  if (!rule.quantized) return;
  const auto index = static_cast<int32_t>(rank.params.size() - 1);
  EngineParam scale = make_quantized(rank.params.back(), *c.quantization, shapes, r, c.tp, index);
  rank.params.push_back(std::move(scale));
}

}  // namespace

std::vector<EngineRankLayout> rule_ranks(const EngineConfig& config, const Renames& renames,
                                         const Fp8Selection* fp8) {
  validate(config);
  const auto tensors = hf_tensors(config.hf);
  HfShapes shapes;
  for (const auto& t : tensors) shapes.emplace(t.key, t.shape);
  const auto rules = rules_for(config, shapes, tensors, renames, fp8);
  std::vector<EngineRankLayout> ranks(static_cast<size_t>(config.tp));
  for (int r = 0; r < config.tp; ++r) {
    auto& rank = ranks[static_cast<size_t>(r)];
    rank.rank = r;
    rank.params.reserve(rules.size());
    for (const auto& rule : rules) add_param(rank, rule, config, shapes, r);
  }
  return ranks;
}

}  // namespace engine

// One replica's layout, from its framework (engine_frameworks.cpp).
EngineLayout make_engine_layout(const EngineConfig& config) {
  const engine::Framework& framework = engine::find_framework(config.framework);
  engine::check_framework_options(framework, config);
  EngineLayout layout;
  layout.config = config;
  layout.ranks = framework.ranks(config);
  layout.groups = {{config, 0, 0, 0}};
  if (framework.checked_for_coverage) check_coverage(layout);
  return layout;
}

EngineLayout make_engine_layout(const EngineSpec& spec) {
  if (spec.groups.empty()) fail(Errc::invalid_layout, "engine config: no engine group");
  EngineLayout out;
  for (size_t i = 0; i < spec.groups.size(); ++i) {
    EngineLayout one;
    try {
      one = make_engine_layout(spec.groups[i]);
    } catch (const Error& e) {
      throw Error(e.code(), spec.groups.size() > 1 ? cat("engine group ", i, ": ", e.what())
                                                   : std::string(e.what()));
    }
    EngineGroup g{one.config, out.world(), out.num_replicas(), static_cast<int>(out.ranks.size())};
    if (i == 0) out.config = one.config;
    out.ranks.insert(out.ranks.end(), std::make_move_iterator(one.ranks.begin()),
                     std::make_move_iterator(one.ranks.end()));
    out.groups.push_back(std::move(g));
  }
  return out;
}

}  // namespace weightsync
