#include "delta_frame.h"

#include "pipeline/wire.h"

#include "core/checksum_stream.h"

#include <weightsync/checksum.h>
#include <weightsync/error.h>

#include <algorithm>
#include <cstring>

namespace weightsync::pipeline {
namespace {

constexpr uint32_t kMagic = 0x46445357;  // "WSDF" little-endian
constexpr uint32_t kDeltaFlag = 1, kDigestFlag = 2, kFragmentsFlag = 4;

}  // namespace

void store_frame_header(char* at, const FrameHeader& h) noexcept {
  const uint32_t flags = (h.delta ? kDeltaFlag : 0) | (h.has_digest ? kDigestFlag : 0) |
                         (h.fragments ? kFragmentsFlag : 0);
  store_le64(at, (static_cast<uint64_t>(flags) << 32) | kMagic);
  store_le64(at + 8, static_cast<uint64_t>(h.step));
  store_le64(at + 16, static_cast<uint64_t>(h.base));
  store_le64(at + 24, h.digest);
}

FrameHeader read_frame_header(const char* at, int64_t bytes, const std::string& what) {
  if (bytes < kFrameHeaderBytes)
    fail(Errc::format, what, ": a delta-sync frame of ", bytes, " bytes, shorter than its ",
         kFrameHeaderBytes, "-byte header");
  const uint64_t first = read_le64(at);
  const auto flags = static_cast<uint32_t>(first >> 32);
  if (static_cast<uint32_t>(first) != kMagic ||
      (flags & ~(kDeltaFlag | kDigestFlag | kFragmentsFlag)) != 0 ||
      ((flags & kDeltaFlag) != 0 && (flags & kFragmentsFlag) != 0))
    fail(Errc::format, what, ": not a delta-sync frame (magic and flags ", std::hex, first,
         std::dec, "; does the sender use the same wire options?)");
  FrameHeader h;
  h.delta = (flags & kDeltaFlag) != 0;
  h.has_digest = (flags & kDigestFlag) != 0;
  h.fragments = (flags & kFragmentsFlag) != 0;
  h.step = static_cast<int64_t>(read_le64(at + 8));
  h.base = static_cast<int64_t>(read_le64(at + 16));
  h.digest = read_le64(at + 24);
  return h;
}

char* host_run(const TensorView& tensor, const Box& box) {
  return tensor.memory == MemoryKind::host ? dense_run(tensor, box) : nullptr;
}

char* dense_run(const TensorView& tensor, const Box& box) {
  if (!tensor.data) return nullptr;
  const auto first = dense_run_offset(tensor.effective_strides(), box);
  if (!first) return nullptr;
  return static_cast<char*>(tensor.data) + *first * static_cast<int64_t>(itemsize(tensor.dtype));
}

std::vector<FrameItem> frame_items(const Plan& plan, int32_t bucket) {
  std::vector<FrameItem> out;
  for (const PlanItem& item : plan.items(bucket)) {
    const Copy c = plan.resolve(item);
    FrameItem f;
    f.offset = c.offset;
    f.bytes = c.bytes;
    const auto size = static_cast<int>(itemsize(c.dtype));
    f.element_bytes =
        !c.fp8 && (size == 1 || size == 2 || size == 4 || size == 8) && c.bytes % size == 0 ? size
                                                                                            : 1;
    out.push_back(f);
  }
  return out;
}

int64_t frame_capacity(const std::vector<FrameItem>& items, int64_t bucket_bytes) noexcept {
  int64_t encoded = 8 * static_cast<int64_t>(items.size());
  for (const FrameItem& f : items)
    encoded += delta::max_encoded_bytes(f.elements(), f.element_bytes);
  return kFrameHeaderBytes + std::max(bucket_bytes, encoded);
}

int64_t encode_frame(const std::vector<FrameItem>& items, const char* const* next, char* base,
                     char* out, delta::EncodeStats* stats, int64_t step, uint64_t* digest) {
  char* table = out + kFrameHeaderBytes;
  char* at = table + 8 * static_cast<int64_t>(items.size());
  if (digest) *digest = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const FrameItem& f = items[i];
    delta::Digest hash{fragment_seed(step, static_cast<uint32_t>(i))};
    const int64_t n = delta::encode(next[i], base + f.offset, f.elements(), f.element_bytes, at,
                                    stats, digest ? &hash : nullptr);
    if (digest) *digest = checksum_fold(*digest, hash.sum);
    store_le64(table, static_cast<uint64_t>(n));
    table += 8;
    at += n;
  }
  return at - out;
}

int64_t estimate_frame(const std::vector<FrameItem>& items, const char* const* next,
                       const char* base) {
  int64_t bytes = 8 * static_cast<int64_t>(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const FrameItem& f = items[i];
    bytes += delta::estimate_encoded_bytes(next[i], base + f.offset, f.elements(), f.element_bytes);
  }
  return bytes;
}

