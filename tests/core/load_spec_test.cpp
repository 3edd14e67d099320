// LoadSpec geometry: one test per rule of DESIGN.md's "LoadSpec" section.
#include <weightsync/error.h>
#include <weightsync/load_spec.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace weightsync {
namespace {

LoadSpec spec_of(Shape global, std::vector<ShardSpec> shards, Shape origin = {}) {
  LoadSpec s;
  s.name = "w";
  s.hf_keys = {"model.w"};
  s.global_shape = global;
  s.origin_shape = origin.empty() ? global : origin;
  s.shards = std::move(shards);
  return s;
}

Mesh mesh_of(std::vector<std::string> axes, Shape shape) {
  return Mesh{std::move(axes), std::move(shape)};
}

TEST(Mesh, RowMajorCoordinates) {
  const Mesh m = mesh_of({"ep", "fsdp"}, {2, 3});
  EXPECT_EQ(m.world(), 6);
  EXPECT_EQ(m.coords(0), (Shape{0, 0}));
  EXPECT_EQ(m.coords(4), (Shape{1, 1}));
  EXPECT_EQ(m.coords(5), (Shape{1, 2}));
  for (int64_t r = 0; r < 6; ++r) EXPECT_EQ(m.rank_of(m.coords(r)), r);
  EXPECT_EQ(m.axis_index("fsdp"), 1);
  EXPECT_EQ(m.axis_index("tp"), -1);
  EXPECT_THROW(m.coords(6), Error);
}

TEST(LoadSpec, UnevenChunksLeaveTrailingRanksEmpty) {
  // DESIGN.md: n=128 over w=48: ranks 0-41 hold 3, rank 42 holds 2, 43-47 hold 0.
  const Mesh m = mesh_of({"fsdp"}, {48});
  const LoadSpec s = spec_of({128, 5}, {{0, "fsdp", 1}});
  for (int64_t r = 0; r < 48; ++r) {
    const int64_t expected = r <= 41 ? 3 : (r == 42 ? 2 : 0);
    EXPECT_EQ(local_shape(s, m, r), (Shape{expected, 5})) << "rank " << r;
    const auto pieces = local_pieces(s, m, r);
    if (expected == 0) {
      EXPECT_TRUE(pieces.empty()) << "rank " << r;
      continue;
    }
    ASSERT_EQ(pieces.size(), 1u) << "rank " << r;
    EXPECT_EQ(pieces[0].hf_box, (Box{{3 * r, 0}, {expected, 5}}));
    EXPECT_EQ(pieces[0].local_box, (Box{{0, 0}, {expected, 5}}));
  }
}

TEST(LoadSpec, NestedShardsCutTheLocalExtent) {
  // EP first, then FSDP on the same dim: FSDP cuts the EP chunk, not the global dim.
  const Mesh m = mesh_of({"ep", "fsdp"}, {2, 3});
  const LoadSpec s = spec_of({10, 4}, {{0, "ep", 1}, {0, "fsdp", 1}});
  // ep chunks: [0,5) and [5,10); fsdp chunk = ceil(5/3) = 2 -> 2, 2, 1 rows.
  const int64_t starts[6] = {0, 2, 4, 5, 7, 9};
  const int64_t lens[6] = {2, 2, 1, 2, 2, 1};
  for (int64_t r = 0; r < 6; ++r) {
    EXPECT_EQ(local_shape(s, m, r), (Shape{lens[r], 4}));
    const auto p = local_pieces(s, m, r);
    ASSERT_EQ(p.size(), 1u);
    EXPECT_EQ(p[0].hf_box, (Box{{starts[r], 0}, {lens[r], 4}})) << "rank " << r;
  }
}

TEST(LoadSpec, ShardOnSecondDimAfterFirst) {
  const Mesh m = mesh_of({"a", "b"}, {2, 2});
  const LoadSpec s = spec_of({4, 6}, {{1, "b", 1}, {0, "a", 1}});
  const auto p = local_pieces(s, m, m.rank_of({1, 0}));
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].hf_box, (Box{{2, 0}, {2, 3}}));
  EXPECT_EQ(p[0].local_box, (Box{{0, 0}, {2, 3}}));
}

