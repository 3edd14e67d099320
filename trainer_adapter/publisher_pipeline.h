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
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/plan.h>
#include <weightsync/publisher.h>
#include "pipeline/wire.h"

#include "core/copy_program.h"
#include "core/cuda/gpu.h"
#include "core/fp8.h"
#include "pipeline/copier.h"
#include "pipeline/delta_frame.h"
#include "pipeline/loop.h"
#include "pipeline/setup.h"
#include "transport/staging.h"

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace weightsync::trainer {

struct SendAction {
  enum class Kind { p2p, root, holder };
  Kind kind = Kind::p2p;
  int32_t bucket = 0;
  int dst_engine = -1;  // p2p: global engine rank
  int root = -1;        // the bucket's sender (broadcast: the root trainer rank)
  int64_t bytes = 0;    // what goes on the wire, without trailer (holder: its part)
  int64_t base = 0;     // bucket offset of this rank's packing (holder: part offset)
  // This rank's items packed into the slot (p2p: the packed fragments'
  // items): sources are tensor addresses, destinations slot offsets.
  CopyProgram pack;
  // p2p, FP8 engines: the items this rank quantizes (Copy::fp8), from the
  // tensors into the slot; run before the bucket's fragments are sent.
  fp8::QuantProgram quant;
  // p2p; a packed fragment's first_op/num_ops index pack.runs().
  std::vector<FragmentRoute> fragments;
  int64_t packed_bytes = 0;       // p2p: slot bytes the packed fragments use
  std::vector<GatherPart> parts;  // root: the other holders' parts to receive
  // Delta sync (WireOptions::delta, p2p): the bucket's items as the codec
  // sees them, and its DeltaBase (SendPipeline::bases_).
  std::vector<pipeline::FrameItem> items;
  int delta_base = -1;
  // Per item: its bytes in place in the tensor (diffed from there), or
  // nullptr (packed by `pack`/`quant` into the slot); and the pack of the
  // in-place ones, for a whole frame.
  std::vector<const char*> in_place;
  CopyProgram pack_in_place;
  // A whole step of host tensors: the frame's header alone, then the
  // bucket's `fragments` as without delta, packed by these (the frame's
  // layout is `pack`/`quant`'s).
  CopyProgram whole_pack;
  fp8::QuantProgram whole_quant;
  // Broadcast roots: what each engine template reads of the bucket (the
  // delta frame's digests).
  std::vector<std::vector<pipeline::ReadBox>> reads;
  // Lent buckets (pipeline/wire.h): whether this one may be, its items, and
  // their copy straight into the engine's params where the loan maps them
  // (compiled when the addresses change).
  bool lendable = false;
  std::vector<Copy> lend_items;
  CopyProgram lent;
};

// An engine rank this trainer rank serves lendable buckets: the params it
// lends, as views at the addresses the loan mapped them to.
struct Loan {
  int engine = -1;                  // global engine rank
  std::vector<int> params;          // pipeline::lent_params, ascending
  std::vector<TensorView> targets;  // by params' order: shape, dtype, mapped address
  std::vector<void*> addresses;     // this step's mapping
  std::vector<void*> compiled_for;  // the addresses the `lent` programs write to
  std::unique_ptr<Request> map;
  bool lent = false;  // this step: its lendable buckets are lent
};

// Delta sync: what the engine ranks of a bucket were last sent. p2p buckets
// that pack the same bytes (one per replica of an engine layout, from this
// rank: "twins", PlanOptions::same_buckets_per_replica) share one: the first
// twin a step posts encodes the delta once when one of the twins' engine
// ranks holds the base, and keeps the frame, which the other twins whose
// rank holds the base send as it is; a rank without it (new, restarted, a
// step behind) gets the whole bytes. A broadcast root's bucket has its own.
struct DeltaBase {
  std::unique_ptr<char[]> last_sent;  // the bucket packed at version last_step
  int64_t bytes = 0;                  // last_sent's
  int64_t last_step = -1;             // -1: nothing yet
  int skip_deltas = 0;                // whole steps left before a delta is tried again
  int whole_tries = 0;                // tries in a row that came out nearly whole (back_off)
  bool last_delta_small = false;      // its last encoding was under 1/4 of the bytes
  // p2p twins: the engine ranks they go to, and this step's decision.
  std::vector<int> engines;
  int64_t decided = -1;     // the run() (SendPipeline::runs_) whose first twin decided
  bool delta = false;       // that step has the delta frame in `frame`
  int64_t frame_base = -1;  // the version it applies to
  std::vector<char> frame;  // with its trailer; kept while twins are left to send it
  int left = 0;             // twins still to send it this step
};

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
  void set_engine_versions(std::vector<int64_t> held) { held_ = std::move(held); }
  void set_delta_verify(bool on) { delta_verify_ = on; }
  // The last run()'s buckets sent as deltas, and their bytes whole.
  uint64_t delta_buckets() const { return delta_buckets_; }
  uint64_t delta_bytes_whole() const { return delta_bytes_whole_; }
  // The host memory the bases hold (PushResult::delta_base_bytes).
  uint64_t delta_base_bytes() const;
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

 private:
  struct Slot {
    StagingBuffer buffer;
    StagingBuffer frame;      // delta sync: the delta frame being sent
    pipeline::Posted posted;  // owners: engine rank, -1 for trainer peers
    int32_t bucket = -1;      // on the wire from this slot (for the trace)
    int64_t bytes = 0;
    int64_t posted_us = 0;
  };
  // a.fragments and a.packed_bytes, and the pack of the packed fragments
  // into `pack` and `quant`.
  void compile_fragments(SendAction& a, const Plan& plan, const std::vector<TensorView>& tensors,
                         CopyProgram& pack, fp8::QuantProgram& quant);
  void pack(size_t index, int slot, size_t first = 0, size_t count = static_cast<size_t>(-1));
  // CUDA tensors: one launch for the bucket, its pack and (FP8 engines) the
  // quantization of its quantized items, into `slot`; returns once done.
  void pack_on_device(size_t index, int slot);
  // Runs action `index`'s FP8 quantization into `slot` (host: now; GPU: on
  // the copier's stream, ahead of its pack).
  void quantize(size_t index, int slot);
  // The bucket's fragments; with delta sync on (a whole step), `header`
  // (its frame header, in the slot's frame buffer) goes first.
  void post_p2p(size_t index, int slot, int64_t step, PushPhases& phases,
                const pipeline::FrameHeader* header = nullptr);
  // Delta sync: the bucket's delta as one frame, or its bytes (a header,
  // then its fragments); returns the bytes sent. The first of its twins
  // (DeltaBase) encodes for all of them, when one's engine rank not `dead`
  // holds the base.
  int64_t post_frame(size_t index, int slot, int64_t step, const std::vector<bool>& dead,
                     PushPhases& phases);
  // Delta sync, broadcast root, the bucket packed and gathered in `slot`:
  // its delta as one frame to every engine rank when all of them hold its
  // base, else its bytes (a header, then the bucket); returns the bytes sent.
  int64_t post_root_frame(size_t index, int slot, int64_t step, std::vector<bool>& dead,
                          PushPhases& phases);
  // With WireOptions::checksums, the trailer of the `bytes` at `at` (a
  // frame, a whole frame's header) after them; returns the bytes to send.
  int64_t with_trailer(char* at, int64_t bytes, int64_t step) const;
  // Broadcast without a native broadcast: `buffer` to every engine rank not
  // `dead`; one whose send is refused at posting is marked dead.
  void send_to_engines(Slot& slot, Tag tag, const Buffer& buffer, std::vector<bool>& dead);
  // Delta sync: the bucket's bytes into its base's last_sent, as the frame
  // lays them out: copied from `packed` (the bucket packed so already), else
  // packed there from the tensors (host tensors).
  void keep_base(SendAction& a, const char* packed = nullptr);
  // Returns the bytes sent (a holder's part, a root's bucket or frame).
  int64_t post(size_t index, int slot, int64_t step, std::vector<bool>& dead, PushPhases& phases);
  void drain(Slot& slot, std::vector<bool>& dead);
  // Lent buckets: maps this step's loans (an engine rank whose map fails
  // with peer_failure is marked dead; any other failure, a decline or an
  // empty loan sends its buckets as fragments) and recompiles the programs
  // of those whose addresses changed.
  void begin_loans(int64_t step, Transport& transport, std::vector<bool>& dead);
  void compile_loan(Loan& loan);
  // Launches lendable bucket `index`'s copy into the lent params (slot `k`
  // holds its message), then settles the one launched before it.
  void post_lent(size_t index, int k, int64_t step, std::vector<bool>& dead, PushPhases& phases);
  // Waits for the launched copy not yet settled and posts its zero-byte
  // message (before anything that may wait on the engine rank).
  void settle_lent(int64_t step, std::vector<bool>& dead);

  int rank_ = 0, trainer_world_ = 1, engine_world_ = 1;
  bool native_broadcast_ = false;
  WireOptions wire_;
  Capabilities caps_;
  std::vector<SendAction> actions_;
  std::vector<DeltaBase> bases_;  // delta sync
  int64_t runs_ = 0;              // run() calls so far
  std::size_t slot_bytes_ = 0;
  std::size_t frame_bytes_ = 0;  // delta sync: the largest frame, with trailer
  uint64_t bytes_direct_ = 0;
  std::vector<int64_t> held_;
  std::vector<const char*> next_;  // post_frame's, kept to spare an allocation
  bool delta_verify_ = true;
  uint64_t delta_buckets_ = 0, delta_bytes_whole_ = 0;
  std::vector<Slot> slots_;  // slot_depth of them
  pipeline::Copier copier_;
  // Lent buckets.
  bool lending_ = false;
  MemoryKind lend_memory_ = MemoryKind::cuda;  // the transport's memory
  std::vector<TensorView> tensors_;
  std::vector<Loan> loans_;
  pipeline::Copier lent_copier_;
  int lent_event_ = 0;
  struct Launched {
    size_t index = 0;
    int slot = 0;
    int event = 0;
  };
  std::optional<Launched> launched_;  // a lent copy whose message is not posted yet
  uint64_t buckets_lent_ = 0;
  std::vector<gpu::DeviceQuant> device_quant_;  // by action, GPU only
  Producer producer_;
  // Set for the duration of run().
  pipeline::Loop* loop_ = nullptr;
  Tracer* tracer_ = nullptr;
};

}  // namespace weightsync::trainer
