// The segment form and pipeline stages of LoadSpec (load_spec.h): random
// segment layouts against an element-by-element reference that reads the
// segments literally, the compact form restated as segments, the JSON, and
// every validation rule.
#include <weightsync/error.h>
#include <weightsync/load_spec.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>

namespace weightsync {
namespace {

using Indices = std::vector<std::vector<int64_t>>;  // per dim: local index -> global index

// Plain shards only (interleave is covered by load_spec_property_test): per
// dim, the global index of every local index, as DESIGN.md says.
Indices reference_indices(const LoadSpec& spec, const Mesh& mesh, int64_t rank) {
  const auto coords = mesh.coords(rank);
  Indices idx(spec.global_shape.size());
  for (size_t d = 0; d < idx.size(); ++d) {
    idx[d].resize(static_cast<size_t>(spec.global_shape[d]));
    std::iota(idx[d].begin(), idx[d].end(), 0);
  }
  for (const ShardSpec& s : spec.shards) {
    const int a = mesh.axis_index(s.axis);
    const int64_t w = mesh.shape[a], r = coords[a];
    const auto& cur = idx[s.dim];
    const auto n = static_cast<int64_t>(cur.size());
    const int64_t chunk = (n + w - 1) / w;
    std::vector<int64_t> next(cur.begin() + std::min(n, r * chunk),
                              cur.begin() + std::min(n, (r + 1) * chunk));
    idx[s.dim] = std::move(next);
  }
  return idx;
}

template <class F>
void for_each_element(const Shape& offsets, const Shape& lengths, F&& f) {
  if (numel(lengths) == 0) return;
  Shape at = offsets;
  while (true) {
    f(at);
    size_t d = lengths.size();
    while (d-- > 0) {
      if (++at[d] < offsets[d] + lengths[d]) break;
      at[d] = offsets[d];
    }
    if (d == static_cast<size_t>(-1)) return;
  }
}

int64_t flat(const Shape& at, const Shape& shape) {
  int64_t f = 0;
  for (size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + at[d];
  return f;
}

// Where each global element comes from, read from the segments one element
// at a time: (key, flat index in the key), or key -1 for padding.
std::vector<std::pair<int, int64_t>> element_owners(const LoadSpec& spec) {
  std::vector<std::pair<int, int64_t>> owner(numel(spec.global_shape), {-1, 0});
  const std::vector<Shape> shapes = spec.key_shapes();
  for (const LoadSegment& s : *spec.segments) {
    const size_t lead = s.param_box.rank() - s.hf_box.rank();
    for_each_element(s.param_box.offsets, s.param_box.lengths, [&](const Shape& at) {
      Shape hf(s.hf_box.rank());
      for (size_t d = 0; d < hf.size(); ++d)
        hf[d] = s.hf_box.offsets[d] + at[lead + d] - s.param_box.offsets[lead + d];
      owner[flat(at, spec.global_shape)] = {s.key, flat(hf, shapes[s.key])};
    });
  }
  return owner;
}

// Checks every rank's pieces element by element; each key element must be
// held once per replica group (ranks with equal coordinates on the axes the
// spec does not shard).
void check_all_ranks(const LoadSpec& spec, const Mesh& mesh) {
  const auto owner = element_owners(spec);
  const std::vector<Shape> shapes = spec.key_shapes();
  std::map<std::vector<int64_t>, std::vector<std::vector<int>>> groups;
  for (int64_t r = 0; r < mesh.world(); ++r) {
    const Indices ref = reference_indices(spec, mesh, r);
    Shape local(ref.size());
    for (size_t d = 0; d < ref.size(); ++d) local[d] = static_cast<int64_t>(ref[d].size());
    ASSERT_EQ(local_shape(spec, mesh, r), local);
    std::vector<int64_t> group;
    const auto coords = mesh.coords(r);
    for (size_t a = 0; a < mesh.axes.size(); ++a)
      if (std::none_of(spec.shards.begin(), spec.shards.end(),
                       [&](const ShardSpec& s) { return s.axis == mesh.axes[a]; }))
        group.push_back(coords[a]);
    auto& counts = groups[group];
    if (counts.empty())
      for (const Shape& s : shapes) counts.emplace_back(numel(s), 0);
    std::vector<int> covered(numel(local), 0);
    for (const Piece& p : local_pieces(spec, mesh, r)) {
      ASSERT_TRUE(p.local_box.fits(local)) << box_str(p.local_box);
      ASSERT_TRUE(p.hf_box.fits(shapes[p.key])) << box_str(p.hf_box);
      const size_t lead = p.local_box.rank() - p.hf_box.rank();
      for_each_element(p.local_box.offsets, p.local_box.lengths, [&](const Shape& at) {
        Shape global(at.size()), hf(p.hf_box.rank());
        for (size_t d = 0; d < at.size(); ++d) global[d] = ref[d][at[d]];
        for (size_t d = 0; d < hf.size(); ++d)
          hf[d] = p.hf_box.offsets[d] + at[lead + d] - p.local_box.offsets[lead + d];
        const auto [key, index] = owner[flat(global, spec.global_shape)];
        ASSERT_EQ(key, p.key) << "rank " << r << " local " << box_str(p.local_box);
        ASSERT_EQ(index, flat(hf, shapes[key])) << "rank " << r;
        ++covered[flat(at, local)];
        ++counts[key][index];
      });
    }
    for_each_element(Shape(local.size(), 0), local, [&](const Shape& at) {
      Shape global(at.size());
      for (size_t d = 0; d < at.size(); ++d) global[d] = ref[d][at[d]];
      const bool padding = owner[flat(global, spec.global_shape)].first < 0;
      ASSERT_EQ(covered[flat(at, local)], padding ? 0 : 1) << "rank " << r;
    });
  }
  for (const auto& [group, counts] : groups)
    for (size_t k = 0; k < counts.size(); ++k)
      for (size_t i = 0; i < counts[k].size(); ++i) ASSERT_EQ(counts[k][i], 1) << "key " << k;
}

// A random segment-form param: dim 0 of origin cut into blocks, each block
// taken by a random key at a random place in it (keys are their blocks in
// another order); some blocks left as padding; random plain shards.
struct Case {
  Mesh mesh;
  LoadSpec spec;
};

Case random_case(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Case c;
  const int64_t naxes = pick(1, 3);
  for (int64_t i = 0; i < naxes; ++i) {
    c.mesh.axes.push_back(std::string(1, static_cast<char>('a' + i)));
    c.mesh.shape.push_back(pick(1, 4));
  }
  LoadSpec& s = c.spec;
  s.name = "p";
  const int64_t ndim = pick(1, 3);
  for (int64_t d = 0; d < ndim; ++d) {
    s.origin_shape.push_back(pick(1, d == 0 ? 24 : 5));
    s.global_shape.push_back(s.origin_shape.back() + (pick(0, 3) == 0 ? pick(1, 3) : 0));
  }
  // Blocks of dim 0; the first nkeys go to distinct keys so each has one.
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (start, length)
  for (int64_t at = 0; at < s.origin_shape[0];) {
    const int64_t len = std::min(s.origin_shape[0] - at, pick(1, 6));
    blocks.push_back({at, len});
    at += len;
  }
  std::shuffle(blocks.begin(), blocks.end(), rng);
  const int nkeys = static_cast<int>(pick(1, std::min<int64_t>(3, blocks.size())));
  for (int k = 0; k < nkeys; ++k) s.hf_keys.push_back("k" + std::to_string(k));
  std::vector<int64_t> key_rows(nkeys, 0);
  s.segments.emplace();
  for (size_t b = 0; b < blocks.size(); ++b) {
    const bool padding = b >= static_cast<size_t>(nkeys) && pick(0, 5) == 0;
    if (padding) continue;
    const int key =
        b < static_cast<size_t>(nkeys) ? static_cast<int>(b) : static_cast<int>(pick(0, nkeys - 1));
    Box param = Box::full(s.origin_shape), hf = param;
    param.offsets[0] = blocks[b].first;
    param.lengths[0] = hf.lengths[0] = blocks[b].second;
    hf.offsets[0] = key_rows[key];
    key_rows[key] += blocks[b].second;
    s.segments->push_back({key, hf, param});
  }
  std::vector<std::string> axes = c.mesh.axes;
  std::shuffle(axes.begin(), axes.end(), rng);
  for (int64_t i = 0, n = pick(0, naxes); i < n; ++i)
    s.shards.push_back({static_cast<int>(pick(0, ndim - 1)), axes[i], 1});
  return c;
}

TEST(LoadSpecSegments, RandomSegmentLayoutsMatchTheElementReference) {
  std::mt19937_64 rng(20261123);
  int padded = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const Case c = random_case(rng);
    const TrainerLayout layout{c.mesh, {c.spec}};
    SCOPED_TRACE(layout.to_json().dump());
    layout.validate();
    // The JSON round trip keeps the meaning.
    const TrainerLayout back = TrainerLayout::from_json(layout.to_json());
    ASSERT_EQ(back.to_json(), layout.to_json());
    padded += c.spec.has_padding();
    check_all_ranks(back.params[0], back.mesh);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(padded, 50);  // padding (tail and uncovered blocks) occurs often
}

// The compact form restated as segments gives the same pieces: fused keys
// (one segment per key on the fused dim) with tail padding.
TEST(LoadSpecSegments, CompactFormRestatedAsSegmentsHasTheSamePieces) {
  Mesh mesh{{"ep", "fsdp"}, {2, 3}};
  LoadSpec compact;
  compact.name = "experts";
  compact.hf_keys = {"e0.gate", "e0.up", "e1.gate", "e1.up"};
  compact.fused_dim = 0;
  compact.global_shape = {20, 3};
  compact.origin_shape = {16, 3};
  compact.shards = {{0, "ep", 1}, {0, "fsdp", 1}};
  LoadSpec seg = compact;
  seg.fused_dim.reset();
  seg.segments.emplace();
  for (int k = 0; k < 4; ++k)
    seg.segments->push_back({k, Box{{0, 0}, {4, 3}}, Box{{4 * k, 0}, {4, 3}}});
  TrainerLayout{mesh, {seg}}.validate();
  EXPECT_EQ(seg.key_shapes(), compact.key_shapes());
  EXPECT_EQ(seg.hf_key_shape(), (Shape{4, 3}));
  for (int64_t r = 0; r < mesh.world(); ++r) {
    EXPECT_EQ(local_shape(seg, mesh, r), local_shape(compact, mesh, r));
    auto a = local_pieces(seg, mesh, r), b = local_pieces(compact, mesh, r);
    auto less = [](const Piece& x, const Piece& y) {
      return x.local_box.offsets < y.local_box.offsets;
    };
    std::sort(a.begin(), a.end(), less);
    std::sort(b.begin(), b.end(), less);
    EXPECT_EQ(a, b) << "rank " << r;
  }
}

// Grouped QKV as Megatron holds it: nh=4 query heads, nkv=2 groups, head
// dim 2, hidden 3; per group [q_g (2 heads); k_g; v_g]; tp=2 splits groups.
LoadSpec grouped_qkv() {
  LoadSpec s;
  s.name = "linear_qkv.weight";
  s.hf_keys = {"q", "k", "v"};
  s.global_shape = s.origin_shape = {16, 3};
  s.shards = {{0, "tp", 1}};
  s.segments.emplace();
  for (int64_t g = 0; g < 2; ++g) {
    s.segments->push_back({0, Box{{4 * g, 0}, {4, 3}}, Box{{8 * g, 0}, {4, 3}}});
    s.segments->push_back({1, Box{{2 * g, 0}, {2, 3}}, Box{{8 * g + 4, 0}, {2, 3}}});
    s.segments->push_back({2, Box{{2 * g, 0}, {2, 3}}, Box{{8 * g + 6, 0}, {2, 3}}});
  }
  return s;
}

TEST(LoadSpecSegments, GroupedQkvPiecesPerTensorParallelRank) {
  const Mesh mesh{{"tp"}, {2}};
  const LoadSpec s = grouped_qkv();
  TrainerLayout{mesh, {s}}.validate();
  EXPECT_EQ(s.key_shapes(), (std::vector<Shape>{{8, 3}, {4, 3}, {4, 3}}));
  EXPECT_THROW(s.hf_key_shape(), Error);
  EXPECT_FALSE(s.has_padding());
  // Rank 1 holds group 1: q rows 4..8, k rows 2..4, v rows 2..4.
  const std::vector<Piece> want = {{0, Box{{4, 0}, {4, 3}}, Box{{0, 0}, {4, 3}}},
                                   {1, Box{{2, 0}, {2, 3}}, Box{{4, 0}, {2, 3}}},
                                   {2, Box{{2, 0}, {2, 3}}, Box{{6, 0}, {2, 3}}}};
  EXPECT_EQ(local_pieces(s, mesh, 1), want);
  check_all_ranks(s, mesh);
}

TEST(LoadSpecSegments, LeadingParamDimsOfLengthOne) {
  // Two experts stacked on dim 0 by segments instead of stack_dim.
  LoadSpec s;
  s.name = "stacked";
  s.hf_keys = {"e0", "e1"};
  s.global_shape = s.origin_shape = {2, 4, 3};
  s.shards = {{0, "ep", 1}};
  s.segments = std::vector<LoadSegment>{{0, Box{{0, 0}, {4, 3}}, Box{{0, 0, 0}, {1, 4, 3}}},
                                        {1, Box{{0, 0}, {4, 3}}, Box{{1, 0, 0}, {1, 4, 3}}}};
  const Mesh mesh{{"ep"}, {2}};
  TrainerLayout{mesh, {s}}.validate();
  EXPECT_EQ(s.key_shapes(), (std::vector<Shape>{{4, 3}, {4, 3}}));
  const std::vector<Piece> want = {{1, Box{{0, 0}, {4, 3}}, Box{{0, 0, 0}, {1, 4, 3}}}};
  EXPECT_EQ(local_pieces(s, mesh, 1), want);
  check_all_ranks(s, mesh);
}

TEST(LoadSpecSegments, JsonNamesKeysAndMayLeaveHfKeysOut) {
  const auto j = nlohmann::json::parse(R"({
    "mesh": {"axes": ["pp", "tp"], "shape": [2, 2]},
    "params": [
      {"name": "qkv", "global_shape": [16, 3], "dtype": "F32", "shards": [{"dim": 0, "axis": "tp"}],
       "stage": {"axis": "pp", "index": 1},
       "segments": [
         {"hf_key": "k", "hf_box": {"offsets": [0, 0], "lengths": [4, 3]},
          "param_box": {"offsets": [0, 0], "lengths": [4, 3]}},
         {"hf_key": "q", "hf_box": {"offsets": [0, 0], "lengths": [12, 3]},
          "param_box": {"offsets": [4, 0], "lengths": [12, 3]}}]},
      {"name": "copy", "hf_keys": [], "global_shape": [4], "dtype": "F32", "segments": []}
    ]})");
  const TrainerLayout layout = TrainerLayout::from_json(j);
  EXPECT_EQ(layout.params[0].hf_keys, (std::vector<std::string>{"k", "q"}));
  EXPECT_EQ(layout.params[0].stage, (StageSpec{"pp", 1}));
  EXPECT_TRUE(layout.params[1].has_padding());
  EXPECT_TRUE(local_pieces(layout.params[1], layout.mesh, 0).empty());
  EXPECT_EQ(local_shape(layout.params[1], layout.mesh, 0), (Shape{4}));
  const auto out = layout.to_json();
  EXPECT_EQ(out["params"][0]["segments"][1]["hf_key"], "q");
  EXPECT_EQ(out["params"][0]["stage"]["index"], 1);
  EXPECT_FALSE(out["params"][1].contains("stage"));
  EXPECT_EQ(TrainerLayout::from_json(out).to_json(), out);
  // Layouts without the new fields print without them (their meaning kept).
  const auto plain = TrainerLayout::from_json(nlohmann::json::parse(R"({
    "mesh": {"axes": ["fsdp"], "shape": [2]},
    "params": [{"name": "w", "hf_keys": ["w"], "fused_dim": null, "global_shape": [4, 2],
                "dtype": "BF16", "shards": [{"dim": 0, "axis": "fsdp"}]}]})"));
  EXPECT_FALSE(plain.to_json()["params"][0].contains("segments"));
  EXPECT_FALSE(plain.params[0].segments.has_value());
}

TEST(LoadSpecStages, ARankHoldsOnlyItsStagesParams) {
  const Mesh mesh{{"pp", "tp"}, {3, 2}};
  TrainerLayout layout{mesh, {}};
  for (int64_t stage = 0; stage < 3; ++stage) {
    LoadSpec s;
    s.name = "decoder.layers.0.w";  // the same local name on every stage
    s.hf_keys = {"model.layers." + std::to_string(stage) + ".w"};
    s.global_shape = s.origin_shape = {4, 2};
    s.shards = {{0, "tp", 1}};
    s.stage = StageSpec{"pp", stage};
    layout.params.push_back(s);
  }
  LoadSpec norm;
  norm.name = "norm";
  norm.hf_keys = {"norm"};
  norm.global_shape = norm.origin_shape = {2};
  layout.params.push_back(norm);
  layout.validate();
  for (int64_t r = 0; r < mesh.world(); ++r) {
    const int64_t stage = r / 2;
    EXPECT_EQ(layout.rank_params(r), (std::vector<size_t>{static_cast<size_t>(stage), 3}));
    for (int64_t p = 0; p < 3; ++p) {
      EXPECT_EQ(holds(layout.params[p], mesh, r), p == stage);
      EXPECT_EQ(local_pieces(layout.params[p], mesh, r).empty(), p != stage);
    }
  }
  try {
    local_shape(layout.params[0], mesh, 5);
    FAIL() << "a rank of stage 2 has no shape for a param of stage 0";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("stage 0 of axis 'pp'; rank 5 is on stage 2"),
              std::string::npos)
        << e.what();
  }
}

// Every rule, each with the words its message must hold.
struct Bad {
  const char* what;
  const char* param;  // one param's JSON
  const char* message;
};

TEST(LoadSpecSegments, ValidationNamesTheRuleBroken) {
  const std::vector<Bad> cases = {
      {"param boxes overlap",
       R"({"name": "p", "global_shape": [4, 2], "dtype": "F32", "segments": [
           {"hf_key": "a", "hf_box": {"offsets": [0, 0], "lengths": [3, 2]},
            "param_box": {"offsets": [0, 0], "lengths": [3, 2]}},
           {"hf_key": "b", "hf_box": {"offsets": [0, 0], "lengths": [2, 2]},
            "param_box": {"offsets": [2, 0], "lengths": [2, 2]}}]})",
       "overlap in the param"},
      {"a key not held whole",
       R"({"name": "p", "global_shape": [4, 2], "dtype": "F32", "segments": [
           {"hf_key": "a", "hf_box": {"offsets": [1, 0], "lengths": [3, 2]},
            "param_box": {"offsets": [0, 0], "lengths": [3, 2]}}]})",
       "holds each of its keys whole"},
      {"a key's boxes overlap",
       R"({"name": "p", "global_shape": [4, 2], "dtype": "F32", "segments": [
           {"hf_key": "a", "hf_box": {"offsets": [0, 0], "lengths": [2, 2]},
            "param_box": {"offsets": [0, 0], "lengths": [2, 2]}},
           {"hf_key": "a", "hf_box": {"offsets": [1, 0], "lengths": [2, 2]},
            "param_box": {"offsets": [2, 0], "lengths": [2, 2]}}]})",
       "overlapping boxes"},
      {"outside origin",
       R"({"name": "p", "global_shape": [4, 2], "origin_shape": [3, 2], "dtype": "F32",
           "segments": [{"hf_key": "a", "hf_box": {"offsets": [0, 0], "lengths": [4, 2]},
            "param_box": {"offsets": [0, 0], "lengths": [4, 2]}}]})",
       "outside origin_shape"},
      {"lengths differ",
       R"({"name": "p", "global_shape": [4, 2], "dtype": "F32", "segments": [
           {"hf_key": "a", "hf_box": {"offsets": [0, 0], "lengths": [2, 4]},
            "param_box": {"offsets": [0, 0], "lengths": [4, 2]}}]})",
       "does not map onto"},
      {"fused_dim with segments",
       R"({"name": "p", "global_shape": [2], "fused_dim": 0, "dtype": "F32", "segments": [
           {"hf_key": "a", "hf_box": {"offsets": [0], "lengths": [2]},
            "param_box": {"offsets": [0], "lengths": [2]}}]})",
       "segments replace fused_dim"},
      {"segment key not listed",
       R"({"name": "p", "hf_keys": ["a"], "global_shape": [2], "dtype": "F32", "segments": [
           {"hf_key": "b", "hf_box": {"offsets": [0], "lengths": [2]},
            "param_box": {"offsets": [0], "lengths": [2]}}]})",
       "is not in the param's hf_keys"},
      {"listed key in no segment",
       R"({"name": "p", "hf_keys": ["a", "b"], "global_shape": [2], "dtype": "F32",
           "segments": [{"hf_key": "a", "hf_box": {"offsets": [0], "lengths": [2]},
            "param_box": {"offsets": [0], "lengths": [2]}}]})",
       "is in no segment"},
      {"unknown stage axis",
       R"({"name": "p", "hf_keys": ["a"], "global_shape": [2], "dtype": "F32",
           "stage": {"axis": "vpp", "index": 0}})",
       "stage.axis: 'vpp' is not a mesh axis"},
      {"stage index out of range",
       R"({"name": "p", "hf_keys": ["a"], "global_shape": [2], "dtype": "F32",
           "stage": {"axis": "pp", "index": 2}})",
       "stage.index 2 out of range"},
      {"sharded over its stage axis",
       R"({"name": "p", "hf_keys": ["a"], "global_shape": [2], "dtype": "F32",
           "stage": {"axis": "pp", "index": 0}, "shards": [{"dim": 0, "axis": "pp"}]})",
       "shards over its stage axis"},
      {"a mirror of a key no param holds",
       R"({"name": "p", "global_shape": [2], "dtype": "F32", "segments": [],
           "mirror_of": "nobody"})",
       "names an HF key that no param of the layout holds"},
      {"a mirror with content of its own",
       R"({"name": "p", "hf_keys": ["a"], "global_shape": [2], "dtype": "F32",
           "mirror_of": "a"})",
       "a mirror holds no HF content of its own"},
  };
  for (const Bad& c : cases) {
    const std::string text =
        std::string(R"({"mesh": {"axes": ["pp", "tp"], "shape": [2, 2]}, "params": [)") + c.param +
        "]}";
    try {
      TrainerLayout::from_json(nlohmann::json::parse(text));
      ADD_FAILURE() << c.what << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_layout) << c.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(c.message), std::string::npos)
          << c.what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("param 'p'"), std::string::npos) << e.what();
    }
  }
}

