// How a p2p bucket travels between a trainer rank and an engine rank.
//
// A bucket is cut into fragments, each one tagged message: every item of at
// least `direct_min_bytes` is a fragment of its own, and each run of smaller
// consecutive items is one fragment. Both sides cut the same way from the plan
// alone, so message sizes match; each side then decides for itself, per
// fragment, where its bytes live. A big item's fragment that is one dense run
// of a registered tensor is sent straight from the trainer's tensor, or received
// straight into the engine's param (zero copy); any other is packed into, or
// landed in and applied from, the rank's bucket slot at its bucket offset.
//
// Fragments of one bucket share the bucket's tag (bucket_tag(step, b, 0)) and
// are matched in posting order. With checksums on, the sender follows them
// with one 8-byte message (part 1) holding the bucket's checksum
// (bucket_checksum: core/wire_sum.h over the bucket's packed bytes, each
// fragment at its bucket offset), summed while it packs; the receiver sums
// the same while it applies and rejects the bucket when they differ. A
// sender whose bytes are in device memory sends 0 ("not computed"), and a
// receiver whose bytes are there does not check (WireOptions::checksums_gpu
// says otherwise). Broadcast buckets travel whole, with the trailer inline
// (kBucketTrailerBytes).
#pragma once

#include <weightsync/backend/transport.h>
#include <weightsync/box.h>
#include <weightsync/checksum.h>
#include <weightsync/engine_layout.h>
#include <weightsync/plan.h>
#include <weightsync/wire_options.h>

