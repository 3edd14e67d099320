// verify_plan: checks a plan against the layouts it claims to connect, with
// its own arithmetic (it recomputes the trainer pieces and reads the engine
// segments again instead of trusting the plan's tables).
#include <weightsync/error.h>
#include <weightsync/plan.h>

#include <algorithm>
#include <map>

namespace weightsync {
namespace {

// The engine box of a sub-box `hf` of a segment (transpose, leading 1-dims).
Box param_box_of(const Segment& s, const Box& hf) {
  const size_t n = hf.rank(), lead = s.param_box.rank() - n;
  Box out = s.param_box;
  for (size_t d = 0; d < n; ++d) {
    const size_t to = s.transpose && n >= 2 && d >= n - 2 ? (d == n - 1 ? n - 2 : n - 1) : d;
    out.offsets[lead + to] = s.param_box.offsets[lead + to] + hf.offsets[d] - s.hf_box.offsets[d];
    out.lengths[lead + to] = hf.lengths[d];
  }
  return out;
}

class Verifier {
 public:
  Verifier(const Plan& plan, const TrainerLayout& trainer, const EngineLayout& engine)
      : plan_(plan), trainer_(trainer), engine_(engine) {}

  void check_source(const Copy& c) {
    auto& pieces = pieces_[{c.src_rank, c.src_param}];
    const LoadSpec& spec = trainer_.params.at(static_cast<size_t>(c.src_param));
    if (pieces.empty()) pieces = local_pieces(spec, trainer_.mesh, c.src_rank);
    const std::string& key = plan_.keys().at(static_cast<size_t>(c.key)).name;
    for (const Piece& p : pieces) {
      if (spec.hf_keys[static_cast<size_t>(p.key)] != key || !p.hf_box.contains(c.hf_box)) continue;
      if (local_sub_box(p.hf_box, p.local_box, c.hf_box) == c.src_box) return;
    }
    fail(Errc::internal, "plan: trainer rank ", c.src_rank, " param '", spec.name,
         "' holds no piece with ", box_str(c.hf_box), " of '", key, "' at local ",
         box_str(c.src_box));
  }

  // Checks the destination and records the box for the cover check.
  void check_destination(const Copy& c, int engine_rank) {
    const EngineRankLayout& rank = engine_.rank_layout(engine_rank);
    const EngineParam& param = rank.params.at(static_cast<size_t>(c.dst_param));
    const std::string& key = plan_.keys()[static_cast<size_t>(c.key)].name;
    bool found = false;
    for (const Segment& s : param.segments)
      found = found || (s.hf_key == key && s.hf_box.contains(c.hf_box) &&
                        s.transpose == c.transpose && param_box_of(s, c.hf_box) == c.dst_box);
    if (!found)
      fail(Errc::internal, "plan: engine rank ", engine_rank, " param '", param.name,
           "' has no segment taking ", box_str(c.hf_box), " of '", key, "' to ",
           box_str(c.dst_box));
    const int t = plan_.engine_template(engine_rank);
    if (c.fp8 != plan_.fp8_on_sender(t, c.dst_param) || (c.fp8 && !param.quant))
      fail(Errc::internal, "plan: engine rank ", engine_rank, " param '", param.name, "': an item ",
           c.fp8 ? "quantized by its sender" : "in the source dtype", ", but the plan says it is ",
           plan_.fp8_on_sender(t, c.dst_param) ? "" : "not ", "quantized by the senders");
    if (c.fp8) check_fp8(c, engine_rank, param, key);
    written_[{engine_rank, c.dst_param}].push_back(c.dst_box);
  }

  // A sender-quantized item holds whole blocks of its segment (on both
  // sides), and its scales land in the blocks of its codes.
  void check_fp8(const Copy& c, int engine_rank, const EngineParam& param, const std::string& key) {
    const size_t n = c.dst_box.rank();
    bool whole = c.scale_param == param.scale_param && c.scale_box.rank() == n && n >= 2;
    for (size_t d = n - 2; whole && d < n; ++d) {
      const int64_t end = c.dst_box.offsets[d] + c.dst_box.lengths[d];
      whole = c.dst_box.offsets[d] % 128 == 0 && (end % 128 == 0 || ends_on_segment(param, c, d)) &&
              c.scale_box.offsets[d] == c.dst_box.offsets[d] / 128 &&
              c.scale_box.lengths[d] == (c.dst_box.lengths[d] + 127) / 128;
    }
    if (!whole)
      fail(Errc::internal, "plan: engine rank ", engine_rank, " param '", param.name,
           "': ", box_str(c.hf_box), " of '", key,
           "' quantized by its sender holds part of a block (to ", box_str(c.dst_box), ", scales ",
           box_str(c.scale_box), ")");
  }

