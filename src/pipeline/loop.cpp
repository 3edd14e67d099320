#include "pipeline/loop.h"

#include <weightsync/error.h>

#include "transport/staging.h"

namespace weightsync::pipeline {

Loop::Loop(std::string who, Transport& transport, std::function<void()> poll,
           Clock::time_point deadline)
    : who_(std::move(who)), transport_(transport), poll_(std::move(poll)), deadline_(deadline) {}

void Loop::until(const std::function<bool()>& ready, const std::function<std::string()>& what,
                 bool progress) {
  const auto began = Clock::now();
  auto last_poll = began;
  int spins = 0;
  while (!ready()) {
    const auto now = Clock::now();
    if (now >= deadline_)
      fail(Errc::timeout, who_, ": ", what(), " did not complete before the step timeout (waited ",
           std::chrono::duration<double>(now - began).count(), " s for it)");
    if (poll_ && now - last_poll >= std::chrono::milliseconds(1)) {
      last_poll = now;
      poll_();
    }
    if (progress) transport_.progress();
    poll_pause(spins);
  }
}

std::optional<Error> Loop::settle(Request& request, const std::function<std::string()>& what) {
  std::optional<Error> failure;
  until(
      [&] {
        try {
          return request.test();
        } catch (const Error& e) {
          failure = e;
          return true;
        }
      },
      what);
  return failure;
}

void Posted::add(std::unique_ptr<Request> request, int owner) {
  requests_.push_back(std::move(request));
  owners_.push_back(owner);
}

void Posted::reserve(std::size_t n) {
  requests_.reserve(n);
  owners_.reserve(n);
}

void Posted::drain(Loop& loop, const DrainHooks& hooks) {
  for (std::size_t i = 0; i < requests_.size(); ++i) {
    Request& r = *requests_[i];
    const int owner = owners_[i];
    loop.until(
        [&] {
          if (hooks.dropped && owner >= 0 && hooks.dropped(owner)) {
            r.cancel();
            return true;
          }
          try {
            if (!r.test()) return false;
          } catch (const Error& e) {
            if (!hooks.failed) throw;
            hooks.failed(owner, e);
            return true;
          }
          if (hooks.done) hooks.done(r);
          return true;
        },
        [&] { return r.describe(); });
  }
  requests_.clear();
  owners_.clear();
}

void Posted::cancel_all() {
  for (auto& r : requests_) r->cancel();
  requests_.clear();
  owners_.clear();
}

}  // namespace weightsync::pipeline
