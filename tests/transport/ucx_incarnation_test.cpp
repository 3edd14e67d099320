// Addresses carry the rank's incarnation (issue 52): while a new process
// takes a rank over, the store may still hold the departed process's UCX
// address. A peer that connects then must wait for the new process's
// address, never connect to the departed one's (which failed with shared
// memory's "Shared memory error" until the next step); with no process
// holding the rank, it fails at once.
#include "harness.h"

#include <weightsync/store.h>

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <mutex>
#include <thread>

namespace weightsync::transport_test {
namespace {

constexpr auto kWait = std::chrono::milliseconds(20000);

// Who holds each rank now, as the coordinator's membership would say.
struct Members {
  std::mutex mu;
  std::map<int, uint64_t> at;
  uint64_t operator()(int rank) {
    std::lock_guard lock(mu);
    auto it = at.find(rank);
    return it == at.end() ? 0 : it->second;
  }
};

TransportOptions options(Store& store, int rank, uint64_t incarnation, Members& members) {
  TransportOptions o;
  o.name = "ucx";
  o.store = &store;
  o.prefix = "job";
  o.rank = rank;
  o.world = 2;
  o.bootstrap_timeout = kWait;
  o.incarnation = incarnation;
  o.incarnation_of = [&members](int peer) { return members(peer); };
  return o;
}

// Rank 0's first process: publishes its address under incarnation 11 and
// exits, as a killed process does; its address stays in the store.
void departed_rank0(const std::string& dir) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    try {
      auto store = make_file_store(dir);
      Members none;
      auto t = make_transport(options(*store, 0, 11, none));
      ::_exit(0);
    } catch (...) {
      ::_exit(1);
    }
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

TEST(UcxIncarnation, APeerTakenOverIsReachedAtItsNewAddressNeverTheDepartedOnes) {
  TempDir dir;
  departed_rank0(dir.path);
  auto store = make_file_store(dir.path);
  Members members;
  members.at = {{0, 12}, {1, 21}};  // process 12 registered for rank 0, not yet published
  auto rank1 = make_transport(options(*store, 1, 21, members));

  // Rank 0's new process publishes 300 ms later, then receives one message
  // and answers it.
  std::atomic<bool> ok{false};
  std::string error;
  std::thread rank0([&] {
    try {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      auto store0 = make_file_store(dir.path);
      auto t = make_transport(options(*store0, 0, 12, members));
      TestBuffer in(65536, MemoryKind::host), back(8, MemoryKind::host);
      t->recv(1, 7, in.buffer())->wait(kWait);
      back.fill(8);
      t->send(1, 8, back.buffer())->wait(kWait);
      ok = in.holds(7, 65536);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  TestBuffer out(65536, MemoryKind::host), answer(8, MemoryKind::host);
  out.fill(7);
  std::string failure;
  try {
    auto reply = rank1->recv(0, 8, answer.buffer());
    rank1->send(0, 7, out.buffer())->wait(kWait);
    reply->wait(kWait);
  } catch (const Error& e) {
    failure = e.what();
  }
  rank0.join();
  EXPECT_EQ(failure, "") << "rank 1 connected to the departed process's address";
  EXPECT_EQ(error, "");
  EXPECT_TRUE(ok) << "rank 0's new process did not get the message whole";
  EXPECT_TRUE(answer.holds(8, 8));
}

TEST(UcxIncarnation, ANewProcessThatNeverPublishesIsNamedInTheTimeout) {
  TempDir dir;
  departed_rank0(dir.path);
  auto store = make_file_store(dir.path);
  Members members;
  members.at = {{0, 12}, {1, 21}};
  TransportOptions o = options(*store, 1, 21, members);
  o.bootstrap_timeout = std::chrono::milliseconds(500);
  auto rank1 = make_transport(o);
  const std::string message = require_error([&] { rank1->connect(0); }, Errc::timeout,
                                            {"rank 0", "process 12", "process 11", "departed"});
  EXPECT_NE(message.find("did not publish its address"), std::string::npos) << message;
}

// The departed process has no successor (no process holds rank 0): a
// connect fails at once, naming the rank and the process that left, rather
// than waiting out the bootstrap timeout (a killed trainer rank then held
// every other rank of a checkpoint save until the command killed them).
TEST(UcxIncarnation, APeerWhoseProcessLeftWithNoSuccessorFailsAtOnce) {
  TempDir dir;
  departed_rank0(dir.path);
  auto store = make_file_store(dir.path);
  Members members;
  members.at = {{1, 21}};
  auto rank1 = make_transport(options(*store, 1, 21, members));  // 20 s bootstrap timeout
  const auto start = std::chrono::steady_clock::now();
  require_error([&] { rank1->connect(0); }, Errc::peer_failure,
                {"rank 0", "member id 11", "left", "no process holds the rank"});
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5))
      << "waited for the bootstrap timeout";
}

}  // namespace
}  // namespace weightsync::transport_test
