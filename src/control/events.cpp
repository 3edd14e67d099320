// Decoding of the coordinator's events and member lists. Pure (nlohmann and
// the error model only), so the fuzz target can build it.
#include "protocol.h"

#include <nlohmann/json.hpp>

#include <limits>

namespace weightsync::control::wire {

std::vector<Member> members_from_json(const Json& list) {
  if (!list.is_array()) fail(Errc::protocol, "members must be an array");
  std::vector<Member> out;
  for (const Json& m : list) out.push_back(wire::member_from_json(m));
  return out;
}

std::optional<std::vector<int>> replicas_from_json(const Json& body) {
  const auto it = body.find("replicas");
  if (it == body.end()) return std::nullopt;
  if (!it->is_array()) fail(Errc::protocol, "replicas must be an array");
  std::vector<int> out;
  for (const Json& r : *it) {
    if (!r.is_number_integer() || r.get<int64_t>() < 0 ||
        r.get<int64_t>() > std::numeric_limits<int>::max() ||
        (!out.empty() && r.get<int64_t>() <= out.back()))
      fail(Errc::protocol, "replicas must be ascending distinct integers in [0, 2^31), got ",
           it->dump());
    out.push_back(r.get<int>());
  }
  return out;
}

namespace {

StepResult step_result_from(const Json& b) {
  StepResult r;
  r.step = b.at("step").get<int64_t>();
  r.trainers_ok = b.at("trainers_ok").get<bool>();
  if (const auto it = b.find("reason"); it != b.end() && it->is_string()) r.reason = *it;
  for (const Json& rank : b.at("committed")) {
    if (!rank.is_number_integer())
      fail(Errc::protocol, "step_result: committed ranks must be integers");
    r.committed.push_back(rank.get<int>());
  }
  for (const Json& f : b.at("failed")) {
    if (!f.is_object() || !f.contains("rank") || !f["rank"].is_number_integer() ||
        !f.contains("reason") || !f["reason"].is_string())
      fail(Errc::protocol, "step_result: failed entries must be {rank, reason}");
    r.failed.push_back(EngineFailure{f["rank"].get<int>(), f["reason"].get<std::string>()});
  }
  return r;
}

}  // namespace

Event event_from_message(const wire::Message& m) {
  const Json& b = m.body;
  switch (m.kind) {
    case Kind::step_begin:
      return StepBegin{b.at("step").get<int64_t>(), b.at("plan_id").get<std::string>(),
                       replicas_from_json(b)};
    case Kind::commit:
      return Commit{b.at("step").get<int64_t>()};
    case Kind::abort:
      return Abort{b.at("step").get<int64_t>(), b.at("reason").get<std::string>(),
                   b.contains("engine_rank") ? b.at("engine_rank").get<int>() : -1};
    case Kind::member_left:
      return MemberLeft{wire::member_from_json(b.at("member")), b.at("reason").get<std::string>()};
    case Kind::step_result:
      return step_result_from(b);
    default:
      fail(Errc::protocol, "message kind '", wire::kind_name(m.kind), "' is not an event");
  }
}

}  // namespace weightsync::control::wire
