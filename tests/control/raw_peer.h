// A raw TCP peer for control-plane tests: speaks (or breaks) the wire
// protocol byte by byte, without the Client's help.
#pragma once

#include <weightsync/control.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace weightsync::control::testing {

using Json = nlohmann::json;

inline std::string frame_of(const std::string& payload) {
  const auto n = static_cast<uint32_t>(payload.size());
  std::string f{static_cast<char>(n >> 24), static_cast<char>(n >> 16), static_cast<char>(n >> 8),
                static_cast<char>(n)};
  return f + payload;
}

class RawPeer {
 public:
  explicit RawPeer(uint16_t port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (fd_ < 0) throw std::runtime_error("socket() failed");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
      throw std::runtime_error("connect() to the coordinator failed");
  }
  ~RawPeer() { close(); }
  RawPeer(const RawPeer&) = delete;
  RawPeer& operator=(const RawPeer&) = delete;

  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd() const { return fd_; }

  // Sends everything; false if the coordinator already closed the connection.
  bool send_bytes(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  bool send_json(const Json& j) { return send_bytes(frame_of(j.dump())); }

  bool hello(const std::string& role, int rank, int world, const std::string& token = "") {
    Json h{{"v", 1},       {"kind", "hello"}, {"id", 1},
           {"role", role}, {"rank", rank},    {"world", world}};
    if (!token.empty()) h["token"] = token;
    return send_json(h);
  }

  // The next frame within `timeout`; nullopt on timeout or once closed (see closed()).
  std::optional<Json> read_frame(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      if (auto f = take_frame()) return f;
      if (eof_) return std::nullopt;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buf[65536];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) {
        eof_ = true;
        continue;
      }
      in_.append(buf, static_cast<size_t>(n));
      received_ += static_cast<size_t>(n);
    }
  }

  // Reads (and keeps) frames until the coordinator closes the connection.
  // True if it closed within `timeout`.
  bool wait_closed(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!eof_ && std::chrono::steady_clock::now() < deadline) {
      if (auto f = read_frame(std::chrono::milliseconds(100))) frames_.push_back(*f);
    }
    while (auto f = take_frame()) frames_.push_back(*f);
    return eof_;
  }
  const std::vector<Json>& frames() const { return frames_; }
  size_t bytes_received() const { return received_; }

  // The first error frame seen by wait_closed, if any.
  std::optional<Json> error_frame() const {
    for (const auto& f : frames_)
      if (f.value("kind", "") == "error") return f;
    return std::nullopt;
  }

 private:
  std::optional<Json> take_frame() {
    if (in_.size() < 4) return std::nullopt;
    const auto* p = reinterpret_cast<const uint8_t*>(in_.data());
    const size_t n = (size_t{p[0]} << 24) | (size_t{p[1]} << 16) | (size_t{p[2]} << 8) | p[3];
    if (in_.size() < 4 + n) return std::nullopt;
    Json j = Json::parse(in_.substr(4, n));
    in_.erase(0, 4 + n);
    return j;
  }

  int fd_ = -1;
  std::string in_;
  bool eof_ = false;
  size_t received_ = 0;
  std::vector<Json> frames_;
};

// Options for tests: short timeouts so that failures show up quickly, with
// generous bounds on every wait.
inline CoordinatorOptions fast_coordinator() {
  CoordinatorOptions o;
  o.hello_timeout = std::chrono::milliseconds(2000);
  o.heartbeat_timeout = std::chrono::milliseconds(3000);
  o.step_timeout = std::chrono::milliseconds(20000);
  return o;
}

inline ClientOptions client_of(const Coordinator& c, Role role, int rank, int world) {
  ClientOptions o;
  o.address = c.address();
  o.role = role;
  o.rank = rank;
  o.world = world;
  o.heartbeat_interval = std::chrono::milliseconds(200);
  o.request_timeout = std::chrono::milliseconds(20000);
  return o;
}

}  // namespace weightsync::control::testing
