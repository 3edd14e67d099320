// Distributed HF saves with real processes: `weightsync export` starts one
// process per trainer rank, each fills its shards from a checkpoint, and
// they save a directory together (Publisher::save_hf). The directory must
// equal the source key by key, byte for byte, with transformers' file names
// and index; a rank killed mid-save must fail the others and leave no index.
#include "e2e/e2e_helpers.h"
#include "mixed_layout.h"

#include <nlohmann/json.hpp>

#include <weightsync/backend/transport.h>
#include <weightsync/hf_checkpoint.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <regex>

namespace weightsync::e2e {
namespace {

namespace fs = std::filesystem;

// A random checkpoint of the layout's keys (shapes and dtypes from its
// LoadSpecs), one .safetensors file.
std::string write_source(const std::string& dir, const TrainerLayout& layout) {
  std::vector<HfTensorSpec> tensors;
  for (const LoadSpec& p : layout.params)
    for (const auto& k : p.hf_keys) tensors.push_back({k, p.hf_key_shape(), p.dtype});
  const std::string path = dir + "/source.safetensors";
  RandomCheckpointOptions ro;
  ro.seed = 3;
  write_random_checkpoint(path, tensors, ro);
  return path;
}

std::string write_layout(const std::string& dir, const nlohmann::json& layout) {
  const std::string path = dir + "/trainer.json";
  std::ofstream(path) << layout.dump();
  return path;
}

nlohmann::json model_layout(const std::string& model, const std::string& mesh,
                            TrainerLayoutStyle style = TrainerLayoutStyle::xtuner) {
  TrainerLayoutOptions o;
  o.style = style;
  return make_trainer_layout(HfModelConfig::load(config_path(model)), parse_mesh_spec(mesh), o)
      .to_json();
}

// Every rule of LoadSpec (as tests/core/shard_test.cpp): fused keys with EP
// then FSDP, tail padding, interleave with an empty shard, a replicated
// param, keys stacked on a leading dim, a column (dim 1) shard.
nlohmann::json mixed_layout() {
  nlohmann::json j = testing::mixed_layout_json();
  j["params"].push_back(nlohmann::json::parse(R"(
      {"name": "cols", "hf_keys": ["cols"], "global_shape": [40, 36], "dtype": "BF16",
       "shards": [{"dim": 1, "axis": "fsdp"}, {"dim": 0, "axis": "ep", "interleave": 2}]})"));
  return j;
}

// The tiny Llama with every 2-D weight cut by columns (strided pieces that
// cannot travel straight from the shards) and FFN rows interleaved.
nlohmann::json column_layout() {
  nlohmann::json j = model_layout("tiny-llama", "fsdp=2");
  for (auto& p : j["params"]) {
    const auto& shape = p["global_shape"];
    if (shape.size() == 2 && shape[1].get<int64_t>() % 2 == 0)
      p["shards"] = {{{"dim", 1}, {"axis", "fsdp"}}};
    if (p["name"].get<std::string>().find("gate_proj") != std::string::npos)
      p["shards"] = {{{"dim", 0}, {"axis", "fsdp"}, {"interleave", 4}}};
  }
  return j;
}

struct Export {
  CliRun run;
  nlohmann::json summary;
};

Export run_export(const std::string& dir, const std::string& source, const std::string& trainer,
                  std::vector<std::string> extra) {
  std::vector<std::string> args{"export",    "--checkpoint", source,       "--trainer",
                                trainer,     "--out",        dir + "/out", "--json",
                                "--timeout", "60",           "--work-dir", dir + "/work"};
  args.insert(args.end(), extra.begin(), extra.end());
  Export e;
  e.run = run_cli(args);
  const auto brace = e.run.output.rfind("\n{");
  if (brace != std::string::npos || e.run.output.rfind('{', 0) == 0)
    e.summary = nlohmann::json::parse(
        e.run.output.substr(brace == std::string::npos ? 0 : brace + 1), nullptr, false);
  return e;
}

// The saved directory against the source and the layout: every key once,
// equal byte for byte; transformers' file names; the index; keys in each
// file in the layout's order; nothing left behind.
void expect_checkpoint(const std::string& out, const std::string& source,
                       const TrainerLayout& layout, int64_t max_file_bytes) {
  const Checkpoint a = Checkpoint::open(source), b = Checkpoint::open(out);
  ASSERT_EQ(a.keys(), b.keys());
  for (const std::string& k : a.keys()) {
    const TensorView x = a.view(k), y = b.view(k);
    ASSERT_EQ(x.dtype, y.dtype) << k;
    ASSERT_EQ(x.shape, y.shape) << k;
    EXPECT_EQ(std::memcmp(x.data, y.data, x.nbytes()), 0) << "bytes of " << k;
  }
  const HfFileLayout files = make_hf_file_layout(layout, max_file_bytes);
  const nlohmann::json index = read_json(out + "/model.safetensors.index.json");
  ASSERT_TRUE(index.is_object());
  EXPECT_EQ(index, files.index_json());
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), files.total_bytes());
  ASSERT_EQ(b.files().size(), files.files.size());
  for (size_t f = 0; f < files.files.size(); ++f) {
    const HfFile& file = files.files[f];
    const auto st = SafetensorsFile::open(out + "/" + file.name);
    ASSERT_EQ(st->tensors().size(), static_cast<size_t>(file.num_keys)) << file.name;
    for (int i = 0; i < file.num_keys; ++i)  // by data offset: the layout's order
      EXPECT_EQ(st->tensors()[i].name, files.keys[file.first_key + i].name) << file.name;
  }
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    EXPECT_TRUE(std::regex_match(name, std::regex(R"(model-\d{5}-of-\d{5}\.safetensors)")) ||
                name == "model.safetensors.index.json" || name == "config.json")
        << "left behind: " << name;
  }
}

