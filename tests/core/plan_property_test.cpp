// Property tests of the planner on random layouts of tiny models: exact cover
// (element by element), bytes per rank, determinism, balance, schedule rules.
#include "plan_sim.h"

#include <weightsync/error.h>
#include <weightsync/layouts.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

namespace weightsync::test {
namespace {

struct Case {
  std::string model;
  TrainerLayout trainer;
  EngineLayout engine;
  PlanOptions options;
};

Case random_case(uint64_t seed, PlanMode mode) {
  std::mt19937_64 rng(seed);
  Case c;
  c.model = tiny_models()[rng() % tiny_models().size()];
  c.trainer = random_trainer_layout(c.model, rng);
  // A third of the cases sync two groups of engines at once (e.g. vLLM
  // replicas beside load_weights ones, framework "hf").
  EngineSpec spec(random_engine_config(c.model, rng));
  if (rng() % 3 == 0) spec.groups.push_back(random_engine_config(c.model, rng));
  c.engine = make_engine_layout(spec);
  c.options.mode = mode;
  c.options.bucket_bytes = int64_t{1024} << (rng() % 8);  // 1 KiB .. 128 KiB
  return c;
}

std::string describe(const Case& c) {
  return cat(c.model, " trainer world ", c.trainer.mesh.world(), " engine groups ",
             c.engine.groups.size(), " tp ", c.engine.config.tp, " x ", c.engine.config.replicas,
             c.engine.config.expert_parallel ? " ep" : "", " bucket ", c.options.bucket_bytes);
}

int64_t param_bytes(const EngineLayout& e, int g) {
  int64_t bytes = 0;
  for (const EngineParam& p : e.rank_layout(g).params)
    for (const Segment& s : p.segments)
      bytes += s.hf_box.numel() * static_cast<int64_t>(itemsize(p.dtype));
  return bytes;
}

class RandomPlans : public ::testing::TestWithParam<int> {};

TEST_P(RandomPlans, P2pCoversEveryElementOnceAndMovesOnlyParamBytes) {
  const Case c = random_case(1000 + static_cast<uint64_t>(GetParam()), PlanMode::p2p);
  SCOPED_TRACE(describe(c));
  const Plan plan = make_plan(c.trainer, c.engine, Topology{}, c.options);
  const SimResult sim = simulate(plan, c.trainer, c.engine);
  for (int g = 0; g < c.engine.world(); ++g) {
    EXPECT_EQ(sim.bytes_in[static_cast<size_t>(g)], param_bytes(c.engine, g)) << "rank " << g;
    EXPECT_EQ(plan.stats().bytes_per_engine_rank[static_cast<size_t>(g)], param_bytes(c.engine, g));
  }
  EXPECT_NO_THROW(verify_plan(plan, c.trainer, c.engine));
}

TEST_P(RandomPlans, BroadcastDeliversTheModelToEveryRank) {
  const Case c = random_case(2000 + static_cast<uint64_t>(GetParam()), PlanMode::broadcast);
  SCOPED_TRACE(describe(c));
  const Plan plan = make_plan(c.trainer, c.engine, Topology{}, c.options);
  const SimResult sim = simulate(plan, c.trainer, c.engine);
  for (int g = 0; g < c.engine.world(); ++g) {
    EXPECT_EQ(sim.bytes_in[static_cast<size_t>(g)], sim.model_bytes) << "rank " << g;
    EXPECT_EQ(plan.stats().bytes_per_engine_rank[static_cast<size_t>(g)], sim.model_bytes);
  }
  // Buckets start in id order: the pipelines merge a rank's roots and gather
  // parts by id (publisher_pipeline.h).
  for (size_t b = 1; b < plan.buckets().size(); ++b)
    EXPECT_GE(plan.buckets()[b].start_s, plan.buckets()[b - 1].end_s) << "bucket " << b;
  EXPECT_NO_THROW(verify_plan(plan, c.trainer, c.engine));
}

TEST_P(RandomPlans, SameInputsSamePlanOtherBucketSizeOtherId) {
  const Case c = random_case(3000 + static_cast<uint64_t>(GetParam()),
                             GetParam() % 2 ? PlanMode::p2p : PlanMode::broadcast);
  SCOPED_TRACE(describe(c));
  const Plan a = make_plan(c.trainer, c.engine, Topology{}, c.options);
  const Plan b = make_plan(c.trainer, c.engine, Topology{}, c.options);
  EXPECT_EQ(a.plan_id_hex(), b.plan_id_hex());
  ASSERT_EQ(a.items().size(), b.items().size());
  for (size_t i = 0; i < a.items().size(); ++i) {
    const PlanItem &x = a.items()[i], &y = b.items()[i];
    EXPECT_TRUE(x.piece == y.piece && x.segment == y.segment && x.dst_rank == y.dst_rank &&
                x.bucket == y.bucket && x.offset == y.offset && x.split_lo == y.split_lo &&
                x.split_len == y.split_len && x.split_dim == y.split_dim)
        << "item " << i;
  }
  ASSERT_EQ(a.buckets().size(), b.buckets().size());
  for (size_t i = 0; i < a.buckets().size(); ++i) {
    EXPECT_EQ(a.buckets()[i].src_rank, b.buckets()[i].src_rank);
    EXPECT_EQ(a.buckets()[i].start_s, b.buckets()[i].start_s);
  }
  for (int t = 0; t < a.trainer_world(); ++t) EXPECT_EQ(a.buckets_sent_by(t), b.buckets_sent_by(t));
  PlanOptions other = c.options;
  other.bucket_bytes *= 2;
  EXPECT_NE(make_plan(c.trainer, c.engine, Topology{}, other).plan_id(), a.plan_id());
}

TEST_P(RandomPlans, ScheduleRespectsBucketLimitAndDoubleBuffering) {
  const Case c = random_case(4000 + static_cast<uint64_t>(GetParam()), PlanMode::p2p);
  SCOPED_TRACE(describe(c));
  const Plan plan = make_plan(c.trainer, c.engine, Topology{}, c.options);
  std::vector<int> seen(plan.buckets().size(), 0);
  for (int t = 0; t < plan.trainer_world(); ++t) {
    const auto& order = plan.buckets_sent_by(t);
    for (size_t k = 0; k < order.size(); ++k) {
      const Bucket& b = plan.buckets()[static_cast<size_t>(order[k])];
      ++seen[static_cast<size_t>(b.id)];
      EXPECT_EQ(b.src_rank, t);
      EXPECT_LE(b.bytes, c.options.bucket_bytes);
      // Bucket k reuses the slot of bucket k-2: it may start only after it ended.
      if (k >= 2) {
        EXPECT_GE(b.start_s, plan.buckets()[static_cast<size_t>(order[k - 2])].end_s);
      }
      if (k >= 1) {
        // One order for every process (the pipelines follow it): start, then id.
        const Bucket& prev = plan.buckets()[static_cast<size_t>(order[k - 1])];
        EXPECT_TRUE(prev.start_s < b.start_s || (prev.start_s == b.start_s && prev.id < b.id))
            << "bucket " << b.id << " after " << prev.id;
      }
    }
  }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  for (int g = 0; g < plan.engine_world(); ++g) {
    const auto& order = plan.buckets_received_by(g);
    for (size_t k = 1; k < order.size(); ++k)  // one bucket at a time into a rank: no incast
      EXPECT_GE(plan.buckets()[static_cast<size_t>(order[k])].start_s,
                plan.buckets()[static_cast<size_t>(order[k - 1])].end_s);
  }
  EXPECT_GT(plan.stats().lower_bound_s, 0);
  EXPECT_LE(plan.stats().lower_bound_s, plan.stats().predicted_s);
}

// The p2p schedule is a list schedule: a bucket never waits while both its
// sender and its receiver are idle. With the default topology (one NIC per
// GPU, trainer and engines on different nodes) ranks are the resources.
TEST_P(RandomPlans, P2pScheduleNeverLeavesAStartableBucketWaiting) {
  const Case c = random_case(5000 + static_cast<uint64_t>(GetParam()), PlanMode::p2p);
  SCOPED_TRACE(describe(c));
  const Plan plan = make_plan(c.trainer, c.engine, Topology{}, c.options);
  const auto& buckets = plan.buckets();
  std::vector<double> events = {0};  // every time the scheduler decided something
  for (const Bucket& b : buckets) events.push_back(b.end_s);
  std::sort(events.begin(), events.end());
  events.erase(std::unique(events.begin(), events.end()), events.end());
  auto busy_at = [&](const std::vector<int32_t>& order, double t) {
    return std::any_of(order.begin(), order.end(), [&](int32_t id) {
      const Bucket& o = buckets[static_cast<size_t>(id)];
      return o.start_s <= t && t < o.end_s;
    });
  };
  for (const Bucket& b : buckets) {
    for (double t : events) {
      if (t >= b.start_s) break;
      EXPECT_TRUE(busy_at(plan.buckets_sent_by(b.src_rank), t) ||
                  busy_at(plan.buckets_received_by(b.dst_rank), t))
          << "bucket " << b.id << " (trainer rank " << b.src_rank << " -> engine rank "
          << b.dst_rank << ") starts at " << b.start_s << " but both ends were idle at " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Seeds, RandomPlans, ::testing::Range(0, 24));

// tiny-llama with every dense param replicated over dp=4 (fsdp=2), into
// `replicas` replicas of tp=2.
struct ReplicatedJob {
  TrainerLayout trainer;
  EngineConfig config;
  EngineLayout engine;
};
ReplicatedJob replicated_job(int replicas) {
  const HfModelConfig config = HfModelConfig::load(model_config_path("tiny-llama"));
  Mesh mesh;
  mesh.axes = {"dp", "fsdp"};
  mesh.shape = {4, 2};
  ReplicatedJob job;
  job.trainer = make_trainer_layout(config, mesh);
  job.config.hf = config;
  job.config.dtype = config.dtype;
  job.config.tp = 2;
  job.config.replicas = replicas;
  job.engine = make_engine_layout(job.config);
  return job;
}

// Every trainer rank sends, and none more than 15 % above the mean (plus
// `slack_items` of the largest item: a choice moves whole items).
void expect_senders_share_the_bytes(const Plan& plan, int slack_items) {
  const auto& sent = plan.stats().bytes_per_trainer_rank;
  const double mean =
      static_cast<double>(std::accumulate(sent.begin(), sent.end(), int64_t{0})) / sent.size();
  int64_t largest_item = 0;
  for (const PlanItem& it : plan.items())
    largest_item = std::max(largest_item, plan.resolve(it).bytes);
  for (size_t t = 0; t < sent.size(); ++t) {
    EXPECT_GT(sent[t], 0) << "trainer rank " << t << " sends nothing";
    EXPECT_LE(static_cast<double>(sent[t]),
              1.15 * mean + static_cast<double>(slack_items * largest_item))
        << "trainer rank " << t;
  }
}

// Every dense param replicated over dp=4: senders must share the work.
TEST(PlanBalance, ReplicasShareTheBytes) {
  const ReplicatedJob job = replicated_job(2);
  PlanOptions options;
  options.bucket_bytes = 4096;
  expect_senders_share_the_bytes(make_plan(job.trainer, job.engine, Topology{}, options), 1);
}

// Delta sync's plans (PlanOptions::same_buckets_per_replica): each replica
// gets every item from the trainer rank the first replica gets it from, in
// buckets that pack the same bytes, so that a sender encodes each once; the
// first replica's choices still spread the bytes over the senders.
TEST(PlanBalance, SameBucketsPerReplicaPackAlikeAndStillShareTheBytes) {
  const ReplicatedJob job = replicated_job(3);
  const TrainerLayout& trainer = job.trainer;
  const EngineLayout& engine = job.engine;
  const EngineConfig& ec = job.config;
  PlanOptions options;
  options.bucket_bytes = 4096;
  const Plan spread = make_plan(trainer, engine, Topology{}, options);
  options.same_buckets_per_replica = true;
  const Plan plan = make_plan(trainer, engine, Topology{}, options);
  EXPECT_NE(plan.plan_id_hex(), spread.plan_id_hex());
  auto packing = [&](int32_t bucket) {
    std::vector<std::string> out{std::to_string(plan.buckets()[static_cast<size_t>(bucket)].bytes)};
    for (const PlanItem& it : plan.items(bucket)) {
      const Copy c = plan.resolve(it);
      out.push_back(cat(c.src_param, " ", box_str(c.src_box), " ", box_str(c.hf_box), " ",
                        box_str(c.view_box), " at ", c.offset, " ", c.bytes));
    }
    return out;
  };
  int twins = 0;
  for (int t = 0; t < plan.trainer_world(); ++t) {
    // This rank's buckets to each engine rank, in sending order.
    std::vector<std::vector<int32_t>> to(static_cast<size_t>(plan.engine_world()));
    for (int32_t b : plan.buckets_sent_by(t))
      to[static_cast<size_t>(plan.buckets()[static_cast<size_t>(b)].dst_rank)].push_back(b);
    for (int rank = 0; rank < ec.tp; ++rank)
      for (int replica = 1; replica < ec.replicas; ++replica) {
        const auto& first = to[static_cast<size_t>(rank)];
        const auto& other = to[static_cast<size_t>(replica * ec.tp + rank)];
        ASSERT_EQ(other.size(), first.size())
            << "trainer rank " << t << ", tp rank " << rank << ", replica " << replica;
        for (size_t i = 0; i < first.size(); ++i, ++twins)
          EXPECT_EQ(packing(other[i]), packing(first[i]))
              << "trainer rank " << t << ", tp rank " << rank << ", replica " << replica
              << ", bucket " << i;
      }
  }
  EXPECT_GT(twins, 0);
  // Without the option the replicas spread over the holders: their buckets
  // differ somewhere.
  bool differ = false;
  for (int t = 0; t < spread.trainer_world(); ++t) {
    std::vector<int64_t> per_replica(static_cast<size_t>(ec.replicas), 0);
    for (int32_t b : spread.buckets_sent_by(t)) {
      const Bucket& bucket = spread.buckets()[static_cast<size_t>(b)];
      per_replica[static_cast<size_t>(bucket.dst_rank / ec.tp)] += bucket.bytes;
    }
    differ = differ || per_replica[0] != per_replica[1];
  }
  EXPECT_TRUE(differ) << "the spread plan sends each replica the same from every rank";
  // The later replicas follow the first one's choices: each choice moves an
  // item for every replica.
  expect_senders_share_the_bytes(plan, ec.replicas);
  // Broadcast plans send one bucket to all: the option changes nothing.
  options.mode = PlanMode::broadcast;
  const Plan broadcast = make_plan(trainer, engine, Topology{}, options);
  options.same_buckets_per_replica = false;
  EXPECT_EQ(broadcast.plan_id_hex(), make_plan(trainer, engine, Topology{}, options).plan_id_hex());
}

TEST(PlanErrors, EngineKeyMissingFromTrainerIsNamed) {
  const HfModelConfig config = HfModelConfig::load(model_config_path("tiny-llama"));
  Mesh mesh;
  mesh.axes = {"fsdp"};
  mesh.shape = {2};
  TrainerLayout trainer = make_trainer_layout(config, mesh);
  const std::string dropped = trainer.params.back().hf_keys[0];
  trainer.params.pop_back();
  EngineConfig ec;
  ec.hf = config;
  ec.dtype = config.dtype;
  try {
    make_plan(trainer, make_engine_layout(ec), Topology{});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_layout);
    EXPECT_NE(std::string(e.what()).find(dropped), std::string::npos) << e.what();
  }
}

TEST(PlanErrors, BucketBytesOutOfRangeIsAnError) {
  const HfModelConfig config = HfModelConfig::load(model_config_path("tiny-llama"));
  Mesh mesh;
  mesh.axes = {"fsdp"};
  mesh.shape = {1};
  EngineConfig ec;
  ec.hf = config;
  ec.dtype = config.dtype;
  PlanOptions options;
  options.bucket_bytes = 100;
  EXPECT_THROW(
      make_plan(make_trainer_layout(config, mesh), make_engine_layout(ec), Topology{}, options),
      Error);
}

// The public lookups of the planner's internal tables agree with resolve,
// and refuse indices outside them, a copy of a Plan keeps them.
TEST(PlanTables, PieceKeyAndSegmentParamAgreeWithResolve) {
  const HfModelConfig config = HfModelConfig::load(model_config_path("tiny-llama"));
  Mesh mesh;
  mesh.axes = {"fsdp"};
  mesh.shape = {2};
  EngineConfig ec;
  ec.hf = config;
  ec.dtype = config.dtype;
  ec.tp = 2;
  PlanOptions options;
  options.bucket_bytes = 4096;
  const Plan made =
      make_plan(make_trainer_layout(config, mesh), make_engine_layout(ec), Topology{}, options);
  const Plan plan = made;  // copied: the tables travel with it
  ASSERT_FALSE(plan.items().empty());
  for (const PlanItem& it : plan.items()) {
    const Copy c = plan.resolve(it);
    EXPECT_EQ(plan.piece_key(it.piece), c.key);
    EXPECT_EQ(plan.segment_param(it.segment), c.dst_param);
  }
  EXPECT_THROW(plan.piece_key(-1), Error);
  EXPECT_THROW(plan.piece_key(1 << 30), Error);
  EXPECT_THROW(plan.segment_param(1 << 30), Error);
}

}  // namespace
}  // namespace weightsync::test
