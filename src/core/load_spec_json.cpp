// TrainerLayout: the contract JSON (DESIGN.md) and its validation.
#include "load_spec_runs.h"

#include <weightsync/error.h>
#include <weightsync/json_fields.h>
#include <weightsync/load_spec.h>

#include <nlohmann/json.hpp>

#include <fstream>
#include <set>
#include <unordered_map>
#include <unordered_set>

namespace weightsync {
namespace {

using nlohmann::json;

// Field access that never falls back to a default on a type error.
const json& field(const json& obj, const char* name, const std::string& where) {
  auto it = obj.find(name);
  if (it == obj.end()) fail(Errc::format, where, ": missing field '", name, "'");
  return *it;
}

int64_t as_int(const json& v, const std::string& where) {
  if (!v.is_number_integer()) fail(Errc::format, where, ": expected an integer, got ", v.dump());
  return v.get<int64_t>();
}

std::string as_string(const json& v, const std::string& where) {
  if (!v.is_string()) fail(Errc::format, where, ": expected a string, got ", v.dump());
  return v.get<std::string>();
}

const json& as_array(const json& v, const std::string& where) {
  if (!v.is_array()) fail(Errc::format, where, ": expected an array, got ", v.dump());
  return v;
}

const json& as_object(const json& v, const std::string& where) {
  if (!v.is_object()) fail(Errc::format, where, ": expected an object");
  return v;
}

Shape as_shape(const json& v, const std::string& where) {
  Shape s;
  for (size_t i = 0; i < as_array(v, where).size(); ++i)
    s.push_back(as_int(v[i], cat(where, "[", i, "]")));
  return s;
}

ShardSpec parse_shard(const json& j, const std::string& where) {
  as_object(j, where);
  check_fields(j, {"dim", "axis", "interleave"}, where);
  ShardSpec s;
  s.dim = static_cast<int>(as_int(field(j, "dim", where), where + ".dim"));
  s.axis = as_string(field(j, "axis", where), where + ".axis");
  if (auto it = j.find("interleave"); it != j.end() && !it->is_null())
    s.interleave = as_int(*it, where + ".interleave");
  return s;
}

Box parse_box(const json& j, const std::string& where) {
  as_object(j, where);
  check_fields(j, {"offsets", "lengths"}, where);
  return {as_shape(field(j, "offsets", where), where + ".offsets"),
          as_shape(field(j, "lengths", where), where + ".lengths")};
}

// Segments name their key; the key list is hf_keys when given (each segment
// key must be in it), else the keys in order of first appearance.
void parse_segments(const json& j, LoadSpec& spec, const std::string& where) {
  as_array(j, where + ".segments");
  std::unordered_map<std::string, int> index;
  for (size_t k = 0; k < spec.hf_keys.size(); ++k)
    index.emplace(spec.hf_keys[k], static_cast<int>(k));
  const bool listed = !spec.hf_keys.empty();
  spec.segments.emplace();
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string at = cat(where, ".segments[", i, "]");
    as_object(j[i], at);
    check_fields(j[i], {"hf_key", "hf_box", "param_box"}, at);
    const std::string key = as_string(field(j[i], "hf_key", at), at + ".hf_key");
    auto it = index.find(key);
    if (it == index.end()) {
      if (listed)
        fail(Errc::invalid_layout, at, ".hf_key: '", key, "' is not in the param's hf_keys");
      it = index.emplace(key, static_cast<int>(spec.hf_keys.size())).first;
      spec.hf_keys.push_back(key);
    }
    spec.segments->push_back({it->second, parse_box(field(j[i], "hf_box", at), at + ".hf_box"),
                              parse_box(field(j[i], "param_box", at), at + ".param_box")});
  }
}

StageSpec parse_stage(const json& j, const std::string& where) {
  as_object(j, where);
  check_fields(j, {"axis", "index"}, where);
  return {as_string(field(j, "axis", where), where + ".axis"),
          as_int(field(j, "index", where), where + ".index")};
}

LoadSpec parse_param(const json& j, size_t index) {
  std::string where = cat("trainer layout: params[", index, "]");
  as_object(j, where);
  LoadSpec spec;
  spec.name = as_string(field(j, "name", where), where + ".name");
  where = cat("trainer layout: param '", spec.name, "'");
  check_fields(j,
               {"name", "hf_keys", "fused_dim", "stack_dim", "global_shape", "origin_shape",
                "dtype", "shards", "segments", "stage", "mirror_of"},
               where);
  auto segments = j.find("segments");
  const bool has_segments = segments != j.end() && !segments->is_null();
  // With segments, hf_keys may be left out (the segments name the keys).
  if (auto keys = j.find("hf_keys"); !has_segments || (keys != j.end() && !keys->is_null())) {
    const json& list = as_array(field(j, "hf_keys", where), where + ".hf_keys");
    for (size_t k = 0; k < list.size(); ++k)
      spec.hf_keys.push_back(as_string(list[k], cat(where, ".hf_keys[", k, "]")));
  }
  if (has_segments) parse_segments(*segments, spec, where);
  if (auto it = j.find("stage"); it != j.end() && !it->is_null())
    spec.stage = parse_stage(*it, where + ".stage");
  if (auto it = j.find("mirror_of"); it != j.end() && !it->is_null())
    spec.mirror_of = as_string(*it, where + ".mirror_of");
  if (auto it = j.find("fused_dim"); it != j.end() && !it->is_null())
    spec.fused_dim = static_cast<int>(as_int(*it, where + ".fused_dim"));
  if (auto it = j.find("stack_dim"); it != j.end() && !it->is_null())
    spec.stack_dim = static_cast<int>(as_int(*it, where + ".stack_dim"));
  spec.global_shape = as_shape(field(j, "global_shape", where), where + ".global_shape");
  if (auto it = j.find("origin_shape"); it != j.end() && !it->is_null())
    spec.origin_shape = as_shape(*it, where + ".origin_shape");
  else
    spec.origin_shape = spec.global_shape;
  const std::string dtype = as_string(field(j, "dtype", where), where + ".dtype");
  auto parsed = parse_dtype(dtype);
  if (!parsed)
    fail(Errc::invalid_layout, where, ".dtype: unknown dtype '", dtype,
         "' (expected a safetensors name such as BF16, F16, F32, F8_E4M3)");
  spec.dtype = *parsed;
  if (auto it = j.find("shards"); it != j.end() && !it->is_null()) {
    as_array(*it, where + ".shards");
    for (size_t i = 0; i < it->size(); ++i)
      spec.shards.push_back(parse_shard((*it)[i], cat(where, ".shards[", i, "]")));
  }
  return spec;
}

Mesh parse_mesh(const json& j) {
  const std::string where = "trainer layout: mesh";
  as_object(j, where);
  check_fields(j, {"axes", "shape"}, where);
  Mesh mesh;
  const json& axes = as_array(field(j, "axes", where), where + ".axes");
  for (size_t i = 0; i < axes.size(); ++i)
    mesh.axes.push_back(as_string(axes[i], cat(where, ".axes[", i, "]")));
  mesh.shape = as_shape(field(j, "shape", where), where + ".shape");
  return mesh;
}

void validate_mesh(const Mesh& mesh) {
  if (mesh.axes.size() != mesh.shape.size())
    fail(Errc::invalid_layout, "trainer layout: mesh has ", mesh.axes.size(), " axes but shape ",
         shape_str(mesh.shape), " has ", mesh.shape.size(), " sizes");
  std::set<std::string> seen;
  for (size_t i = 0; i < mesh.axes.size(); ++i) {
    if (mesh.axes[i].empty())
      fail(Errc::invalid_layout, "trainer layout: mesh axis ", i, " has no name");
    if (!seen.insert(mesh.axes[i]).second)
      fail(Errc::invalid_layout, "trainer layout: mesh axis '", mesh.axes[i], "' listed twice");
    if (mesh.shape[i] <= 0)
      fail(Errc::invalid_layout, "trainer layout: mesh axis '", mesh.axes[i], "' has size ",
           mesh.shape[i], " (expected > 0)");
  }
}

// Every extent a shard may cut on its dim, over all ranks: a plain shard of n
// leaves full chunks, one remainder and empty tails, so the set stays small.
std::set<int64_t> next_extents(const std::set<int64_t>& extents, int64_t w, int64_t interleave) {
  std::set<int64_t> out;
  for (int64_t n : extents) {
    if (interleave > 1) {
      out.insert(n / w);
      continue;
    }
    const int64_t chunk = (n + w - 1) / w;
    if (chunk == 0) {
      out.insert(0);
      continue;
    }
    const int64_t full = n / chunk;
    if (full > 0) out.insert(chunk);
    if (full < w) out.insert(n - full * chunk);
    if (full + 1 < w) out.insert(0);
  }
  return out;
}

void validate_shards(const LoadSpec& spec, const Mesh& mesh, const std::string& where) {
  std::vector<std::set<int64_t>> extents(spec.global_shape.size());
  for (size_t d = 0; d < extents.size(); ++d) extents[d] = {spec.global_shape[d]};
  std::set<std::string> used;
  for (size_t i = 0; i < spec.shards.size(); ++i) {
    const ShardSpec& s = spec.shards[i];
    const std::string at = cat(where, ": shards[", i, "]");
    const int a = mesh.axis_index(s.axis);
    if (a < 0) {
      std::string known;
      for (const auto& ax : mesh.axes) known += (known.empty() ? "" : ", ") + ax;
      fail(Errc::invalid_layout, at, ".axis: unknown mesh axis '", s.axis, "' (mesh axes: ", known,
           ")");
    }
    if (!used.insert(s.axis).second)
      fail(Errc::invalid_layout, at, ".axis: axis '", s.axis, "' used twice in one param");
    if (s.dim < 0 || static_cast<size_t>(s.dim) >= spec.global_shape.size())
      fail(Errc::invalid_layout, at, ".dim: ", s.dim, " out of range for global_shape ",
           shape_str(spec.global_shape));
    if (s.interleave < 1)
      fail(Errc::invalid_layout, at, ".interleave: ", s.interleave, " (expected >= 1)");
    const int64_t w = mesh.shape[a];
    for (int64_t n : extents[s.dim])
      if (s.interleave > 1 && n % (w * s.interleave) != 0)
        fail(Errc::invalid_layout, at, ".interleave: ", s.interleave, " over axis '", s.axis,
             "' of size ", w, " needs the extent of dim ", s.dim, " divisible by ",
             w * s.interleave, ", but a rank cuts an extent of ", n);
    extents[s.dim] = next_extents(extents[s.dim], w, s.interleave);
  }
}

void validate_shapes(const LoadSpec& spec, const std::string& where) {
  for (int64_t d : spec.global_shape)
    if (d < 0)
      fail(Errc::invalid_layout, where, ": global_shape ", shape_str(spec.global_shape),
           " has a negative dim");
  const Shape& origin = spec.origin_shape.empty() ? spec.global_shape : spec.origin_shape;
  if (origin.size() != spec.global_shape.size())
    fail(Errc::invalid_layout, where, ": origin_shape ", shape_str(origin),
         " has another rank than global_shape ", shape_str(spec.global_shape));
  for (size_t d = 0; d < origin.size(); ++d)
    if (origin[d] < 0 || origin[d] > spec.global_shape[d])
      fail(Errc::invalid_layout, where, ": origin_shape ", shape_str(origin),
           " must lie within global_shape ", shape_str(spec.global_shape), " (dim ", d, ")");
}

// Stacked keys (load_spec.h): dim 0 of the global tensor indexes entries of
// keys_per_entry() keys each; the HF tensors lack that dim.
void validate_stack(const LoadSpec& spec, const std::string& where) {
  const int sd = *spec.stack_dim;
  if (sd != 0)
    fail(Errc::invalid_layout, where, ": stack_dim ", sd,
         " is not supported (only 0: keys stacked along the leading dim)");
  const Shape& origin = spec.origin_shape.empty() ? spec.global_shape : spec.origin_shape;
  if (origin.size() < 2)
    fail(Errc::invalid_layout, where,
         ": stack_dim 0 needs a global tensor of at least 2 dims, got ",
         shape_str(spec.global_shape));
  const auto nkeys = static_cast<int64_t>(spec.hf_keys.size());
  if (origin[0] < 1 || nkeys % origin[0] != 0)
    fail(Errc::invalid_layout, where, ": ", nkeys, " hf_keys are not a whole number per entry of ",
         "the ", origin[0], " stacked along dim 0 of origin_shape ", shape_str(origin));
  const int64_t per_entry = nkeys / origin[0];
  if (!spec.fused_dim) {
    if (per_entry > 1)
      fail(Errc::invalid_layout, where, ": ", per_entry,
           " hf_keys per stacked entry need a fused_dim to be fused along");
    return;
  }
  const int fd = *spec.fused_dim;
  if (per_entry == 1)
    fail(Errc::invalid_layout, where, ": fused_dim ", fd,
         " is set but each stacked entry holds one hf_key (use null)");
  if (fd < 1 || static_cast<size_t>(fd) >= origin.size())
    fail(Errc::invalid_layout, where, ": fused_dim ", fd, " must be a dim after stack_dim 0 of ",
         "global_shape ", shape_str(spec.global_shape));
  if (origin[fd] % per_entry != 0)
    fail(Errc::invalid_layout, where, ": ", per_entry, " hf_keys per entry do not divide the ",
         "fused extent ", origin[fd], " of origin_shape ", shape_str(origin), " (dim ", fd, ")");
}

void validate_keys(const LoadSpec& spec, const std::string& where) {
  if (spec.segments) return detail::validate_segments(spec, where);
  if (spec.hf_keys.empty()) fail(Errc::invalid_layout, where, ": hf_keys is empty");
  if (spec.stack_dim) return validate_stack(spec, where);
  const size_t nkeys = spec.hf_keys.size();
  if (!spec.fused_dim) {
    if (nkeys > 1)
      fail(Errc::invalid_layout, where, ": fused_dim is null but there are ", nkeys,
           " hf_keys (several keys need the dim they are fused along)");
    return;
  }
  const int fd = *spec.fused_dim;
  if (nkeys == 1)
    fail(Errc::invalid_layout, where, ": fused_dim ", fd,
         " is set but there is one hf_key (use null)");
  if (fd < 0 || static_cast<size_t>(fd) >= spec.global_shape.size())
    fail(Errc::invalid_layout, where, ": fused_dim ", fd, " out of range for global_shape ",
         shape_str(spec.global_shape));
  const Shape& origin = spec.origin_shape.empty() ? spec.global_shape : spec.origin_shape;
  if (origin[fd] % static_cast<int64_t>(nkeys) != 0)
    fail(Errc::invalid_layout, where, ": ", nkeys, " hf_keys do not divide the fused extent ",
         origin[fd], " of origin_shape ", shape_str(origin), " (dim ", fd, ")");
}

void validate_stage(const LoadSpec& spec, const Mesh& mesh, const std::string& where) {
  const StageSpec& st = *spec.stage;
  const int a = mesh.axis_index(st.axis);
  if (a < 0) fail(Errc::invalid_layout, where, ": stage.axis: '", st.axis, "' is not a mesh axis");
  if (st.index < 0 || st.index >= mesh.shape[static_cast<size_t>(a)])
    fail(Errc::invalid_layout, where, ": stage.index ", st.index, " out of range for axis '",
         st.axis, "' of size ", mesh.shape[static_cast<size_t>(a)]);
  for (const ShardSpec& s : spec.shards)
    if (s.axis == st.axis)
      fail(Errc::invalid_layout, where, ": shards over its stage axis '", st.axis,
           "' (a param on one stage is sharded or replicated inside it)");
}

// Names identify a param on a rank: several params may share one only when
// they live on different stages of one axis.
class NameCheck {
 public:
  explicit NameCheck(size_t n) { first_.reserve(n); }
  void add(const LoadSpec& spec, const std::string& where) {
    auto [it, fresh] = first_.emplace(spec.name, &spec);
    if (fresh) return;
    const LoadSpec& prev = *it->second;
    if (!prev.stage || !spec.stage || prev.stage->axis != spec.stage->axis)
      fail(Errc::invalid_layout, where, ": name used by two params (a name may repeat only ",
           "on different stages of one axis)");
    staged_.emplace(prev.name, prev.stage->index);  // no-op after the name's first repeat
    if (!staged_.emplace(spec.name, spec.stage->index).second)
      fail(Errc::invalid_layout, where, ": name used by two params on stage ", spec.stage->index,
           " of axis '", spec.stage->axis, "'");
  }

