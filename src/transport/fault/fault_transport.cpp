// "fault:<inner>": wraps any transport and injects the faults its settings ask
// for (drop, corrupt, truncate, delay, fail after N, dead peers, a frozen
// rank), deterministically, so that failure paths are tested on real
// transports without real failures.
#include <weightsync/backend/transport.h>
#include <weightsync/error.h>

#include "builtin.h"
#include "fault_config.h"

#include <csignal>
#include <cstdio>
#include <cstring>
#include <vector>

namespace weightsync::transport::fault {
namespace {

using Clock = std::chrono::steady_clock;

// release_ms: a message's release travels back under its tag with this bit
// set (the job's tags stay below it; UCX keeps 48 bits).
constexpr Tag kReleaseBit = Tag{1} << 47;

// The releases a rank owes its senders (release_ms), sent from its progress.
class Releases {
 public:
  Releases(Transport& inner, std::chrono::milliseconds after) : inner_(inner), after_(after) {}
  // A receive from `peer` with `tag` completed: release it `after` from now.
  void owe(int peer, Tag tag) { due_.push_back({peer, tag, Clock::now() + after_}); }
  // Sends the releases that are due and forgets those that went out. Errors
  // (a peer gone) are left alone: its sender is gone too.
  void pump() {
    const auto now = Clock::now();
    for (size_t i = 0; i < due_.size();) {
      if (due_[i].when > now) {
        ++i;
        continue;
      }
      try {
        out_.push_back(inner_.send(due_[i].peer, due_[i].tag | kReleaseBit,
                                   host_buffer(&kToken, sizeof kToken)));
      } catch (const Error&) {
      }
      due_.erase(due_.begin() + static_cast<std::ptrdiff_t>(i));
    }
    for (size_t i = 0; i < out_.size();) {
      bool done = true;
      try {
        done = out_[i]->test();
      } catch (const Error&) {
      }
      if (done)
        out_.erase(out_.begin() + static_cast<std::ptrdiff_t>(i));
      else
        ++i;
    }
  }

 private:
  struct Due {
    int peer;
    Tag tag;
    Clock::time_point when;
  };
  static constexpr uint64_t kToken = 0x72656c65617365;  // "release"
  Transport& inner_;
  std::chrono::milliseconds after_;
  std::vector<Due> due_;
  std::vector<std::unique_ptr<Request>> out_;
};

// One wrapped operation: the inner request (none for a dropped send), an owned
// corrupted copy for a corrupted send, a byte to flip after a receive, and the
// earliest completion time for delays.
class FaultRequest final : public Request {
 public:
  struct Setup {
    std::unique_ptr<Request> inner;
    std::vector<uint8_t> payload_copy;  // keeps a corrupted send's payload alive
    uint8_t* flip_base = nullptr;       // receive buffer to corrupt on completion
    std::size_t flip_seed = 0;
    Clock::time_point not_before;
    std::optional<Error> error;  // an injected failure reported by test()
    // release_ms: the releases of this rank (pumped by every test), and for a
    // send, the receive of its release; for a receive, owes one when done.
    Releases* releases = nullptr;
    std::unique_ptr<uint64_t> release_buffer;
    std::unique_ptr<Request> release;
    bool owes_release = false;
  };

  FaultRequest(const std::string& name, Kind kind, int peer, Tag tag, std::size_t bytes,
               Transport& inner_transport, Setup setup)
      : Request(name, kind, peer, tag, bytes),
        inner_transport_(inner_transport),
        s_(std::move(setup)) {}

  bool test() override {
    if (s_.releases) s_.releases->pump();  // as a worker progresses everything
    if (s_.error) throw *s_.error;
    if (Clock::now() < s_.not_before) {
      inner_transport_.progress();
      return false;
    }
    if (s_.inner && !s_.inner->test()) return false;
    if (s_.release && !s_.release->test()) return false;
    if (s_.owes_release) {
      s_.owes_release = false;
      s_.releases->owe(peer(), tag());
    }
    if (s_.flip_base && !flipped_) {
      flipped_ = true;
      const std::size_t n = transferred();
      if (n > 0) s_.flip_base[s_.flip_seed % n] ^= 0xFF;
    }
    return true;
  }
  void cancel() override {
    if (s_.inner) s_.inner->cancel();
    if (s_.release) s_.release->cancel();
    s_.owes_release = false;
  }
  std::size_t transferred() const override {
    return s_.inner ? s_.inner->transferred() : (kind() == Kind::send ? bytes() : 0);
  }

