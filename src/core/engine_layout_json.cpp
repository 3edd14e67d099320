// The JSON form of rank layouts (weightsync engine-layout --json writes it)
// and of the rank layouts a live engine derived from its own loader
// (python/weightsync/_derive.py; framework "derived" carries them in the
// engine config); and engine configs as JSON (hf_config inline; reading one
// is the layouts library's, src/layouts/engine_config.cpp, which knows the
// frameworks).
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/json_fields.h>

#include <nlohmann/json.hpp>

#include <set>
#include <string>

namespace weightsync {
namespace {

using nlohmann::json;

json box_json(const Box& b) {
  return {{"offsets", b.offsets}, {"lengths", b.lengths}};
}

const json& member(const json& j, const char* name, const std::string& where) {
  if (!j.is_object()) fail(Errc::format, where, ": expected a JSON object");
  auto it = j.find(name);
  if (it == j.end()) fail(Errc::format, where, ": missing field '", name, "'");
  return *it;
}

Shape shape_of(const json& j, const std::string& where) {
  if (!j.is_array()) fail(Errc::format, where, ": expected an array of integers");
  Shape out;
  for (const json& v : j) {
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
      fail(Errc::format, where, ": expected non-negative integers, got ", v.dump());
    out.push_back(v.get<int64_t>());
  }
  return out;
}

Box box_of(const json& j, const std::string& where) {
  check_fields(j, {"offsets", "lengths"}, where);
  Box b{shape_of(member(j, "offsets", where), where + ".offsets"),
        shape_of(member(j, "lengths", where), where + ".lengths")};
  if (b.offsets.size() != b.lengths.size())
    fail(Errc::format, where, ": ", b.offsets.size(), " offsets but ", b.lengths.size(),
         " lengths");
  return b;
}

DType dtype_of(const json& j, const std::string& where) {
  if (!j.is_string()) fail(Errc::format, where, ": expected a dtype name");
  return dtype_from_name(j.get<std::string>(), where);
}

std::string string_of(const json& j, const std::string& where) {
  if (!j.is_string() || j.get<std::string>().empty())
    fail(Errc::format, where, ": expected a non-empty string");
  return j.get<std::string>();
}

}  // namespace

json rank_layout_to_json(const EngineRankLayout& rank) {
  json params = json::array();
  for (const auto& p : rank.params) {
    json segs = json::array();
    for (const auto& s : p.segments)
      segs.push_back({{"hf_key", s.hf_key},
                      {"hf_box", box_json(s.hf_box)},
                      {"param_box", box_json(s.param_box)},
                      {"transpose", s.transpose}});
    json one = {{"name", p.name},
                {"dtype", std::string(dtype_name(p.dtype))},
                {"shape", p.shape},
                {"segments", std::move(segs)}};
    // FP8 engines: a quantized weight names its scale param and back.
    if (p.quant)
      one["quantization"] = {
          {"weight_block_size", {p.quant->block_rows, p.quant->block_cols}},
          {"scale", std::string(scale_format_name(p.quant->scale))},
          {"scale_param", rank.params.at(static_cast<size_t>(p.scale_param)).name}};
    if (p.scale_of >= 0) one["scale_of"] = rank.params.at(static_cast<size_t>(p.scale_of)).name;
    params.push_back(std::move(one));
  }
  return {{"rank", rank.rank}, {"params", std::move(params)}};
}

EngineRankLayout rank_layout_from_json(const json& j) {
  EngineRankLayout rank;
  const json& r = member(j, "rank", "rank layout");
  if (!r.is_number_integer() || r.get<int64_t>() < 0)
    fail(Errc::format, "rank layout: field 'rank' must be a non-negative integer");
  rank.rank = r.get<int>();
  const std::string where = cat("rank ", rank.rank);
  check_fields(j, {"rank", "params"}, cat("rank layout ", rank.rank));
  const json& params = member(j, "params", where);
  if (!params.is_array()) fail(Errc::format, where, ": field 'params' must be an array");
  std::set<std::string> names;
  for (size_t i = 0; i < params.size(); ++i) {
    const json& pj = params[i];
    EngineParam p;
    p.name = string_of(member(pj, "name", cat(where, " param ", i)), cat(where, " param ", i));
    const std::string at = cat(where, " param '", p.name, "'");
    if (!names.insert(p.name).second) fail(Errc::format, at, ": named twice");
    check_fields(pj, {"name", "dtype", "shape", "segments", "quantization", "scale_of"}, at);
    if (pj.contains("quantization") || pj.contains("scale_of"))
      fail(Errc::unsupported, at, ": FP8 params are not taken from JSON (FP8 engines use the ",
           "vllm or sglang tables)");
    p.dtype = dtype_of(member(pj, "dtype", at), at + ".dtype");
    p.shape = shape_of(member(pj, "shape", at), at + ".shape");
    const json& segs = member(pj, "segments", at);
    if (!segs.is_array()) fail(Errc::format, at, ": field 'segments' must be an array");
    for (size_t k = 0; k < segs.size(); ++k) {
      const std::string sat = cat(at, " segment ", k);
      check_fields(segs[k], {"hf_key", "hf_box", "param_box", "transpose"}, sat);
      Segment s;
      s.hf_key = string_of(member(segs[k], "hf_key", sat), sat + ".hf_key");
      s.hf_box = box_of(member(segs[k], "hf_box", sat), sat + ".hf_box");
      s.param_box = box_of(member(segs[k], "param_box", sat), sat + ".param_box");
      auto t = segs[k].find("transpose");
      if (t != segs[k].end()) {
        if (!t->is_boolean()) fail(Errc::format, sat, ": field 'transpose' must be a boolean");
        s.transpose = t->get<bool>();
      }
      p.segments.push_back(std::move(s));
    }
    rank.params.push_back(std::move(p));
  }
  return rank;
}

std::shared_ptr<const DerivedLayout> derived_layout_from_json(const json& j, int tp) {
  auto out = std::make_shared<DerivedLayout>();
  const std::string where = "engine config (derived)";
  check_fields(j, {"tensors", "ranks"}, where);
  const json& tensors = member(j, "tensors", where);
  if (!tensors.is_array() || tensors.empty())
    fail(Errc::format, where, ": field 'tensors' must be a non-empty array");
  std::set<std::string> keys;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string at = cat(where, " tensor ", i);
    check_fields(tensors[i], {"key", "shape", "dtype"}, at);
    HfTensorSpec t;
    t.key = string_of(member(tensors[i], "key", at), at + ".key");
    if (!keys.insert(t.key).second) fail(Errc::format, where, ": HF tensor '", t.key, "' twice");
    t.shape = shape_of(member(tensors[i], "shape", at), at + ".shape");
    t.dtype = dtype_of(member(tensors[i], "dtype", at), at + ".dtype");
    out->tensors.push_back(std::move(t));
  }
  const json& ranks = member(j, "ranks", where);
  if (!ranks.is_array() || ranks.size() != static_cast<size_t>(tp))
    fail(Errc::invalid_layout, where, ": field 'ranks' must hold tp=", tp, " rank layouts, got ",
         ranks.is_array() ? ranks.size() : 0);
  for (size_t r = 0; r < ranks.size(); ++r) {
    EngineRankLayout rank = rank_layout_from_json(ranks[r]);
    if (rank.rank != static_cast<int>(r))
      fail(Errc::invalid_layout, where, ": ranks[", r, "] says it is rank ", rank.rank);
    out->ranks.push_back(std::move(rank));
  }
  return out;
}

