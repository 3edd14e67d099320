// LoadSpec geometry: the mesh, local shapes and the pieces a rank holds.
//
// Per dim, a rank's local index set is a list of runs of global indices; the
// local tensor along that dim is their concatenation. Shards narrow the runs
// in order; the pieces are the cartesian product of the per-dim runs after
// cutting padding off and splitting the fused dim at key boundaries. All work
// is per run, never per element, so a rank's cost is proportional to what it
// holds.
#include "load_spec_runs.h"

#include <weightsync/error.h>
#include <weightsync/load_spec.h>

#include <algorithm>

namespace weightsync {

int64_t Mesh::world() const noexcept {
  int64_t w = 1;
  for (int64_t s : shape) w *= s;
  return w;
}

int Mesh::axis_index(std::string_view axis) const noexcept {
  for (size_t i = 0; i < axes.size(); ++i)
    if (axes[i] == axis) return static_cast<int>(i);
  return -1;
}

std::vector<int64_t> Mesh::coords(int64_t rank) const {
  if (rank < 0 || rank >= world())
    fail(Errc::invalid_argument, "rank ", rank, " out of range for a mesh of ", world(),
         " ranks (shape ", shape_str(shape), ")");
  std::vector<int64_t> c(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    c[i] = rank % shape[i];
    rank /= shape[i];
  }
  return c;
}

int64_t Mesh::rank_of(const std::vector<int64_t>& coords) const {
  if (coords.size() != shape.size())
    fail(Errc::invalid_argument, "mesh coordinates ", shape_str(coords), " do not match shape ",
         shape_str(shape));
  int64_t rank = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (coords[i] < 0 || coords[i] >= shape[i])
      fail(Errc::invalid_argument, "mesh coordinate ", coords[i], " out of range for axis '",
           axes[i], "' of size ", shape[i]);
    rank = rank * shape[i] + coords[i];
  }
  return rank;
}

int64_t LoadSpec::keys_per_entry() const {
  const auto keys = static_cast<int64_t>(hf_keys.size());
  if (!stack_dim) return keys;
  const Shape& origin = origin_shape.empty() ? global_shape : origin_shape;
  const int64_t entries = origin.empty() ? 0 : origin[0];
  return entries > 0 ? keys / entries : keys;
}

namespace {

// The shape every key shares in the compact form.
Shape compact_key_shape(const LoadSpec& spec) {
  Shape s = spec.origin_shape.empty() && !spec.global_shape.empty() ? spec.global_shape
                                                                    : spec.origin_shape;
  const int64_t per_entry = spec.keys_per_entry();
  if (spec.fused_dim && *spec.fused_dim >= 0 && static_cast<size_t>(*spec.fused_dim) < s.size() &&
      per_entry > 0)
    s[*spec.fused_dim] /= per_entry;
  if (spec.stack_dim && !s.empty()) s.erase(s.begin());
  return s;
}

}  // namespace

std::vector<Shape> LoadSpec::key_shapes() const {
  if (segments) return detail::segment_key_shapes(*this);
  return std::vector<Shape>(hf_keys.size(), compact_key_shape(*this));
}

Shape LoadSpec::hf_key_shape() const {
  if (!segments) return compact_key_shape(*this);
  const std::vector<Shape> shapes = key_shapes();
  for (size_t k = 1; k < shapes.size(); ++k)
    if (shapes[k] != shapes[0])
      fail(Errc::invalid_layout, "param '", name, "': its keys have different shapes ('",
           hf_keys[0], "' ", shape_str(shapes[0]), ", '", hf_keys[k], "' ", shape_str(shapes[k]),
           "); ask for key_shapes()");
  if (shapes.empty())
    fail(Errc::invalid_layout, "param '", name, "' holds no HF key (empty segments)");
  return shapes[0];
}

bool LoadSpec::has_padding() const {
  if (!origin_shape.empty() && origin_shape != global_shape) return true;
  if (!segments) return false;
  // Segments are disjoint (validate()): they cover the tensor when their
  // volumes add up to it.
  int64_t covered = 0;
  for (const LoadSegment& s : *segments) covered += s.param_box.numel();
  return covered != numel(global_shape);
}

bool holds(const LoadSpec& spec, const Mesh& mesh, int64_t rank) {
  if (!spec.stage) return true;
  const int a = mesh.axis_index(spec.stage->axis);
  if (a < 0)
    fail(Errc::invalid_layout, "param '", spec.name, "': stage axis '", spec.stage->axis,
         "' is not a mesh axis");
  if (rank < 0 || rank >= mesh.world())
    fail(Errc::invalid_argument, "rank ", rank, " out of range for a mesh of ", mesh.world(),
         " ranks (shape ", shape_str(mesh.shape), ")");
  int64_t stride = 1;
  for (size_t i = static_cast<size_t>(a) + 1; i < mesh.shape.size(); ++i) stride *= mesh.shape[i];
  return (rank / stride) % mesh.shape[static_cast<size_t>(a)] == spec.stage->index;
}

