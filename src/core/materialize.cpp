// Materialize: an engine rank's parameters built straight from a checkpoint,
// the reference that every sync must reproduce byte for byte.
#include <weightsync/error.h>
#include <weightsync/materialize.h>
#include <weightsync/safetensors.h>

#include "core/fp8.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>

namespace weightsync {
namespace {

// The checkpoint view of `s.hf_key` seen in the parameter's orientation: the
// leading length-1 expert dims added and the last two dims swapped when the
// segment transposes. `box` (a box of hf coordinates) is converted alike.
TensorView oriented_view(const Checkpoint& ckpt, const Segment& s, Box& box) {
  TensorView v = ckpt.view(s.hf_key);
  const size_t extra = s.param_box.rank() - s.hf_box.rank();
  if (extra > 0) {
    v.strides = v.effective_strides();
    v.shape.insert(v.shape.begin(), extra, 1);
    v.strides.insert(v.strides.begin(), extra, 0);
    box.offsets.insert(box.offsets.begin(), extra, 0);
    box.lengths.insert(box.lengths.begin(), extra, 1);
  }
  if (s.transpose) {
    const int r = static_cast<int>(v.shape.size());
    v = transposed(v, r - 2, r - 1);
    std::swap(box.offsets[r - 2], box.offsets[r - 1]);
    std::swap(box.lengths[r - 2], box.lengths[r - 1]);
  }
  return v;
}

void check_segment_source(const Checkpoint& ckpt, const EngineParam& p, const Segment& s) {
  if (!ckpt.contains(s.hf_key))
    fail(Errc::not_found, "checkpoint '", ckpt.path(), "' has no tensor '", s.hf_key,
         "' (needed by engine param '", p.name, "')");
  const TensorInfo& info = ckpt.info(s.hf_key);
  if (p.quant && !fp8::quantizable_source(info.dtype))
    fail(Errc::mismatch, "checkpoint tensor '", s.hf_key, "' is ", dtype_name(info.dtype),
         "; FP8 engine param '", p.name, "' quantizes BF16, F16 or F32 weights");
  if (!p.quant && info.dtype != p.dtype)
    fail(Errc::mismatch, "checkpoint tensor '", s.hf_key, "' is ", dtype_name(info.dtype),
         ", engine param '", p.name, "' is ", dtype_name(p.dtype), " (no dtype conversion)");
  if (!s.hf_box.fits(info.shape))
    fail(Errc::mismatch, "checkpoint tensor '", s.hf_key, "' has shape ", shape_str(info.shape),
         ", too small for box ", box_str(s.hf_box), " of engine param '", p.name, "'");
}

// Copies the part of every segment inside `window` (a box of the parameter)
// into `dst`, a contiguous tensor of window.lengths in `dtype` (the param's;
// the checkpoint's for a quantized weight); zero-fills first unless the
// segments write the whole window.
void fill_window(const Checkpoint& ckpt, const EngineParam& p, const Box& window, DType dtype,
                 void* dst) {
  const TensorView out = host_view(dst, dtype, window.lengths);
  std::vector<std::pair<const Segment*, Box>> parts;
  int64_t written = 0;
  for (const auto& s : p.segments) {
    auto part = intersect(s.param_box, window);
    if (!part) continue;
    written += part->numel();
    parts.emplace_back(&s, *part);
  }
  if (written < window.numel()) std::memset(dst, 0, out.nbytes());
  for (const auto& [s, part] : parts) {
    Box src_box = segment_hf_sub_box(*s, part);
    const TensorView src = oriented_view(ckpt, *s, src_box);
    copy_box(src, src_box, out, part.relative_to(window));
  }
}

// A box that is one contiguous run of a row-major tensor of `shape`: ones,
// then any length, then full dims. Returns its first element, or -1.
int64_t run_start(const Box& box, const Shape& shape) {
  size_t d = 0;
  while (d < box.rank() && box.lengths[d] == 1) ++d;
  for (size_t k = d + 1; k < box.rank(); ++k)
    if (box.offsets[k] != 0 || box.lengths[k] != shape[k]) return -1;
  const Shape strides = contiguous_strides(shape);
  int64_t start = 0;
  for (size_t k = 0; k < box.rank(); ++k) start += box.offsets[k] * strides[k];
  return start;
}

struct Run {
  int64_t dst_start;  // in elements of the parameter
  const char* src;
  int64_t count;
};

// The parameter as contiguous runs from the checkpoint's mapping (gaps are
// zero padding), when every segment is one contiguous run on both sides.
bool direct_runs(const Checkpoint& ckpt, const EngineParam& p, std::vector<Run>& runs) {
  runs.clear();
  const size_t item = itemsize(p.dtype);
  for (const auto& s : p.segments) {
    if (s.transpose || s.param_box.empty()) {
      if (s.transpose) return false;
      continue;
    }
    const TensorView v = ckpt.view(s.hf_key);
    const int64_t dst = run_start(s.param_box, p.shape);
    const int64_t src = run_start(s.hf_box, v.shape);
    if (dst < 0 || src < 0 || !v.is_contiguous()) return false;
    runs.push_back({dst, static_cast<const char*>(v.data) + src * item, s.param_box.numel()});
  }
  std::sort(runs.begin(), runs.end(),
            [](const Run& a, const Run& b) { return a.dst_start < b.dst_start; });
  return true;
}

constexpr size_t kBufferBytes = 16u << 20;

// The dtype a quantized weight's segments hold in the checkpoint (one for
// all of them: the quantizer reads one source dtype per block).
DType source_dtype(const Checkpoint& ckpt, const EngineParam& w) {
  if (w.segments.empty()) return DType::BF16;
  const DType d = ckpt.info(w.segments.front().hf_key).dtype;
  for (const auto& s : w.segments)
    if (ckpt.info(s.hf_key).dtype != d)
      fail(Errc::mismatch, "FP8 engine param '", w.name, "': checkpoint tensors '",
           w.segments.front().hf_key, "' and '", s.hf_key, "' differ in dtype");
  return d;
}

// A quantized weight, band by band in row-major order: each band is one
// block row (up to 128 rows) of one 2-D slice (leading dims fixed), filled
// from the checkpoint and quantized; `sink(q, q_bytes, scales, n_scales)`
// gets its FP8 bytes and its block scales, which follow one another in the
// weight's and the scale param's row-major orders.
template <class Sink>
void quantize_bands(const Checkpoint& ckpt, const EngineParam& w, Sink sink) {
  const size_t n = w.shape.size();
  const int64_t rows = w.shape[n - 2], cols = w.shape[n - 1];
  const int64_t slices = rows * cols > 0 ? numel(w.shape) / (rows * cols) : 0;
  const DType src = source_dtype(ckpt, w);
  const int64_t nb = (cols + fp8::kBlock - 1) / fp8::kBlock;
  std::vector<char> band(static_cast<size_t>(fp8::kBlock * cols) * itemsize(src));
  std::vector<uint8_t> q(static_cast<size_t>(fp8::kBlock * cols));
  std::vector<float> scales(static_cast<size_t>(nb));
  for (int64_t i = 0; i < slices; ++i) {
    Box window = Box::full(w.shape);
    for (size_t d = n - 2, rest = static_cast<size_t>(i); d-- > 0; rest /= w.shape[d]) {
      window.offsets[d] = static_cast<int64_t>(rest) % w.shape[d];
      window.lengths[d] = 1;
    }
    for (int64_t r0 = 0; r0 < rows; r0 += fp8::kBlock) {
      window.offsets[n - 2] = r0;
      window.lengths[n - 2] = std::min(fp8::kBlock, rows - r0);
      fill_window(ckpt, w, window, src, band.data());
      fp8::quantize_tensor(band.data(), src, window.lengths[n - 2], cols, w.quant->scale, q.data(),
                           scales.data());
      sink(q.data(), window.lengths[n - 2] * cols, scales.data(), nb);
    }
  }
}

class RankWriter {
 public:
  RankWriter(const Checkpoint& ckpt, SafetensorsWriter& out) : ckpt_(ckpt), out_(out) {}