#include "core/wire_sum.h"
#include "transport/staging.h"

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace weightsync {

// How a broadcast bucket travels (publisher <-> subscriber): its payload
// followed by an 8-byte little-endian trailer holding its bucket_checksum,
// so one message carries both and a flipped byte anywhere is caught.
inline constexpr std::size_t kBucketTrailerBytes = 8;

// A u64 as 8 little-endian bytes at `at`, and back (trailers, frame headers).
inline void store_le64(char* at, uint64_t v) noexcept {
  for (std::size_t i = 0; i < 8; ++i, v >>= 8) at[i] = static_cast<char>(v & 0xff);
}
inline uint64_t read_le64(const char* at) noexcept {
  uint64_t v = 0;
  for (std::size_t i = 8; i-- > 0;) v = (v << 8) | static_cast<unsigned char>(at[i]);
  return v;
}

// The trailer holding `sum` at `at`; and back.
static_assert(kBucketTrailerBytes == 8, "a trailer is one little-endian u64");
inline void store_trailer(char* at, uint64_t sum) noexcept {
  store_le64(at, sum);
}
inline uint64_t read_trailer(const char* at) noexcept {
  return read_le64(at);
}

// The transport tag of bucket `bucket` of `step`; part 0 is the bucket itself,
// part 1 a broadcast gather part on its way to the root. The step rides in the
// tag so that a message of an aborted step never matches a later receive.
// Below 2^47: fits every backend's tag space (UCX keeps 48 bits).
inline uint64_t bucket_tag(int64_t step, int32_t bucket, int part) noexcept {
  return ((static_cast<uint64_t>(step) & 0x7FFF) << 32) | (static_cast<uint64_t>(bucket) << 1) |
         static_cast<uint64_t>(part & 1);
}

// Items [first, first + count) of plan.items(bucket), at [offset, offset + bytes)
// of the packed bucket.
struct Fragment {
  int64_t offset = 0;
  int64_t bytes = 0;
  uint32_t first = 0;
  uint32_t count = 0;
};

// The fragments of p2p bucket `bucket` (Errc::internal when its items are not
// packed back to back, which the planner guarantees).
std::vector<Fragment> bucket_fragments(const Plan& plan, int32_t bucket, int64_t direct_min_bytes);

// The messages of p2p bucket `bucket` on the wire: its fragments, plus the
// checksum message when checksums are on; with delta sync, plus the frame
// header before them (a bucket sent as a delta is one message, its frame).
int64_t bucket_messages(const Plan& plan, int32_t bucket, const WireOptions& wire);

// When the elements of `box`, in row-major order, are one dense run of memory
// in a tensor with element `strides`: the element offset of its first element.
std::optional<int64_t> dense_run_offset(const Shape& strides, const Box& box);

// One fragment as one side moves it: straight from or into a registered
// tensor (`direct`), or through the side's bucket slot at `slot_offset`, with
// the copies of its items (pack or apply ops) at [first_op, first_op + num_ops)
// of that side's op list (each side turns them into runs of its program).
// `offset`: where it lies in the bucket (the same on both sides). `fused`:
// its runs move each of its packed bytes once, so the bucket checksum is
// summed inside them (else by a read of the slot).
struct FragmentRoute {
  int64_t offset = 0;
  int64_t bytes = 0;
  bool fused = false;
  char* direct = nullptr;  // nullptr: through the slot
  MemoryKind memory = MemoryKind::host;
  int device = -1;
  int64_t slot_offset = 0;
  uint32_t first_op = 0, num_ops = 0;
};

// The route straight from or into `box` of `tensor` when its elements are one
// dense run in memory the transport can reach (`caps`); a route with a null
// `direct` otherwise. CUDA memory only without checksums on device paths
// (WireOptions::checksums_gpu: they are computed on the host).
FragmentRoute direct_route(const TensorView& tensor, const Box& box, const Capabilities& caps,
                           const WireOptions& wire);

// Routes the fragments of p2p bucket `bucket` for one side. `direct(copy)`
// offers a big item's direct route (direct_route, or none); every other item
// is handed to `add_op(copy, shift)`, in order (its op index counts from 0),
// its packed bytes lying at copy.offset + shift of the slot, where such
// fragments lie back to back from `slot_bytes` on (which grows by them).
std::vector<FragmentRoute> route_fragments(
    const Plan& plan, int32_t bucket, int64_t direct_min_bytes,
    const std::function<FragmentRoute(const Copy&)>& direct,
    const std::function<void(const Copy&, int64_t shift)>& add_op, int64_t& slot_bytes);

// Where a rank's staging slots live, from where its tensors are and what the
// transport reaches (DESIGN.md "GPU data path"): host tensors use host slots;
// CUDA tensors use device slots when the transport reaches device memory,
// else pinned host slots when it reaches host memory. Checksums are computed
// on the host, so with checksums_gpu on CUDA tensors take pinned slots. `who` ("trainer
// rank 2") and `transport` name the parties of the Errc::unsupported thrown
// when no slot fits (e.g. host tensors over NCCL).
SlotMemory choose_slot_memory(MemoryKind tensors, const Capabilities& caps, const WireOptions& wire,
                              const std::string& who, const std::string& transport);

// How many staging slots a rank's pipeline rotates through, so how many of
// its buckets are in flight at once. Two, unless its slots are small next
// to its buckets (most bytes go straight from tensors or into params, as in
// a colocated 1 -> 1 sync): then as many as fit in the memory two whole
// buckets (`bucket_bytes`, its largest) would take, up to kMaxSlotDepth and
// `buckets`. A sender then does not wait for each receiver's completions
// before its next bucket, and a receiver posts its receives in long runs,
// whose control messages go out together (cuda_ipc batches them).
// Delta sync, broadcast buckets and transports that match in posting order
// on one stream (Capabilities::ordered_only: NCCL) keep two.
inline constexpr std::size_t kMaxSlotDepth = 64;
std::size_t slot_depth(std::size_t slot_bytes, int64_t bucket_bytes, std::size_t buckets,
                       bool broadcast_buckets, const WireOptions& wire, const Capabilities& caps);

// ---- lent buckets (WireOptions::lend) --------------------------------------
//
// Where the transport maps a peer's memory (Capabilities::maps_peer_memory),
// each step begins with every engine rank lending each trainer rank it
// receives lendable buckets from the params those buckets write
// (lent_params, in that order), under lend_tag(step). The trainer rank maps
// them, or declines (its tensors are not in the transport's memory), and an
// engine rank that cannot lend (a param not contiguous or not in that
// memory) lends an empty list. Where the loan was mapped, each lendable
// bucket of the pair is then one copy program on the trainer, from its
// tensors straight into the engine's params (add_pack_apply), and one
// zero-byte message with the bucket's tag once it completed; every other
// bucket travels as fragments. Both sides derive all but the loan's outcome
// from the plan, and both see that outcome (the expose and the map).

// The tag of step `step`'s loans: no bucket's (bucket ids stay below 2^31 - 1).
inline uint64_t lend_tag(int64_t step) noexcept {
  return bucket_tag(step, 0x7FFFFFFF, 0);
}

// Whether buckets may be lent at all: a p2p plan without delta sync or
// checksums on device paths (WireOptions::checksums_on_device), with
// WireOptions::lend, over a transport that maps peer memory.
bool lending_possible(const Plan& plan, const WireOptions& wire, const Capabilities& caps);

// Whether p2p bucket `bucket` may be lent: none of its items is quantized by
// its sender, and each is packed as its HF box.
bool lendable_bucket(const Plan& plan, int32_t bucket);

// The engine params (indices of the rank layout) that `buckets` (lendable
// ones) write, ascending and distinct: what the engine rank lends.
std::vector<int> lent_params(const Plan& plan, const std::vector<int32_t>& buckets);

// The dtype each param of an engine rank (`layout`, of plan template
// `engine_template`) is received in, by layout index: an FP8 weight that the
// engine rank quantizes itself (not Plan::fp8_on_sender) arrives in its
// trainer's dtype, into a staging tensor of that dtype
// (engine_adapter/subscriber_fp8.h), which is also what the rank lends;
// every other param in its own dtype. Both sides of a loan derive its views
// from this.
std::vector<DType> received_dtypes(const Plan& plan, int engine_template,
                                   const EngineRankLayout& layout);

// The seed of fragment `index` of a bucket of `step` (delta frames' digests).
inline uint64_t fragment_seed(int64_t step, uint32_t index) noexcept {
  return static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ULL + index;
}

// The checksum of a bucket of `bytes` bytes of `step` whose packed bytes
// sum to `sums` (core/wire_sum.h); never 0, the trailer's "not computed".
inline uint64_t bucket_checksum(const WireSum& sums, int64_t bytes, int64_t step) noexcept {
  return wire_digest(sums, static_cast<uint64_t>(bytes), static_cast<uint64_t>(step));
}

}  // namespace weightsync