Box local_sub_box(const Box& piece_hf, const Box& piece_local, const Box& hf_sub) {
  const size_t lead = piece_local.rank() - piece_hf.rank();
  Box out = piece_local;
  for (size_t d = 0; d < hf_sub.rank(); ++d) {
    out.offsets[lead + d] += hf_sub.offsets[d] - piece_hf.offsets[d];
    out.lengths[lead + d] = hf_sub.lengths[d];
  }
  return out;
}

Box hf_sub_box(const Box& piece_hf, const Box& piece_local, const Box& local_sub) {
  const size_t lead = piece_local.rank() - piece_hf.rank();
  Box out = piece_hf;
  for (size_t d = 0; d < piece_hf.rank(); ++d) {
    out.offsets[d] += local_sub.offsets[lead + d] - piece_local.offsets[lead + d];
    out.lengths[d] = local_sub.lengths[lead + d];
  }
  return out;
}

namespace detail {

// Appends the part [lo, hi) of the concatenated `runs` to `out`.
void select_range(const std::vector<Run>& runs, int64_t lo, int64_t hi, std::vector<Run>& out) {
  int64_t pos = 0;
  for (const Run& run : runs) {
    const int64_t a = std::max(lo, pos), b = std::min(hi, pos + run.length);
    if (a < b) {
      const int64_t start = run.start + (a - pos);
      // Keep runs maximal: join with the previous run when globally contiguous.
      if (!out.empty() && out.back().start + out.back().length == start)
        out.back().length += b - a;
      else
        out.push_back({start, b - a});
    }
    pos += run.length;
    if (pos >= hi) break;
  }
}

int64_t total_length(const std::vector<Run>& runs) {
  int64_t n = 0;
  for (const Run& r : runs) n += r.length;
  return n;
}

void apply_shard(std::vector<Run>& runs, int64_t w, int64_t r, int64_t interleave,
                 const std::string& param, size_t shard_index) {
  const int64_t n = total_length(runs);
  std::vector<Run> out;
  if (interleave <= 1) {
    const int64_t chunk = (n + w - 1) / w;
    select_range(runs, std::min(n, r * chunk), std::min(n, (r + 1) * chunk), out);
  } else {
    if (n % (w * interleave) != 0)
      fail(Errc::invalid_layout, "param '", param, "': shards[", shard_index, "]: interleave ",
           interleave, " over ", w, " ranks needs an extent divisible by ", w * interleave,
           ", got ", n);
    const int64_t seg = n / (w * interleave);
    for (int64_t j = 0; j < interleave; ++j)
      select_range(runs, (j * w + r) * seg, (j * w + r + 1) * seg, out);
  }
  runs = std::move(out);
}

std::vector<std::vector<Run>> dim_runs(const LoadSpec& spec, const Mesh& mesh, int64_t rank) {
  const std::vector<int64_t> coords = mesh.coords(rank);
  std::vector<std::vector<Run>> runs(spec.global_shape.size());
  for (size_t d = 0; d < runs.size(); ++d)
    if (spec.global_shape[d] > 0) runs[d].push_back({0, spec.global_shape[d]});
  for (size_t i = 0; i < spec.shards.size(); ++i) {
    const ShardSpec& s = spec.shards[i];
    const int a = mesh.axis_index(s.axis);
    if (a < 0)
      fail(Errc::invalid_layout, "param '", spec.name, "': shards[", i, "].axis: unknown axis '",
           s.axis, "'");
    if (s.dim < 0 || static_cast<size_t>(s.dim) >= runs.size())
      fail(Errc::invalid_layout, "param '", spec.name, "': shards[", i, "].dim ", s.dim,
           " out of range for global_shape ", shape_str(spec.global_shape));
    apply_shard(runs[s.dim], mesh.shape[a], coords[a], s.interleave, spec.name, i);
  }
  return runs;
}

}  // namespace detail

Shape local_shape(const LoadSpec& spec, const Mesh& mesh, int64_t rank) {
  if (!holds(spec, mesh, rank))
    fail(Errc::invalid_argument, "param '", spec.name, "' lives on stage ", spec.stage->index,
         " of axis '", spec.stage->axis, "'; rank ", rank, " is on stage ",
         mesh.coords(rank)[static_cast<size_t>(mesh.axis_index(spec.stage->axis))],
         " and does not hold it");
  const auto runs = detail::dim_runs(spec, mesh, rank);
  Shape shape(runs.size());
  for (size_t d = 0; d < runs.size(); ++d) shape[d] = detail::total_length(runs[d]);
  return shape;
}