TEST(LoadSpec, InterleaveTakesStridedRuns) {
  // 12 rows, w=2, F=3: runs of 2; rank 1 holds runs 1, 3, 5 = rows 2-3, 6-7, 10-11.
  const Mesh m = mesh_of({"etp"}, {2});
  const LoadSpec s = spec_of({12, 3}, {{0, "etp", 3}});
  EXPECT_EQ(local_shape(s, m, 1), (Shape{6, 3}));
  const auto p = local_pieces(s, m, 1);
  ASSERT_EQ(p.size(), 3u);
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(p[j].hf_box, (Box{{2 + 4 * j, 0}, {2, 3}}));
    EXPECT_EQ(p[j].local_box, (Box{{2 * j, 0}, {2, 3}}));
  }
}

TEST(LoadSpec, InterleaveThatDoesNotDivideIsAnError) {
  const Mesh m = mesh_of({"etp"}, {2});
  const LoadSpec s = spec_of({10, 3}, {{0, "etp", 3}});
  try {
    local_pieces(s, m, 0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_layout);
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
}

TEST(LoadSpec, UnnamedAxesReplicate) {
  const Mesh m = mesh_of({"dp", "fsdp"}, {3, 2});
  const LoadSpec s = spec_of({4, 2}, {{0, "fsdp", 1}});
  for (int64_t dp = 0; dp < 3; ++dp) {
    EXPECT_EQ(local_pieces(s, m, m.rank_of({dp, 0})), local_pieces(s, m, m.rank_of({0, 0})));
    EXPECT_EQ(local_pieces(s, m, m.rank_of({dp, 1}))[0].hf_box, (Box{{2, 0}, {2, 2}}));
  }
  const LoadSpec replicated = spec_of({4, 2}, {});
  for (int64_t r = 0; r < 6; ++r) {
    const auto p = local_pieces(replicated, m, r);
    ASSERT_EQ(p.size(), 1u);
    EXPECT_EQ(p[0].hf_box, Box::full({4, 2}));
  }
}

TEST(LoadSpec, PaddingBelongsToNoPiece) {
  // global 8 rows, origin 6: rank 1 of 2 holds rows 4-7 of which 6-7 are padding.
  const Mesh m = mesh_of({"fsdp"}, {2});
  const LoadSpec s = spec_of({8, 4}, {{0, "fsdp", 1}}, {6, 3});
  EXPECT_EQ(s.hf_key_shape(), (Shape{6, 3}));
  EXPECT_EQ(local_shape(s, m, 1), (Shape{4, 4}));
  const auto p = local_pieces(s, m, 1);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].hf_box, (Box{{4, 0}, {2, 3}}));
  EXPECT_EQ(p[0].local_box, (Box{{0, 0}, {2, 3}}));
}

TEST(LoadSpec, RankHoldingOnlyPaddingHasNoPieces) {
  const Mesh m = mesh_of({"fsdp"}, {4});
  const LoadSpec s = spec_of({8}, {{0, "fsdp", 1}}, {5});
  EXPECT_EQ(local_shape(s, m, 3), (Shape{2}));
  EXPECT_TRUE(local_pieces(s, m, 3).empty());
  const auto p = local_pieces(s, m, 2);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].hf_box, (Box{{4}, {1}}));
}

