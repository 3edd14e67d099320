#include "core/writer_layout.h"

#include <weightsync/error.h>

#include <algorithm>
#include <map>

namespace weightsync {
namespace {

bool box_less(const Box& a, const Box& b) {
  return a.offsets != b.offsets ? a.offsets < b.offsets : a.lengths < b.lengths;
}

// Each key's writer's own pieces of it.
std::vector<std::vector<LocalPart>> local_parts(const TrainerLayout& layout,
                                                const WriterLayout& wl) {
  std::vector<std::vector<LocalPart>> out(wl.files.keys.size());
  int first_key = 0;
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const LoadSpec& spec = layout.params[p];
    const int keys = static_cast<int>(spec.hf_keys.size());
    std::vector<int> writers;
    for (int k = first_key; k < first_key + keys; ++k) writers.push_back(wl.writer_of(k));
    std::sort(writers.begin(), writers.end());
    writers.erase(std::unique(writers.begin(), writers.end()), writers.end());
    for (int w : writers)
      for (Piece& piece : local_pieces(spec, layout.mesh, w)) {
        const int key = first_key + piece.key;
        if (wl.writer_of(key) != w || piece.hf_box.empty()) continue;
        out[static_cast<size_t>(key)].push_back(
            {static_cast<int>(p), std::move(piece.hf_box), std::move(piece.local_box)});
      }
    first_key += keys;
  }
  return out;
}

std::vector<WriterPart> remote_parts(int key, const Shape& shape,
                                     const std::vector<LocalPart>& local) {
  std::vector<Box> rest;
  if (numel(shape) > 0) rest.push_back(Box::full(shape));
  for (const LocalPart& l : local) {
    std::vector<Box> next;
    for (const Box& r : rest)
      for (Box& b : subtract_box(r, l.hf_box)) next.push_back(std::move(b));
    rest = std::move(next);
  }
  std::sort(rest.begin(), rest.end(), box_less);
  std::vector<WriterPart> out;
  for (Box& b : rest) out.push_back({key, std::move(b)});
  return out;
}

// Cuts one writer's remote parts, in writing order, into windows.
void cut_windows(WriterLayout& wl, int writer, int64_t window_bytes) {
  WriterWindow open{writer, 0, {}, 0};
  auto close = [&] {
    if (open.parts.empty()) return;
    wl.windows.push_back(std::move(open));
    open = WriterWindow{writer, wl.windows.back().index + 1, {}, 0};
  };
  for (int key : wl.stream_of(writer)) {
    const int64_t item =
        static_cast<int64_t>(itemsize(wl.files.keys[static_cast<size_t>(key)].dtype));
    for (const WriterPart& part : wl.remote[static_cast<size_t>(key)]) {
      const Box& box = part.box;
      const int64_t rows = box.rank() == 0 ? 1 : box.lengths[0];
      const int64_t row_bytes = box.numel() / rows * item;
      for (int64_t done = 0; done < rows;) {
        if (open.bytes > 0 && open.bytes + row_bytes > window_bytes) close();
        const int64_t room = (window_bytes - open.bytes) / row_bytes;
        const int64_t take = std::clamp<int64_t>(room, 1, rows - done);
        Box slab = box;
        if (box.rank() > 0) {
          slab.offsets[0] += done;
          slab.lengths[0] = take;
        }
        open.parts.push_back({key, std::move(slab)});
        open.bytes += take * row_bytes;
        done += take;
      }
    }
  }
  close();
}

// One "hf" group of one replica whose ranks are the windows: rank g holds
// the parts of window g, each a param of the part's shape.
EngineLayout windows_engine(const WriterLayout& wl) {
  EngineLayout out;
  if (wl.windows.empty()) return out;
  EngineConfig config;
  config.framework = "hf";
  config.tp = static_cast<int>(wl.windows.size());
  config.replicas = 1;
  out.config = config;
  out.groups = {{config, 0, 0, 0}};
  for (size_t g = 0; g < wl.windows.size(); ++g) {
    EngineRankLayout rank;
    rank.rank = static_cast<int>(g);
    for (const WriterPart& part : wl.windows[g].parts) {
      const HfKey& key = wl.files.keys[static_cast<size_t>(part.key)];
      const Box whole = Box::full(part.box.lengths);
      rank.params.push_back({cat(key.name, box_str(part.box)),
                             key.dtype,
                             part.box.lengths,
                             {{key.name, part.box, whole, false}}});
    }
    out.ranks.push_back(std::move(rank));
  }
  return out;
}

}  // namespace

std::vector<Box> subtract_box(const Box& a, const Box& b) {
  const auto cut = intersect(a, b);
  if (!cut) return {a};
  std::vector<Box> out;
  Box rest = a;
  // Peel off what lies below and above the cut along each dim in turn; what
  // remains after the last dim is the cut itself.
  for (size_t d = 0; d < a.rank(); ++d) {
    if (rest.offsets[d] < cut->offsets[d]) {
      Box below = rest;
      below.lengths[d] = cut->offsets[d] - rest.offsets[d];
      out.push_back(std::move(below));
    }
    if (cut->end(d) < rest.end(d)) {
      Box above = rest;
      above.offsets[d] = cut->end(d);
      above.lengths[d] = rest.end(d) - cut->end(d);
      out.push_back(std::move(above));
    }
    rest.offsets[d] = cut->offsets[d];
    rest.lengths[d] = cut->lengths[d];
  }
  return out;
}

std::vector<int> WriterLayout::stream_of(int rank) const {
  std::vector<int> out;
  for (int f : files.files_of(rank)) {
    const HfFile& file = files.files[static_cast<size_t>(f)];
    for (int k = file.first_key; k < file.first_key + file.num_keys; ++k) out.push_back(k);
  }
  return out;
}

WriterLayout make_writer_layout(const TrainerLayout& layout, int64_t max_file_bytes,
                                int64_t window_bytes) {
  if (window_bytes <= 0)
    fail(Errc::invalid_argument, "window_bytes must be positive, got ", window_bytes);
  WriterLayout wl;
  wl.files = make_hf_file_layout(layout, max_file_bytes);
  wl.local = local_parts(layout, wl);
  for (size_t k = 0; k < wl.files.keys.size(); ++k)
    wl.remote.push_back(remote_parts(static_cast<int>(k), wl.files.keys[k].shape, wl.local[k]));
  for (int w = 0; w < wl.files.writers; ++w) cut_windows(wl, w, window_bytes);
  wl.engine = windows_engine(wl);
  return wl;
}

}  // namespace weightsync
