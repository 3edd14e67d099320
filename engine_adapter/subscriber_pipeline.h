// The engine rank's data path, compiled once from the plan and run every
// step: receive bucket k+1 while bucket k is verified and applied, in two
// receive slots, in the same global bucket order the trainers send in. A p2p
// bucket lands as fragments (wire.h): dense runs go straight into their
// param (or staging copy), the rest into the slot and is applied from there.
#pragma once

#include <weightsync/plan.h>
#include <weightsync/subscriber.h>
#include <weightsync/transport.h>
#include <weightsync/wire.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace weightsync {
class Tracer;
}

namespace weightsync::engine {

// One strided copy from a landed bucket into a param (or its staging copy).
struct ApplyOp {
  int64_t src_offset = 0;  // first element, bytes into the bucket
  Shape lengths;           // in the source's (HF) orientation
  Shape src_strides;       // in elements
  Shape dst_strides;       // of the destination, permuted when transposed
  char* dst = nullptr;     // first element in the destination
  DType dtype = DType::U8;
  // For non-host destinations (copy_box path).
  const TensorView* target = nullptr;
  Shape view_lengths;  // the packed tensor at view_offset
  int64_t view_offset = 0;
  Box src_box, dst_box;
  bool transpose = false;
};

struct RecvAction {
  int32_t bucket = 0;
  int src = 0;        // transport rank of the sender (trainer rank)
  int64_t bytes = 0;  // payload, without trailer
  std::vector<ApplyOp> ops;
  std::vector<FragmentRoute> fragments;  // p2p
  int64_t slot_bytes = 0;                // slot bytes used, without trailer
};

struct ReceiveReport {
  uint64_t bytes = 0;
  uint64_t bytes_direct = 0;  // landed straight in their targets
  uint64_t checksum = 0;
  std::string error;  // first failed bucket, "" when every bucket was good
};

class ReceivePipeline {
 public:
  // `targets`: where this rank's params are applied (the params themselves or
  // their staging copies), indexed like EngineRankLayout::params.
  // `caps` are the transport's: which memory a fragment may land in.
  ReceivePipeline(const Plan& plan, int global_rank, const std::vector<TensorView>& targets,
                  const WireOptions& wire, const Capabilities& caps);

  std::size_t slot_bytes() const { return slot_bytes_; }
  void prepare(Transport& transport);
  // Runs one step; `poll` is called about every millisecond and throws to
  // abandon the step. A bad checksum does not stop the step (the senders must
  // not stall): the bucket is skipped and reported.
  ReceiveReport run(int64_t step, Transport& transport, const std::function<void()>& poll,
                    std::chrono::steady_clock::time_point deadline, StepPhases& phases,
                    Tracer* tracer);
  void cancel_all();

 private:
  struct Slot : RegisteredHostBuffer {
    std::vector<std::unique_ptr<Request>> requests;
    int64_t posted_us = 0;
    std::string error;  // a message of the bucket came short
  };
  void compile_fragments(RecvAction& a, const Plan& plan, const std::vector<TensorView>& targets);
  FragmentRoute direct_target(const Copy& c, const TensorView& target) const;
  void post(size_t k, Slot& slot, int64_t step, Transport& t);
  void wait(Slot& slot, const std::function<void()>& poll,
            std::chrono::steady_clock::time_point deadline);
  // The bucket's checksum as it landed and as sent; equal when not checked.
  std::pair<uint64_t, uint64_t> checksums(const RecvAction& a, const char* data,
                                          int64_t step) const;
  void apply(const RecvAction& a, size_t first, size_t count, const char* data);

  int global_rank_ = 0;
  int trainer_world_ = 1, engine_world_ = 1;
  bool broadcast_ = false;
  WireOptions wire_;
  Capabilities caps_;
  std::vector<RecvAction> actions_;
  std::size_t slot_bytes_ = 0;
  Slot slots_[2];
};

}  // namespace weightsync::engine