// Beyond its shards, a writer assembles keys in an arena of a few windows
// (buckets) plus a few of its largest tensors (keys bigger than a window are
// alive across several), never its whole files.
void expect_bounded_memory(const nlohmann::json& summary, const TrainerLayout& layout,
                           int64_t max_file_bytes, const std::vector<std::string>& extra) {
  const auto flag = std::find(extra.begin(), extra.end(), "--bucket-bytes");
  if (flag == extra.end()) return;
  const int64_t bucket = std::stoll(*(flag + 1));
  const HfFileLayout files = make_hf_file_layout(layout, max_file_bytes);
  for (const auto& r : summary["per_rank"]) {
    const int rank = r["rank"].get<int>();
    int64_t largest = 0, written = 0;
    for (int f : files.files_of(rank)) {
      const HfFile& file = files.files[static_cast<size_t>(f)];
      written += file.bytes;
      for (int k = file.first_key; k < file.first_key + file.num_keys; ++k)
        largest = std::max(largest, files.keys[static_cast<size_t>(k)].bytes + 256);
    }
    const int64_t arena = r["stats"]["rounds"][0]["save"]["arena_bytes"].get<int64_t>();
    EXPECT_LE(arena, 8 * bucket + 3 * largest) << "rank " << rank << " writes " << written;
    if (written > 0) {
      EXPECT_LT(arena, written) << "rank " << rank;
    }
  }
}

struct Case {
  std::string name;
  std::function<nlohmann::json()> layout;
  std::vector<int64_t> file_limits;
  std::vector<std::string> extra;
};

class CheckpointSave : public ::testing::TestWithParam<Case> {};

TEST_P(CheckpointSave, DirectoryEqualsTheSourceForEveryFileLimit) {
  REQUIRE_UCX();
  const Case& c = GetParam();
  const std::string dir = temp_dir("save-" + c.name);
  const nlohmann::json layout_json = c.layout();
  const TrainerLayout layout = TrainerLayout::from_json(layout_json);
  const std::string trainer = write_layout(dir, layout_json);
  const std::string source = write_source(dir, layout);
  for (int64_t limit : c.file_limits) {
    std::vector<std::string> extra = c.extra;
    extra.insert(extra.end(), {"--max-file-bytes", std::to_string(limit)});
    const Export e = run_export(dir, source, trainer, extra);
    ASSERT_EQ(e.run.exit_code, 0) << "limit " << limit << ":\n" << e.run.output;
    ASSERT_TRUE(e.summary.is_object()) << e.run.output;
    EXPECT_TRUE(e.summary["ok"].get<bool>());
    EXPECT_EQ(e.summary["files"].get<size_t>(), make_hf_file_layout(layout, limit).files.size());
    expect_checkpoint(dir + "/out", source, layout, limit);
    expect_bounded_memory(e.summary, layout, limit, c.extra);
  }
  fs::remove_all(dir);
}

