// Wire options: the settings of the data path's wire format that both sides
// of a sync must share (src/pipeline/wire.h has the format itself).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>

namespace weightsync {

// Settings both sides must share; trainer rank 0 publishes them with the plan
// options and the subscribers follow.
struct WireOptions {
  // Verify every bucket end to end. Costs one read of every byte on each side;
  // the transports below (TCP, shared memory, RDMA) guard their own links.
  bool checksums = false;
  int64_t direct_min_bytes = int64_t{64} << 10;  // smaller items travel packed

  nlohmann::json to_json() const;
  // Errc::invalid_argument naming the field for a malformed object.
  static WireOptions from_json(const nlohmann::json& j);
};

}  // namespace weightsync
