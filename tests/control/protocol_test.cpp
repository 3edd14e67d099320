// The wire protocol on its own: frames, validation, encodings.
#include "control/protocol.h"

#include <gtest/gtest.h>

namespace weightsync::control::wire {
namespace {

std::string frame(const std::string& payload) {
  const auto n = static_cast<uint32_t>(payload.size());
  std::string f{static_cast<char>(n >> 24), static_cast<char>(n >> 16), static_cast<char>(n >> 8),
                static_cast<char>(n)};
  return f + payload;
}

void feed(FrameDecoder& d, const std::string& bytes) {
  d.feed(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

Errc code_of(const std::string& payload) {
  try {
    parse_message(payload);
  } catch (const Error& e) {
    return e.code();
  }
  ADD_FAILURE() << "accepted: " << payload;
  return Errc::internal;
}

TEST(FrameDecoder, SplitsFramesFedByteByByte) {
  const std::string stream = frame("{\"a\":1}") + frame("") + frame("xyz");
  FrameDecoder d(1024);
  std::vector<std::string> got;
  for (char c : stream) {
    feed(d, std::string(1, c));
    while (auto p = d.next()) got.push_back(*p);
  }
  EXPECT_EQ(got, (std::vector<std::string>{"{\"a\":1}", "", "xyz"}));
  EXPECT_FALSE(d.mid_frame());
}

TEST(FrameDecoder, ReportsATruncatedFrame) {
  FrameDecoder d(1024);
  feed(d, frame("hello").substr(0, 6));
  EXPECT_FALSE(d.next().has_value());
  EXPECT_TRUE(d.mid_frame());
}

TEST(FrameDecoder, RejectsAnOversizeHeaderBeforeThePayloadArrives) {
  FrameDecoder d(16);
  try {
    feed(d, std::string("\x00\x00\x00\x11", 4));
    FAIL() << "oversize frame accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::format);
    EXPECT_NE(std::string(e.what()).find("17 bytes"), std::string::npos) << e.what();
  }
}

TEST(EncodeFrame, RoundTripsThroughTheDecoder) {
  Json m = make(Kind::commit);
  m["step"] = 7;
  FrameDecoder d(1024);
  feed(d, encode_frame(m));
  const auto p = d.next();
  ASSERT_TRUE(p.has_value());
  const Message back = parse_message(*p);
  EXPECT_EQ(back.kind, Kind::commit);
  EXPECT_EQ(back.body.at("step"), 7);
  EXPECT_THROW(encode_frame(m, 4), Error);
}

TEST(ParseMessage, RejectsEachKindOfMalformedPayload) {
  EXPECT_EQ(code_of("not json"), Errc::format);
  EXPECT_EQ(code_of("[1,2]"), Errc::format);
  EXPECT_EQ(code_of("\"str\""), Errc::format);
  EXPECT_EQ(code_of(std::string(1000, '[') + std::string(1000, ']')), Errc::format);
  EXPECT_EQ(code_of(R"({"kind":"heartbeat"})"), Errc::protocol);              // no version
  EXPECT_EQ(code_of(R"({"v":2,"kind":"heartbeat"})"), Errc::protocol);        // wrong version
  EXPECT_EQ(code_of(R"({"v":1,"kind":"launch_missiles"})"), Errc::protocol);  // unknown kind
  EXPECT_EQ(code_of(R"({"v":1,"kind":7})"), Errc::protocol);
  EXPECT_EQ(code_of(R"({"v":1,"kind":"kv_get","id":1,"key":"k"})"), Errc::protocol);  // missing
  EXPECT_EQ(code_of(R"({"v":1,"kind":"kv_get","id":1,"key":5,"timeout_ms":1})"), Errc::protocol);
  EXPECT_EQ(code_of(R"({"v":1,"kind":"kv_set","id":1,"key":"k","value":"@@@@"})"),
            Errc::protocol);  // not base64
  EXPECT_EQ(code_of(R"({"v":1,"kind":"hello","id":1,"role":"trainer","rank":-1,"world":2})"),
            Errc::protocol);
  EXPECT_EQ(code_of(R"({"v":1,"kind":"ack","id":1,"step":1,"ok":true,"bytes":1,"checksum":"1x"})"),
            Errc::protocol);
}

TEST(ParseMessage, AcceptsChecksumsAsNumbersOrDecimalStrings) {
  const auto a = parse_message(
      R"({"v":1,"kind":"ack","id":1,"step":3,"ok":true,"bytes":10,"checksum":"18446744073709551615"})");
  EXPECT_EQ(get_u64(a.body, "checksum"), 18446744073709551615ull);
  const auto b =
      parse_message(R"({"v":1,"kind":"ack","id":1,"step":3,"ok":false,"bytes":10,"checksum":42})");
  EXPECT_EQ(get_u64(b.body, "checksum"), 42u);
  EXPECT_EQ(
      code_of(
          R"({"v":1,"kind":"ack","id":1,"step":3,"ok":true,"bytes":1,"checksum":"18446744073709551616"})"),
      Errc::protocol);
}

TEST(Base64, RoundTripsEveryLengthAndRejectsGarbage) {
  for (size_t n = 0; n < 10; ++n) {
    std::vector<uint8_t> bytes(n);
    for (size_t i = 0; i < n; ++i) bytes[i] = static_cast<uint8_t>(i * 77 + 3);
    EXPECT_EQ(base64_decode(base64_encode(bytes)), bytes) << n;
  }
  EXPECT_EQ(base64_encode({'M', 'a', 'n'}), "TWFu");
  EXPECT_THROW(base64_decode("abc"), Error);
  EXPECT_THROW(base64_decode("ab=c"), Error);
  EXPECT_THROW(base64_decode("a==="), Error);
  EXPECT_THROW(base64_decode("ab==abcd"), Error);
}

TEST(MemberJson, RoundTripsAndRejectsMalformedMembers) {
  Member m;
  m.id = 9;
  m.role = Role::engine;
  m.rank = 3;
  m.world = 8;
  m.replica = 1;
  m.layout_hash = "abc";
  m.transport_address = {0, 1, 255};
  m.parity = "2 of 2 linear weights FP8, scales fp32; matches the engine";
  const Member back = member_from_json(member_to_json(m));
  EXPECT_EQ(back.parity, m.parity);
  EXPECT_EQ(back.id, 9u);
  EXPECT_EQ(back.role, Role::engine);
  EXPECT_EQ(back.rank, 3);
  EXPECT_EQ(back.world, 8);
  EXPECT_EQ(back.replica, 1);
  EXPECT_EQ(back.layout_hash, "abc");
  EXPECT_EQ(back.transport_address, m.transport_address);
  Json bad = member_to_json(m);
  bad["role"] = "pilot";
  EXPECT_THROW(member_from_json(bad), Error);
  bad = member_to_json(m);
  bad.erase("rank");
  EXPECT_THROW(member_from_json(bad), Error);
  bad = member_to_json(m);
  bad["parity"] = 3;
  EXPECT_THROW(member_from_json(bad), Error);
  bad.erase("parity");  // a coordinator older than the field
  EXPECT_EQ(member_from_json(bad).parity, "");
}

TEST(ErrcNames, RoundTrip) {
  EXPECT_EQ(errc_from_name("timeout"), Errc::timeout);
  EXPECT_EQ(errc_from_name("peer_failure"), Errc::peer_failure);
  EXPECT_EQ(errc_from_name("nonsense"), Errc::protocol);
  EXPECT_THROW(parse_role("pilot"), Error);
  EXPECT_EQ(parse_role(role_name(Role::observer)), Role::observer);
}

}  // namespace
}  // namespace weightsync::control::wire
