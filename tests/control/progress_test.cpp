// Client::while_waiting: the work a rank must keep doing while it waits in
// the control client (a transport's progress), through real clients and a
// real coordinator.
#include "control/raw_peer.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <atomic>
#include <thread>

namespace weightsync::control {
namespace {

using namespace std::chrono_literals;
using testing::client_of;
using testing::fast_coordinator;

// Every kind of wait runs the hook from the waiting thread, again and again
// while it waits; once the registration is gone, none does.
TEST(ClientProgress, EveryWaitRunsTheHookUntilItIsGone) {
  Coordinator coord(fast_coordinator());
  Client a(client_of(coord, Role::engine, 0, 1));
  std::atomic<int> calls{0};
  std::thread::id where;
  auto progress = a.while_waiting([&] {
    where = std::this_thread::get_id();
    ++calls;
  });
  EXPECT_THROW(a.wait_event(300ms), Error);  // nothing happens: a timeout
  const int after_event = calls.load();
  // About every millisecond: far more than a handful over 300 ms.
  EXPECT_GT(after_event, 20);
  EXPECT_EQ(where, std::this_thread::get_id());
  EXPECT_THROW(a.get("never/set", 200ms), Error);  // a request's wait
  EXPECT_GT(calls.load(), after_event + 10);
  EXPECT_THROW(a.wait_step_result(7, 100ms), Error);

  progress = {};
  const int before = calls.load();
  EXPECT_THROW(a.wait_event(100ms), Error);
  EXPECT_EQ(calls.load(), before) << "the hook ran after its registration ended";
}

// A wait whose answer arrives returns at once, with hooks registered too.
TEST(ClientProgress, AnswersStillEndTheWait) {
  Coordinator coord(fast_coordinator());
  Client a(client_of(coord, Role::trainer, 0, 2));
  Client b(client_of(coord, Role::trainer, 1, 2));
  int calls = 0;
  auto progress = b.while_waiting([&] { ++calls; });
  a.set("k", {1, 2, 3});
  EXPECT_EQ(b.get("k", 10s), (std::vector<uint8_t>{1, 2, 3}));
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    a.set("late", {4});
  });
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(b.get("late", 10s), std::vector<uint8_t>{4});
  later.join();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_GT(calls, 0) << "the wait for 'late' ran the hook";
}

// Two registrations both run; ending one leaves the other.
TEST(ClientProgress, RegistrationsAreIndependent) {
  Coordinator coord(fast_coordinator());
  Client a(client_of(coord, Role::engine, 0, 1));
  int first = 0, second = 0;
  auto p1 = a.while_waiting([&] { ++first; });
  {
    auto p2 = a.while_waiting([&] { ++second; });
    EXPECT_THROW(a.wait_event(50ms), Error);
    EXPECT_GT(first, 0);
    EXPECT_GT(second, 0);
  }
  const int second_before = second, first_before = first;
  EXPECT_THROW(a.wait_event(50ms), Error);
  EXPECT_EQ(second, second_before);
  EXPECT_GT(first, first_before);
  Client::Progress moved = std::move(p1);  // a moved registration still counts
  const int moved_before = first;
  EXPECT_THROW(a.wait_event(50ms), Error);
  EXPECT_GT(first, moved_before);
}

// A watcher thread waiting on the client beside the thread that drives the
// transport (save_hf's end watch) runs no hook while it is quiet, on any
// client; the driving thread's waits still do, and so does the watcher's
// once its QuietWaits is gone.
TEST(ClientProgress, QuietWaitsRunNoHookOnTheirThread) {
  Coordinator coord(fast_coordinator());
  Client a(client_of(coord, Role::trainer, 0, 1));
  std::atomic<int> on_main{0}, elsewhere{0};
  const auto main_thread = std::this_thread::get_id();
  auto progress = a.while_waiting([&] {
    if (std::this_thread::get_id() == main_thread)
      ++on_main;
    else
      ++elsewhere;
  });
  std::thread watcher([&] {
    {
      Client::QuietWaits quiet;
      {
        Client::QuietWaits nested;  // nesting keeps it quiet
      }
      EXPECT_THROW(a.get("never/set", 300ms), Error);
    }
    EXPECT_EQ(elsewhere.load(), 0) << "a quiet wait ran the hook";
    EXPECT_THROW(a.get("never/set", 100ms), Error);  // quiet no more
  });
  EXPECT_THROW(a.wait_event(200ms), Error);
  watcher.join();
  EXPECT_GT(on_main.load(), 10) << "the driving thread's wait ran the hook";
  EXPECT_GT(elsewhere.load(), 0) << "the hook ran once the watcher was quiet no more";
}

}  // namespace
}  // namespace weightsync::control
