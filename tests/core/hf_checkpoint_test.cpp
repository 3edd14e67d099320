// HF checkpoints from trainer layouts: the file layout (cuts, writers,
// names, index), the writer layout behind a distributed save (what each
// writer holds itself, its windows), and load_local_tensors against the
// reference cut of `weightsync shard` (fill_local_tensor), errors included.
#include "mixed_layout.h"
#include "safetensors_test_util.h"

#include <weightsync/box.h>
#include <weightsync/error.h>
#include <weightsync/hf_checkpoint.h>
#include <weightsync/load_spec.h>
#include <weightsync/safetensors.h>

#include "core/writer_layout.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <random>

namespace weightsync {
namespace {

using testing::expect_error;
using testing::ScratchDir;

// Every LoadSpec rule (as in shard_test): fused keys with EP then FSDP, tail
// padding, interleave with an empty shard, replication, stacked keys.
TrainerLayout mixed_layout() {
  return TrainerLayout::from_json(testing::mixed_layout_json());
}

// A random checkpoint of the layout's keys as an HF directory of several files.
void write_hf_dir(const std::string& dir, const TrainerLayout& layout, int64_t max_file_bytes) {
  const HfFileLayout files = make_hf_file_layout(layout, max_file_bytes);
  std::mt19937_64 rng(11);
  for (const HfFile& f : files.files) {
    std::vector<SafetensorsWriter::Entry> entries;
    for (int k = f.first_key; k < f.first_key + f.num_keys; ++k)
      entries.push_back({files.keys[k].name, files.keys[k].dtype, files.keys[k].shape});
    SafetensorsWriter w(dir + "/" + f.name, entries);
    for (const auto& e : entries) {
      std::vector<uint8_t> b(numel(e.shape) * itemsize(e.dtype));
      for (auto& x : b) x = static_cast<uint8_t>(1 + rng() % 255);  // never zero: padding is
      w.write_tensor(e.name, b.data(), b.size());
    }
    w.finish();
  }
  std::ofstream(dir + "/model.safetensors.index.json") << files.index_json().dump();
}

TEST(HfFileLayout, CutsKeysInOrderAtTheLimitAndNamesFilesAsTransformers) {
  const TrainerLayout layout = mixed_layout();
  // e*.gate/up are [5, 4] F32 = 80 bytes; 200 bytes take two of them.
  const HfFileLayout f = make_hf_file_layout(layout, 200);
  std::vector<std::string> order;
  for (const LoadSpec& p : layout.params)
    for (const auto& k : p.hf_keys) order.push_back(k);
  ASSERT_EQ(f.keys.size(), order.size());
  int64_t total = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    EXPECT_EQ(f.keys[k].name, order[k]);
    total += f.keys[k].bytes;
    const HfFile& file = f.files[f.keys[k].file];
    EXPECT_GE(static_cast<int>(k), file.first_key);
    EXPECT_LT(static_cast<int>(k), file.first_key + file.num_keys);
  }
  EXPECT_EQ(f.total_bytes(), total);
  for (size_t i = 0; i < f.files.size(); ++i) {
    EXPECT_EQ(f.files[i].name, hf_file_name(static_cast<int>(i), static_cast<int>(f.files.size())));
    // At most the limit, unless one key alone exceeds it; greedy: the next
    // file's first key would not have fitted.
    if (f.files[i].num_keys > 1) {
      EXPECT_LE(f.files[i].bytes, 200);
    }
    if (i + 1 < f.files.size()) {
      EXPECT_GT(f.files[i].bytes + f.keys[f.files[i + 1].first_key].bytes, 200);
    }
  }
  EXPECT_EQ(hf_file_name(1, 5), "model-00002-of-00005.safetensors");
  const nlohmann::json index = f.index_json();
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);
  EXPECT_EQ(index["weight_map"]["embed"], f.files[f.keys[6].file].name);
  EXPECT_EQ(index["weight_map"].size(), order.size());
}

TEST(HfFileLayout, OneBigFileByDefaultAndOneKeyPerFileAtOneByte) {
  const TrainerLayout layout = mixed_layout();
  EXPECT_EQ(make_hf_file_layout(layout).files.size(), 1u);
  const HfFileLayout tiny = make_hf_file_layout(layout, 1);
  EXPECT_EQ(tiny.files.size(), tiny.keys.size());
  expect_error([&] { make_hf_file_layout(layout, 0); }, Errc::invalid_argument, {"max_file_bytes"});
}

