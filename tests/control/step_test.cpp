// The step protocol over real sockets: commit, per-engine abort, dead
// engines, dead trainers, step timeouts.
#include "control/raw_peer.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <map>

namespace weightsync::control {
namespace {

using namespace std::chrono_literals;
using testing::client_of;
using testing::fast_coordinator;
using testing::RawPeer;

// Skips member_left events (they are incidental here) and returns the next
// step event.
Event next_step_event(Client& c) {
  while (true) {
    Event e = c.wait_event(20s);
    if (!std::holds_alternative<MemberLeft>(e)) return e;
  }
}

template <class T>
T expect_event(Client& c) {
  Event e = next_step_event(c);
  EXPECT_TRUE(std::holds_alternative<T>(e)) << "got event index " << e.index();
  return std::holds_alternative<T>(e) ? std::get<T>(e) : T{};
}

struct Job {
  explicit Job(CoordinatorOptions opts, int trainers, int engines) : coord(opts) {
    for (int r = 0; r < trainers; ++r)
      this->trainers.push_back(
          std::make_unique<Client>(client_of(coord, Role::trainer, r, trainers)));
    for (int r = 0; r < engines; ++r)
      this->engines.push_back(std::make_unique<Client>(client_of(coord, Role::engine, r, engines)));
  }
  void begin(int64_t step) {
    for (auto& t : trainers) t->begin_step(step, "plan-1");
    for (auto& e : engines) {
      const auto b = expect_event<StepBegin>(*e);
      EXPECT_EQ(b.step, step);
      EXPECT_EQ(b.plan_id, "plan-1");
    }
  }
  Coordinator coord;
  std::vector<std::unique_ptr<Client>> trainers;
  std::vector<std::unique_ptr<Client>> engines;
};

TEST(Steps, AllOkCommitsEveryEngineAndMovesVersions) {
  Job job(fast_coordinator(), 2, 3);
  for (int64_t step = 1; step <= 2; ++step) {
    job.begin(step);
    for (auto& e : job.engines) e->ack({step, true, 1000, 0xdeadbeefcafef00dull, ""});
    for (auto& t : job.trainers) t->sent(step, true);
    for (auto& e : job.engines) EXPECT_EQ(expect_event<Commit>(*e).step, step);
    for (auto& t : job.trainers) {
      const StepResult r = t->wait_step_result(step, 20s);
      EXPECT_TRUE(r.trainers_ok);
      EXPECT_EQ(r.committed, (std::vector<int>{0, 1, 2}));
      EXPECT_TRUE(r.failed.empty());
    }
    for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(job.trainers[0]->committed_version(rank), step);
  }
  EXPECT_EQ(job.coord.committed_version(1), 2);
  EXPECT_EQ(job.coord.committed_version(7), -1);
}

TEST(Steps, OneFailedEngineAbortsOnlyThatEngine) {
  Job job(fast_coordinator(), 1, 3);
  job.begin(5);
  job.engines[0]->ack({5, true, 10, 1, ""});
  job.engines[1]->ack({5, false, 0, 0, "checksum mismatch in bucket 3"});
  job.engines[2]->ack({5, true, 10, 1, ""});
  job.trainers[0]->sent(5, true);
  EXPECT_EQ(expect_event<Commit>(*job.engines[0]).step, 5);
  const Abort a = expect_event<Abort>(*job.engines[1]);
  EXPECT_EQ(a.step, 5);
  EXPECT_NE(a.reason.find("checksum mismatch"), std::string::npos) << a.reason;
  EXPECT_EQ(expect_event<Commit>(*job.engines[2]).step, 5);
  const StepResult r = job.trainers[0]->wait_step_result(5, 20s);
  EXPECT_TRUE(r.trainers_ok);
  EXPECT_EQ(r.committed, (std::vector<int>{0, 2}));
  ASSERT_EQ(r.failed.size(), 1u);
  EXPECT_EQ(r.failed[0].rank, 1);
  EXPECT_EQ(job.coord.committed_version(1), -1) << "the failed engine keeps its old version";
  EXPECT_EQ(job.coord.committed_version(0), 5);
}

TEST(Steps, AnEngineDyingMidStepDoesNotStopTheOthersFromCommitting) {
  Job job(fast_coordinator(), 1, 3);
  job.begin(1);
  job.engines[0]->ack({1, true, 10, 1, ""});
  job.engines[1].reset();  // leaves mid-step without acking
  job.engines[2]->ack({1, true, 10, 1, ""});
  job.trainers[0]->sent(1, true);
  const StepResult r = job.trainers[0]->wait_step_result(1, 20s);
  EXPECT_EQ(r.committed, (std::vector<int>{0, 2}));
  ASSERT_EQ(r.failed.size(), 1u);
  EXPECT_EQ(r.failed[0].rank, 1);
  EXPECT_EQ(expect_event<Commit>(*job.engines[0]).step, 1);
  EXPECT_EQ(expect_event<Commit>(*job.engines[2]).step, 1);
}

// A replica serves one model from all its ranks: one rank failing (or dying)
// aborts the step on every rank of its replica; other replicas commit.
TEST(Steps, AReplicaCommitsWholeOrNotAtAll) {
  Coordinator coord(fast_coordinator());
  Client trainer(client_of(coord, Role::trainer, 0, 1));
  std::vector<std::unique_ptr<Client>> engines;
  for (int r = 0; r < 4; ++r) {  // replicas of tp=2: ranks 0,1 -> 0; 2,3 -> 1
    ClientOptions o = client_of(coord, Role::engine, r, 4);
    o.replica = r / 2;
    engines.push_back(std::make_unique<Client>(o));
  }
  trainer.begin_step(3, "plan-1");
  for (auto& e : engines) EXPECT_EQ(expect_event<StepBegin>(*e).step, 3);
  engines[0]->ack({3, true, 10, 1, ""});
  engines[1]->ack({3, false, 0, 0, "bucket 2 never arrived"});
  engines[2]->ack({3, true, 10, 1, ""});
  engines[3]->ack({3, true, 10, 1, ""});
  trainer.sent(3, true);
  const Abort a0 = expect_event<Abort>(*engines[0]);  // acked ok, its replica did not
  EXPECT_NE(a0.reason.find("replica 0"), std::string::npos) << a0.reason;
  EXPECT_NE(a0.reason.find("bucket 2 never arrived"), std::string::npos) << a0.reason;
  EXPECT_EQ(expect_event<Abort>(*engines[1]).step, 3);
  EXPECT_EQ(expect_event<Commit>(*engines[2]).step, 3);
  EXPECT_EQ(expect_event<Commit>(*engines[3]).step, 3);
  const StepResult r = trainer.wait_step_result(3, 20s);
  EXPECT_EQ(r.committed, (std::vector<int>{2, 3}));
  ASSERT_EQ(r.failed.size(), 2u);
  EXPECT_EQ(coord.committed_version(0), -1);
  EXPECT_EQ(coord.committed_version(2), 3);
  // A rank that dies: the rest of its replica aborts too.
  trainer.begin_step(4, "plan-1");
  for (auto& e : engines) EXPECT_EQ(expect_event<StepBegin>(*e).step, 4);
  engines[0]->ack({4, true, 10, 1, ""});
  engines[1]->ack({4, true, 10, 1, ""});
  engines[2]->ack({4, true, 10, 1, ""});
  engines[3].reset();
  trainer.sent(4, true);
  EXPECT_EQ(expect_event<Commit>(*engines[0]).step, 4);
  EXPECT_EQ(expect_event<Commit>(*engines[1]).step, 4);
  EXPECT_NE(expect_event<Abort>(*engines[2]).reason.find("replica 1"), std::string::npos);
  EXPECT_EQ(trainer.wait_step_result(4, 20s).committed, (std::vector<int>{0, 1}));
}

// begin_step names the step's engines with their member ids: a rank whose
// process left is absent, and a new process for it comes with a new id.
TEST(Steps, BeginStepNamesTheStepsEnginesAndNewProcesses) {
  Job job(fast_coordinator(), 1, 2);
  const auto first = job.trainers[0]->begin_step(1, "plan-1");
  ASSERT_EQ(first.size(), 2u);
  std::map<int, uint64_t> ids;
  for (const auto& m : first) ids[m.rank] = m.id;
  ASSERT_EQ(ids.size(), 2u);
  for (auto& e : job.engines) e->ack({1, true, 1, 1, ""});
  job.trainers[0]->sent(1, true);
  job.trainers[0]->wait_step_result(1, 20s);

  job.engines[1].reset();                         // rank 1's process leaves
  Event left = job.trainers[0]->wait_event(20s);  // the coordinator noticed
  while (std::holds_alternative<StepResult>(left)) left = job.trainers[0]->wait_event(20s);
  ASSERT_TRUE(std::holds_alternative<MemberLeft>(left)) << "got event index " << left.index();
  EXPECT_EQ(std::get<MemberLeft>(left).member.rank, 1);
  const auto second = job.trainers[0]->begin_step(2, "plan-1");
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0].rank, 0);
  EXPECT_EQ(second[0].id, ids[0]);
  job.engines[0]->ack({2, true, 1, 1, ""});
  job.trainers[0]->sent(2, true);
  job.trainers[0]->wait_step_result(2, 20s);