  // Params in layout order: a quantized weight's scales are kept for its
  // scale param, which follows it.
  void write_param(const EngineParam& p) {
    if (p.quant) return write_quantized(p);
    if (p.scale_of >= 0) {
      out_.write(scales_.data(), scales_.size() * sizeof(float));
      scales_.clear();
      return;
    }
    const int64_t item = static_cast<int64_t>(itemsize(p.dtype));
    if (direct_runs(ckpt_, p, runs_)) {
      int64_t at = 0;
      for (const auto& r : runs_) {
        zeros(r.dst_start - at, item);
        out_.write(r.src, static_cast<size_t>(r.count * item));
        at = r.dst_start + r.count;
      }
      zeros(numel(p.shape) - at, item);
      return;
    }
    // Windows of whole dim-0 rows, as many as fit the buffer (at least one).
    const int64_t rows = p.shape.empty() ? 1 : p.shape[0];
    const int64_t row_bytes =
        (p.shape.empty() ? 1 : numel(p.shape) / std::max<int64_t>(rows, 1)) * item;
    const int64_t per =
        std::max<int64_t>(1, static_cast<int64_t>(kBufferBytes) / std::max<int64_t>(row_bytes, 1));
    if (buffer_.size() < static_cast<size_t>(per * row_bytes)) buffer_.resize(per * row_bytes);
    for (int64_t r0 = 0; r0 < rows; r0 += per) {
      Box window = Box::full(p.shape);
      if (!p.shape.empty()) {
        window.offsets[0] = r0;
        window.lengths[0] = std::min(per, rows - r0);
      }
      fill_window(ckpt_, p, window, p.dtype, buffer_.data());
      out_.write(buffer_.data(), static_cast<size_t>(window.numel() * item));
    }
  }

