// Lent buckets on an engine rank (pipeline/wire.h): each step it lends every
// trainer rank that sends it lendable buckets the targets those buckets
// write, registered once, and waits until each loan was mapped, declined or
// could not be; a lent bucket then comes as a zero-byte message that says
// the trainer rank's copy wrote it.
#pragma once

#include <weightsync/backend/transport.h>
#include "recv_action.h"

#include "pipeline/loop.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace weightsync::engine {

class Lender {
 public:
  // The loans, as the plan lays them out (the trainer ranks derive the
  // same), and each lendable action's loan. `memory`: the transport's.
  void plan(const Plan& plan, std::vector<RecvAction>& actions,
            const std::vector<TensorView>& targets, MemoryKind memory);
  bool empty() const { return loans_.empty(); }
  MemoryKind memory() const { return memory_; }
  // Registers the lent targets with the transport, once: a loan then finds
  // its regions without a lookup, and they stay lent while this lives. A
  // loan whose memory the transport cannot share lends nothing.
  void register_memory(Transport& transport);
  // Lends every loan for `step` and waits until each was mapped, declined
  // or could not be (then its buckets come as fragments).
  void begin(int64_t step, Transport& t, pipeline::Loop& loop);
  // Whether `a` is lent this step.
  bool lent(const RecvAction& a) const {
    return a.loan >= 0 && loans_[static_cast<size_t>(a.loan)].lent;
  }
  void cancel();

 private:
  // What this rank lends one trainer rank each step: the targets its
  // lendable buckets write (pipeline::lent_params), or nothing when one of
  // them cannot be lent (not contiguous, not in the transport's memory).
  struct Loan {
    int src = 0;  // the trainer rank
    std::vector<Buffer> buffers;
    std::unique_ptr<Request> expose;
    bool lent = false;  // this step: the trainer rank mapped them
  };
  std::vector<Loan> loans_;
  // The lent params' registrations (register_memory).
  std::vector<std::unique_ptr<MemoryRegion>> regions_;
  MemoryKind memory_ = MemoryKind::cuda;
};

}  // namespace weightsync::engine
