// How a p2p bucket travels when delta sync is on (WireOptions::delta): as
// one message, a frame, that says itself whether it carries the bucket's
// bytes or their delta against a version the engine rank holds
// (docs/delta.md).
//
//   header (kFrameHeaderBytes), little-endian:
//     u32 magic "WSDF"   u32 flags (bit 0: delta, bit 1: digest present,
//                        bit 2: the bucket follows as fragments)
//     i64 step           i64 base (delta: the version it applies to; else -1)
//     u64 digest         frame_digest(the bucket's new bytes, step)
//   full frame:  the packed bucket (Bucket::bytes), as without delta
//   header only (bit 2): nothing more; the bucket's bytes follow as the
//                fragments it travels as without delta (wire.h), same tag,
//                straight from the tensors into the params where they can
//   delta frame: an i64 per item (its encoding's bytes), then the items'
//                encodings (core/delta.h) back to back, in plan order
//   broadcast plans: a bucket goes to every engine rank, and each reads a
//   part of it, so a delta frame with a digest carries, between the header
//   and the table, a u64 per engine template (Plan::engine_templates):
//   reads_digest of what that template's ranks read of the new bucket
//   (the header's digest is 0). Whole bytes go as the header alone, then
//   the bucket as without delta.
//   with WireOptions::checksums: an 8-byte trailer, checksum64 of all the
//   frame before it (seed step), as a broadcast bucket carries.
//
// The receiver sizes its slot for the largest frame (frame_capacity), reads
// the kind from the header and checks everything against the plan before it
// writes a byte into a param.
#pragma once

#include <weightsync/plan.h>
#include <weightsync/tensor.h>

#include "core/delta.h"

#include <cstdint>
#include <string>
#include <vector>

namespace weightsync::pipeline {

inline constexpr int64_t kFrameHeaderBytes = 32;

struct FrameHeader {
  bool delta = false;
  bool has_digest = false;
  bool fragments = false;  // the header alone; the bucket follows as fragments
  int64_t step = 0;
  int64_t base = -1;
  uint64_t digest = 0;
};

void store_frame_header(char* at, const FrameHeader& h) noexcept;
// Errc::format naming `what` ("bucket 3 from trainer rank 1") when the
// message is shorter than a header or is not a frame.
FrameHeader read_frame_header(const char* at, int64_t bytes, const std::string& what);

// One item of a bucket as the delta codec sees it: its packed bytes at
// `offset` of the bucket, compared element by element (the engine dtype's
// size; bytes for items quantized by their sender, codes and scales).
struct FrameItem {
  int64_t offset = 0;
  int64_t bytes = 0;
  int element_bytes = 1;
  int64_t elements() const noexcept { return bytes / element_bytes; }
};

// Where `box` of `tensor` lies as one dense run of its memory (so that an
// item is patched in place); nullptr when it does not. host_run: only in
// host memory (so that the CPU diffs or patches it).
char* dense_run(const TensorView& tensor, const Box& box);
char* host_run(const TensorView& tensor, const Box& box);

// The items of p2p bucket `bucket`, in plan order.
std::vector<FrameItem> frame_items(const Plan& plan, int32_t bucket);

// The largest frame of a bucket of `bucket_bytes` with `items`, without trailer.
int64_t frame_capacity(const std::vector<FrameItem>& items, int64_t bucket_bytes) noexcept;

// Writes the delta frame's table and encodings of the items' new bytes
// (`next[i]`, item i's packed bytes wherever they lie) against `base` (the
// packed bucket the receiver holds; updated to the new bytes) at `out` +
// kFrameHeaderBytes; returns the frame's bytes, header included (the header
// itself is the caller's). `stats` sums the items'. With `digest`, the new
// bytes' frame_digest for `step` goes there, hashed while the encoder has
// them in cache.
int64_t encode_frame(const std::vector<FrameItem>& items, const char* const* next, char* base,
                     char* out, delta::EncodeStats* stats = nullptr, int64_t step = 0,
                     uint64_t* digest = nullptr);

// About the bytes encode_frame would return, header aside, from samples of
// each item (delta::estimate_encoded_bytes), reading 1/64 of the bytes.
int64_t estimate_frame(const std::vector<FrameItem>& items, const char* const* next,
                       const char* base);

// Applies the delta frame at `frame` (`bytes`, header included, trailer not)
// to the items' bytes at the frame's base version, item i at `targets[i]`
// (wherever it lies: a param, or a scratch bucket). Checks the table and
// every encoding before it writes anything: Errc::format naming `what` and
// the item when one is malformed. With `digest`, the frame_digest for
// `step` of the targets after the patch goes there (hashed as they are
// patched, while in cache). With `changed`, item i's entry says whether its
// encoding changed any element (delta::unchanged_bytes).
void apply_frame(const std::vector<FrameItem>& items, const char* frame, int64_t bytes,
                 char* const* targets, const std::string& what, int64_t step = 0,
                 uint64_t* digest = nullptr, std::vector<bool>* changed = nullptr);

// The tables that apply a delta frame where the CPU does not reach the
// targets (a GPU's params; cuda/delta_kernel.cu runs them): the frame is
// checked as apply_frame checks it (the same errors), item i's target lies
// at address targets[i] of the target memory, the patch reads the frame at
// its offsets, and with `digest` the hash table gives frame_digest's value
// for `step`. `changed` as apply_frame. After an error the tables are to be
// discarded (nothing was run).
struct FrameTables {
  std::vector<delta::PatchChunk> patch;
  std::vector<delta::HashChunk> hash;
};
void frame_tables(const std::vector<FrameItem>& items, const char* frame, int64_t bytes,
                  const int64_t* targets, const std::string& what, int64_t step, bool digest,
                  FrameTables& out, std::vector<bool>* changed = nullptr);

// Broadcast plans: one apply item of an engine template as the digest sees
// it: the part `hf_box` of the row-major view `view_box` packed at
// `offset` of the bucket.
struct ReadBox {
  int64_t offset = 0;
  int element_bytes = 1;
  Box view_box;
  Box hf_box;
};

// What the engine ranks of template `engine_template` read of broadcast
// bucket `bucket`: its apply items, in plan order.
std::vector<ReadBox> template_reads(const Plan& plan, int32_t bucket, int engine_template);

// The digest of `reads` of the bucket packed at `packed` for `step`: the
// fold of each read's checksum64 (its elements in row-major order, seed
// fragment_seed(step, i)). The sender hashes the new bucket, the engine its
// rebuilt copy: equal only where every byte the engine applies is the
// sender's.
uint64_t reads_digest(const std::vector<ReadBox>& reads, const char* packed, int64_t step);

// The digest of a bucket of `step` whose item i holds the bytes at
// `data[i]`: the fold of each item's delta::digest (seed fragment_seed(step,
// i)), the sum of its chunks' checksum64.
uint64_t frame_digest(const std::vector<FrameItem>& items, const char* const* data, int64_t step);

}  // namespace weightsync::pipeline