TEST(LoadSpec, FusedKeysSplitAtKeyBoundaries) {
  // Two experts, gate/up of 3 rows each: keys e0.gate, e0.up, e1.gate, e1.up.
  LoadSpec s = spec_of({12, 2}, {{0, "ep", 1}, {0, "fsdp", 1}});
  s.hf_keys = {"e0.gate", "e0.up", "e1.gate", "e1.up"};
  s.fused_dim = 0;
  EXPECT_EQ(s.hf_key_shape(), (Shape{3, 2}));
  const Mesh m = mesh_of({"ep", "fsdp"}, {2, 2});
  // Rank (0, 1): ep rows [0, 6), fsdp part [3, 6) = all of e0.up.
  auto p = local_pieces(s, m, m.rank_of({0, 1}));
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].key, 1);
  EXPECT_EQ(p[0].hf_box, Box::full({3, 2}));
  // A mesh that cuts across keys: fsdp=1, ep=3 -> rows [4, 8): 2 of e0.up, 2 of e1.gate.
  const Mesh m3 = mesh_of({"ep", "fsdp"}, {3, 1});
  p = local_pieces(s, m3, 1);
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].key, 1);
  EXPECT_EQ(p[0].hf_box, (Box{{1, 0}, {2, 2}}));
  EXPECT_EQ(p[0].local_box, (Box{{0, 0}, {2, 2}}));
  EXPECT_EQ(p[1].key, 2);
  EXPECT_EQ(p[1].hf_box, (Box{{0, 0}, {2, 2}}));
  EXPECT_EQ(p[1].local_box, (Box{{2, 0}, {2, 2}}));
}

TEST(LoadSpec, FusedOnSecondDimWithPadding) {
  // Keys fused along dim 1 (3 columns each), origin 6 of 8 columns.
  LoadSpec s = spec_of({2, 8}, {{1, "tp", 1}}, {2, 6});
  s.hf_keys = {"a", "b"};
  s.fused_dim = 1;
  const Mesh m = mesh_of({"tp"}, {2});
  // Rank 0: columns [0, 4) = a[0:3] + b[0:1].
  auto p = local_pieces(s, m, 0);
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].key, 0);
  EXPECT_EQ(p[0].hf_box, (Box{{0, 0}, {2, 3}}));
  EXPECT_EQ(p[1].key, 1);
  EXPECT_EQ(p[1].hf_box, (Box{{0, 0}, {2, 1}}));
  EXPECT_EQ(p[1].local_box, (Box{{0, 3}, {2, 1}}));
  // Rank 1: columns [4, 8) = b[1:3] + 2 padding columns.
  p = local_pieces(s, m, 1);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].hf_box, (Box{{0, 1}, {2, 2}}));
  EXPECT_EQ(p[0].local_box, (Box{{0, 0}, {2, 2}}));
}

TEST(LoadSpec, UnvalidatedFusedSpecIsAnErrorNotABadKeyIndex) {
  // 5 rows cannot split into 2 keys: without the guard, row 4 would map to key 2.
  LoadSpec s = spec_of({5, 2}, {});
  s.hf_keys = {"a", "b"};
  s.fused_dim = 0;
  const Mesh m = mesh_of({"fsdp"}, {1});
  try {
    local_pieces(s, m, 0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_layout);
    EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
  }
  s.fused_dim.reset();
  EXPECT_THROW(local_pieces(s, m, 0), Error);
}

TEST(LoadSpec, ContiguousRunsMergeIntoOnePiece) {
  // Interleave over an axis of size 1 leaves F adjacent runs: one piece.
  const Mesh m = mesh_of({"etp"}, {1});
  const LoadSpec s = spec_of({12, 3}, {{0, "etp", 4}});
  const auto p = local_pieces(s, m, 0);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].hf_box, Box::full({12, 3}));
}

TEST(LoadSpec, ScalarAndEmptyTensors) {
  const Mesh m = mesh_of({"fsdp"}, {2});
  const LoadSpec scalar = spec_of({}, {});
  EXPECT_EQ(local_shape(scalar, m, 1), Shape{});
  const auto p = local_pieces(scalar, m, 1);
  ASSERT_EQ(p.size(), 1u);
  EXPECT_EQ(p[0].hf_box.rank(), 0u);
  const LoadSpec empty = spec_of({0, 4}, {{0, "fsdp", 1}});
  EXPECT_EQ(local_shape(empty, m, 0), (Shape{0, 4}));
  EXPECT_TRUE(local_pieces(empty, m, 0).empty());
}

