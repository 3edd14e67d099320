// Property tests of LoadSpec geometry over seeded random shapes and meshes,
// against an element-by-element reference that follows DESIGN.md literally
// (index lists instead of runs).
#include <weightsync/error.h>
#include <weightsync/load_spec.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <map>
#include <numeric>
#include <optional>
#include <random>

namespace weightsync {
namespace {

using Indices = std::vector<std::vector<int64_t>>;  // per dim: local index -> global index

// The reference: per dim, the global index of every local index, or nullopt
// when an interleave does not divide the extent it cuts on this rank.
std::optional<Indices> reference_indices(const LoadSpec& spec, const Mesh& mesh, int64_t rank) {
  const auto coords = mesh.coords(rank);
  Indices idx(spec.global_shape.size());
  for (size_t d = 0; d < idx.size(); ++d) {
    idx[d].resize(spec.global_shape[d]);
    std::iota(idx[d].begin(), idx[d].end(), 0);
  }
  for (const ShardSpec& s : spec.shards) {
    const int a = mesh.axis_index(s.axis);
    const int64_t w = mesh.shape[a], r = coords[a];
    const std::vector<int64_t>& cur = idx[s.dim];
    const int64_t n = static_cast<int64_t>(cur.size());
    std::vector<int64_t> next;
    if (s.interleave == 1) {
      const int64_t chunk = (n + w - 1) / w;
      for (int64_t i = std::min(n, r * chunk); i < std::min(n, (r + 1) * chunk); ++i)
        next.push_back(cur[i]);
    } else {
      if (n % (w * s.interleave) != 0) return std::nullopt;
      const int64_t seg = n / (w * s.interleave);
      for (int64_t j = 0; j < s.interleave; ++j)
        for (int64_t i = 0; i < seg; ++i) next.push_back(cur[(j * w + r) * seg + i]);
    }
    idx[s.dim] = std::move(next);
  }
  return idx;
}

// Calls f(multi_index) for every element of `lengths` offset by `offsets`.
template <class F>
void for_each_element(const Shape& offsets, const Shape& lengths, F&& f) {
  if (numel(lengths) == 0) return;
  Shape at = offsets;
  while (true) {
    f(at);
    size_t d = lengths.size();
    while (d-- > 0) {
      if (++at[d] < offsets[d] + lengths[d]) break;
      at[d] = offsets[d];
    }
    if (d == static_cast<size_t>(-1)) return;
  }
}

int64_t flat(const Shape& at, const Shape& shape) {
  int64_t f = 0;
  for (size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + at[d];
  return f;
}

struct Case {
  Mesh mesh;
  LoadSpec spec;
};

Case random_case(std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  Case c;
  const std::vector<std::string> names = {"a", "b", "c"};
  const int64_t naxes = pick(1, 3);
  for (int64_t i = 0; i < naxes; ++i) {
    c.mesh.axes.push_back(names[i]);
    c.mesh.shape.push_back(pick(1, 4));
  }
  LoadSpec& s = c.spec;
  s.name = "p";
  const int64_t ndim = pick(1, 3);
  for (int64_t d = 0; d < ndim; ++d) {
    const int64_t g = pick(0, 9) == 0 ? 0 : pick(1, ndim == 1 ? 40 : 10);
    s.global_shape.push_back(g);
    s.origin_shape.push_back(pick(0, 2) == 0 ? std::max<int64_t>(0, g - pick(0, 3)) : g);
  }
  std::vector<std::string> axes = c.mesh.axes;
  std::shuffle(axes.begin(), axes.end(), rng);
  const int64_t nshards = pick(0, naxes);
  for (int64_t i = 0; i < nshards; ++i)
    s.shards.push_back({static_cast<int>(pick(0, ndim - 1)), axes[i], pick(0, 4) == 0 ? 2 : 1});
  s.hf_keys = {"k0"};
  if (pick(0, 1) == 1) {
    const int fd = static_cast<int>(pick(0, ndim - 1));
    std::vector<int64_t> divisors;
    for (int64_t k = 2; k <= s.origin_shape[fd]; ++k)
      if (s.origin_shape[fd] % k == 0) divisors.push_back(k);
    if (!divisors.empty()) {
      const int64_t nkeys = divisors[pick(0, static_cast<int64_t>(divisors.size()) - 1)];
      s.fused_dim = fd;
      s.hf_keys.clear();
      for (int64_t k = 0; k < nkeys; ++k) s.hf_keys.push_back("k" + std::to_string(k));
    }
  }
  return c;
}

// The coordinates of `rank` on the axes that `spec` does not shard: ranks
// with equal values form one replica group.
std::vector<int64_t> replica_group(const LoadSpec& spec, const Mesh& mesh, int64_t rank) {
  std::vector<int64_t> group;
  const auto coords = mesh.coords(rank);
  for (size_t a = 0; a < mesh.axes.size(); ++a) {
    bool sharded = false;
    for (const auto& s : spec.shards) sharded |= s.axis == mesh.axes[a];
    if (!sharded) group.push_back(coords[a]);
  }
  return group;
}

// Checks one rank's pieces against the reference; adds its HF elements to
// `counts` (per key, flat index -> times held).
void check_rank(const Case& c, int64_t rank, const Indices& ref,
                std::vector<std::vector<int>>& counts) {
  const LoadSpec& s = c.spec;
  const Shape key_shape = s.hf_key_shape();
  const int64_t extent = s.fused_dim ? key_shape[*s.fused_dim] : 0;
  Shape local(ref.size());
  for (size_t d = 0; d < ref.size(); ++d) local[d] = static_cast<int64_t>(ref[d].size());
  ASSERT_EQ(local_shape(s, c.mesh, rank), local);
  std::vector<int> covered(numel(local), 0);
  for (const Piece& p : local_pieces(s, c.mesh, rank)) {
    ASSERT_FALSE(p.local_box.empty());
    ASSERT_TRUE(p.local_box.fits(local)) << box_str(p.local_box);
    ASSERT_TRUE(p.hf_box.fits(key_shape)) << box_str(p.hf_box);
    ASSERT_EQ(p.local_box.lengths, p.hf_box.lengths);
    ASSERT_GE(p.key, 0);
    ASSERT_LT(p.key, static_cast<int>(s.hf_keys.size()));
    for_each_element(p.local_box.offsets, p.local_box.lengths, [&](const Shape& at) {
      // The reference global index of this element, relative to its key.
      Shape hf(at.size());
      int key = 0;
      for (size_t d = 0; d < at.size(); ++d) {
        int64_t g = ref[d][at[d]];
        if (s.fused_dim && static_cast<size_t>(*s.fused_dim) == d) {
          key = static_cast<int>(g / extent);
          g -= key * extent;
        }
        hf[d] = g;
        ASSERT_EQ(g, p.hf_box.offsets[d] + at[d] - p.local_box.offsets[d]) << "dim " << d;
      }
      ASSERT_EQ(key, p.key);
      ++covered[flat(at, local)];
      ++counts[key][flat(hf, key_shape)];
    });
  }
  // Local boxes tile exactly the non-padding local elements.
  for_each_element(Shape(local.size(), 0), local, [&](const Shape& at) {
    bool padding = false;
    for (size_t d = 0; d < at.size(); ++d) padding |= ref[d][at[d]] >= s.origin_shape[d];
    ASSERT_EQ(covered[flat(at, local)], padding ? 0 : 1) << "rank " << rank;
  });
}

TEST(LoadSpecProperty, RandomLayoutsCoverEveryKeyExactlyOncePerReplicaGroup) {
  std::mt19937_64 rng(20240601);
  int valid = 0, invalid = 0;
  for (int iter = 0; iter < 400; ++iter) {
    const Case c = random_case(rng);
    const TrainerLayout as_layout{c.mesh, {c.spec}};
    SCOPED_TRACE(as_layout.to_json().dump());
    std::vector<std::optional<Indices>> refs;
    bool ref_valid = true;
    for (int64_t r = 0; r < c.mesh.world(); ++r) {
      refs.push_back(reference_indices(c.spec, c.mesh, r));
      ref_valid &= refs.back().has_value();
    }
    bool validates = true;
    try {
      TrainerLayout{c.mesh, {c.spec}}.validate();
    } catch (const Error& e) {
      ASSERT_EQ(e.code(), Errc::invalid_layout) << e.what();
      validates = false;
    }
    ASSERT_EQ(validates, ref_valid) << "validate() and the reference disagree";
    if (!validates) {
      ++invalid;
      continue;
    }
    ++valid;
    const int64_t key_numel = numel(c.spec.hf_key_shape());
    std::map<std::vector<int64_t>, std::vector<std::vector<int>>> groups;
    for (int64_t r = 0; r < c.mesh.world(); ++r) {
      auto& counts = groups[replica_group(c.spec, c.mesh, r)];
      if (counts.empty()) counts.assign(c.spec.hf_keys.size(), std::vector<int>(key_numel, 0));
      check_rank(c, r, *refs[r], counts);
      if (HasFatalFailure()) return;
    }
    for (const auto& [group, counts] : groups)
      for (size_t k = 0; k < counts.size(); ++k)
        for (int64_t i = 0; i < key_numel; ++i)
          ASSERT_EQ(counts[k][i], 1) << "key " << k << " element " << i;
  }
  // Both kinds of case must occur, or the test checks less than it says.
  EXPECT_GT(valid, 250);
  EXPECT_GT(invalid, 5);
}

}  // namespace
}  // namespace weightsync
