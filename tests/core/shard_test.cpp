// `weightsync shard` round trips: write a random checkpoint, shard it for
// every trainer rank (library and the real binary), reassemble the HF tensors
// from the shards and compare bytes; padding must be zero.
#include "mixed_layout.h"
#include "safetensors_test_util.h"

#include <weightsync/box.h>
#include <weightsync/error.h>
#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>
#include <weightsync/load_spec.h>
#include <weightsync/safetensors.h>

#include "core/random_checkpoint.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <fstream>
#include <map>
#include <random>

namespace weightsync {
namespace {

using testing::ScratchDir;
using Bytes = std::vector<uint8_t>;

struct KeySpec {
  DType dtype;
  Shape shape;
};

// Writes random bytes for every key with SafetensorsWriter; returns them.
std::map<std::string, Bytes> write_checkpoint(const std::string& path,
                                              const std::map<std::string, KeySpec>& keys,
                                              uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<SafetensorsWriter::Entry> entries;
  std::map<std::string, Bytes> data;
  for (const auto& [key, ks] : keys) {
    entries.push_back({key, ks.dtype, ks.shape});
    Bytes b(numel(ks.shape) * itemsize(ks.dtype));
    // Never zero, so a zero in a shard can only be padding.
    for (auto& x : b) x = static_cast<uint8_t>(1 + rng() % 255);
    data[key] = std::move(b);
  }
  SafetensorsWriter writer(path, entries);
  for (const auto& e : entries)
    writer.write_tensor(e.name, data[e.name].data(), data[e.name].size());
  writer.finish();
  return data;
}

// Mesh dp=2 x ep=2 x fsdp=3 and params exercising every rule: fused keys with
// EP then FSDP, tail padding, interleave, an empty local shard, replication,
// keys stacked on a leading dim (fused and padded; transformers >= 5 experts).
TrainerLayout mixed_layout() {
  return TrainerLayout::from_json(testing::mixed_layout_json());
}

std::map<std::string, KeySpec> keys_of(const TrainerLayout& layout) {
  std::map<std::string, KeySpec> keys;
  for (const LoadSpec& p : layout.params) {
    const std::vector<Shape> shapes = p.key_shapes();
    for (size_t k = 0; k < p.hf_keys.size(); ++k) keys[p.hf_keys[k]] = {p.dtype, shapes[k]};
  }
  return keys;
}

// Mesh pp=2 x tp=2: grouped QKV (segments, tp on whole groups) and a
// per-stage weight under one local name, a copy with no HF content on stage
// 1, a param on every rank.
TrainerLayout staged_layout() {
  return TrainerLayout::from_json(nlohmann::json::parse(R"({
    "mesh": {"axes": ["pp", "tp"], "shape": [2, 2]},
    "params": [
      {"name": "layers.0.qkv", "global_shape": [12, 3], "dtype": "BF16",
       "shards": [{"dim": 0, "axis": "tp"}], "stage": {"axis": "pp", "index": 0},
       "segments": [
         {"hf_key": "l0.q", "hf_box": {"offsets": [0, 0], "lengths": [4, 3]},
          "param_box": {"offsets": [0, 0], "lengths": [4, 3]}},
         {"hf_key": "l0.k", "hf_box": {"offsets": [0, 0], "lengths": [1, 3]},
          "param_box": {"offsets": [4, 0], "lengths": [1, 3]}},
         {"hf_key": "l0.v", "hf_box": {"offsets": [0, 0], "lengths": [1, 3]},
          "param_box": {"offsets": [5, 0], "lengths": [1, 3]}},
         {"hf_key": "l0.q", "hf_box": {"offsets": [4, 0], "lengths": [4, 3]},
          "param_box": {"offsets": [6, 0], "lengths": [4, 3]}},
         {"hf_key": "l0.k", "hf_box": {"offsets": [1, 0], "lengths": [1, 3]},
          "param_box": {"offsets": [10, 0], "lengths": [1, 3]}},
         {"hf_key": "l0.v", "hf_box": {"offsets": [1, 0], "lengths": [1, 3]},
          "param_box": {"offsets": [11, 0], "lengths": [1, 3]}}]},
      {"name": "layers.0.w", "hf_keys": ["l0.w"], "global_shape": [4, 2], "dtype": "F32",
       "shards": [{"dim": 1, "axis": "tp"}], "stage": {"axis": "pp", "index": 0}},
      {"name": "layers.0.w", "hf_keys": ["l1.w"], "global_shape": [6, 2], "origin_shape": [5, 2],
       "dtype": "F32", "shards": [{"dim": 0, "axis": "tp"}], "stage": {"axis": "pp", "index": 1}},
      {"name": "tied_copy", "hf_keys": [], "segments": [], "global_shape": [2, 3],
       "dtype": "F32", "shards": [], "stage": {"axis": "pp", "index": 1}},
      {"name": "norm", "hf_keys": ["norm"], "global_shape": [3], "dtype": "F16", "shards": []}
    ]})"));
}

// Reads every rank's shard file back into HF tensors; checks shapes, dtypes
// and that padding bytes are zero. Returns the reassembled tensors.
std::map<std::string, Bytes> reassemble(const TrainerLayout& layout,
                                        const std::vector<std::string>& shard_files) {
  std::map<std::string, Bytes> out;
  for (const auto& [key, ks] : keys_of(layout))
    out[key].assign(numel(ks.shape) * itemsize(ks.dtype), 0);
  for (int64_t r = 0; r < layout.mesh.world(); ++r) {
    const auto file = SafetensorsFile::open(shard_files[r]);
    // A rank's file holds exactly the params of its stages.
    EXPECT_EQ(file->tensors().size(), layout.rank_params(r).size());
    for (size_t p : layout.rank_params(r)) {
      const LoadSpec& spec = layout.params[p];
      const TensorInfo* info = file->find(spec.name);
      EXPECT_NE(info, nullptr) << spec.name << " missing on rank " << r;
      if (!info) continue;
      EXPECT_EQ(info->shape, local_shape(spec, layout.mesh, r)) << spec.name << " rank " << r;
      EXPECT_EQ(info->dtype, spec.dtype);
      const TensorView local = file->view(spec.name);
      // Mark what the pieces cover; everything else is padding and must be zero.
      Bytes mask(local.numel(), 0);
      const TensorView mask_view = host_view(mask.data(), DType::U8, Shape(local.shape));
      const size_t isz = itemsize(spec.dtype);
      const std::vector<Shape> key_shapes = spec.key_shapes();
      for (const Piece& p : local_pieces(spec, layout.mesh, r)) {
        copy_box(local, p.local_box,
                 host_view(out[spec.hf_keys[p.key]].data(), spec.dtype, key_shapes[p.key]),
                 p.hf_box);
        Bytes ones(p.local_box.numel(), 1);
        copy_box(host_view(ones.data(), DType::U8, p.local_box.lengths),
                 Box::full(p.local_box.lengths), mask_view, p.local_box);
      }
      const auto* bytes = static_cast<const uint8_t*>(local.data);
      for (size_t i = 0; i < mask.size(); ++i) {
        if (mask[i]) continue;
        for (size_t b = 0; b < isz; ++b)
          EXPECT_EQ(bytes[i * isz + b], 0) << spec.name << " rank " << r << " element " << i;
      }
    }
  }
  return out;
}

class Shard : public ScratchDir {};

TEST_F(Shard, EveryRankReassemblesTheCheckpoint) {
  const TrainerLayout layout = mixed_layout();
  const auto original = write_checkpoint(path("ckpt.safetensors"), keys_of(layout), 7);
  const Checkpoint ckpt = Checkpoint::open(path("ckpt.safetensors"));
  std::vector<std::string> files;
  for (int64_t r = 0; r < layout.mesh.world(); ++r) {
    files.push_back(path("rank" + std::to_string(r) + ".safetensors"));
    // A tiny buffer forces many row windows per tensor.
    write_rank_shard(ckpt, layout, r, files.back(), 16);
  }
  // The interleaved param leaves fsdp rank 2 an empty [4, 0] tensor.
  const auto last = SafetensorsFile::open(files[layout.mesh.rank_of({0, 0, 2})]);
  ASSERT_NE(last->find("w13"), nullptr);
  EXPECT_EQ(last->find("w13")->shape, (Shape{4, 0}));
  const auto rebuilt = reassemble(layout, files);
  for (const auto& [key, bytes] : original) EXPECT_TRUE(rebuilt.at(key) == bytes) << key;
}

TEST_F(Shard, SegmentsAndStagesReassembleTheCheckpoint) {
  const TrainerLayout layout = staged_layout();
  const auto original = write_checkpoint(path("ckpt.safetensors"), keys_of(layout), 17);
  const Checkpoint ckpt = Checkpoint::open(path("ckpt.safetensors"));
  std::vector<std::string> files;
  for (int64_t r = 0; r < layout.mesh.world(); ++r) {
    files.push_back(path("rank" + std::to_string(r) + ".safetensors"));
    write_rank_shard(ckpt, layout, r, files.back(), 16);
  }
  // Stage 1's ranks hold their own "layers.0.w" (key l1.w) and the copy.
  const auto stage1 = SafetensorsFile::open(files[layout.mesh.rank_of({1, 1})]);
  EXPECT_EQ(stage1->find("layers.0.w")->shape, (Shape{3, 2}));
  EXPECT_NE(stage1->find("tied_copy"), nullptr);
  EXPECT_EQ(stage1->find("layers.0.qkv"), nullptr);
  // tp rank 1 of stage 0 holds group 1 of the QKV: q rows 4..8, k 1, v 1.
  const auto stage0 = SafetensorsFile::open(files[layout.mesh.rank_of({0, 1})]);
  const TensorView qkv = stage0->view("layers.0.qkv");
  const auto* got = static_cast<const uint8_t*>(qkv.data);
  const Bytes& q = original.at("l0.q");
  EXPECT_TRUE(std::equal(q.begin() + 4 * 3 * 2, q.end(), got)) << "q rows of group 1";
  EXPECT_TRUE(std::equal(original.at("l0.k").begin() + 6, original.at("l0.k").end(), got + 24));
  const auto rebuilt = reassemble(layout, files);
  for (const auto& [key, bytes] : original) EXPECT_TRUE(rebuilt.at(key) == bytes) << key;
}

TEST_F(Shard, FillLocalTensorMatchesTheShardFile) {
  const TrainerLayout layout = mixed_layout();
  write_checkpoint(path("ckpt.safetensors"), keys_of(layout), 8);
  const Checkpoint ckpt = Checkpoint::open(path("ckpt.safetensors"));
  const int64_t rank = layout.mesh.rank_of({1, 1, 1});
  write_rank_shard(ckpt, layout, rank, path("r.safetensors"));
  const auto file = SafetensorsFile::open(path("r.safetensors"));
  for (const LoadSpec& spec : layout.params) {
    const Shape shape = local_shape(spec, layout.mesh, rank);
    Bytes buf(numel(shape) * itemsize(spec.dtype), 0xee);
    fill_local_tensor(ckpt, spec, layout.mesh, rank, host_view(buf.data(), spec.dtype, shape));
    const TensorView v = file->view(spec.name);
    EXPECT_EQ(Bytes(static_cast<const uint8_t*>(v.data),
                    static_cast<const uint8_t*>(v.data) + v.nbytes()),
              buf)
        << spec.name;
  }
  Bytes small(4);
  EXPECT_THROW(fill_local_tensor(ckpt, layout.params[0], layout.mesh, rank,
                                 host_view(small.data(), DType::F32, {1})),
               Error);
}

TrainerLayoutOptions style_of(TrainerLayoutStyle style) {
  TrainerLayoutOptions o;
  o.style = style;
  return o;
}

// Both layout styles: XTuner's fused experts and transformers' stacked ones.
class ShardStyles : public ScratchDir, public ::testing::WithParamInterface<TrainerLayoutStyle> {};

TEST_P(ShardStyles, TinyMoeModelRoundTripsWithGeneratedLayout) {
  const HfModelConfig config = HfModelConfig::load(std::string(WEIGHTSYNC_SOURCE_DIR) +
                                                   "/configs/models/tiny-qwen3-moe/config.json");
  const TrainerLayout layout =
      make_trainer_layout(config, parse_mesh_spec("ep=2,fsdp=3"), style_of(GetParam()));
  write_random_checkpoint(path("ckpt"), hf_tensors(config), {.seed = 3, .num_files = 2});
  const Checkpoint ckpt = Checkpoint::open(path("ckpt"));
  std::vector<std::string> files;
  for (int64_t r = 0; r < layout.mesh.world(); ++r) {
    files.push_back(path("rank" + std::to_string(r) + ".safetensors"));
    write_rank_shard(ckpt, layout, r, files.back());
  }
  const auto rebuilt = reassemble(layout, files);
  for (const HfTensorSpec& t : hf_tensors(config)) {
    const TensorView v = ckpt.view(t.key);
    const auto* p = static_cast<const uint8_t*>(v.data);
    EXPECT_TRUE(rebuilt.at(t.key) == Bytes(p, p + v.nbytes())) << t.key;
  }
}

INSTANTIATE_TEST_SUITE_P(Styles, ShardStyles,
                         ::testing::Values(TrainerLayoutStyle::xtuner,
                                           TrainerLayoutStyle::transformers),
                         [](const auto& info) {
                           return std::string(trainer_layout_style_name(info.param));
                         });

TEST_F(Shard, CheckedInPaddedVocabExampleRoundTrips) {
  const std::string src = WEIGHTSYNC_SOURCE_DIR;
  const HfModelConfig config = HfModelConfig::load(src + "/configs/models/tiny-llama/config.json");
  const TrainerLayout layout =
      TrainerLayout::load(src + "/configs/examples/trainer_tiny_llama_dp2_fsdp3_padded_vocab.json");
  write_random_checkpoint(path("ckpt.safetensors"), hf_tensors(config), {.seed = 5});
  const Checkpoint ckpt = Checkpoint::open(path("ckpt.safetensors"));
  std::vector<std::string> files;
  for (int64_t r = 0; r < layout.mesh.world(); ++r) {
    files.push_back(path("rank" + std::to_string(r) + ".safetensors"));
    write_rank_shard(ckpt, layout, r, files.back());
  }
  // 128 padded vocab rows over fsdp=3: the last rank holds rows 86..127, 28 of them padding.
  const auto last = SafetensorsFile::open(files.back());
  EXPECT_EQ(last->find("model.embed_tokens.weight")->shape, (Shape{42, config.hidden_size}));
  const auto rebuilt = reassemble(layout, files);
  for (const HfTensorSpec& t : hf_tensors(config)) {
    const TensorView v = ckpt.view(t.key);
    const auto* p = static_cast<const uint8_t*>(v.data);
    EXPECT_TRUE(rebuilt.at(t.key) == Bytes(p, p + v.nbytes())) << t.key;
  }
}

// Runs the real binary; returns its exit status and stderr+stdout.
std::pair<int, std::string> run_cli(const std::string& args) {
  const std::string cmd = std::string(WEIGHTSYNC_CLI) + " " + args + " 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return {-1, "popen failed"};
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  const int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST_F(Shard, BinaryWritesTheSameFileAsTheLibrary) {
  const TrainerLayout layout = mixed_layout();
  write_checkpoint(path("ckpt.safetensors"), keys_of(layout), 9);
  std::ofstream(path("trainer.json")) << layout.to_json().dump(2);
  const Checkpoint ckpt = Checkpoint::open(path("ckpt.safetensors"));
  for (int64_t rank : {0, 5, 11}) {
    write_rank_shard(ckpt, layout, rank, path("lib.safetensors"));
    const auto [rc, out] = run_cli("shard --checkpoint " + path("ckpt.safetensors") +
                                   " --trainer " + path("trainer.json") + " --rank " +
                                   std::to_string(rank) + " --out " + path("cli.safetensors"));
    ASSERT_EQ(rc, 0) << out;
    EXPECT_EQ(slurp(path("cli.safetensors")), slurp(path("lib.safetensors"))) << "rank " << rank;
  }
  const auto [rc, out] =
      run_cli("shard --checkpoint " + path("ckpt.safetensors") + " --trainer " +
              path("trainer.json") + " --rank 12 --out " + path("x.safetensors"));
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("rank 12"), std::string::npos) << out;
}

class ShardErrors : public ScratchDir {
 protected:
  void shard_with(std::map<std::string, KeySpec> keys, int64_t rank, Errc code,
                  std::initializer_list<std::string> parts) {
    write_checkpoint(path("ckpt.safetensors"), keys, 1);
    const Checkpoint ckpt = Checkpoint::open(path("ckpt.safetensors"));
    testing::expect_error(
        [&] { write_rank_shard(ckpt, mixed_layout(), rank, path("out.safetensors")); }, code,
        parts);
    EXPECT_FALSE(std::filesystem::exists(path("out.safetensors")));
  }
};

TEST_F(ShardErrors, MissingKey) {
  auto keys = keys_of(mixed_layout());
  keys.erase("e1.up");
  shard_with(keys, 0, Errc::not_found, {"'e1.up'", "experts.gate_up"});
}

TEST_F(ShardErrors, ShapeMismatch) {
  auto keys = keys_of(mixed_layout());
  keys["embed"].shape = {9, 3};
  shard_with(keys, 0, Errc::mismatch, {"'embed'", "[9, 3]", "[7, 3]"});
}

TEST_F(ShardErrors, DtypeMismatch) {
  auto keys = keys_of(mixed_layout());
  keys["norm"].dtype = DType::BF16;
  shard_with(keys, 0, Errc::mismatch, {"'norm'", "BF16", "F32"});
}

TEST_F(ShardErrors, RankOutOfRange) {
  shard_with(keys_of(mixed_layout()), 12, Errc::invalid_argument, {"rank 12", "12 ranks"});
  shard_with(keys_of(mixed_layout()), -1, Errc::invalid_argument, {"rank -1"});
}

TEST_F(ShardErrors, BinaryNamesTheMissingKey) {
  auto keys = keys_of(mixed_layout());
  keys.erase("norm");
  write_checkpoint(path("ckpt.safetensors"), keys, 1);
  std::ofstream(path("trainer.json")) << mixed_layout().to_json().dump();
  const auto [rc, out] = run_cli("shard --checkpoint " + path("ckpt.safetensors") + " --trainer " +
                                 path("trainer.json") + " --rank 0 --out " + path("o.safetensors"));
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("'norm'"), std::string::npos) << out;
}

}  // namespace
}  // namespace weightsync
