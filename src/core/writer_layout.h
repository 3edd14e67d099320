// The writer layout of a distributed HF save (Publisher::save_hf): the file
// layout (hf_checkpoint.h) plus what the planner needs to move the bytes.
//
// Each writer rank writes its files' keys in order. What it holds itself it
// copies from its own shards; only the rest (its "remote parts": each key's
// box minus the writer's own pieces of it) is planned. A writer's remote
// parts, in writing order, are cut into windows of at most `window_bytes`
// (along dim 0 of a part; at least one row), and every window is one engine
// rank of the plan (an "hf" group of one replica, tp = windows): so a
// bucket, which belongs to one link, never spans two windows, and a writer
// that receives window by window holds only a few windows of keys at once,
// whatever the layout. Not installed.
#pragma once

#include <weightsync/engine_layout.h>
#include <weightsync/hf_checkpoint.h>
#include <weightsync/load_spec.h>

#include <cstdint>
#include <vector>

namespace weightsync {

// The part of `a` outside `b`, as disjoint boxes (at most 2 per dim).
std::vector<Box> subtract_box(const Box& a, const Box& b);

// A piece of a key that the key's writer holds in its own local tensor.
struct LocalPart {
  int param = 0;  // TrainerLayout::params index
  Box hf_box;     // in the key
  Box local_box;  // in the writer's local tensor of `param` (stack dim included)
};

struct WriterPart {
  int key = 0;  // HfFileLayout::keys index
  Box box;      // in the key
};

struct WriterWindow {
  int writer = 0;
  int index = 0;  // among its writer's windows, in writing order
  std::vector<WriterPart> parts;
  int64_t bytes = 0;
};

struct WriterLayout {
  HfFileLayout files;
  std::vector<std::vector<LocalPart>> local;    // by key: its writer's own pieces
  std::vector<std::vector<WriterPart>> remote;  // by key: what comes from other ranks
  std::vector<WriterWindow> windows;            // plan engine rank g = windows[g]
  EngineLayout engine;                          // empty (no group) when no window

  int writer_of(int key) const {
    return files.files[static_cast<size_t>(files.keys[static_cast<size_t>(key)].file)].writer;
  }
  // The keys rank `rank` writes, in writing order (its files in order).
  std::vector<int> stream_of(int rank) const;
};

// Errc::invalid_argument for max_file_bytes or window_bytes <= 0.
WriterLayout make_writer_layout(const TrainerLayout& layout, int64_t max_file_bytes,
                                int64_t window_bytes);

}  // namespace weightsync
