// EngineLayout's rank arithmetic (which group, replica and rank layout a
// global engine rank belongs to) and the names of the scale formats: part of
// the layout data model the planner consumes. The generators that fill a
// layout live in src/layouts.
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>

namespace weightsync {

std::string_view scale_format_name(ScaleFormat format) noexcept {
  return format == ScaleFormat::ue8m0 ? "ue8m0" : "fp32";
}

int EngineLayout::world() const noexcept {
  if (groups.empty()) return 0;
  const EngineGroup& last = groups.back();
  return last.first_rank + last.config.tp * last.config.replicas;
}

int EngineLayout::num_replicas() const noexcept {
  return groups.empty() ? 0 : groups.back().first_replica + groups.back().config.replicas;
}

const EngineGroup& EngineLayout::group_of(int global_rank) const {
  if (global_rank < 0 || global_rank >= world())
    fail(Errc::invalid_argument, "engine rank ", global_rank, " outside the engines' ", world(),
         " ranks");
  size_t i = groups.size() - 1;
  while (groups[i].first_rank > global_rank) --i;
  return groups[i];
}

int EngineLayout::template_of(int global_rank) const {
  const EngineGroup& g = group_of(global_rank);
  return g.first_template + (global_rank - g.first_rank) % g.config.tp;
}

int EngineLayout::global_rank(int replica, int rank) const {
  if (replica < 0 || replica >= num_replicas())
    fail(Errc::invalid_argument, "replica ", replica, " outside the engines' ", num_replicas(),
         " replicas");
  size_t i = groups.size() - 1;
  while (groups[i].first_replica > replica) --i;
  const EngineGroup& g = groups[i];
  if (rank < 0 || rank >= g.config.tp)
    fail(Errc::invalid_argument, "rank ", rank, " outside tp=", g.config.tp, " of replica ",
         replica);
  return g.first_rank + (replica - g.first_replica) * g.config.tp + rank;
}

}  // namespace weightsync
