// Internal: the trainer mesh of a Megatron-Core job (trainer_layout.h,
// make_megatron_layout) and the checks of its parallel sizes.
#pragma once

#include <weightsync/hf_model.h>
#include <weightsync/layouts.h>

#include <string>
#include <vector>

namespace weightsync::detail {

// The mesh, and which of its axes make up tensor parallel (dense), expert
// parallel and expert tensor parallel, each slowest first: sharding over them
// in this order is sharding over the combined axis.
struct MegatronMesh {
  Mesh mesh;
  std::vector<std::string> tp, ep, etp;
};

MegatronMesh megatron_mesh(const MegatronParallel& parallel, bool moe);

// Errc::invalid_layout / invalid_argument where Megatron-Core refuses the
// sizes for this model.
void check_parallel(const HfModelConfig& config, const MegatronParallel& parallel);

}  // namespace weightsync::detail
