// Megatron-Core trainer layouts (Transformer Engine layer spec): every rank's
// params under Megatron's names, on its pipeline stage. The facts and where
// they come from: docs/megatron.md.
#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include "trainer_layout_megatron_mesh.h"

#include <map>
#include <set>

namespace weightsync {
namespace {

using detail::MegatronMesh;

class Builder {
 public:
  Builder(const HfModelConfig& config, const MegatronParallel& par, const MegatronOptions& opt,
          DType dtype)
      : c_(config),
        par_(par),
        opt_(opt),
        dtype_(dtype),
        mesh_(detail::megatron_mesh(par, config.is_moe())) {
    for (HfTensorSpec& t : hf_tensors(config)) shapes_.emplace(std::move(t.key), t.shape);
    layout_.mesh = mesh_.mesh;
  }

  TrainerLayout build(const std::vector<int64_t>& layers_per_stage) {
    int64_t first = 0;
    for (int64_t s = 0; s < par_.pp; ++s) {
      stage_ = s;
      if (s == 0) vocab("embedding.word_embeddings.weight", "model.embed_tokens.weight");
      for (int64_t l = 0; l < layers_per_stage[s]; ++l) add_layer(first + l, l);
      first += layers_per_stage[s];
      if (s == par_.pp - 1) add_head();
    }
    return std::move(layout_);
  }

 private:
  const HfModelConfig& c_;
  MegatronParallel par_;
  MegatronOptions opt_;
  DType dtype_;
  MegatronMesh mesh_;
  std::map<std::string, Shape, std::less<>> shapes_;
  TrainerLayout layout_;
  int64_t stage_ = 0;

  bool has(const std::string& key) const { return shapes_.count(key) > 0; }
  const Shape& shape(const std::string& key) const {
    auto it = shapes_.find(key);
    if (it == shapes_.end())
      fail(Errc::internal, "megatron layout: the ", c_.family, " checkpoint has no key '", key,
           "'");
    return it->second;
  }

  std::vector<ShardSpec> on(const std::vector<std::string>& axes, int dim, int64_t interleave) {
    std::vector<ShardSpec> out;
    for (const std::string& a : axes) out.push_back({dim, a, interleave});
    return out;
  }

  LoadSpec& add(std::string name, std::vector<std::string> keys, Shape global,
                std::vector<ShardSpec> shards, std::optional<int> fused_dim = std::nullopt) {
    LoadSpec s;
    s.name = std::move(name);
    s.hf_keys = std::move(keys);
    s.fused_dim = s.hf_keys.size() > 1 ? fused_dim : std::nullopt;
    s.global_shape = s.origin_shape = std::move(global);
    s.dtype = dtype_;
    s.shards = std::move(shards);
    if (par_.pp > 1) s.stage = StageSpec{"pp", stage_};
    layout_.params.push_back(std::move(s));
    return layout_.params.back();
  }

  void replicated(const std::string& name, const std::string& key) {
    add(name, {key}, shape(key), {});
  }
  // Column parallel: dim 0 over the tensor-parallel ranks (whole heads).
  void column(const std::string& name, const std::string& key) {
    need_divisible(key, shape(key)[0], par_.tp, "tp");
    add(name, {key}, shape(key), on(mesh_.tp, 0, 1));
  }
  // Row parallel: dim 1.
  void row(const std::string& name, const std::string& key) {
    need_divisible(key, shape(key)[1], par_.tp, "tp");
    add(name, {key}, shape(key), on(mesh_.tp, 1, 1));
  }
  // `[gate; up]` with rank r holding [gate_r; up_r]: interleave 2.
  void gate_up(const std::string& name, const std::string& gate, const std::string& up,
               const std::vector<std::string>& axes, int64_t ways, const char* axis) {
    const Shape& g = shape(gate);
    need_divisible(gate, g[0], ways, axis);
    add(name, {gate, up}, {2 * g[0], g[1]}, on(axes, 0, 2), 0);
  }
  void vocab(const std::string& name, const std::string& key) {
    const Shape& s = shape(key);
    LoadSpec& p = add(name, {key}, s, on(mesh_.tp, 0, 1));
    p.global_shape[0] = megatron_padded_vocab(c_.vocab_size, par_.tp, opt_.vocab_divisible_by);
  }
  void need_divisible(const std::string& key, int64_t n, int64_t ways, const char* axis) const {
    if (n % ways != 0)
      fail(Errc::invalid_layout, "megatron layout: '", key, "' has ", n,
           " rows/columns to split over ", axis, "=", ways,
           ", which does not divide them (Megatron-Core refuses it)");
  }

