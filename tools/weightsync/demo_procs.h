// Child processes for demo, bench and the e2e tests: the `weightsync` binary
// re-executes itself (/proc/self/exe) once per role and rank, so every rank is
// a real, separate process. Each child's stdout and stderr go to its own log
// file; the group reaps every child it started (no zombie), kills the rest
// when one fails, and bounds every wait.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <sys/types.h>

#include "transport/staging.h"

namespace weightsync::demo {

// The path of the running executable, for re-executing it.
std::string self_exe();

struct ChildResult {
  std::string label;  // "trainer 0", "engine 3", ...
  pid_t pid = -1;
  bool exited = false;  // false: killed by a signal (or never reaped)
  int exit_code = -1;
  int signal = 0;
  bool may_fail = false;           // a child whose failure is part of the scenario
  bool kill_when_stopped = false;  // a drill's victim: SIGKILL it once it stops (freezes)
  std::string log_path;

  bool ok() const { return exited && exit_code == 0; }
  std::string status() const;  // "exit 0", "exit 1", "killed by signal 9 (Killed)"
};

class ProcessGroup {
 public:
  // Logs go to `log_dir`/<label with spaces as dashes>.log.
  explicit ProcessGroup(std::string log_dir);
  ~ProcessGroup();  // kills (SIGKILL) and reaps whatever still runs
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // Starts `self_exe() args...`. `may_fail`: its failure does not fail the
  // group (e.g. an engine the scenario kills on purpose). `kill_when_stopped`:
  // the group SIGKILLs the child as soon as it stops (a failure drill's
  // victim, frozen at its chosen operation by the fault transport).
  // Returns the child's pid.
  pid_t spawn(const std::string& label, const std::vector<std::string>& args, bool may_fail = false,
              bool kill_when_stopped = false);
  // Without waiting: whether child `pid` still runs (reaps what ended), and
  // its result (null for a pid this group did not start).
  bool running(pid_t pid);
  const ChildResult* result(pid_t pid) const;

  // Waits until every child has ended, or `timeout`. When a child that may not
  // fail ends badly, the others get `grace` to end on their own (they usually
  // fail fast with a peer_failure of their own), then are killed. Children
  // still running at the deadline are killed and reported as timed out.
  // Returns every child's result, in spawn order.
  // `on_exit`, when set, is called once for each child that ended (it may
  // spawn more children, which are then waited for too).
  std::vector<ChildResult> wait_all(
      std::chrono::milliseconds timeout, std::chrono::milliseconds grace = std::chrono::seconds(10),
      const std::function<void(const ChildResult&)>& on_exit = nullptr,
      const std::function<void()>& on_tick = nullptr);  // every few ms (may spawn too)
  void kill_all();                                      // SIGKILL to every running child
  bool timed_out() const { return timed_out_; }

 private:
  void reap(bool block);

  std::string log_dir_;
  std::vector<ChildResult> children_;
  std::vector<bool> running_;
  bool timed_out_ = false;
};

// The last `max_bytes` of a file (a child's log), "" when unreadable.
std::string tail_of_file(const std::string& path, std::size_t max_bytes = 4000);

// The last line of a child's log that says what failed (a worker prints
// "...: error [code]: message" before it exits), else its last line.
std::string reason_in_log(const std::string& log);

}  // namespace weightsync::demo
