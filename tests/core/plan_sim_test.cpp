// Support for the planner tests (named *_test.cpp so that the tests/ build
// compiles it into ws_planner_tests): random layouts and the element-level
// simulation declared in plan_sim.h.
#include "plan_sim.h"

#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <map>

namespace weightsync::test {
namespace {

// Calls f(i, coords) for every element of `box` in row-major order.
template <class F>
void for_each_element(const Box& box, F f) {
  const int64_t n = box.numel();
  Shape c = box.offsets;
  for (int64_t i = 0; i < n; ++i) {
    f(i, c);
    for (size_t d = box.rank(); d-- > 0;) {
      if (++c[d] < box.end(d)) break;
      c[d] = box.offsets[d];
    }
  }
}

// The local coords of HF coords `h` of a piece (hf_box -> local_box, which
// may lead with a stack dim the HF box lacks).
Shape to_local(const Box& hf_box, const Box& local_box, const Shape& h) {
  const size_t lead = local_box.rank() - hf_box.rank();
  Shape l = local_box.offsets;
  for (size_t d = 0; d < h.size(); ++d) l[lead + d] += h[d] - hf_box.offsets[d];
  return l;
}

int64_t flat(const Shape& shape, const Shape& c) {
  int64_t idx = 0;
  for (size_t d = 0; d < shape.size(); ++d) idx = idx * shape[d] + c[d];
  return idx;
}

// An element's identity: its HF key (1-based) and flat index in that key.
uint64_t element_id(int key, int64_t index) {
  return (static_cast<uint64_t>(key + 1) << 40) | static_cast<uint64_t>(index);
}

// The param coords of HF coords `h` of segment `s` (test's own arithmetic).
Shape to_param(const Segment& s, const Shape& h) {
  const size_t n = h.size(), lead = s.param_box.rank() - n;
  Shape p = s.param_box.offsets;
  for (size_t d = 0; d < n; ++d) {
    size_t to = d;
    if (s.transpose && n >= 2 && d == n - 1) to = n - 2;
    if (s.transpose && n >= 2 && d == n - 2) to = n - 1;
    p[lead + to] += h[d] - s.hf_box.offsets[d];
  }
  return p;
}

struct Engine {
  std::vector<std::vector<uint64_t>> want, got;  // per param of one engine rank
  std::vector<std::vector<int>> writes;
};

class Simulator {
 public:
  Simulator(const Plan& plan, const TrainerLayout& trainer, const EngineLayout& engine)
      : plan_(plan), trainer_(trainer), engine_(engine) {
    int k = 0;
    for (const LoadSpec& spec : trainer.params)
      for (const std::string& key : spec.hf_keys) key_ids_[key] = k++;
  }

  // Rank r's local tensor of param p, each element its HF identity (0: padding).
  const std::vector<uint64_t>& local(int r, int p) {
    auto& t = local_[{r, p}];
    if (!t.empty()) return t;
    const LoadSpec& spec = trainer_.params[static_cast<size_t>(p)];
    const Shape shape = local_shape(spec, trainer_.mesh, r);
    const Shape key_shape = spec.hf_key_shape();
    t.assign(static_cast<size_t>(numel(shape)), 0);
    for (const Piece& piece : local_pieces(spec, trainer_.mesh, r)) {
      const int key = key_ids_.at(spec.hf_keys[static_cast<size_t>(piece.key)]);
      for_each_element(piece.hf_box, [&](int64_t i, const Shape& h) {
        const Shape l = to_local(piece.hf_box, piece.local_box, h);
        t[static_cast<size_t>(flat(shape, l))] = element_id(key, flat(key_shape, h));
      });
    }
    return t;
  }

  Engine make_engine(int g) {
    Engine e;
    for (const EngineParam& p : engine_.rank_layout(g).params) {
      e.want.emplace_back(static_cast<size_t>(numel(p.shape)), 0);
      e.got.emplace_back(static_cast<size_t>(numel(p.shape)), 0);
      e.writes.emplace_back(static_cast<size_t>(numel(p.shape)), 0);
      for (const Segment& s : p.segments) {
        const int key = key_ids_.at(s.hf_key);
        const Shape key_shape = plan_.keys()[static_cast<size_t>(key)].shape;
        for_each_element(s.hf_box, [&](int64_t, const Shape& h) {
          e.want.back()[static_cast<size_t>(flat(p.shape, to_param(s, h)))] =
              element_id(key, flat(key_shape, h));
        });
      }
    }
    return e;
  }