  void add_layer(int64_t global, int64_t local) {
    const std::string hf = cat("model.layers.", global, "."),
                      mg = cat("decoder.layers.", local, ".");
    if (has(hf + "self_attn.kv_a_proj_with_mqa.weight"))
      add_mla(hf, mg);
    else
      add_gqa(hf, mg);
    if (c_.is_moe_layer(global))
      add_moe(hf, mg);
    else
      add_dense_mlp(hf, mg);
  }

  // Grouped QKV: per query group g, its nh/nkv query heads, then k head g,
  // then v head g. Tensor parallel cuts these rows into tp equal blocks:
  // whole groups when tp divides nkv, a group's rows in tp/nkv blocks when nkv
  // divides tp (Megatron-Core all-gathers the QKV activations then).
  void qkv(const std::string& name, const std::string& hf, const char* what) {
    const std::string q = hf + "self_attn.q_proj." + what, k = hf + "self_attn.k_proj." + what,
                      v = hf + "self_attn.v_proj." + what;
    const int64_t nkv = c_.num_kv_heads, hd = c_.head_dim, per = c_.num_heads / nkv;
    const Shape& qs = shape(q);
    const bool bias = qs.size() == 1;
    const int64_t rows = (c_.num_heads + 2 * nkv) * hd;
    need_divisible(name, rows, par_.tp, "tp");
    LoadSpec& p = add(name, {q, k, v}, bias ? Shape{rows} : Shape{rows, qs[1]}, on(mesh_.tp, 0, 1));
    p.segments.emplace();
    auto box = [&](int64_t row, int64_t len) {
      return bias ? Box{{row}, {len}} : Box{{row, 0}, {len, qs[1]}};
    };
    for (int64_t g = 0; g < nkv; ++g) {
      const int64_t at = g * (per + 2) * hd;
      p.segments->push_back({0, box(g * per * hd, per * hd), box(at, per * hd)});
      p.segments->push_back({1, box(g * hd, hd), box(at + per * hd, hd)});
      p.segments->push_back({2, box(g * hd, hd), box(at + (per + 1) * hd, hd)});
    }
  }

