// Hostile and broken peers over raw sockets: each closes only its own
// connection (after an error frame where possible) while a well-behaved
// client keeps being served.
#include "control/raw_peer.h"

#include <nlohmann/json.hpp>

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
using testing::frame_of;
using testing::Json;
using testing::RawPeer;

// A client doing store round trips on its own thread for the whole test.
class BusyClient {
 public:
  explicit BusyClient(const Coordinator& coord)
      : client_(client_of(coord, Role::observer, 0, 1)), thread_([this] { run(); }) {}
  ~BusyClient() {
    stop_ = true;
    thread_.join();
  }
  // Round trips completed so far; throws if any failed.
  int check() {
    if (!error_.empty()) ADD_FAILURE() << "well-behaved client failed: " << error_;
    return rounds_;
  }

 private:
  void run() {
    try {
      while (!stop_) {
        const std::string key = "busy/" + std::to_string(rounds_ % 7);
        const std::vector<uint8_t> value(64, static_cast<uint8_t>(rounds_));
        client_.set(key, value);
        if (client_.get(key, 10s) != value) throw std::runtime_error("value mismatch");
        ++rounds_;
      }
    } catch (const std::exception& e) {
      error_ = e.what();
    }
  }
  Client client_;
  std::atomic<bool> stop_{false};
  std::atomic<int> rounds_{0};
  std::string error_;
  std::thread thread_;
};

// The peer must be closed with an error frame of `code`.
void expect_rejected(RawPeer& peer, const std::string& code, const std::string& what) {
  ASSERT_TRUE(peer.wait_closed(20s)) << what << ": connection left open";
  const auto err = peer.error_frame();
  ASSERT_TRUE(err.has_value()) << what << ": no error frame";
  EXPECT_EQ(err->value("code", ""), code) << what << ": " << err->dump();
  EXPECT_FALSE(err->value("message", "").empty()) << what;
}

