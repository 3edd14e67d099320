// The fault-injecting wrapper ("fault:<inner>") injects exactly the faults it
// is configured with, deterministically, over a real UCX transport.
#include "harness.h"

#include "transport/fault/fault_config.h"
#include "transport/fault/freeze_points.h"

#include <gtest/gtest.h>

#include <csignal>

#include <sys/wait.h>
#include <unistd.h>

namespace weightsync::transport_test {

constexpr auto kWait = std::chrono::milliseconds(60000);

// Rank 1 sends two messages; with corrupt_recv=1&count=1 rank 0's first
// receive has exactly one byte flipped and the second is intact.
void fault_corrupt_recv(ScenarioContext& c) {
  Transport& t = c.transport;
  if (t.rank() == 1) {
    TestBuffer a(4096, c.memory), b(4096, c.memory);
    a.fill(1);
    b.fill(2);
    auto s1 = t.send(0, 5, a.buffer());
    auto s2 = t.send(0, 5, b.buffer());
    s1->wait(kWait);
    s2->wait(kWait);
    TestBuffer bye(1, c.memory);
    t.recv(0, 6, bye.buffer())->wait(kWait);
    return;
  }
  TestBuffer a(4096, c.memory), b(4096, c.memory);
  t.recv(1, 5, a.buffer())->wait(kWait);
  t.recv(1, 5, b.buffer())->wait(kWait);
  require(a.differing(1, 4096) == 1,
          cat("first message: ", a.differing(1, 4096), " bytes differ, expected exactly 1"));
  require(b.holds(2, 4096), "second message intact (count=1)");
  TestBuffer bye(1, c.memory);
  t.send(1, 6, bye.buffer())->wait(kWait);
}

// With corrupt_send=1&count=1&tag=6 on the sender, the receiver sees one
// flipped byte in the first tag-6 message, the second intact, and the
// sender's own buffer is left untouched.
void fault_corrupt_send(ScenarioContext& c) {
  Transport& t = c.transport;
  TestBuffer a(100000, c.memory), b(100000, c.memory), bye(1, c.memory);
  if (t.rank() == 1) {
    a.fill(3);
    b.fill(4);
    t.send(0, 6, a.buffer())->wait(kWait);
    t.send(0, 6, b.buffer())->wait(kWait);
    require(a.holds(3, a.size()), "the sender's buffer is not modified");
    t.recv(0, 7, bye.buffer())->wait(kWait);
    return;
  }
  t.recv(1, 6, a.buffer())->wait(kWait);
  t.recv(1, 6, b.buffer())->wait(kWait);
  require(a.differing(3, a.size()) == 1,
          cat("first message: ", a.differing(3, a.size()), " bytes differ, expected exactly 1"));
  require(b.holds(4, b.size()), "second message intact");
  t.send(1, 7, bye.buffer())->wait(kWait);
}

// With truncate_send=1&count=1&tag=10 on the sender, the first tag-10 message
// arrives one byte short (the receive says so) and the second whole.
void fault_truncate_send(ScenarioContext& c) {
  Transport& t = c.transport;
  TestBuffer a(4096, c.memory), b(4096, c.memory), bye(1, c.memory);
  if (t.rank() == 1) {
    a.fill(7);
    b.fill(8);
    t.send(0, 10, a.buffer())->wait(kWait);
    t.send(0, 10, b.buffer())->wait(kWait);
    t.recv(0, 11, bye.buffer())->wait(kWait);
    return;
  }
  const std::size_t first = t.recv(1, 10, a.buffer())->wait(kWait);
  const std::size_t second = t.recv(1, 10, b.buffer())->wait(kWait);
  require(first == a.size() - 1, cat("first message: ", first, " bytes, expected ", a.size() - 1));
  require(a.holds(7, first), "the bytes that came are the sender's");
  require(second == b.size() && b.holds(8, b.size()), "second message whole (count=1)");
  t.send(1, 11, bye.buffer())->wait(kWait);
}

// With drop_send=1&count=1&tag=8 on the sender, the first tag-8 message never
// arrives: rank 0's first receive gets the second, its next one times out.
void fault_drop_send(ScenarioContext& c) {
  Transport& t = c.transport;
  TestBuffer a(2048, c.memory), b(2048, c.memory), bye(1, c.memory);
  if (t.rank() == 1) {
    a.fill(5);
    b.fill(6);
    require(t.send(0, 8, a.buffer())->wait(kWait) == a.size(), "a dropped send completes");
    t.send(0, 8, b.buffer())->wait(kWait);
    t.recv(0, 9, bye.buffer())->wait(kWait);
    return;
  }
  t.recv(1, 8, a.buffer())->wait(kWait);
  require(a.holds(6, a.size()), "the first message to arrive is the second one sent");
  require_error([&] { t.recv(1, 8, b.buffer())->wait(std::chrono::milliseconds(300)); },
                Errc::timeout, {"rank 1"});
  t.send(1, 9, bye.buffer())->wait(kWait);
}

namespace {

void expect_scenario(const std::string& scenario, const std::string& transport) {
  std::string failures;
  try {
    failures = run_scenario(scenario, transport, 2);
  } catch (const std::exception& e) {
    FAIL() << scenario << ", rank 0: " << e.what();
  }
  EXPECT_EQ(failures, "");
}

TEST(FaultTransport, CorruptsOneReceivedByte) {
  expect_scenario("fault_corrupt_recv", "fault:ucx?tls=tcp,self&corrupt_recv=1&count=1&tag=5");
}

TEST(FaultTransport, CorruptsOneSentByteWithoutTouchingTheSendersBuffer) {
  expect_scenario("fault_corrupt_send", "fault:ucx?tls=tcp,self&corrupt_send=1&count=1&tag=6");
}

TEST(FaultTransport, TruncatesASend) {
  expect_scenario("fault_truncate_send", "fault:ucx?tls=tcp,self&truncate_send=1&count=1&tag=10");
}

TEST(FaultTransport, DropsASend) {
  expect_scenario("fault_drop_send", "fault:ucx?tls=tcp,self&drop_send=1&count=1&tag=8");
}

// Single-process cases: a world of one talking to itself over UCX "self".
std::unique_ptr<Transport> self_transport(const TempDir& dir, const std::string& faults,
                                          int world = 1) {
  return make_test_transport("fault:ucx?tls=tcp,self&" + faults, dir.path, 0, world);
}

std::size_t round_trip(Transport& t, Tag tag, TestBuffer& in, const TestBuffer& out) {
  auto r = t.recv(0, tag, in.buffer());
  auto s = t.send(0, tag, out.buffer());
  s->wait(kWait);
  return r->wait(kWait);
}

TEST(FaultTransport, FailsEveryOperationAfterN) {
  TempDir dir;
  auto t = self_transport(dir, "fail_after=2");
  TestBuffer in(256, MemoryKind::host), out(256, MemoryKind::host);
  out.fill(1);
  EXPECT_EQ(round_trip(*t, 1, in, out), 256u);  // operations 1 and 2
  EXPECT_TRUE(in.holds(1, 256));
  auto third = t->send(0, 2, out.buffer());
  try {
    third->wait(kWait);
    ADD_FAILURE() << "the third operation succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::transport);
    EXPECT_NE(std::string(e.what()).find("injected failure"), std::string::npos) << e.what();
  }
}

// Loans through the wrapper (over ipc_host, which makes them): its rank
// answers them, so that a peer never waits out a loan it would not make,
// but lends nothing and declines what it is lent (writes into lent memory
// would bypass its faults). Both transports live in this process, one
// thread driving both.
TEST(FaultTransport, AnswersLoansWithoutLendingOrMapping) {
  TempDir dir;
  auto plain = make_test_transport("ipc_host", dir.path, 0, 2);
  auto faulty = make_test_transport("fault:ipc_host?seed=3", dir.path, 1, 2);
  ASSERT_TRUE(faulty->capabilities().maps_peer_memory) << "it answers loans";
  TestBuffer memory(4096, MemoryKind::host);
  const auto settle = [](Request& a, Request& b) {
    bool done_a = false, done_b = false;
    for (int i = 0; i < 1000000 && !(done_a && done_b); ++i) {
      done_a = done_a || a.test();
      done_b = done_b || b.test();
    }
    ASSERT_TRUE(done_a && done_b);
  };
  // The faulty rank lends: its peer maps nothing, and the loan lent 0 bytes.
  std::vector<void*> at{memory.buffer().data};
  auto lend = faulty->expose(0, 7, {memory.buffer()});
  auto map = plain->map_exposed(1, 7, &at);
  settle(*lend, *map);
  EXPECT_TRUE(at.empty());
  EXPECT_EQ(lend->transferred(), 0u);
  EXPECT_EQ(map->transferred(), 0u);
  // The faulty rank is lent memory: it declines, and the lender learns it.
  std::vector<void*> mapped{memory.buffer().data};
  auto lend_to_faulty = plain->expose(1, 8, {memory.buffer()});
  auto declined = faulty->map_exposed(0, 8, &mapped);
  require_error([&] { settle(*lend_to_faulty, *declined); }, Errc::cancelled, {"rank 1"});
  EXPECT_EQ(mapped, std::vector<void*>{memory.buffer().data})
      << "nothing written into its addresses";
}

TEST(FaultTransport, DeadPeerFailsEveryOperationWithIt) {
  TempDir dir;
  auto t = self_transport(dir, "dead=1", 2);  // rank 1 never exists: it is never contacted
  TestBuffer b(16, MemoryKind::host);
  EXPECT_TRUE(t->peer_failed(1));
  EXPECT_FALSE(t->peer_failed(0));
  for (auto* r : {t->send(1, 1, b.buffer()).release(), t->recv(1, 1, b.buffer()).release()}) {
    std::unique_ptr<Request> owned(r);
    try {
      owned->wait(kWait);
      ADD_FAILURE() << "an operation with the dead rank 1 succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::peer_failure) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(t->connect(1), Error);
}

TEST(FaultTransport, DelayHoldsCompletionBack) {
  TempDir dir;
  auto t = self_transport(dir, "delay_ms=200");
  TestBuffer in(64, MemoryKind::host), out(64, MemoryKind::host);
  out.fill(3);
  const auto start = std::chrono::steady_clock::now();
  auto r = t->recv(0, 1, in.buffer());
  auto s = t->send(0, 1, out.buffer());
  EXPECT_FALSE(s->test());  // a lower bound set by the wrapper, not a race
  s->wait(kWait);
  r->wait(kWait);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
  EXPECT_TRUE(in.holds(3, 64));
}

// release_ms: a send completes only once its receiver released it, no
// sooner than release_ms after the receive completed, through the
// receiver's progress (here the same rank's: a self transport).
TEST(FaultTransport, ReleaseHoldsASendUntilItsReceiverReleasesIt) {
  TempDir dir;
  auto t = self_transport(dir, "release_ms=150");
  TestBuffer in(64, MemoryKind::host), out(64, MemoryKind::host);
  out.fill(4);
  auto r = t->recv(0, 1, in.buffer());
  auto s = t->send(0, 1, out.buffer());
  r->wait(kWait);
  const auto received = std::chrono::steady_clock::now();
  EXPECT_TRUE(in.holds(4, 64));
  EXPECT_FALSE(s->test()) << "released before its time";
  s->wait(kWait);
  EXPECT_GE(std::chrono::steady_clock::now() - received, std::chrono::milliseconds(150));
  // The releases travel under the tag with bit 47 set, which the job's own
  // tags must leave free.
  try {
    t->recv(0, Tag{1} << 47, in.buffer());
    FAIL() << "a tag with bit 47 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("bit 47"), std::string::npos) << e.what();
  }
}

// Which messages are corrupted, and where, depends only on the seed.
std::vector<std::vector<uint8_t>> corrupted_run(uint64_t seed) {
  TempDir dir;
  auto t = self_transport(dir, "corrupt_recv=0.5&seed=" + std::to_string(seed));
  TestBuffer in(256, MemoryKind::host), out(256, MemoryKind::host);
  out.fill(9);
  std::vector<std::vector<uint8_t>> received;
  for (int i = 0; i < 24; ++i) {
    round_trip(*t, 1, in, out);
    received.push_back(in.read());
  }
  return received;
}

TEST(FaultTransport, SameSeedSameFaults) {
  const auto a = corrupted_run(42);
  const auto b = corrupted_run(42);
  EXPECT_EQ(a, b);
  int corrupted = 0;
  TestBuffer reference(256, MemoryKind::host);
  reference.fill(9);
  for (const auto& m : a) corrupted += m != reference.read();
  EXPECT_GT(corrupted, 0);
  EXPECT_LT(corrupted, 24);
}

// freeze_send=2: the rank stops (SIGSTOP) posting its second send, as a hung
// process would, and goes on when continued. Run in a child process, which
// the test sees stopped, then resumes; the round trips complete. The freeze
// points are a test hook: refused (exit code 2) until the child arms them.
TEST(FaultTransport, FreezeStopsTheRankAtItsNthSend) {
  TempDir dir;
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    try {
      self_transport(dir, "freeze_send=2");
      ::_exit(2);
    } catch (const Error& e) {
      if (e.code() != Errc::invalid_argument) ::_exit(2);
    }
    transport::fault::arm_freeze_points();
    int code = 1;
    try {
      auto t = self_transport(dir, "freeze_send=2");
      TestBuffer in(256, MemoryKind::host), out(256, MemoryKind::host);
      out.fill(5);
      if (round_trip(*t, 1, in, out) == 256 && in.holds(5, 256) &&  // send 1
          round_trip(*t, 2, in, out) == 256)                        // send 2: freezes first
        code = 0;
    } catch (...) {
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, WUNTRACED), pid);
  ASSERT_TRUE(WIFSTOPPED(status)) << "the rank did not freeze (status " << status << ")";
  EXPECT_EQ(WSTOPSIG(status), SIGSTOP);
  ::kill(pid, SIGCONT);
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the round trips failed after the rank was continued";
}

TEST(FaultTransport, RejectsMalformedSettings) {
  TempDir dir;
  for (const char* bad : {"corrupt_recv=2", "drop_send=x", "fail_after=-1", "dead=a,b",
                          "freeze_send=0", "release_ms=soon"}) {
    try {
      self_transport(dir, bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::string(bad).substr(0, 6)), std::string::npos)
          << e.what();
    }
  }
}

// tag=T1,T2: only operations with one of the listed tags are hit (the chaos
// soak arms one rank for the buckets of several steps this way).
TEST(FaultTransport, TagListHitsOnlyThoseTags) {
  using transport::fault::FaultConfig;
  using transport::fault::FaultPlan;
  FaultPlan plan(FaultConfig::parse({{"corrupt_recv", "1"}, {"tag", "5,9"}}));
  std::vector<bool> hit;
  for (Tag t : {Tag{4}, Tag{5}, Tag{9}, Tag{5}, Tag{10}})
    hit.push_back(plan.next_recv(t) == FaultPlan::Fault::corrupt);
  EXPECT_EQ(hit, (std::vector<bool>{false, true, true, true, false}));
  EXPECT_THROW(FaultConfig::parse({{"tag", "5,x"}}), Error);
}

}  // namespace
}  // namespace weightsync::transport_test
