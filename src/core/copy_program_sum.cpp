// The host executor of copy programs with the bucket checksum fused into its
// copies (copy_program.h, wire_sum.h): the pack of a bucket sums what it
// writes, the apply what it reads, so the checksum costs no pass of its own.
#include "core/copy_program.h"

#include <algorithm>

namespace weightsync {

WireSum execute_host_sum(const CopyProgram& program, std::uintptr_t src_base,
                         std::uintptr_t dst_base, PackedSide side, int64_t origin,
                         std::size_t first, std::size_t count) {
  const auto& runs = program.runs();
  first = std::min(first, runs.size());
  const std::size_t end = first + std::min(count, runs.size() - first);
  const bool packed_dst = side == PackedSide::dst;
  WireSum sum;
  for (std::size_t i = first; i < end; ++i) {
    const CopyRun& r = runs[i];
    const auto bytes = static_cast<std::size_t>(r.bytes);
    const int64_t ss = r.src_stride[0], ds = r.dst_stride[0];
    const int64_t ps = packed_dst ? ds : ss;
    // Element-sized rows (a transpose) go element by element, as in execute_host.
    const bool elements = bytes == 1 || bytes == 2 || bytes == 4 || bytes == 8;
    for (int64_t i2 = 0; i2 < r.count[2]; ++i2)
      for (int64_t i1 = 0; i1 < r.count[1]; ++i1) {
        const int64_t s = r.src + i1 * r.src_stride[1] + i2 * r.src_stride[2];
        const int64_t d = r.dst + i1 * r.dst_stride[1] + i2 * r.dst_stride[2];
        char* to = reinterpret_cast<char*>(dst_base + static_cast<std::uintptr_t>(d));
        const char* from = reinterpret_cast<const char*>(src_base + static_cast<std::uintptr_t>(s));
        const auto at = static_cast<uint64_t>((packed_dst ? d : s) - origin);
        if (elements) {
          sum += copy_wire_sum_elements(to, from, r.count[0], bytes, ds, ss, at, ps);
          continue;
        }
        for (int64_t i0 = 0; i0 < r.count[0]; ++i0)
          sum += copy_wire_sum(to + i0 * ds, from + i0 * ss, bytes,
                               at + static_cast<uint64_t>(i0 * ps));
      }
  }
  return sum;
}

int64_t runs_bytes(const CopyProgram& program, std::size_t first, std::size_t count) {
  const auto& runs = program.runs();
  first = std::min(first, runs.size());
  const std::size_t end = first + std::min(count, runs.size() - first);
  int64_t bytes = 0;
  for (std::size_t i = first; i < end; ++i) bytes += runs[i].total_bytes();
  return bytes;
}

}  // namespace weightsync