 private:
  Transport& inner_transport_;
  Setup s_;
  bool flipped_ = false;
};

class FaultTransport final : public Transport {
 public:
  FaultTransport(std::unique_ptr<Transport> inner, const FaultConfig& config)
      : inner_(std::move(inner)), plan_(config) {
    if (config.release_ms)
      releases_ =
          std::make_unique<Releases>(*inner_, std::chrono::milliseconds(*config.release_ms));
  }

  std::string name() const override { return "fault:" + inner_->name(); }
  int rank() const override { return inner_->rank(); }
  int world() const override { return inner_->world(); }
  Capabilities capabilities() const override {
    Capabilities c = inner_->capabilities();
    c.native_broadcast = false;  // broadcasts fan out here so that faults apply per message
    return c;
  }
  std::unique_ptr<MemoryRegion> register_memory(const Buffer& buffer) override {
    return inner_->register_memory(buffer);
  }
  void progress() override {
    inner_->progress();
    if (releases_) releases_->pump();
  }
  void connect(int peer) override {
    if (plan_.dead(peer))
      fail(Errc::peer_failure, name(), ": connect to rank ", peer, ": peer rank ", peer,
           " failed (injected)");
    inner_->connect(peer);
  }
  bool peer_failed(int peer) const override {
    return plan_.dead(peer) || inner_->peer_failed(peer);
  }
  void reconnect(int peer) override { inner_->reconnect(peer); }
  void sends_settled() override { inner_->sends_settled(); }
  std::shared_ptr<char> allocate_host(std::size_t bytes) override {
    return inner_->allocate_host(bytes);
  }
  // Loans (where the inner transport has them): this rank answers them, so
  // that its peers never wait for a loan it would not make, but it lends
  // nothing and declines what it is lent: writes into lent memory would
  // bypass the faults, so its buckets travel as messages, through them.
  std::unique_ptr<Request> expose(int peer, Tag tag, const std::vector<Buffer>& buffers) override {
    if (!inner_->capabilities().maps_peer_memory) return Transport::expose(peer, tag, buffers);
    return inner_->expose(peer, tag, {});
  }
  std::unique_ptr<Request> map_exposed(int peer, Tag tag, std::vector<void*>* addresses) override {
    if (!inner_->capabilities().maps_peer_memory)
      return Transport::map_exposed(peer, tag, addresses);
    return inner_->map_exposed(peer, tag, nullptr);
  }

  std::unique_ptr<Request> send(int peer, Tag tag, const Buffer& buffer) override {
    if (releases_) release_tag(tag);
    if (plan_.freezes_send()) freeze("send", peer, tag);
    FaultRequest::Setup s;
    s.not_before = Clock::now() + plan_.delay();
    if (!injected_failure(Request::Kind::send, peer, tag, buffer, s)) {
      const auto fault = plan_.next_send(tag);
      if (fault == FaultPlan::Fault::corrupt) {
        require_host(buffer, "corrupt_send");
        const auto* p = static_cast<const uint8_t*>(buffer.data);
        s.payload_copy.assign(p, p + buffer.bytes);
        if (buffer.bytes) s.payload_copy[plan_.position(buffer.bytes)] ^= 0xFF;
        s.inner = inner_->send(peer, tag, host_buffer(s.payload_copy.data(), buffer.bytes));
      } else if (fault == FaultPlan::Fault::truncate) {
        Buffer shorter = buffer;
        shorter.bytes = buffer.bytes ? buffer.bytes - 1 : 0;
        s.inner = inner_->send(peer, tag, shorter);
      } else if (fault == FaultPlan::Fault::none) {
        if (releases_) {
          s.release_buffer = std::make_unique<uint64_t>(0);
          s.release = inner_->recv(peer, release_tag(tag),
                                   host_buffer(s.release_buffer.get(), sizeof(uint64_t)));
        }
        s.inner = inner_->send(peer, tag, buffer);
      }  // dropped: nothing goes out, the send completes locally
    }
    return wrap(Request::Kind::send, peer, tag, buffer.bytes, std::move(s));
  }

