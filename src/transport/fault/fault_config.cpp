#include "fault_config.h"

#include <weightsync/error.h>

#include "freeze_points.h"

#include <atomic>
#include <charconv>

namespace weightsync::transport::fault {
namespace {

std::atomic<bool> freeze_armed{false};

uint64_t parse_uint(const std::string& key, const std::string& value) {
  uint64_t out = 0;
  const int base = value.rfind("0x", 0) == 0 ? 16 : 10;
  const char* begin = value.data() + (base == 16 ? 2 : 0);
  auto [p, ec] = std::from_chars(begin, value.data() + value.size(), out, base);
  if (value.empty() || ec != std::errc() || p != value.data() + value.size())
    fail(Errc::invalid_argument, "fault transport: ", key, "=", value,
         " is not a non-negative integer");
  return out;
}

double parse_probability(const std::string& key, const std::string& value) {
  double p = -1;
  try {
    size_t used = 0;
    p = std::stod(value, &used);
    if (used != value.size()) p = -1;
  } catch (const std::exception&) {
  }
  if (!(p >= 0 && p <= 1))
    fail(Errc::invalid_argument, "fault transport: ", key, "=", value,
         " is not a probability in [0, 1]");
  return p;
}

std::set<uint64_t> parse_list(const std::string& key, const std::string& value) {
  std::set<uint64_t> out;
  size_t start = 0;
  while (start < value.size()) {
    size_t end = value.find(',', start);
    if (end == std::string::npos) end = value.size();
    out.insert(parse_uint(key, value.substr(start, end - start)));
    start = end + 1;
  }
  return out;
}

std::set<int> parse_ranks(const std::string& key, const std::string& value) {
  std::set<int> ranks;
  for (uint64_t r : parse_list(key, value)) ranks.insert(static_cast<int>(r));
  return ranks;
}

}  // namespace

void arm_freeze_points() {
  freeze_armed.store(true);
}
bool freeze_points_armed() {
  return freeze_armed.load();
}

namespace {

const std::set<std::string>& fault_keys() {
  static const std::set<std::string> keys{
      "seed",     "drop_send",   "corrupt_send", "truncate_send", "corrupt_recv",
      "delay_ms", "fail_after",  "dead",         "after",         "tag",
      "count",    "freeze_send", "freeze_recv",  "release_ms"};
  return keys;
}

}  // namespace

bool FaultConfig::is_fault_key(const std::string& key) {
  return fault_keys().count(key) > 0;
}

std::string FaultConfig::keys() {
  std::string out;
  for (const auto& key : fault_keys()) out += (out.empty() ? "" : ", ") + key;
  return out;
}

FaultConfig FaultConfig::parse(const std::map<std::string, std::string>& params) {
  FaultConfig c;
  for (const auto& [key, value] : params) {
    if (key == "seed") c.seed = parse_uint(key, value);
    if (key == "drop_send") c.drop_send = parse_probability(key, value);
    if (key == "corrupt_send") c.corrupt_send = parse_probability(key, value);
    if (key == "truncate_send") c.truncate_send = parse_probability(key, value);
    if (key == "corrupt_recv") c.corrupt_recv = parse_probability(key, value);
    if (key == "delay_ms") c.delay_ms = static_cast<int64_t>(parse_uint(key, value));
    if (key == "fail_after") c.fail_after = parse_uint(key, value);
    if (key == "dead") c.dead = parse_ranks(key, value);
    if (key == "after") c.after = parse_uint(key, value);
    if (key == "tag") c.tags = parse_list(key, value);
    if (key == "count") c.count = parse_uint(key, value);
    if (key == "release_ms") c.release_ms = static_cast<int64_t>(parse_uint(key, value));
    if (key == "freeze_send" || key == "freeze_recv") {
      const uint64_t n = parse_uint(key, value);
      if (n == 0)
        fail(Errc::invalid_argument, "fault transport: ", key, "=0: operations count from 1");
      if (!freeze_points_armed())
        fail(Errc::invalid_argument, "fault transport: ", key, "=", value,
             " stops the process (SIGSTOP), a test hook that is off unless a test or a failure ",
             "drill of the command armed it");
      (key == "freeze_send" ? c.freeze_send : c.freeze_recv) = n;
    }
  }
  return c;
}

bool FaultPlan::chosen(double probability, uint64_t index, Tag tag) {
  if (probability <= 0) return false;
  if (index < config_.after) return false;
  if (!config_.tags.empty() && !config_.tags.count(tag)) return false;
  if (config_.count && injected_ >= *config_.count) return false;
  // Always draw, so that which operations are hit depends only on the seed
  // and the order of calls.
  const double draw = std::uniform_real_distribution<double>(0, 1)(random_);
  if (probability < 1 && draw >= probability) return false;
  ++injected_;
  return true;
}

FaultPlan::Fault FaultPlan::next_send(Tag tag) {
  const uint64_t index = sends_++;
  if (chosen(config_.drop_send, index, tag)) return Fault::drop;
  if (chosen(config_.corrupt_send, index, tag)) return Fault::corrupt;
  if (chosen(config_.truncate_send, index, tag)) return Fault::truncate;
  return Fault::none;
}

FaultPlan::Fault FaultPlan::next_recv(Tag tag) {
  const uint64_t index = recvs_++;
  return chosen(config_.corrupt_recv, index, tag) ? Fault::corrupt : Fault::none;
}

bool FaultPlan::next_fails() {
  const uint64_t index = ops_++;
  return config_.fail_after && index >= *config_.fail_after;
}

}  // namespace weightsync::transport::fault
