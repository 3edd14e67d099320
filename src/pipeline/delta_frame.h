// How a p2p bucket travels when delta sync is on (WireOptions::delta): as
// one message, a frame, that says itself whether it carries the bucket's
// bytes or their delta against a version the engine rank holds
// (docs/delta.md).
//
//   header (kFrameHeaderBytes), little-endian:
//     u32 magic "WSDF"   u32 flags (bit 0: delta, bit 1: digest present)
//     i64 step           i64 base (delta: the version it applies to; else -1)
//     u64 digest         checksum64(the bucket's new bytes, seed step)
//   full frame:  the packed bucket (Bucket::bytes), as without delta
//   delta frame: an i64 per item (its encoding's bytes), then the items'
//                encodings (core/delta.h) back to back, in plan order
//   with WireOptions::checksums: an 8-byte trailer, checksum64 of all the
//   frame before it (seed step), as a broadcast bucket carries.
//
// The receiver sizes its slot for the largest frame (frame_capacity), reads
// the kind from the header and checks everything against the plan before it
// writes a byte into a param.
#pragma once

#include <weightsync/plan.h>

#include "core/delta.h"

#include <cstdint>
#include <string>
#include <vector>

namespace weightsync::pipeline {

inline constexpr int64_t kFrameHeaderBytes = 32;

struct FrameHeader {
  bool delta = false;
  bool has_digest = false;
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

// The items of p2p bucket `bucket`, in plan order.
std::vector<FrameItem> frame_items(const Plan& plan, int32_t bucket);

// The largest frame of a bucket of `bucket_bytes` with `items`, without trailer.
int64_t frame_capacity(const std::vector<FrameItem>& items, int64_t bucket_bytes) noexcept;

// Writes the delta frame's table and encodings of `next` (the packed bucket)
// against `base` (what the receiver holds; updated to `next`) at `out` +
// kFrameHeaderBytes; returns the frame's bytes, header included (the header
// itself is the caller's). `stats` sums the items'.
int64_t encode_frame(const std::vector<FrameItem>& items, const char* next, char* base, char* out,
                     delta::EncodeStats* stats = nullptr);

// Applies the delta frame at `frame` (`bytes`, header included, trailer not)
// to `bucket`, which holds the packed bucket at the frame's base version.
// Errc::format naming `what` and the item when the table or an encoding is
// malformed: the table is checked before anything is written, each item's
// encoding before that item is (earlier items may be written by then: apply
// into scratch, as the Subscriber does).
void apply_frame(const std::vector<FrameItem>& items, const char* frame, int64_t bytes,
                 char* bucket, const std::string& what);

}  // namespace weightsync::pipeline
