// Wire options: the settings of the data path's wire format that both sides
// of a sync must share (src/pipeline/wire.h has the format itself).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string_view>

namespace weightsync {

// Delta sync (docs/delta.md): off, or "auto": each p2p bucket goes as the
// elements that changed since the version its engine rank holds, where
// that rank holds the version the sender last sent it, else whole.
enum class DeltaMode : uint8_t { off, automatic };
std::string_view delta_mode_name(DeltaMode mode) noexcept;  // "off", "auto"
DeltaMode parse_delta_mode(std::string_view name);          // Errc::invalid_argument

// Settings both sides must share; trainer rank 0 publishes them with the plan
// options and the subscribers follow.
struct WireOptions {
  // Verify every bucket end to end (on by default): a bucket that does not
  // arrive as sent fails the step for its engine rank, naming the bucket,
  // the trainer rank and both checksums. The checksum (core/wire_sum.h) is
  // summed inside the copies that pack and apply the bucket on the host;
  // bytes that move zero-copy (straight from a tensor, straight into a
  // param) are read once more. Buckets whose bytes are in device memory on
  // either side (device slots, zero-copy CUDA routes, lent params) travel
  // unchecked unless `checksums_gpu`.
  bool checksums = true;
  // With checksums: verify the buckets of CUDA tensors too. Their bytes
  // then pass through pinned host memory (no device slots, no zero-copy
  // CUDA routes, no lending), which costs the GPU path most of its speed.
  bool checksums_gpu = false;
  // Whether checksums reach into device memory's paths (both fields on).
  bool checksums_on_device() const noexcept { return checksums && checksums_gpu; }
  int64_t direct_min_bytes = int64_t{64} << 10;  // smaller items travel packed
  // Buckets travel as frames that carry either their bytes or a delta
  // (pipeline/delta_frame.h). Set by the Publisher from
  // PublisherOptions::delta; the subscribers follow.
  bool delta = false;
  // Where the transport maps a peer's memory (cuda_ipc), the engine ranks
  // lend their params to the trainer ranks every step, and a p2p bucket
  // without checksums_on_device(), delta or sender-quantized items is written by its
  // trainer straight into them: one copy program (one kernel) per bucket
  // and a zero-byte message saying it is done. Off: buckets travel as
  // fragments (pipeline/wire.h) over every transport.
  bool lend = true;

  nlohmann::json to_json() const;
  // Errc::invalid_argument naming the field for a malformed object.
  static WireOptions from_json(const nlohmann::json& j);
};

}  // namespace weightsync
