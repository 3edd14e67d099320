// First-fit placement of byte ranges that are alive over intervals of time
// (bucket indices): the arenas of the load_weights delivery (engine side)
// and of the HF save's writers (trainer side).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace weightsync::detail {

// `id` indexes the caller's offsets; the span is alive from `first` to `last`
// (inclusive) and takes `bytes`.
struct LiveSpan {
  size_t id = 0;
  int64_t first = 0, last = 0, bytes = 0;
};

// In order of start (then id), each span takes the lowest offset that no span
// still alive at its start holds; writes offset[id] and returns the arena's
// size.
int64_t place_first_fit(std::vector<LiveSpan> spans, std::vector<int64_t>& offset);

}  // namespace weightsync::detail
