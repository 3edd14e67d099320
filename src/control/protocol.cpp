#include "protocol.h"

#include <nlohmann/json.hpp>

#include <array>
#include <limits>

namespace weightsync::control {

std::string_view role_name(Role role) noexcept {
  switch (role) {
    case Role::trainer:
      return "trainer";
    case Role::engine:
      return "engine";
    case Role::observer:
      return "observer";
  }
  return "unknown";
}

Role parse_role(std::string_view name) {
  if (name == "trainer") return Role::trainer;
  if (name == "engine") return Role::engine;
  if (name == "observer") return Role::observer;
  fail(Errc::invalid_argument, "unknown role '", name, "' (expected trainer, engine or observer)");
}

}  // namespace weightsync::control

namespace weightsync::control::wire {
namespace {

// What a field must hold. Ranges are checked here so that handlers never see
// a negative rank or a count that does not fit an int.
enum class Type { str, boolean, i64, count, u64, bytes, object, array };

struct Field {
  const char* name;
  Type type;
  bool required = true;
};

struct KindSpec {
  Kind kind;
  const char* name;
  bool request;
  std::vector<Field> fields;
};

// Requests that join, leave and meet: membership, the key/value store and barriers.
std::vector<KindSpec> membership_requests() {
  return {
      {Kind::hello,
       "hello",
       true,
       {{"id", Type::u64},
        {"role", Type::str},
        {"rank", Type::count},
        {"world", Type::count},
        {"replica", Type::i64, false},
        {"layout_hash", Type::str, false},
        {"address", Type::bytes, false},
        {"token", Type::str, false},
        {"parity", Type::str, false},
        // A client registering again after a lost connection (a restarted
        // coordinator): {"member", "version", "last_step", "torn"}.
        {"resume", Type::object, false}}},
      {Kind::heartbeat, "heartbeat", true, {}},
      {Kind::leave, "leave", true, {{"id", Type::u64}}},
      {Kind::kv_set,
       "kv_set",
       true,
       {{"id", Type::u64}, {"key", Type::str}, {"value", Type::bytes}}},
      {Kind::kv_get,
       "kv_get",
       true,
       {{"id", Type::u64}, {"key", Type::str}, {"timeout_ms", Type::u64}}},
      {Kind::barrier,
       "barrier",
       true,
       {{"id", Type::u64}, {"name", Type::str}, {"count", Type::count}, {"timeout_ms", Type::u64}}},
      {Kind::wait_members,
       "wait_members",
       true,
       {{"id", Type::u64},
        {"trainers", Type::count},
        {"engines", Type::count},
        {"timeout_ms", Type::u64}}},
      {Kind::members, "members", true, {{"id", Type::u64}}},
  };
}

// Requests that publish plans and drive a step: put/get a plan, begin, ack, sent,
// send_failed.
std::vector<KindSpec> step_requests() {
  return {
      {Kind::plan_put,
       "plan_put",
       true,
       {{"id", Type::u64}, {"plan_id", Type::str}, {"blob", Type::bytes}}},
      {Kind::plan_get,
       "plan_get",
       true,
       {{"id", Type::u64}, {"plan_id", Type::str}, {"timeout_ms", Type::u64}}},
      {Kind::begin_step,
       "begin_step",
       true,
       {{"id", Type::u64},
        {"step", Type::i64},
        {"plan_id", Type::str},
        {"replicas", Type::array, false},
        {"timeout_ms", Type::u64, false}}},
      {Kind::ack,
       "ack",
       true,
       {{"id", Type::u64},
        {"step", Type::i64},
        {"ok", Type::boolean},
        {"bytes", Type::u64},
        {"checksum", Type::u64},
        {"error", Type::str, false},
        {"stats", Type::object, false},
        {"landed", Type::boolean, false},
        {"stopped", Type::boolean, false}}},
      {Kind::sent,
       "sent",
       true,
       {{"id", Type::u64},
        {"step", Type::i64},
        {"ok", Type::boolean},
        {"error", Type::str, false},
        {"stats", Type::object, false}}},
      // A trainer's send to one engine rank failed: that rank fails the step
      // now (it is told to stop), not at the step timeout.
      {Kind::send_failed,
       "send_failed",
       true,
       {{"id", Type::u64},
        {"step", Type::i64},
        {"engine_rank", Type::count},
        {"error", Type::str}}},
      // An engine rank whose params a failed step wrote put its last
      // committed version back whole (the engine's own restore): not torn.
      {Kind::restored, "restored", true, {{"id", Type::u64}, {"step", Type::i64}}},
      // An engine rank now serves committed step `step` (a staged one
      // applied between engine steps): since when, and the index of the
      // first token step `step` made in each request running at the swap.
      {Kind::applied,
       "applied",
       true,
       {{"id", Type::u64}, {"step", Type::i64}, {"requests", Type::object}}},
      {Kind::version, "version", true, {{"id", Type::u64}, {"engine_rank", Type::count}}},
      {Kind::status, "status", true, {{"id", Type::u64}}},
  };
}

// What the coordinator sends: replies to requests and the step's broadcasts.
std::vector<KindSpec> coordinator_messages() {
  return {
      {Kind::welcome,
       "welcome",
       false,
       {{"id", Type::u64},
        {"member", Type::object},
        {"members", Type::array},
        // Which coordinator this is (its start time in microseconds): a
        // client that comes back to the same one was dropped by it.
        {"coordinator", Type::u64, false},
        // The requests it knows beyond the first set ("applied").
        {"features", Type::array, false}}},
      {Kind::reply, "reply", false, {{"id", Type::u64}}},
      {Kind::error,
       "error",
       false,
       {{"message", Type::str}, {"code", Type::str, false}, {"id", Type::u64, false}}},
      {Kind::step_begin,
       "step_begin",
       false,
       {{"step", Type::i64}, {"plan_id", Type::str}, {"replicas", Type::array, false}}},
      {Kind::commit, "commit", false, {{"step", Type::i64}}},
      {Kind::abort,
       "abort",
       false,
       {{"step", Type::i64}, {"reason", Type::str}, {"engine_rank", Type::count, false}}},
      {Kind::member_left, "member_left", false, {{"member", Type::object}, {"reason", Type::str}}},
      {Kind::step_result,
       "step_result",
       false,
       {{"step", Type::i64},
        {"trainers_ok", Type::boolean},
        {"committed", Type::array},
        {"failed", Type::array}}},
  };
}

const std::vector<KindSpec>& specs() {
  static const std::vector<KindSpec> table = [] {
    std::vector<KindSpec> all = membership_requests();
    for (auto& group : {step_requests(), coordinator_messages()})
      all.insert(all.end(), group.begin(), group.end());
    return all;
  }();
  return table;
}

const KindSpec* find_spec(std::string_view name) {
  for (const auto& s : specs())
    if (name == s.name) return &s;
  return nullptr;
}

const KindSpec& spec_of(Kind kind) {
  for (const auto& s : specs())
    if (s.kind == kind) return s;
  fail(Errc::internal, "no wire spec for message kind ", static_cast<int>(kind));
}

bool is_decimal_u64(const std::string& s) {
  if (s.empty() || s.size() > 20) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return s.size() < 20 || s <= "18446744073709551615";
}

bool base64_valid(const std::string& s) {
  try {
    base64_decode(s);
    return true;
  } catch (const Error&) {
    return false;
  }
}

bool has_type(const Json& v, Type type) {
  switch (type) {
    case Type::str:
      return v.is_string();
    case Type::boolean:
      return v.is_boolean();
    case Type::i64:
      return v.is_number_integer();
    case Type::count:
      return v.is_number_integer() && v.get<int64_t>() >= 0 &&
             v.get<int64_t>() <= std::numeric_limits<int>::max();
    case Type::u64:
      return v.is_number_unsigned() || (v.is_string() && is_decimal_u64(v.get<std::string>()));
    case Type::bytes:
      return v.is_string() && base64_valid(v.get<std::string>());
    case Type::object:
      return v.is_object();
    case Type::array:
      return v.is_array();
  }
  return false;
}

const char* type_name(Type type) {
  switch (type) {
    case Type::str:
      return "a string";
    case Type::boolean:
      return "a boolean";
    case Type::i64:
      return "an integer";
    case Type::count:
      return "an integer in [0, 2^31)";
    case Type::u64:
      return "an unsigned 64-bit integer (number or decimal string)";
    case Type::bytes:
      return "a base64 string";
    case Type::object:
      return "an object";
    case Type::array:
      return "an array";
  }
  return "?";
}

// Rejects deep nesting before building the DOM, so that hostile input like
// "[[[[..." cannot exhaust the stack anywhere downstream.
struct DepthGuard : nlohmann::json_sax<Json> {
  int depth = 0;
  bool push() { return ++depth <= kMaxJsonDepth; }
  bool pop() { return --depth, true; }
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override { return push(); }
  bool key(string_t&) override { return true; }
  bool end_object() override { return pop(); }
  bool start_array(std::size_t) override { return push(); }
  bool end_array() override { return pop(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }
};

}  // namespace

void FrameDecoder::feed(const uint8_t* data, size_t size) {
  // Compact before growing so the buffer never holds consumed frames.
  if (offset_ > 0) {
    buffer_.erase(0, offset_);
    offset_ = 0;
  }
  buffer_.append(reinterpret_cast<const char*>(data), size);
  check_header();
}

void FrameDecoder::check_header() {
  if (buffer_.size() - offset_ < kHeaderBytes) return;
  const auto* p = reinterpret_cast<const uint8_t*>(buffer_.data() + offset_);
  const uint64_t length =
      (uint64_t{p[0]} << 24) | (uint64_t{p[1]} << 16) | (uint64_t{p[2]} << 8) | uint64_t{p[3]};
  if (length > max_frame_bytes_)
    fail(Errc::format, "frame of ", length, " bytes exceeds the limit of ", max_frame_bytes_,
         " bytes");
}

std::optional<std::string> FrameDecoder::next() {
  if (buffer_.size() - offset_ < kHeaderBytes) return std::nullopt;
  check_header();
  const auto* p = reinterpret_cast<const uint8_t*>(buffer_.data() + offset_);
  const size_t length = (size_t{p[0]} << 24) | (size_t{p[1]} << 16) | (size_t{p[2]} << 8) | p[3];
  if (buffer_.size() - offset_ - kHeaderBytes < length) return std::nullopt;
  std::string payload = buffer_.substr(offset_ + kHeaderBytes, length);
  offset_ += kHeaderBytes + length;
  if (offset_ == buffer_.size()) {
    buffer_.clear();
    offset_ = 0;
  }
  return payload;
}

std::string encode_frame(const Json& message, size_t max_frame_bytes) {
  // Invalid UTF-8 in a string becomes U+FFFD instead of an exception.
  std::string payload = message.dump(-1, ' ', false, Json::error_handler_t::replace);
  if (payload.size() > max_frame_bytes || payload.size() > 0xffffffffu)
    fail(Errc::format, "message '", message.value("kind", "?"), "' of ", payload.size(),
         " bytes exceeds the frame limit of ", max_frame_bytes, " bytes");
  const auto n = static_cast<uint32_t>(payload.size());
  std::string frame;
  frame.reserve(kHeaderBytes + n);
  frame.push_back(static_cast<char>(n >> 24));
  frame.push_back(static_cast<char>(n >> 16));
  frame.push_back(static_cast<char>(n >> 8));
  frame.push_back(static_cast<char>(n));
  return frame + payload;
}

std::string_view kind_name(Kind kind) noexcept {
  for (const auto& s : specs())
    if (s.kind == kind) return s.name;
  return "unknown";
}

bool is_request(Kind kind) noexcept {
  for (const auto& s : specs())
    if (s.kind == kind) return s.request;
  return false;
}

Message parse_message(std::string_view payload) {
  DepthGuard guard;
  if (!Json::sax_parse(payload, &guard, Json::input_format_t::json, false))
    fail(Errc::format, "control message is not valid JSON (or nests deeper than ", kMaxJsonDepth,
         " levels)");
  Json body = Json::parse(payload, nullptr, false);
  if (body.is_discarded()) fail(Errc::format, "control message is not valid JSON");
  if (!body.is_object()) fail(Errc::format, "control message is not a JSON object");
  const auto v = body.find("v");
  if (v == body.end() || !v->is_number_integer() || v->get<int64_t>() != kProtocolVersion)
    fail(Errc::protocol, "control message needs \"v\": ", kProtocolVersion);
  const auto k = body.find("kind");
  if (k == body.end() || !k->is_string())
    fail(Errc::protocol, "control message needs a string \"kind\"");
  const KindSpec* spec = find_spec(k->get_ref<const std::string&>());
  if (!spec) fail(Errc::protocol, "unknown message kind '", k->get_ref<const std::string&>(), "'");
  for (const Field& f : spec->fields) {
    const auto it = body.find(f.name);
    if (it == body.end()) {
      if (f.required) fail(Errc::protocol, spec->name, ": missing field \"", f.name, "\"");
      continue;
    }
    if (!has_type(*it, f.type))
      fail(Errc::protocol, spec->name, ": field \"", f.name, "\" must be ", type_name(f.type));
  }
  return Message{spec->kind, std::move(body)};
}

Json make(Kind kind) {
  return Json{{"v", kProtocolVersion}, {"kind", spec_of(kind).name}};
}

uint64_t get_u64(const Json& body, const char* field) {
  const Json& v = body.at(field);
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_string() && is_decimal_u64(v.get<std::string>()))
    return std::stoull(v.get<std::string>());
  fail(Errc::protocol, "field \"", field, "\" must be an unsigned 64-bit integer");
}

std::vector<uint8_t> get_bytes(const Json& body, const char* field) {
  return base64_decode(body.at(field).get_ref<const std::string&>());
}

namespace {
constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int sextet(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}
}  // namespace

std::string base64_encode(const std::vector<uint8_t>& bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  for (size_t i = 0; i < bytes.size(); i += 3) {
    const size_t n = std::min<size_t>(3, bytes.size() - i);
    uint32_t group = uint32_t{bytes[i]} << 16;
    if (n > 1) group |= uint32_t{bytes[i + 1]} << 8;
    if (n > 2) group |= bytes[i + 2];
    out.push_back(kAlphabet[(group >> 18) & 63]);
    out.push_back(kAlphabet[(group >> 12) & 63]);
    out.push_back(n > 1 ? kAlphabet[(group >> 6) & 63] : '=');
    out.push_back(n > 2 ? kAlphabet[group & 63] : '=');
  }
  return out;
}

std::vector<uint8_t> base64_decode(std::string_view text) {
  if (text.size() % 4 != 0)
    fail(Errc::format, "base64 text of ", text.size(), " characters is not a multiple of 4");
  std::vector<uint8_t> out;
  out.reserve(text.size() / 4 * 3);
  for (size_t i = 0; i < text.size(); i += 4) {
    const bool last = i + 4 == text.size();
    const int pad = last ? (text[i + 3] == '=') + (text[i + 2] == '=' && text[i + 3] == '=') : 0;
    uint32_t group = 0;
    for (int j = 0; j < 4; ++j) {
      const int s = j >= 4 - pad ? 0 : sextet(text[i + j]);
      if (s < 0) fail(Errc::format, "invalid base64 character at offset ", i + j);
      group = (group << 6) | static_cast<uint32_t>(s);
    }
    out.push_back(static_cast<uint8_t>(group >> 16));
    if (pad < 2) out.push_back(static_cast<uint8_t>(group >> 8));
    if (pad < 1) out.push_back(static_cast<uint8_t>(group));
  }
  return out;
}

Json member_to_json(const Member& m) {
  return Json{{"id", m.id},
              {"role", role_name(m.role)},
              {"rank", m.rank},
              {"world", m.world},
              {"replica", m.replica},
              {"layout_hash", m.layout_hash},
              {"address", base64_encode(m.transport_address)},
              {"parity", m.parity}};
}

Member member_from_json(const Json& j) {
  static const std::vector<Field> fields = {{"id", Type::u64},       {"role", Type::str},
                                            {"rank", Type::count},   {"world", Type::count},
                                            {"replica", Type::i64},  {"layout_hash", Type::str},
                                            {"address", Type::bytes}};
  if (!j.is_object()) fail(Errc::protocol, "member must be an object");
  for (const Field& f : fields) {
    const auto it = j.find(f.name);
    if (it == j.end() || !has_type(*it, f.type))
      fail(Errc::protocol, "member: field \"", f.name, "\" must be ", type_name(f.type));
  }
  Member m;
  m.id = get_u64(j, "id");
  try {
    m.role = parse_role(j.at("role").get<std::string>());
  } catch (const Error& e) {
    fail(Errc::protocol, "member: ", e.what());
  }
  m.rank = j.at("rank").get<int>();
  m.world = j.at("world").get<int>();
  const auto replica = j.at("replica").get<int64_t>();
  m.replica = replica < -1 || replica > std::numeric_limits<int>::max() ? -1 : int(replica);
  m.layout_hash = j.at("layout_hash").get<std::string>();
  m.transport_address = get_bytes(j, "address");
  // Absent from coordinators older than the field.
  if (const auto it = j.find("parity"); it != j.end()) {
    if (!it->is_string()) fail(Errc::protocol, "member: field \"parity\" must be a string");
    m.parity = it->get<std::string>();
  }
  return m;
}

Errc errc_from_name(std::string_view name) noexcept {
  for (int i = 0; i <= static_cast<int>(Errc::internal); ++i)
    if (errc_name(static_cast<Errc>(i)) == name) return static_cast<Errc>(i);
  return Errc::protocol;
}

}  // namespace weightsync::control::wire
