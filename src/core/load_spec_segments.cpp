// The segment form of a LoadSpec (load_spec.h): explicit (key, hf_box) ->
// param_box parts of the global tensor. Its pieces, its keys' shapes and its
// validation. Like the compact form, everything is per run and per segment,
// never per element.
#include "load_spec_runs.h"

#include <weightsync/error.h>
#include <weightsync/load_spec.h>

#include <algorithm>
#include <numeric>

namespace weightsync::detail {
namespace {

// A part of one dim of a segment that a rank holds: `rel` counts from the
// segment's param_box offset, `local` in the rank's local tensor.
struct SegmentRun {
  int64_t local = 0;
  int64_t rel = 0;
  int64_t length = 0;
};

// Where each run of `runs` starts in the local tensor.
std::vector<int64_t> local_starts(const std::vector<Run>& runs) {
  std::vector<int64_t> out;
  out.reserve(runs.size());
  int64_t pos = 0;
  for (const Run& r : runs) {
    out.push_back(pos);
    pos += r.length;
  }
  return out;
}

// True when two boxes of equal rank share an element.
bool overlap(const Box& a, const Box& b) {
  if (a.empty() || b.empty()) return false;
  for (size_t d = 0; d < a.rank(); ++d)
    if (a.offsets[d] >= b.end(d) || b.offsets[d] >= a.end(d)) return false;
  return true;
}

// The first pair of overlapping boxes among `boxes[ids]` (all of one rank),
// by a sweep over dim 0: each box meets only those starting inside it there.
std::optional<std::pair<size_t, size_t>> first_overlap(const std::vector<const Box*>& boxes) {
  std::vector<size_t> order(boxes.size());
  std::iota(order.begin(), order.end(), size_t{0});
  if (!boxes.empty() && boxes[0]->rank() == 0)
    return boxes.size() > 1 ? std::optional(std::pair<size_t, size_t>{0, 1}) : std::nullopt;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return boxes[a]->offsets[0] < boxes[b]->offsets[0]; });
  for (size_t i = 0; i < order.size(); ++i) {
    const Box& a = *boxes[order[i]];
    for (size_t j = i + 1; j < order.size() && boxes[order[j]]->offsets[0] < a.end(0); ++j)
      if (overlap(a, *boxes[order[j]]))
        return std::pair<size_t, size_t>{std::min(order[i], order[j]),
                                         std::max(order[i], order[j])};
  }
  return std::nullopt;
}

bool non_negative(const Shape& s) {
  return std::all_of(s.begin(), s.end(), [](int64_t v) { return v >= 0; });
}

// One segment on its own: a key that exists, boxes of consistent ranks and
// lengths (param_box = hf_box with leading length-1 dims), inside origin.
void check_segment(const LoadSpec& spec, size_t i, const Shape& origin, const std::string& where) {
  const LoadSegment& s = (*spec.segments)[i];
  const std::string at = cat(where, ": segments[", i, "]");
  if (s.key < 0 || static_cast<size_t>(s.key) >= spec.hf_keys.size())
    fail(Errc::invalid_layout, at, ": key index ", s.key, " out of range for ", spec.hf_keys.size(),
         " hf_keys");
  const std::string of = cat(" of '", spec.hf_keys[static_cast<size_t>(s.key)], "'");
  if (s.hf_box.offsets.size() != s.hf_box.lengths.size() ||
      s.param_box.offsets.size() != s.param_box.lengths.size())
    fail(Errc::invalid_layout, at, of, ": a box has offsets and lengths of different ranks");
  if (s.param_box.rank() != spec.global_shape.size())
    fail(Errc::invalid_layout, at, of, ": param_box ", box_str(s.param_box), " has rank ",
         s.param_box.rank(), " but global_shape ", shape_str(spec.global_shape), " has rank ",
         spec.global_shape.size());
  const size_t n = s.hf_box.rank(), m = s.param_box.rank();
  bool ok = n <= m && non_negative(s.hf_box.offsets) && non_negative(s.hf_box.lengths) &&
            non_negative(s.param_box.offsets);
  for (size_t d = 0; ok && d < m; ++d)
    ok = d < m - n ? s.param_box.lengths[d] == 1
                   : s.param_box.lengths[d] == s.hf_box.lengths[d - (m - n)];
  if (!ok)
    fail(Errc::invalid_layout, at, of, ": hf_box ", box_str(s.hf_box), " does not map onto ",
         "param_box ", box_str(s.param_box),
         " (equal lengths, up to leading length-1 dims of param_box; no negative values)");
  if (!s.param_box.fits(origin))
    fail(Errc::invalid_layout, at, of, ": param_box ", box_str(s.param_box),
         " lies outside origin_shape ", shape_str(origin));
}