  // Whether dst_box's end along param dim d is where a segment ends (an edge
  // block), as opposed to inside one.
  static bool ends_on_segment(const EngineParam& param, const Copy& c, size_t d) {
    const int64_t end = c.dst_box.offsets[d] + c.dst_box.lengths[d];
    for (const Segment& s : param.segments)
      if (s.param_box.offsets[d] + s.param_box.lengths[d] == end) return true;
    return false;
  }

  // Every (rank, param) written exactly once where its segments say.
  void check_cover(int first_rank, int last_rank) {
    for (int g = first_rank; g < last_rank; ++g) {
      const EngineRankLayout& rank = engine_.rank_layout(g);
      for (size_t q = 0; q < rank.params.size(); ++q) {
        int64_t want = 0;
        for (const Segment& s : rank.params[q].segments) want += s.hf_box.numel();
        auto it = written_.find({g, static_cast<int>(q)});
        std::vector<Box> none;
        check_disjoint_sum(it == written_.end() ? none : it->second, want,
                           cat("engine rank ", g, " param '", rank.params[q].name, "'"));
      }
    }
  }

  static void check_disjoint_sum(std::vector<Box>& boxes, int64_t want, const std::string& what) {
    std::sort(boxes.begin(), boxes.end(), [](const Box& a, const Box& b) {
      return a.offsets != b.offsets ? a.offsets < b.offsets : a.lengths < b.lengths;
    });
    int64_t sum = 0;
    for (size_t i = 0; i < boxes.size(); ++i) {
      sum += boxes[i].numel();
      for (size_t j = i + 1; j < boxes.size() && boxes[j].offsets[0] < boxes[i].end(0); ++j)
        if (intersect(boxes[i], boxes[j]))
          fail(Errc::internal, "plan: ", what, ": ", box_str(boxes[i]), " and ", box_str(boxes[j]),
               " are written twice");
    }
    if (sum != want)
      fail(Errc::internal, "plan: ", what, " gets ", sum, " elements, expected ", want);
  }

  // Item byte ranges inside each bucket: in bounds and disjoint.
  void check_bucket(const Bucket& b) {
    if (b.bytes > plan_.options().bucket_bytes)
      fail(Errc::internal, "plan: bucket ", b.id, " holds ", b.bytes, " bytes > bucket_bytes ",
           plan_.options().bucket_bytes);
    std::vector<std::pair<int64_t, int64_t>> ranges;
    int64_t sum = 0;
    for (const PlanItem& item : plan_.items(b.id)) {
      const Copy c = plan_.resolve(item);
      if (item.bucket != b.id || c.offset + c.bytes > b.bytes)
        fail(Errc::internal, "plan: item of '", plan_.keys()[static_cast<size_t>(c.key)].name,
             "' lies outside bucket ", b.id);
      ranges.push_back({c.offset, c.offset + c.bytes});
      sum += c.bytes;
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i)
      if (ranges[i].first < ranges[i - 1].second)
        fail(Errc::internal, "plan: items overlap in bucket ", b.id);
    if (sum != b.bytes)
      fail(Errc::internal, "plan: bucket ", b.id, " says ", b.bytes, " bytes, items hold ", sum);
  }

  // In the trainer's dtypes (an FP8 param quantized on the engine receives
  // its source bytes; one quantized by the senders its codes and scales).
  int64_t rank_param_bytes(int g) const {
    std::map<std::string_view, DType> dtypes;
    for (const PlanKey& k : plan_.keys()) dtypes.emplace(k.name, k.dtype);
    int64_t bytes = 0;
    const auto& params = engine_.rank_layout(g).params;
    for (size_t q = 0; q < params.size(); ++q) {
      const bool fp8 = plan_.fp8_on_sender(plan_.engine_template(g), static_cast<int>(q));
      for (const Segment& s : params[q].segments)
        bytes += fp8 ? fp8_wire_bytes(s.hf_box)
                     : s.hf_box.numel() * static_cast<int64_t>(itemsize(dtypes.at(s.hf_key)));
    }
    return bytes;
  }

  std::map<std::pair<int, int>, std::vector<Box>> written_;

