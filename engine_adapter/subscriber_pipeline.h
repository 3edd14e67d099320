// The engine rank's data path, compiled once from the plan and run every
// step: receive bucket k+1 while bucket k is verified and applied, in two
// receive slots (more when most of each bucket lands straight in its params:
// slot_depth), in the order the trainers send (Plan::buckets_received_by:
// predicted start, then bucket id). A p2p bucket lands as fragments
// (wire.h): dense runs go straight into their param (or staging copy), the
// rest into the slot and is applied from there.
//
// Each bucket's apply is a copy program (core/copy_program.h) built here
// once: loops on the host for host params, one kernel launch per bucket on
// the pipeline's own stream for CUDA params. A slot is posted again only once
// the apply that read it completed, and run() returns (the engine acks) only
// once every apply completed on the device.
//
// With staging, the pipeline owns a private copy of every param (in the
// params' memory), applies into it, and publish_staging() copies it into the
// params at commit.
//
// The pipeline orchestrates: delta sync's frames are DeltaReceiver's
// (delta_receiver.h), lent buckets' loans the Lender's (lender.h).
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/plan.h>
#include <weightsync/subscriber.h>
#include "delta_receiver.h"
#include "lender.h"
#include "recv_action.h"

#include "core/copy_program.h"
#include "core/cuda/gpu.h"
#include "pipeline/copier.h"
#include "pipeline/loop.h"
#include "pipeline/setup.h"
#include "transport/staging.h"

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace weightsync {
class Tracer;
}

namespace weightsync::engine {

class ReceivePipeline {
 public:
  // `params`: this rank's registered params, indexed like
  // EngineRankLayout::params, all in `memory`. With `staging`, applies go
  // into private copies allocated here (host ones from
  // transport.allocate_host, so that the transport can land and lend into
  // them as into the params). The transport's capabilities say which memory
  // a fragment may land in.
  ReceivePipeline(const Plan& plan, int global_rank, const std::vector<TensorView>& params,
                  bool staging, const pipeline::RankMemory& memory, const WireOptions& wire,
                  Transport& transport);

  std::size_t slot_bytes() const { return slot_bytes_; }
  // The slots' memory in all.
  std::size_t staging_bytes() const { return slots_.size() * slot_bytes_; }
  // Allocates and registers the slots (`slots` memory on `slot_device`)
  // and, for CUDA params, uploads the apply programs (once).
  void prepare(Transport& transport, SlotMemory slots, int slot_device);
  // Runs one step; `poll` is called about every millisecond and throws to
  // abandon the step. A bad checksum or a short message does not stop the
  // step (the senders must not stall): the bucket is skipped and reported.
  ReceiveReport run(int64_t step, Transport& transport, const std::function<void()>& poll,
                    std::chrono::steady_clock::time_point deadline, StepPhases& phases,
                    Tracer* tracer);
  // Delta sync: the version the targets hold now (the rank's committed one),
  // which a delta must name as its base, before run().
  void set_version(int64_t version) { delta_.set_version(version); }
  // Staging: copies the private copies into the params (after a commit);
  // returns when the copy is done.
  void publish_staging();
  // Called with k once bucket k (of Plan::buckets_received_by) is applied,
  // while every earlier bucket is too and no later one failed; before its
  // slot is posted again (load_weights mode hands the tensors it completed
  // to the engine). Exceptions from it fail run(), as from `poll`.
  void on_bucket(std::function<void(size_t k)> fn) { on_bucket_ = std::move(fn); }
  // Delta sync: whether param `p` may have changed in this run() so far: a
  // bucket that wrote it came whole, or its delta changed an element of it
  // (false: it holds what it held before the step).
  bool changed(uint32_t p) const { return p < changed_.size() && changed_[p]; }
  void cancel_all();

