// Delta sync on a trainer rank (docs/delta.md): per bucket and step, whether
// it goes as a delta against what its engine ranks were last sent or as its
// whole bytes (the tries and the back-off), the encoding, and the bases the
// deltas are encoded against. The SendPipeline packs and posts; this decides
// and encodes into the frame buffer it is given.
#pragma once

#include <weightsync/publisher.h>
#include "send_action.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

namespace weightsync::trainer {

// What the engine ranks of a bucket were last sent. p2p buckets that pack
// the same bytes (one per replica of an engine layout, from this rank:
// "twins", PlanOptions::same_buckets_per_replica) share one: the first twin
// a step posts encodes the delta once when one of the twins' engine ranks
// holds the base, and keeps the frame, which the other twins whose rank
// holds the base send as it is; a rank without it (new, restarted, a step
// behind) gets the whole bytes. A broadcast root's bucket has its own.
struct DeltaBase {
  std::unique_ptr<char[]> last_sent;  // the bucket packed at version last_step
  int64_t bytes = 0;                  // last_sent's
  int64_t last_step = -1;             // -1: nothing yet
  int skip_deltas = 0;                // whole steps left before a delta is tried again
  int whole_tries = 0;                // tries in a row that came out nearly whole (back_off)
  bool last_delta_small = false;      // its last encoding was under 1/4 of the bytes
  // p2p twins: the engine ranks they go to, and this step's decision.
  std::vector<int> engines;
  int64_t decided = -1;     // the run (DeltaSender::begin_run) whose first twin decided
  bool delta = false;       // that step has the delta frame in `frame`
  int64_t frame_base = -1;  // the version it applies to
  std::vector<char> frame;  // with its trailer; kept while twins are left to send it
  int left = 0;             // twins still to send it this step
};

// A p2p bucket's frame this step (DeltaSender::p2p_frame).
struct P2pFrame {
  bool delta = false;  // the delta frame, `bytes` with its trailer, is in the frame buffer
  int64_t bytes = 0;
  bool take = false;  // whole bytes: the base takes them (the encoder did not)
};

class DeltaSender {
 public:
  DeltaSender(bool checksums, int engine_world)
      : checksums_(checksums), engine_world_(engine_world) {}

  // Compiling. A p2p bucket: its items, their frame's programs (a.pack,
  // a.quant, a.pack_in_place, packing behind the frame's header) and its
  // base, shared with its twins.
  void compile_p2p(SendAction& a, const Plan& plan, const std::vector<TensorView>& tensors);
  // A broadcast root's bucket (packed and gathered as without delta): its
  // items, its base and what each engine template reads.
  void compile_root(SendAction& a, const Plan& plan);
  // The largest frame, with its trailer.
  std::size_t frame_bytes() const { return frame_bytes_; }

  // The version each engine rank holds as this rank knows it (-1: unknown),
  // by global engine rank; and whether delta buckets carry a digest.
  void set_engine_versions(std::vector<int64_t> held) { held_ = std::move(held); }
  void set_verify(bool on) { verify_ = on; }
  // A new step: the counters below start again.
  void begin_run();
  // This run's buckets sent as deltas, and their bytes whole.
  uint64_t delta_buckets() const { return delta_buckets_; }
  uint64_t delta_bytes_whole() const { return delta_bytes_whole_; }
  // The host memory the bases hold (PushResult::delta_base_bytes).
  uint64_t base_bytes() const;

  // A p2p bucket: a delta when its engine rank holds the base and it is
  // worth it, encoded into `frame` (the first of its twins encodes for all
  // of them, when one's engine rank not `dead` holds the base), else the
  // whole bytes. `pack` packs the frame's layout into the slot, whose bytes
  // after the header are at `body`; the encoding counts as packing.
  P2pFrame p2p_frame(const SendAction& a, int64_t step, const std::vector<bool>& dead,
                     const char* body, char* frame, const std::function<void()>& pack,
                     PushPhases& phases);
  // A broadcast root's bucket, packed and gathered at `packed`: its delta as
  // one frame into `frame` when every engine rank not `dead` holds its
  // base, and returns its bytes with trailer; 0 for the whole bytes (the
  // base then took them where it must).
  int64_t root_frame(const SendAction& a, int64_t step, const std::vector<bool>& dead,
                     const char* packed, char* frame);
  // The bucket's bytes into its base, as the frame lays them out: copied
  // from `packed` (the bucket packed so already), else packed there from
  // the tensors (host tensors).
  void keep_base(const SendAction& a, const char* packed = nullptr);
  // With WireOptions::checksums, the trailer of the `bytes` at `at` (a
  // frame, a whole frame's header) after them; returns the bytes to send.
  int64_t with_trailer(char* at, int64_t bytes, int64_t step) const;

 private:
  bool holds(int engine, int64_t version) const {
    return static_cast<size_t>(engine) < held_.size() &&
           held_[static_cast<size_t>(engine)] == version;
  }
  P2pFrame first_twin(const SendAction& a, DeltaBase& d, int64_t step,
                      const std::vector<bool>& dead, const char* body, char* frame,
                      const std::function<void()>& pack, PushPhases& phases);
  P2pFrame next_twin(const SendAction& a, DeltaBase& d, char* frame);
  // The encodings: the frame's bytes with trailer, or 0 when the bucket
  // goes whole; `base_is_next` once the encoder brought the base up to
  // this step.
  int64_t encode_p2p(const SendAction& a, DeltaBase& d, int64_t step, const char* body, char* frame,
                     bool& base_is_next);
  int64_t encode_root(const SendAction& a, DeltaBase& d, int64_t step, const char* packed,
                      char* frame, bool& base_is_next);
  void count_delta(const SendAction& a);

  bool checksums_ = false;
  int engine_world_ = 1;
  std::vector<DeltaBase> bases_;
  std::map<std::vector<int64_t>, size_t> twins_;  // compiling: packing key -> bases_ index
  std::size_t frame_bytes_ = 0;
  int64_t runs_ = 0;  // begin_run() calls so far
  std::vector<int64_t> held_;
  bool verify_ = true;
  std::vector<const char*> next_;  // the encoders', kept to spare an allocation
  uint64_t delta_buckets_ = 0, delta_bytes_whole_ = 0;
};

}  // namespace weightsync::trainer