TEST(LoadSpecStages, NamesRepeatOnlyOnDifferentStagesOfOneAxis) {
  auto layout_of = [](const char* a, const char* b) {
    return std::string(R"({"mesh": {"axes": ["pp", "vp"], "shape": [2, 2]}, "params": [)") + a +
           "," + b + "]}";
  };
  const char* s0 = R"({"name": "w", "hf_keys": ["a"], "global_shape": [2], "dtype": "F32",
                      "stage": {"axis": "pp", "index": 0}})";
  const char* s1 = R"({"name": "w", "hf_keys": ["b"], "global_shape": [2], "dtype": "F32",
                      "stage": {"axis": "pp", "index": 1}})";
  const char* s1b = R"({"name": "w", "hf_keys": ["c"], "global_shape": [2], "dtype": "F32",
                       "stage": {"axis": "pp", "index": 1}})";
  const char* plain = R"({"name": "w", "hf_keys": ["d"], "global_shape": [2], "dtype": "F32"})";
  const char* other_axis = R"({"name": "w", "hf_keys": ["e"], "global_shape": [2],
                              "dtype": "F32", "stage": {"axis": "vp", "index": 1}})";
  EXPECT_NO_THROW(TrainerLayout::from_json(nlohmann::json::parse(layout_of(s0, s1))));
  for (const auto& [b, why] : std::vector<std::pair<const char*, const char*>>{
           {s0, "on stage 0"},
           {plain, "different stages of one axis"},
           {other_axis, "different stages of one axis"}}) {
    try {
      TrainerLayout::from_json(nlohmann::json::parse(layout_of(s0, b)));
      ADD_FAILURE() << "accepted: " << b;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
  const std::string three = std::string(R"({"mesh": {"axes": ["pp"], "shape": [2]}, "params": [)") +
                            s0 + "," + s1 + "," + s1b + "]}";
  EXPECT_THROW(TrainerLayout::from_json(nlohmann::json::parse(three)), Error);
}

}  // namespace
}  // namespace weightsync
