// Helpers of the end-to-end tests: models on disk, running the real
// `weightsync` binary (which starts one process per rank), reading results.
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>
#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>
#include <weightsync/materialize.h>
#include <weightsync/plan.h>
#include <weightsync/safetensors.h>
#include <weightsync/topology.h>

#include "core/random_checkpoint.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

namespace weightsync::e2e {

inline bool have_ucx() {
  const auto names = transport_names();
  return std::find(names.begin(), names.end(), "ucx") != names.end();
}

#define REQUIRE_UCX() \
  if (!::weightsync::e2e::have_ucx()) GTEST_SKIP() << "weightsync was built without UCX"

// Host memory for a tensor of `shape`, optionally seen through a view whose
// rows are padded (3 elements longer: not contiguous), so that no box of it
// is a dense run unless it is a single row.
struct Storage {
  std::vector<char> bytes;
  TensorView view;
};

inline Storage make_storage(DType dtype, const Shape& shape, bool padded) {
  Storage s;
  Shape strides = contiguous_strides(shape);
  int64_t elements = numel(shape);
  if (padded && shape.size() >= 2) {
    const int64_t row = shape.back() + 3;
    for (size_t d = 0; d + 1 < shape.size(); ++d) strides[d] = strides[d] / shape.back() * row;
    elements = numel(shape) / std::max<int64_t>(shape.back(), 1) * row;
  }
  s.bytes.assign(static_cast<size_t>(std::max<int64_t>(elements, 1)) * itemsize(dtype), '\0');
  s.view = host_view(s.bytes.data(), dtype, shape);
  if (padded) s.view.strides = strides;
  return s;
}

// The HF config of a model under configs/models/.
inline std::string config_path(const std::string& model) {
  return std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/" + model + "/config.json";
}

struct Model {
  std::string dir, checkpoint, trainer, engine;
};

inline std::string temp_dir(const std::string& what) {
  std::string p = "/tmp/ws-e2e-" + what + "-XXXXXX";
  if (!::mkdtemp(p.data())) throw std::runtime_error("mkdtemp failed");
  return p;
}

// A random checkpoint of configs/models/<name>, a trainer layout on `mesh`
// and a vLLM engine config.
inline Model make_model(const std::string& name, const std::string& mesh, int tp, int replicas,
                        bool expert_parallel = false) {
  Model m;
  m.dir = temp_dir(name);
  const std::string config_path =
      std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/" + name + "/config.json";
  const HfModelConfig config = HfModelConfig::load(config_path);
  m.checkpoint = m.dir + "/model.safetensors";
  RandomCheckpointOptions ro;
  ro.seed = 7;
  write_random_checkpoint(m.checkpoint, hf_tensors(config), ro);
  m.trainer = m.dir + "/trainer.json";
  std::ofstream(m.trainer) << make_trainer_layout(config, parse_mesh_spec(mesh)).to_json().dump();
  m.engine = m.dir + "/engine.json";
  std::ofstream(m.engine) << nlohmann::json{
      {"framework", "vllm"},
      {"hf_config", config_path},
      {"tp", tp},
      {"expert_parallel", expert_parallel},
      {"expert_placement", "linear"},
      {"replicas", replicas},
      {"dtype",
       dtype_name(config.dtype)}}.dump();
  return m;
}

struct CliRun {
  int exit_code = -1;
  std::string output;
};

// Runs the weightsync binary with `args` (bounded by coreutils timeout).
inline CliRun run_cli(const std::vector<std::string>& args, int timeout_s = 240) {
  std::string cmd = "timeout -s KILL " + std::to_string(timeout_s) + " '" WEIGHTSYNC_CLI "'";
  for (const auto& a : args) cmd += " '" + a + "'";
  cmd += " 2>&1";
  CliRun r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

inline nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) return nullptr;
  auto j = nlohmann::json::parse(in, nullptr, false);
  return j.is_discarded() ? nlohmann::json(nullptr) : j;
}

// A `weightsync demo` run on a model's files and what its summary said.
struct Demo {
  CliRun run;
  nlohmann::json summary;
};

// `weightsync demo` on `m` (its summary and work directory in m.dir), with
// `extra` options and, when `dump` is given, the engines' dumps there.
inline Demo run_model_demo(const Model& m, const std::vector<std::string>& extra,
                           const std::string& dump = "", int timeout_s = 240) {
  const std::string summary = m.dir + "/summary.json";
  std::vector<std::string> args{"demo",    "--checkpoint", m.checkpoint,   "--trainer",
                                m.trainer, "--engine",     m.engine,       "--summary",
                                summary,   "--work-dir",   m.dir + "/work"};
  if (!dump.empty()) {
    args.push_back("--dump");
    args.push_back(dump);
  }
  args.insert(args.end(), extra.begin(), extra.end());
  Demo d;
  d.run = run_cli(args, timeout_s);
  d.summary = read_json(summary);
  return d;
}

// A JSON list of ranks.
inline std::vector<int> ints(const nlohmann::json& j) {
  return j.get<std::vector<int>>();
}

inline Plan plan_of(const Model& m, const std::string& mode, int64_t bucket_bytes) {
  PlanOptions po;
  po.mode = parse_plan_mode(mode);
  po.bucket_bytes = bucket_bytes;
  return make_plan(TrainerLayout::load(m.trainer), make_engine_layout(load_engine_spec(m.engine)),
                   Topology{}, po);
}

// Compares a dumped engine rank with `weightsync materialize` of the
// checkpoint for that rank, tensor by tensor; "" when equal.
inline std::string compare_with_materialize(const Model& m, const std::string& dump, int rank) {
  const std::string ref = dump + ".reference.safetensors";
  const EngineLayout layout = make_engine_layout(load_engine_spec(m.engine));
  materialize(Checkpoint::open(m.checkpoint), layout, rank, ref);
  const auto a = SafetensorsFile::open(dump);
  const auto b = SafetensorsFile::open(ref);
  if (a->tensors().size() != b->tensors().size()) return "tensor counts differ";
  for (const auto& t : b->tensors()) {
    const auto* other = a->find(t.name);
    if (!other) return "missing " + t.name;
    const TensorView va = a->view(t.name), vb = b->view(t.name);
    if (va.shape != vb.shape || va.dtype != vb.dtype) return "shape/dtype of " + t.name;
    if (std::memcmp(va.data, vb.data, vb.nbytes()) != 0) return "bytes of " + t.name;
  }
  return "";
}

// The file the demo's --dump-dir writes for global engine rank `g`.
inline std::string dump_file(const std::string& dump, const EngineLayout& layout, int g) {
  const EngineGroup& group = layout.group_of(g);
  const int replica = group.first_replica + (g - group.first_rank) / group.config.tp;
  return dump + "/engine" + std::to_string(replica) + "-rank" +
         std::to_string((g - group.first_rank) % group.config.tp) + ".safetensors";
}

}  // namespace weightsync::e2e
