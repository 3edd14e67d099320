#include "demo_job.h"

#include <nlohmann/json.hpp>

#include <weightsync/error.h>

#include "transport/fault/freeze_points.h"

#include <cstring>
#include <fstream>

namespace weightsync::demo {

namespace {

// {replica: step} as [[replica, step], ...] (JSON keys are strings).
nlohmann::json join_pairs(const std::map<int, int>& m) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& [replica, step] : m) out.push_back({replica, step});
  return out;
}

std::map<int, int> pairs_map(const nlohmann::json& j) {
  std::map<int, int> out;
  for (const auto& p : j) out[p.at(0).get<int>()] = p.at(1).get<int>();
  return out;
}

}  // namespace

nlohmann::json JobSpec::to_json() const {
  return {
      {"checkpoint", checkpoint},
      {"trainer", trainer},
      {"engine", engine},
      {"steps", steps},
      {"mode", mode},
      {"transport", transport},
      {"engine_transport", engine_transport},
      {"trainer_transport", trainer_transport},
      {"bucket_bytes", bucket_bytes},
      {"fp8_site", fp8_site},
      {"timeout_ms", timeout_ms},
      {"staging", staging},
      {"checksums", checksums},
      {"checksums_gpu", checksums_gpu},
      {"lend", lend},
      {"delta", delta},
      {"delta_verify", delta_verify},
      {"update_fraction", update_fraction},
      {"verify", verify},
      {"dump_dir", dump_dir},
      {"work_dir", work_dir},
      {"trace", trace},
      {"coordinator", coordinator},
      {"token", token},
      {"kill", {{"role", kill.role}, {"rank", kill.rank}, {"op", kill.op}, {"after", kill.after}}},
      {"raw_rounds", raw_rounds},
      {"restart_killed", restart_killed},
      {"step_gap_ms", step_gap_ms},
      {"coordinator_reconnect_ms", coordinator_reconnect_ms},
      {"device", device},
      {"elastic", elastic},
      {"min_replicas", min_replicas},
      {"join", join_pairs(join)},
      {"leave", join_pairs(leave)},
      {"chaos_dir", chaos_dir}};
}

JobSpec JobSpec::from_json(const nlohmann::json& j) {
  try {
    JobSpec s;
    s.checkpoint = j.at("checkpoint").get<std::string>();
    s.trainer = j.at("trainer").get<std::string>();
    s.engine = j.at("engine").get<std::string>();
    s.steps = j.at("steps").get<int>();
    s.mode = j.at("mode").get<std::string>();
    s.transport = j.at("transport").get<std::string>();
    s.engine_transport = j.at("engine_transport").get<std::vector<std::string>>();
    s.trainer_transport =
        j.value("trainer_transport", nlohmann::json::array()).get<std::vector<std::string>>();
    s.bucket_bytes = j.at("bucket_bytes").get<int64_t>();
    s.fp8_site = j.value("fp8_site", std::string("sender"));
    s.timeout_ms = j.at("timeout_ms").get<int64_t>();
    s.staging = j.at("staging").get<bool>();
    s.checksums = j.at("checksums").get<bool>();
    s.checksums_gpu = j.value("checksums_gpu", false);
    s.lend = j.value("lend", true);
    s.delta = j.value("delta", false);
    s.delta_verify = j.value("delta_verify", true);
    s.update_fraction = j.value("update_fraction", -1.0);
    s.verify = j.at("verify").get<bool>();
    s.dump_dir = j.at("dump_dir").get<std::string>();
    s.work_dir = j.at("work_dir").get<std::string>();
    s.trace = j.at("trace").get<bool>();
    s.coordinator = j.at("coordinator").get<std::string>();
    s.token = j.at("token").get<std::string>();
    const auto& k = j.at("kill");
    s.kill = {k.at("role").get<std::string>(), k.at("rank").get<int>(),
              k.at("op").get<std::string>(), k.at("after").get<int64_t>()};
    s.raw_rounds = j.at("raw_rounds").get<int>();
    s.restart_killed = j.value("restart_killed", false);
    s.step_gap_ms = j.value("step_gap_ms", int64_t{0});
    s.coordinator_reconnect_ms = j.value("coordinator_reconnect_ms", int64_t{0});
    s.device = j.value("device", std::string("cpu"));
    s.elastic = j.value("elastic", false);
    s.min_replicas = j.value("min_replicas", 1);
    if (j.contains("join")) s.join = pairs_map(j["join"]);
    if (j.contains("leave")) s.leave = pairs_map(j["leave"]);
    s.chaos_dir = j.value("chaos_dir", std::string());
    return s;
  } catch (const nlohmann::json::exception& e) {
    fail(Errc::format, "job file: ", e.what());
  }
}

