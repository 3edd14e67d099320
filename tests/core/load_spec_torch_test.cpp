// Cross-check of LoadSpec geometry against PyTorch itself: for seeded random
// specs, a Python script shards torch.arange(numel).reshape(global_shape)
// with torch.chunk as DTensor's Shard does (trailing ranks empty), interleave
// as w*F equal chunks; every element a piece places must carry the value
// that torch puts at that local position. Skipped without Python + torch.
#include <weightsync/box.h>
#include <weightsync/error.h>
#include <weightsync/load_spec.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

namespace weightsync {
namespace {

const char* kPython = WEIGHTSYNC_TEST_PYTHON;

// Reads cases [{mesh, spec}] from argv[1]; prints, per case and rank, the
// local tensor's shape and flat values.
const char* kScript = R"PY(
import json, sys, torch
cases = json.load(open(sys.argv[1]))
out = []
for c in cases:
    axes, shape = c["axes"], c["shape"]
    world = 1
    for s in shape: world *= s
    glob = c["global"]
    n = 1
    for g in glob: n *= g
    base = torch.arange(n, dtype=torch.int64).reshape(glob)
    ranks = []
    for rank in range(world):
        coords, rem = [], rank
        for s in reversed(shape):
            coords.append(rem % s); rem //= s
        coords.reverse()
        t = base
        for sh in c["shards"]:
            a = axes.index(sh["axis"]); w = shape[a]; r = coords[a]; d = sh["dim"]
            f = sh.get("interleave", 1)
            if t.shape[d] == 0:
                continue
            if f == 1:
                parts = torch.chunk(t, w, d)
                t = parts[r] if r < len(parts) else t.narrow(d, 0, 0)
            else:
                parts = torch.chunk(t, w * f, d)
                t = torch.cat([parts[j * w + r] for j in range(f)], d)
        ranks.append({"shape": list(t.shape), "values": t.contiguous().reshape(-1).tolist()})
    out.append(ranks)
json.dump(out, sys.stdout)
)PY";

bool have_torch() {
  const std::string cmd = std::string(kPython) + " -c 'import torch' >/dev/null 2>&1";
  return ::access(kPython, X_OK) == 0 && std::system(cmd.c_str()) == 0;
}

std::string run_python(const std::string& script, const std::string& arg) {
  const std::string cmd = std::string(kPython) + " " + script + " " + arg;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (!pipe) return "";
  std::string out;
  char buf[65536];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) out.append(buf, n);
  ::pclose(pipe);
  return out;
}

struct TorchCase {
  Mesh mesh;
  LoadSpec spec;
};

// Random specs that validate: interleave only where every rank's extent divides.
std::vector<TorchCase> random_cases(int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::vector<TorchCase> cases;
  while (static_cast<int>(cases.size()) < count) {
    TorchCase c;
    const int64_t naxes = pick(1, 3);
    for (int64_t i = 0; i < naxes; ++i) {
      c.mesh.axes.push_back(std::string(1, static_cast<char>('a' + i)));
      c.mesh.shape.push_back(pick(1, 5));
    }
    LoadSpec& s = c.spec;
    s.name = "p";
    s.hf_keys = {"k"};
    const int64_t ndim = pick(1, 2);
    for (int64_t d = 0; d < ndim; ++d) s.global_shape.push_back(pick(0, ndim == 1 ? 48 : 12));
    s.origin_shape = s.global_shape;
    std::vector<std::string> axes = c.mesh.axes;
    std::shuffle(axes.begin(), axes.end(), rng);
    for (int64_t i = 0, n = pick(0, naxes); i < n; ++i)
      s.shards.push_back({static_cast<int>(pick(0, ndim - 1)), axes[i], pick(0, 3) == 0 ? 2 : 1});
    try {
      TrainerLayout{c.mesh, {s}}.validate();
    } catch (const Error&) {
      continue;
    }
    cases.push_back(std::move(c));
  }
  return cases;
}

TEST(LoadSpecTorch, PiecesMatchTorchChunk) {
  if (!have_torch()) GTEST_SKIP() << kPython << " with torch is not available";
  const auto dir =
      std::filesystem::temp_directory_path() / ("ws_ls_torch_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::vector<TorchCase> cases = random_cases(150, 424242);
  nlohmann::json j = nlohmann::json::array();
  for (const auto& c : cases) {
    nlohmann::json shards = nlohmann::json::array();
    for (const auto& s : c.spec.shards)
      shards.push_back({{"dim", s.dim}, {"axis", s.axis}, {"interleave", s.interleave}});
    j.push_back({{"axes", c.mesh.axes},
                 {"shape", c.mesh.shape},
                 {"global", c.spec.global_shape},
                 {"shards", shards}});
  }
  std::ofstream((dir / "cases.json").string()) << j.dump();
  std::ofstream((dir / "shard.py").string()) << kScript;
  const std::string out = run_python((dir / "shard.py").string(), (dir / "cases.json").string());
  std::filesystem::remove_all(dir);
  const nlohmann::json torch = nlohmann::json::parse(out, nullptr, false);
  ASSERT_TRUE(torch.is_array() && torch.size() == cases.size()) << out.substr(0, 500);
  for (size_t i = 0; i < cases.size(); ++i) {
    const TorchCase& c = cases[i];
    SCOPED_TRACE(j[i].dump());
    const Shape gstrides = contiguous_strides(c.spec.global_shape);
    for (int64_t r = 0; r < c.mesh.world(); ++r) {
      const Shape local = local_shape(c.spec, c.mesh, r);
      ASSERT_EQ(torch[i][r]["shape"].get<Shape>(), local) << "rank " << r;
      const auto values = torch[i][r]["values"].get<std::vector<int64_t>>();
      const Shape lstrides = contiguous_strides(local);
      int64_t covered = 0;
      for (const Piece& p : local_pieces(c.spec, c.mesh, r)) {
        // Walk the piece's elements: local flat index -> expected global flat index.
        const int64_t n = p.local_box.numel();
        for (int64_t e = 0; e < n; ++e) {
          int64_t rem = e, lflat = 0, gflat = 0;
          for (size_t d = p.local_box.rank(); d-- > 0;) {
            const int64_t x = rem % p.local_box.lengths[d];
            rem /= p.local_box.lengths[d];
            lflat += (p.local_box.offsets[d] + x) * lstrides[d];
            gflat += (p.hf_box.offsets[d] + x) * gstrides[d];
          }
          ASSERT_EQ(values.at(lflat), gflat) << "rank " << r << " piece " << box_str(p.local_box);
        }
        covered += n;
      }
      EXPECT_EQ(covered, numel(local)) << "rank " << r;
    }
  }
}

}  // namespace
}  // namespace weightsync
