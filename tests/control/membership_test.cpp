// Membership over real sockets: concurrent joins and leaves, dead members,
// duplicate registrations, tokens.
#include "control/raw_peer.h"

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <set>
#include <thread>

namespace weightsync::control {
namespace {

using namespace std::chrono_literals;
using testing::client_of;
using testing::fast_coordinator;
using testing::RawPeer;

std::set<uint64_t> ids_of(const std::vector<Member>& members) {
  std::set<uint64_t> ids;
  for (const auto& m : members) ids.insert(m.id);
  return ids;
}

Errc code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return Errc::internal;
}

TEST(Membership, SixtyFourClientsJoinAndLeaveConcurrently) {
  Coordinator coord(fast_coordinator());
  constexpr int kClients = 64;
  std::vector<std::unique_ptr<Client>> clients(kClients);
  std::vector<std::set<uint64_t>> seen(kClients);
  std::vector<std::string> errors(kClients);
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      try {
        const Role role = i % 2 ? Role::engine : Role::trainer;
        clients[i] = std::make_unique<Client>(client_of(coord, role, i / 2, kClients / 2));
        // Everyone waits for everyone, then all must agree on who is there.
        seen[i] = ids_of(clients[i]->wait_members(kClients / 2, kClients / 2, 30s));
        clients[i]->barrier("joined", kClients, 30s);
        clients[i]->leave();
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  std::set<uint64_t> all;
  for (int i = 0; i < kClients; ++i) {
    ASSERT_EQ(errors[i], "") << "client " << i;
    all.insert(clients[i]->member_id());
  }
  EXPECT_EQ(all.size(), size_t{kClients}) << "member ids must be unique";
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(seen[i], all) << "client " << i;
  EXPECT_TRUE(coord.members().empty()) << "every client left";
}

TEST(Membership, AMemberThatStopsHeartbeatingIsDroppedAndOthersAreTold) {
  auto opts = fast_coordinator();
  opts.heartbeat_timeout = 500ms;
  Coordinator coord(opts);
  Client watcher(client_of(coord, Role::engine, 0, 1));
  RawPeer silent(coord.port());
  ASSERT_TRUE(silent.hello("trainer", 0, 1));
  const auto welcome = silent.read_frame(10s);
  ASSERT_TRUE(welcome.has_value());
  ASSERT_EQ(welcome->at("kind"), "welcome");
  // The raw peer never sends a heartbeat: the coordinator must drop it.
  const Event e = watcher.wait_event(20s);
  ASSERT_TRUE(std::holds_alternative<MemberLeft>(e));
  const auto& left = std::get<MemberLeft>(e);
  EXPECT_EQ(left.member.role, Role::trainer);
  EXPECT_NE(left.reason.find("heartbeat"), std::string::npos) << left.reason;
  EXPECT_TRUE(silent.wait_closed(10s));
  ASSERT_TRUE(silent.error_frame().has_value());
  EXPECT_EQ(silent.error_frame()->value("code", ""), "timeout");
  // The heartbeating watcher is still a member.
  EXPECT_EQ(ids_of(coord.members()), std::set<uint64_t>{watcher.member_id()});
}

TEST(Membership, DuplicateRegistrationClosesOnlyTheNewcomer) {
  Coordinator coord(fast_coordinator());
  Client first(client_of(coord, Role::engine, 2, 4));
  EXPECT_EQ(code_of([&] { Client second(client_of(coord, Role::engine, 2, 4)); }), Errc::protocol);
  EXPECT_TRUE(first.connected());
  EXPECT_EQ(first.members().size(), 1u);
  // Another rank, or the same rank in another role, is fine.
  Client other(client_of(coord, Role::engine, 3, 4));
  Client trainer(client_of(coord, Role::trainer, 2, 4));
  EXPECT_EQ(first.members().size(), 3u);
}

TEST(Membership, RankOutsideTheWorldIsRefused) {
  Coordinator coord(fast_coordinator());
  RawPeer peer(coord.port());
  ASSERT_TRUE(peer.hello("engine", 4, 4));
  EXPECT_TRUE(peer.wait_closed(10s));
  ASSERT_TRUE(peer.error_frame().has_value());
  EXPECT_NE(peer.error_frame()->at("message").get<std::string>().find("outside world"),
            std::string::npos);
}

TEST(Membership, TokenIsRequiredWhenConfigured) {
  auto opts = fast_coordinator();
  opts.token = "s3cret-token";
  Coordinator coord(opts);
  auto o = client_of(coord, Role::trainer, 0, 1);
  EXPECT_EQ(code_of([&] { Client c(o); }), Errc::protocol) << "no token";
  o.token = "s3cret-tokeN";
  EXPECT_EQ(code_of([&] { Client c(o); }), Errc::protocol) << "wrong token";
  o.token = "s3cret";
  EXPECT_EQ(code_of([&] { Client c(o); }), Errc::protocol) << "prefix of the token";
  o.token = "s3cret-token";
  Client good(o);
  EXPECT_EQ(good.members().size(), 1u);
}

TEST(Membership, ConnectTimesOutWhenNothingListens) {
  uint16_t port = 0;
  {
    Coordinator c(fast_coordinator());
    port = c.port();
  }
  ClientOptions o;
  o.address = "127.0.0.1:" + std::to_string(port);
  o.connect_timeout = 300ms;
  try {
    Client c(o);
    FAIL() << "connected to a stopped coordinator";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::timeout);
    EXPECT_NE(std::string(e.what()).find(o.address), std::string::npos) << e.what();
  }
}

TEST(Membership, ClientSeesPeerFailureWhenTheCoordinatorStops) {
  auto coord = std::make_unique<Coordinator>(fast_coordinator());
  Client c(client_of(*coord, Role::engine, 0, 1));
  coord.reset();
  EXPECT_EQ(code_of([&] { c.wait_event(20s); }), Errc::peer_failure);
  EXPECT_EQ(code_of([&] { c.members(); }), Errc::peer_failure);
  EXPECT_FALSE(c.connected());
}

}  // namespace
}  // namespace weightsync::control