JobSpec JobSpec::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(Errc::io, "cannot open job file ", path);
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded()) fail(Errc::format, "job file ", path, " is not JSON");
  return from_json(j);
}

void JobSpec::save(const std::string& path) const {
  std::ofstream out(path, std::ios::trunc);
  out << to_json().dump(2);
  if (!out) fail(Errc::io, "cannot write job file ", path);
}

std::string JobSpec::stats_path(const std::string& role, int rank) const {
  return cat(work_dir, "/stats-", role, rank, ".json");
}

std::string JobSpec::trace_path(const std::string& role, int rank) const {
  return cat(work_dir, "/trace-", role, rank, ".json");
}

uint8_t version_pattern(int64_t step, int64_t final_step) {
  if (step == final_step) return 0;
  // Odd, hence never zero: every byte of every tensor changes.
  return static_cast<uint8_t>(((step * 0x9D) ^ 0x5A) | 1);
}

void xor_bytes(void* data, std::size_t bytes, uint8_t pattern) {
  if (pattern == 0) return;
  auto* p = static_cast<unsigned char*>(data);
  uint64_t wide = 0x0101010101010101ULL * pattern;
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, 8);
    v ^= wide;
    std::memcpy(p + i, &v, 8);
  }
  for (; i < bytes; ++i) p[i] ^= pattern;
}

void flip_picked(void* data, std::size_t bytes, std::size_t item, const void* mask, double fraction,
                 int64_t first, int64_t last) {
  if (fraction <= 0 || first > last || item == 0 || item > 8) return;
  auto* p = static_cast<unsigned char*>(data);
  const auto* m = static_cast<const unsigned char*>(mask);
  // Picked when the hash's top 53 bits, as a fraction of 2^53, are below.
  const auto limit = fraction >= 1 ? ~uint64_t{0} : static_cast<uint64_t>(fraction * 0x1p53);
  for (std::size_t at = 0; at + item <= bytes; at += item) {
    if (m && m[at] == 0) continue;
    uint64_t v = 0;
    std::memcpy(&v, p + at, item);
    v &= ~uint64_t{1};
    unsigned flips = 0;
    for (int64_t j = first; j <= last; ++j) {
      uint64_t h = v * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(j) * 0xBF58476D1CE4E5B9ULL;
      h ^= h >> 31;
      h *= 0x94D049BB133111EBULL;
      h ^= h >> 29;
      flips += (h >> 11) < limit;
    }
    p[at] = static_cast<unsigned char>(p[at] ^ (flips & 1));
  }
}

double parse_update_fraction(const std::string& text, const std::string& option) {
  const std::string prefix = "random:";
  double f = -1;
  if (text.rfind(prefix, 0) == 0) {
    try {
      size_t used = 0;
      f = std::stod(text.substr(prefix.size()), &used);
      if (used != text.size() - prefix.size()) f = -1;
    } catch (const std::exception&) {
      f = -1;
    }
  }
  if (!(f > 0 && f <= 1))
    fail(Errc::invalid_argument, option, " expects random:F with 0 < F <= 1, got '", text, "'");
  return f;
}

double peak_rss_mb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  }
  return 0;
}

std::string with_freeze(const std::string& transport, const std::string& op, int64_t after) {
  weightsync::transport::fault::arm_freeze_points();
  const char sep = transport.find('?') == std::string::npos ? '?' : '&';
  const std::string freeze = cat(sep, "freeze_", op, "=", after);
  // One fault wrapper takes every fault key: an inner one would get none.
  if (transport.rfind("fault:", 0) == 0) return transport + freeze;
  return cat("fault:", transport, freeze);
}

}  // namespace weightsync::demo