  // Copies a resolved item's elements from the trainer rank into `buf`.
  void pack(const Copy& c, std::vector<uint64_t>& buf) {
    const LoadSpec& spec = trainer_.params[static_cast<size_t>(c.src_param)];
    const Shape shape = local_shape(spec, trainer_.mesh, c.src_rank);
    const auto& src = local(c.src_rank, c.src_param);
    const Shape& key_shape = plan_.keys()[static_cast<size_t>(c.key)].shape;
    const int64_t item = static_cast<int64_t>(itemsize(c.dtype));
    for_each_element(c.hf_box, [&](int64_t i, const Shape& h) {
      const Shape l = to_local(c.hf_box, c.src_box, h);
      const uint64_t v = src.at(static_cast<size_t>(flat(shape, l)));
      EXPECT_EQ(v, element_id(c.key, flat(key_shape, h)))
          << "trainer rank " << c.src_rank << " does not hold that element of "
          << plan_.keys()[static_cast<size_t>(c.key)].name;
      buf.at(static_cast<size_t>(c.offset + i * item)) = v;
    });
  }

  // Applies a resolved item (view at c.offset of c.view_box) into engine e.
  void apply(const Copy& c, const std::vector<uint64_t>& buf, Engine& e, int g) {
    const EngineParam& p = engine_.rank_layout(g).params.at(static_cast<size_t>(c.dst_param));
    const int64_t item = static_cast<int64_t>(itemsize(c.dtype));
    Segment s;  // the item as a segment: its own HF box onto its dst box
    s.hf_box = c.hf_box;
    s.param_box = c.dst_box;
    s.transpose = c.transpose;
    for_each_element(c.hf_box, [&](int64_t, const Shape& h) {
      Shape v = h;
      for (size_t d = 0; d < v.size(); ++d) v[d] -= c.view_box.offsets[d];
      const int64_t at = c.offset + flat(c.view_box.lengths, v) * item;
      const size_t idx = static_cast<size_t>(flat(p.shape, to_param(s, h)));
      auto& slot = e.got[static_cast<size_t>(c.dst_param)];
      slot.at(idx) = buf.at(static_cast<size_t>(at));
      ++e.writes[static_cast<size_t>(c.dst_param)][idx];
    });
  }

  void check(const Engine& e, int g) {
    const auto& params = engine_.rank_layout(g).params;
    for (size_t q = 0; q < params.size(); ++q) {
      int bad = 0;
      for (size_t i = 0; i < e.want[q].size() && bad < 3; ++i) {
        const int want_writes = e.want[q][i] ? 1 : 0;
        if (e.writes[q][i] != want_writes || e.got[q][i] != e.want[q][i]) {
          ++bad;
          ADD_FAILURE() << "engine rank " << g << " param " << params[q].name << " element " << i
                        << ": written " << e.writes[q][i] << " times, want " << want_writes
                        << (e.got[q][i] != e.want[q][i] ? " (wrong data)" : "");
        }
      }
    }
  }

