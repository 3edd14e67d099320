// The trainer rank's data path, compiled once from the plan and run every
// step: pack bucket k+1 while bucket k is on the wire, in two staging slots
// (more when most of each bucket goes straight from the tensors:
// slot_depth).
//
// Each bucket's pack is a copy program (core/copy_program.h) built here once:
// loops on the host for host tensors, one kernel launch per bucket on the
// pipeline's own stream for CUDA tensors, into slots where the data goes
// (wire.h choose_slot_memory: host, pinned or device memory). A p2p bucket
// travels as fragments (wire.h): dense runs of the registered tensors go out
// as they are, the rest is packed into the slot first; a send is posted only
// once its pack completed.
//
// Buckets go in the plan's order (Plan::buckets_sent_by: predicted start,
// then bucket id), one order shared by every process; with bounded windows
// on both sides it cannot deadlock: the earliest unfinished bucket is always
// posted by its sender and its receiver. In broadcast mode the buckets this
// rank roots and those it contributes gather parts to are merged by id,
// which is that order there.
//
// The pipeline orchestrates: delta sync's choices, encoding and bases are
// DeltaSender's (delta_sender.h), lent buckets' maps and copies
// LoanWriter's (loan_writer.h).
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/plan.h>
#include <weightsync/publisher.h>
#include "delta_sender.h"
#include "loan_writer.h"
#include "send_action.h"

