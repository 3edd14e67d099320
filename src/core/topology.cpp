#include <weightsync/error.h>
#include <weightsync/topology.h>

#include <nlohmann/json.hpp>

#include <fstream>

namespace weightsync {
namespace {

template <class T>
void read_field(const nlohmann::json& j, const char* name, T& out) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return;
  if constexpr (std::is_same_v<T, std::string>) {
    if (!it->is_string()) fail(Errc::format, "topology: \"", name, "\" must be a string");
  } else if constexpr (std::is_same_v<T, std::vector<int>>) {
    if (!it->is_array()) fail(Errc::format, "topology: \"", name, "\" must be a list of nodes");
    for (const auto& v : *it)
      if (!v.is_number_integer())
        fail(Errc::format, "topology: \"", name, "\" must hold integers, got ", v.dump());
  } else if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer()) fail(Errc::format, "topology: \"", name, "\" must be an integer");
  } else {
    if (!it->is_number()) fail(Errc::format, "topology: \"", name, "\" must be a number");
  }
  out = it->get<T>();
}

// The index of `rank` among the ranks of the same node in an explicit list.
int slot_in(const std::vector<int>& nodes, int rank) {
  int slot = 0;
  for (int r = 0; r < rank; ++r)
    if (nodes[static_cast<size_t>(r)] == nodes[static_cast<size_t>(rank)]) ++slot;
  return slot;
}

void check_listed(const std::vector<int>& nodes, int rank, const char* what) {
  if (rank < 0 || static_cast<size_t>(rank) >= nodes.size())
    fail(Errc::invalid_argument, "topology: ", what, " rank ", rank, " has no entry in ", what,
         "_nodes (", nodes.size(), " entries)");
}

}  // namespace

Topology Topology::from_json(const nlohmann::json& j) {
  if (!j.is_object()) fail(Errc::format, "topology: expected a JSON object, got ", j.type_name());
  static const char* known[] = {"name",
                                "gpus_per_node",
                                "gpus_per_nic",
                                "nic_bandwidth_GBps",
                                "nic_latency_us",
                                "nvlink_bandwidth_GBps",
                                "nvlink_latency_us",
                                "trainer_nodes",
                                "engine_nodes",
                                "comment"};
  for (const auto& [k, v] : j.items()) {
    bool ok = false;
    for (const char* n : known) ok = ok || k == n;
    if (!ok) fail(Errc::format, "topology: unknown field \"", k, "\"");
  }
  Topology t;
  read_field(j, "name", t.name);
  read_field(j, "gpus_per_node", t.gpus_per_node);
  read_field(j, "gpus_per_nic", t.gpus_per_nic);
  read_field(j, "nic_bandwidth_GBps", t.nic_bandwidth_GBps);
  read_field(j, "nic_latency_us", t.nic_latency_us);
  read_field(j, "nvlink_bandwidth_GBps", t.nvlink_bandwidth_GBps);
  read_field(j, "nvlink_latency_us", t.nvlink_latency_us);
  read_field(j, "trainer_nodes", t.trainer_nodes);
  read_field(j, "engine_nodes", t.engine_nodes);
  t.validate();
  return t;
}

Topology Topology::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(Errc::io, "topology: cannot open ", path);
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    fail(Errc::format, "topology: ", path, " is not valid JSON: ", e.what());
  }
  try {
    return from_json(j);
  } catch (const Error& e) {
    fail(e.code(), e.what(), " (in ", path, ")");
  }
}

nlohmann::json Topology::to_json() const {
  nlohmann::json j = {{"name", name},
                      {"gpus_per_node", gpus_per_node},
                      {"gpus_per_nic", gpus_per_nic},
                      {"nic_bandwidth_GBps", nic_bandwidth_GBps},
                      {"nic_latency_us", nic_latency_us},
                      {"nvlink_bandwidth_GBps", nvlink_bandwidth_GBps},
                      {"nvlink_latency_us", nvlink_latency_us}};
  if (!trainer_nodes.empty()) j["trainer_nodes"] = trainer_nodes;
  if (!engine_nodes.empty()) j["engine_nodes"] = engine_nodes;
  return j;
}

void Topology::validate() const {
  if (gpus_per_node < 1) fail(Errc::invalid_argument, "topology: gpus_per_node must be >= 1");
  if (gpus_per_nic < 1 || gpus_per_node % gpus_per_nic != 0)
    fail(Errc::invalid_argument, "topology: gpus_per_nic (", gpus_per_nic,
         ") must be >= 1 and divide gpus_per_node (", gpus_per_node, ")");
  if (!(nic_bandwidth_GBps > 0) || !(nvlink_bandwidth_GBps > 0))
    fail(Errc::invalid_argument, "topology: bandwidths must be > 0 GB/s");
  if (nic_latency_us < 0 || nvlink_latency_us < 0)
    fail(Errc::invalid_argument, "topology: latencies must be >= 0 us");
  for (int n : trainer_nodes)
    if (n < 0) fail(Errc::invalid_argument, "topology: negative node in trainer_nodes");
  for (int n : engine_nodes)
    if (n < 0) fail(Errc::invalid_argument, "topology: negative node in engine_nodes");
}

int Topology::trainer_node(int rank, int trainer_world) const {
  if (!trainer_nodes.empty()) {
    check_listed(trainer_nodes, rank, "trainer");
    return trainer_nodes[static_cast<size_t>(rank)];
  }
  return rank / gpus_per_node;
}

int Topology::engine_node(int global_rank, int trainer_world) const {
  if (!engine_nodes.empty()) {
    check_listed(engine_nodes, global_rank, "engine");
    return engine_nodes[static_cast<size_t>(global_rank)];
  }
  const int trainer_nodes_used = (trainer_world + gpus_per_node - 1) / gpus_per_node;
  return trainer_nodes_used + global_rank / gpus_per_node;
}

int Topology::trainer_slot(int rank, int trainer_world) const {
  if (!trainer_nodes.empty()) {
    check_listed(trainer_nodes, rank, "trainer");
    return slot_in(trainer_nodes, rank) % gpus_per_node;
  }
  return rank % gpus_per_node;
}

int Topology::engine_slot(int global_rank, int trainer_world) const {
  if (!engine_nodes.empty()) {
    check_listed(engine_nodes, global_rank, "engine");
    // Engines sharing a node with trainer ranks take the GPUs after them.
    int slot = slot_in(engine_nodes, global_rank);
    const int node = engine_nodes[static_cast<size_t>(global_rank)];
    for (int t : trainer_nodes) slot += t == node ? 1 : 0;
    return slot % gpus_per_node;
  }
  return global_rank % gpus_per_node;
}

}  // namespace weightsync