json derived_layout_to_json(const DerivedLayout& d) {
  json tensors = json::array();
  for (const auto& t : d.tensors)
    tensors.push_back(
        {{"key", t.key}, {"shape", t.shape}, {"dtype", std::string(dtype_name(t.dtype))}});
  json ranks = json::array();
  for (const auto& r : d.ranks) ranks.push_back(rank_layout_to_json(r));
  return {{"tensors", std::move(tensors)}, {"ranks", std::move(ranks)}};
}

std::vector<HfTensorSpec> engine_hf_tensors(const EngineConfig& config) {
  if (config.framework == "derived") {
    if (!config.derived)
      fail(Errc::invalid_layout, "engine config: framework \"derived\" without its layout");
    return config.derived->tensors;
  }
  return hf_tensors(config.hf);
}

json EngineSpec::to_json() const {
  if (groups.size() == 1) return groups[0].to_json();
  json out = json::array();
  for (const EngineConfig& g : groups) out.push_back(g.to_json());
  return out;
}

json EngineConfig::to_json() const {
  json j = {{"framework", framework},
            {"hf_config", hf.raw()},
            {"tp", tp},
            {"expert_parallel", expert_parallel},
            {"expert_placement", expert_placement},
            {"replicas", replicas},
            {"dtype", std::string(dtype_name(dtype))}};
  if (moe_order != "w13") j["moe_order"] = moe_order;
  if (derived) j["derived"] = derived_layout_to_json(*derived);
  if (quantization)
    j["quantization"] = {
        {"method", "fp8"},
        {"weight_block_size", {quantization->block_rows, quantization->block_cols}},
        {"scale", std::string(scale_format_name(quantization->scale))}};
  return j;
}

}  // namespace weightsync
