// Copy programs (src/core/copy_program.h) against copy_box on random layouts,
// every byte of the destination compared, and the GPU's cut into tasks run
// on the host with the kernel's arithmetic.
#include "core/copy_random_layout.h"

#include <weightsync/error.h>

#include "core/copy_program.h"

#include <gtest/gtest.h>

#include <cstring>

namespace weightsync {
namespace {

std::uintptr_t addr(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

// The program of one copy, offsets relative to the two tensors' data.
CopyProgram program_of(const test::RandomCopy& c) {
  CopyProgram p;
  p.add(test::box_byte_offset(c.src.view, c.src_box), c.src.view.effective_strides(),
        test::box_byte_offset(c.dst.view, c.dst_box), c.dst.view.effective_strides(),
        c.src_box.lengths, itemsize(c.src.view.dtype));
  return p;
}

TEST(CopyProgram, MatchesCopyBoxOnRandomLayouts) {
  std::mt19937_64 rng(20261122);
  for (int trial = 0; trial < 2000; ++trial) {
    test::RandomCopy c = test::random_copy(rng);
    const std::vector<unsigned char> before = c.dst.storage;
    copy_box(c.src.view, c.src_box, c.dst.view, c.dst_box);
    const std::vector<unsigned char> expected = c.dst.storage;
    c.dst.storage = before;  // same buffer (the view points into it), old bytes
    const CopyProgram p = program_of(c);
    EXPECT_EQ(p.bytes(), c.src_box.numel() * static_cast<int64_t>(itemsize(c.src.view.dtype)));
    execute_host(p, addr(c.src.storage.data()), addr(c.dst.storage.data()));
    ASSERT_EQ(c.dst.storage, expected)
        << "trial " << trial << ": box " << box_str(c.src_box) << " into " << box_str(c.dst_box);
  }
}

TEST(CopyProgram, TasksRunTheSameBytesAsTheProgram) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 1000; ++trial) {
    test::RandomCopy c = test::random_copy(rng);
    const CopyProgram p = program_of(c);
    const std::vector<unsigned char> before = c.dst.storage;
    execute_host(p, addr(c.src.storage.data()), addr(c.dst.storage.data()));
    const std::vector<unsigned char> expected = c.dst.storage;
    c.dst.storage = before;
    const int64_t chunk = 16 * (1 + static_cast<int64_t>(rng() % 64));
    const auto tasks = copy_tasks(p, chunk);
    int64_t moved = 0;
    for (const CopyTask& t : tasks) {
      moved += int64_t{t.rows} * t.vecs_per_row * t.vec;
      const CopyRun& r = p.runs()[t.run];
      ASSERT_EQ(r.bytes % t.vec, 0);
      if (t.tile != 0) {  // a transpose tile: one element a row
        ASSERT_EQ(r.bytes, t.vec);
        ASSERT_LE(int64_t{t.rows}, kTileElements * kTileElements);
        continue;
      }
      ASSERT_LE(int64_t{t.rows} * t.vecs_per_row * t.vec, std::max<int64_t>(chunk, r.bytes));
    }
    EXPECT_EQ(moved, p.bytes()) << "every byte in exactly one task";
    execute_tasks_host(p, tasks, addr(c.src.storage.data()), addr(c.dst.storage.data()));
    ASSERT_EQ(c.dst.storage, expected) << "trial " << trial << ", chunk " << chunk;
  }
}

TEST(CopyProgram, DenseBlockIsOneRunAndTransposeIsElementRuns) {
  CopyProgram dense;
  dense.add(0, {12, 4, 1}, 1000, {12, 4, 1}, {2, 3, 4}, 2);
  ASSERT_EQ(dense.size(), 1u);
  EXPECT_EQ(dense.runs()[0].bytes, 48);
  EXPECT_EQ(dense.runs()[0].rows(), 1);

  // A [4, 6] slice of an [8, 6] tensor into a [4, 10] row-padded one: rows.
  CopyProgram rows;
  rows.add(0, {6, 1}, 0, {10, 1}, {4, 6}, 4);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows.runs()[0].bytes, 24);
  EXPECT_EQ(rows.runs()[0].count[0], 4);
  EXPECT_EQ(rows.runs()[0].src_stride[0], 24);
  EXPECT_EQ(rows.runs()[0].dst_stride[0], 40);

  // Transposed: element-sized runs over two outer dims.
  CopyProgram t;
  t.add(0, {1, 5}, 0, {3, 1}, {5, 3}, 2);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t.runs()[0].bytes, 2);
  EXPECT_EQ(t.runs()[0].rows(), 15);
}

