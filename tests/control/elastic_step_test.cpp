// Steps of elastic replicas over real sockets: trainer rank 0 leads with its
// plan and membership, the other trainers follow, only the engines of the
// replicas served take part, and the engines learn the list from StepBegin.
#include "control/raw_peer.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <future>
#include <thread>

namespace weightsync::control {
namespace {

using namespace std::chrono_literals;
using testing::client_of;
using testing::fast_coordinator;

// Engine rank `rank` of replica `replica` (tp 2: global rank = replica * 2 + rank).
std::unique_ptr<Client> engine(const Coordinator& c, int replica, int rank) {
  ClientOptions o = client_of(c, Role::engine, replica * 2 + rank, 6);
  o.replica = replica;
  return std::make_unique<Client>(o);
}

StepBegin next_begin(Client& c) {
  while (true) {
    Event e = c.wait_event(20s);
    if (auto* b = std::get_if<StepBegin>(&e)) return *b;
  }
}

TEST(ElasticSteps, FollowersGetTheLeadersPlanAndOnlyTheServedReplicasTakePart) {
  Coordinator coord(fast_coordinator());
  Client t0(client_of(coord, Role::trainer, 0, 2)), t1(client_of(coord, Role::trainer, 1, 2));
  std::vector<std::unique_ptr<Client>> engines;
  for (int replica : {0, 2})
    for (int rank = 0; rank < 2; ++rank) engines.push_back(engine(coord, replica, rank));

  // The follower asks first and waits for the leader.
  auto follower = std::async(std::launch::async, [&] { return t1.follow_step(1, 10s); });
  std::this_thread::sleep_for(200ms);
  const StepStart lead = t0.begin_step(1, "plan-a", std::vector<int>{2}, 10s);
  const StepStart follow = follower.get();
  EXPECT_EQ(follow.plan_id, "plan-a");
  ASSERT_TRUE(follow.replicas.has_value());
  EXPECT_EQ(*follow.replicas, std::vector<int>{2});
  ASSERT_EQ(lead.engines.size(), 2u) << "replica 2's two ranks only";
  for (const Member& m : lead.engines) EXPECT_EQ(m.replica, 2);
  EXPECT_EQ(follow.engines.size(), 2u);

  for (auto& e : engines) {
    const StepBegin b = next_begin(*e);
    EXPECT_EQ(b.step, 1);
    EXPECT_EQ(b.plan_id, "plan-a");
    ASSERT_TRUE(b.replicas.has_value());
    EXPECT_EQ(*b.replicas, std::vector<int>{2});
  }
  // Replica 2 acks; replica 0 is no participant (its ack is refused) and
  // keeps its version.
  engines[2]->ack({1, true, 10, 1, ""});
  engines[3]->ack({1, true, 10, 1, ""});
  EXPECT_THROW(engines[0]->ack({1, true, 10, 1, ""}), Error);
  t0.sent(1, true);
  t1.sent(1, true);
  const StepResult r = t0.wait_step_result(1, 20s);
  EXPECT_TRUE(r.trainers_ok);
  EXPECT_EQ(r.committed, (std::vector<int>{4, 5}));
  EXPECT_EQ(coord.committed_version(4), 1);
  EXPECT_EQ(coord.committed_version(0), -1);

  // Step 2 serves both: a follower arriving after the leader gets its answer at once.
  const StepStart lead2 = t0.begin_step(2, "plan-b", std::vector<int>{0, 2}, 10s);
  EXPECT_EQ(lead2.engines.size(), 4u);
  const StepStart follow2 = t1.follow_step(2, 10s);
  EXPECT_EQ(follow2.plan_id, "plan-b");
  EXPECT_EQ(*follow2.replicas, (std::vector<int>{0, 2}));
  for (auto& e : engines) {
    const StepBegin b = next_begin(*e);
    EXPECT_EQ(b.step, 2);
    EXPECT_EQ(*b.replicas, (std::vector<int>{0, 2}));
    e->ack({2, true, 10, 1, ""});
  }
  t0.sent(2, true);
  t1.sent(2, true);
  EXPECT_EQ(t1.wait_step_result(2, 20s).committed, (std::vector<int>{0, 1, 4, 5}));
}

TEST(ElasticSteps, LeadersThatDisagreeOnTheMembershipFailTheStep) {
  Coordinator coord(fast_coordinator());
  Client t0(client_of(coord, Role::trainer, 0, 2)), t1(client_of(coord, Role::trainer, 1, 2));
  auto e = engine(coord, 0, 0);
  t0.begin_step(1, "plan-a", std::vector<int>{0}, 10s);
  try {
    t1.begin_step(1, "plan-a", std::vector<int>{0, 1}, 10s);
    ADD_FAILURE() << "a second leader with other replicas was accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), Errc::mismatch);
    EXPECT_NE(std::string(err.what()).find("for replicas [0,1]"), std::string::npos) << err.what();
  }
  const StepResult r = t0.wait_step_result(1, 20s);
  EXPECT_FALSE(r.trainers_ok);
}

TEST(ElasticSteps, AFollowerWithoutALeaderTimesOutAndBadListsAreRefused) {
  Coordinator coord(fast_coordinator());
  Client t0(client_of(coord, Role::trainer, 0, 2)), t1(client_of(coord, Role::trainer, 1, 2));
  try {
    t1.follow_step(1, 300ms);
    ADD_FAILURE() << "follow_step returned without a leader";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), Errc::timeout);
    EXPECT_NE(std::string(err.what()).find("no trainer began that step"), std::string::npos)
        << err.what();
  }
  for (const std::vector<int>& bad : {std::vector<int>{1, 0}, std::vector<int>{-1}}) {
    try {
      t0.begin_step(1, "plan-a", bad, 10s);
      ADD_FAILURE() << "accepted replicas " << bad.size();
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), Errc::invalid_argument) << err.what();
      EXPECT_NE(std::string(err.what()).find("ascending distinct"), std::string::npos)
          << err.what();
    }
  }
  // The coordinator still serves a good step afterwards.
  auto follower = std::async(std::launch::async, [&] { return t1.follow_step(1, 10s); });
  std::this_thread::sleep_for(100ms);
  t0.begin_step(1, "plan-a", std::vector<int>{}, 10s);
  EXPECT_EQ(follower.get().plan_id, "plan-a");
}

}  // namespace
}  // namespace weightsync::control