class Hostile : public ::testing::Test {
 protected:
  Hostile() : coord_(options()), busy_(coord_) {}
  static CoordinatorOptions options() {
    auto o = fast_coordinator();
    o.hello_timeout = 300ms;
    o.max_frame_bytes = 1 << 20;
    o.max_outgoing_bytes = 1 << 20;
    return o;
  }
  void TearDown() override {
    const int before = busy_.check();
    // Still served after the abuse, and still making progress.
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (busy_.check() <= before && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(10ms);
    EXPECT_GT(busy_.check(), before);
  }
  Coordinator coord_;
  BusyClient busy_;
};

TEST_F(Hostile, OversizeFrameIsRejected) {
  RawPeer p(coord_.port());
  p.send_bytes(std::string("\xff\xff\xff\xff", 4) + std::string(1000, 'x'));
  expect_rejected(p, "format", "oversize frame");
}

TEST_F(Hostile, NonJsonNonObjectAndDeepNestingAreRejected) {
  for (const std::string& payload :
       {std::string("this is not json"), std::string("[1,2,3]"), std::string("42"),
        std::string(5000, '[') + std::string(5000, ']'), std::string("{\"v\":1,")}) {
    RawPeer p(coord_.port());
    p.send_bytes(frame_of(payload));
    expect_rejected(p, "format", payload.substr(0, 20));
  }
}

TEST_F(Hostile, ProtocolViolationsAreRejected) {
  const std::vector<Json> cases = {
      {{"v", 1}, {"kind", "no_such_kind"}},
      {{"v", 99}, {"kind", "hello"}},
      {{"v", 1}, {"kind", "hello"}, {"id", 1}, {"role", "trainer"}, {"world", 2}},  // no rank
      {{"v", 1}, {"kind", "hello"}, {"id", 1}, {"role", "trainer"}, {"rank", "0"}, {"world", 2}},
      {{"v", 1}, {"kind", "hello"}, {"id", 1}, {"role", "pilot"}, {"rank", 0}, {"world", 2}},
      {{"v", 1}, {"kind", "kv_get"}, {"id", 1}, {"key", "k"}, {"timeout_ms", 5}},  // before hello
      {{"v", 1}, {"kind", "commit"}, {"step", 1}},  // a coordinator-to-client kind
  };
  for (const Json& msg : cases) {
    RawPeer p(coord_.port());
    p.send_json(msg);
    expect_rejected(p, "protocol", msg.dump());
  }
}

TEST_F(Hostile, WrongFieldTypesAfterRegistrationAreRejected) {
  RawPeer p(coord_.port());
  ASSERT_TRUE(p.hello("engine", 0, 1));
  ASSERT_TRUE(p.read_frame(10s).has_value());
  p.send_json({{"v", 1},
               {"kind", "ack"},
               {"id", 2},
               {"step", "one"},
               {"ok", true},
               {"bytes", 1},
               {"checksum", 1}});
  expect_rejected(p, "protocol", "ack with a string step");
  EXPECT_TRUE(coord_.members().size() == 1u) << "only the busy client is left";
}

TEST_F(Hostile, SilentConnectionIsClosedAfterTheHelloTimeout) {
  RawPeer p(coord_.port());
  expect_rejected(p, "timeout", "no hello");
}

TEST_F(Hostile, TruncatedFrameFromAMemberCountsAsItLeaving) {
  Client watcher(client_of(coord_, Role::trainer, 0, 1));
  {
    RawPeer p(coord_.port());
    ASSERT_TRUE(p.hello("engine", 0, 1));
    ASSERT_TRUE(p.read_frame(10s).has_value());
    const std::string f = frame_of(R"({"v":1,"kind":"heartbeat"})");
    p.send_bytes(f.substr(0, f.size() / 2));
  }  // closed mid-frame
  const Event e = watcher.wait_event(20s);
  ASSERT_TRUE(std::holds_alternative<MemberLeft>(e));
  EXPECT_NE(std::get<MemberLeft>(e).reason.find("middle of a frame"), std::string::npos)
      << std::get<MemberLeft>(e).reason;
}

TEST_F(Hostile, SlowReaderIsDroppedWhenItsQueueOverflows) {
  RawPeer p(coord_.port());
  ASSERT_TRUE(p.hello("engine", 0, 1));
  ASSERT_TRUE(p.read_frame(10s).has_value());
  const std::string value_b64(400 * 1024, 'A');  // 300 KiB once decoded
  p.send_json({{"v", 1}, {"kind", "kv_set"}, {"id", 2}, {"key", "big"}, {"value", value_b64}});
  ASSERT_TRUE(p.read_frame(10s).has_value());
  // Ask for the value many times without reading the replies.
  constexpr int kRequests = 400;
  for (int i = 0; i < kRequests; ++i)
    if (!p.send_json(
            {{"v", 1}, {"kind", "kv_get"}, {"id", 3 + i}, {"key", "big"}, {"timeout_ms", 1000}}))
      break;
  ASSERT_TRUE(p.wait_closed(30s)) << "slow reader not dropped";
  EXPECT_LT(p.bytes_received(), size_t{kRequests} * value_b64.size())
      << "the coordinator buffered every reply instead of dropping the reader";
}

TEST_F(Hostile, ParkedWaitsAndNameLengthsAreCapped) {
  RawPeer p(coord_.port());
  ASSERT_TRUE(p.hello("engine", 0, 1));
  ASSERT_TRUE(p.read_frame(10s).has_value());
  // Park waits on keys nobody sets until the coordinator refuses more.
  constexpr int kWaits = 300;
  for (int i = 0; i < kWaits; ++i)
    ASSERT_TRUE(p.send_json({{"v", 1},
                             {"kind", "kv_get"},
                             {"id", 10 + i},
                             {"key", "never/" + std::to_string(i)},
                             {"timeout_ms", 60000}}));
  const auto refused = p.read_frame(20s);
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(refused->value("kind", ""), "error");
  EXPECT_EQ(refused->value("code", ""), "invalid_argument");
  EXPECT_NE(refused->value("message", "").find("waits pending"), std::string::npos);
  // A huge key is refused as well, and the connection stays usable.
  p.send_json({{"v", 1},
               {"kind", "kv_set"},
               {"id", 1},
               {"key", std::string(10000, 'k')},
               {"value", "AAAA"}});
  p.send_json({{"v", 1}, {"kind", "members"}, {"id", 2}});
  std::optional<Json> big_key, members;
  for (int i = 0; i < 2 * kWaits && !(big_key && members); ++i) {
    auto f = p.read_frame(20s);
    ASSERT_TRUE(f.has_value()) << "connection closed or silent";
    if (f->value("id", 0) == 1) big_key = f;
    if (f->value("id", 0) == 2) members = f;
  }
  ASSERT_TRUE(big_key && members);
  EXPECT_EQ(big_key->value("code", ""), "invalid_argument");
  EXPECT_EQ(members->value("kind", ""), "reply");
}

TEST_F(Hostile, ConnectionsBeyondTheCapAreRefused) {
  // The cap of this fixture's coordinator is large; use a small one here.
  auto o = fast_coordinator();
  o.max_connections = 2;
  Coordinator small(o);
  RawPeer a(small.port()), b(small.port());
  ASSERT_TRUE(a.hello("engine", 0, 2));
  ASSERT_TRUE(b.hello("engine", 1, 2));
  ASSERT_TRUE(a.read_frame(10s).has_value());
  ASSERT_TRUE(b.read_frame(10s).has_value());
  RawPeer c(small.port());
  expect_rejected(c, "unsupported", "third connection");
  EXPECT_EQ(small.members().size(), 2u);
}

}  // namespace
}  // namespace weightsync::control
