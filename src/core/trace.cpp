#include <weightsync/error.h>
#include <weightsync/trace.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include <time.h>

namespace weightsync {

int64_t trace_now_us() noexcept {
  // CLOCK_MONOTONIC is one clock for the whole machine, unlike a process's
  // steady_clock epoch guarantees, so events of separate processes align.
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

Tracer::Tracer(std::string process, int pid)
    : process_(std::move(process)),
      pid_(pid),
      events_(std::make_shared<nlohmann::json>(nlohmann::json::array())) {}

int Tracer::lane_id(std::string_view lane) {
  auto it = lanes_.find(lane);
  if (it != lanes_.end()) return it->second;
  const int id = static_cast<int>(lanes_.size()) + 1;
  lanes_.emplace(std::string(lane), id);
  return id;
}

void Tracer::complete(std::string_view name, std::string_view lane, int64_t start_us,
                      int64_t end_us) {
  complete(name, lane, start_us, end_us, nlohmann::json::object());
}

void Tracer::complete(std::string_view name, std::string_view lane, int64_t start_us,
                      int64_t end_us, const nlohmann::json& args) {
  std::lock_guard lock(mutex_);
  nlohmann::json e = {{"name", name},   {"ph", "X"},
                      {"pid", pid_},    {"tid", lane_id(lane)},
                      {"ts", start_us}, {"dur", std::max<int64_t>(0, end_us - start_us)},
                      {"args", args}};
  events_->push_back(std::move(e));
}

std::size_t Tracer::size() const {
  std::lock_guard lock(mutex_);
  return events_->size();
}

nlohmann::json Tracer::to_json() const {
  std::lock_guard lock(mutex_);
  nlohmann::json events = nlohmann::json::array();
  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", pid_}, {"args", {{"name", process_}}}});
  events.push_back({{"name", "process_sort_index"},
                    {"ph", "M"},
                    {"pid", pid_},
                    {"args", {{"sort_index", pid_}}}});
  for (const auto& [lane, id] : lanes_)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", pid_},
                      {"tid", id},
                      {"args", {{"name", lane}}}});
  for (const auto& e : *events_) events.push_back(e);
  return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
}

void Tracer::write(const std::string& path) const {
  const std::string text = to_json().dump();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) fail(Errc::io, "trace: cannot write ", path);
}

TraceSpan::TraceSpan(Tracer* tracer, std::string_view name, std::string_view lane)
    : tracer_(tracer), start_us_(tracer ? trace_now_us() : 0) {
  if (tracer_) {
    name_ = name;
    lane_ = lane;
  }
}

TraceSpan::~TraceSpan() {
  if (tracer_) tracer_->complete(name_, lane_, start_us_, trace_now_us());
}

std::vector<std::string> merge_traces(const std::vector<std::string>& files,
                                      const std::string& out_path) {
  nlohmann::json events = nlohmann::json::array();
  std::vector<std::string> missing;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    if (!in) {
      missing.push_back(f);
      continue;
    }
    nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("traceEvents") ||
        !j["traceEvents"].is_array())
      fail(Errc::format, "trace: ", f,
           " is not a Chrome trace (expected {\"traceEvents\": [...]})");
    for (auto& e : j["traceEvents"]) events.push_back(std::move(e));
  }
  nlohmann::json merged = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  std::ofstream out(out_path, std::ios::binary | std::ios::trunc);
  out << merged.dump();
  out.close();
  if (!out) fail(Errc::io, "trace: cannot write ", out_path);
  return missing;
}

}  // namespace weightsync
