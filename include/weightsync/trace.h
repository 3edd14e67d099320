// Chrome-trace (Perfetto-viewable) recording of the phases of a sync.
//
// Each process records its own events into a Tracer and writes them to its
// own file; the parent merges the files into one trace with merge_traces().
// Events are "complete" events (ph "X"): pid = the process, tid = a phase
// lane ("pack", "wire", "apply", ...), times in microseconds of a clock shared
// by every process of the machine (CLOCK_MONOTONIC), so that lanes of
// different processes line up.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace weightsync {

// Microseconds on the machine-wide monotonic clock.
int64_t trace_now_us() noexcept;

class Tracer {
 public:
  // `process` names the pid lane group, e.g. "trainer 0"; `pid` orders them.
  Tracer(std::string process, int pid);

  // Records [start_us, end_us) of `name` on `lane`. Thread-safe.
  void complete(std::string_view name, std::string_view lane, int64_t start_us, int64_t end_us);
  // The same with the event's "args" (an object).
  void complete(std::string_view name, std::string_view lane, int64_t start_us, int64_t end_us,
                const nlohmann::json& args);
  std::size_t size() const;
  // {"traceEvents": [...], "displayTimeUnit": "ms"}, with process and lane names.
  nlohmann::json to_json() const;
  // Writes to_json() to `path` (Errc::io naming the path on failure).
  void write(const std::string& path) const;

 private:
  int lane_id(std::string_view lane);  // caller holds mutex_

  std::string process_;
  int pid_;
  mutable std::mutex mutex_;
  std::map<std::string, int, std::less<>> lanes_;
  std::shared_ptr<nlohmann::json> events_;  // an array; shared_ptr: json stays incomplete here
};

// Records the enclosing scope as one event when a tracer is given (null: off).
class TraceSpan {
 public:
  TraceSpan(Tracer* tracer, std::string_view name, std::string_view lane);
  ~TraceSpan();
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

 private:
  Tracer* tracer_;
  std::string name_, lane_;
  int64_t start_us_;
};

// Concatenates the traceEvents of every file into `out_path`. Files that are
// missing (a process that died before writing) are skipped and returned.
std::vector<std::string> merge_traces(const std::vector<std::string>& files,
                                      const std::string& out_path);

}  // namespace weightsync
