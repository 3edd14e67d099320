// A one-line progress report for long work on a terminal: what is done of a
// total, the rate and the time left, redrawn in place on stderr at most five
// times a second. Silent where stderr is no terminal and with --json, so that
// logs and machine-read output stay clean.
#pragma once

#include <chrono>
#include <string>

namespace weightsync::cli {

class ProgressLine {
 public:
  // `unit` names what is counted ("MB", "steps"); a done or total value is
  // divided by `scale` for display. `enabled` false (e.g. --json): silent.
  ProgressLine(std::string label, double total, std::string unit, double scale, bool enabled);
  ~ProgressLine();  // ends the line (once something was drawn)
  ProgressLine(const ProgressLine&) = delete;
  ProgressLine& operator=(const ProgressLine&) = delete;

  bool active() const { return active_; }
  void update(double done);
  // The text of one report (for tests): "export: 12.0 / 48.0 MB, 6.0 MB/s, 6 s left".
  static std::string format(const std::string& label, double done, double total,
                            const std::string& unit, double scale, double seconds);

 private:
  std::string label_, unit_;
  double total_, scale_;
  bool active_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_;
};

// Bytes written so far into the safetensors files of `dir` (the blocks they
// hold on disk, each file at most its size): a save's progress as the disk
// sees it, whichever processes write.
double safetensors_bytes_on_disk(const std::string& dir);

}  // namespace weightsync::cli
