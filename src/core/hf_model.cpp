// HfModelConfig parsing and the tensor list of each supported HF family.
//
// The per-family differences are small facts (attention kind, qk norms, qkv
// biases, how the MoE block is named), kept in one table so that adding a
// family is a row plus, at most, one small function.
#include <weightsync/error.h>
#include <weightsync/hf_model.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <fstream>
#include <optional>

namespace weightsync {
namespace {

using nlohmann::json;

enum class Attention { gqa, mla };
enum class Moe { none, qwen, qwen2_shared, mixtral, deepseek };

struct Family {
  std::string_view name;
  std::array<std::string_view, 2> model_types;  // "" for unused entries
  std::string_view architecture;
  Attention attention;
  bool qk_norm;
  bool qkv_bias;  // q/k/v biases (Qwen2: always, with no config switch)
  Moe moe;
};

// Kimi-K2 ships as model_type "kimi_k2" with the DeepseekV3 architecture;
// Mistral's dense models store exactly Llama's tensors.
constexpr std::array<Family, 7> kFamilies{{
    {"llama", {"llama", "mistral"}, "LlamaForCausalLM", Attention::gqa, false, false, Moe::none},
    {"qwen2", {"qwen2", ""}, "Qwen2ForCausalLM", Attention::gqa, false, true, Moe::none},
    {"qwen3", {"qwen3", ""}, "Qwen3ForCausalLM", Attention::gqa, true, false, Moe::none},
    {"qwen3_moe", {"qwen3_moe", ""}, "Qwen3MoeForCausalLM", Attention::gqa, true, false, Moe::qwen},
    {"qwen2_moe",
     {"qwen2_moe", ""},
     "Qwen2MoeForCausalLM",
     Attention::gqa,
     false,
     true,
     Moe::qwen2_shared},
    {"mixtral", {"mixtral", ""}, "MixtralForCausalLM", Attention::gqa, false, false, Moe::mixtral},
    {"deepseek_v3",
     {"deepseek_v3", "kimi_k2"},
     "DeepseekV3ForCausalLM",
     Attention::mla,
     false,
     false,
     Moe::deepseek},
}};

const Family& family_of(const std::string& name) {
  for (const auto& f : kFamilies)
    if (f.name == name) return f;
  fail(Errc::internal, "hf_model: no family '", name, "'");
}

// Typed field access: a field of the wrong type is an error naming it, never
// a silent default. JSON null counts as absent (HF writes "head_dim": null).
std::optional<int64_t> opt_int(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer())
    fail(Errc::format, "HF config: field '", field, "' must be an integer, got ", it->dump());
  return it->get<int64_t>();
}

int64_t req_int(const json& j, const char* field) {
  auto v = opt_int(j, field);
  if (!v) fail(Errc::format, "HF config: missing integer field '", field, "'");
  return *v;
}

std::optional<bool> opt_bool(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean())
    fail(Errc::format, "HF config: field '", field, "' must be a boolean, got ", it->dump());
  return it->get<bool>();
}

std::string opt_string(const json& j, const char* field) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return "";
  if (!it->is_string())
    fail(Errc::format, "HF config: field '", field, "' must be a string, got ", it->dump());
  return it->get<std::string>();
}

const Family& recognise(const json& j) {
  const std::string model_type = opt_string(j, "model_type");
  for (const auto& f : kFamilies)
    for (auto t : f.model_types)
      if (!t.empty() && t == model_type) return f;
  std::string archs;
  if (auto it = j.find("architectures"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) fail(Errc::format, "HF config: field 'architectures' must be an array");
    for (const auto& a : *it) {
      if (!a.is_string()) fail(Errc::format, "HF config: 'architectures' holds a non-string");
      for (const auto& f : kFamilies)
        if (f.architecture == a.get<std::string>()) return f;
      archs += (archs.empty() ? "" : ", ") + a.get<std::string>();
    }
  }
  fail(Errc::invalid_argument, "HF config: unsupported architecture (model_type '", model_type,
       "', architectures [", archs,
       "]); supported: llama, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, deepseek_v3/kimi_k2");
}