  job.engines[1] = std::make_unique<Client>(client_of(job.coord, Role::engine, 1, 2));
  const auto third = job.trainers[0]->begin_step(3, "plan-1");
  ASSERT_EQ(third.size(), 2u);
  for (const auto& m : third) {
    if (m.rank == 0) EXPECT_EQ(m.id, ids[0]) << "the same process";
    if (m.rank == 1) EXPECT_NE(m.id, ids[1]) << "a new process took rank 1";
  }
}

TEST(Steps, AnEngineThatStopsHeartbeatingCountsAsFailed) {
  auto opts = fast_coordinator();
  opts.heartbeat_timeout = 1500ms;
  Job job(opts, 1, 1);
  RawPeer silent(job.coord.port());
  ASSERT_TRUE(silent.hello("engine", 1, 2));
  ASSERT_TRUE(silent.read_frame(10s).has_value());
  ASSERT_TRUE(silent.send_json({{"v", 1}, {"kind", "heartbeat"}}));
  job.begin(3);
  // The raw engine takes part in step 3, then never speaks again.
  const auto begin = silent.read_frame(10s);
  ASSERT_TRUE(begin.has_value());
  ASSERT_EQ(begin->at("kind"), "step_begin");
  job.engines[0]->ack({3, true, 1, 1, ""});
  job.trainers[0]->sent(3, true);
  const StepResult r = job.trainers[0]->wait_step_result(3, 20s);
  EXPECT_EQ(r.committed, (std::vector<int>{0}));
  ASSERT_EQ(r.failed.size(), 1u);
  EXPECT_EQ(r.failed[0].rank, 1);
  EXPECT_NE(r.failed[0].reason.find("heartbeat"), std::string::npos) << r.failed[0].reason;
}

