// The settings of the fault-injecting wrapper ("fault:<inner>"), parsed from
// TransportOptions::params; see the list in transport.h.
#pragma once

#include <weightsync/backend/transport.h>

#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>

namespace weightsync::transport::fault {

struct FaultConfig {
  uint64_t seed = 1;
  double drop_send = 0;
  double corrupt_send = 0;
  double truncate_send = 0;  // the message goes out one byte short
  double corrupt_recv = 0;
  int64_t delay_ms = 0;
  std::optional<uint64_t> fail_after;
  std::set<int> dead;
  uint64_t after = 0;
  std::set<Tag> tags;  // tag=T1,T2,...: only operations with one of these tags (empty: any)
  std::optional<uint64_t> count;
  // 1-based: the N-th send (receive) posted. Test hooks, refused unless
  // armed (freeze_points.h).
  std::optional<uint64_t> freeze_send;
  std::optional<uint64_t> freeze_recv;
  // A send completes only once its receiver released it, release_ms after
  // its receive completed, from the receiver's progress (as UCX's rendezvous
  // needs the receiver's worker progressed to release the sender).
  std::optional<int64_t> release_ms;

  // Reads the fault keys of `params`; the others are left for the inner
  // transport. Errc::invalid_argument names a malformed value.
  static FaultConfig parse(const std::map<std::string, std::string>& params);
  // The keys parse() understands.
  static bool is_fault_key(const std::string& key);
  // Every fault key, sorted and joined with ", " (for messages).
  static std::string keys();
};

// Decides, deterministically from the seed and the order of calls, which
// operations get which fault.
class FaultPlan {
 public:
  explicit FaultPlan(const FaultConfig& config) : config_(config), random_(config.seed) {}

  enum class Fault { none, drop, corrupt, truncate };
  // The fault for the next send (or receive) with `tag`.
  Fault next_send(Tag tag);
  Fault next_recv(Tag tag);
  // Counts one operation; true once more than fail_after operations were posted.
  bool next_fails();
  // Counts one posted send (receive); true for the one that freezes the rank.
  bool freezes_send() { return config_.freeze_send && ++posted_sends_ == *config_.freeze_send; }
  bool freezes_recv() { return config_.freeze_recv && ++posted_recvs_ == *config_.freeze_recv; }
  bool dead(int peer) const { return config_.dead.count(peer) > 0; }
  // A position in [0, bytes) to corrupt.
  std::size_t position(std::size_t bytes) { return bytes ? random_() % bytes : 0; }
  std::chrono::milliseconds delay() const { return std::chrono::milliseconds(config_.delay_ms); }

 private:
  bool chosen(double probability, uint64_t index, Tag tag);

  FaultConfig config_;
  std::mt19937_64 random_;
  uint64_t sends_ = 0;
  uint64_t recvs_ = 0;
  uint64_t ops_ = 0;
  uint64_t injected_ = 0;
  uint64_t posted_sends_ = 0;
  uint64_t posted_recvs_ = 0;
};

}  // namespace weightsync::transport::fault
