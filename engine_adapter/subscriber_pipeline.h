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
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/plan.h>
#include <weightsync/subscriber.h>
#include "pipeline/wire.h"

#include "core/copy_program.h"
#include "core/cuda/gpu.h"
#include "pipeline/copier.h"
#include "pipeline/delta_frame.h"
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

struct RecvAction {
  int32_t bucket = 0;
  int src = 0;        // transport rank of the sender (trainer rank)
  int64_t bytes = 0;  // payload, without trailer
  // The bucket's items from the slot into their targets: sources are slot
  // offsets, destinations param (or staging) addresses.
  CopyProgram apply;
  std::vector<FragmentRoute> fragments;  // p2p
  int64_t slot_bytes = 0;                // slot bytes used, without trailer
  // Delta sync (WireOptions::delta): a delta travels as one frame
  // (pipeline/delta_frame.h), whole bytes as a header and then `fragments`
  // as without delta. `frame_apply` reads the packed bucket from offset 0
  // of wherever it lies, and `gather` is its reverse, the packed bucket as
  // the targets hold it (the base a delta applies to).
  std::vector<pipeline::FrameItem> items;
  CopyProgram frame_apply;
  CopyProgram gather;
  int64_t frame_bytes = 0;  // the largest frame, without trailer
  // Per item: its bytes in place in the target (a delta patches them
  // there, a whole frame copies them there), or nullptr (through `apply`).
  std::vector<char*> in_place;
  // Broadcast plans: `apply` reads the bucket (a rebuilt one too) and
  // `gather` is its reverse; a delta's digest covers `reads`, the parts of
  // the bucket this rank's template reads.
  std::vector<pipeline::ReadBox> reads;
  // Delta sync: the params (indices of the rank layout) the bucket writes,
  // and those each item writes (broadcast: none for an item this rank does
  // not read), for ReceivePipeline::changed().
  std::vector<uint32_t> params;
  std::vector<std::vector<uint32_t>> item_params;
  // Lent buckets (pipeline/wire.h): the loan (ReceivePipeline::loans_
  // index) that may carry this bucket, or -1.
  int loan = -1;
};

