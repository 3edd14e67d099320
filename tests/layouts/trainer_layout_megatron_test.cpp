// make_megatron_layout (Megatron-Core style, trainer_layout.h): meshes in
// Megatron's rank order, names per stage, coverage of every checkpoint key,
// and the configurations Megatron-Core refuses. Element-level equality with
// an independent reference: tests/python/test_megatron_layout.py.
#include <weightsync/error.h>
#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <ostream>
#include <set>

namespace weightsync {
namespace {

HfModelConfig model(const std::string& name) {
  return HfModelConfig::load(std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/" + name +
                             "/config.json");
}

// The config with `num_hidden_layers` changed (for stage splits).
HfModelConfig with_layers(const std::string& name, int64_t layers) {
  nlohmann::json j = model(name).raw();
  j["num_hidden_layers"] = layers;
  return HfModelConfig::from_json(j);
}

TrainerLayout megatron(const HfModelConfig& c, const std::string& sizes,
                       const MegatronOptions& o = {}) {
  return make_megatron_layout(c, parse_megatron_parallel(sizes), o);
}

const LoadSpec& find(const TrainerLayout& layout, const std::string& name, int64_t stage = -1) {
  for (const LoadSpec& p : layout.params)
    if (p.name == name && (stage < 0 || (p.stage && p.stage->index == stage))) return p;
  throw std::runtime_error("no param " + name);
}

void expect_error(const std::function<void()>& f, Errc code, const std::string& words) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one with '" << words << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
  }
}

// The config with its attention heads changed.
HfModelConfig with_heads(const std::string& name, int64_t heads, int64_t groups, int64_t head_dim) {
  nlohmann::json j = model(name).raw();
  j["num_attention_heads"] = heads;
  j["num_key_value_heads"] = groups;
  j["head_dim"] = head_dim;
  return HfModelConfig::from_json(j);
}

// A run of rows of a rank's local tensor: local rows [local, local + rows)
// hold rows [hf, hf + rows) of hf_keys[key].
struct Rows {
  int64_t local, key, hf, rows;
  friend bool operator==(const Rows&, const Rows&) = default;
};

std::ostream& operator<<(std::ostream& os, const Rows& r) {
  return os << "{local " << r.local << ", key " << r.key << ", hf " << r.hf << ", rows " << r.rows
            << "}";
}

// The rows of `p` that `rank` holds, in local order (whole rows: every piece
// spans all columns).
std::vector<Rows> rank_rows(const TrainerLayout& l, const LoadSpec& p, int64_t rank) {
  std::vector<Rows> out;
  for (const Piece& x : local_pieces(p, l.mesh, rank)) {
    for (size_t d = 1; d < x.hf_box.rank(); ++d) {
      EXPECT_EQ(x.hf_box.offsets[d], 0);
      EXPECT_EQ(x.hf_box.lengths[d], p.global_shape[d]);
    }
    out.push_back({x.local_box.offsets[0], x.key, x.hf_box.offsets[0], x.hf_box.lengths[0]});
  }
  std::sort(out.begin(), out.end(), [](const Rows& a, const Rows& b) { return a.local < b.local; });
  return out;
}

// Megatron-Core's linear_qkv (a column-parallel linear over the grouped rows:
// per query group, its query heads, its key head, its value head) on a layout
// of tp ranks only: tp rank r holds grouped rows [r * R / tp, (r + 1) * R / tp)
// whatever the number of groups (attention.py, SelfAttention). Checks every
// local row of every rank against that, and that the ranks hold every row of
// q, k and v exactly once.
void expect_megatron_qkv_rows(const TrainerLayout& l, const LoadSpec& p, const HfModelConfig& c,
                              int64_t tp) {
  const int64_t hd = c.head_dim, per = c.num_heads / c.num_kv_heads, group = (per + 2) * hd;
  const int64_t rows = (c.num_heads + 2 * c.num_kv_heads) * hd;
  ASSERT_EQ(p.global_shape[0], rows);
  ASSERT_EQ(l.mesh.world(), tp);
  std::vector<std::vector<int>> seen = {std::vector<int>(c.num_heads * hd),
                                        std::vector<int>(c.num_kv_heads * hd),
                                        std::vector<int>(c.num_kv_heads * hd)};
  for (int64_t r = 0; r < tp; ++r) {
    SCOPED_TRACE(r);
    EXPECT_EQ(local_shape(p, l.mesh, r)[0], rows / tp);
    int64_t next = 0;
    for (const Rows& x : rank_rows(l, p, r)) {
      EXPECT_EQ(x.local, next);  // no gap: no padding
      next = x.local + x.rows;
      for (int64_t i = 0; i < x.rows; ++i) {
        const int64_t at = r * rows / tp + x.local + i, g = at / group, o = at % group;
        const int64_t key = o < per * hd ? 0 : o < (per + 1) * hd ? 1 : 2;
        const int64_t hf = key == 0 ? g * per * hd + o : g * hd + o - (per + key - 1) * hd;
        EXPECT_EQ(x.key, key) << "grouped row " << at;
        EXPECT_EQ(x.hf + i, hf) << "grouped row " << at;
        ++seen[static_cast<size_t>(x.key)][static_cast<size_t>(x.hf + i)];
      }
    }
    EXPECT_EQ(next, rows / tp);
  }
  for (const auto& key : seen)
    EXPECT_EQ(std::count(key.begin(), key.end(), 1), static_cast<int64_t>(key.size()));
}