// transformers >= 5: experts.gate_up_proj [E, 2I, H] holds, per expert, gate
// then up, each [I, H] on disk.
LoadSpec stacked_gate_up(int64_t experts, int64_t inter, int64_t hidden) {
  LoadSpec s;
  s.name = "mlp.experts.gate_up_proj";
  for (int64_t e = 0; e < experts; ++e) {
    s.hf_keys.push_back(cat("mlp.experts.", e, ".gate_proj.weight"));
    s.hf_keys.push_back(cat("mlp.experts.", e, ".up_proj.weight"));
  }
  s.stack_dim = 0;
  s.fused_dim = 1;
  s.global_shape = {experts, 2 * inter, hidden};
  s.origin_shape = s.global_shape;
  return s;
}

TEST(LoadSpec, StackedKeysLoseTheStackDim) {
  const LoadSpec s = stacked_gate_up(4, 3, 5);
  EXPECT_EQ(s.keys_per_entry(), 2);
  EXPECT_EQ(s.hf_key_shape(), (Shape{3, 5}));
}

TEST(LoadSpec, StackedKeysGiveOnePiecePerEntryAndKey) {
  // 4 experts over ep=2: rank 1 holds experts 2 and 3, each a gate and an up piece.
  const Mesh m = mesh_of({"ep"}, {2});
  LoadSpec s = stacked_gate_up(4, 3, 5);
  s.shards = {{0, "ep", 1}};
  EXPECT_EQ(local_shape(s, m, 1), (Shape{2, 6, 5}));
  const auto pieces = local_pieces(s, m, 1);
  ASSERT_EQ(pieces.size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(s.hf_keys[static_cast<size_t>(pieces[i].key)],
              cat("mlp.experts.", 2 + i / 2, i % 2 ? ".up_proj.weight" : ".gate_proj.weight"));
    EXPECT_EQ(pieces[i].hf_box, (Box{{0, 0}, {3, 5}}));
    EXPECT_EQ(pieces[i].local_box, (Box{{i / 2, 3 * (i % 2), 0}, {1, 3, 5}}));
  }
}

TEST(LoadSpec, StackedKeysShardedInsideAnEntry) {
  // FSDP=4 on dim 1 (6 rows: gate 0..2, up 3..5), chunk 2: rank 1 holds gate
  // row 2 and up row 0.
  const Mesh m = mesh_of({"fsdp"}, {4});
  LoadSpec s = stacked_gate_up(1, 3, 2);
  s.shards = {{1, "fsdp", 1}};
  const auto pieces = local_pieces(s, m, 1);
  ASSERT_EQ(pieces.size(), 2u);
  EXPECT_EQ(pieces[0].key, 0);
  EXPECT_EQ(pieces[0].hf_box, (Box{{2, 0}, {1, 2}}));
  EXPECT_EQ(pieces[0].local_box, (Box{{0, 0, 0}, {1, 1, 2}}));
  EXPECT_EQ(pieces[1].key, 1);
  EXPECT_EQ(pieces[1].hf_box, (Box{{0, 0}, {1, 2}}));
  EXPECT_EQ(pieces[1].local_box, (Box{{0, 1, 0}, {1, 1, 2}}));
  EXPECT_EQ(local_sub_box(pieces[1].hf_box, pieces[1].local_box, Box{{0, 1}, {1, 1}}),
            (Box{{0, 1, 1}, {1, 1, 1}}));
  EXPECT_EQ(hf_sub_box(pieces[1].hf_box, pieces[1].local_box, Box{{0, 1, 1}, {1, 1, 1}}),
            (Box{{0, 1}, {1, 1}}));
}