namespace {

// A run placed in both coordinate systems, tagged with its key on the fused dim.
struct PlacedRun {
  int64_t local = 0;
  int64_t global = 0;  // relative to the key's tensor on the fused dim
  int64_t length = 0;
  int key = 0;
};

// Cuts the runs of one dim to [0, origin) and, on the fused dim, at multiples
// of `key_extent`; merges neighbours contiguous in local and HF coordinates.
std::vector<PlacedRun> place_runs(const std::vector<detail::Run>& runs, int64_t origin,
                                  int64_t key_extent) {
  std::vector<PlacedRun> out;
  int64_t local = 0;
  for (const detail::Run& run : runs) {
    int64_t g = run.start, l = local;
    const int64_t end = std::min(run.start + run.length, origin);
    while (g < end) {
      const int key = key_extent > 0 ? static_cast<int>(g / key_extent) : 0;
      const int64_t key_end = key_extent > 0 ? (key + 1) * key_extent : end;
      const int64_t len = std::min(end, key_end) - g;
      const int64_t rel = g - static_cast<int64_t>(key) * key_extent;
      if (!out.empty() && out.back().key == key && out.back().local + out.back().length == l &&
          out.back().global + out.back().length == rel)
        out.back().length += len;
      else
        out.push_back({l, rel, len, key});
      g += len;
      l += len;
    }
    local += run.length;
  }
  return out;
}

// Checks what local_pieces relies on, for specs that skipped validate():
// keys must split the fused extent evenly (and the stack entries), or a piece
// could name a key that does not exist.
void check_key_split(const LoadSpec& spec, const Shape& origin) {
  const size_t nd = origin.size();
  const auto keys = static_cast<int64_t>(spec.hf_keys.size());
  const int64_t per_entry = spec.keys_per_entry();
  bool ok = keys > 0 && per_entry > 0;
  if (ok && spec.stack_dim)
    ok = *spec.stack_dim == 0 && nd >= 2 && origin[0] > 0 && keys == origin[0] * per_entry;
  if (ok && spec.fused_dim)
    ok = *spec.fused_dim >= (spec.stack_dim ? 1 : 0) && static_cast<size_t>(*spec.fused_dim) < nd &&
         origin[*spec.fused_dim] % per_entry == 0;
  if (ok && !spec.fused_dim) ok = per_entry == 1;
  if (!ok)
    fail(Errc::invalid_layout, "param '", spec.name, "': ", keys,
         " hf_keys do not split origin_shape ", shape_str(origin), " along fused_dim ",
         spec.fused_dim ? std::to_string(*spec.fused_dim) : std::string("null"),
         spec.stack_dim ? cat(" stacked on dim ", *spec.stack_dim) : std::string());
}

}  // namespace

std::vector<Piece> local_pieces(const LoadSpec& spec, const Mesh& mesh, int64_t rank) {
  if (!holds(spec, mesh, rank)) return {};
  const auto runs = detail::dim_runs(spec, mesh, rank);
  if (spec.segments) return detail::segment_pieces(spec, runs);
  const size_t nd = runs.size();
  const Shape& origin = spec.origin_shape.empty() ? spec.global_shape : spec.origin_shape;
  if (origin.size() != nd)
    fail(Errc::invalid_layout, "param '", spec.name, "': origin_shape ", shape_str(origin),
         " has another rank than global_shape ", shape_str(spec.global_shape));
  check_key_split(spec, origin);
  const int64_t per_entry = spec.keys_per_entry();
  const bool stacked = spec.stack_dim.has_value();
  const auto fused = spec.fused_dim ? static_cast<size_t>(*spec.fused_dim) : nd;
  std::vector<std::vector<PlacedRun>> placed(nd);
  size_t count = 1;
  for (size_t d = 0; d < nd; ++d) {
    // The stack dim is cut at every entry (each holds other keys); the fused
    // dim at every key.
    int64_t key_extent = 0;
    if (stacked && d == 0) key_extent = 1;
    if (d == fused) key_extent = origin[d] / per_entry;
    placed[d] = place_runs(runs[d], origin[d], key_extent);
    count *= placed[d].size();
  }
  std::vector<Piece> pieces;
  if (count == 0) return pieces;
  pieces.reserve(count);
  const size_t lead = stacked ? 1 : 0;
  // Odometer over the per-dim runs, last dim fastest (row-major piece order).
  std::vector<size_t> idx(nd, 0);
  for (size_t p = 0; p < count; ++p) {
    Piece piece;
    piece.hf_box.offsets.resize(nd - lead);
    piece.hf_box.lengths.resize(nd - lead);
    piece.local_box.offsets.resize(nd);
    piece.local_box.lengths.resize(nd);
    int64_t entry = 0, part = 0;
    for (size_t d = 0; d < nd; ++d) {
      const PlacedRun& r = placed[d][idx[d]];
      piece.local_box.offsets[d] = r.local;
      piece.local_box.lengths[d] = r.length;
      if (d < lead) {
        entry = r.key;  // a run of length 1: the entry's index
        continue;
      }
      piece.hf_box.offsets[d - lead] = r.global;
      piece.hf_box.lengths[d - lead] = r.length;
      if (d == fused) part = r.key;
    }
    piece.key = static_cast<int>(entry * per_entry + part);
    pieces.push_back(std::move(piece));
    for (size_t d = nd; d-- > 0;) {
      if (++idx[d] < placed[d].size()) break;
      idx[d] = 0;
    }
  }
  return pieces;
}

}  // namespace weightsync
