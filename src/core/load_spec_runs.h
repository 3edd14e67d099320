// Internal: per-dim runs of global indices, shared by the LoadSpec geometry
// and its validation; the segment form's geometry.
#pragma once

#include <weightsync/load_spec.h>

#include <string>
#include <vector>

namespace weightsync::detail {

// Global indices [start, start + length) of one dim.
struct Run {
  int64_t start = 0;
  int64_t length = 0;
};

int64_t total_length(const std::vector<Run>& runs);
// Appends the part [lo, hi) of the concatenation of `runs` to `out`.
void select_range(const std::vector<Run>& runs, int64_t lo, int64_t hi, std::vector<Run>& out);
// Narrows `runs` to what coordinate `r` of an axis of `w` ranks holds.
void apply_shard(std::vector<Run>& runs, int64_t w, int64_t r, int64_t interleave,
                 const std::string& param, size_t shard_index);
// The runs of every dim of `spec` held by `rank`.
std::vector<std::vector<Run>> dim_runs(const LoadSpec& spec, const Mesh& mesh, int64_t rank);

// The segment form (load_spec_segments.cpp): the pieces of the part of the
// global tensor given by `runs`, segment by segment; each key's extent over
// its segments; and the checks of validate() (`where` names the param).
std::vector<Piece> segment_pieces(const LoadSpec& spec, const std::vector<std::vector<Run>>& runs);
std::vector<Shape> segment_key_shapes(const LoadSpec& spec);
void validate_segments(const LoadSpec& spec, const std::string& where);

}  // namespace weightsync::detail