DType parse_torch_dtype(const json& j) {
  std::string name = opt_string(j, "torch_dtype");
  if (name.empty()) name = opt_string(j, "dtype");  // newer transformers
  if (name.empty() || name == "bfloat16") return DType::BF16;
  if (name == "float16") return DType::F16;
  if (name == "float32") return DType::F32;
  fail(Errc::format, "HF config: torch_dtype '", name,
       "' is not supported (expected bfloat16, float16 or float32)");
}

void read_moe_fields(HfModelConfig& c, const json& j, Moe moe) {
  switch (moe) {
    case Moe::none:
      return;
    case Moe::mixtral:
      // Mixtral's experts use intermediate_size; every layer is MoE.
      c.num_experts = req_int(j, "num_local_experts");
      c.moe_intermediate_size = c.intermediate_size;
      return;
    case Moe::qwen:
    case Moe::qwen2_shared:
      // transformers >= 5.2x writes Qwen MoE configs (to_dict) with the
      // expert count as num_local_experts.
      c.num_experts = j.contains("num_experts") || !j.contains("num_local_experts")
                          ? req_int(j, "num_experts")
                          : req_int(j, "num_local_experts");
      c.moe_intermediate_size = req_int(j, "moe_intermediate_size");
      c.decoder_sparse_step = opt_int(j, "decoder_sparse_step").value_or(1);
      if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
        if (!it->is_array()) fail(Errc::format, "HF config: 'mlp_only_layers' must be an array");
        for (const auto& v : *it) {
          if (!v.is_number_integer())
            fail(Errc::format, "HF config: 'mlp_only_layers' must hold integers");
          c.mlp_only_layers.push_back(v.get<int64_t>());
        }
      }
      if (moe == Moe::qwen2_shared)
        c.shared_expert_intermediate_size = req_int(j, "shared_expert_intermediate_size");
      return;
    case Moe::deepseek:
      c.num_experts = req_int(j, "n_routed_experts");
      c.moe_intermediate_size = req_int(j, "moe_intermediate_size");
      c.n_shared_experts = opt_int(j, "n_shared_experts").value_or(0);
      c.first_k_dense_replace = opt_int(j, "first_k_dense_replace").value_or(0);
      c.moe_layer_freq = opt_int(j, "moe_layer_freq").value_or(1);
      return;
  }
}

void validate(const HfModelConfig& c) {
  auto positive = [](int64_t v, const char* field) {
    if (v <= 0) fail(Errc::format, "HF config: '", field, "' must be positive, got ", v);
  };
  positive(c.hidden_size, "hidden_size");
  positive(c.num_layers, "num_hidden_layers");
  positive(c.num_heads, "num_attention_heads");
  positive(c.num_kv_heads, "num_key_value_heads");
  positive(c.vocab_size, "vocab_size");
  positive(c.intermediate_size, "intermediate_size");
  if (c.family == "deepseek_v3") {
    positive(c.kv_lora_rank, "kv_lora_rank");
    positive(c.qk_nope_head_dim, "qk_nope_head_dim");
    positive(c.qk_rope_head_dim, "qk_rope_head_dim");
    positive(c.v_head_dim, "v_head_dim");
    if (c.q_lora_rank < 0) fail(Errc::format, "HF config: 'q_lora_rank' must not be negative");
  } else {
    positive(c.head_dim, "head_dim");
    if (c.num_heads % c.num_kv_heads != 0)
      fail(Errc::format, "HF config: num_attention_heads ", c.num_heads,
           " is not a multiple of num_key_value_heads ", c.num_kv_heads);
  }
  if (c.is_moe()) {
    positive(c.moe_intermediate_size, "moe_intermediate_size");
    positive(c.decoder_sparse_step, "decoder_sparse_step");
    positive(c.moe_layer_freq, "moe_layer_freq");
  } else if (family_of(c.family).moe != Moe::none) {
    fail(Errc::format, "HF config: a ", c.family, " model needs a positive expert count");
  }
}

}  // namespace