TEST(Steps, ATrainerDyingMidStepAbortsEveryEngine) {
  Job job(fast_coordinator(), 2, 2);
  job.begin(1);
  job.engines[0]->ack({1, true, 10, 1, ""});
  job.trainers[0]->sent(1, true);
  job.trainers[1].reset();  // dies before reporting sent
  for (auto& e : job.engines) {
    const Abort a = expect_event<Abort>(*e);
    EXPECT_EQ(a.step, 1);
    EXPECT_NE(a.reason.find("trainer rank 1"), std::string::npos) << a.reason;
  }
  const StepResult r = job.trainers[0]->wait_step_result(1, 20s);
  EXPECT_FALSE(r.trainers_ok);
  EXPECT_TRUE(r.committed.empty());
  EXPECT_EQ(r.failed.size(), 2u);
  // A late ack for the decided step is accepted and ignored.
  EXPECT_NO_THROW(job.engines[1]->ack({1, true, 10, 1, ""}));
  EXPECT_EQ(job.coord.committed_version(0), -1);
}

TEST(Steps, ATrainerReportingFailureAbortsEveryEngine) {
  Job job(fast_coordinator(), 1, 2);
  job.begin(1);
  job.trainers[0]->sent(1, false, "transport: peer 3 unreachable");
  for (auto& e : job.engines) EXPECT_EQ(expect_event<Abort>(*e).step, 1);
  const StepResult r = job.trainers[0]->wait_step_result(1, 20s);
  EXPECT_FALSE(r.trainers_ok);
  EXPECT_NE(r.reason.find("peer 3 unreachable"), std::string::npos) << r.reason;
}

