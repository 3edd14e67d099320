// TrainerLayout validation: every bad layout is a clear Error naming the param
// and the field, one test per rule.
#include <weightsync/error.h>
#include <weightsync/load_spec.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <functional>

namespace weightsync {
namespace {

using nlohmann::json;

// A valid layout to break one field at a time.
json good_layout() {
  return json::parse(R"({
    "mesh": {"axes": ["ep", "fsdp"], "shape": [2, 4]},
    "params": [
      {"name": "experts", "hf_keys": ["e0.gate", "e0.up", "e1.gate", "e1.up"], "fused_dim": 0,
       "global_shape": [16, 8], "dtype": "BF16",
       "shards": [{"dim": 0, "axis": "ep"}, {"dim": 0, "axis": "fsdp"}]},
      {"name": "embed", "hf_keys": ["embed"], "fused_dim": null, "global_shape": [10, 8],
       "dtype": "BF16", "shards": [{"dim": 0, "axis": "fsdp"}]}
    ]})");
}

// Parses `j` and expects an Error of `code` whose message holds every `parts`.
void expect_error(const json& j, Errc code, std::vector<std::string> parts) {
  try {
    TrainerLayout::from_json(j);
    FAIL() << "expected an error for " << j.dump();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message '" << e.what() << "' lacks '" << p << "'";
  }
}

json with(std::function<void(json&)> edit) {
  json j = good_layout();
  edit(j);
  return j;
}

TEST(TrainerLayoutValidate, GoodLayoutParses) {
  EXPECT_NO_THROW(TrainerLayout::from_json(good_layout()));
}

TEST(TrainerLayoutValidate, UnknownAxis) {
  expect_error(with([](json& j) { j["params"][1]["shards"][0]["axis"] = "tp"; }),
               Errc::invalid_layout, {"'embed'", "shards[0].axis", "'tp'"});
}

TEST(TrainerLayoutValidate, ShardDimOutOfRange) {
  expect_error(with([](json& j) { j["params"][1]["shards"][0]["dim"] = 2; }), Errc::invalid_layout,
               {"'embed'", "shards[0].dim", "2"});
  expect_error(with([](json& j) { j["params"][1]["shards"][0]["dim"] = -1; }), Errc::invalid_layout,
               {"'embed'", "dim"});
}

TEST(TrainerLayoutValidate, AxisUsedTwiceInOneParam) {
  expect_error(with([](json& j) { j["params"][0]["shards"][1]["axis"] = "ep"; }),
               Errc::invalid_layout, {"'experts'", "shards[1]", "used twice"});
}

TEST(TrainerLayoutValidate, InterleaveThatDoesNotDivide) {
  // 10 rows over fsdp=4 with interleave 2 needs a multiple of 8.
  expect_error(with([](json& j) { j["params"][1]["shards"][0]["interleave"] = 2; }),
               Errc::invalid_layout, {"'embed'", "interleave", "8", "10"});
  // After ep (16 -> 8 rows), interleave 2 over fsdp=4 divides: fine.
  EXPECT_NO_THROW(TrainerLayout::from_json(
      with([](json& j) { j["params"][0]["shards"][1]["interleave"] = 2; })));
  // After an uneven fsdp cut (14 rows over 4: 4, 4, 4, 2), interleave 2 over ep needs
  // multiples of 4: the last rank's 2 rows fail, though the others divide.
  auto uneven = [](int64_t rows) {
    return with([rows](json& j) {
      j["params"][1]["shards"].push_back({{"dim", 0}, {"axis", "ep"}, {"interleave", 2}});
      j["params"][1]["global_shape"] = {rows, 8};
    });
  };
  expect_error(uneven(14), Errc::invalid_layout, {"'embed'", "shards[1].interleave", "of 2"});
  EXPECT_NO_THROW(TrainerLayout::from_json(uneven(16)));
  expect_error(with([](json& j) { j["params"][1]["shards"][0]["interleave"] = 0; }),
               Errc::invalid_layout, {"'embed'", "interleave"});
}

TEST(TrainerLayoutValidate, OriginLargerThanGlobal) {
  expect_error(with([](json& j) {
                 j["params"][1]["origin_shape"] = {11, 8};
               }),
               Errc::invalid_layout, {"'embed'", "origin_shape", "[11, 8]", "[10, 8]"});
}

TEST(TrainerLayoutValidate, OriginOfAnotherRank) {
  expect_error(with([](json& j) { j["params"][1]["origin_shape"] = {10}; }), Errc::invalid_layout,
               {"'embed'", "origin_shape"});
}

TEST(TrainerLayoutValidate, FusedDimWithOneKey) {
  expect_error(with([](json& j) { j["params"][1]["fused_dim"] = 0; }), Errc::invalid_layout,
               {"'embed'", "fused_dim", "one hf_key"});
}

TEST(TrainerLayoutValidate, SeveralKeysWithoutFusedDim) {
  expect_error(with([](json& j) { j["params"][0]["fused_dim"] = nullptr; }), Errc::invalid_layout,
               {"'experts'", "fused_dim"});
  expect_error(with([](json& j) { j["params"][0].erase("fused_dim"); }), Errc::invalid_layout,
               {"'experts'", "fused_dim"});
}

TEST(TrainerLayoutValidate, KeysThatDoNotDivideTheFusedExtent) {
  expect_error(with([](json& j) {
                 j["params"][0]["global_shape"] = {18, 8};
               }),
               Errc::invalid_layout, {"'experts'", "4 hf_keys", "18"});
  // The unpadded extent is what the keys split.
  expect_error(with([](json& j) {
                 j["params"][0]["origin_shape"] = {15, 8};
               }),
               Errc::invalid_layout, {"'experts'", "15"});
}

TEST(TrainerLayoutValidate, FusedDimOutOfRange) {
  expect_error(with([](json& j) { j["params"][0]["fused_dim"] = 2; }), Errc::invalid_layout,
               {"'experts'", "fused_dim 2"});
}

TEST(TrainerLayoutValidate, DuplicateParamNames) {
  expect_error(with([](json& j) { j["params"][1]["name"] = "experts"; }), Errc::invalid_layout,
               {"'experts'", "two params"});
}

TEST(TrainerLayoutValidate, HfKeyUsedTwice) {
  expect_error(with([](json& j) { j["params"][1]["hf_keys"] = {"e1.up"}; }), Errc::invalid_layout,
               {"'embed'", "'e1.up'", "'experts'"});
  expect_error(with([](json& j) { j["params"][0]["hf_keys"][3] = "e0.gate"; }),
               Errc::invalid_layout, {"'experts'", "'e0.gate'"});
}

TEST(TrainerLayoutValidate, UnknownDtype) {
  expect_error(with([](json& j) { j["params"][1]["dtype"] = "float32"; }), Errc::invalid_layout,
               {"'embed'", "dtype", "float32"});
}

TEST(TrainerLayoutValidate, EmptyHfKeys) {
  expect_error(with([](json& j) { j["params"][1]["hf_keys"] = json::array(); }),
               Errc::invalid_layout, {"'embed'", "hf_keys"});
}

TEST(TrainerLayoutValidate, NonPositiveMeshSize) {
  expect_error(with([](json& j) { j["mesh"]["shape"][1] = 0; }), Errc::invalid_layout,
               {"mesh", "'fsdp'", "0"});
  expect_error(with([](json& j) { j["mesh"]["shape"][0] = -2; }), Errc::invalid_layout,
               {"mesh", "'ep'"});
}

TEST(TrainerLayoutValidate, MeshAxesAndShapeOfDifferentLengths) {
  expect_error(with([](json& j) { j["mesh"]["shape"] = {2}; }), Errc::invalid_layout,
               {"mesh", "2 axes"});
}

TEST(TrainerLayoutValidate, NegativeGlobalDim) {
  expect_error(with([](json& j) {
                 j["params"][1]["global_shape"] = {-1, 8};
               }),
               Errc::invalid_layout, {"'embed'", "global_shape"});
}

TEST(TrainerLayoutValidate, WrongJsonTypesAreFormatErrors) {
  expect_error(json::array(), Errc::format, {"trainer layout"});
  expect_error(with([](json& j) { j.erase("mesh"); }), Errc::format, {"'mesh'"});
  expect_error(with([](json& j) { j["mesh"]["shape"] = "2x4"; }), Errc::format, {"mesh.shape"});
  expect_error(with([](json& j) { j["params"][1]["global_shape"][0] = "10"; }), Errc::format,
               {"'embed'", "global_shape[0]"});
  expect_error(with([](json& j) { j["params"][1]["hf_keys"] = "embed"; }), Errc::format,
               {"'embed'", "hf_keys"});
  expect_error(with([](json& j) { j["params"][1]["fused_dim"] = "0"; }), Errc::format,
               {"'embed'", "fused_dim"});
  expect_error(with([](json& j) { j["params"][1]["shards"][0]["dim"] = 0.5; }), Errc::format,
               {"'embed'", "shards[0].dim"});
  expect_error(with([](json& j) { j["params"][1]["name"] = 3; }), Errc::format, {"params[1].name"});
  expect_error(with([](json& j) { j["params"][1].erase("dtype"); }), Errc::format,
               {"'embed'", "'dtype'"});
}

TEST(TrainerLayoutValidate, LoadNamesTheFile) {
  try {
    TrainerLayout::load("/nonexistent/trainer.json");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::io);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/trainer.json"), std::string::npos);
  }
}

}  // namespace
}  // namespace weightsync
