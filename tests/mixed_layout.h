// The trainer layout that exercises every LoadSpec rule at once, shared by
// the shard, HF checkpoint and save tests: fused keys with EP then FSDP, tail
// padding, interleave with an empty local shard, replication, keys stacked on
// a leading dim (fused and padded; transformers >= 5 experts).
#pragma once

#include <nlohmann/json.hpp>

namespace weightsync::testing {

inline nlohmann::json mixed_layout_json() {
  return nlohmann::json::parse(R"({
    "mesh": {"axes": ["dp", "ep", "fsdp"], "shape": [2, 2, 3]},
    "params": [
      {"name": "experts.gate_up", "fused_dim": 0, "global_shape": [30, 4], "dtype": "F32",
       "hf_keys": ["e0.gate", "e0.up", "e1.gate", "e1.up", "e2.gate", "e2.up"],
       "shards": [{"dim": 0, "axis": "ep"}, {"dim": 0, "axis": "fsdp"}]},
      {"name": "embed", "hf_keys": ["embed"], "global_shape": [9, 3], "origin_shape": [7, 3],
       "dtype": "BF16", "shards": [{"dim": 0, "axis": "fsdp"}]},
      {"name": "w13", "hf_keys": ["w13"], "global_shape": [8, 4], "dtype": "F16",
       "shards": [{"dim": 0, "axis": "ep", "interleave": 2}, {"dim": 1, "axis": "fsdp"}]},
      {"name": "norm", "hf_keys": ["norm"], "global_shape": [5], "dtype": "F32", "shards": []},
      {"name": "experts.stacked_gate_up", "stack_dim": 0, "fused_dim": 1,
       "global_shape": [5, 6, 3], "dtype": "BF16",
       "hf_keys": ["s0.gate", "s0.up", "s1.gate", "s1.up", "s2.gate", "s2.up", "s3.gate",
                   "s3.up", "s4.gate", "s4.up"],
       "shards": [{"dim": 0, "axis": "ep"}, {"dim": 0, "axis": "fsdp"}]},
      {"name": "experts.stacked_down", "stack_dim": 0, "global_shape": [6, 3, 2],
       "origin_shape": [5, 3, 2], "dtype": "F32",
       "hf_keys": ["s0.down", "s1.down", "s2.down", "s3.down", "s4.down"],
       "shards": [{"dim": 0, "axis": "ep"}, {"dim": 1, "axis": "fsdp"}]}
    ]})");
}

}  // namespace weightsync::testing
