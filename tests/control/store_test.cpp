// The coordinator's key/value store, plans, barriers and wait_members,
// through real clients.
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

std::vector<uint8_t> bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

TEST(ControlStore, SetThenGetAndGetWaitsForALaterSet) {
  Coordinator coord(fast_coordinator());
  Client a(client_of(coord, Role::trainer, 0, 2));
  Client b(client_of(coord, Role::trainer, 1, 2));
  a.set("ucx/0", bytes("address-of-0"));
  EXPECT_EQ(b.get("ucx/0", 10s), bytes("address-of-0"));
  a.set("ucx/0", bytes("overwritten"));
  EXPECT_EQ(b.get("ucx/0", 10s), bytes("overwritten"));

  auto waiting = std::async(std::launch::async, [&] { return b.get("nccl/uid", 20s); });
  std::this_thread::sleep_for(
      50ms);  // let the get reach the coordinator first (either order passes)
  std::vector<uint8_t> binary(256);
  for (int i = 0; i < 256; ++i) binary[i] = static_cast<uint8_t>(i);
  a.set("nccl/uid", binary);
  EXPECT_EQ(waiting.get(), binary);
}

TEST(ControlStore, GetTimesOutNamingTheKey) {
  Coordinator coord(fast_coordinator());
  Client a(client_of(coord, Role::engine, 0, 1));
  try {
    a.get("never/set", 200ms);
    FAIL() << "get returned for a key nobody set";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::timeout);
    EXPECT_NE(std::string(e.what()).find("never/set"), std::string::npos) << e.what();
  }
  // The connection is still fine after a timeout.
  a.set("k", bytes("v"));
  EXPECT_EQ(a.get("k", 1s), bytes("v"));
  // A zero timeout asks whether the key is there now (StateTest checks that
  // the answer comes without a tick).
  EXPECT_EQ(a.get("k", 0ms), bytes("v"));
  EXPECT_THROW(a.get("absent", 0ms), Error);
}

TEST(ControlStore, StoreSizeIsCapped) {
  auto opts = fast_coordinator();
  opts.max_store_bytes = 1000;
  Coordinator coord(opts);
  Client a(client_of(coord, Role::engine, 0, 1));
  a.set("small", std::vector<uint8_t>(400));
  EXPECT_THROW(a.set("big", std::vector<uint8_t>(700)), Error);
  a.set("small", std::vector<uint8_t>(10));  // overwriting frees space
  a.set("big", std::vector<uint8_t>(700));
  EXPECT_EQ(a.get("big", 1s).size(), 700u);
}

TEST(ControlStore, PlansArePutAndFetchedWithASizeCap) {
  auto opts = fast_coordinator();
  opts.max_plan_bytes = 64;
  Coordinator coord(opts);
  Client t(client_of(coord, Role::trainer, 0, 1));
  Client e(client_of(coord, Role::engine, 0, 1));
  auto waiting = std::async(std::launch::async, [&] { return e.get_plan("plan-abc", 20s); });
  t.put_plan("plan-abc", bytes("the plan"));
  EXPECT_EQ(waiting.get(), bytes("the plan"));
  try {
    t.put_plan("plan-big", std::vector<uint8_t>(65));
    FAIL() << "oversize plan accepted";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), Errc::invalid_argument);
    EXPECT_NE(std::string(err.what()).find("plan-big"), std::string::npos) << err.what();
  }
  EXPECT_THROW(e.get_plan("plan-big", 100ms), Error);
  // Plans and keys do not collide.
  EXPECT_THROW(e.get("plan-abc", 100ms), Error);
}

TEST(ControlStore, BarrierReleasesEveryoneOnlyWhenAllArrived) {
  Coordinator coord(fast_coordinator());
  constexpr int kN = 5;
  std::vector<std::unique_ptr<Client>> clients;
  for (int i = 0; i < kN; ++i)
    clients.push_back(std::make_unique<Client>(client_of(coord, Role::trainer, i, kN)));
  // With one member missing the barrier must time out for those waiting.
  std::vector<std::future<Errc>> partial;
  for (int i = 0; i < kN - 1; ++i)
    partial.push_back(std::async(std::launch::async, [&, i] {
      try {
        clients[i]->barrier("b1", kN, 300ms);
        return Errc::internal;
      } catch (const Error& e) {
        return e.code();
      }
    }));
  for (auto& f : partial) EXPECT_EQ(f.get(), Errc::timeout);
  // Everyone: released. Twice, since a barrier name can be reused.
  for (int round = 0; round < 2; ++round) {
    std::vector<std::future<void>> all;
    for (int i = 0; i < kN; ++i)
      all.push_back(std::async(std::launch::async, [&, i] { clients[i]->barrier("b1", kN, 20s); }));
    for (auto& f : all) EXPECT_NO_THROW(f.get());
  }
}

TEST(ControlStore, WaitMembersTimesOutAndSucceedsOnceEnoughJoined) {
  Coordinator coord(fast_coordinator());
  Client t(client_of(coord, Role::trainer, 0, 1));
  try {
    t.wait_members(1, 1, 200ms);
    FAIL() << "wait_members returned without an engine";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::timeout);
    EXPECT_NE(std::string(e.what()).find("engines"), std::string::npos) << e.what();
  }
  auto waiting = std::async(std::launch::async, [&] { return t.wait_members(1, 2, 20s); });
  Client e0(client_of(coord, Role::engine, 0, 2));
  Client e1(client_of(coord, Role::engine, 1, 2));
  EXPECT_EQ(waiting.get().size(), 3u);
}

TEST(ControlStore, MemberFieldsAreCarriedToOthers) {
  Coordinator coord(fast_coordinator());
  auto o = client_of(coord, Role::engine, 1, 2);
  o.replica = 0;
  o.layout_hash = "vllm-tp2";
  o.transport_address = {1, 2, 3, 0, 255};
  Client e(o);
  Client t(client_of(coord, Role::trainer, 0, 1));
  const auto members = t.members();
  ASSERT_EQ(members.size(), 2u);
  EXPECT_EQ(members[0].id, e.member_id());
  EXPECT_EQ(members[0].rank, 1);
  EXPECT_EQ(members[0].world, 2);
  EXPECT_EQ(members[0].replica, 0);
  EXPECT_EQ(members[0].layout_hash, "vllm-tp2");
  EXPECT_EQ(members[0].transport_address, o.transport_address);
  EXPECT_EQ(t.members_at_join().size(), 2u);
}

}  // namespace
}  // namespace weightsync::control