 private:
  void write_quantized(const EngineParam& w) {
    scales_.clear();
    quantize_bands(ckpt_, w, [&](const uint8_t* q, int64_t bytes, const float* s, int64_t n) {
      out_.write(q, static_cast<size_t>(bytes));
      scales_.insert(scales_.end(), s, s + n);
    });
  }

  void zeros(int64_t count, int64_t item) {
    if (count <= 0) return;
    if (zero_.empty()) zero_.assign(kBufferBytes, 0);
    for (int64_t left = count * item; left > 0;) {
      const int64_t n = std::min<int64_t>(left, static_cast<int64_t>(zero_.size()));
      out_.write(zero_.data(), static_cast<size_t>(n));
      left -= n;
    }
  }

  const Checkpoint& ckpt_;
  SafetensorsWriter& out_;
  std::vector<Run> runs_;
  std::vector<char> buffer_, zero_;
  std::vector<float> scales_;
};

}  // namespace

void check_checkpoint(const Checkpoint& ckpt, const EngineLayout& layout, int rank) {
  std::map<std::string, Shape, std::less<>> expected;
  for (const auto& t : engine_hf_tensors(layout.group_of(rank).config))
    expected.emplace(t.key, t.shape);
  std::set<std::string_view> seen;
  for (const auto& p : layout.rank_layout(rank).params) {
    for (const auto& s : p.segments) {
      if (!seen.insert(s.hf_key).second) continue;
      check_segment_source(ckpt, p, s);
      const Shape& have = ckpt.info(s.hf_key).shape;
      auto it = expected.find(s.hf_key);
      if (it != expected.end() && it->second != have)
        fail(Errc::mismatch, "checkpoint tensor '", s.hf_key, "' has shape ", shape_str(have),
             ", the model config says ", shape_str(it->second));
    }
  }
}

void fill_param(const Checkpoint& ckpt, const EngineParam& p, void* dst) {
  if (p.quant || p.scale_of >= 0)
    fail(Errc::invalid_argument, "fill_param: FP8 param '", p.name,
         "' needs its rank layout (fill_param(checkpoint, rank, index, dst))");
  for (const auto& s : p.segments) check_segment_source(ckpt, p, s);
  fill_window(ckpt, p, Box::full(p.shape), p.dtype, dst);
}

void fill_param(const Checkpoint& ckpt, const EngineRankLayout& rank, size_t index, void* dst) {
  const EngineParam& p = rank.params.at(index);
  if (!p.quant && p.scale_of < 0) return fill_param(ckpt, p, dst);
  const EngineParam& w = p.quant ? p : rank.params.at(static_cast<size_t>(p.scale_of));
  for (const auto& s : w.segments) check_segment_source(ckpt, w, s);
  auto* q_out = static_cast<uint8_t*>(dst);
  auto* s_out = static_cast<float*>(dst);
  quantize_bands(ckpt, w, [&](const uint8_t* q, int64_t bytes, const float* s, int64_t n) {
    if (p.quant) {
      std::memcpy(q_out, q, static_cast<size_t>(bytes));
      q_out += bytes;
    } else {
      std::memcpy(s_out, s, static_cast<size_t>(n) * sizeof(float));
      s_out += n;
    }
  });
}

uint64_t materialize(const Checkpoint& ckpt, const EngineLayout& layout, int rank,
                     const std::string& out_path) {
  if (rank < 0 || rank >= layout.world())
    fail(Errc::invalid_argument, "materialize: rank ", rank, " is outside the engine's ",
         layout.world(), " ranks (", layout.num_replicas(), " replicas)");
  check_checkpoint(ckpt, layout, rank);
  const EngineConfig& config = layout.group_of(rank).config;
  const EngineRankLayout& ranks = layout.rank_layout(rank);
  std::vector<SafetensorsWriter::Entry> entries;
  uint64_t bytes = 0;
  for (const auto& p : ranks.params) {
    entries.push_back({p.name, p.dtype, p.shape});
    bytes += static_cast<uint64_t>(numel(p.shape)) * itemsize(p.dtype);
  }
  SafetensorsWriter out(out_path, std::move(entries),
                        {{"format", "pt"},
                         {"weightsync_framework", config.framework},
                         {"weightsync_rank", std::to_string(ranks.rank)},
                         {"weightsync_tp", std::to_string(config.tp)}});
  RankWriter writer(ckpt, out);
  for (const auto& p : ranks.params) writer.write_param(p);
  out.finish();
  return bytes;
}

}  // namespace weightsync