TEST(HfFileLayout, BalancesBytesAndPrefersRanksHoldingKeysWhole) {
  // Four ranks, EP=4: rank r holds experts r's keys whole; dense keys sharded.
  const TrainerLayout layout = TrainerLayout::from_json(nlohmann::json::parse(R"({
    "mesh": {"axes": ["ep"], "shape": [4]},
    "params": [
      {"name": "dense", "hf_keys": ["dense"], "global_shape": [64, 16], "dtype": "F32",
       "shards": [{"dim": 0, "axis": "ep"}]},
      {"name": "experts", "fused_dim": 0, "global_shape": [64, 16], "dtype": "F32",
       "hf_keys": ["x0", "x1", "x2", "x3"], "shards": [{"dim": 0, "axis": "ep"}]}
    ]})"));
  // 1024 bytes per expert, 4096 for dense: one file per key.
  const HfFileLayout f = make_hf_file_layout(layout, 1024);
  ASSERT_EQ(f.files.size(), 5u);
  for (int e = 0; e < 4; ++e) EXPECT_EQ(f.files[1 + e].writer, e) << "expert " << e;
  const HfFileLayout again = make_hf_file_layout(layout, 1024);
  for (size_t i = 0; i < f.files.size(); ++i) EXPECT_EQ(f.files[i].writer, again.files[i].writer);
  // Eight equal files over four ranks: two each.
  const HfFileLayout even = make_hf_file_layout(mixed_layout(), 1);
  std::map<int, int64_t> load;
  for (const HfFile& file : even.files) load[file.writer] += file.bytes;
  int64_t lo = INT64_MAX, hi = 0, biggest = 0;
  for (const HfFile& file : even.files) biggest = std::max(biggest, file.bytes);
  for (int r = 0; r < 12; ++r) lo = std::min(lo, load[r]), hi = std::max(hi, load[r]);
  EXPECT_LE(hi - lo, biggest) << "loads between " << lo << " and " << hi;
}

TEST(WriterLayout, SubtractBoxTilesTheRest) {
  const Box a{{0, 0}, {6, 5}}, b{{2, 1}, {2, 3}};
  const auto rest = subtract_box(a, b);
  int64_t sum = 0;
  for (const Box& r : rest) {
    sum += r.numel();
    EXPECT_TRUE(a.contains(r));
    EXPECT_FALSE(intersect(r, b).has_value()) << box_str(r);
    for (const Box& o : rest)
      if (&o != &r) {
        EXPECT_FALSE(intersect(r, o).has_value()) << box_str(r) << box_str(o);
      }
  }
  EXPECT_EQ(sum, a.numel() - b.numel());
  EXPECT_EQ(subtract_box(a, Box{{7, 0}, {1, 1}}).size(), 1u);
  EXPECT_TRUE(subtract_box(a, a).empty());
}

TEST(WriterLayout, RemotePartsAndLocalPartsTileEveryKeyAndWindowsStayBounded) {
  const TrainerLayout layout = mixed_layout();
  const int64_t window = 48;
  const WriterLayout wl = make_writer_layout(layout, 100, window);
  for (size_t k = 0; k < wl.files.keys.size(); ++k) {
    int64_t covered = 0;
    for (const LocalPart& l : wl.local[k]) covered += l.hf_box.numel();
    for (const WriterPart& r : wl.remote[k]) covered += r.box.numel();
    EXPECT_EQ(covered, numel(wl.files.keys[k].shape)) << wl.files.keys[k].name;
  }
  // Windows: each writer's remote parts in writing order, at most `window`
  // bytes unless one row alone is bigger; one engine rank each.
  ASSERT_EQ(wl.engine.ranks.size(), wl.windows.size());
  std::map<int, int> next_index;
  for (const WriterWindow& w : wl.windows) {
    EXPECT_EQ(w.index, next_index[w.writer]++);
    if (w.parts.size() > 1) {
      EXPECT_LE(w.bytes, window);
    }
  }
  // No writer is sent what it holds: nothing is planned for replicated "norm".
  const int norm = 8;
  ASSERT_EQ(wl.files.keys[norm].name, "norm");
  EXPECT_TRUE(wl.remote[norm].empty());
}

class HfLoad : public ScratchDir {};

TEST_F(HfLoad, EveryRankEqualsTheShardCutPaddingZero) {
  const TrainerLayout layout = mixed_layout();
  write_hf_dir(path(""), layout, 150);
  const Checkpoint ckpt = Checkpoint::open(path(""));
  ASSERT_GT(ckpt.files().size(), 3u);
  for (int r = 0; r < layout.mesh.world(); ++r) {
    std::vector<std::vector<char>> got, want;
    std::vector<TensorView> views;
    for (const LoadSpec& spec : layout.params) {
      const Shape s = local_shape(spec, layout.mesh, r);
      const size_t bytes = numel(s) * itemsize(spec.dtype);
      got.emplace_back(bytes + 1, '\x77');  // garbage: padding must be zeroed
      want.emplace_back(bytes + 1, 0);
      views.push_back(host_view(got.back().data(), spec.dtype, s));
      fill_local_tensor(ckpt, spec, layout.mesh, r, host_view(want.back().data(), spec.dtype, s));
    }
    const LoadReport report = load_local_tensors(ckpt, layout, r, views);
    EXPECT_GT(report.pieces, 0u);
    for (size_t p = 0; p < layout.params.size(); ++p)
      EXPECT_EQ(std::memcmp(got[p].data(), want[p].data(), views[p].nbytes()), 0)
          << layout.params[p].name << " on rank " << r;
  }
}