// Each key's segments: of one rank, disjoint, and tiling [0, extent).
void check_key_tiling(const LoadSpec& spec, const std::string& where) {
  std::vector<std::vector<size_t>> of_key(spec.hf_keys.size());
  for (size_t i = 0; i < spec.segments->size(); ++i)
    of_key[static_cast<size_t>((*spec.segments)[i].key)].push_back(i);
  const std::vector<Shape> shapes = segment_key_shapes(spec);
  for (size_t k = 0; k < of_key.size(); ++k) {
    const std::string key = cat(where, ": hf_key '", spec.hf_keys[k], "'");
    std::vector<const Box*> boxes;
    int64_t volume = 0;
    for (size_t i : of_key[k]) {
      const Box& b = (*spec.segments)[i].hf_box;
      if (b.rank() != shapes[k].size())
        fail(Errc::invalid_layout, key, ": segments[", i, "] has a box of rank ", b.rank(),
             ", another segment of the key one of rank ", shapes[k].size());
      boxes.push_back(&b);
      volume += b.numel();
    }
    if (auto o = first_overlap(boxes))
      fail(Errc::invalid_layout, key, ": segments[", of_key[k][o->first], "] and segments[",
           of_key[k][o->second], "] hold overlapping boxes ", box_str(*boxes[o->first]), " and ",
           box_str(*boxes[o->second]), " of it");
    if (volume != numel(shapes[k]))
      fail(Errc::invalid_layout, key, ": its segments hold ", volume, " elements of its ",
           shape_str(shapes[k]), " (", numel(shapes[k]), "); a param holds each of its keys whole");
  }
}

}  // namespace

std::vector<Piece> segment_pieces(const LoadSpec& spec, const std::vector<std::vector<Run>>& runs) {
  const size_t nd = runs.size();
  std::vector<std::vector<int64_t>> starts(nd);
  for (size_t d = 0; d < nd; ++d) starts[d] = local_starts(runs[d]);
  std::vector<Piece> pieces;
  std::vector<std::vector<SegmentRun>> placed(nd);
  for (const LoadSegment& seg : *spec.segments) {
    if (seg.param_box.rank() != nd || seg.hf_box.rank() > nd)
      fail(Errc::invalid_layout, "param '", spec.name, "': a segment's param_box ",
           box_str(seg.param_box), " does not match global_shape ", shape_str(spec.global_shape));
    const size_t lead = nd - seg.hf_box.rank();
    size_t count = 1;
    for (size_t d = 0; d < nd; ++d) {
      placed[d].clear();
      const int64_t lo = seg.param_box.offsets[d], hi = lo + seg.param_box.lengths[d];
      for (size_t i = 0; i < runs[d].size(); ++i) {
        const Run& r = runs[d][i];
        const int64_t a = std::max(lo, r.start), b = std::min(hi, r.start + r.length);
        if (a < b) placed[d].push_back({starts[d][i] + (a - r.start), a - lo, b - a});
      }
      count *= placed[d].size();
    }
    // Odometer over the per-dim runs, last dim fastest.
    std::vector<size_t> idx(nd, 0);
    for (size_t p = 0; p < count; ++p) {
      Piece piece;
      piece.key = seg.key;
      piece.hf_box = seg.hf_box;
      piece.local_box.offsets.resize(nd);
      piece.local_box.lengths.resize(nd);
      for (size_t d = 0; d < nd; ++d) {
        const SegmentRun& r = placed[d][idx[d]];
        piece.local_box.offsets[d] = r.local;
        piece.local_box.lengths[d] = r.length;
        if (d < lead) continue;
        piece.hf_box.offsets[d - lead] += r.rel;
        piece.hf_box.lengths[d - lead] = r.length;
      }
      pieces.push_back(std::move(piece));
      for (size_t d = nd; d-- > 0;) {
        if (++idx[d] < placed[d].size()) break;
        idx[d] = 0;
      }
    }
  }
  return pieces;
}

std::vector<Shape> segment_key_shapes(const LoadSpec& spec) {
  std::vector<Shape> shapes(spec.hf_keys.size());
  std::vector<bool> seen(spec.hf_keys.size(), false);
  for (const LoadSegment& s : *spec.segments) {
    if (s.key < 0 || static_cast<size_t>(s.key) >= shapes.size())
      fail(Errc::invalid_layout, "param '", spec.name, "': a segment names key index ", s.key,
           " of ", shapes.size(), " hf_keys");
    Shape& shape = shapes[static_cast<size_t>(s.key)];
    if (!seen[static_cast<size_t>(s.key)]) shape.assign(s.hf_box.rank(), 0);
    seen[static_cast<size_t>(s.key)] = true;
    for (size_t d = 0; d < std::min(shape.size(), s.hf_box.rank()); ++d)
      shape[d] = std::max(shape[d], s.hf_box.end(d));
  }
  for (size_t k = 0; k < shapes.size(); ++k)
    if (!seen[k])
      fail(Errc::invalid_layout, "param '", spec.name, "': hf_key '", spec.hf_keys[k],
           "' is in no segment (a key's shape is the extent of its segments)");
  return shapes;
}

void validate_segments(const LoadSpec& spec, const std::string& where) {
  if (spec.fused_dim || spec.stack_dim)
    fail(Errc::invalid_layout, where, ": segments replace fused_dim and stack_dim (set them null)");
  const Shape& origin = spec.origin_shape.empty() ? spec.global_shape : spec.origin_shape;
  const auto& segments = *spec.segments;
  if (segments.empty() && !spec.hf_keys.empty())
    fail(Errc::invalid_layout, where, ": no segments but ", spec.hf_keys.size(), " hf_keys");
  for (size_t i = 0; i < segments.size(); ++i) check_segment(spec, i, origin, where);
  std::vector<const Box*> boxes;
  boxes.reserve(segments.size());
  for (const LoadSegment& s : segments) boxes.push_back(&s.param_box);
  if (auto o = first_overlap(boxes))
    fail(Errc::invalid_layout, where, ": segments[", o->first, "] and segments[", o->second,
         "] overlap in the param (", box_str(*boxes[o->first]), " and ", box_str(*boxes[o->second]),
         ")");
  check_key_tiling(spec, where);
}

}  // namespace weightsync::detail
