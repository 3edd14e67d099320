// The "kill" transport wrapper: lets the e2e tests kill a rank at an exact
// point of a step (its N-th send or receive), which timing-based kills could
// not do deterministically. Everything else passes through to the inner
// transport.
#include "demo_job.h"

#include <weightsync/error.h>
#include <weightsync/transport.h>

#include <charconv>

#include <signal.h>
#include <unistd.h>

namespace weightsync::demo {
namespace {

class KillTransport final : public Transport {
 public:
  KillTransport(std::unique_ptr<Transport> inner, bool on_send, int64_t after)
      : inner_(std::move(inner)), on_send_(on_send), after_(after) {}

  std::string name() const override { return "kill:" + inner_->name(); }
  int rank() const override { return inner_->rank(); }
  int world() const override { return inner_->world(); }
  Capabilities capabilities() const override { return inner_->capabilities(); }
  std::unique_ptr<MemoryRegion> register_memory(const Buffer& b) override {
    return inner_->register_memory(b);
  }
  std::unique_ptr<Request> send(int peer, Tag tag, const Buffer& b) override {
    if (on_send_) count();
    return inner_->send(peer, tag, b);
  }
  std::unique_ptr<Request> recv(int peer, Tag tag, const Buffer& b) override {
    if (!on_send_) count();
    return inner_->recv(peer, tag, b);
  }
  void progress() override { inner_->progress(); }
  void connect(int peer) override { inner_->connect(peer); }
  bool peer_failed(int peer) const override { return inner_->peer_failed(peer); }
  void reconnect(int peer) override { inner_->reconnect(peer); }

 private:
  void count() {
    if (++ops_ == after_) {
      // A hard crash, as an OOM kill or a node failure would look to peers.
      ::kill(::getpid(), SIGKILL);
    }
  }
  std::unique_ptr<Transport> inner_;
  bool on_send_;
  int64_t after_;
  int64_t ops_ = 0;
};

std::unique_ptr<Transport> make_kill_transport(const TransportOptions& options) {
  const auto colon = options.name.find(':');
  if (colon == std::string::npos)
    fail(Errc::invalid_argument, "transport '", options.name, "': kill needs an inner transport");
  TransportOptions inner = options;
  inner.name = options.name.substr(colon + 1);
  const auto op = options.params.count("op") ? options.params.at("op") : "send";
  if (op != "send" && op != "recv")
    fail(Errc::invalid_argument, "transport kill: op must be send or recv, got '", op, "'");
  int64_t after = 1;
  if (options.params.count("after")) {
    const std::string& text = options.params.at("after");
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), after);
    if (ec != std::errc() || end != text.data() + text.size() || after < 1)
      fail(Errc::invalid_argument, "transport kill: after must be a positive integer, got '", text,
           "'");
  }
  inner.params.erase("op");
  inner.params.erase("after");
  return std::make_unique<KillTransport>(make_transport(inner), op == "send", after);
}

}  // namespace

void register_kill_transport() {
  register_transport("kill", make_kill_transport);
}

}  // namespace weightsync::demo