TEST(LoadSpec, StackedKeysValidation) {
  auto rejects = [](LoadSpec s, const std::string& what) {
    TrainerLayout l{mesh_of({"ep"}, {2}), {std::move(s)}};
    try {
      l.validate();
      ADD_FAILURE() << "accepted: " << what;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_layout);
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  LoadSpec s = stacked_gate_up(4, 3, 5);
  s.stack_dim = 1;
  rejects(s, "stack_dim 1 is not supported");
  s = stacked_gate_up(4, 3, 5);
  s.hf_keys.pop_back();
  rejects(s, "7 hf_keys are not a whole number per entry");
  s = stacked_gate_up(4, 3, 5);
  s.fused_dim.reset();
  rejects(s, "2 hf_keys per stacked entry need a fused_dim");
  s = stacked_gate_up(4, 3, 5);
  s.fused_dim = 0;
  rejects(s, "must be a dim after stack_dim 0");
  s = stacked_gate_up(4, 3, 5);
  s.global_shape[1] = s.origin_shape[1] = 7;
  rejects(s, "do not divide the fused extent 7");
  TrainerLayout ok{mesh_of({"ep"}, {2}), {stacked_gate_up(4, 3, 5)}};
  EXPECT_NO_THROW(ok.validate());
}

TEST(TrainerLayout, JsonRoundTrip) {
  const nlohmann::json j = nlohmann::json::parse(R"({
    "mesh": {"axes": ["ep", "fsdp"], "shape": [2, 2]},
    "params": [
      {"name": "experts", "hf_keys": ["e0", "e1"], "fused_dim": 0, "global_shape": [8, 4],
       "dtype": "F32", "shards": [{"dim": 0, "axis": "ep"}, {"dim": 0, "axis": "fsdp"}]},
      {"name": "embed", "hf_keys": ["embed"], "global_shape": [10, 4], "origin_shape": [9, 4],
       "dtype": "BF16", "shards": [{"dim": 0, "axis": "fsdp", "interleave": 1}]},
      {"name": "norm", "hf_keys": ["norm"], "fused_dim": null, "global_shape": [4],
       "dtype": "F8_E4M3", "shards": []},
      {"name": "down", "hf_keys": ["e0.down", "e1.down"], "stack_dim": 0, "global_shape": [2, 3, 4],
       "dtype": "BF16", "shards": [{"dim": 0, "axis": "ep"}]}
    ]})");
  const TrainerLayout layout = TrainerLayout::from_json(j);
  ASSERT_EQ(layout.params.size(), 4u);
  EXPECT_EQ(layout.params[3].stack_dim, 0);
  EXPECT_EQ(layout.params[3].hf_key_shape(), (Shape{3, 4}));
  EXPECT_FALSE(layout.params[0].stack_dim.has_value());
  EXPECT_FALSE(layout.to_json()["params"][0].contains("stack_dim"));
  EXPECT_EQ(layout.params[0].fused_dim, 0);
  EXPECT_EQ(layout.params[0].hf_key_shape(), (Shape{4, 4}));
  EXPECT_EQ(layout.params[0].dtype, DType::F32);
  EXPECT_EQ(layout.params[1].origin_shape, (Shape{9, 4}));
  EXPECT_FALSE(layout.params[1].fused_dim.has_value());
  EXPECT_EQ(layout.params[2].origin_shape, (Shape{4}));
  EXPECT_EQ(layout.params[2].dtype, DType::F8_E4M3);
  const TrainerLayout again = TrainerLayout::from_json(layout.to_json());
  EXPECT_EQ(again.to_json(), layout.to_json());
  EXPECT_EQ(again.mesh.axes, layout.mesh.axes);
  EXPECT_EQ(again.params[1].shards.size(), 1u);
}

}  // namespace
}  // namespace weightsync
