// Filling a trainer rank's local tensors from an HF checkpoint: the read
// items of a distributed load (DCP's load planner, in HF space), each piece
// of the rank copied straight out of the mapped file, in file order.
#include <weightsync/box.h>
#include <weightsync/error.h>
#include <weightsync/hf_checkpoint.h>
#include <weightsync/safetensors.h>

#include "load_spec_mirror.h"

#include <algorithm>
#include <chrono>
#include <map>

namespace weightsync {
namespace {

// key -> (file index in checkpoint.files(), its info there).
std::map<std::string, std::pair<size_t, const TensorInfo*>, std::less<>> index_keys(
    const Checkpoint& checkpoint) {
  std::map<std::string, std::pair<size_t, const TensorInfo*>, std::less<>> out;
  const auto& files = checkpoint.files();
  for (size_t f = 0; f < files.size(); ++f)
    for (const TensorInfo& t : files[f]->tensors()) out.emplace(t.name, std::make_pair(f, &t));
  return out;
}

using KeyIndex = std::map<std::string, std::pair<size_t, const TensorInfo*>, std::less<>>;

// What fills each param: itself, or for a mirror the compact spec of its key.
std::vector<LoadSpec> contents(const Checkpoint& checkpoint, const TrainerLayout& layout,
                               int64_t rank, const KeyIndex& where) {
  std::vector<LoadSpec> out;
  out.reserve(layout.params.size());
  for (const LoadSpec& spec : layout.params) {
    if (!spec.mirror_of) {
      out.push_back(spec);
      continue;
    }
    auto it = where.find(*spec.mirror_of);
    if (it == where.end())
      fail(Errc::not_found, "trainer rank ", rank, ": checkpoint '", checkpoint.path(),
           "' has no tensor '", *spec.mirror_of, "' (mirrored by param '", spec.name, "')");
    out.push_back(detail::mirror_content(spec, it->second.second->shape));
  }
  return out;
}

void check_keys(const Checkpoint& checkpoint, const std::vector<LoadSpec>& specs, int64_t rank,
                const KeyIndex& where) {
  for (const LoadSpec& spec : specs) {
    const std::vector<Shape> shapes = spec.key_shapes();
    for (size_t k = 0; k < spec.hf_keys.size(); ++k) {
      const std::string& key = spec.hf_keys[k];
      const Shape& expected = shapes[k];
      auto it = where.find(key);
      if (it == where.end())
        fail(Errc::not_found, "trainer rank ", rank, ": checkpoint '", checkpoint.path(),
             "' has no tensor '", key, "' (needed by param '", spec.name, "')");
      const TensorInfo& info = *it->second.second;
      const std::string& file = checkpoint.files()[it->second.first]->path();
      if (info.dtype != spec.dtype)
        fail(Errc::mismatch, "trainer rank ", rank, ": tensor '", key, "' in ", file, " is ",
             dtype_name(info.dtype), " but param '", spec.name, "' expects ",
             dtype_name(spec.dtype));
      if (info.shape != expected)
        fail(Errc::mismatch, "trainer rank ", rank, ": tensor '", key, "' in ", file, " has shape ",
             shape_str(info.shape), " but param '", spec.name, "' expects ", shape_str(expected));
    }
  }
}

void check_tensors(const TrainerLayout& layout, int64_t rank,
                   const std::vector<TensorView>& tensors) {
  if (tensors.size() != layout.params.size())
    fail(Errc::invalid_argument, "trainer rank ", rank, ": ", tensors.size(),
         " tensors for a layout of ", layout.params.size(), " params");
  for (size_t p = 0; p < tensors.size(); ++p) {
    const LoadSpec& spec = layout.params[p];
    if (!holds(spec, layout.mesh, rank)) continue;  // another stage's: nothing to fill
    const Shape local = local_shape(spec, layout.mesh, rank);
    const TensorView& t = tensors[p];
    if (t.dtype != spec.dtype || t.shape != local)
      fail(Errc::mismatch, "trainer rank ", rank, ": param '", spec.name, "' is ",
           dtype_name(t.dtype), shape_str(t.shape), " but its local shard is ",
           dtype_name(spec.dtype), shape_str(local));
    if (!t.data && t.numel() > 0)
      fail(Errc::invalid_argument, "trainer rank ", rank, ": param '", spec.name,
           "' has a null pointer");
  }
}

// Padding belongs to no key: zero the whole tensor before the pieces land.
void zero(const TensorView& t) {
  if (t.numel() == 0) return;
  std::vector<char> zeros(t.nbytes(), 0);
  const Box all = Box::full(t.shape);
  copy_box(host_view(zeros.data(), t.dtype, t.shape), all, t, all);
}

struct ReadItem {
  size_t file = 0;
  uint64_t begin = 0;  // the key's data offset in its file
  size_t param = 0;
  Piece piece;
};

}  // namespace

void check_hf_checkpoint(const Checkpoint& checkpoint, const TrainerLayout& layout, int64_t rank) {
  const KeyIndex where = index_keys(checkpoint);
  check_keys(checkpoint, contents(checkpoint, layout, rank, where), rank, where);
}

LoadReport load_local_tensors(const Checkpoint& checkpoint, const TrainerLayout& layout,
                              int64_t rank, const std::vector<TensorView>& tensors) {
  const auto start = std::chrono::steady_clock::now();
  layout.validate();
  if (rank < 0 || rank >= layout.mesh.world())
    fail(Errc::invalid_argument, "rank ", rank, " outside the trainer mesh ",
         shape_str(layout.mesh.shape));
  check_tensors(layout, rank, tensors);
  const KeyIndex where = index_keys(checkpoint);
  const std::vector<LoadSpec> specs = contents(checkpoint, layout, rank, where);
  check_keys(checkpoint, specs, rank, where);
  std::vector<ReadItem> items;
  for (size_t p = 0; p < specs.size(); ++p) {
    const LoadSpec& spec = specs[p];
    if (!holds(spec, layout.mesh, rank)) continue;
    if (spec.has_padding()) zero(tensors[p]);
    for (Piece& piece : local_pieces(spec, layout.mesh, rank)) {
      if (piece.hf_box.empty()) continue;
      const auto& [file, info] = where.find(spec.hf_keys[static_cast<size_t>(piece.key)])->second;
      items.push_back({file, info->begin, p, std::move(piece)});
    }
  }
  // One pass over the files, each front to back (the page cache reads ahead).
  std::sort(items.begin(), items.end(), [](const ReadItem& a, const ReadItem& b) {
    if (a.file != b.file) return a.file < b.file;
    if (a.begin != b.begin) return a.begin < b.begin;
    return a.piece.hf_box.offsets < b.piece.hf_box.offsets;
  });
  LoadReport report;
  std::vector<bool> touched(checkpoint.files().size(), false);
  for (const ReadItem& item : items) {
    const LoadSpec& spec = specs[item.param];
    const std::string& key = spec.hf_keys[static_cast<size_t>(item.piece.key)];
    copy_box(checkpoint.files()[item.file]->view(key), item.piece.hf_box, tensors[item.param],
             item.piece.local_box);
    report.bytes += static_cast<uint64_t>(item.piece.hf_box.numel()) * itemsize(spec.dtype);
    ++report.pieces;
    touched[item.file] = true;
  }
  report.files = static_cast<size_t>(std::count(touched.begin(), touched.end(), true));
  report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace weightsync