 private:
  std::unordered_map<std::string_view, const LoadSpec*> first_;
  std::set<std::pair<std::string_view, int64_t>> staged_;
};

json box_json(const Box& b) {
  return {{"offsets", b.offsets}, {"lengths", b.lengths}};
}

json segments_json(const LoadSpec& p) {
  json out = json::array();
  for (const LoadSegment& s : *p.segments)
    out.push_back({{"hf_key", p.hf_keys.at(static_cast<size_t>(s.key))},
                   {"hf_box", box_json(s.hf_box)},
                   {"param_box", box_json(s.param_box)}});
  return out;
}

}  // namespace

TrainerLayout TrainerLayout::from_json(const json& j) {
  as_object(j, "trainer layout");
  check_fields(j, {"mesh", "params"}, "trainer layout");
  TrainerLayout layout;
  layout.mesh = parse_mesh(field(j, "mesh", "trainer layout"));
  const json& params = as_array(field(j, "params", "trainer layout"), "trainer layout: params");
  layout.params.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) layout.params.push_back(parse_param(params[i], i));
  layout.validate();
  return layout;
}

TrainerLayout TrainerLayout::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(Errc::io, "cannot open trainer layout '", path, "'");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail(Errc::format, "trainer layout '", path, "' is not valid JSON: ", e.what());
  }
  try {
    return from_json(j);
  } catch (const Error& e) {
    fail(e.code(), e.what(), " (in '", path, "')");
  }
}

