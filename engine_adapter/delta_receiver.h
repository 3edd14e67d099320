// Delta sync on an engine rank (docs/delta.md): each bucket's frame
// compiled from the plan, and each step's frame checked and, a delta,
// applied to the bucket as the targets hold it (on the host, or by the patch
// kernel for CUDA targets) before the ReceivePipeline applies the result.
#pragma once

#include <weightsync/backend/transport.h>
#include "recv_action.h"

#include "core/cuda/gpu.h"
#include "pipeline/copier.h"
#include "pipeline/setup.h"
#include "transport/staging.h"

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace weightsync::engine {

class DeltaReceiver {
 public:
  // `copier`: the pipeline's, which runs the gathers on CUDA targets.
  DeltaReceiver(const Plan& plan, int global_rank, const pipeline::RankMemory& memory,
                const WireOptions& wire, pipeline::Copier& copier);

  // Compiling. A p2p bucket: its items, where each lies in place, the
  // frame's apply and its reverse, and the params each item writes.
  void compile_p2p(RecvAction& a, const Plan& plan, const std::vector<TensorView>& targets);
  // A broadcast bucket (`a.apply` compiled): a.items, a.gather and a.reads,
  // and a.params / a.item_params from `writes` (bucket offset, param of each
  // item of `apply`); Errc::unsupported for CUDA targets.
  void compile_broadcast(RecvAction& a, const Plan& plan,
                         const std::vector<std::pair<int64_t, uint32_t>>& writes);
  // Whether frames are applied on the device (CUDA targets).
  bool on_device() const { return memory_.memory == MemoryKind::cuda; }
  // Refuses what delta sync cannot do with this transport and these slots.
  void check(bool broadcast, bool native_broadcast, SlotMemory slots) const;
  // The scratch a delta is applied in, for buckets up to `most` bytes.
  void prepare(int64_t most);
  // The version the targets hold now (the rank's committed one), which a
  // delta must name as its base.
  void set_version(int64_t version) { version_ = version; }

  // Whether the frame in a slot (`received` bytes) is a header alone (the
  // bucket follows as fragments); a damaged one is recorded in `error`.
  bool header_only(const RecvAction& a, const char* frame, int64_t received, int64_t step,
                   std::string& error) const;
  // Checks bucket `a`'s frame (`bytes` at `frame`, its trailer included)
  // and, a delta, applies it to the packed bucket gathered from the targets
  // (CUDA targets: queued on the copier's stream with gather program
  // `gather` and slot `slot`'s event); marks the params it changed. Returns
  // the packed bucket for a.frame_apply (broadcast: a.apply). Errc::format
  // or Errc::mismatch for a bad frame.
  const char* open(const RecvAction& a, size_t gather, int slot, const char* frame, int64_t bytes,
                   int64_t step, ReceiveReport& report, std::vector<bool>& changed);

 private:
  std::string what(const RecvAction& a, int64_t step) const;
  // The frame's bytes without its trailer, checked.
  int64_t verify(const char* frame, int64_t bytes, int64_t step, const std::string& what,
                 ReceiveReport& report) const;
  // A whole frame: its items in place copied there.
  void place_whole(const RecvAction& a, const char* packed, int64_t bytes, const std::string& what);
  const char* patch(const RecvAction& a, size_t gather, int slot, const char* frame, int64_t bytes,
                    const pipeline::FrameHeader& h, int64_t step, const std::string& what);
  // The patch on the host; returns the digest and sets `sent` to the one
  // to compare with (broadcast: this template's).
  uint64_t patch_on_host(const RecvAction& a, const char* frame, int64_t bytes,
                         const pipeline::FrameHeader& h, int64_t step, const std::string& what,
                         uint64_t& sent);
  // The tables built and checked here, the patch and the digest run on the
  // device; returns the digest (0 without one).
  uint64_t patch_on_device(const RecvAction& a, size_t gather, int slot, const char* frame,
                           int64_t bytes, int64_t step, bool digest, const std::string& what);
  [[noreturn]] void refuse_cuda_broadcast() const;

  int global_rank_ = 0;
  bool broadcast_ = false;
  int engine_template_ = 0, engine_templates_ = 1;  // broadcast frames' digests
  bool checksums_ = false;
  pipeline::RankMemory memory_;
  pipeline::Copier& copier_;
  int64_t version_ = -1;
  std::unique_ptr<char[]> scratch_;  // the bucket being rebuilt
  // CUDA targets: scratch on the device, the tables and the kernels that
  // apply a frame there.
  gpu::Memory device_scratch_;
  gpu::DeltaPatcher patcher_;
  pipeline::FrameTables tables_;
  std::vector<int64_t> target_addrs_;
  std::vector<char*> targets_;       // patch_on_host's, kept to spare an allocation
  std::vector<bool> items_changed_;  // by item
};

}  // namespace weightsync::engine