// A transpose is cut into tiles (the kernel moves each through shared
// memory, reading and writing along each side's contiguous dim): either
// side contiguous along dim 0, ragged edges, a third dim, every element
// size; the tiles move every byte once, as the program does.
TEST(CopyProgram, TransposesAreCutIntoTilesThatMoveEveryByteOnce) {
  struct Case {
    Shape lengths, src_strides, dst_strides;
    bool tiles;
  };
  const Case cases[] = {
      {{70, 45}, {1, 70}, {45, 1}, true},                   // ragged edges
      {{45, 70}, {70, 1}, {1, 45}, true},                   // the dims the other way
      {{3, 33, 100}, {3300, 1, 33}, {3300, 100, 1}, true},  // a batch of transposes
      {{64, 64}, {1, 64}, {64, 1}, true},                   // whole tiles only
      {{5, 3}, {1, 5}, {3, 1}, false},                      // too small for tiles: rows
  };
  for (const Case& c : cases) {
    for (size_t e : {1, 2, 4, 8, 16}) {
      SCOPED_TRACE(::testing::Message()
                   << "lengths " << c.lengths[0] << "x" << c.lengths[1] << ", element " << e);
      CopyProgram p;
      p.add(0, c.src_strides, 0, c.dst_strides, c.lengths, e);
      int64_t n = 1;
      for (int64_t l : c.lengths) n *= l;
      std::vector<unsigned char> src(static_cast<size_t>(n) * e), want(src.size()),
          got(src.size(), 0);
      for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
      execute_host(p, addr(src.data()), addr(want.data()));
      const auto tasks = copy_tasks(p, 4096);
      int64_t tiles = 0, moved = 0;
      for (const CopyTask& t : tasks) {
        tiles += t.tile != 0;
        moved += int64_t{t.rows} * t.vecs_per_row * t.vec;
      }
      EXPECT_EQ(moved, p.bytes());
      execute_tasks_host(p, tasks, addr(src.data()), addr(got.data()));
      EXPECT_EQ(got, want);
      ASSERT_EQ(p.size(), 1u);
      const CopyRun& r = p.runs()[0];
      const int64_t batch = c.lengths.size() == 3 ? c.lengths[0] : 1;
      const int64_t rows = c.lengths[c.lengths.size() - 2], cols = c.lengths.back();
      if (c.tiles) {
        EXPECT_NE(transpose_tile_kind(r), 0u);
        EXPECT_EQ(tiles, batch * ((rows + 31) / 32) * ((cols + 31) / 32));
        EXPECT_EQ(tiles, static_cast<int64_t>(tasks.size()));
      } else {
        EXPECT_EQ(transpose_tile_kind(r), 0u);
        EXPECT_EQ(tiles, 0);
      }
    }
  }
}

TEST(CopyProgram, MoreOuterDimsThanARunHoldsBecomeSeveralRuns) {
  // Six dims, none mergeable (padded on both sides): 3 in the run, 2x2 runs.
  const Shape lengths{2, 2, 2, 2, 2, 2};
  const Shape src_strides{400, 100, 30, 9, 4, 1}, dst_strides{300, 80, 20, 7, 3, 1};
  std::vector<unsigned char> src(900), dst_a(700, 0), dst_b(700, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i * 7 + 1);
  CopyProgram p;
  p.add(0, src_strides, 0, dst_strides, lengths, 1);
  EXPECT_EQ(p.size(), 4u);
  execute_host(p, addr(src.data()), addr(dst_a.data()));
  copy_strided(dst_b.data(), dst_strides.data(), src.data(), src_strides.data(), lengths.data(), 6,
               1);
  EXPECT_EQ(dst_a, dst_b);
}

TEST(CopyProgram, VectorWidthFollowsEveryAddress) {
  CopyRun r;
  r.src = 4096;
  r.dst = 64;
  r.bytes = 256;
  EXPECT_EQ(run_vector_bytes(r), 16u);
  r.count[0] = 3;
  r.src_stride[0] = 1000;  // 8-aligned rows
  r.dst_stride[0] = 256;
  EXPECT_EQ(run_vector_bytes(r), 8u);
  r.bytes = 2;
  EXPECT_EQ(run_vector_bytes(r), 2u);
}

TEST(CopyProgram, TaskChunksGiveEveryBlockWorkWithinBounds) {
  EXPECT_EQ(task_chunk_bytes(0, 528), 16 << 10) << "at least 16 KiB";
  EXPECT_EQ(task_chunk_bytes(int64_t{1} << 40, 528), 256 << 10) << "at most 256 KiB";
  const int64_t c = task_chunk_bytes(int64_t{256} << 20, 528);  // a 256 MiB bucket
  EXPECT_EQ(c % 16, 0);
  EXPECT_GE((int64_t{256} << 20) / c, 4 * 528 - 16) << "about four tasks per block";
}

TEST(CopyProgram, RejectsBadInput) {
  CopyProgram p;
  EXPECT_THROW(p.add(0, {1}, 0, {1, 1}, {2, 2}, 2), Error);
  EXPECT_THROW(p.add(0, {1}, 0, {1}, {-1}, 2), Error);
  EXPECT_THROW(copy_tasks(p, 24), Error);
  p.add(0, {1}, 0, {1}, {0}, 2);  // empty: nothing to do
  EXPECT_TRUE(p.empty());
}

}  // namespace
}  // namespace weightsync
