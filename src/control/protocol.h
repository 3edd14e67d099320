// The control-plane wire protocol: frames, message validation, encodings.
//
// A frame is a 4-byte big-endian payload length followed by the payload, a
// UTF-8 JSON object with "v" (kProtocolVersion) and "kind". parse_message is
// the one gate every received payload passes: after it, a message's fields
// exist with the types its kind requires, so handlers may read them with
// plain .at()/.get<>() without further checks. This file and protocol.cpp
// depend only on nlohmann_json and the error model, so the fuzz target can
// build them alone.
#pragma once

#include <weightsync/control.h>
#include <weightsync/error.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace weightsync::control::wire {

using Json = nlohmann::json;

inline constexpr size_t kHeaderBytes = 4;
inline constexpr int kMaxJsonDepth = 16;

// Splits a byte stream into payloads. Memory is bounded by one frame plus
// the bytes fed at once.
class FrameDecoder {
 public:
  explicit FrameDecoder(size_t max_frame_bytes) : max_frame_bytes_(max_frame_bytes) {}
  // Appends received bytes. Errc::format as soon as a header announces a
  // frame above the limit (the caller should drop the connection).
  void feed(const uint8_t* data, size_t size);
  // The next complete payload, if one is buffered.
  std::optional<std::string> next();
  // True when part of a frame is buffered: a peer closing now truncated it.
  bool mid_frame() const { return buffer_.size() > offset_; }

 private:
  void check_header();
  size_t max_frame_bytes_;
  std::string buffer_;
  size_t offset_ = 0;  // start of the first unconsumed byte in buffer_
};

// Header + compact JSON. Errc::format if the payload exceeds max_frame_bytes.
std::string encode_frame(const Json& message, size_t max_frame_bytes = kDefaultMaxFrameBytes);

enum class Kind {
  // client -> coordinator
  hello,
  heartbeat,
  leave,
  kv_set,
  kv_get,
  barrier,
  wait_members,
  members,
  plan_put,
  plan_get,
  begin_step,
  ack,
  sent,
  send_failed,
  restored,
  applied,
  version,
  status,
  // coordinator -> client
  welcome,
  reply,
  error,
  step_begin,
  commit,
  abort,
  member_left,
  step_result,
};

std::string_view kind_name(Kind kind) noexcept;
bool is_request(Kind kind) noexcept;  // sent by clients to the coordinator

struct Message {
  Kind kind;
  Json body;  // the whole validated object
};

// Parses and validates one payload. Errc::format when it is not a JSON object
// (or nests deeper than kMaxJsonDepth); Errc::protocol for a wrong version,
// an unknown kind, a missing field or a field of the wrong type or range.
Message parse_message(std::string_view payload);

// A new message of `kind` with "v" set.
Json make(Kind kind);

// Field readers for validated messages.
uint64_t get_u64(const Json& body, const char* field);                // number or decimal string
std::vector<uint8_t> get_bytes(const Json& body, const char* field);  // base64

std::string base64_encode(const std::vector<uint8_t>& bytes);
// Errc::format on a character outside the alphabet or bad padding.
std::vector<uint8_t> base64_decode(std::string_view text);

Json member_to_json(const Member& member);
Member member_from_json(const Json& json);  // Errc::protocol on a malformed member

// Decoders of what the coordinator sends to clients (Errc::protocol when
// malformed beyond what parse_message checks).
Event event_from_message(const Message& message);  // step_begin, commit, abort, ...
std::vector<Member> members_from_json(const Json& list);
// Elastic replicas: the "replicas" field of begin_step, its reply and
// step_begin (absent: nullopt); Errc::protocol unless an array of ascending
// distinct integers in [0, 2^31).
std::optional<std::vector<int>> replicas_from_json(const Json& body);

// Errc from its name (errc_name); Errc::protocol for an unknown name.
Errc errc_from_name(std::string_view name) noexcept;

}  // namespace weightsync::control::wire