json TrainerLayout::to_json() const {
  json out = json::array();
  for (const LoadSpec& p : params) {
    json shards = json::array();
    for (const ShardSpec& s : p.shards) {
      json sj = {{"dim", s.dim}, {"axis", s.axis}};
      if (s.interleave != 1) sj["interleave"] = s.interleave;
      shards.push_back(std::move(sj));
    }
    json pj = {{"name", p.name},
               {"hf_keys", p.hf_keys},
               {"fused_dim", p.fused_dim ? json(*p.fused_dim) : json(nullptr)},
               {"global_shape", p.global_shape}};
    if (p.stack_dim) pj["stack_dim"] = *p.stack_dim;
    if (!p.origin_shape.empty() && p.origin_shape != p.global_shape)
      pj["origin_shape"] = p.origin_shape;
    pj["dtype"] = std::string(dtype_name(p.dtype));
    pj["shards"] = std::move(shards);
    if (p.segments) pj["segments"] = segments_json(p);
    if (p.stage) pj["stage"] = {{"axis", p.stage->axis}, {"index", p.stage->index}};
    if (p.mirror_of) pj["mirror_of"] = *p.mirror_of;
    out.push_back(std::move(pj));
  }
  return json{{"mesh", {{"axes", mesh.axes}, {"shape", mesh.shape}}}, {"params", std::move(out)}};
}