  std::unique_ptr<Request> recv(int peer, Tag tag, const Buffer& buffer) override {
    if (releases_) release_tag(tag);  // checks the tag before anything is posted
    if (plan_.freezes_recv()) freeze("receive", peer, tag);
    FaultRequest::Setup s;
    s.not_before = Clock::now() + plan_.delay();
    if (!injected_failure(Request::Kind::recv, peer, tag, buffer, s)) {
      if (plan_.next_recv(tag) == FaultPlan::Fault::corrupt) {
        require_host(buffer, "corrupt_recv");
        s.flip_base = static_cast<uint8_t*>(buffer.data);
        s.flip_seed = plan_.position(std::numeric_limits<std::size_t>::max());
      }
      s.inner = inner_->recv(peer, tag, buffer);
      s.owes_release = releases_ != nullptr;
    }
    return wrap(Request::Kind::recv, peer, tag, buffer.bytes, std::move(s));
  }

 private:
  Tag release_tag(Tag tag) const {
    if (tag & kReleaseBit)
      fail(Errc::invalid_argument, name(), ": tag ", tag, " has bit 47 set, which release_ms ",
           "keeps for its releases");
    return tag | kReleaseBit;
  }

  std::unique_ptr<Request> wrap(Request::Kind kind, int peer, Tag tag, std::size_t bytes,
                                FaultRequest::Setup s) {
    s.releases = releases_.get();
    return std::make_unique<FaultRequest>(name(), kind, peer, tag, bytes, *inner_, std::move(s));
  }

  // Dead peers and fail_after: the operation is not posted and its request
  // reports the injected error.
  bool injected_failure(Request::Kind kind, int peer, Tag tag, const Buffer& b,
                        FaultRequest::Setup& s) {
    const char* what = kind == Request::Kind::send ? "send to" : "receive from";
    if (plan_.dead(peer)) {
      s.error =
          Error(Errc::peer_failure, cat(name(), ": ", what, " rank ", peer, ", tag ", tag, ", ",
                                        b.bytes, " bytes: peer rank ", peer, " failed (injected)"));
      return true;
    }
    if (plan_.next_fails()) {
      s.error = Error(Errc::transport, cat(name(), ": ", what, " rank ", peer, ", tag ", tag, ", ",
                                           b.bytes, " bytes: injected failure"));
      return true;
    }
    return false;
  }

  // The process stops where it stands, as a hung one would (a drill kills it
  // from outside; SIGCONT resumes it and the operation is posted).
  void freeze(const char* what, int peer, Tag tag) {
    std::fprintf(stderr, "%s: rank %d freezes (SIGSTOP) posting a %s with rank %d, tag %llu\n",
                 name().c_str(), rank(), what, peer, static_cast<unsigned long long>(tag));
    std::fflush(stderr);
    std::raise(SIGSTOP);
  }

  void require_host(const Buffer& b, const char* what) const {
    if (b.memory != MemoryKind::host)
      fail(Errc::unsupported, name(), ": ", what, " needs host memory");
  }

  std::unique_ptr<Transport> inner_;
  FaultPlan plan_;
  std::unique_ptr<Releases> releases_;  // release_ms
};

}  // namespace
}  // namespace weightsync::transport::fault

namespace weightsync::transport {

std::unique_ptr<Transport> make_fault_transport(const TransportOptions& options) {
  const auto colon = options.name.find(':');
  if (colon == std::string::npos || colon + 1 == options.name.size())
    fail(Errc::invalid_argument, "transport '", options.name,
         "': the fault wrapper needs an inner transport, as in fault:ucx");
  const auto config = fault::FaultConfig::parse(options.params);
  TransportOptions inner = options;
  inner.name = options.name.substr(colon + 1);
  inner.params.clear();
  // The inner transport's own keys pass through; a misspelt fault key is
  // named here, with both lists, rather than handed on (an ignored fault key
  // would make a drill that injects nothing).
  const std::string backend = inner.name.substr(0, inner.name.find(':'));
  for (const auto& [k, v] : options.params) {
    if (fault::FaultConfig::is_fault_key(k)) continue;
    check_param(options.name, backend, k, fault::FaultConfig::keys());
    inner.params[k] = v;
  }
  return std::make_unique<fault::FaultTransport>(make_transport(inner), config);
}

}  // namespace weightsync::transport
