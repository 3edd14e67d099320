// Store: a key/value rendezvous with a timeout on every wait (c10d-style).
// Transports bootstrap through it (UCX worker addresses, the NCCL unique id);
// the control plane's client implements it against the coordinator, and tests
// may use any implementation.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace weightsync {

class Store {
 public:
  virtual ~Store() = default;
  // Sets `key` (overwrites).
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Waits until `key` is set and returns its value; Errc::timeout after `timeout`,
  // naming the key.
  virtual std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

// A Store over a directory shared by the processes of one machine (each key a
// file, written atomically by rename). Useful for tests and single-host tools.
std::unique_ptr<Store> make_file_store(const std::string& directory);

}  // namespace weightsync
