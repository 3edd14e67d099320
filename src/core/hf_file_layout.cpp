// The file layout of an HF checkpoint written from a trainer layout: keys cut
// into files, files assigned to writer ranks (hf_checkpoint.h).
#include <weightsync/error.h>
#include <weightsync/hf_checkpoint.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <numeric>

namespace weightsync {
namespace {

// A file may make its writer's load this much above an even share.
constexpr double kBalanceSlack = 1.10;

std::vector<HfKey> layout_keys(const TrainerLayout& layout) {
  std::vector<HfKey> keys;
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const LoadSpec& spec = layout.params[p];
    std::vector<Shape> shapes = spec.key_shapes();
    for (size_t k = 0; k < shapes.size(); ++k) {
      const int64_t bytes = numel(shapes[k]) * static_cast<int64_t>(itemsize(spec.dtype));
      keys.push_back(
          {spec.hf_keys[k], std::move(shapes[k]), spec.dtype, bytes, static_cast<int>(p), 0});
    }
  }
  return keys;
}

// Greedy, as save_pretrained shards: a new file once the next key would
// exceed the limit; a key above the limit alone in its file.
std::vector<HfFile> cut_files(std::vector<HfKey>& keys, int64_t max_file_bytes) {
  std::vector<HfFile> files;
  for (size_t k = 0; k < keys.size(); ++k) {
    if (files.empty() ||
        (files.back().num_keys > 0 && files.back().bytes + keys[k].bytes > max_file_bytes))
      files.push_back({"", 0, static_cast<int>(k), 0, 0});
    keys[k].file = static_cast<int>(files.size()) - 1;
    files.back().num_keys += 1;
    files.back().bytes += keys[k].bytes;
  }
  if (files.empty()) files.push_back({"", 0, 0, 0, 0});  // an empty model: one empty file
  for (size_t f = 0; f < files.size(); ++f)
    files[f].name = hf_file_name(static_cast<int>(f), static_cast<int>(files.size()));
  return files;
}

// Bytes of each file that each rank holds whole: local[file * world + rank].
std::vector<int64_t> whole_bytes(const TrainerLayout& layout, const std::vector<HfKey>& keys,
                                 size_t files) {
  const auto world = static_cast<size_t>(layout.mesh.world());
  std::vector<int64_t> local(files * world, 0);
  std::vector<size_t> first_key(layout.params.size() + 1, 0);
  for (size_t p = 0; p < layout.params.size(); ++p)
    first_key[p + 1] = first_key[p] + layout.params[p].hf_keys.size();
  for (size_t p = 0; p < layout.params.size(); ++p) {
    const LoadSpec& spec = layout.params[p];
    for (size_t r = 0; r < world; ++r)
      for (const Piece& piece : local_pieces(spec, layout.mesh, static_cast<int64_t>(r))) {
        const HfKey& key = keys[first_key[p] + static_cast<size_t>(piece.key)];
        if (piece.hf_box.lengths != key.shape || piece.hf_box.empty() ||
            std::any_of(piece.hf_box.offsets.begin(), piece.hf_box.offsets.end(),
                        [](int64_t o) { return o != 0; }))
          continue;
        local[static_cast<size_t>(key.file) * world + r] += key.bytes;
      }
  }
  return local;
}

void assign_writers(std::vector<HfFile>& files, const std::vector<int64_t>& local, int world) {
  auto held = [&](size_t f, int r) {
    return local[f * static_cast<size_t>(world) + static_cast<size_t>(r)];
  };
  // Files some rank holds (partly) whole first, so that their holders still
  // have room for them; then the rest. Largest first within each pass.
  std::vector<size_t> order(files.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::vector<bool> owned(files.size(), false);
  for (size_t f = 0; f < files.size(); ++f)
    for (int r = 0; r < world && !owned[f]; ++r) owned[f] = held(f, r) > 0;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (owned[a] != owned[b]) return static_cast<bool>(owned[a]);
    return files[a].bytes > files[b].bytes;
  });
  int64_t total = 0;
  for (const HfFile& f : files) total += f.bytes;
  const double share = static_cast<double>(total) / world;
  std::vector<int64_t> load(static_cast<size_t>(world), 0);
  for (size_t f : order) {
    const int64_t bytes = files[f].bytes;
    const double cap = std::max(share, static_cast<double>(bytes)) * kBalanceSlack;
    // Better: fits the cap, then holds more, then less loaded, then lower rank.
    auto better = [&](int a, int b) {
      const bool fa = static_cast<double>(load[a] + bytes) <= cap;
      const bool fb = static_cast<double>(load[b] + bytes) <= cap;
      if (fa != fb) return fa;
      if (fa && held(f, a) != held(f, b)) return held(f, a) > held(f, b);
      if (load[a] != load[b]) return load[a] < load[b];
      return held(f, a) > held(f, b);
    };
    int best = 0;
    for (int r = 1; r < world; ++r)
      if (better(r, best)) best = r;
    files[f].writer = best;
    load[static_cast<size_t>(best)] += bytes;
  }
}

}  // namespace

std::string hf_file_name(int index, int count) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", index + 1, count);
  return name;
}

int64_t HfFileLayout::total_bytes() const noexcept {
  int64_t total = 0;
  for (const HfFile& f : files) total += f.bytes;
  return total;
}

std::vector<int> HfFileLayout::files_of(int rank) const {
  std::vector<int> out;
  for (size_t f = 0; f < files.size(); ++f)
    if (files[f].writer == rank) out.push_back(static_cast<int>(f));
  return out;
}

nlohmann::json HfFileLayout::index_json() const {
  // Keys sorted, as transformers writes the index (sort_keys=True).
  nlohmann::json weight_map = nlohmann::json::object();
  for (const HfKey& k : keys) weight_map[k.name] = files[static_cast<size_t>(k.file)].name;
  return {{"metadata", {{"total_size", total_bytes()}}}, {"weight_map", weight_map}};
}

HfFileLayout make_hf_file_layout(const TrainerLayout& layout, int64_t max_file_bytes) {
  if (max_file_bytes <= 0)
    fail(Errc::invalid_argument, "max_file_bytes must be positive, got ", max_file_bytes);
  layout.validate();
  HfFileLayout out;
  out.writers = static_cast<int>(layout.mesh.world());
  out.keys = layout_keys(layout);
  out.files = cut_files(out.keys, max_file_bytes);
  assign_writers(out.files, whole_bytes(layout, out.keys, out.files.size()), out.writers);
  return out;
}

}  // namespace weightsync