const std::vector<int64_t> kLimits = {1, 3000, kDefaultMaxFileBytes};

INSTANTIATE_TEST_SUITE_P(
    Layouts, CheckpointSave,
    ::testing::Values(
        // 12 ranks: fused, padded, interleaved, replicated, stacked, column shards.
        Case{"mixed_dp2_ep2_fsdp3", mixed_layout, {1, 150, kDefaultMaxFileBytes}, {}},
        // Nested EP then FSDP on fused experts; small buckets: many windows per writer.
        Case{"qwen3_moe_ep2_fsdp2",
             [] { return model_layout("tiny-qwen3-moe", "ep=2,fsdp=2"); },
             {20000, kDefaultMaxFileBytes},
             {"--bucket-bytes", "4096"}},
        // transformers >= 5 stacked experts, uneven FSDP over 3 ranks.
        Case{"qwen3_moe_stacked_fsdp3",
             [] {
               return model_layout("tiny-qwen3-moe", "fsdp=3", TrainerLayoutStyle::transformers);
             },
             kLimits,
             {}},
        // Padded vocab rows, replicated over dp.
        Case{"llama_dp2_fsdp3_padded",
             [] {
               return read_json(std::string(WEIGHTSYNC_SOURCE_DIR) +
                                "/configs/examples/trainer_tiny_llama_dp2_fsdp3_padded_vocab.json");
             },
             kLimits,
             {}},
        // Column shards and interleaved rows: packed and applied, not sent straight.
        Case{"llama_columns_fsdp2", column_layout, {5000}, {"--bucket-bytes", "2048"}},
        // The same through the page cache (SaveHfOptions::direct_io off).
        Case{"llama_columns_fsdp2_buffered_io",
             column_layout,
             {5000},
             {"--bucket-bytes", "2048", "--buffered-io"}},
        // One rank: nothing moves, every key written from its own shard.
        Case{"llama_one_rank", [] { return model_layout("tiny-llama", "fsdp=1"); }, {9000}, {}}),
    [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

TEST(CheckpointSaveFailure, RankKilledMidSaveFailsTheOthersAndLeavesNoIndex) {
  REQUIRE_UCX();
  const std::string dir = temp_dir("save-kill");
  const nlohmann::json layout_json = model_layout("tiny-qwen3-moe", "ep=2,fsdp=2");
  const TrainerLayout layout = TrainerLayout::from_json(layout_json);
  const std::string trainer = write_layout(dir, layout_json);
  const std::string source = write_source(dir, layout);
  // A complete save first: its index must go when the next save starts.
  const Export first = run_export(dir, source, trainer, {"--max-file-bytes", "20000"});
  ASSERT_EQ(first.run.exit_code, 0) << first.run.output;
  ASSERT_TRUE(fs::exists(dir + "/out/model.safetensors.index.json"));
  // Rank 2 frozen at its third send and killed: the command's failure drill,
  // a test hook (no option of it).
  ::setenv("WEIGHTSYNC_TEST_KILL", "2:3", 1);
  const Export e =
      run_export(dir, source, trainer, {"--max-file-bytes", "20000", "--bucket-bytes", "4096"});
  ::unsetenv("WEIGHTSYNC_TEST_KILL");
  EXPECT_EQ(e.run.exit_code, 1) << e.run.output;
  ASSERT_TRUE(e.summary.is_object()) << e.run.output;
  EXPECT_FALSE(e.summary["ok"].get<bool>());
  EXPECT_FALSE(fs::exists(dir + "/out/model.safetensors.index.json"));
  for (const auto& r : e.summary["per_rank"]) {
    const int rank = r["rank"].get<int>();
    if (rank == 2) {
      EXPECT_NE(r["status"].get<std::string>().find("signal 9"), std::string::npos) << r.dump();
      continue;
    }
    ASSERT_TRUE(r.contains("stats")) << r.dump();
    const std::string error = r["stats"].value("error", "");
    // Each survivor names the rank that died, directly or in the abort
    // another survivor sent.
    EXPECT_NE(error.find("trainer rank 2 left"), std::string::npos)
        << "rank " << rank << ": " << error;
    EXPECT_NE(error.find("save_hf to"), std::string::npos) << error;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace weightsync::e2e