void TrainerLayout::validate() const {
  validate_mesh(mesh);
  // Views into the params: no copies of tens of thousands of key strings.
  NameCheck names(params.size());
  std::unordered_map<std::string_view, const std::string*> key_owner;
  size_t nkeys = 0;
  for (const LoadSpec& spec : params) nkeys += spec.hf_keys.size();
  key_owner.reserve(nkeys);
  for (const LoadSpec& spec : params) {
    const std::string where = cat("trainer layout: param '", spec.name, "'");
    if (spec.name.empty()) fail(Errc::invalid_layout, "trainer layout: a param has an empty name");
    names.add(spec, where);
    if (spec.stage) validate_stage(spec, mesh, where);
    validate_shapes(spec, where);
    validate_keys(spec, where);
    for (const std::string& key : spec.hf_keys) {
      auto [it, fresh] = key_owner.emplace(key, &spec.name);
      if (!fresh)
        fail(Errc::invalid_layout, where, ": hf_key '", key, "' is already used by param '",
             *it->second, "'");
    }
    validate_shards(spec, mesh, where);
  }
  for (const LoadSpec& spec : params) {
    if (!spec.mirror_of) continue;
    const std::string where = cat("trainer layout: param '", spec.name, "'");
    if (!spec.segments || !spec.segments->empty() || !spec.hf_keys.empty())
      fail(Errc::invalid_layout, where, ": mirror_of '", *spec.mirror_of,
           "' needs \"segments\": [] and no hf_keys (a mirror holds no HF content of its own)");
    if (!key_owner.contains(*spec.mirror_of))
      fail(Errc::invalid_layout, where, ": mirror_of '", *spec.mirror_of,
           "' names an HF key that no param of the layout holds");
  }
}

std::vector<size_t> TrainerLayout::rank_params(int64_t rank) const {
  std::vector<size_t> out;
  out.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i)
    if (holds(params[i], mesh, rank)) out.push_back(i);
  return out;
}

}  // namespace weightsync