#include "core/cuda/gpu.h"
#include "pipeline/copier.h"
#include "pipeline/loop.h"
#include "pipeline/setup.h"
#include "transport/staging.h"

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace weightsync::trainer {

// Waits for the user's producer work before a push reads the tensors
// (PublisherOptions): an event, else a stream, else the whole device.
struct Producer {
  void* stream = nullptr;  // cudaStream_t
  void* event = nullptr;   // cudaEvent_t
};

class SendPipeline {
 public:
  // Compiles the actions of `rank` from the plan for the registered tensors
  // (indexed like TrainerLayout::params). `caps` are the transport's: which
  // memory a fragment may be sent from.
  // `engine` (its params' shapes and dtypes) lets the engine ranks lend
  // their params (WireOptions::lend); without it every loan is declined.
  SendPipeline(const Plan& plan, int rank, const std::vector<TensorView>& tensors,
               const WireOptions& wire, const Capabilities& caps,
               const EngineLayout* engine = nullptr);

  std::size_t slot_bytes() const { return slot_bytes_; }
  // The slots' memory in all.
  std::size_t staging_bytes() const { return slots_.size() * slot_bytes_; }
  std::size_t num_actions() const { return actions_.size(); }
  // Bytes the last run() sent straight from the registered tensors (lent
  // buckets' included), and its buckets written into lent params.
  uint64_t bytes_direct() const { return bytes_direct_; }
  uint64_t buckets_lent() const { return buckets_lent_; }
  // Delta sync: the version each engine rank holds as this rank knows it
  // (committed from what this rank sent; -1: unknown), by global engine
  // rank, for the next run(); and whether delta buckets carry a digest.
  void set_engine_versions(std::vector<int64_t> held) {
    delta_.set_engine_versions(std::move(held));
  }
  void set_delta_verify(bool on) { delta_.set_verify(on); }
  // The last run()'s buckets sent as deltas, and their bytes whole.
  uint64_t delta_buckets() const { return delta_.delta_buckets(); }
  uint64_t delta_bytes_whole() const { return delta_.delta_bytes_whole(); }
  // The host memory the bases hold (PushResult::delta_base_bytes).
  uint64_t delta_base_bytes() const { return delta_.base_bytes(); }
  // Allocates and registers the two slots (`slots` memory, on `slot_device`)
  // and, for CUDA tensors, uploads the pack programs to their device (once).
  void prepare(Transport& transport, SlotMemory slots, int slot_device,
               const pipeline::RankMemory& memory, Producer producer);

  // Runs one step. `poll` is called about every millisecond while waiting; it
  // throws to abandon the step. `dead` marks engine ranks to skip (updated by
  // the caller's poll and by send failures). Returns payload bytes sent.
  uint64_t run(int64_t step, Transport& transport, std::vector<bool>& dead,
               const std::function<void()>& poll, std::chrono::steady_clock::time_point deadline,
               PushPhases& phases, Tracer* tracer);
  // Cancels whatever is still posted (after a failure).
  void cancel_all();
  // Called (from run()) once per engine rank and run when a send to it fails
  // or is refused: the rank is dropped from the step, and `fn` gets a
  // message naming this rank, the bucket, the engine rank and the error, to
  // report at once (the engine would otherwise wait for the step timeout).
  void on_engine_failed(std::function<void(int engine, const std::string& why)> fn) {
    engine_failed_ = std::move(fn);
  }

 private:
  struct Slot {
    StagingBuffer buffer;
    StagingBuffer frame;      // delta sync: the delta frame being sent
    pipeline::Posted posted;  // owners: engine rank, -1 for trainer peers
    int32_t bucket = -1;      // on the wire from this slot (for the trace)
    int64_t bytes = 0;
    int64_t posted_us = 0;
    // The bytes run() counted as sent for the bucket in this slot (p2p, and
    // a broadcast root's), taken back if one of its messages fails or is
    // dropped: bytes_sent counts only buckets whose every message completed.
    uint64_t counted = 0;
    // A message of the bucket to an engine rank was refused at posting, or
    // no engine rank was left to send it to: the bucket is not counted.
    bool unsent = false;
  };
  // Drops engine rank `g` from the step after `error` (`what`: what failed)
  // and reports it once (engine_failed_).
  void drop_engine(int g, const Error& error, std::vector<bool>& dead, const std::string& what);
  // The bucket in `slot` did not reach its engine rank: not sent.
  void uncount(Slot& slot);
  // The programs of action `a` (its bucket's sizes are ordered_actions').
  void compile_action(SendAction& a, const Plan& plan, const std::vector<TensorView>& tensors);
  // ---- the bucket checksum (send_sums.cpp) ----
  // Whether every byte of p2p action `a` is where the host reads it (else
  // its trailer says "not computed").
  bool host_readable(const SendAction& a) const;
  // Packs fragment `f` (host) into the slot at `slot`, with its sums when
  // `summed`: inside the copies where they write every byte (f.fused), else
  // by a read of what they packed. The CUDA pack ran before: only the read.
  WireSum pack_fragment(const CopyProgram& program, char* slot, const FragmentRoute& f,
                        bool summed);
  // The checksum of the `bytes` bytes at the start of `slot` (a broadcast
  // bucket, whole), or 0 where they are in device memory.
  uint64_t slot_checksum(const Slot& slot, int64_t bytes, int64_t step) const;
  void pack(size_t index, int slot, size_t first = 0, size_t count = static_cast<size_t>(-1));
  // CUDA tensors: one launch for the bucket, its pack and (FP8 engines) the
  // quantization of its quantized items, into `slot`; returns once done.
  void pack_on_device(size_t index, int slot);
  // Runs action `index`'s FP8 quantization into `slot` (host: now; GPU: on
  // the copier's stream, ahead of its pack).
  void quantize(size_t index, int slot);
  // The bucket's fragments; `whole_frame` (delta sync, a whole step, its
  // header posted) packs them with the fragments' own programs.
  void post_p2p(size_t index, int slot, int64_t step, PushPhases& phases, bool whole_frame = false);
  // Posts `bytes` from `from` to the bucket's engine rank as one message
  // (a frame), and traces it; returns `bytes`.
  int64_t send_frame(const SendAction& a, Slot& slot, const StagingBuffer& from, int64_t bytes,
                     bool delta, int64_t step, int64_t pack_us);
  // Delta sync: the bucket's delta as one frame, or its bytes (a header,
  // then its fragments); returns the bytes sent (DeltaSender::p2p_frame).
  int64_t post_frame(size_t index, int slot, int64_t step, const std::vector<bool>& dead,
                     PushPhases& phases);
  // Delta sync, broadcast root, the bucket packed and gathered in `slot`:
  // its delta as one frame to every engine rank when all of them hold its
  // base, else its bytes (a header, then the bucket); returns the bytes sent.
  int64_t post_root_frame(size_t index, int slot, int64_t step, std::vector<bool>& dead,
                          PushPhases& phases);
  // Broadcast without a native broadcast: `buffer` to every engine rank not
  // `dead`; one whose send is refused at posting is marked dead.
  void send_to_engines(Slot& slot, Tag tag, const Buffer& buffer, std::vector<bool>& dead);
  // A broadcast bucket's root or holder: packs (and gathers) it; returns
  // the bytes sent (a holder's part, a root's bucket or frame).
  int64_t post(size_t index, int slot, int64_t step, std::vector<bool>& dead, PushPhases& phases);
  // A packed broadcast bucket from its root to the engine ranks.
  void post_root(const SendAction& a, Slot& slot, int64_t step, std::vector<bool>& dead);
  // One action of run(): returns the bytes sent.
  uint64_t post_action(size_t index, int slot, int64_t step, bool lend, std::vector<bool>& dead,
                       PushPhases& phases);
  void drain(Slot& slot, std::vector<bool>& dead);
  // Lent buckets: launches bucket `index`'s copy into the lent params (slot
  // `k` holds its message), then settles the one launched before it.
  void post_lent(size_t index, int k, int64_t step, std::vector<bool>& dead, PushPhases& phases);
  // Waits for the launched copy not yet settled and posts its zero-byte
  // message (before anything that may wait on the engine rank).
  void settle_lent(int64_t step, std::vector<bool>& dead);
  void settle_lent(const LentCopy& copy, int64_t step, std::vector<bool>& dead);

  int rank_ = 0, trainer_world_ = 1, engine_world_ = 1;
  bool native_broadcast_ = false;
  SlotMemory slot_memory_ = SlotMemory::host;
  WireOptions wire_;
  Capabilities caps_;
  std::vector<SendAction> actions_;
  DeltaSender delta_;
  std::size_t slot_bytes_ = 0;
  uint64_t bytes_direct_ = 0;
  uint64_t unsent_ = 0;  // this run(): counted, then failed or dropped (uncount)
  std::function<void(int, const std::string&)> engine_failed_;
  std::vector<Slot> slots_;  // slot_depth of them
  pipeline::Copier copier_;
  LoanWriter loans_;
  uint64_t buckets_lent_ = 0;
  std::vector<gpu::DeviceQuant> device_quant_;  // by action, GPU only
  Producer producer_;
  // Set for the duration of run().
  pipeline::Loop* loop_ = nullptr;
  Tracer* tracer_ = nullptr;
};

}  // namespace weightsync::trainer