  const Plan& plan_;
  const TrainerLayout& trainer_;
  const EngineLayout& engine_;
  std::map<std::string, int> key_ids_;
  std::map<std::pair<int, int>, std::vector<uint64_t>> local_;
};

}  // namespace

std::string model_config_path(const std::string& name) {
  return std::string(WEIGHTSYNC_SOURCE_DIR) + "/configs/models/" + name + "/config.json";
}

const std::vector<std::string>& tiny_models() {
  static const std::vector<std::string> models = {
      "tiny-llama",     "tiny-qwen2",   "tiny-qwen3",      "tiny-qwen3-moe",
      "tiny-qwen2-moe", "tiny-mixtral", "tiny-deepseek-v3"};
  return models;
}

EngineConfig random_engine_config(const std::string& model, std::mt19937_64& rng) {
  EngineConfig c;
  c.hf = HfModelConfig::load(model_config_path(model));
  c.dtype = c.hf.dtype;
  c.framework = rng() % 5 == 0 ? "hf" : rng() % 2 ? "vllm" : "sglang";
  c.replicas = 1 + static_cast<int>(rng() % 2);
  c.expert_parallel = c.hf.is_moe() && rng() % 2;
  c.expert_placement = rng() % 2 ? "linear" : "round_robin";
  for (int tp : {4, 2, 1}) {
    if (tp > 1 && rng() % 3 == 0) continue;
    c.tp = tp;
    try {
      make_engine_layout(c);
      return c;
    } catch (const Error&) {
    }
  }
  c.tp = 1;
  return c;
}

namespace {

// Redraws one param's shards (and tail padding) at random.
void redraw_param(LoadSpec& spec, const Mesh& mesh, std::mt19937_64& rng) {
  spec.shards.clear();
  std::vector<std::string> axes = mesh.axes;
  std::shuffle(axes.begin(), axes.end(), rng);
  const size_t nshards = rng() % (axes.size() + 1);
  for (size_t i = 0; i < nshards; ++i) {
    ShardSpec sh;
    sh.axis = axes[i];
    sh.dim = static_cast<int>(rng() % spec.global_shape.size());
    sh.interleave = rng() % 4 == 0 ? 2 : 1;
    spec.shards.push_back(sh);
  }
  if (rng() % 3 == 0) {
    if (spec.origin_shape.empty()) spec.origin_shape = spec.global_shape;
    const size_t d = rng() % spec.global_shape.size();
    spec.global_shape[d] += 1 + static_cast<int64_t>(rng() % 3);
  }
}

}  // namespace

TrainerLayout random_trainer_layout(const std::string& model, std::mt19937_64& rng) {
  const HfModelConfig config = HfModelConfig::load(model_config_path(model));
  Mesh mesh;
  const int64_t ep = config.is_moe() ? 1 + static_cast<int64_t>(rng() % 2) : 1;
  mesh.axes = {"ep", "fsdp", "dp"};
  mesh.shape = {ep, 1 + static_cast<int64_t>(rng() % 4), 1 + static_cast<int64_t>(rng() % 2)};
  TrainerLayoutOptions options;
  // Half the MoE cases hold experts stacked, as transformers >= 5 does.
  if (config.is_moe() && rng() % 2) options.style = TrainerLayoutStyle::transformers;
  TrainerLayout layout;
  try {
    layout = make_trainer_layout(config, mesh, options);
  } catch (const Error&) {
    mesh.shape[0] = 1;
    layout = make_trainer_layout(config, mesh, options);
  }
  for (LoadSpec& spec : layout.params) {
    if (rng() % 2) continue;
    const LoadSpec keep = spec;
    redraw_param(spec, layout.mesh, rng);
    try {
      layout.validate();
    } catch (const Error&) {
      spec = keep;  // an invalid draw (e.g. interleave not dividing): keep the original
    }
  }
  return layout;
}

SimResult simulate(const Plan& plan, const TrainerLayout& trainer, const EngineLayout& engine) {
  Simulator sim(plan, trainer, engine);
  SimResult out;
  out.bytes_in.assign(static_cast<size_t>(engine.world()), 0);
  std::vector<Engine> engines;
  for (int g = 0; g < engine.world(); ++g) engines.push_back(sim.make_engine(g));
  for (const Bucket& b : plan.buckets()) {
    std::vector<uint64_t> buf(static_cast<size_t>(b.bytes), 0);
    for (const PlanItem& item : plan.items(b.id)) sim.pack(plan.resolve(item), buf);
    if (plan.mode() == PlanMode::p2p) {
      out.bytes_in[static_cast<size_t>(b.dst_rank)] += b.bytes;
      for (const PlanItem& item : plan.items(b.id))
        sim.apply(plan.resolve(item), buf, engines[static_cast<size_t>(b.dst_rank)], b.dst_rank);
      continue;
    }
    for (int g = 0; g < engine.world(); ++g) {
      if (!plan.serves(g)) continue;  // elastic replicas: outside the membership
      out.bytes_in[static_cast<size_t>(g)] += b.bytes;
      // The simulation's own mapping of ranks to templates, not the plan's.
      for (const ApplyItem& a : plan.apply_items(b.id, engine.template_of(g)))
        sim.apply(plan.resolve(a, g), buf, engines[static_cast<size_t>(g)], g);
    }
  }
  // Ranks the plan does not serve (elastic replicas) must get nothing at all.
  for (int g = 0; g < engine.world(); ++g)
    if (plan.serves(g))
      sim.check(engines[static_cast<size_t>(g)], g);
    else
      EXPECT_EQ(out.bytes_in[static_cast<size_t>(g)], 0) << "unserved engine rank " << g;
  std::vector<bool> used(plan.keys().size(), false);
  for (const auto& rank : engine.ranks)
    for (const EngineParam& p : rank.params)
      for (const Segment& s : p.segments)
        used[static_cast<size_t>(sim.key_ids_.at(s.hf_key))] = true;
  for (size_t k = 0; k < used.size(); ++k)
    if (used[k])
      out.model_bytes +=
          numel(plan.keys()[k].shape) * static_cast<int64_t>(itemsize(plan.keys()[k].dtype));
  return out;
}

}  // namespace weightsync::test
