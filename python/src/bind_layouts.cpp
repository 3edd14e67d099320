// Layouts and plans: what the package needs to describe tensors and engines.
#include "bindings.h"

#include <nlohmann/json.hpp>

#include <weightsync/engine_layout.h>
#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>
#include <weightsync/load_spec.h>
#include <weightsync/plan.h>
#include <weightsync/topology.h>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <tuple>

namespace weightsync::python {
namespace {

using ParamInfo = std::tuple<std::string, std::string, Shape>;

EngineSpec engine_spec(const std::string& text, const std::string& base_dir) {
  return engine_spec_from_json(parse_json(text, "engine config"), base_dir);
}

TrainerLayout trainer_layout(const std::string& text) {
  return TrainerLayout::from_json(parse_json(text, "trainer layout"));
}

std::vector<ParamInfo> engine_params(const std::string& text, const std::string& base_dir,
                                     int replica, int rank) {
  const EngineLayout layout = make_engine_layout(engine_spec(text, base_dir));
  std::vector<ParamInfo> out;
  for (const EngineParam& p : layout.rank_layout(layout.global_rank(replica, rank)).params)
    out.emplace_back(p.name, std::string(dtype_name(p.dtype)), p.shape);
  return out;
}

// FP8 engines: "N of M linear weights FP8, scales <format>" for an engine
// rank, and where its quantization comes from ("" for both when none).
std::tuple<std::string, std::string> engine_fp8_summary(const std::string& text,
                                                        const std::string& base_dir, int replica,
                                                        int rank) {
  const EngineLayout layout = make_engine_layout(engine_spec(text, base_dir));
  const int global = layout.global_rank(replica, rank);
  return {fp8_summary(layout.rank_layout(global)), fp8_source(layout.group_of(global).config)};
}

std::string engine_config_json(const std::string& text, const std::string& base_dir) {
  return engine_spec(text, base_dir).to_json().dump();
}

std::string check_trainer_layout(const std::string& text) {
  return trainer_layout(text).to_json().dump();
}

// Names are unique per rank (pipeline stages repeat local layer names).
Shape layout_local_shape(const std::string& text, const std::string& name, int64_t rank) {
  const TrainerLayout layout = trainer_layout(text);
  for (size_t p : layout.rank_params(rank))
    if (layout.params[p].name == name) return local_shape(layout.params[p], layout.mesh, rank);
  fail(Errc::not_found, "param '", name, "' is not in the trainer layout of rank ", rank);
}

std::vector<std::string> rank_param_names(const std::string& text, int64_t rank) {
  const TrainerLayout layout = trainer_layout(text);
  if (rank < 0 || rank >= layout.mesh.world())
    fail(Errc::invalid_argument, "rank ", rank, " outside the trainer mesh ",
         shape_str(layout.mesh.shape));
  std::vector<std::string> out;
  for (size_t p : layout.rank_params(rank)) out.push_back(layout.params[p].name);
  return out;
}

std::tuple<std::vector<std::string>, std::optional<int>, std::optional<int>> transformers_keys(
    const std::string& model_type, const std::string& name, const Shape& shape) {
  TransformersParam p = transformers_param(model_type, name, shape);
  return {std::move(p.hf_keys), p.fused_dim, p.stack_dim};
}

// Style megatron reads `mesh` as Megatron's parallel sizes ("pp=2,tp=2,...");
// the last three arguments are its MegatronOptions.
std::string generate_trainer_layout(const std::string& hf_config, const std::string& mesh,
                                    const std::string& style, std::optional<std::string> dtype,
                                    int64_t vocab_divisible_by,
                                    std::optional<int64_t> first_stage_layers,
                                    std::optional<int64_t> last_stage_layers) {
  TrainerLayoutOptions options;
  options.style = parse_trainer_layout_style(style);
  if (dtype) options.dtype = dtype_from_name(*dtype, "dtype");
  options.megatron.vocab_divisible_by = vocab_divisible_by;
  options.megatron.first_stage_layers = first_stage_layers;
  options.megatron.last_stage_layers = last_stage_layers;
  const HfModelConfig config = HfModelConfig::from_json(parse_json(hf_config, "HF config"));
  return make_trainer_layout(config, parse_mesh_spec(mesh), options).to_json().dump();
}

std::string plan_summary(const std::string& trainer, const std::string& engine,
                         const std::string& base_dir, const std::string& mode, int64_t bucket_bytes,
                         const std::string& fp8_site) {
  PlanOptions options;
  options.fp8_site = parse_fp8_site(fp8_site);
  options.mode = parse_plan_mode(mode);
  options.bucket_bytes = bucket_bytes;
  const Plan plan =
      make_plan(trainer_layout(trainer), make_engine_layout(engine_spec(engine, base_dir)),
                Topology{}, options);
  return plan.summary_json().dump();
}

}  // namespace

void bind_layouts(nb::module_& m) {
  m.def("engine_params", &engine_params, nb::arg("engine"), nb::arg("base_dir"), nb::arg("replica"),
        nb::arg("rank"));
  m.def("engine_fp8_summary", &engine_fp8_summary, nb::arg("engine"), nb::arg("base_dir"),
        nb::arg("replica"), nb::arg("rank"));
  m.def("engine_config_json", &engine_config_json, nb::arg("engine"), nb::arg("base_dir"));
  m.def("check_trainer_layout", &check_trainer_layout, nb::arg("layout"));
  m.def("local_shape", &layout_local_shape, nb::arg("layout"), nb::arg("name"), nb::arg("rank"));
  m.def("rank_param_names", &rank_param_names, nb::arg("layout"), nb::arg("rank"));
  m.def("transformers_param", &transformers_keys, nb::arg("model_type"), nb::arg("name"),
        nb::arg("shape"));
  m.def("make_trainer_layout", &generate_trainer_layout, nb::arg("hf_config"), nb::arg("mesh"),
        nb::arg("style"), nb::arg("dtype") = nb::none(), nb::arg("vocab_divisible_by") = 128,
        nb::arg("first_stage_layers") = nb::none(), nb::arg("last_stage_layers") = nb::none());
  m.def("plan_summary", &plan_summary, nb::arg("trainer"), nb::arg("engine"), nb::arg("base_dir"),
        nb::arg("mode"), nb::arg("bucket_bytes"), nb::arg("fp8_site") = "sender",
        nb::call_guard<nb::gil_scoped_release>());
}

}  // namespace weightsync::python
