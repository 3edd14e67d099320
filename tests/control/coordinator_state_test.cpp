// CoordinatorState without sockets: a recording Outbox and a clock the test
// moves by hand, so deadline behaviour is checked without waiting.
#include "control/coordinator_state.h"

#include <nlohmann/json.hpp>

#include <map>
#include <string>

#include <gtest/gtest.h>

namespace weightsync::control {
namespace {

using namespace std::chrono_literals;
using wire::Json;

struct Recorder final : Outbox {
  void send(ConnId conn, const Json& m) override { sent[conn].push_back(m); }
  void close(ConnId conn, std::optional<Errc> code, const std::string& message) override {
    closed[conn] = code ? std::string(errc_name(*code)) : "";
  }
  // Kinds sent to `conn`, in order, then forgotten.
  std::vector<std::string> take(ConnId conn) {
    std::vector<std::string> kinds;
    for (const auto& m : sent[conn]) kinds.push_back(m.at("kind"));
    sent[conn].clear();
    return kinds;
  }
  std::map<ConnId, std::vector<Json>> sent;
  std::map<ConnId, std::string> closed;
};

class StateTest : public ::testing::Test {
 protected:
  StateTest() : state_(options(), out_) {}
  static CoordinatorOptions options() {
    CoordinatorOptions o;
    o.hello_timeout = 1s;
    o.heartbeat_timeout = 2s;
    o.step_timeout = 10s;
    return o;
  }
  void message(ConnId conn, Json body) {
    body["v"] = 1;
    state_.on_message(conn, wire::parse_message(body.dump()), now_);
  }
  // Connects `conn` and sends its hello, with `extra` fields.
  void hello(ConnId conn, const std::string& role, int rank, int world, Json extra = {}) {
    state_.on_connect(conn, now_);
    Json body = {{"kind", "hello"}, {"id", 1}, {"role", role}, {"rank", rank}, {"world", world}};
    for (const auto& [k, v] : extra.items()) body[k] = v;
    message(conn, std::move(body));
  }
  void join(ConnId conn, const std::string& role, int rank, int world, Json extra = {}) {
    hello(conn, role, rank, world, std::move(extra));
    ASSERT_EQ(out_.take(conn), std::vector<std::string>{"welcome"});
  }
  void request(ConnId conn, const std::string& kind, Json fields) {
    fields["kind"] = kind;
    fields["id"] = ++next_id_;
    message(conn, fields);
  }
  // Whether status() lists engine rank `rank` as torn.
  bool torn(int rank) const {
    const Json status = state_.status();
    for (const Json& m : status.at("members"))
      if (m.at("role") == "engine" && m.at("rank") == rank) return m.at("torn").get<bool>();
    ADD_FAILURE() << "no engine rank " << rank << " in " << status.dump();
    return false;
  }
  Recorder out_;
  CoordinatorState state_;
  Clock::time_point now_ = Clock::now();
  uint64_t next_id_ = 100;
};

// A get with a zero timeout (trainer rank 0 polling engines' ready keys) is
// answered at once, without waiting for a tick of the clock.
TEST_F(StateTest, ZeroTimeoutGetIsAnsweredAtOnce) {
  join(1, "trainer", 0, 1);
  request(1, "kv_get", {{"key", "ready/3"}, {"timeout_ms", 0}});
  ASSERT_EQ(out_.sent[1].size(), 1u) << "no answer before any tick";
  EXPECT_EQ(out_.sent[1][0].at("kind"), "error");
  EXPECT_EQ(out_.sent[1][0].at("code"), "timeout");
  out_.take(1);
  request(1, "kv_get", {{"key", "ready/3"}, {"timeout_ms", 5}});
  EXPECT_TRUE(out_.take(1).empty()) << "a nonzero timeout still waits";
  request(1, "kv_set", {{"key", "ready/3"}, {"value", wire::base64_encode({'7'})}});
  EXPECT_EQ(out_.take(1), (std::vector<std::string>{"reply", "reply"}));  // the waiter, the set
}

TEST_F(StateTest, EngineThatAckedOkThenDiedIsNotCommitted) {
  join(1, "trainer", 0, 1);
  join(2, "engine", 0, 2);
  join(3, "engine", 1, 2);
  request(1, "begin_step", {{"step", 1}, {"plan_id", "p"}});
  EXPECT_EQ(out_.take(2), std::vector<std::string>{"step_begin"});
  request(2, "ack", {{"step", 1}, {"ok", true}, {"bytes", 1}, {"checksum", 1}});
  state_.on_disconnect(2, "connection lost");
  request(3, "ack", {{"step", 1}, {"ok", true}, {"bytes", 1}, {"checksum", 1}});
  request(1, "sent", {{"step", 1}, {"ok", true}});
  EXPECT_EQ(state_.committed_version(0), -1);
  EXPECT_EQ(state_.committed_version(1), 1);
  const auto& result = out_.sent[1].back();
  ASSERT_EQ(result.at("kind"), "step_result");
  EXPECT_EQ(result.at("committed"), Json::array({1}));
  EXPECT_EQ(result.at("failed")[0].at("rank"), 0);
}

TEST_F(StateTest, AbortReasonNamesTheTrainerThatFailedNotOneStillSending) {
  join(1, "trainer", 0, 3);
  join(2, "trainer", 1, 3);
  join(3, "trainer", 2, 3);
  join(4, "engine", 0, 1);
  for (ConnId t : {1, 2, 3}) request(t, "begin_step", {{"step", 1}, {"plan_id", "p"}});
  out_.take(4);
  // Rank 0 is still sending when rank 2's connection is lost: the step is
  // decided at once, and its reason is rank 2's loss.
  request(2, "sent", {{"step", 1}, {"ok", true}});
  state_.on_disconnect(3, "heartbeat timeout");
  const auto& result = out_.sent[1].back();
  ASSERT_EQ(result.at("kind"), "step_result");
  EXPECT_EQ(result.at("trainers_ok"), false);
  const std::string reason = result.at("reason");
  EXPECT_NE(reason.find("heartbeat timeout"), std::string::npos) << reason;
  EXPECT_EQ(reason.find("rank 0"), std::string::npos) << reason;
  EXPECT_EQ(out_.take(4), (std::vector<std::string>{"member_left", "abort"}));
}

// A trainer whose send to engine rank 0 failed says so: that rank fails the
// step with the trainer's reason and is told to abort at once (not at the
// step timeout); engine rank 1 goes on and commits. Rank 0's late ack says
// the step wrote its params: status lists it torn until it commits again.
TEST_F(StateTest, SendFailureAbortsThatEngineAtOnceAndItsLandingMarksItTorn) {
  join(1, "trainer", 0, 1);
  join(2, "engine", 0, 2);
  join(3, "engine", 1, 2);
  request(1, "begin_step", {{"step", 1}, {"plan_id", "p"}});
  for (ConnId c : {1, 2, 3}) out_.take(c);
  const std::string why = "trainer rank 0: sending bucket 3 to engine rank 0 failed: injected";
  request(1, "send_failed", {{"step", 1}, {"engine_rank", 0}, {"error", why}});
  ASSERT_EQ(out_.sent[1].size(), 2u);
  EXPECT_EQ(out_.sent[1][0].at("kind"), "reply");
  EXPECT_EQ(out_.sent[1][1].at("kind"), "abort") << "the trainers stop sending to it";
  EXPECT_EQ(out_.sent[1][1].at("engine_rank"), 0);
  out_.take(1);
  ASSERT_EQ(out_.sent[2].size(), 1u) << "engine rank 0 is told before the step is decided";
  EXPECT_EQ(out_.sent[2][0].at("kind"), "abort");
  EXPECT_EQ(out_.sent[2][0].at("reason"), why);
  out_.take(2);
  EXPECT_TRUE(out_.take(3).empty()) << "engine rank 1 is not aborted";
  request(2, "ack", {{"step", 1}, {"ok", false}, {"bytes", 0}, {"checksum", 0}, {"landed", true}});
  request(3, "ack", {{"step", 1}, {"ok", true}, {"bytes", 1}, {"checksum", 1}, {"landed", true}});
  request(1, "sent", {{"step", 1}, {"ok", true}});
  const auto& result = out_.sent[1].back();
  ASSERT_EQ(result.at("kind"), "step_result");
  EXPECT_EQ(result.at("committed"), Json::array({1}));
  ASSERT_EQ(result.at("failed").size(), 1u);
  EXPECT_EQ(result.at("failed")[0].at("reason"), why);
  EXPECT_EQ(out_.take(2), std::vector<std::string>{"reply"}) << "its ack's; no second abort";
  EXPECT_EQ(out_.take(3), (std::vector<std::string>{"reply", "commit"}));
  EXPECT_TRUE(torn(0));
  EXPECT_FALSE(torn(1));
  request(1, "begin_step", {{"step", 2}, {"plan_id", "p"}});
  for (ConnId e : {2, 3})
    request(e, "ack", {{"step", 2}, {"ok", true}, {"bytes", 1}, {"checksum", 1}, {"landed", true}});
  request(1, "sent", {{"step", 2}, {"ok", true}});
  EXPECT_EQ(out_.sent[1].back().at("committed"), Json::array({0, 1}));
  EXPECT_FALSE(torn(0)) << "its commit ends the mix";
}

// An engine rank whose receive failed stops receiving and acks at once
// (stopped): the trainers still sending are told to drop it, the others
// are not told anything yet.
TEST_F(StateTest, EngineThatStoppedReceivingIsDroppedByTheTrainersStillSending) {
  join(1, "trainer", 0, 2);
  join(2, "trainer", 1, 2);
  join(3, "engine", 0, 2);
  join(4, "engine", 1, 2);
  for (ConnId t : {1, 2}) request(t, "begin_step", {{"step", 1}, {"plan_id", "p"}});
  request(2, "sent", {{"step", 1}, {"ok", true}});
  for (ConnId c : {1, 2, 3, 4}) out_.take(c);
  request(3, "ack",
          {{"step", 1},
           {"ok", false},
           {"bytes", 0},
           {"checksum", 0},
           {"error", "engine rank 0: receive from rank 0 failed"},
           {"stopped", true}});
  ASSERT_EQ(out_.sent[1].size(), 1u) << "trainer rank 0 still sends";
  EXPECT_EQ(out_.sent[1][0].at("kind"), "abort");
  EXPECT_EQ(out_.sent[1][0].at("engine_rank"), 0);
  EXPECT_TRUE(out_.take(2).empty()) << "trainer rank 1 has sent everything";
  EXPECT_TRUE(out_.take(4).empty());
}

// An engine rank told to abort while receiving does not ack before the
// decision; its late ack (of a decided step) still marks it torn.
TEST_F(StateTest, LateLandingOfADecidedStepMarksTheRankTorn) {
  join(1, "trainer", 0, 1);
  join(2, "engine", 0, 1);
  request(1, "begin_step", {{"step", 1}, {"plan_id", "p"}});
  request(1, "sent", {{"step", 1}, {"ok", false}, {"error", "out of memory"}});
  EXPECT_EQ(out_.take(2), (std::vector<std::string>{"step_begin", "abort"}));
  request(2, "ack", {{"step", 1}, {"ok", false}, {"bytes", 0}, {"checksum", 0}, {"landed", true}});
  EXPECT_EQ(out_.take(2), std::vector<std::string>{"reply"}) << "acknowledged, ignored";
  EXPECT_TRUE(torn(0)) << state_.status().dump(1);
}

// An engine that put its last committed version back by its own means
// (weightsync's vLLM and SGLang layers reload it) says so: status stops
// listing it torn. Not while its step is open, and not from a trainer.
TEST_F(StateTest, ARestoredRankIsNoLongerTorn) {
  join(1, "trainer", 0, 1);
  join(2, "engine", 0, 1);
  request(1, "begin_step", {{"step", 1}, {"plan_id", "p"}});
  out_.take(2);
  request(2, "restored", {{"step", 1}});
  ASSERT_EQ(out_.sent[2].size(), 1u);
  EXPECT_EQ(out_.sent[2][0].at("kind"), "error") << "step 1 is still open and not acked";
  EXPECT_NE(out_.sent[2][0].at("message").get<std::string>().find("still open"), std::string::npos);
  out_.take(2);
  request(1, "sent", {{"step", 1}, {"ok", false}, {"error", "out of memory"}});
  request(2, "ack", {{"step", 1}, {"ok", false}, {"bytes", 0}, {"checksum", 0}, {"landed", true}});
  out_.take(2);
  ASSERT_TRUE(torn(0));
  request(1, "restored", {{"step", 1}});
  EXPECT_EQ(out_.sent[1].back().at("kind"), "error") << "engines only";
  EXPECT_TRUE(torn(0));
  request(2, "restored", {{"step", 1}});
  EXPECT_EQ(out_.take(2), std::vector<std::string>{"reply"});
  EXPECT_FALSE(torn(0)) << state_.status().dump(1);
}

// A rank told to abort while the others go on (a trainer's send to it
// failed) restores before the step is decided: the decision does not mark
// it torn again.
TEST_F(StateTest, ARankRestoredBeforeTheDecisionStaysWhole) {
  join(1, "trainer", 0, 1);
  join(2, "engine", 0, 2);
  join(3, "engine", 1, 2);
  request(1, "begin_step", {{"step", 1}, {"plan_id", "p"}});
  for (ConnId c : {1, 2, 3}) out_.take(c);
  request(1, "send_failed", {{"step", 1}, {"engine_rank", 0}, {"error", "injected"}});
  request(2, "ack", {{"step", 1}, {"ok", false}, {"bytes", 0}, {"checksum", 0}, {"landed", true}});
  ASSERT_TRUE(torn(0));
  out_.take(2);
  request(2, "restored", {{"step", 1}});
  EXPECT_EQ(out_.take(2), std::vector<std::string>{"reply"});
  EXPECT_FALSE(torn(0));
  request(3, "ack", {{"step", 1}, {"ok", true}, {"bytes", 1}, {"checksum", 1}, {"landed", true}});
  request(1, "sent", {{"step", 1}, {"ok", true}});
  ASSERT_EQ(out_.sent[1].back().at("kind"), "step_result");
  EXPECT_EQ(out_.sent[1].back().at("committed"), Json::array({1}));
  EXPECT_FALSE(torn(0)) << "the decision marked the restored rank torn again";
}

// An engine rank that applied a committed step (a staged version swapped in
// between engine steps) says so, with the first token index of each request
// running at the swap: status shows its last report and since when. A step
// it did not commit, a bad index and a trainer's report are refused.
TEST_F(StateTest, StatusShowsWhatEachEngineRankAppliedAndSinceWhen) {
  join(1, "trainer", 0, 1);
  join(2, "engine", 0, 1);
  auto applied = [&] {
    const Json status = state_.status();
    for (const Json& m : status.at("members"))
      if (m.at("role") == "engine") return m.at("applied");
    ADD_FAILURE() << "no engine in " << state_.status().dump();
    return Json();
  };
  auto refused = [&](ConnId conn, const char* part) {
    ASSERT_EQ(out_.sent[conn].size(), 1u);
    EXPECT_EQ(out_.sent[conn][0].at("kind"), "error");
    const auto message = out_.sent[conn][0].at("message").get<std::string>();
    EXPECT_NE(message.find(part), std::string::npos) << message;
    out_.take(conn);
  };
  EXPECT_TRUE(applied().is_null()) << "no report yet";
  request(2, "applied", {{"step", 1}, {"requests", Json::object()}});
  refused(2, "not a step it committed (its committed version is -1)");
  request(1, "begin_step", {{"step", 1}, {"plan_id", "p"}});
  request(2, "ack", {{"step", 1}, {"ok", true}, {"bytes", 1}, {"checksum", 1}});
  request(1, "sent", {{"step", 1}, {"ok", true}});
  ASSERT_EQ(state_.committed_version(0), 1);
  out_.take(1);
  out_.take(2);
  request(2, "applied", {{"step", 1}, {"requests", {{"cmpl-a-0-1f2e3d4c", -1}}}});
  refused(2, "request 'cmpl-a-0-1f2e3d4c' must map to a token index >= 0");
  request(2, "applied", {{"step", 1}, {"requests", {{"r", "7"}}}});
  refused(2, "request 'r' must map to a token index");
  request(1, "applied", {{"step", 1}, {"requests", Json::object()}});
  refused(1, "engines only");
  EXPECT_TRUE(applied().is_null()) << "refused reports leave nothing";
  const double before =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const Json requests = {{"cmpl-a-0-1f2e3d4c", 117}, {"cmpl-b-0-99aa88bb", 0}};
  request(2, "applied", {{"step", 1}, {"requests", requests}});
  EXPECT_EQ(out_.take(2), std::vector<std::string>{"reply"});
  const Json a = applied();
  ASSERT_TRUE(a.is_object()) << state_.status().dump(1);
  EXPECT_EQ(a.at("step"), 1);
  EXPECT_EQ(a.at("requests"), requests);
  EXPECT_GE(a.at("at").get<double>(), before);
  EXPECT_LE(a.at("at").get<double>(), before + 60);
  Json many = Json::object();
  for (int i = 0; i <= 4096; ++i) many["r" + std::to_string(i)] = i;
  request(2, "applied", {{"step", 1}, {"requests", many}});
  refused(2, "4097 requests, above the limit of 4096 per report");
  EXPECT_EQ(applied().at("requests"), requests) << "the refused report changed nothing";
  // A new process for the rank has applied nothing yet; its welcome says
  // the coordinator takes "applied" (an older one would close on it).
  state_.on_disconnect(2, "connection lost");
  hello(3, "engine", 0, 1);
  ASSERT_EQ(out_.sent[3].size(), 1u);
  EXPECT_EQ(out_.sent[3][0].at("features"), Json::array({"applied"}));
  EXPECT_TRUE(applied().is_null()) << state_.status().dump(1);
}

// An engine rank's parity line (its FP8 parity check at connect) is shown
// per rank by status; a trainer's is refused, naming the rank.
TEST_F(StateTest, StatusShowsEachEngineRanksParityLine) {
  const std::string line = "14 of 16 linear weights FP8, scales fp32; matches the engine";
  join(1, "engine", 0, 2, {{"parity", line}});
  join(2, "engine", 1, 2);
  const Json status = state_.status();
  std::map<int, std::string> shown;
  for (const Json& m : status.at("members"))
    shown[m.at("rank").get<int>()] = m.at("parity").get<std::string>();
  EXPECT_EQ(shown, (std::map<int, std::string>{{0, line}, {1, ""}})) << status.dump(1);
  try {
    hello(3, "trainer", 0, 1, {{"parity", line}});
    ADD_FAILURE() << "a trainer's parity line was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::protocol);
    EXPECT_NE(std::string(e.what()).find("trainer rank 0 sent a parity line"), std::string::npos)
        << e.what();
  }
}

TEST_F(StateTest, MembersJoiningMidStepWaitForTheNextStep) {
  join(1, "trainer", 0, 1);
  join(2, "engine", 0, 2);
  request(1, "begin_step", {{"step", 1}, {"plan_id", "p"}});
  join(3, "engine", 1, 2);
  request(3, "ack", {{"step", 1}, {"ok", true}, {"bytes", 1}, {"checksum", 1}});
  ASSERT_EQ(out_.sent[3].back().at("kind"), "error") << "not a participant";
  request(2, "ack", {{"step", 1}, {"ok", true}, {"bytes", 1}, {"checksum", 1}});
  request(1, "sent", {{"step", 1}, {"ok", true}});
  EXPECT_EQ(out_.sent[1].back().at("committed"), Json::array({0}));
  out_.take(3);
  request(1, "begin_step", {{"step", 2}, {"plan_id", "p"}});
  EXPECT_EQ(out_.take(3), std::vector<std::string>{"step_begin"});
}

TEST_F(StateTest, DeadlinesExpireOnlyWhenTheirTimeHasCome) {
  state_.on_connect(9, now_);  // never says hello
  join(1, "trainer", 0, 1);
  join(2, "engine", 0, 1);
  request(2, "kv_get", {{"key", "k"}, {"timeout_ms", 1500}});
  request(1, "begin_step", {{"step", 1}, {"plan_id", "p"}});
  out_.take(2);
  state_.on_tick(now_ + 900ms);
  EXPECT_TRUE(out_.closed.empty());
  EXPECT_TRUE(out_.take(2).empty());
  // Keep both members alive with heartbeats; only the silent connection goes.
  now_ += 1100ms;
  message(1, {{"kind", "heartbeat"}});
  message(2, {{"kind", "heartbeat"}});
  state_.on_tick(now_);
  EXPECT_EQ(out_.closed, (std::map<ConnId, std::string>{{9, "timeout"}}));
  now_ += 500ms;
  state_.on_tick(now_);
  EXPECT_EQ(out_.take(2), std::vector<std::string>{"error"}) << "kv_get timed out";
  // The step timeout (10 s) and the grace a rank has to report its own
  // failure (control::kReportGrace, 1 s) fail the engine that never acked
  // and the trainer that never reported: everyone aborts, not before.
  now_ += 9s;  // 10.6 s after the step began
  message(1, {{"kind", "heartbeat"}});
  message(2, {{"kind", "heartbeat"}});
  state_.on_tick(now_);
  EXPECT_TRUE(out_.take(2).empty()) << "a rank may still report within the grace";
  now_ += 500ms;  // 11.1 s
  message(1, {{"kind", "heartbeat"}});
  message(2, {{"kind", "heartbeat"}});
  state_.on_tick(now_);
  EXPECT_EQ(out_.take(2), std::vector<std::string>{"abort"});
  EXPECT_EQ(out_.sent[1].back().at("trainers_ok"), false);
}

TEST_F(StateTest, HeartbeatTimeoutDropsTheMemberAndTellsTheOthers) {
  join(1, "trainer", 0, 1);
  join(2, "engine", 0, 1);
  now_ += 1500ms;
  message(1, {{"kind", "heartbeat"}});
  now_ += 1000ms;
  state_.on_tick(now_);
  EXPECT_EQ(out_.closed.count(2), 1u);
  EXPECT_EQ(out_.closed.count(1), 0u);
  EXPECT_EQ(out_.take(1), std::vector<std::string>{"member_left"});
  EXPECT_EQ(state_.members().size(), 1u);
}

// A coordinator that did not run for a while (its process stopped, or
// starved on a loaded machine: a CI run lost an engine rank so during a 6 s
// swap) does not drop the members it could not hear: silence counts only
// while it ticks. Silent for the timeout after that, a member goes.
TEST_F(StateTest, TimeTheCoordinatorDidNotRunIsNoMembersSilence) {
  join(1, "trainer", 0, 1);
  join(2, "engine", 0, 1);
  state_.on_connect(9, now_);  // never says hello
  state_.on_tick(now_ + 500ms);
  now_ += 12s;  // no tick for 11.5 s: the coordinator was not running
  state_.on_tick(now_);
  EXPECT_TRUE(out_.closed.empty()) << "dropped for silence it could not hear";
  EXPECT_EQ(state_.members().size(), 2u);
  message(1, {{"kind", "heartbeat"}});
  for (int i = 0; i < 2; ++i) {  // ticking every 500 ms: engine rank 0 stays silent
    now_ += 500ms;
    message(1, {{"kind", "heartbeat"}});
    state_.on_tick(now_);
  }
  EXPECT_EQ(out_.closed, (std::map<ConnId, std::string>{{9, "timeout"}}))
      << "silent 0.5 s before the stall and 1 s after: the heartbeat timeout is 2 s (the "
         "hello timeout, 1 s, counts the same way)";
  now_ += 600ms;
  state_.on_tick(now_);
  EXPECT_EQ(out_.closed.count(2), 1u) << "2.1 s silent while the coordinator ran";
  EXPECT_EQ(out_.closed.count(1), 0u);
}

TEST_F(StateTest, LeaveRepliesThenClosesQuietly) {
  join(1, "engine", 0, 1);
  join(2, "observer", 0, 1);
  request(1, "leave", Json::object());
  EXPECT_EQ(out_.take(1), std::vector<std::string>{"reply"});
  EXPECT_EQ(out_.closed.at(1), "") << "no error frame for a graceful leave";
  EXPECT_EQ(out_.take(2), std::vector<std::string>{"member_left"});
  EXPECT_TRUE(state_.members().size() == 1u);
}

}  // namespace
}  // namespace weightsync::control
