// Topology: where trainer and engine ranks sit (nodes, NICs) and how fast the
// links between them are. The planner's cost model reads it; nothing else does.
//
// JSON (configs/topologies/*.json), every field optional:
//   {"name": "h800-rdma", "gpus_per_node": 8, "gpus_per_nic": 1,
//    "nic_bandwidth_GBps": 50, "nic_latency_us": 5,
//    "nvlink_bandwidth_GBps": 450, "nvlink_latency_us": 2,
//    "trainer_nodes": [0, 0, ...], "engine_nodes": [4, 4, ...]}
// Bandwidths are in gigabytes (1e9 bytes) per second, per GPU for NVLink and
// per NIC for the NIC. Without explicit node lists, trainer rank t sits on
// node t / gpus_per_node and engine rank g on the first node after the
// trainer's, plus g / gpus_per_node: trainer and engines never share a node.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace weightsync {

struct Topology {
  std::string name = "default";
  int gpus_per_node = 8;
  int gpus_per_nic = 1;
  double nic_bandwidth_GBps = 50.0;  // 400 Gb/s per GPU (RDMA)
  double nic_latency_us = 5.0;
  double nvlink_bandwidth_GBps = 450.0;
  double nvlink_latency_us = 2.0;
  // Optional explicit placement: node of each trainer rank / global engine rank.
  std::vector<int> trainer_nodes;
  std::vector<int> engine_nodes;

  // Errc::format naming the field for a wrong type; Errc::invalid_argument for
  // a non-positive size or bandwidth.
  static Topology from_json(const nlohmann::json& j);
  static Topology load(const std::string& path);
  nlohmann::json to_json() const;
  void validate() const;

  // Placement for a job of `trainer_world` trainer ranks. Errc::invalid_argument
  // when an explicit list is shorter than the rank asked for.
  int trainer_node(int rank, int trainer_world) const;
  int engine_node(int global_rank, int trainer_world) const;
  // The GPU's slot inside its node (rank modulo gpus_per_node without lists).
  int trainer_slot(int rank, int trainer_world) const;
  int engine_slot(int global_rank, int trainer_world) const;
};

}  // namespace weightsync