// A mirror (Megatron's tied output_layer) is no source of the key: the file
// layout ignores it; it is filled with the key it copies, shard cut and load
// alike.
TEST_F(HfLoad, AMirrorIsFilledWithTheKeyItCopies) {
  nlohmann::json j = mixed_layout().to_json();
  j["params"].push_back(nlohmann::json::parse(R"({"name": "head", "global_shape": [9, 3],
      "dtype": "BF16", "shards": [{"dim": 0, "axis": "fsdp"}], "segments": [],
      "mirror_of": "embed"})"));
  const TrainerLayout layout = TrainerLayout::from_json(j);
  const size_t head = layout.params.size() - 1, embed = 1;
  write_hf_dir(path(""), layout, 150);
  const Checkpoint ckpt = Checkpoint::open(path(""));
  EXPECT_EQ(make_hf_file_layout(layout, 150).keys.size(),
            make_hf_file_layout(mixed_layout(), 150).keys.size());
  for (int r = 0; r < layout.mesh.world(); ++r) {
    std::vector<std::vector<char>> got;
    std::vector<TensorView> views;
    for (const LoadSpec& spec : layout.params) {
      const Shape s = local_shape(spec, layout.mesh, r);
      got.emplace_back(numel(s) * itemsize(spec.dtype) + 1, '\x77');
      views.push_back(host_view(got.back().data(), spec.dtype, s));
    }
    load_local_tensors(ckpt, layout, r, views);
    std::vector<char> cut(views[head].nbytes() + 1, 0);
    fill_local_tensor(ckpt, layout.params[head], layout.mesh, r,
                      host_view(cut.data(), DType::BF16, views[head].shape));
    ASSERT_EQ(views[head].nbytes(), views[embed].nbytes());
    EXPECT_EQ(std::memcmp(got[head].data(), got[embed].data(), views[head].nbytes()), 0) << r;
    EXPECT_EQ(std::memcmp(got[head].data(), cut.data(), views[head].nbytes()), 0) << r;
    // Rows of the key itself (not only padding) on the ranks that hold some.
    if (r % 3 < 2) {
      EXPECT_TRUE(std::any_of(cut.begin(), cut.end() - 1, [](char c) { return c != 0; })) << r;
    }
  }
}

TEST_F(HfLoad, MismatchesNameTheKeyTheRankAndTheFile) {
  const TrainerLayout layout = mixed_layout();
  write_hf_dir(path(""), layout, 1 << 20);
  const Checkpoint ckpt = Checkpoint::open(path(""));
  std::vector<std::vector<char>> storage;
  std::vector<TensorView> views;
  for (const LoadSpec& spec : layout.params) {
    const Shape s = local_shape(spec, layout.mesh, 5);
    storage.emplace_back(numel(s) * itemsize(spec.dtype) + 1);
    views.push_back(host_view(storage.back().data(), spec.dtype, s));
  }
  nlohmann::json j = layout.to_json();
  j["params"][1]["hf_keys"][0] = "embed_missing";
  expect_error([&] { load_local_tensors(ckpt, TrainerLayout::from_json(j), 5, views); },
               Errc::not_found, {"trainer rank 5", "embed_missing", "embed"});
  j = layout.to_json();
  j["params"][3]["global_shape"] = {6};
  views[3].shape = {6};
  expect_error([&] { load_local_tensors(ckpt, TrainerLayout::from_json(j), 5, views); },
               Errc::mismatch, {"trainer rank 5", "'norm'", "[5]", "[6]", "model-00001"});
  j = layout.to_json();
  views[3].shape = {5};
  j["params"][3]["dtype"] = "BF16";
  views[3].dtype = DType::BF16;
  expect_error([&] { load_local_tensors(ckpt, TrainerLayout::from_json(j), 5, views); },
               Errc::mismatch, {"trainer rank 5", "'norm'", "F32", "BF16"});
  views[3].dtype = DType::F32;
  views[0].shape = {1, 1};
  expect_error([&] { load_local_tensors(ckpt, layout, 5, views); }, Errc::mismatch,
               {"trainer rank 5", "experts.gate_up"});
}

}  // namespace
}  // namespace weightsync