HfModelConfig HfModelConfig::from_json(const json& j) {
  if (!j.is_object()) fail(Errc::format, "HF config: expected a JSON object");
  const Family& f = recognise(j);
  HfModelConfig c;
  c.family = std::string(f.name);
  c.model_type = opt_string(j, "model_type");
  c.dtype = parse_torch_dtype(j);
  c.hidden_size = req_int(j, "hidden_size");
  c.intermediate_size = req_int(j, "intermediate_size");
  c.num_layers = req_int(j, "num_hidden_layers");
  c.num_heads = req_int(j, "num_attention_heads");
  c.num_kv_heads = opt_int(j, "num_key_value_heads").value_or(c.num_heads);
  c.head_dim = opt_int(j, "head_dim").value_or(c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  c.vocab_size = req_int(j, "vocab_size");
  c.tie_word_embeddings = opt_bool(j, "tie_word_embeddings").value_or(false);
  c.qkv_bias = f.qkv_bias;
  // Qwen2 always has q/k/v biases (its config has no switch). Elsewhere
  // attention_bias also adds an o_proj bias, which no model we target has.
  if (!f.qkv_bias && opt_bool(j, "attention_bias").value_or(false))
    fail(Errc::unsupported, "HF config: attention_bias=true is not supported for ", f.name);
  if (f.attention == Attention::mla) {
    c.q_lora_rank = opt_int(j, "q_lora_rank").value_or(0);
    c.kv_lora_rank = req_int(j, "kv_lora_rank");
    c.qk_nope_head_dim = req_int(j, "qk_nope_head_dim");
    c.qk_rope_head_dim = req_int(j, "qk_rope_head_dim");
    c.v_head_dim = req_int(j, "v_head_dim");
  }
  read_moe_fields(c, j, f.moe);
  c.set_raw(j);
  validate(c);
  return c;
}

HfModelConfig HfModelConfig::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(Errc::io, "HF config: cannot open '", path, "'");
  json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail(Errc::format, "HF config '", path, "': not valid JSON");
  try {
    return from_json(j);
  } catch (const Error& e) {
    throw Error(e.code(), cat(path, ": ", e.what()));
  }
}

bool HfModelConfig::is_moe_layer(int64_t layer) const {
  if (!is_moe()) return false;
  switch (family_of(family).moe) {
    case Moe::none:
      return false;
    case Moe::mixtral:
      return true;
    case Moe::qwen:
    case Moe::qwen2_shared:
      // As transformers' Qwen*MoeDecoderLayer decides.
      return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) ==
                 mlp_only_layers.end() &&
             (layer + 1) % decoder_sparse_step == 0;
    case Moe::deepseek:
      return layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  return false;
}

namespace {

struct TensorList {
  DType dtype;
  std::vector<HfTensorSpec> out;
  void add(std::string key, Shape shape) {
    out.push_back({std::move(key), std::move(shape), dtype});
  }
};

void add_gqa_attention(TensorList& t, const HfModelConfig& c, const std::string& p) {
  const int64_t q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim, h = c.hidden_size;
  t.add(p + "self_attn.q_proj.weight", {q, h});
  t.add(p + "self_attn.k_proj.weight", {kv, h});
  t.add(p + "self_attn.v_proj.weight", {kv, h});
  if (c.qkv_bias) {
    t.add(p + "self_attn.q_proj.bias", {q});
    t.add(p + "self_attn.k_proj.bias", {kv});
    t.add(p + "self_attn.v_proj.bias", {kv});
  }
  t.add(p + "self_attn.o_proj.weight", {h, q});
  if (family_of(c.family).qk_norm) {
    t.add(p + "self_attn.q_norm.weight", {c.head_dim});
    t.add(p + "self_attn.k_norm.weight", {c.head_dim});
  }
}

void add_mla_attention(TensorList& t, const HfModelConfig& c, const std::string& p) {
  const int64_t h = c.hidden_size, qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim;
  if (c.q_lora_rank > 0) {
    t.add(p + "self_attn.q_a_proj.weight", {c.q_lora_rank, h});
    t.add(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank});
    t.add(p + "self_attn.q_b_proj.weight", {c.num_heads * qk_head, c.q_lora_rank});
  } else {
    t.add(p + "self_attn.q_proj.weight", {c.num_heads * qk_head, h});
  }
  t.add(p + "self_attn.kv_a_proj_with_mqa.weight", {c.kv_lora_rank + c.qk_rope_head_dim, h});
  t.add(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank});
  t.add(p + "self_attn.kv_b_proj.weight",
        {c.num_heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank});
  t.add(p + "self_attn.o_proj.weight", {h, c.num_heads * c.v_head_dim});
}

