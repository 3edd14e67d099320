// check_coverage and the segment box mappings. Everything is box arithmetic
// (sorting, intersections, box differences), so it runs on DeepSeek-size
// layouts in well under a second, never per element.
#include <weightsync/engine_layout.h>
#include <weightsync/error.h>

#include <algorithm>
#include <map>
#include <span>

namespace weightsync {
namespace {

// param_box dims = extra leading length-1 dims + hf dims (last two swapped
// when transposed).
size_t extra_dims(const Segment& s) {
  if (s.param_box.rank() < s.hf_box.rank())
    fail(Errc::invalid_layout, "segment of '", s.hf_key, "': param box ", box_str(s.param_box),
         " has fewer dims than HF box ", box_str(s.hf_box));
  return s.param_box.rank() - s.hf_box.rank();
}

// The param dim that HF dim `d` maps to.
size_t param_dim(const Segment& s, size_t d, size_t extra) {
  const size_t n = s.hf_box.rank();
  if (s.transpose && n >= 2 && d >= n - 2) d = (d == n - 1) ? n - 2 : n - 1;
  return d + extra;
}

}  // namespace

Box segment_hf_sub_box(const Segment& s, const Box& param_sub) {
  const size_t extra = extra_dims(s);
  Box out = s.hf_box;
  for (size_t d = 0; d < s.hf_box.rank(); ++d) {
    const size_t pd = param_dim(s, d, extra);
    out.offsets[d] = s.hf_box.offsets[d] + param_sub.offsets[pd] - s.param_box.offsets[pd];
    out.lengths[d] = param_sub.lengths[pd];
  }
  return out;
}

Box segment_param_sub_box(const Segment& s, const Box& hf_sub) {
  const size_t extra = extra_dims(s);
  Box out = s.param_box;
  for (size_t d = 0; d < s.hf_box.rank(); ++d) {
    const size_t pd = param_dim(s, d, extra);
    out.offsets[pd] = s.param_box.offsets[pd] + hf_sub.offsets[d] - s.hf_box.offsets[d];
    out.lengths[pd] = hf_sub.lengths[d];
  }
  return out;
}

namespace {

void check_segment(const EngineParam& p, const Segment& s, const Shape& hf_shape) {
  if (!s.hf_box.fits(hf_shape))
    fail(Errc::invalid_layout, "engine param '", p.name, "': HF box ", box_str(s.hf_box), " of '",
         s.hf_key, "' lies outside its shape ", shape_str(hf_shape));
  if (!s.param_box.fits(p.shape))
    fail(Errc::invalid_layout, "engine param '", p.name, "': param box ", box_str(s.param_box),
         " (from '", s.hf_key, "') lies outside its shape ", shape_str(p.shape));
  const size_t extra = extra_dims(s);
  bool ok = true;
  for (size_t d = 0; d < extra; ++d) ok = ok && s.param_box.lengths[d] == 1;
  for (size_t d = 0; d < s.hf_box.rank(); ++d)
    ok = ok && s.param_box.lengths[param_dim(s, d, extra)] == s.hf_box.lengths[d];
  if (!ok)
    fail(Errc::invalid_layout, "engine param '", p.name, "': HF box ", box_str(s.hf_box), " of '",
         s.hf_key, "' and param box ", box_str(s.param_box), " differ in size");
}

// Segments pairwise disjoint (sweep over dim 0), and the written elements
// are exactly the rows [0, covered) of the parameter: whatever is not
// written is tail padding along dim 0 (vocab rows past vocab_size).
void check_param(const EngineParam& p, const std::map<std::string, Shape, std::less<>>& hf) {
  std::vector<const Segment*> segs;
  for (const auto& s : p.segments) {
    auto it = hf.find(s.hf_key);
    if (it == hf.end())
      fail(Errc::invalid_layout, "engine param '", p.name, "': HF key '", s.hf_key,
           "' is not a tensor of the model");
    check_segment(p, s, it->second);
    if (!s.param_box.empty()) segs.push_back(&s);
  }
  if (p.shape.empty()) {
    if (segs.size() != 1)
      fail(Errc::invalid_layout, "engine param '", p.name, "': a scalar needs one segment");
    return;
  }
  std::sort(segs.begin(), segs.end(), [](const Segment* a, const Segment* b) {
    return a->param_box.offsets[0] < b->param_box.offsets[0];
  });
  int64_t written = 0, covered_rows = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    const Box& a = segs[i]->param_box;
    for (size_t k = i + 1; k < segs.size() && segs[k]->param_box.offsets[0] < a.end(0); ++k)
      if (auto both = intersect(a, segs[k]->param_box))
        fail(Errc::invalid_layout, "engine param '", p.name, "': segments from '", segs[i]->hf_key,
             "' and '", segs[k]->hf_key, "' both write ", box_str(*both));
    written += a.numel();
    covered_rows = std::max(covered_rows, a.end(0));
  }
  Shape prefix = p.shape;
  prefix[0] = covered_rows;
  if (written != numel(prefix))
    fail(Errc::invalid_layout, "engine param '", p.name, "' of shape ", shape_str(p.shape),
         ": its segments write ", written, " elements, leaving holes that are not tail padding (",
         numel(prefix), " elements in rows [0, ", covered_rows, "))");
}

// a minus b, as up to 2 * rank disjoint boxes.
void subtract(const Box& a, const Box& b, std::vector<Box>& out) {
  if (!intersect(a, b)) {
    out.push_back(a);
    return;
  }
  Box rest = a;
  for (size_t d = 0; d < a.rank(); ++d) {
    const int64_t lo = std::max(rest.offsets[d], b.offsets[d]);
    const int64_t hi = std::min(rest.end(d), b.end(d));
    if (rest.offsets[d] < lo) {
      Box below = rest;
      below.lengths[d] = lo - rest.offsets[d];
      out.push_back(below);
    }
    if (hi < rest.end(d)) {
      Box above = rest;
      above.offsets[d] = hi;
      above.lengths[d] = rest.end(d) - hi;
      out.push_back(above);
    }
    rest.offsets[d] = lo;
    rest.lengths[d] = hi - lo;
  }
}

// Every HF tensor some rank reads must be read whole by the replica.
void check_hf_cover(std::span<const EngineRankLayout> ranks,
                    const std::map<std::string, Shape, std::less<>>& hf) {
  std::map<std::string, std::vector<Box>, std::less<>> reads;
  for (const auto& rank : ranks)
    for (const auto& p : rank.params)
      for (const auto& s : p.segments) reads[s.hf_key].push_back(s.hf_box);
  for (auto& [key, boxes] : reads) {
    std::vector<Box> missing{Box::full(hf.at(key))}, next;
    for (const auto& b : boxes) {
      next.clear();
      for (const auto& m : missing) subtract(m, b, next);
      missing.swap(next);
      if (missing.empty()) break;
    }
    missing.erase(
        std::remove_if(missing.begin(), missing.end(), [](const Box& m) { return m.empty(); }),
        missing.end());
    if (!missing.empty())
      fail(Errc::invalid_layout, "engine layout: no rank of the replica reads ",
           box_str(missing.front()), " of HF tensor '", key, "' (shape ", shape_str(hf.at(key)),
           ")");
  }
}

}  // namespace

void check_coverage(const EngineLayout& layout) {
  size_t templates = 0;
  for (const EngineGroup& g : layout.groups) templates += static_cast<size_t>(g.config.tp);
  if (layout.groups.empty() || layout.ranks.size() != templates)
    fail(Errc::invalid_layout, "engine layout: ", layout.ranks.size(), " rank layouts for ",
         layout.groups.size(), " groups of ", templates, " ranks in all");
  // Each group's replica covers its HF tensors whole, on its own.
  for (const EngineGroup& g : layout.groups) {
    std::map<std::string, Shape, std::less<>> hf;
    for (const auto& t : engine_hf_tensors(g.config)) hf.emplace(t.key, t.shape);
    const std::span<const EngineRankLayout> ranks(layout.ranks.data() + g.first_template,
                                                  static_cast<size_t>(g.config.tp));
    for (const auto& rank : ranks) {
      try {
        for (const auto& p : rank.params) check_param(p, hf);
      } catch (const Error& e) {
        throw Error(e.code(), cat("rank ", rank.rank, ": ", e.what()));
      }
    }
    check_hf_cover(ranks, hf);
  }
}

}  // namespace weightsync
