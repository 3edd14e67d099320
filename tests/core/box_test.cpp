#include <weightsync/box.h>
#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <numeric>
#include <random>

namespace weightsync {
namespace {

TEST(TensorView, NonOverlappingViews) {
  auto view = [](Shape shape, Shape strides) {
    TensorView v = host_view(nullptr, DType::F32, std::move(shape));
    v.strides = std::move(strides);
    return v;
  };
  EXPECT_TRUE(view({4, 3}, {}).is_non_overlapping());
  EXPECT_TRUE(view({4, 3}, {1, 4}).is_non_overlapping());   // transposed
  EXPECT_TRUE(view({4, 3}, {8, 1}).is_non_overlapping());   // rows of a wider buffer
  EXPECT_TRUE(view({4, 1}, {1, 0}).is_non_overlapping());   // stride 0 on a dim of 1
  EXPECT_FALSE(view({4, 3}, {0, 1}).is_non_overlapping());  // expanded rows
  EXPECT_FALSE(view({4, 3}, {2, 1}).is_non_overlapping());  // rows overlap by one
  EXPECT_FALSE(view({2, 2, 2}, {2, 1, 1}).is_non_overlapping());
  EXPECT_TRUE(view({2, 3, 2}, {6, 1, 3}).is_non_overlapping());
}

TEST(Box, IntersectAndEmpty) {
  Box a{{0, 2}, {4, 4}};
  Box b{{2, 0}, {4, 3}};
  auto c = intersect(a, b);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(*c, (Box{{2, 2}, {2, 1}}));
  EXPECT_FALSE(intersect(a, Box{{4, 0}, {1, 8}}).has_value());
  EXPECT_EQ(box_str(a), "[0:4, 2:6]");
  EXPECT_TRUE(a.contains(Box{{1, 3}, {2, 2}}));
  EXPECT_FALSE(a.contains(Box{{1, 3}, {2, 4}}));
}

// Reference element-by-element copy to compare copy_box against.
void reference_copy(const std::vector<int32_t>& src, const Shape& ss, const Box& sb,
                    std::vector<int32_t>& dst, const Shape& ds, const Box& db) {
  const Shape sst = contiguous_strides(ss), dst_strides = contiguous_strides(ds);
  const int64_t n = sb.numel();
  for (int64_t i = 0; i < n; ++i) {
    int64_t rem = i, so = 0, doff = 0;
    for (size_t d = sb.rank(); d-- > 0;) {
      int64_t c = rem % sb.lengths[d];
      rem /= sb.lengths[d];
      so += (sb.offsets[d] + c) * sst[d];
      doff += (db.offsets[d] + c) * dst_strides[d];
    }
    dst[doff] = src[so];
  }
}

TEST(Box, CopyBoxMatchesReferenceOnRandomBoxes) {
  std::mt19937 rng(7);
  for (int iter = 0; iter < 300; ++iter) {
    const int rank = 1 + static_cast<int>(rng() % 4);
    Shape ss(rank), ds(rank), len(rank), so(rank), dof(rank);
    for (int d = 0; d < rank; ++d) {
      ss[d] = 1 + rng() % 6;
      ds[d] = 1 + rng() % 6;
      len[d] = rng() % (std::min(ss[d], ds[d]) + 1);
      so[d] = rng() % (ss[d] - len[d] + 1);
      dof[d] = rng() % (ds[d] - len[d] + 1);
    }
    std::vector<int32_t> src(numel(ss)), dst(numel(ds), -1), want(numel(ds), -1);
    std::iota(src.begin(), src.end(), 0);
    Box sb{so, len}, db{dof, len};
    copy_box(host_view(src.data(), DType::I32, ss), sb, host_view(dst.data(), DType::I32, ds), db);
    reference_copy(src, ss, sb, want, ds, db);
    ASSERT_EQ(dst, want) << "iteration " << iter;
  }
}

TEST(Box, CopyBoxTransposedView) {
  std::vector<uint16_t> src{1, 2, 3, 4, 5, 6};  // [2, 3]
  std::vector<uint16_t> dst(6, 0);              // [3, 2]
  TensorView s = host_view(src.data(), DType::BF16, {2, 3});
  TensorView d = transposed(host_view(dst.data(), DType::BF16, {3, 2}), 0, 1);  // seen as [2, 3]
  copy_box(s, Box::full({2, 3}), d, Box::full({2, 3}));
  EXPECT_EQ(dst, (std::vector<uint16_t>{1, 4, 2, 5, 3, 6}));
}

TEST(Box, CopyBoxRejectsMismatches) {
  std::vector<float> a(4), b(4);
  auto va = host_view(a.data(), DType::F32, {4});
  auto vb = host_view(b.data(), DType::I32, {4});
  try {
    copy_box(va, Box::full({4}), vb, Box::full({4}));
    FAIL() << "expected a dtype mismatch";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Errc::mismatch);
  }
  auto vc = host_view(b.data(), DType::F32, {4});
  EXPECT_THROW(copy_box(va, Box{{2}, {3}}, vc, Box{{0}, {3}}), Error);
}

}  // namespace
}  // namespace weightsync
