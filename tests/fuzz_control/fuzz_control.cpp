// libFuzzer target for the control plane's input handling.
//
// The input is read three ways: as a byte stream of frames (split in two
// feeds at a point chosen by the first byte, to exercise buffering), each
// decoded payload validated and, when valid, handed to a coordinator state
// machine as if from one of three connections; and as one payload on its
// own, validated and decoded as a client would. Any exception other than
// weightsync::Error, any crash and any sanitizer report is a finding.
#include "control/coordinator_state.h"
#include "control/protocol.h"

#include <cstddef>
#include <cstdint>

namespace {

using namespace weightsync;
using namespace weightsync::control;

class NullOutbox final : public Outbox {
 public:
  void send(ConnId, const wire::Json& message) override {
    // Every message the coordinator sends must itself frame and re-parse.
    const std::string frame = wire::encode_frame(message, size_t{64} << 20);
    wire::parse_message(std::string_view(frame).substr(wire::kHeaderBytes));
  }
  void close(ConnId, std::optional<Errc>, const std::string&) override {}
};

void as_client_would(const wire::Message& m) {
  switch (m.kind) {
    case wire::Kind::welcome:
      wire::member_from_json(m.body.at("member"));
      wire::members_from_json(m.body.at("members"));
      break;
    case wire::Kind::step_begin:
    case wire::Kind::commit:
    case wire::Kind::abort:
    case wire::Kind::member_left:
    case wire::Kind::step_result:
      wire::event_from_message(m);
      break;
    default:
      for (const char* field : {"id", "checksum", "bytes", "timeout_ms"})
        if (m.body.contains(field)) wire::get_u64(m.body, field);
      for (const char* field : {"value", "blob", "address"})
        if (m.body.contains(field)) wire::get_bytes(m.body, field);
  }
}

void feed_stream(const uint8_t* data, size_t size) {
  CoordinatorOptions options;
  options.max_frame_bytes = 1 << 16;
  options.max_store_bytes = 1 << 16;
  options.step_timeout = std::chrono::milliseconds(50);
  NullOutbox outbox;
  CoordinatorState state(options, outbox);
  auto now = Clock::time_point{} + std::chrono::hours(1);
  for (ConnId c = 1; c <= 3; ++c) state.on_connect(c, now);
  wire::FrameDecoder decoder(options.max_frame_bytes);
  const size_t split = size ? data[0] % (size + 1) : 0;
  size_t index = 0;
  try {
    for (const auto& [begin, length] : {std::pair{size_t{0}, split}, {split, size - split}}) {
      decoder.feed(data + begin, length);
      while (auto payload = decoder.next()) {
        const ConnId conn = 1 + index++ % 3;
        now += std::chrono::milliseconds(7);
        try {
          state.on_message(conn, wire::parse_message(*payload), now);
        } catch (const Error&) {
          // As the I/O layer does: drop the connection. The id is reused
          // for a fresh connection so later frames still reach the state.
          state.on_disconnect(conn, "protocol violation");
          state.on_connect(conn, now);
        }
        state.on_tick(now);
      }
    }
  } catch (const Error&) {
  }
  // Every deadline, in ticks at most 1 s apart (a tick more than 2 s after
  // the one before counts as a coordinator that did not run: no member's
  // silence), then an hour on (step deadlines and waiters).
  for (int s = 1; s <= 60; ++s) state.on_tick(now + std::chrono::seconds(s));
  state.on_tick(now + std::chrono::hours(1));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  feed_stream(data, size);
  try {
    as_client_would(
        wire::parse_message(std::string_view(reinterpret_cast<const char*>(data), size)));
  } catch (const Error&) {
  }
  return 0;
}
