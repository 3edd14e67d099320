// The one polling loop of both data paths (trainer_adapter's SendPipeline,
// engine_adapter's ReceivePipeline): waiting for posted requests and for GPU
// events, polling the control plane about every millisecond (which throws to
// abandon a step), bounded by the step's deadline.
//
// Part of weightsync_pipeline (src/pipeline/CMakeLists.txt), which both
// adapters link.
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/error.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace weightsync::pipeline {

// Seconds of the steady clock since `t`: what every phase time of a step is.
inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

using Clock = std::chrono::steady_clock;

// What is left until `deadline`, in whole milliseconds, never negative.
inline std::chrono::milliseconds left_until(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(0),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

class Loop {
 public:
  // `who` opens timeout messages ("trainer rank 3"); `poll` may be empty.
  Loop(std::string who, Transport& transport, std::function<void()> poll,
       Clock::time_point deadline);

  // Returns once ready() is true. Meanwhile polls (about every ms) and pauses
  // between looks (poll_pause); with `progress`, also drives the transport
  // (for conditions that are no request: a GPU event). Errc::timeout at the
  // deadline: "<who>: <what()> did not complete before the step timeout
  // (waited <s> s for it)".
  void until(const std::function<bool()>& ready, const std::function<std::string()>& what,
             bool progress = false);

  // Waits until `request` settles: its failure, if it failed (the loop's
  // own, from the poll or the deadline, is thrown).
  std::optional<Error> settle(Request& request, const std::function<std::string()>& what);

  Transport& transport() const noexcept { return transport_; }
  const std::string& who() const noexcept { return who_; }

 private:
  std::string who_;
  Transport& transport_;
  std::function<void()> poll_;
  Clock::time_point deadline_;
};

// What drain() does with each request, by its owner (an engine rank, or -1
// for a trainer peer).
struct DrainHooks {
  // True: the owner was dropped; its request is cancelled, not waited for.
  std::function<bool(int owner)> dropped;
  // A request failed; rethrow to abandon the step, return to go on (the
  // caller drops the owner). Empty: rethrow.
  std::function<void(int owner, const Error& error)> failed;
  // A request completed (e.g. to check the bytes that arrived).
  std::function<void(const Request& request)> done;
};

// The requests of one staging slot, drained in posting order (they mostly
// complete in that order).
class Posted {
 public:
  void add(std::unique_ptr<Request> request, int owner = -1);
  bool empty() const noexcept { return requests_.empty(); }
  std::size_t size() const noexcept { return requests_.size(); }
  void reserve(std::size_t n);

  // Waits for every request through `loop`, then forgets them.
  void drain(Loop& loop, const DrainHooks& hooks);
  // Cancels every request still posted and forgets them (after a failure).
  void cancel_all();

 private:
  std::vector<std::unique_ptr<Request>> requests_;
  std::vector<int> owners_;
};

}  // namespace weightsync::pipeline
