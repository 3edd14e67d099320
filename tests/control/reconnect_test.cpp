// A coordinator that dies and is restarted takes the job back (issue 52):
// clients with ClientOptions::reconnect_timeout reach it again, register as
// the same members (same ids), report their versions and steps, and write
// again what they wrote to the store, so the new coordinator's membership,
// versions, keys and plans are what the old one's were.
#include "control/raw_peer.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <functional>
#include <set>
#include <thread>

namespace weightsync::control {
namespace {

using namespace std::chrono_literals;
using testing::client_of;
using testing::fast_coordinator;

CoordinatorOptions on_port(uint16_t port, const std::string& token = {}) {
  CoordinatorOptions o = fast_coordinator();
  o.port = port;
  o.token = token;
  return o;
}

ClientOptions reconnecting(const Coordinator& c, Role role, int rank, int world) {
  ClientOptions o = client_of(c, role, rank, world);
  o.reconnect_timeout = 20s;
  return o;
}

bool eventually(const std::function<bool()>& ok, std::chrono::milliseconds within = 20s) {
  const auto deadline = std::chrono::steady_clock::now() + within;
  while (std::chrono::steady_clock::now() < deadline) {
    if (ok()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return ok();
}

std::vector<uint8_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

TEST(Reconnect, ARestartedCoordinatorGetsTheMembersTheirKeysPlansAndVersionsBack) {
  auto coord = std::make_unique<Coordinator>(fast_coordinator());
  const uint16_t port = coord->port();
  Client trainer(reconnecting(*coord, Role::trainer, 0, 1));
  Client engine(reconnecting(*coord, Role::engine, 0, 1));
  const uint64_t trainer_id = trainer.member_id(), engine_id = engine.member_id();
  trainer.put_plan("plan-a", bytes("the plan"));
  trainer.set("job/layout", bytes("layout"));
  engine.set("job/ucx/address/1", bytes("engine address"));
  // Step 4 committed on the engine, as the old coordinator decided it.
  engine.set_resume({4, -1, false});
  trainer.set_resume({-1, 4, false});

  coord.reset();  // dies: every connection closes
  EXPECT_TRUE(eventually([&] { return !trainer.connected() && !engine.connected(); }));
  EXPECT_TRUE(trainer.reconnecting());
  EXPECT_EQ(trainer.connection_losses(), 1u);
  // While it is down, a client's wait for an event waits (no failure).
  const auto before = std::chrono::steady_clock::now();
  EXPECT_THROW(engine.wait_event(300ms), Error);
  EXPECT_GE(std::chrono::steady_clock::now() - before, 250ms) << "returned at once while down";

  coord = std::make_unique<Coordinator>(on_port(port));
  ASSERT_TRUE(eventually([&] { return trainer.connected() && engine.connected(); }))
      << "the clients did not come back to the restarted coordinator";
  Client observer(client_of(*coord, Role::observer, 0, 1));
  std::set<uint64_t> ids;
  for (const auto& m : observer.members()) ids.insert(m.id);
  EXPECT_TRUE(ids.count(trainer_id)) << "the trainer came back under another member id";
  EXPECT_TRUE(ids.count(engine_id)) << "the engine came back under another member id";
  EXPECT_EQ(trainer.member_id(), trainer_id);
  EXPECT_GT(observer.member_id(), std::max(trainer_id, engine_id))
      << "a restarted coordinator must not hand out its predecessor's ids";
  // The store and plans, written again by the clients that wrote them.
  EXPECT_EQ(observer.get_plan("plan-a", 5s), bytes("the plan"));
  EXPECT_EQ(observer.get("job/layout", 5s), bytes("layout"));
  EXPECT_EQ(observer.get("job/ucx/address/1", 5s), bytes("engine address"));
  // Versions from what the engines reported; steps go on after the last one.
  EXPECT_EQ(coord->committed_version(0), 4);
  try {
    trainer.begin_step(4, "plan-a");
    FAIL() << "step 4 was decided before the restart; beginning it again must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("steps must increase"), std::string::npos) << e.what();
  }
  trainer.begin_step(5, "plan-a");
  const auto begin = engine.wait_event(5s);
  ASSERT_TRUE(std::holds_alternative<StepBegin>(begin));
  EXPECT_EQ(std::get<StepBegin>(begin).step, 5);
}

TEST(Reconnect, AStepInFlightWhenTheCoordinatorDiesFailsAtOnceAndTheNextCommits) {
  auto coord = std::make_unique<Coordinator>(fast_coordinator());
  const uint16_t port = coord->port();
  Client trainer(reconnecting(*coord, Role::trainer, 0, 1));
  Client engine(reconnecting(*coord, Role::engine, 0, 1));
  trainer.put_plan("p", bytes("plan"));
  trainer.begin_step(1, "p");
  ASSERT_TRUE(std::holds_alternative<StepBegin>(engine.wait_event(5s)));
  std::thread waiter;
  std::optional<Error> result_error;
  waiter = std::thread([&] {
    try {
      trainer.wait_step_result(1, 20s);
    } catch (const Error& e) {
      result_error = e;
    }
  });
  std::this_thread::sleep_for(100ms);
  const auto died = std::chrono::steady_clock::now();
  coord.reset();
  waiter.join();
  ASSERT_TRUE(result_error) << "the step's result came from a dead coordinator";
  EXPECT_EQ(result_error->code(), Errc::peer_failure) << result_error->what();
  EXPECT_LT(std::chrono::steady_clock::now() - died, 2s) << "the wait did not end at once";
  ASSERT_TRUE(eventually([&] { return engine.connection_losses() == 1; }));

  coord = std::make_unique<Coordinator>(on_port(port));
  ASSERT_TRUE(eventually([&] { return trainer.connected() && engine.connected(); }));
  // The new coordinator knows nothing of step 1: the next step begins.
  trainer.begin_step(2, "p");
  StepAck ack;
  ack.step = 2;
  ack.bytes = 8;
  while (true) {  // events of the old connection may still be queued
    const auto ev = engine.wait_event(5s);
    if (const auto* b = std::get_if<StepBegin>(&ev); b && b->step == 2) break;
  }
  engine.ack(ack);
  trainer.sent(2, true);
  const StepResult r = trainer.wait_step_result(2, 10s);
  EXPECT_TRUE(r.trainers_ok) << r.reason;
  EXPECT_EQ(r.committed, std::vector<int>{0});
  EXPECT_EQ(coord->committed_version(0), 2);
}

// The coordinator dies as step 5 begins: trainer rank 1 had begun it there
// and failed it with the loss; trainer rank 0's begin_step waited through
// the reconnection and opened step 5 on the restarted coordinator alone.
// When trainer rank 1 comes back reporting that it had ended step 5, the
// step fails at once (not at its deadline), naming why, and step 6 commits.
TEST(Reconnect, AStepATrainerEndedBeforeTheRestartFailsWhenItComesBack) {
  auto coord = std::make_unique<Coordinator>(fast_coordinator());
  const uint16_t port = coord->port();
  const std::string address = coord->address();
  Client t0(reconnecting(*coord, Role::trainer, 0, 2));
  Client t1(reconnecting(*coord, Role::trainer, 1, 2));
  Client engine(reconnecting(*coord, Role::engine, 0, 1));
  t0.set_resume({-1, 4, false});
  t1.set_resume({-1, 5, false});  // it ended (failed) step 5 with the old coordinator
  engine.set_resume({4, -1, false});
  coord.reset();
  // Every client has seen the loss before the restart: a client that has not
  // yet read the close would send begin_step down the dead connection.
  ASSERT_TRUE(eventually([&] {
    return t0.connection_losses() == 1 && t1.connection_losses() == 1 &&
           engine.connection_losses() == 1;
  }));
  ASSERT_TRUE(t1.reconnecting() && !t1.connected());
  t1.set_address("127.0.0.1:1");  // kept away until step 5 is open
  auto opts = on_port(port);
  opts.step_timeout = 60s;
  coord = std::make_unique<Coordinator>(opts);
  ASSERT_TRUE(eventually([&] { return t0.connected() && engine.connected(); }));
  t0.begin_step(5, "plan-1");
  auto next = [&] {
    while (true) {
      Event e = engine.wait_event(20s);
      if (!std::holds_alternative<MemberLeft>(e)) return e;
    }
  };
  Event began = next();
  ASSERT_TRUE(std::holds_alternative<StepBegin>(began));
  EXPECT_EQ(std::get<StepBegin>(began).step, 5);
  const auto before = std::chrono::steady_clock::now();
  t1.set_address(address);
  const StepResult r = t0.wait_step_result(5, 20s);
  EXPECT_LT(std::chrono::steady_clock::now() - before, 10s) << "the step ran to its deadline";
  EXPECT_FALSE(r.trainers_ok);
  EXPECT_NE(r.reason.find("trainer rank 1 had ended step 5 before it came back"), std::string::npos)
      << r.reason;
  Event aborted = next();
  ASSERT_TRUE(std::holds_alternative<Abort>(aborted));
  EXPECT_EQ(std::get<Abort>(aborted).step, 5);
  // Step 6, with both trainers, commits.
  ASSERT_TRUE(eventually([&] { return t1.connected(); }));
  t0.begin_step(6, "plan-1");
  t1.begin_step(6, "plan-1");
  Event six = next();
  ASSERT_TRUE(std::holds_alternative<StepBegin>(six));
  engine.ack({6, true, 10, 1, ""});
  t0.sent(6, true);
  t1.sent(6, true);
  EXPECT_EQ(t0.wait_step_result(6, 20s).committed, (std::vector<int>{0}));
}

TEST(Reconnect, SetAddressMovesAClientToACoordinatorElsewhere) {
  auto first = std::make_unique<Coordinator>(fast_coordinator());
  Client engine(reconnecting(*first, Role::engine, 0, 1));
  const uint64_t id = engine.member_id();
  engine.set_resume({7, -1, true});
  Coordinator second(fast_coordinator());
  ASSERT_NE(second.port(), first->port());
  engine.set_address(second.address());
  EXPECT_EQ(engine.address(), second.address());
  ASSERT_TRUE(eventually([&] { return second.members().size() == 1 && engine.connected(); }));
  EXPECT_EQ(second.members()[0].id, id);
  EXPECT_EQ(second.committed_version(0), 7);
  Client observer(client_of(second, Role::observer, 0, 1));
  EXPECT_NE(observer.status_json().find("\"torn\":true"), std::string::npos)
      << "a torn rank that came back must still be reported torn: " << observer.status_json();
  EXPECT_TRUE(eventually([&] { return first->members().empty(); }))
      << "the old coordinator still holds the moved client";
  EXPECT_THROW(engine.set_address("no-port"), Error);
}

TEST(Reconnect, ARefusedReturnEndsTheConnectionWithTheReason) {
  auto coord = std::make_unique<Coordinator>(fast_coordinator());
  const uint16_t port = coord->port();
  Client engine(reconnecting(*coord, Role::engine, 0, 1));
  coord.reset();
  ASSERT_TRUE(eventually([&] { return engine.connection_losses() == 1; }));
  // Restarted with a token this client does not have: it is refused, for good.
  coord = std::make_unique<Coordinator>(on_port(port, "secret"));
  ASSERT_TRUE(eventually([&] { return !engine.reconnecting(); })) << "a refused client kept trying";
  EXPECT_FALSE(engine.connected());
  try {
    engine.members();
    FAIL() << "a refused client's request went through";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token"), std::string::npos) << e.what();
  }
}

// A coordinator that dropped a member told everyone it left, and the
// trainers count on a new member id for a new connection: it takes the
// member back only after a restart. Reaching the same coordinator again
// ends the connection, naming why (the process registers anew).
TEST(Reconnect, TheSameCoordinatorDoesNotTakeAMemberBack) {
  Coordinator coord(fast_coordinator());
  Client engine(reconnecting(coord, Role::engine, 0, 1));
  engine.set_address("localhost:" + std::to_string(coord.port()));  // the same one, by name
  ASSERT_TRUE(eventually([&] { return engine.connection_losses() == 1; }));
  ASSERT_TRUE(eventually([&] { return !engine.reconnecting() && !engine.connected(); }))
      << "the client is still trying, or was taken back";
  try {
    engine.members();
    FAIL() << "the request of a client the coordinator did not take back went through";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("takes members back only after a restart"),
              std::string::npos)
        << e.what();
  }
}

TEST(Reconnect, WithoutReconnectionALostCoordinatorEndsTheClient) {
  auto coord = std::make_unique<Coordinator>(fast_coordinator());
  const uint16_t port = coord->port();
  Client engine(client_of(*coord, Role::engine, 0, 1));
  coord.reset();
  coord = std::make_unique<Coordinator>(on_port(port));
  EXPECT_THROW(engine.wait_event(2s), Error);
  std::this_thread::sleep_for(500ms);
  EXPECT_FALSE(engine.connected());
  EXPECT_FALSE(engine.reconnecting());
  EXPECT_TRUE(coord->members().empty());
}

}  // namespace
}  // namespace weightsync::control
