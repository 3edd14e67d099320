// `weightsync shard`: a trainer rank's local tensors cut straight from an HF
// checkpoint, streamed to a safetensors file through one reusable buffer.
#include <weightsync/box.h>
#include <weightsync/error.h>
#include <weightsync/load_spec.h>
#include <weightsync/safetensors.h>

#include "load_spec_mirror.h"

#include <algorithm>
#include <cstring>

namespace weightsync {
namespace {

// Copies the rows [row_begin, row_end) (dim 0) of the rank's local tensor into
// `dst`, a contiguous buffer of exactly those rows; padding stays as it was.
void copy_local_rows(const Checkpoint& checkpoint, const LoadSpec& spec,
                     const std::vector<Piece>& pieces, const Shape& local, int64_t row_begin,
                     int64_t row_end, void* dst) {
  Shape window_shape = local;
  Box window = Box::full(local);
  if (!local.empty()) {
    window_shape[0] = row_end - row_begin;
    window.offsets[0] = row_begin;
    window.lengths[0] = row_end - row_begin;
  }
  const TensorView dst_view = host_view(dst, spec.dtype, window_shape);
  for (const Piece& piece : pieces) {
    std::optional<Box> part =
        local.empty() ? std::optional<Box>(piece.local_box) : intersect(piece.local_box, window);
    if (!part) continue;
    // A stacked key lacks the local tensor's leading stack dim; copy_box
    // takes boxes that differ by leading length-1 dims.
    copy_box(checkpoint.view(spec.hf_keys[piece.key]),
             hf_sub_box(piece.hf_box, piece.local_box, *part), dst_view, part->relative_to(window));
  }
}

void check_rank(const Mesh& mesh, int64_t rank) {
  if (rank < 0 || rank >= mesh.world())
    fail(Errc::invalid_argument, "rank ", rank, " out of range: the trainer mesh ",
         shape_str(mesh.shape), " has ", mesh.world(), " ranks (0..", mesh.world() - 1, ")");
}

void check_spec_keys(const Checkpoint& checkpoint, const LoadSpec& spec) {
  const std::vector<Shape> shapes = spec.key_shapes();
  for (size_t k = 0; k < spec.hf_keys.size(); ++k) {
    const std::string& key = spec.hf_keys[k];
    const Shape& expected = shapes[k];
    if (!checkpoint.contains(key))
      fail(Errc::not_found, "checkpoint '", checkpoint.path(), "' has no tensor '", key,
           "' (needed by trainer param '", spec.name, "')");
    const TensorInfo& info = checkpoint.info(key);
    if (info.shape != expected)
      fail(Errc::mismatch, "checkpoint tensor '", key, "' has shape ", shape_str(info.shape),
           " but trainer param '", spec.name, "' expects ", shape_str(expected));
    if (info.dtype != spec.dtype)
      fail(Errc::mismatch, "checkpoint tensor '", key, "' has dtype ", dtype_name(info.dtype),
           " but trainer param '", spec.name, "' expects ", dtype_name(spec.dtype));
  }
}

// What fills `spec`'s local tensor: the spec itself, or for a mirror the
// compact spec of the one key it copies (same global shape and shards; the
// key's checkpoint shape as its origin, the rest padding).
LoadSpec content_of(const Checkpoint& checkpoint, const LoadSpec& spec) {
  if (!spec.mirror_of) return spec;
  const std::string& key = *spec.mirror_of;
  if (!checkpoint.contains(key))
    fail(Errc::not_found, "checkpoint '", checkpoint.path(), "' has no tensor '", key,
         "' (mirrored by trainer param '", spec.name, "')");
  return detail::mirror_content(spec, checkpoint.info(key).shape);
}

}  // namespace

LoadSpec detail::mirror_content(const LoadSpec& spec, const Shape& key_shape) {
  if (!spec.mirror_of) return spec;
  if (!Box::full(key_shape).fits(spec.global_shape))
    fail(Errc::mismatch, "checkpoint tensor '", *spec.mirror_of, "' has shape ",
         shape_str(key_shape), ", which does not fit trainer param '", spec.name, "' ",
         shape_str(spec.global_shape), " that mirrors it");
  LoadSpec c = spec;
  c.mirror_of.reset();
  c.segments.reset();
  c.hf_keys = {*spec.mirror_of};
  c.fused_dim.reset();
  c.stack_dim.reset();
  c.origin_shape = key_shape;
  return c;
}

void check_checkpoint(const Checkpoint& checkpoint, const TrainerLayout& layout) {
  for (const LoadSpec& spec : layout.params)
    check_spec_keys(checkpoint, content_of(checkpoint, spec));
}

void fill_local_tensor(const Checkpoint& checkpoint, const LoadSpec& spec, const Mesh& mesh,
                       int64_t rank, const TensorView& dst) {
  check_rank(mesh, rank);
  const Shape local = local_shape(spec, mesh, rank);
  if (dst.shape != local || dst.dtype != spec.dtype || !dst.is_contiguous() ||
      dst.memory != MemoryKind::host)
    fail(Errc::mismatch, "param '", spec.name, "' on rank ", rank, ": destination ",
         dtype_name(dst.dtype), shape_str(dst.shape), " is not a contiguous host tensor of ",
         dtype_name(spec.dtype), shape_str(local));
  const LoadSpec content = content_of(checkpoint, spec);
  check_spec_keys(checkpoint, content);
  if (dst.nbytes() == 0) return;
  std::memset(dst.data, 0, dst.nbytes());
  copy_local_rows(checkpoint, content, local_pieces(content, mesh, rank), local, 0,
                  local.empty() ? 1 : local[0], dst.data);
}

void write_rank_shard(const Checkpoint& checkpoint, const TrainerLayout& layout, int64_t rank,
                      const std::string& out_path, std::size_t buffer_bytes) {
  // Layouts built in code may have skipped validation; pieces rely on it.
  layout.validate();
  check_rank(layout.mesh, rank);
  check_checkpoint(checkpoint, layout);
  // Only the params of the rank's stages: names repeat across stages.
  const std::vector<size_t> held = layout.rank_params(rank);
  std::vector<SafetensorsWriter::Entry> entries;
  entries.reserve(held.size());
  for (size_t p : held) {
    const LoadSpec& spec = layout.params[p];
    entries.push_back({spec.name, spec.dtype, local_shape(spec, layout.mesh, rank)});
  }
  SafetensorsWriter writer(out_path, entries, {{"weightsync.trainer_rank", std::to_string(rank)}});
  std::vector<char> buffer;
  for (size_t i = 0; i < held.size(); ++i) {
    const LoadSpec spec = content_of(checkpoint, layout.params[held[i]]);
    const Shape& local = entries[i].shape;
    if (numel(local) == 0) continue;
    const std::vector<Piece> pieces = local_pieces(spec, layout.mesh, rank);
    const int64_t rows = local.empty() ? 1 : local[0];
    const std::size_t row_bytes =
        static_cast<std::size_t>(numel(local) / rows) * itemsize(spec.dtype);
    const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(buffer_bytes / row_bytes));
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
      const int64_t r1 = std::min(rows, r0 + step);
      const std::size_t bytes = static_cast<std::size_t>(r1 - r0) * row_bytes;
      if (buffer.size() < bytes) buffer.resize(bytes);
      // Padding elements belong to no piece: zero them before the copies.
      std::memset(buffer.data(), 0, bytes);
      copy_local_rows(checkpoint, spec, pieces, local, r0, r1, buffer.data());
      writer.write(buffer.data(), bytes);
    }
  }
  writer.finish();
}

}  // namespace weightsync