TEST(MegatronLayout, DenseMeshIsPpDpTpInMegatronOrder) {
  const TrainerLayout l = megatron(model("tiny-llama"), "pp=2,tp=2,dp=3");
  EXPECT_EQ(l.mesh.axes, (std::vector<std::string>{"pp", "dp", "tp"}));
  EXPECT_EQ(l.mesh.shape, (Shape{2, 3, 2}));
  const TrainerLayout cp = megatron(model("tiny-llama"), "pp=1,tp=2,cp=2,dp=1");
  EXPECT_EQ(cp.mesh.axes, (std::vector<std::string>{"pp", "dp", "cp", "tp"}));
}

TEST(MegatronLayout, MoeMeshRefinesBothGrids) {
  // tp=2, etp=1, ep=4 over a stage of 8 ranks: cuts at 2 (tp), 4 (etp x ep).
  const TrainerLayout l = megatron(model("tiny-qwen3-moe"), "pp=1,tp=2,dp=4,ep=2,etp=1");
  EXPECT_EQ(l.mesh.axes, (std::vector<std::string>{"pp", "dp_edp", "tp_ep"}));
  const TrainerLayout m = megatron(with_layers("tiny-mixtral", 2), "pp=2,tp=2,dp=4,ep=2,etp=2");
  EXPECT_EQ(m.mesh.axes, (std::vector<std::string>{"pp", "dp_edp", "dp_ep", "tp_etp"}));
  EXPECT_EQ(m.mesh.shape, (Shape{2, 2, 2, 2}));
  // Experts shard over ep's axes then etp's; dense over tp's.
  const LoadSpec& fc1 = find(m, "decoder.layers.0.mlp.experts.linear_fc1.weight1", 0);
  ASSERT_EQ(fc1.shards.size(), 2u);
  EXPECT_EQ(fc1.shards[0].axis, "dp_ep");
  EXPECT_EQ(fc1.shards[1].axis, "tp_etp");
  EXPECT_EQ(fc1.shards[1].interleave, 2);
  // Local expert 1 of EP rank r is expert r * 3 + 1 (6 experts, ep=2).
  EXPECT_EQ(fc1.hf_keys,
            (std::vector<std::string>{"model.layers.0.block_sparse_moe.experts.1.w1.weight",
                                      "model.layers.0.block_sparse_moe.experts.1.w3.weight",
                                      "model.layers.0.block_sparse_moe.experts.4.w1.weight",
                                      "model.layers.0.block_sparse_moe.experts.4.w3.weight"}));
  // Grids whose cuts do not nest cannot be one row-major mesh.
  expect_error([] { megatron(model("tiny-mixtral"), "tp=2,dp=3,ep=3,etp=1"); },
               Errc::invalid_layout, "not multiples of one another");
}

TEST(MegatronLayout, StagesHoldTheirLayersUnderLocalNames) {
  const HfModelConfig c = with_layers("tiny-qwen3", 6);
  const TrainerLayout l = megatron(c, "pp=3,tp=1,dp=2");
  const LoadSpec& w = find(l, "decoder.layers.1.self_attention.linear_proj.weight", 2);
  EXPECT_EQ(w.hf_keys, (std::vector<std::string>{"model.layers.5.self_attn.o_proj.weight"}));
  EXPECT_EQ(find(l, "embedding.word_embeddings.weight").stage, (StageSpec{"pp", 0}));
  EXPECT_EQ(find(l, "output_layer.weight").stage, (StageSpec{"pp", 2}));
  EXPECT_EQ(find(l, "decoder.final_layernorm.weight").stage, (StageSpec{"pp", 2}));
  // Rank 4 is stage 2 (pp is the slowest axis): its names are unique.
  std::set<std::string> names;
  for (size_t p : l.rank_params(4)) EXPECT_TRUE(names.insert(l.params[p].name).second);
  EXPECT_TRUE(names.count("output_layer.weight"));
  EXPECT_FALSE(names.count("embedding.word_embeddings.weight"));
  // One stage: no stage field at all.
  for (const LoadSpec& p : megatron(c, "pp=1,tp=2").params) EXPECT_FALSE(p.stage.has_value());
}

