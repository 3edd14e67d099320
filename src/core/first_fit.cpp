#include "first_fit.h"

#include <algorithm>

namespace weightsync::detail {

int64_t place_first_fit(std::vector<LiveSpan> spans, std::vector<int64_t>& offset) {
  std::sort(spans.begin(), spans.end(), [](const LiveSpan& a, const LiveSpan& b) {
    return a.first != b.first ? a.first < b.first : a.id < b.id;
  });
  struct Live {
    int64_t last, at, bytes;
  };
  std::vector<Live> live;
  int64_t arena = 0;
  for (const LiveSpan& s : spans) {
    std::erase_if(live, [&](const Live& l) { return l.last < s.first; });
    std::sort(live.begin(), live.end(), [](const Live& a, const Live& b) { return a.at < b.at; });
    int64_t at = 0;
    for (const Live& l : live) {
      if (at + s.bytes <= l.at) break;
      at = std::max(at, l.at + l.bytes);
    }
    offset[s.id] = at;
    live.push_back({s.last, at, s.bytes});
    arena = std::max(arena, at + s.bytes);
  }
  return arena;
}

}  // namespace weightsync::detail
