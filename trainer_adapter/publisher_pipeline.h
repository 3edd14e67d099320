// The trainer rank's data path, compiled once from the plan and run every
// step: pack bucket k+1 while bucket k is on the wire, in two staging slots.
//
// A p2p bucket travels as fragments (wire.h): dense runs of the registered
// tensors go out as they are, the rest is packed into the slot first.
//
// Buckets are handled in one global order shared by every process (the
// plan's predicted start time, then the bucket id), which with bounded
// windows on both sides cannot deadlock: the earliest unfinished bucket is
// always posted by its sender and its receiver.
#pragma once

#include <weightsync/plan.h>
#include <weightsync/publisher.h>
#include <weightsync/transport.h>
#include <weightsync/wire.h>

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

namespace weightsync::trainer {

// One strided copy from a local tensor into a bucket, resolved to pointers.
struct PackOp {
  const TensorView* tensor = nullptr;  // the registered local tensor
  Box src_box;                         // in that tensor
  Shape lengths;                       // packed row-major at dst_offset
  int64_t dst_offset = 0;              // in the slot buffer
  const char* src = nullptr;           // host fast path: first element
  Shape src_strides, dst_strides;
};

struct SendAction {
  enum class Kind { p2p, root, holder };
  Kind kind = Kind::p2p;
  int32_t bucket = 0;
  int dst_engine = -1;      // p2p: global engine rank
  int root = -1;            // the bucket's sender (broadcast: the root trainer rank)
  int64_t bytes = 0;        // what goes on the wire, without trailer (holder: its part)
  int64_t base = 0;         // bucket offset of this rank's packing (holder: part offset)
  std::vector<PackOp> ops;  // this rank's items (p2p: the packed fragments' items)
  std::vector<FragmentRoute> fragments;  // p2p
  int64_t packed_bytes = 0;              // p2p: slot bytes the packed fragments use
  std::vector<GatherPart> parts;         // root: the other holders' parts to receive
};

struct PipelineConfig {
  int rank = 0;
  int trainer_world = 1;
  int engine_world = 1;
  std::chrono::steady_clock::time_point deadline;
};

class SendPipeline {
 public:
  // Compiles the actions of `rank` from the plan for the registered tensors
  // (indexed like TrainerLayout::params).
  // `caps` are the transport's: which memory a fragment may be sent from.
  SendPipeline(const Plan& plan, int rank, const std::vector<TensorView>& tensors,
               const WireOptions& wire, const Capabilities& caps);

  std::size_t slot_bytes() const { return slot_bytes_; }
  std::size_t num_actions() const { return actions_.size(); }
  // Bytes the last run() sent straight from the registered tensors.
  uint64_t bytes_direct() const { return bytes_direct_; }
  // Allocates and registers the two slots (once).
  void prepare(Transport& transport);

  // Runs one step. `poll` is called about every millisecond while waiting; it
  // throws to abandon the step. `dead` marks engine ranks to skip (updated by
  // the caller's poll and by send failures). Returns payload bytes sent.
  uint64_t run(int64_t step, Transport& transport, std::vector<bool>& dead,
               const std::function<void()>& poll, std::chrono::steady_clock::time_point deadline,
               PushPhases& phases, Tracer* tracer);
  // Cancels whatever is still posted (after a failure).
  void cancel_all();

 private:
  struct Slot : RegisteredHostBuffer {
    std::vector<std::unique_ptr<Request>> requests;
    std::vector<int> engines;  // engine rank of each request, -1 for trainer peers
    int32_t bucket = -1;       // on the wire from this slot (for the trace)
    int64_t bytes = 0;
    int64_t posted_us = 0;
  };
  void compile_fragments(SendAction& a, const Plan& plan, const std::vector<TensorView>& tensors);
  void pack(const SendAction& a, size_t first, size_t count, char* buffer);
  void post_p2p(const SendAction& a, Slot& slot, int64_t step, Transport& t, PushPhases& phases);
  void post(const SendAction& a, Slot& slot, int64_t step, Transport& t, std::vector<bool>& dead,
            const std::function<void()>& poll, PushPhases& phases);
  void drain(Slot& slot, std::vector<bool>& dead, const std::function<void()>& poll,
             PushPhases& phases);

  int rank_ = 0, trainer_world_ = 1, engine_world_ = 1;
  bool native_broadcast_ = false;
  WireOptions wire_;
  Capabilities caps_;
  std::vector<SendAction> actions_;
  std::size_t slot_bytes_ = 0;
  uint64_t bytes_direct_ = 0;
  Slot slots_[2];
  std::chrono::steady_clock::time_point deadline_;
  Tracer* tracer_ = nullptr;
};

}  // namespace weightsync::trainer
