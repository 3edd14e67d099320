// What an engine rank does with one bucket each step (ReceivePipeline
// compiles them once from the plan): receive it and apply it to its
// targets. Delta sync (delta_receiver.h) and lent buckets (lender.h) each
// add their fields.
#pragma once

#include <weightsync/error.h>
#include <weightsync/plan.h>
#include "pipeline/wire.h"

#include "core/copy_program.h"
#include "pipeline/delta_frame.h"

#include <cstdint>
#include <string>
#include <vector>

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
  // Lent buckets (pipeline/wire.h): the loan (Lender's index) that may
  // carry this bucket, or -1.
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

// Errc::internal unless plan item `c` is for engine rank `rank`.
inline void check_item_rank(const Copy& c, int rank) {
  if (c.dst_rank != rank)
    fail(Errc::internal, "engine rank ", rank, ": a bucket for it holds an item for engine rank ",
         c.dst_rank);
}

}  // namespace weightsync::engine