namespace {

// Checks a delta frame's table against `items` and returns where each
// item's encoding lies: (offset into the frame, bytes).
std::vector<std::pair<int64_t, int64_t>> frame_encodings(const std::vector<FrameItem>& items,
                                                         const char* frame, int64_t bytes,
                                                         const std::string& what) {
  const auto table_bytes = 8 * static_cast<int64_t>(items.size());
  if (bytes < kFrameHeaderBytes + table_bytes)
    fail(Errc::format, what, ": a delta frame of ", bytes, " bytes cannot hold the table of its ",
         items.size(), " items");
  const char* table = frame + kFrameHeaderBytes;
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t at = kFrameHeaderBytes + table_bytes;
  for (size_t i = 0; i < items.size(); ++i) {
    const auto n = static_cast<int64_t>(read_le64(table + 8 * i));
    if (n < 0 || n > bytes - at)
      fail(Errc::format, what, ": item ", i, " claims ", n, " bytes of encoding, but ", bytes - at,
           " bytes of the frame are left");
    out.emplace_back(at, n);
    at += n;
  }
  if (at != bytes)
    fail(Errc::format, what, ": ", bytes - at, " bytes left over after the last item's encoding");
  return out;
}

std::string item_what(const std::string& what, size_t i) {
  return what + ", item " + std::to_string(i);
}

}  // namespace

void apply_frame(const std::vector<FrameItem>& items, const char* frame, int64_t bytes,
                 char* const* targets, const std::string& what, int64_t step, uint64_t* digest,
                 std::vector<bool>* changed) {
  // The table must cut the frame exactly, and every encoding be sound,
  // before a byte is written.
  const auto encodings = frame_encodings(items, frame, bytes, what);
  for (size_t i = 0; i < items.size(); ++i)
    delta::check(frame + encodings[i].first, encodings[i].second, items[i].elements(),
                 items[i].element_bytes, item_what(what, i));
  if (digest) *digest = 0;
  if (changed) changed->assign(items.size(), false);
  for (size_t i = 0; i < items.size(); ++i) {
    const auto [at, n] = encodings[i];
    const FrameItem& f = items[i];
    if (changed) (*changed)[i] = n != delta::unchanged_bytes(f.elements());
    delta::Digest hash{fragment_seed(step, static_cast<uint32_t>(i))};
    delta::apply(frame + at, n, targets[i], f.elements(), f.element_bytes, item_what(what, i),
                 digest ? &hash : nullptr);
    if (digest) *digest = checksum_fold(*digest, hash.sum);
  }
}

void frame_tables(const std::vector<FrameItem>& items, const char* frame, int64_t bytes,
                  const int64_t* targets, const std::string& what, int64_t step, bool digest,
                  FrameTables& out, std::vector<bool>* changed) {
  out.patch.clear();
  out.hash.clear();
  const auto encodings = frame_encodings(items, frame, bytes, what);
  if (changed) changed->assign(items.size(), false);
  for (size_t i = 0; i < items.size(); ++i) {
    const auto [at, n] = encodings[i];
    const FrameItem& f = items[i];
    const bool any = delta::patch_table(frame + at, n, f.elements(), f.element_bytes,
                                        item_what(what, i), at, targets[i], out.patch);
    if (changed) (*changed)[i] = any;
    if (digest)
      delta::hash_table(f.elements(), f.element_bytes,
                        fragment_seed(step, static_cast<uint32_t>(i)), targets[i], out.hash);
  }
}

std::vector<ReadBox> template_reads(const Plan& plan, int32_t bucket, int engine_template) {
  std::vector<ReadBox> out;
  const int rank = plan.template_rank(engine_template);
  for (const ApplyItem& ai : plan.apply_items(bucket, engine_template)) {
    const Copy c = plan.resolve(ai, rank);
    out.push_back({c.offset, static_cast<int>(itemsize(c.dtype)), c.view_box, c.hf_box});
  }
  return out;
}

uint64_t reads_digest(const std::vector<ReadBox>& reads, const char* packed, int64_t step) {
  uint64_t sum = 0;
  for (size_t i = 0; i < reads.size(); ++i) {
    const ReadBox& r = reads[i];
    const size_t n = r.hf_box.rank();
    const int64_t elements = r.hf_box.numel();
    Checksum64Stream hash(fragment_seed(step, static_cast<uint32_t>(i)),
                          static_cast<size_t>(elements * r.element_bytes));
    if (elements > 0) {
      // Row by row along the last dim: the rows of hf_box inside the view.
      const Shape strides = contiguous_strides(r.view_box.lengths);
      const int64_t row = n == 0 ? 1 : r.hf_box.lengths[n - 1];
      std::vector<int64_t> at(n, 0);  // index inside hf_box, last dim 0
      for (int64_t done = 0; done < elements; done += row) {
        int64_t element = 0;
        for (size_t d = 0; d < n; ++d)
          element += (r.hf_box.offsets[d] - r.view_box.offsets[d] + at[d]) * strides[d];
        hash.update(packed + r.offset + element * r.element_bytes,
                    static_cast<size_t>(row * r.element_bytes));
        for (size_t d = n == 0 ? 0 : n - 1; d-- > 0;) {  // the next row
          if (++at[d] < r.hf_box.lengths[d]) break;
          at[d] = 0;
        }
      }
    }
    sum = checksum_fold(sum, hash.finish());
  }
  return sum;
}

uint64_t frame_digest(const std::vector<FrameItem>& items, const char* const* data, int64_t step) {
  uint64_t sum = 0;
  for (size_t i = 0; i < items.size(); ++i)
    sum = checksum_fold(sum, delta::digest(data[i], items[i].elements(), items[i].element_bytes,
                                           fragment_seed(step, static_cast<uint32_t>(i))));
  return sum;
}

}  // namespace weightsync::pipeline
