// Lent buckets (WireOptions::lend, pipeline/wire.h) end to end: a Publisher
// and the Subscribers of a tp=2 replica, through their C++ API, over
// ipc_host (cuda_ipc's protocol over host memory; "local=1" lets the heap's
// memory be used within this process, where they run as threads). Where the
// engine ranks can lend, every bucket is written by the trainer straight
// into their params and travels as one zero-byte message; where one cannot
// (a param seen through a padded view), or lending is off or impossible
// (checksums on device paths: checksums_gpu), its buckets travel as
// fragments. The default checksums (host paths) leave lending on. Every step moves other
// bytes, and every version is bit-exact. LendSyncAcrossProcesses runs the
// engine rank in a process of its own, its params in memory the trainer's
// process maps; IpcScenarios.LentMemoryIsWrittenThroughTheMappedAddresses
// lends between processes over the transport alone.
#include "e2e/e2e_helpers.h"
#include "harness.h"

#include <weightsync/backend/transport.h>
#include <weightsync/control.h>
#include <weightsync/layouts.h>
#include <weightsync/materialize.h>
#include <weightsync/publisher.h>
#include <weightsync/subscriber.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <thread>

namespace weightsync::transport_test {
namespace {

using e2e::make_model;
using e2e::make_storage;
using e2e::Model;
using e2e::Storage;

// Version `step` of dense `data`: the first byte of every element that is
// not zero flipped by the step's pattern (so that trainer shards and engine
// params, laid out differently, agree; the engine's zero padding stays).
void version(char* data, size_t bytes, size_t item, int64_t step) {
  for (size_t at = 0; at + item <= bytes; at += item)
    if (std::any_of(data + at, data + at + item, [](char c) { return c != 0; }))
      data[at] = static_cast<char>(data[at] ^ static_cast<char>(step));
}

std::vector<char> read_view(const TensorView& v) {
  std::vector<char> out(static_cast<size_t>(v.numel()) * itemsize(v.dtype));
  copy_box(v, Box::full(v.shape), host_view(out.data(), v.dtype, v.shape), Box::full(v.shape));
  return out;
}

struct LendCase {
  std::string label;
  bool lend = true;
  bool checksums_gpu = false;   // WireOptions::checksums_gpu (checksums stay on by default)
  bool padded_trainer = false;  // every other trainer shard strided
  int padded_engine = -1;       // this engine rank's params seen through padded views
  std::string model = "tiny-llama";
};

class LendSync : public ::testing::TestWithParam<LendCase> {};

TEST_P(LendSync, BucketsWrittenIntoLentParamsAreBitExactEveryStep) {
  const LendCase lc = GetParam();
  constexpr int64_t kSteps = 3;
  const std::string transport = "ipc_host?local=1";
  const Model m = make_model(lc.model, "fsdp=1", 2, 1);
  const Checkpoint ckpt = Checkpoint::open(m.checkpoint);
  const TrainerLayout layout = TrainerLayout::load(m.trainer);
  const EngineConfig config = load_engine_config(m.engine);
  const EngineLayout engine_layout = make_engine_layout(config);
  control::Coordinator coordinator(control::CoordinatorOptions{});

  // Each engine rank keeps its params as each version committed them.
  std::vector<std::vector<Storage>> params(2);
  std::vector<std::map<int64_t, std::vector<std::vector<char>>>> held(2);
  std::vector<std::vector<StepOutcome>> outcomes(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> engines;
  for (int r = 0; r < 2; ++r) {
    const EngineRankLayout& rl = engine_layout.rank_layout(r);
    for (const EngineParam& p : rl.params)
      params[r].push_back(make_storage(p.dtype, p.shape, lc.padded_engine == r));
    engines.emplace_back([&, r, rl] {
      try {
        SubscriberOptions so;
        so.coordinator = coordinator.address();
        so.engine = config;
        so.rank = r;
        so.transport = transport;
        Subscriber sub(so);
        for (size_t i = 0; i < rl.params.size(); ++i)
          sub.register_param(rl.params[i].name, params[r][i].view);
        sub.on_end([&, r](int64_t s) {
          if (sub.version() != s) return;
          for (const Storage& p : params[r]) held[r][s].push_back(read_view(p.view));
        });
        for (int i = 0; i < 300 && sub.version() < kSteps; ++i)
          if (auto o = sub.run_step(std::chrono::milliseconds(200))) outcomes[r].push_back(*o);
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  }
  std::vector<Storage> shards;
  std::vector<std::vector<char>> pristine;
  std::vector<PushResult> results;
  std::vector<size_t> sent_buckets;
  std::string trainer_error;
  try {
    PublisherOptions po;
    po.coordinator = coordinator.address();
    po.layout = layout;
    po.engine = config;
    po.transport = transport;
    po.plan.bucket_bytes = 16384;
    po.wire.checksums_gpu = lc.checksums_gpu;
    po.wire.lend = lc.lend;
    po.wire.direct_min_bytes = 256;
    Publisher pub(po);
    for (size_t i = 0; i < layout.params.size(); ++i) {
      const LoadSpec& spec = layout.params[i];
      const Shape shape = local_shape(spec, layout.mesh, 0);
      shards.push_back(make_storage(spec.dtype, shape, lc.padded_trainer && i % 2 == 0));
      pristine.emplace_back(static_cast<size_t>(numel(shape)) * itemsize(spec.dtype));
      fill_local_tensor(ckpt, spec, layout.mesh, 0,
                        host_view(pristine.back().data(), spec.dtype, shape));
      pub.register_tensor(spec.name, shards.back().view);
    }
    for (int64_t step = 1; step <= kSteps; ++step) {
      for (size_t i = 0; i < shards.size(); ++i) {
        std::vector<char> v = pristine[i];
        version(v.data(), v.size(), itemsize(layout.params[i].dtype), step);
        const TensorView& t = shards[i].view;
        copy_box(host_view(v.data(), t.dtype, t.shape), Box::full(t.shape), t, Box::full(t.shape));
      }
      results.push_back(pub.push(step));
      EXPECT_EQ(results.back().committed, (std::vector<int>{0, 1})) << "step " << step;
    }
    for (int r = 0; r < 2; ++r) sent_buckets.push_back(0);
    for (int32_t b : pub.plan().buckets_sent_by(0))
      ++sent_buckets[static_cast<size_t>(pub.plan().buckets()[static_cast<size_t>(b)].dst_rank)];
  } catch (const Error& e) {
    trainer_error = e.what();
  }
  for (auto& t : engines) t.join();
  ASSERT_EQ(trainer_error, "");
  ASSERT_EQ(sent_buckets.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "engine rank " << r;
    const EngineRankLayout& rl = engine_layout.rank_layout(r);
    for (int64_t step = 1; step <= kSteps; ++step) {
      ASSERT_TRUE(held[r].count(step)) << "engine rank " << r << " did not commit step " << step;
      for (size_t i = 0; i < rl.params.size(); ++i) {
        std::vector<char> expected(static_cast<size_t>(numel(rl.params[i].shape)) *
                                   itemsize(rl.params[i].dtype));
        fill_param(ckpt, rl.params[i], expected.data());
        version(expected.data(), expected.size(), itemsize(rl.params[i].dtype), step);
        ASSERT_EQ(held[r].at(step)[i], expected)
            << "engine rank " << r << ", step " << step << ", " << rl.params[i].name;
      }
    }
  }
  // Which buckets were lent: every one of an engine rank that can lend.
  std::vector<uint64_t> lent_expected(2, 0);
  for (int r = 0; r < 2; ++r)
    if (lc.lend && !lc.checksums_gpu && lc.padded_engine != r) lent_expected[r] = sent_buckets[r];
  for (const PushResult& result : results) {
    EXPECT_EQ(result.buckets_lent, lent_expected[0] + lent_expected[1]) << "step " << result.step;
    if (lent_expected[0] + lent_expected[1] == sent_buckets[0] + sent_buckets[1]) {
      EXPECT_EQ(result.bytes_direct, result.bytes_sent) << "all of it straight into the params";
    }
  }
  for (int r = 0; r < 2; ++r)
    for (const StepOutcome& o : outcomes[r]) {
      EXPECT_TRUE(o.committed) << o.reason;
      EXPECT_EQ(o.buckets_lent, lent_expected[r]) << "engine rank " << r << ", step " << o.step;
    }
  if (lc.lend && !lc.checksums_gpu) {
    EXPECT_GT(lent_expected[0] + lent_expected[1], 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LendSync,
    ::testing::Values(LendCase{"Lent"}, LendCase{"LentFromStridedShards", true, false, true},
                      LendCase{"OneRankCannotLend", true, false, false, 1},
                      LendCase{"LendingOff", false}, LendCase{"WithDeviceChecksums", true, true},
                      // Fused experts (leading expert dims), fused QKV.
                      LendCase{"MoeExperts", true, false, false, -1, "tiny-qwen3-moe"}),
    [](const auto& info) { return info.param.label; });

// The engine rank of LendSyncAcrossProcesses, in its own process
// (WS_LEND_COORDINATOR, WS_LEND_MODEL: the coordinator and the model's
// directory): its params in the tests' shared arena, so that the trainer's
// process maps them; every committed version bit-exact, and every bucket
// lent. Its transport from the harness is not used.
void lend_engine(ScenarioContext&) {
  const auto env = [](const char* name) {
    const char* v = std::getenv(name);
    require(v != nullptr, cat(name, " is not set"));
    return std::string(v);
  };
  const std::string dir = env("WS_LEND_MODEL");
  const Checkpoint ckpt = Checkpoint::open(dir + "/model.safetensors");
  const EngineConfig config = load_engine_config(dir + "/engine.json");
  const EngineRankLayout rl = make_engine_layout(config).rank_layout(0);
  std::vector<TensorView> params;
  for (const EngineParam& p : rl.params) {
    const size_t bytes = static_cast<size_t>(numel(p.shape)) * itemsize(p.dtype);
    void* data = shared_host_alloc(bytes);
    std::memset(data, 0, bytes);
    params.push_back(host_view(data, p.dtype, p.shape));
  }
  SubscriberOptions so;
  so.coordinator = env("WS_LEND_COORDINATOR");
  so.engine = config;
  so.transport = "ipc_host?local=1";
  Subscriber sub(so);
  for (size_t i = 0; i < rl.params.size(); ++i) sub.register_param(rl.params[i].name, params[i]);
  int64_t checked = 0;
  for (int i = 0; i < 600 && checked < 3; ++i) {
    const auto o = sub.run_step(std::chrono::milliseconds(200));
    if (!o) continue;
    require(o->committed, cat("step ", o->step, ": ", o->reason));
    require(o->buckets_lent > 0 && o->bytes_direct == o->bytes,
            cat("step ", o->step, ": ", o->buckets_lent, " buckets lent, ", o->bytes_direct, " of ",
                o->bytes, " bytes straight into the params"));
    for (size_t k = 0; k < rl.params.size(); ++k) {
      std::vector<char> expected(static_cast<size_t>(params[k].nbytes()));
      fill_param(ckpt, rl.params[k], expected.data());
      version(expected.data(), expected.size(), itemsize(rl.params[k].dtype), o->step);
      require(std::memcmp(params[k].data, expected.data(), expected.size()) == 0,
              cat("step ", o->step, ": ", rl.params[k].name, " differs"));
    }
    checked = o->step;
  }
  require(checked == 3, cat("the engine rank checked versions up to ", checked, " of 3"));
}

TEST(LendSyncAcrossProcesses, TheTrainerWritesStraightIntoTheParamsOfAnEngineProcess) {
  const Model m = make_model("tiny-llama", "fsdp=1", 1, 1);
  const Checkpoint ckpt = Checkpoint::open(m.checkpoint);
  const TrainerLayout layout = TrainerLayout::load(m.trainer);
  control::Coordinator coordinator(control::CoordinatorOptions{});
  ::setenv("WS_LEND_COORDINATOR", coordinator.address().c_str(), 1);
  ::setenv("WS_LEND_MODEL", m.dir.c_str(), 1);
  TempDir store;
  PeerProcesses engine("lend_engine", "ipc_host", 2, store.path, "t");
  ::unsetenv("WS_LEND_COORDINATOR");
  ::unsetenv("WS_LEND_MODEL");
  PublisherOptions po;
  po.coordinator = coordinator.address();
  po.layout = layout;
  po.engine = load_engine_config(m.engine);
  po.transport = "ipc_host?local=1";
  po.plan.bucket_bytes = 16384;
  // Gone before the engine process ends: its mappings with it, so that the
  // engine's deregistration does not wait for them.
  auto pub_owner = std::make_unique<Publisher>(po);
  Publisher& pub = *pub_owner;
  std::vector<std::vector<char>> shards;
  for (const LoadSpec& spec : layout.params) {
    const Shape shape = local_shape(spec, layout.mesh, 0);
    shards.emplace_back(static_cast<size_t>(numel(shape)) * itemsize(spec.dtype));
    pub.register_tensor(spec.name, host_view(shards.back().data(), spec.dtype, shape));
  }
  for (int64_t step = 1; step <= 3; ++step) {
    for (size_t i = 0; i < shards.size(); ++i) {
      const LoadSpec& spec = layout.params[i];
      const Shape shape = local_shape(spec, layout.mesh, 0);
      fill_local_tensor(ckpt, spec, layout.mesh, 0, host_view(shards[i].data(), spec.dtype, shape));
      version(shards[i].data(), shards[i].size(), itemsize(spec.dtype), step);
    }
    const PushResult r = pub.push(step);
    EXPECT_EQ(r.committed, (std::vector<int>{0})) << "step " << step;
    EXPECT_EQ(r.buckets_lent, pub.plan().buckets_sent_by(0).size()) << "step " << step;
    EXPECT_EQ(r.bytes_direct, r.bytes_sent) << "step " << step;
  }
  pub_owner.reset();
  EXPECT_EQ(engine.join(std::chrono::seconds(120)), "");
}

}  // namespace

Scenario find_lend_scenario(const std::string& name) {
  return name == "lend_engine" ? lend_engine : nullptr;
}

}  // namespace weightsync::transport_test