  void add_gqa(const std::string& hf, const std::string& mg) {
    const int64_t nkv = c_.num_kv_heads, tp = par_.tp;
    if (c_.num_heads % tp != 0 || (nkv % tp != 0 && tp % nkv != 0))
      fail(Errc::invalid_layout, "megatron layout: ", c_.num_heads, " query heads in ", nkv,
           " groups do not split over tp=", tp,
           " (Megatron-Core needs num_attention_heads % tp == 0 and num_query_groups a multiple"
           " or a divisor of tp)");
    replicated(mg + "self_attention.linear_qkv.layer_norm_weight", hf + "input_layernorm.weight");
    qkv(mg + "self_attention.linear_qkv.weight", hf, "weight");
    if (has(hf + "self_attn.q_proj.bias")) qkv(mg + "self_attention.linear_qkv.bias", hf, "bias");
    if (has(hf + "self_attn.q_norm.weight")) {
      replicated(mg + "self_attention.q_layernorm.weight", hf + "self_attn.q_norm.weight");
      replicated(mg + "self_attention.k_layernorm.weight", hf + "self_attn.k_norm.weight");
    }
    row(mg + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight");
  }

  // Multi-latent attention (DeepSeek-V3): the down projections replicated,
  // the q/kv norms fused into the up projections (qk_layernorm, TE spec).
  void add_mla(const std::string& hf, const std::string& mg) {
    if (c_.num_heads % par_.tp != 0)
      fail(Errc::invalid_layout, "megatron layout: ", c_.num_heads,
           " heads do not split over tp=", par_.tp);
    const std::string a = mg + "self_attention.", h = hf + "self_attn.";
    replicated(mg + "input_layernorm.weight", hf + "input_layernorm.weight");
    if (has(h + "q_a_proj.weight")) {
      replicated(a + "linear_q_down_proj.weight", h + "q_a_proj.weight");
      replicated(a + "linear_q_up_proj.layer_norm_weight", h + "q_a_layernorm.weight");
      column(a + "linear_q_up_proj.weight", h + "q_b_proj.weight");
    } else {
      column(a + "linear_q_proj.weight", h + "q_proj.weight");
    }
    replicated(a + "linear_kv_down_proj.weight", h + "kv_a_proj_with_mqa.weight");
    replicated(a + "linear_kv_up_proj.layer_norm_weight", h + "kv_a_layernorm.weight");
    column(a + "linear_kv_up_proj.weight", h + "kv_b_proj.weight");
    row(a + "linear_proj.weight", h + "o_proj.weight");
  }

  void add_dense_mlp(const std::string& hf, const std::string& mg) {
    replicated(mg + "mlp.linear_fc1.layer_norm_weight", hf + "post_attention_layernorm.weight");
    gate_up(mg + "mlp.linear_fc1.weight", hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight",
            mesh_.tp, par_.tp, "tp");
    row(mg + "mlp.linear_fc2.weight", hf + "mlp.down_proj.weight");
  }

  void add_moe(const std::string& hf, const std::string& mg) {
    const bool mixtral = c_.family == "mixtral";
    const std::string block = hf + (mixtral ? "block_sparse_moe." : "mlp.");
    const char* gate = mixtral ? "w1" : "gate_proj";
    const char* up = mixtral ? "w3" : "up_proj";
    const char* down = mixtral ? "w2" : "down_proj";
    replicated(mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight");
    replicated(mg + "mlp.router.weight", block + "gate.weight");
    if (has(block + "gate.e_score_correction_bias"))
      replicated(mg + "mlp.router.expert_bias", block + "gate.e_score_correction_bias");
    add_experts(block + "experts.", mg + "mlp.experts.", gate, up, down);
    if (has(block + "shared_experts.gate_proj.weight")) {
      const std::string s = block + "shared_experts.";
      gate_up(mg + "mlp.shared_experts.linear_fc1.weight", s + "gate_proj.weight",
              s + "up_proj.weight", mesh_.tp, par_.tp, "tp");
      row(mg + "mlp.shared_experts.linear_fc2.weight", s + "down_proj.weight");
    }
  }

  // TE's grouped MLP: local expert e of EP rank r is global expert
  // r * E/ep + e. Param weight{e}'s global tensor stacks expert e of every EP
  // rank (fc1 on dim 0, fc2 on dim 1), so one LoadSpec serves all EP ranks.
  void add_experts(const std::string& hf, const std::string& mg, const char* gate, const char* up,
                   const char* down) {
    const int64_t local = c_.num_experts / par_.ep;
    for (int64_t e = 0; e < local; ++e) {
      std::vector<std::string> fc1, fc2;
      for (int64_t r = 0; r < par_.ep; ++r) {
        const std::string x = cat(hf, r * local + e, ".");
        fc1.push_back(x + gate + ".weight");
        fc1.push_back(x + up + ".weight");
        fc2.push_back(x + down + ".weight");
      }
      const Shape g = shape(fc1[0]), d = shape(fc2[0]);
      need_divisible(fc1[0], g[0], par_.expert_tp(), "etp");
      std::vector<ShardSpec> s1 = on(mesh_.ep, 0, 1), s2 = on(mesh_.ep, 1, 1);
      for (ShardSpec& s : on(mesh_.etp, 0, 2)) s1.push_back(s);
      for (ShardSpec& s : on(mesh_.etp, 1, 1)) s2.push_back(s);
      add(cat(mg, "linear_fc1.weight", e), std::move(fc1), {par_.ep * 2 * g[0], g[1]},
          std::move(s1), 0);
      add(cat(mg, "linear_fc2.weight", e), std::move(fc2), {d[0], par_.ep * d[1]}, std::move(s2),
          1);
    }
  }

  void add_head() {
    replicated("decoder.final_layernorm.weight", "model.norm.weight");
    if (has("lm_head.weight")) {
      vocab("output_layer.weight", "lm_head.weight");
    } else if (par_.pp > 1) {
      // Tied embeddings: the last stage keeps its own copy of the embedding,
      // which Megatron keeps equal to the first stage's (it all-reduces their
      // gradients); the first stage's is the one sent.
      LoadSpec& p =
          add("output_layer.weight", {}, shape("model.embed_tokens.weight"), on(mesh_.tp, 0, 1));
      p.global_shape[0] = megatron_padded_vocab(c_.vocab_size, par_.tp, opt_.vocab_divisible_by);
      p.origin_shape = p.global_shape;
      p.segments.emplace();
      p.mirror_of = "model.embed_tokens.weight";
    }
  }
};

}  // namespace

MegatronParallel megatron_parallel(const Mesh& sizes) {
  MegatronParallel p;
  for (size_t i = 0; i < sizes.axes.size(); ++i) {
    const std::string& a = sizes.axes[i];
    int64_t* field = a == "pp"    ? &p.pp
                     : a == "tp"  ? &p.tp
                     : a == "dp"  ? &p.dp
                     : a == "cp"  ? &p.cp
                     : a == "ep"  ? &p.ep
                     : a == "etp" ? &p.etp
                                  : nullptr;
    if (!field)
      fail(Errc::invalid_argument, "megatron parallel sizes: unknown name '", a,
           "' (expected pp, tp, dp, cp, ep, etp)");
    *field = sizes.shape[i];
  }
  return p;
}

MegatronParallel parse_megatron_parallel(std::string_view spec) {
  return megatron_parallel(parse_mesh_spec(spec));
}

int64_t megatron_padded_vocab(int64_t vocab_size, int64_t tp, int64_t divisible_by) {
  if (divisible_by <= 0) {
    if (vocab_size % tp != 0)
      fail(Errc::invalid_layout, "megatron layout: vocab_size ", vocab_size,
           " does not split over tp=", tp,
           " without padding (set make_vocab_size_divisible_by, Megatron-LM's default 128)");
    return vocab_size;
  }
  const int64_t multiple = divisible_by * tp;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

std::vector<int64_t> megatron_stage_layers(int64_t num_layers, int64_t pp,
                                           const MegatronOptions& opt) {
  const auto first = opt.first_stage_layers, last = opt.last_stage_layers;
  if (!first && !last) {
    if (num_layers % pp != 0)
      fail(Errc::invalid_layout, "megatron layout: ", num_layers, " layers do not split evenly",
           " over pp=", pp, " stages; Megatron-Core refuses uneven stages unless",
           " num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage are set");
    return std::vector<int64_t>(static_cast<size_t>(pp), num_layers / pp);
  }
  if (pp < 2)
    fail(Errc::invalid_layout, "megatron layout: first/last stage layer counts need pp >= 2");
  int64_t middle_layers = num_layers, middle_stages = pp;
  for (const auto& n : {first, last}) {
    if (!n) continue;
    if (*n <= 0)
      fail(Errc::invalid_layout, "megatron layout: a first/last stage layer count of ", *n,
           " (Megatron-Core needs it larger than 0)");
    middle_layers -= *n;
    middle_stages -= 1;
  }
  if (middle_layers < 0)
    fail(Errc::invalid_layout, "megatron layout: the first/last stages take more than the ",
         num_layers, " layers of the model (pp=", pp, ")");
  // Megatron-Core checks only that the middle layers split evenly over the
  // middle stages (a middle stage may hold none); layers left over without a
  // middle stage would be built on no stage at all, so they are refused too.
  if (middle_stages == 0 && middle_layers != 0)
    fail(Errc::invalid_layout, "megatron layout: ", middle_layers, " of the ", num_layers,
         " layers are on no stage of pp=", pp,
         " (the first/last stage counts leave them without a middle stage)");
  if (middle_stages > 0 && middle_layers % middle_stages != 0)
    fail(Errc::invalid_layout, "megatron layout: ", middle_layers, " layers left for ",
         middle_stages, " middle stages of pp=", pp, " (of ", num_layers,
         " layers; Megatron-Core needs the middle layers to split evenly over the middle "
         "stages)");
  std::vector<int64_t> out(static_cast<size_t>(pp),
                           middle_stages > 0 ? middle_layers / middle_stages : 0);
  if (first) out.front() = *first;
  if (last) out.back() = *last;
  return out;
}

TrainerLayout make_megatron_layout(const HfModelConfig& config, const MegatronParallel& par,
                                   const MegatronOptions& options, std::optional<DType> dtype) {
  static const std::set<std::string> kFamilies = {"llama",     "qwen2",   "qwen3",
                                                  "qwen3_moe", "mixtral", "deepseek_v3"};
  if (!kFamilies.count(config.family))
    fail(Errc::unsupported, "megatron layout: the ", config.family,
         " family is not covered (llama, qwen2, qwen3, qwen3_moe, mixtral, deepseek_v3 are)");
  detail::check_parallel(config, par);
  const std::vector<int64_t> layers = megatron_stage_layers(config.num_layers, par.pp, options);
  TrainerLayout layout = Builder(config, par, options, dtype.value_or(config.dtype)).build(layers);
  layout.validate();
  return layout;
}

}  // namespace weightsync