TEST(Steps, EnginesThatNeverAckAreFailedAtTheStepTimeout) {
  auto opts = fast_coordinator();
  opts.step_timeout = 500ms;
  Job job(opts, 1, 2);
  job.begin(1);
  job.engines[0]->ack({1, true, 10, 1, ""});
  job.trainers[0]->sent(1, true);
  const StepResult r = job.trainers[0]->wait_step_result(1, 20s);
  EXPECT_EQ(r.committed, (std::vector<int>{0}));
  ASSERT_EQ(r.failed.size(), 1u);
  EXPECT_NE(r.failed[0].reason.find("step timeout"), std::string::npos) << r.failed[0].reason;
  EXPECT_EQ(expect_event<Abort>(*job.engines[1]).step, 1);
}

TEST(Steps, ProtocolMisuseIsAnsweredWithErrors) {
  Job job(fast_coordinator(), 2, 1);
  auto code = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return e.code();
    }
    return Errc::internal;
  };
  EXPECT_EQ(code([&] { job.engines[0]->begin_step(1, "p"); }), Errc::protocol) << "engine begins";
  EXPECT_EQ(code([&] { job.trainers[0]->ack({1, true, 0, 0, ""}); }), Errc::protocol);
  EXPECT_EQ(code([&] { job.trainers[0]->sent(9, true); }), Errc::protocol) << "no such step";
  job.trainers[0]->begin_step(4, "p");
  EXPECT_EQ(code([&] { job.trainers[1]->begin_step(4, "other"); }), Errc::mismatch);
  // The plan mismatch aborted step 4; steps must now go above 4.
  EXPECT_FALSE(job.trainers[0]->wait_step_result(4, 20s).trainers_ok);
  EXPECT_EQ(code([&] { job.trainers[0]->begin_step(3, "p"); }), Errc::protocol);
  EXPECT_NO_THROW(job.trainers[0]->begin_step(6, "p"));
}

// A trainer of the open step that begins a later one gave the open step up
// (its coordinator was lost during the step, and the restarted one opened
// it for another rank alone): the open step fails at once, naming why, not
// at its deadline, and the later step begins.
TEST(Steps, ATrainerBeginningALaterStepEndsTheOpenOneAtOnce) {
  Job job(fast_coordinator(), 2, 1);
  job.begin(1);
  for (auto& t : job.trainers) t->sent(1, true);
  job.engines[0]->ack({1, true, 10, 1, ""});
  ASSERT_EQ(job.trainers[0]->wait_step_result(1, 20s).committed, (std::vector<int>{0}));
  EXPECT_EQ(expect_event<Commit>(*job.engines[0]).step, 1);
  job.trainers[0]->begin_step(2, "plan-1");
  EXPECT_EQ(expect_event<StepBegin>(*job.engines[0]).step, 2);
  const auto before = std::chrono::steady_clock::now();
  job.trainers[1]->begin_step(3, "plan-1");  // trainer 1 gave step 2 up
  const StepResult r = job.trainers[0]->wait_step_result(2, 20s);
  EXPECT_LT(std::chrono::steady_clock::now() - before, 5s);
  EXPECT_FALSE(r.trainers_ok);
  EXPECT_NE(r.reason.find("trainer rank 1 began step 3 while step 2 was open"), std::string::npos)
      << r.reason;
  EXPECT_EQ(expect_event<Abort>(*job.engines[0]).step, 2);
  // Step 3 is open: trainer 0 joins it, and it commits.
  job.trainers[0]->begin_step(3, "plan-1");
  EXPECT_EQ(expect_event<StepBegin>(*job.engines[0]).step, 3);
  job.trainers[0]->sent(3, true);
  job.trainers[1]->sent(3, true);
  job.engines[0]->ack({3, true, 10, 1, ""});
  EXPECT_EQ(job.trainers[0]->wait_step_result(3, 20s).committed, (std::vector<int>{0}));
  EXPECT_EQ(job.coord.committed_version(0), 3);
}

}  // namespace
}  // namespace weightsync::control