struct ReceiveReport {
  uint64_t bytes = 0;
  uint64_t bytes_direct = 0;  // landed straight in their targets
  uint64_t checksum = 0;
  uint64_t delta_buckets = 0;  // delta sync: buckets that came as deltas
  uint64_t buckets_lent = 0;   // written by their trainer into lent params
  std::string error;           // first failed bucket, "" when every bucket was good
};

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
  void set_version(int64_t version) { version_ = version; }
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
  // What this rank lends one trainer rank each step: the targets its
  // lendable buckets write (pipeline::lent_params), or nothing when one of
  // them cannot be lent (not contiguous, not in the transport's memory).
  struct Loan {
    int src = 0;  // the trainer rank
    std::vector<Buffer> buffers;
    std::unique_ptr<Request> expose;
    bool lent = false;  // this step: the trainer rank mapped them
  };
  void plan_loans(const Plan& plan, const std::vector<TensorView>& targets);
  // Lends every loan for `step` and waits until each was mapped, declined
  // or could not be (then its buckets come as fragments).
  void begin_loans(int64_t step, Transport& t, pipeline::Loop& loop);
  bool lent(const RecvAction& a) const {
    return a.loan >= 0 && loans_[static_cast<size_t>(a.loan)].lent;
  }
  std::vector<TensorView> make_staging(const std::vector<TensorView>& params, Transport& transport);
  void compile_fragments(RecvAction& a, const Plan& plan, const std::vector<TensorView>& targets);
  void compile_frame(RecvAction& a, const Plan& plan, const std::vector<TensorView>& targets);
  // Delta sync, broadcast plans: a.items, a.gather and a.reads for `apply`,
  // and a.params / a.item_params from `writes` (bucket offset, param of
  // each item of `apply`).
  void compile_broadcast_frame(RecvAction& a, const Plan& plan,
                               const std::vector<std::pair<int64_t, uint32_t>>& writes);
  // Marks the params `a` writes as changed.
  void mark_changed(const RecvAction& a);
  [[noreturn]] void refuse_cuda_broadcast_delta() const;
  FragmentRoute direct_target(const Copy& c, const TensorView& target) const;
  void post(size_t k, int slot, int64_t step, Transport& t);
  void post_fragments(const RecvAction& a, Slot& slot, int64_t step, Transport& t);
  // Delta sync: whether the frame in `slot` is a header alone (the bucket
  // follows as fragments); a damaged one is recorded in the slot's error.
  bool header_only(const RecvAction& a, Slot& slot, int64_t step);
  void receive(size_t k, int slot, int64_t step, pipeline::Loop& loop, StepPhases& phases,
               Tracer* tracer);
  void settle(size_t k, int slot, int64_t step, pipeline::Loop& loop, ReceiveReport& report,
              StepPhases& phases, Tracer* tracer);
  // The bucket's checksum as it landed and as sent; equal when not checked.
  std::pair<uint64_t, uint64_t> checksums(const RecvAction& a, const char* data,
                                          int64_t step) const;
  // Delta sync: checks bucket k's frame in `slot` and applies it (a delta
  // onto the packed bucket gathered from the targets, in scratch_).
  void settle_frame(size_t k, int slot, int64_t step, pipeline::Loop& loop, ReceiveReport& report,
                    StepPhases& phases);
  // settle_frame's delta for CUDA targets: the tables built and checked
  // here, the patch and the digest run on the device; returns the digest
  // (0 without one).
  uint64_t patch_on_device(size_t k, int slot, const char* frame, int64_t bytes, int64_t step,
                           bool digest, const std::string& what);
  // The copier's indices of bucket k's gather and frame_apply programs
  // (CUDA targets; its apply is k, publish_ actions_.size()).
  std::size_t gather_index(size_t k) const { return actions_.size() + 1 + k; }
  std::size_t frame_apply_index(size_t k) const { return 2 * actions_.size() + 1 + k; }

  int global_rank_ = 0;
  int trainer_world_ = 1, engine_world_ = 1;
  bool broadcast_ = false;
  int engine_template_ = 0, engine_templates_ = 1;  // broadcast delta frames' digests
  WireOptions wire_;
  Capabilities caps_;
  pipeline::RankMemory memory_;
  std::vector<RecvAction> actions_;
  std::size_t slot_bytes_ = 0;
  // Before the slots: requests still posted (cancelled at destruction) may
  // land in the staging copies, so these outlive them.
  std::vector<StagingCopy> staging_;
  std::vector<Slot> slots_;          // slot_depth of them
  CopyProgram publish_;              // staging -> params
  std::unique_ptr<char[]> scratch_;  // delta sync: the bucket being rebuilt
  // Delta sync with CUDA targets: scratch on the device, the tables and
  // the kernels that apply a frame there.
  gpu::Memory device_scratch_;
  gpu::DeltaPatcher patcher_;
  pipeline::FrameTables tables_;
  std::vector<int64_t> target_addrs_;
  std::vector<char*> targets_;       // settle_frame's, kept to spare an allocation
  std::vector<bool> changed_;        // by param: changed(), this run()
  std::vector<bool> items_changed_;  // settle_frame's, by item
  int64_t version_ = -1;
  std::vector<Loan> loans_;
  // The lent params, registered once (prepare): a loan then finds its
  // regions without a lookup, and they stay lent while the pipeline lives.
  std::vector<std::unique_ptr<MemoryRegion>> lent_regions_;
  MemoryKind lend_memory_ = MemoryKind::cuda;
  pipeline::Copier copier_;
  std::function<void(size_t)> on_bucket_;
};

}  // namespace weightsync::engine
