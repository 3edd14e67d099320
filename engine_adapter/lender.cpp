#include "lender.h"

#include <map>
#include <optional>

namespace weightsync::engine {

void Lender::plan(const Plan& plan, std::vector<RecvAction>& actions,
                  const std::vector<TensorView>& targets, MemoryKind memory) {
  memory_ = memory;
  std::map<int, std::vector<int32_t>> lendable;  // by trainer rank
  std::vector<bool> is_lendable;                 // by action
  for (const RecvAction& a : actions) {
    is_lendable.push_back(lendable_bucket(plan, a.bucket));
    if (is_lendable.back()) lendable[a.src].push_back(a.bucket);
  }
  std::map<int, int> loan_of;  // trainer rank -> loans_ index
  for (const auto& [src, buckets] : lendable) {
    Loan l;
    l.src = src;
    bool able = true;
    for (int p : lent_params(plan, buckets)) {
      const TensorView& t = targets.at(static_cast<size_t>(p));
      able = able && t.memory == memory_ && t.effective_strides() == contiguous_strides(t.shape);
      l.buffers.push_back(
          Buffer{t.numel() > 0 ? t.data : nullptr, t.nbytes(), t.memory, t.device, nullptr});
    }
    if (!able) l.buffers.clear();  // lends nothing: the trainer rank sends fragments
    loan_of[src] = static_cast<int>(loans_.size());
    loans_.push_back(std::move(l));
  }
  // Each lendable bucket rides on its trainer rank's loan.
  for (size_t k = 0; k < actions.size(); ++k)
    if (is_lendable[k]) actions[k].loan = loan_of.at(actions[k].src);
}

void Lender::register_memory(Transport& transport) {
  if (!regions_.empty()) return;
  for (Loan& l : loans_) {
    try {
      for (Buffer& b : l.buffers) {
        if (b.bytes == 0) continue;
        regions_.push_back(transport.register_memory(b));
        b.region = regions_.back().get();
      }
    } catch (const Error& e) {
      // Memory the transport cannot share (e.g. from a CUDA memory pool):
      // this loan lends nothing, and its buckets come as fragments.
      if (e.code() != Errc::unsupported) throw;
      l.buffers.clear();
    }
  }
}

void Lender::begin(int64_t step, Transport& t, pipeline::Loop& loop) {
  for (Loan& l : loans_) {
    l.lent = false;
    l.expose = t.expose(l.src, lend_tag(step), l.buffers);
  }
  for (Loan& l : loans_) {
    const std::optional<Error> failure = loop.settle(*l.expose, [&] {
      return cat("the loan to trainer rank ", l.src, " (", l.expose->describe(), ")");
    });
    // What the trainer rank mapped: nothing where this rank's transport
    // lent nothing (a fault wrapper answers loans that way).
    const std::size_t mapped = failure ? 0 : l.expose->transferred();
    l.expose.reset();
    // Declined, or the trainer rank could not map it: fragments, which the
    // trainer rank knows to send. A dead trainer fails the step.
    if (failure && failure->code() == Errc::peer_failure) throw *failure;
    l.lent = !failure && !l.buffers.empty() && mapped > 0;
  }
}

void Lender::cancel() {
  for (Loan& l : loans_) l.expose.reset();
}

}  // namespace weightsync::engine