 private:
  const Plan& plan_;
  const TrainerLayout& trainer_;
  const EngineLayout& engine_;
  std::map<std::pair<int, int>, std::vector<Piece>> pieces_;
};

void verify_p2p(const Plan& plan, Verifier& v, const EngineLayout& engine) {
  std::vector<int64_t> sent(static_cast<size_t>(plan.trainer_world()), 0);
  std::vector<int64_t> received(static_cast<size_t>(engine.world()), 0);
  for (const Bucket& b : plan.buckets()) {
    v.check_bucket(b);
    received.at(static_cast<size_t>(b.dst_rank)) += b.bytes;
    for (const PlanItem& item : plan.items(b.id)) {
      const Copy c = plan.resolve(item);
      if (c.src_rank != b.src_rank || c.dst_rank != b.dst_rank)
        fail(Errc::internal, "plan: item of bucket ", b.id, " on another link");
      v.check_source(c);
      v.check_destination(c, c.dst_rank);
    }
    sent[static_cast<size_t>(b.src_rank)] += b.bytes;
  }
  for (int g = 0; g < engine.world(); ++g) {
    const int64_t got = plan.stats().bytes_per_engine_rank.at(static_cast<size_t>(g));
    if (!plan.serves(g)) {
      // Elastic replicas: a rank outside the membership receives nothing.
      if (got != 0 || received[static_cast<size_t>(g)] != 0 || !plan.buckets_received_by(g).empty())
        fail(Errc::internal, "plan: engine rank ", g, " of replica ", plan.replica_of(g),
             " is not served but receives ", received[static_cast<size_t>(g)], " bytes");
      continue;
    }
    v.check_cover(g, g + 1);
    if (got != v.rank_param_bytes(g))
      fail(Errc::internal, "plan: engine rank ", g, " receives ", got, " bytes, its params hold ",
           v.rank_param_bytes(g));
  }
  if (sent != plan.stats().bytes_per_trainer_rank)
    fail(Errc::internal, "plan: bytes per trainer rank disagree with the buckets");
}

void verify_broadcast(const Plan& plan, Verifier& v, const EngineLayout& engine) {
  std::map<int, std::vector<Box>> gathered;  // key -> HF boxes
  int64_t model = 0;
  for (const Bucket& b : plan.buckets()) {
    v.check_bucket(b);
    for (const PlanItem& item : plan.items(b.id)) {
      const Copy c = plan.resolve(item);
      v.check_source(c);
      gathered[c.key].push_back(c.hf_box);
    }
    // Every replica of a group applies alike: check each template's first rank.
    for (int t = 0; t < plan.engine_templates(); ++t)
      for (const ApplyItem& a : plan.apply_items(b.id, t)) {
        const Copy c = plan.resolve(a, plan.template_rank(t));
        if (!c.view_box.contains(c.hf_box) || plan.items()[a.item].bucket != b.id)
          fail(Errc::internal, "plan: apply item of bucket ", b.id, " reads outside its view");
        v.check_destination(c, c.dst_rank);
      }
    model += b.bytes;
  }
  for (auto& [key, boxes] : gathered)
    Verifier::check_disjoint_sum(boxes, numel(plan.keys()[static_cast<size_t>(key)].shape),
                                 cat("HF key '", plan.keys()[static_cast<size_t>(key)].name, "'"));
  for (int t = 0; t < plan.engine_templates(); ++t)
    v.check_cover(plan.template_rank(t), plan.template_rank(t) + 1);
  for (int g = 0; g < plan.engine_world(); ++g) {
    const int64_t got = plan.stats().bytes_per_engine_rank[static_cast<size_t>(g)];
    const int64_t want = plan.serves(g) ? model : 0;  // elastic replicas: only those served
    if (got != want)
      fail(Errc::internal, "plan: engine rank ", g, " receives ", got, " bytes, expected ", want);
  }
}

}  // namespace

void verify_plan(const Plan& plan, const TrainerLayout& trainer, const EngineLayout& engine) {
  if (plan.trainer_world() != trainer.mesh.world() || plan.engine_world() != engine.world())
    fail(Errc::internal, "plan: made for ", plan.trainer_world(), " trainer and ",
         plan.engine_world(), " engine ranks, layouts have ", trainer.mesh.world(), " and ",
         engine.world());
  Verifier v(plan, trainer, engine);
  if (plan.mode() == PlanMode::p2p)
    verify_p2p(plan, v, engine);
  else
    verify_broadcast(plan, v, engine);
  if (plan.stats().lower_bound_s > plan.stats().predicted_s * (1 + 1e-9))
    fail(Errc::internal, "plan: lower bound ", plan.stats().lower_bound_s, " s above predicted ",
         plan.stats().predicted_s, " s");
}

}  // namespace weightsync