void add_gated_mlp(TensorList& t, const std::string& p, int64_t hidden, int64_t inter) {
  t.add(p + "gate_proj.weight", {inter, hidden});
  t.add(p + "up_proj.weight", {inter, hidden});
  t.add(p + "down_proj.weight", {hidden, inter});
}

// The prefix of a MoE block and its expert projection names.
struct MoeNames {
  std::string block;  // "mlp." or "block_sparse_moe."
  std::string gate, up, down;
};

MoeNames moe_names(Moe moe) {
  if (moe == Moe::mixtral) return {"block_sparse_moe.", "w1", "w3", "w2"};
  return {"mlp.", "gate_proj", "up_proj", "down_proj"};
}

void add_moe(TensorList& t, const HfModelConfig& c, const std::string& p) {
  const Moe moe = family_of(c.family).moe;
  const MoeNames n = moe_names(moe);
  const int64_t h = c.hidden_size, e = c.num_experts, i = c.moe_intermediate_size;
  t.add(p + n.block + "gate.weight", {e, h});
  if (moe == Moe::deepseek) t.add(p + n.block + "gate.e_score_correction_bias", {e});
  for (int64_t x = 0; x < e; ++x) {
    const std::string ep = p + n.block + "experts." + std::to_string(x) + ".";
    t.add(ep + n.gate + ".weight", {i, h});
    t.add(ep + n.up + ".weight", {i, h});
    t.add(ep + n.down + ".weight", {h, i});
  }
  if (moe == Moe::qwen2_shared) {
    add_gated_mlp(t, p + "mlp.shared_expert.", h, c.shared_expert_intermediate_size);
    t.add(p + "mlp.shared_expert_gate.weight", {1, h});
  }
  if (moe == Moe::deepseek && c.n_shared_experts > 0)
    add_gated_mlp(t, p + "mlp.shared_experts.", h, c.n_shared_experts * i);
}

}  // namespace

// DeepSeek-V3 and Kimi-K2 checkpoints are really stored in F8_E4M3 with a
// weight_scale_inv tensor per 128x128 block. weightsync models them in the
// config's torch_dtype (BF16) without scales, the form a BF16 trainer holds.
std::vector<HfTensorSpec> hf_tensors(const HfModelConfig& c) {
  TensorList t{c.dtype, {}};
  const int64_t h = c.hidden_size;
  const Family& f = family_of(c.family);
  t.add("model.embed_tokens.weight", {c.vocab_size, h});
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    t.add(p + "input_layernorm.weight", {h});
    if (f.attention == Attention::mla)
      add_mla_attention(t, c, p);
    else
      add_gqa_attention(t, c, p);
    t.add(p + "post_attention_layernorm.weight", {h});
    if (c.is_moe_layer(layer))
      add_moe(t, c, p);
    else
      add_gated_mlp(t, p + "mlp.", h, c.intermediate_size);
  }
  t.add("model.norm.weight", {h});
  if (!c.tie_word_embeddings) t.add("lm_head.weight", {c.vocab_size, h});
  return t.out;
}

std::vector<MoeLayerKeys> hf_moe_layers(const HfModelConfig& c) {
  std::vector<MoeLayerKeys> layers;
  if (!c.is_moe()) return layers;
  const MoeNames n = moe_names(family_of(c.family).moe);
  for (int64_t layer = 0; layer < c.num_layers; ++layer) {
    if (!c.is_moe_layer(layer)) continue;
    MoeLayerKeys k;
    k.layer = layer;
    const std::string p = "model.layers." + std::to_string(layer) + "." + n.block + "experts.";
    for (int64_t x = 0; x < c.num_experts; ++x) {
      const std::string ep = p + std::to_string(x) + ".";
      k.gate.push_back(ep + n.gate + ".weight");
      k.up.push_back(ep + n.up + ".weight");
      k.down.push_back(ep + n.down + ".weight");
    }
    layers.push_back(std::move(k));
  }
  return layers;
}

const nlohmann::json& HfModelConfig::raw() const noexcept {
  static const nlohmann::json kNull;
  return raw_ ? *raw_ : kNull;
}

void HfModelConfig::set_raw(nlohmann::json config) {
  raw_ = std::make_shared<const nlohmann::json>(std::move(config));
}

}  // namespace weightsync
