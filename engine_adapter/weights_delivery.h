// load_weights mode (subscriber.h, on_weights): an engine rank of a
// framework-"hf" group hands each HF tensor, whole, to the engine's own
// loader as soon as the bucket that completes it landed, instead of writing
// into registered params.
//
// The tensors are assembled in one arena of the rank's memory, allocated
// once: the data path sees each HF key as a param at a fixed place in it and
// applies into it like into any param (copy programs, direct fragments). A
// key occupies its place from two buckets before the first that carries it
// (receives are posted ahead) to the one that completes it; keys whose
// spans do not meet share memory. The arena stays near a few buckets even
// for a model far larger than the rank's memory (but with delta sync, which
// needs the version kept).
#pragma once

#include <weightsync/engine_layout.h>
#include <weightsync/plan.h>

#include <cstdint>
#include <vector>

namespace weightsync::engine {

struct DeliveryPlan {
  std::vector<int64_t> offset;  // per param of the rank layout: bytes into the arena
  int64_t arena_bytes = 0;
  // Per bucket in this rank's receive order (Plan::buckets_received_by): the
  // params it completes, in layout order. Params no bucket carries (empty
  // tensors) complete with the last bucket.
  std::vector<std::vector<uint32_t>> complete_after;
};

// Errc::invalid_argument when `layout` is not whole HF tensors (one segment
// covering each param). With `keep_version` (delta sync) no two keys share
// memory: the arena holds the rank's whole version from step to step (the
// base a delta patches), at the cost of the rank's bytes.
DeliveryPlan plan_delivery(const Plan& plan, int global_rank, const EngineRankLayout& layout,
                           bool keep_version = false);

}  // namespace weightsync::engine
