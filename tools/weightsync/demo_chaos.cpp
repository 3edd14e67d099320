// The chaos soak's schedule and the files its parent and workers share.
#include "demo_chaos.h"

#include "pipeline/wire.h"

#include <weightsync/error.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <unistd.h>

namespace weightsync::demo::chaos {
namespace {

// The ranks of `buckets` that have any.
std::vector<int> ranks_with_buckets(const std::vector<std::vector<int32_t>>& buckets) {
  std::vector<int> out;
  for (size_t r = 0; r < buckets.size(); ++r)
    if (!buckets[r].empty()) out.push_back(static_cast<int>(r));
  return out;
}

}  // namespace

const char* fault_name(FaultKind kind) {
  switch (kind) {
    case FaultKind::none:
      return "none";
    case FaultKind::kill_trainer:
      return "kill_trainer";
    case FaultKind::kill_engine:
      return "kill_engine";
    case FaultKind::kill_coordinator:
      return "kill_coordinator";
    case FaultKind::corrupt:
      return "corrupt";
    case FaultKind::truncate:
      return "truncate";
    case FaultKind::delay:
      return "delay";
  }
  return "?";
}

std::string Fault::describe() const {
  switch (kind) {
    case FaultKind::none:
      return "none";
    case FaultKind::kill_trainer:
    case FaultKind::kill_engine:
      return cat("SIGKILL ", role, " rank ", rank, " ", at_ms,
                 " ms into the step (a new process takes it)");
    case FaultKind::kill_coordinator:
      return cat("SIGKILL the coordinator ", at_ms, " ms into the step (restarted on its address)");
    case FaultKind::corrupt:
      return cat("engine rank ", rank, " receives bucket ", bucket, " with a byte flipped");
    case FaultKind::truncate:
      return cat("trainer rank ", rank, " sends bucket ", bucket, " one byte short");
    case FaultKind::delay:
      return cat(role, " rank ", rank, " stalls ", stall_ms, " ms (SIGSTOP) ", at_ms,
                 " ms into the step");
  }
  return "?";
}

std::vector<Fault> make_schedule(uint64_t seed, int steps, const Targets& targets) {
  std::mt19937_64 rng(seed);
  const int trainers = static_cast<int>(targets.trainer_buckets.size());
  const int engines = static_cast<int>(targets.engine_buckets.size());
  const auto senders = ranks_with_buckets(targets.trainer_buckets);
  const auto receivers = ranks_with_buckets(targets.engine_buckets);
  std::vector<Fault> out;
  for (int s = 1; s <= steps; ++s) {
    // Every step draws the same values, whatever it uses, so that one
    // step's fault does not shift the next steps' draws.
    const uint64_t kind = rng() % 10, who = rng(), which = rng(), at = rng() % 60,
                   stall = 300 + rng() % 1200;
    Fault f;
    f.step = s;
    if (s == 1 || s == steps || kind < 4) {
      out.push_back(f);
      continue;
    }
    f.kind = static_cast<FaultKind>(kind - 3);
    f.at_ms = static_cast<int64_t>(at);
    switch (f.kind) {
      case FaultKind::kill_trainer:
        f.role = "trainer", f.rank = static_cast<int>(who % trainers);
        break;
      case FaultKind::kill_engine:
        f.role = "engine", f.rank = static_cast<int>(who % engines);
        break;
      case FaultKind::corrupt: {
        if (receivers.empty()) f.kind = FaultKind::none;
        if (receivers.empty()) break;
        f.role = "engine", f.rank = receivers[who % receivers.size()];
        const auto& b = targets.engine_buckets[static_cast<size_t>(f.rank)];
        f.bucket = b[which % b.size()];
        break;
      }
      case FaultKind::truncate: {
        if (senders.empty()) f.kind = FaultKind::none;
        if (senders.empty()) break;
        f.role = "trainer", f.rank = senders[who % senders.size()];
        const auto& b = targets.trainer_buckets[static_cast<size_t>(f.rank)];
        f.bucket = b[which % b.size()];
        break;
      }
      case FaultKind::delay:
        f.role = which % 2 ? "engine" : "trainer";
        f.rank = static_cast<int>(who % (f.role == "engine" ? engines : trainers));
        f.stall_ms = static_cast<int64_t>(stall);
        break;
      default:
        break;
    }
    if (f.kind == FaultKind::none) {
      f = Fault();
      f.step = s;
    }
    out.push_back(f);
  }
  return out;
}

nlohmann::json schedule_json(const std::vector<Fault>& schedule) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& f : schedule) {
    nlohmann::json j = {{"step", f.step}, {"fault", fault_name(f.kind)}};
    if (f.kind != FaultKind::none) j["what"] = f.describe();
    if (!f.role.empty()) j["role"] = f.role, j["rank"] = f.rank;
    out.push_back(j);
  }
  return out;
}

std::string fault_options(const std::vector<Fault>& schedule, const std::string& role, int rank) {
  const FaultKind kind = role == "engine" ? FaultKind::corrupt : FaultKind::truncate;
  std::string tags;
  for (const auto& f : schedule)
    if (f.kind == kind && f.rank == rank)
      tags += cat(tags.empty() ? "" : ",", bucket_tag(f.step, f.bucket, 0));
  if (tags.empty()) return "";
  return cat(role == "engine" ? "corrupt_recv=1" : "truncate_send=1", "&tag=", tags);
}

std::string go_path(const std::string& dir, int step) {
  return cat(dir, "/go-", step);
}
std::string stop_path(const std::string& dir) {
  return dir + "/stop";
}
std::string ready_path(const std::string& dir, const std::string& role, int rank, long pid) {
  return cat(dir, "/ready-", role, "-", rank, "-", pid);
}
std::string report_path(const std::string& dir, const std::string& role, int rank) {
  return cat(dir, "/", role, "-", rank, ".jsonl");
}

void touch(const std::string& path) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) fail(Errc::io, "cannot create ", path);
}

void append_line(const std::string& path, const nlohmann::json& line) {
  const std::string text = line.dump() + "\n";
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) fail(Errc::io, "cannot open ", path);
  const ssize_t n = ::write(fd, text.data(), text.size());
  ::close(fd);
  if (n != static_cast<ssize_t>(text.size())) fail(Errc::io, "cannot append to ", path);
}

std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded()) out.push_back(std::move(j));
  }
  return out;
}

int first_step(const std::string& dir) {
  int last = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("go-", 0) == 0) last = std::max(last, std::stoi(name.substr(3)));
  }
  return last + 1;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

bool wait_for_go(const std::string& dir, int step) {
  const std::string go = go_path(dir, step), stop = stop_path(dir);
  for (;;) {
    if (std::filesystem::exists(go)) return true;
    if (std::filesystem::exists(stop)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace weightsync::demo::chaos
