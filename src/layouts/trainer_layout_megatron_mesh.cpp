// The trainer mesh of a Megatron-Core job. Megatron numbers ranks in the
// order "tp-cp-ep-dp-pp": inside a pipeline stage, the dense layers see
// tp x cp x dp (tp fastest) and the experts etp x ep x edp over the same
// ranks (parallel_state.py, two RankGenerators). A LoadSpec shards over
// named row-major axes, so the stage's ranks are cut at every boundary of
// either grid; each piece is one axis, and a grid's axis is the run of
// pieces inside it.
#include "trainer_layout_megatron_mesh.h"

#include <weightsync/error.h>

#include <algorithm>
#include <set>

namespace weightsync::detail {
namespace {

struct Part {
  int64_t end;  // the part covers ranks strides [previous end, end)
  const char* name;
};

// The role of the piece [lo, hi) of a grid given by its parts (ascending).
const char* role(const std::vector<Part>& parts, int64_t hi) {
  for (const Part& p : parts)
    if (hi <= p.end) return p.name;
  return parts.back().name;
}

}  // namespace

MegatronMesh megatron_mesh(const MegatronParallel& par, bool moe) {
  MegatronMesh out;
  out.mesh.axes = {"pp"};
  out.mesh.shape = {par.pp};
  if (!moe) {
    // Axes as Megatron names them, slowest first.
    for (const auto& [name, size] :
         {std::pair<const char*, int64_t>{"dp", par.dp}, {"cp", par.cp}, {"tp", par.tp}}) {
      if (std::string(name) == "cp" && par.cp == 1) continue;
      out.mesh.axes.push_back(name);
      out.mesh.shape.push_back(size);
    }
    out.tp = {"tp"};
    return out;
  }
  const int64_t n = par.tp * par.cp * par.dp, etp = par.expert_tp();
  const std::vector<Part> dense = {{par.tp, "tp"}, {par.tp * par.cp, "cp"}, {n, "dp"}};
  const std::vector<Part> expert = {{etp, "etp"}, {etp * par.ep, "ep"}, {n, "edp"}};
  std::set<int64_t> cuts = {1, n};
  for (const auto* grid : {&dense, &expert})
    for (const Part& p : *grid) cuts.insert(p.end);
  const std::vector<int64_t> b(cuts.begin(), cuts.end());
  std::vector<std::pair<std::string, int64_t>> pieces;  // fastest first
  for (size_t i = 0; i + 1 < b.size(); ++i) {
    if (b[i + 1] % b[i] != 0)
      fail(Errc::invalid_layout, "megatron layout: tp=", par.tp, ", cp=", par.cp, ", dp=", par.dp,
           " and etp=", etp, ", ep=", par.ep,
           " cut a stage's ranks at strides that are not multiples of one another (", b[i], " and ",
           b[i + 1], "); weightsync's row-major mesh cannot express both grids");
    const std::string dense_role = role(dense, b[i + 1]), expert_role = role(expert, b[i + 1]);
    pieces.push_back({dense_role + "_" + expert_role, b[i + 1] / b[i]});
    if (dense_role == "tp") out.tp.insert(out.tp.begin(), pieces.back().first);
    if (expert_role == "ep") out.ep.insert(out.ep.begin(), pieces.back().first);
    if (expert_role == "etp") out.etp.insert(out.etp.begin(), pieces.back().first);
  }
  for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) {
    out.mesh.axes.push_back(it->first);
    out.mesh.shape.push_back(it->second);
  }
  return out;
}

void check_parallel(const HfModelConfig& config, const MegatronParallel& par) {
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"pp", par.pp},
                                {"tp", par.tp},
                                {"dp", par.dp},
                                {"cp", par.cp},
                                {"ep", par.ep},
                                {"etp", par.expert_tp()}})
    if (v < 1) fail(Errc::invalid_argument, "megatron layout: ", name, "=", v, " (expected >= 1)");
  const int64_t stage = par.tp * par.cp * par.dp, expert = par.expert_tp() * par.ep;
  if (!config.is_moe()) {
    if (par.ep > 1)
      fail(Errc::invalid_layout, "megatron layout: ep=", par.ep, " on the dense ", config.family,
           " model (expert parallel needs experts)");
    return;
  }
  if (config.num_experts % par.ep != 0)
    fail(Errc::invalid_layout, "megatron layout: ", config.num_experts,
         " experts do not split over ep=", par.ep, " (Megatron-Core: num_moe_experts % ep == 0)");
  if (stage % expert != 0)
    fail(Errc::invalid_layout, "megatron layout: etp x ep = ", par.expert_tp(), " x ", par.ep,
         " does not divide the ", stage, " ranks of a stage (tp x cp x dp = ", par.tp, " x ",
         par.cp, " x ", par.dp, "); Megatron-Core refuses it");
}

}  // namespace weightsync::detail
