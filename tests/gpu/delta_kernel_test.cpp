// The delta patch and hash kernels (gpu::DeltaPatcher, cuda/delta_kernel.cu)
// against the host codec: items of every element size, changes scattered,
// clustered in many short runs, in long runs and total, so that every
// record kind (list, runs, dense, unchanged) runs on the device; items at
// odd places in the target memory and the frame. Every byte of the target
// is compared with delta::apply's, the digest with delta::digest's.
#include "gpu/gpu_test_util.h"

#include "core/cuda/gpu.h"
#include "core/delta.h"

#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace weightsync::gpu_test {
namespace {

using Bytes = std::vector<char>;

enum class Pattern { scattered, short_runs, long_runs, all, none };

// `old` with changes in the last byte of the elements `pattern` picks.
Bytes changed(const Bytes& old, int e, Pattern pattern, double fraction, std::mt19937& rng) {
  Bytes next = old;
  std::bernoulli_distribution pick(fraction);
  const auto n = static_cast<int64_t>(old.size()) / e;
  for (int64_t i = 0; i < n; ++i) {
    bool change = false;
    switch (pattern) {
      case Pattern::scattered:
        change = pick(rng);
        break;
      case Pattern::short_runs:  // runs of 3, gaps of 5: 512 runs a chunk, taken as runs
        change = i % 8 < 3;
        break;
      case Pattern::long_runs:
        change = i % 1024 < 64;
        break;
      case Pattern::all:
        change = true;
        break;
      case Pattern::none:
        break;
    }
    if (change) next[static_cast<size_t>(i * e + e - 1)] ^= 0x5a;
  }
  return next;
}

TEST(DeltaKernel, PatchesAndHashesAsTheHostCodec) {
  REQUIRE_GPU();
  std::mt19937 rng(41);
  const int device = 0;
  gpu::set_device(device);
  const gpu::Stream stream(device);
  gpu::DeltaPatcher patcher(device);
  for (int e : {1, 2, 4, 8}) {
    // Items back to back in one target memory (the first at an odd element
    // offset), each with its own pattern; a partial last chunk.
    struct Item {
      int64_t elements;
      Pattern pattern;
      double fraction;
    };
    const std::vector<Item> items{
        {3 * delta::kChunkElements + 77, Pattern::scattered, 0.02},
        {2 * delta::kChunkElements, Pattern::short_runs, 0},
        {delta::kChunkElements + 5, Pattern::long_runs, 0},
        {2 * delta::kChunkElements - 3, Pattern::all, 0},
        {delta::kChunkElements, Pattern::none, 0},
        {1000, Pattern::scattered, 0.3},
        {7, Pattern::all, 0},
    };
    int64_t total = 3;  // elements before the first item
    for (const Item& it : items) total += it.elements;
    Bytes old(static_cast<size_t>(total * e));
    for (char& b : old) b = static_cast<char>(rng());
    Bytes next = old, expected = old;
    Bytes frame(5, 0);  // encodings at odd offsets of the frame
    std::vector<delta::PatchChunk> patch;
    std::vector<delta::HashChunk> hash;
    uint64_t want_digest = 0;
    int64_t at = 3 * e;
    int64_t kinds[4] = {0, 0, 0, 0};
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      const auto bytes = static_cast<size_t>(it.elements * e);
      const Bytes item_old(old.begin() + at, old.begin() + at + static_cast<int64_t>(bytes));
      const Bytes item_next = changed(item_old, e, it.pattern, it.fraction, rng);
      std::copy(item_next.begin(), item_next.end(), next.begin() + at);
      Bytes base = item_old;
      Bytes enc(static_cast<size_t>(delta::max_encoded_bytes(it.elements, e)));
      delta::EncodeStats stats;
      enc.resize(static_cast<size_t>(
          delta::encode(item_next.data(), base.data(), it.elements, e, enc.data(), &stats)));
      for (int k = 0; k < 4; ++k) kinds[k] += stats.chunks[k];
      delta::apply(enc.data(), static_cast<int64_t>(enc.size()), expected.data() + at, it.elements,
                   e, "item");
      const auto offset = static_cast<int64_t>(frame.size());
      frame.insert(frame.end(), enc.begin(), enc.end());
      const std::string what = "item " + std::to_string(i);
      delta::patch_table(frame.data() + offset, static_cast<int64_t>(enc.size()), it.elements, e,
                         what, offset, at, patch);
      delta::hash_table(it.elements, e, 1000 + i, at, hash);
      want_digest += delta::digest(item_next.data(), it.elements, e, 1000 + i);
      at += static_cast<int64_t>(bytes);
    }
    ASSERT_EQ(expected, next);
    for (int k = 0; k < 4; ++k) EXPECT_GT(kinds[k], 0) << "E" << e << ": no record of kind " << k;

    gpu::Memory target(old.size(), gpu::MemoryPlace::device, device);
    gpu::copy_to_device(target.data(), old.data(), old.size());
    patcher.run(stream, frame.data(), frame.size(), patch, hash,
                reinterpret_cast<std::uintptr_t>(target.data()));
    EXPECT_EQ(patcher.digest(stream), want_digest) << "E" << e;
    Bytes got(old.size());
    gpu::copy_to_host(got.data(), target.data(), got.size());
    EXPECT_EQ(got, next) << "E" << e;
    // The host's run of the same tables agrees (what the CPU tests rely on).
    Bytes host = old;
    delta::execute_patch_host(patch, frame.data(), host.data());
    EXPECT_EQ(host, next) << "E" << e;
    EXPECT_EQ(delta::execute_hash_host(hash, host.data()), want_digest) << "E" << e;
  }
}

}  // namespace
}  // namespace weightsync::gpu_test