TEST(MegatronLayout, EveryFamilyCoversItsCheckpointKeysOnce) {
  for (const char* m : {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "tiny-mixtral",
                        "tiny-deepseek-v3"}) {
    SCOPED_TRACE(m);
    const HfModelConfig c = model(m);
    const TrainerLayout l = megatron(c, c.is_moe() ? "pp=1,tp=2,ep=2,etp=1" : "pp=2,tp=2,dp=1");
    std::set<std::string> keys;
    for (const LoadSpec& p : l.params)
      for (const std::string& k : p.hf_keys) EXPECT_TRUE(keys.insert(k).second) << k;
    std::set<std::string> want;
    for (const HfTensorSpec& t : hf_tensors(c)) want.insert(t.key);
    EXPECT_EQ(keys, want);
  }
}

TEST(MegatronLayout, TiedEmbeddingsMirrorTheEmbeddingOnTheLastStage) {
  const HfModelConfig c = model("tiny-qwen2");
  ASSERT_TRUE(c.tie_word_embeddings);
  const TrainerLayout two = megatron(c, "pp=2,tp=2");
  const LoadSpec& copy = find(two, "output_layer.weight", 1);
  ASSERT_TRUE(copy.segments.has_value());
  EXPECT_TRUE(copy.segments->empty());
  EXPECT_EQ(copy.mirror_of, std::optional<std::string>("model.embed_tokens.weight"));
  EXPECT_EQ(copy.global_shape, (Shape{256, c.hidden_size}));
  // The JSON form keeps it.
  const TrainerLayout back = TrainerLayout::from_json(two.to_json());
  EXPECT_EQ(find(back, "output_layer.weight", 1).mirror_of, copy.mirror_of);
  // One stage: Megatron allocates no output weight at all.
  for (const LoadSpec& p : megatron(c, "pp=1,tp=2").params)
    EXPECT_NE(p.name, "output_layer.weight");
}

TEST(MegatronLayout, VocabPaddingAndGroupedQkv) {
  const HfModelConfig c = model("tiny-llama");  // 8 heads, 2 groups, head dim 8, vocab 100
  const TrainerLayout l = megatron(c, "tp=2");
  const LoadSpec& emb = find(l, "embedding.word_embeddings.weight");
  EXPECT_EQ(emb.global_shape, (Shape{256, 64}));
  EXPECT_EQ(emb.origin_shape, (Shape{100, 64}));
  MegatronOptions none;
  none.vocab_divisible_by = 0;
  EXPECT_EQ(find(megatron(c, "tp=2", none), "output_layer.weight").global_shape, (Shape{100, 64}));
  expect_error([&] { megatron(c, "tp=3", none); }, Errc::invalid_layout, "without padding");
  const LoadSpec& qkv = find(l, "decoder.layers.0.self_attention.linear_qkv.weight");
  EXPECT_EQ(qkv.global_shape, (Shape{(8 + 4) * 8, 64}));
  ASSERT_EQ(qkv.segments->size(), 6u);
  // Group 1: q rows 32..64 of q_proj at 48, then k and v head 1.
  EXPECT_EQ((*qkv.segments)[3].param_box, (Box{{48, 0}, {32, 64}}));
  EXPECT_EQ((*qkv.segments)[3].hf_box, (Box{{32, 0}, {32, 64}}));
  EXPECT_EQ((*qkv.segments)[4].param_box.offsets[0], 80);
  EXPECT_EQ((*qkv.segments)[5].param_box.offsets[0], 88);
}