 private:
  struct Slot {
    StagingBuffer buffer;
    pipeline::Posted posted;
    int64_t posted_us = 0;
    std::string error;       // a message of the bucket came short
    int64_t received = 0;    // delta sync: the frame's bytes
    bool fragments = false;  // delta sync: the header came, then the fragments
  };
  struct StagingCopy {
    std::shared_ptr<char> host;
    gpu::Memory device;
  };
  std::vector<TensorView> make_staging(const std::vector<TensorView>& params, Transport& transport);
  void compile_fragments(RecvAction& a, const Plan& plan, const std::vector<TensorView>& targets);
  // Action `a` of bucket `b`: its programs, and the slot bytes they need.
  RecvAction compile_action(int32_t b, const Plan& plan, const std::vector<TensorView>& targets);
  // Marks the params `a` writes as changed.
  void mark_changed(const RecvAction& a);
  FragmentRoute direct_target(const Copy& c, const TensorView& target) const;
  void post(size_t k, int slot, int64_t step, Transport& t);
  void post_fragments(const RecvAction& a, Slot& slot, int64_t step, Transport& t);
  void receive(size_t k, int slot, int64_t step, pipeline::Loop& loop, StepPhases& phases,
               Tracer* tracer);
  void settle(size_t k, int slot, int64_t step, pipeline::Loop& loop, ReceiveReport& report,
              StepPhases& phases, Tracer* tracer);
  // A lent bucket: in the params already.
  void settle_lent(size_t k, Slot& slot, ReceiveReport& report);
  // The slot's error, if any, into the report (the step is rejected);
  // true when there was one.
  bool reject(Slot& slot, ReceiveReport& report);
  // ---- the bucket checksum (recv_sums.cpp) ----
  // Fragment routes' ops -> runs of a.apply, and which fragments' runs read
  // each packed byte once (FragmentRoute::fused): `whole` says, by op, that
  // the op's item reads its packed box whole.
  static void fuse_fragments(RecvAction& a, const std::vector<uint32_t>& first_run,
                             const std::vector<bool>& whole);
  // Applies bucket k from slot `s` and returns its checksum as it landed and
  // as sent (equal when not checked: the sender's or this rank's bytes in
  // device memory). On the host the sums are taken inside the apply's
  // copies, so a bad bucket is applied before it is rejected (the step
  // fails; without staging the rank is torn, as for a zero-copy fragment).
  std::pair<uint64_t, uint64_t> apply_bucket(size_t k, int s, int64_t step, pipeline::Loop& loop,
                                             StepPhases& phases);
  // Whether every byte of `a` is where the host reads it.
  bool host_readable(const RecvAction& a) const;
  // The checksum of bucket `a` as it lies in `data` (its slot) and its
  // zero-copy fragments, by a read of its own.
  uint64_t read_checksum(const RecvAction& a, const char* data, int64_t step) const;
  // Delta sync: checks bucket k's frame in `slot` and applies it
  // (DeltaReceiver::open).
  void settle_frame(size_t k, int slot, int64_t step, pipeline::Loop& loop, ReceiveReport& report,
                    StepPhases& phases);
  // The copier's indices of bucket k's gather and frame_apply programs
  // (CUDA targets; its apply is k, publish_ actions_.size()).
  std::size_t gather_index(size_t k) const { return actions_.size() + 1 + k; }
  std::size_t frame_apply_index(size_t k) const { return 2 * actions_.size() + 1 + k; }

  int global_rank_ = 0;
  int trainer_world_ = 1, engine_world_ = 1;
  bool broadcast_ = false;
  WireOptions wire_;
  Capabilities caps_;
  pipeline::RankMemory memory_;
  std::vector<RecvAction> actions_;
  std::size_t slot_bytes_ = 0;
  SlotMemory slot_memory_ = SlotMemory::host;
  // Before the slots: requests still posted (cancelled at destruction) may
  // land in the staging copies, so these outlive them.
  std::vector<StagingCopy> staging_;
  std::vector<Slot> slots_;    // slot_depth of them
  CopyProgram publish_;        // staging -> params
  DeltaReceiver delta_;        // delta sync
  std::vector<bool> changed_;  // by param: changed(), this run()
  Lender lender_;
  pipeline::Copier copier_;
  std::function<void(size_t)> on_bucket_;
};

}  // namespace weightsync::engine
