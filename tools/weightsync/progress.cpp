#include "progress.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

namespace weightsync::cli {

ProgressLine::ProgressLine(std::string label, double total, std::string unit, double scale,
                           bool enabled)
    : label_(std::move(label)),
      unit_(std::move(unit)),
      total_(total),
      scale_(scale > 0 ? scale : 1),
      active_(enabled && total > 0 && ::isatty(STDERR_FILENO)),
      start_(std::chrono::steady_clock::now()),
      last_(start_) {}

ProgressLine::~ProgressLine() {
  if (drawn_) std::fputs("\n", stderr);
}

std::string ProgressLine::format(const std::string& label, double done, double total,
                                 const std::string& unit, double scale, double seconds) {
  char buf[160];
  const double rate = seconds > 0 ? done / seconds : 0;
  int n = std::snprintf(buf, sizeof buf, "%s: %.1f / %.1f %s", label.c_str(), done / scale,
                        total / scale, unit.c_str());
  if (rate > 0 && n > 0 && n < static_cast<int>(sizeof buf)) {
    const double left = std::max(0.0, total - done) / rate;
    std::snprintf(buf + n, sizeof buf - static_cast<size_t>(n), ", %.1f %s/s, %.0f s left",
                  rate / scale, unit.c_str(), left);
  }
  return buf;
}

void ProgressLine::update(double done) {
  if (!active_) return;
  const auto now = std::chrono::steady_clock::now();
  if (drawn_ && now - last_ < std::chrono::milliseconds(200) && done < total_) return;
  last_ = now;
  drawn_ = true;
  const double seconds = std::chrono::duration<double>(now - start_).count();
  // \r and clear to the end of the line: the report replaces the last one.
  std::fprintf(stderr, "\r%s\033[K",
               format(label_, std::min(done, total_), total_, unit_, scale_, seconds).c_str());
  std::fflush(stderr);
}

double safetensors_bytes_on_disk(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  double bytes = 0;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string path = entry.path().string();
    if (entry.path().extension() != ".safetensors") continue;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) continue;
    bytes += std::min(static_cast<double>(st.st_blocks) * 512, static_cast<double>(st.st_size));
  }
  return bytes;
}

}  // namespace weightsync::cli