TEST(MegatronLayout, MoreTpRanksThanQueryGroupsSplitEachGroup) {
  // Qwen3-30B-A3B at tp=8: 32 query heads in 4 groups, head dim 128. A
  // group's 1280 rows [q x8, k, v] are two ranks' 640: rank 2g holds query
  // heads 8g..8g+4, rank 2g+1 query heads 8g+5..8g+7, then k and v head g.
  const HfModelConfig big = model("Qwen3-30B-A3B");
  ASSERT_EQ(big.num_heads, 32);
  ASSERT_EQ(big.num_kv_heads, 4);
  const TrainerLayout l = megatron(big, "tp=8,ep=8,etp=1");
  const LoadSpec& qkv = find(l, "decoder.layers.0.self_attention.linear_qkv.weight");
  for (int64_t g = 0; g < 4; ++g) {
    EXPECT_EQ(rank_rows(l, qkv, 2 * g), (std::vector<Rows>{{0, 0, 1024 * g, 640}}));
    EXPECT_EQ(rank_rows(l, qkv, 2 * g + 1),
              (std::vector<Rows>{
                  {0, 0, 1024 * g + 640, 384}, {384, 1, 128 * g, 128}, {512, 2, 128 * g, 128}}));
  }
  expect_megatron_qkv_rows(l, qkv, big, 8);
  // The q/k norms (head dim wide) are whole on every rank; o_proj is split
  // by columns as with fewer ranks.
  EXPECT_TRUE(find(l, "decoder.layers.0.self_attention.q_layernorm.weight").shards.empty());
  EXPECT_TRUE(find(l, "decoder.layers.0.self_attention.k_layernorm.weight").shards.empty());
  EXPECT_EQ(local_shape(find(l, "decoder.layers.0.self_attention.linear_proj.weight"), l.mesh, 3),
            (Shape{big.hidden_size, 32 * 128 / 8}));

  // 2 groups at tp=4 (tiny-llama: 8 heads, head dim 8): a group [q x4, k, v]
  // is 48 rows, two ranks' 24.
  const HfModelConfig llama = model("tiny-llama");
  const TrainerLayout l4 = megatron(llama, "tp=4");
  const LoadSpec& w = find(l4, "decoder.layers.1.self_attention.linear_qkv.weight");
  EXPECT_EQ(rank_rows(l4, w, 0), (std::vector<Rows>{{0, 0, 0, 24}}));
  EXPECT_EQ(rank_rows(l4, w, 1), (std::vector<Rows>{{0, 0, 24, 8}, {8, 1, 0, 8}, {16, 2, 0, 8}}));
  EXPECT_EQ(rank_rows(l4, w, 2), (std::vector<Rows>{{0, 0, 32, 24}}));
  EXPECT_EQ(rank_rows(l4, w, 3), (std::vector<Rows>{{0, 0, 56, 8}, {8, 1, 8, 8}, {16, 2, 8, 8}}));
  expect_megatron_qkv_rows(l4, w, llama, 4);
  // One group over tp=8: 80 grouped rows, 10 a rank, so the blocks cut
  // heads: rank 6 holds the last 4 rows of query head 7 and the first 6 of k,
  // rank 7 the last 2 of k and all of v.
  const TrainerLayout l8 = megatron(with_heads("tiny-llama", 8, 1, 8), "tp=8");
  const LoadSpec& one = find(l8, "decoder.layers.0.self_attention.linear_qkv.weight");
  EXPECT_EQ(rank_rows(l8, one, 6), (std::vector<Rows>{{0, 0, 60, 4}, {4, 1, 0, 6}}));
  EXPECT_EQ(rank_rows(l8, one, 7), (std::vector<Rows>{{0, 1, 6, 2}, {2, 2, 0, 8}}));
  expect_megatron_qkv_rows(l8, one, with_heads("tiny-llama", 8, 1, 8), 8);

  // The QKV bias (qwen2: 4 heads in 2 groups, head dim 16) splits as its
  // weight: rank 2g holds query heads 2g, 2g+1, rank 2g+1 k and v head g.
  const HfModelConfig qwen2 = model("tiny-qwen2");
  const TrainerLayout b4 = megatron(qwen2, "tp=4");
  const LoadSpec& bias = find(b4, "decoder.layers.0.self_attention.linear_qkv.bias");
  EXPECT_EQ(bias.global_shape, (Shape{128}));
  EXPECT_EQ(rank_rows(b4, bias, 2), (std::vector<Rows>{{0, 0, 32, 32}}));
  EXPECT_EQ(rank_rows(b4, bias, 3), (std::vector<Rows>{{0, 1, 16, 16}, {16, 2, 16, 16}}));
  expect_megatron_qkv_rows(b4, bias, qwen2, 4);
  expect_megatron_qkv_rows(b4, find(b4, "decoder.layers.0.self_attention.linear_qkv.weight"), qwen2,
                           4);
  // And with fewer ranks than groups, whole groups as before.
  const TrainerLayout q2 = megatron(model("tiny-qwen3"), "tp=2");
  expect_megatron_qkv_rows(q2, find(q2, "decoder.layers.0.self_attention.linear_qkv.weight"),
                           model("tiny-qwen3"), 2);

  // Grouped rows that tp does not divide: Megatron-Core's column-parallel
  // linear refuses them (4 heads of dim 3 in 1 group: 18 rows over tp=4).
  expect_error([] { megatron(with_heads("tiny-llama", 4, 1, 3), "tp=4"); }, Errc::invalid_layout,
               "'decoder.layers.0.self_attention.linear_qkv.weight' has 18 rows/columns to split "
               "over tp=4");
}

TEST(MegatronLayout, StageLayersFollowMegatronsRules) {
  EXPECT_EQ(megatron_stage_layers(8, 4, {}), (std::vector<int64_t>{2, 2, 2, 2}));
  MegatronOptions o;
  o.first_stage_layers = 3;
  o.last_stage_layers = 2;
  // DeepSeek-V3 in NeMo-RL's recipe: 61 layers over 16 stages.
  std::vector<int64_t> want(16, 4);
  want.front() = 3;
  want.back() = 2;
  EXPECT_EQ(megatron_stage_layers(61, 16, o), want);
  expect_error([] { megatron_stage_layers(61, 16, {}); }, Errc::invalid_layout,
               "do not split evenly");
  o.last_stage_layers.reset();
  expect_error([&] { megatron_stage_layers(61, 16, o); }, Errc::invalid_layout,
               "layers left for 15 middle stages");
  MegatronOptions both;
  both.first_stage_layers = 1;
  both.last_stage_layers = 1;
  expect_error([&] { megatron_stage_layers(3, 2, both); }, Errc::invalid_layout,
               "1 of the 3 layers are on no stage");
  // Megatron-Core lets a middle stage hold no layer (0 splits evenly).
  MegatronOptions ends;
  ends.first_stage_layers = 2;
  ends.last_stage_layers = 2;
  EXPECT_EQ(megatron_stage_layers(4, 4, ends), (std::vector<int64_t>{2, 0, 0, 2}));
  expect_error([&] { megatron_stage_layers(3, 3, ends); }, Errc::invalid_layout,
               "take more than the 3 layers");
  expect_error([] { megatron(model("tiny-llama"), "pp=3"); }, Errc::invalid_layout,
               "2 layers do not split evenly over pp=3");
}

TEST(MegatronLayout, RefusesWhatMegatronRefuses) {
  const HfModelConfig llama = model("tiny-llama");  // 8 heads, 2 kv groups
  // 12 heads in 6 groups over tp=4: neither 6 nor 4 divides the other.
  expect_error([] { megatron(with_heads("tiny-llama", 12, 6, 8), "tp=4"); }, Errc::invalid_layout,
               "12 query heads in 6 groups do not split over tp=4");
  expect_error([&] { megatron(llama, "tp=16"); }, Errc::invalid_layout,
               "8 query heads in 2 groups do not split over tp=16");
  expect_error([&] { megatron(llama, "tp=1,ep=2"); }, Errc::invalid_layout, "needs experts");
  const HfModelConfig moe = model("tiny-qwen3-moe");  // 6 experts, I=32
  expect_error([&] { megatron(moe, "dp=4,ep=4"); }, Errc::invalid_layout, "6 experts");
  expect_error([&] { megatron(moe, "dp=2,ep=2,etp=2"); }, Errc::invalid_layout,
               "does not divide the 2 ranks");
  expect_error([&] { megatron(model("tiny-qwen2-moe"), "tp=1"); }, Errc::unsupported,
               "qwen2_moe family is not covered");
  expect_error([] { parse_megatron_parallel("pp=2,fsdp=2"); }, Errc::invalid_argument,
               "unknown name 'fsdp'");
}

TEST(MegatronLayout, DeepSeekV3NamesMlaExpertsAndSharedExperts) {
  const TrainerLayout l = megatron(model("tiny-deepseek-v3"), "pp=1,tp=2,ep=2,etp=1");
  for (const char* name :
       {"decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_q_down_proj.weight",
        "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
        "decoder.layers.0.self_attention.linear_q_up_proj.weight",
        "decoder.layers.0.self_attention.linear_kv_down_proj.weight",
        "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight",
        "decoder.layers.0.self_attention.linear_kv_up_proj.weight",
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
        "decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.1.mlp.router.weight",
        "decoder.layers.1.mlp.router.expert_bias",
        "decoder.layers.1.mlp.experts.linear_fc1.weight2",
        "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
        "decoder.layers.1.mlp.shared_experts.linear_fc2.weight"})
    EXPECT_NO_THROW(find(l, name)) << name;
  EXPECT_TRUE(find(l, "decoder.layers.0.self_attention.linear_kv_down_proj.weight").shards.empty());
  EXPECT_EQ(find(l, "decoder.layers.0.self_attention.linear_kv_up_proj.weight").shards[0].dim, 0);
}

}  // namespace
}  // namespace weightsync
