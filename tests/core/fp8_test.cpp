// The host FP8 block quantizer (src/core/fp8.*) against a reference written
// here from DESIGN.md "FP8 engines": E4M3 values decoded from their fields,
// the nearest one found by search (ties to the even code), the block scale
// in FP32. Shares no arithmetic with fp8_math.h.
#include "core/fp8.h"
#include "core/fp8_math.h"

#include <weightsync/error.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace weightsync {
namespace {

using fp8::kBlock;

// The value of E4M3FN code c (c & 0x7F == 0x7F is NaN; not used here).
double e4m3_value(int c) {
  const int s = (c >> 7) & 1, e = (c >> 3) & 0xF, m = c & 7;
  const double mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

// Round to nearest, ties to even code, among the finite codes of the sign of
// y; beyond 448 saturate (the quantizer never makes NaN).
uint8_t reference_e4m3(float y) {
  if (std::isnan(y)) return std::signbit(y) ? 0xFE : 0x7E;
  const int sign = std::signbit(y) ? 0x80 : 0;
  const double a = std::fabs(static_cast<double>(y));
  if (a >= 448.0) return static_cast<uint8_t>(sign | 0x7E);
  int best = 0;
  double best_d = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7E; ++c) {
    const double d = std::fabs(e4m3_value(c) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(sign | best);
}

uint16_t bf16_of(float f) {  // round to nearest even (inputs here are finite)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float f32_of_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The block formula, from the spec: a = max(amax, 1e-4), s = a / 448 (FP32),
// UE8M0: the least power of two >= s; q = e4m3(x * (1 / s)).
float reference_scale(float amax, bool ue8m0) {
  const float a = std::max(amax, 1e-4f);
  float s = a / 448.0f;
  if (ue8m0) {
    float p = 1.0f;
    while (p < s) p *= 2.0f;
    while (p / 2.0f >= s) p /= 2.0f;
    s = p;
  }
  return s;
}

struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> scales;
};

Quantized reference_tensor(const std::vector<float>& x, int64_t rows, int64_t cols, bool ue8m0) {
  const int64_t br = (rows + kBlock - 1) / kBlock, bc = (cols + kBlock - 1) / kBlock;
  Quantized out{std::vector<uint8_t>(static_cast<size_t>(rows * cols)),
                std::vector<float>(static_cast<size_t>(br * bc))};
  for (int64_t i = 0; i < br; ++i)
    for (int64_t j = 0; j < bc; ++j) {
      float amax = 0;
      for (int64_t r = i * kBlock; r < std::min(rows, (i + 1) * kBlock); ++r)
        for (int64_t c = j * kBlock; c < std::min(cols, (j + 1) * kBlock); ++c)
          amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * cols + c)]));
      const float s = reference_scale(amax, ue8m0);
      const float inv = 1.0f / s;
      out.scales[static_cast<size_t>(i * bc + j)] = s;
      for (int64_t r = i * kBlock; r < std::min(rows, (i + 1) * kBlock); ++r)
        for (int64_t c = j * kBlock; c < std::min(cols, (j + 1) * kBlock); ++c)
          out.q[static_cast<size_t>(r * cols + c)] =
              reference_e4m3(x[static_cast<size_t>(r * cols + c)] * inv);
    }
  return out;
}

// Quantizes BF16 values (given as floats, exactly representable) both ways.
void expect_same(const std::vector<float>& x, int64_t rows, int64_t cols, ScaleFormat format) {
  std::vector<uint16_t> bf(x.size());
  for (size_t i = 0; i < x.size(); ++i) bf[i] = bf16_of(x[i]);
  std::vector<float> xr(x.size());
  for (size_t i = 0; i < x.size(); ++i) xr[i] = f32_of_bf16(bf[i]);
  const bool ue8m0 = format == ScaleFormat::ue8m0;
  const Quantized want = reference_tensor(xr, rows, cols, ue8m0);
  std::vector<uint8_t> q(x.size(), 0xAA);
  std::vector<float> s(want.scales.size(), -1.0f);
  fp8::quantize_tensor(bf.data(), DType::BF16, rows, cols, format, q.data(), s.data());
  for (size_t i = 0; i < s.size(); ++i)
    ASSERT_EQ(std::bit_cast<uint32_t>(s[i]), std::bit_cast<uint32_t>(want.scales[i]))
        << "scale " << i << " of " << rows << " x " << cols << ": " << s[i] << " vs "
        << want.scales[i];
  for (size_t i = 0; i < q.size(); ++i) {
    ASSERT_EQ(int{q[i]}, int{want.q[i]})
        << "element " << i << " (" << xr[i] << ") of " << rows << " x " << cols;
    ASSERT_NE(q[i] & 0x7F, 0x7F) << "NaN code at element " << i;
  }
}

TEST(Fp8E4m3, EveryCodeMidpointAndRandomValueRoundsToNearestEven) {
  std::vector<float> probes;
  for (int c = 0; c <= 0x7E; ++c) {
    const double v = e4m3_value(c);
    probes.push_back(static_cast<float>(v));
    probes.push_back(static_cast<float>(-v));
    if (c < 0x7E) {
      const double mid = (v + e4m3_value(c + 1)) / 2;  // exact in FP32: a tie
      probes.push_back(static_cast<float>(mid));
      probes.push_back(std::nextafter(static_cast<float>(mid), 0.0f));
      probes.push_back(std::nextafter(static_cast<float>(mid), 1000.0f));
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> wide(-470.0f, 470.0f);
  std::uniform_real_distribution<float> tiny(-0.02f, 0.02f);  // subnormal E4M3 results
  for (int i = 0; i < 20000; ++i) probes.push_back(i % 2 ? wide(rng) : tiny(rng));
  for (float y : probes)
    ASSERT_EQ(int{fp8::e4m3_from_f32(y)}, int{reference_e4m3(y)}) << "y = " << y;
}

TEST(Fp8E4m3, SaturatesAbove448AndNeverMakesNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float y : {448.0f, 449.0f, 464.0f, 480.0f, 1e6f, 3e38f, inf}) {
    EXPECT_EQ(fp8::e4m3_from_f32(y), 0x7E) << y;
    EXPECT_EQ(fp8::e4m3_from_f32(-y), 0xFE) << -y;
  }
  EXPECT_EQ(fp8::e4m3_from_f32(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7E);
  EXPECT_EQ(fp8::e4m3_from_f32(0.0f), 0x00);
  EXPECT_EQ(fp8::e4m3_from_f32(-0.0f), 0x80);
  EXPECT_EQ(fp8::e4m3_from_f32(std::ldexp(1.0f, -10)), 0x00);   // half the least subnormal: even
  EXPECT_EQ(fp8::e4m3_from_f32(std::ldexp(3.0f, -10)), 0x02);   // 1.5 ulp: to even (2)
  EXPECT_EQ(fp8::e4m3_from_f32(std::ldexp(1.0f, -9)), 0x01);    // least subnormal
  EXPECT_EQ(fp8::e4m3_from_f32(std::ldexp(15.0f, -10)), 0x08);  // rounds up into the normals
}

TEST(Fp8E4m3, DecodesEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(fp8::e4m3_to_f32(static_cast<uint8_t>(c))));
      continue;
    }
    EXPECT_EQ(static_cast<double>(fp8::e4m3_to_f32(static_cast<uint8_t>(c))), e4m3_value(c)) << c;
  }
}

TEST(Fp8Quantizer, RandomRaggedTensorsEqualTheReference) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{128, 128},
                            {1, 1},
                            {130, 200},
                            {257, 129},
                            {64, 384},
                            {300, 7}}) {
    std::vector<float> x(static_cast<size_t>(rows * cols));
    for (float& v : x) v = normal(rng);
    for (ScaleFormat f : {ScaleFormat::fp32, ScaleFormat::ue8m0}) expect_same(x, rows, cols, f);
  }
}

TEST(Fp8Quantizer, AdversarialBlocks) {
  const int64_t rows = 256, cols = 384;  // 2 x 3 blocks, each its own case
  std::vector<float> x(static_cast<size_t>(rows * cols), 0.0f);
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto block = [&](int i, int j, auto value) {
    for (int64_t r = i * kBlock; r < (i + 1) * kBlock; ++r)
      for (int64_t c = j * kBlock; c < (j + 1) * kBlock; ++c)
        x[static_cast<size_t>(r * cols + c)] = value(r, c);
  };
  block(0, 0, [](int64_t, int64_t) { return 0.0f; });  // all zeros: the 1e-4 floor
  block(0, 1, [&](int64_t r, int64_t c) {  // BF16 subnormals and tiny normals, below the floor
    return ((r + c) % 2 ? 1.0f : -1.0f) * std::ldexp(1.0f + static_cast<float>(c % 8) / 8, -130);
  });
  block(0, 2, [&](int64_t r, int64_t c) {  // +-448 and values around it
    const float v = (c % 3 == 0) ? 448.0f : u(rng) * 448.0f;
    return r % 2 ? -v : v;
  });
  block(1, 0, [&](int64_t, int64_t c) {  // huge values: the scale far above 1
    return c == 5 ? 3.0e38f : u(rng) * 1e30f;
  });
  block(1, 1, [&](int64_t r, int64_t c) {  // one outlier: most elements flush to subnormals
    return r == 1 && c == kBlock + 1 ? 1000.0f : u(rng) * 0.05f;
  });
  block(1, 2, [&](int64_t, int64_t) {  // amax just above the floor
    return u(rng) * 1.5e-4f;
  });
  for (ScaleFormat f : {ScaleFormat::fp32, ScaleFormat::ue8m0}) expect_same(x, rows, cols, f);
}

TEST(Fp8Quantizer, ScaleFormulaCorners) {
  EXPECT_EQ(fp8::block_scale(0.0f, false), 1e-4f / 448.0f);
  EXPECT_EQ(fp8::block_scale(448.0f, false), 1.0f);
  EXPECT_EQ(fp8::block_scale(448.0f, true), 1.0f);  // a power of two stays
  EXPECT_EQ(fp8::block_scale(449.0f, true), 2.0f);  // else the next one up
  EXPECT_EQ(fp8::block_scale(224.0f + 1e-3f, true), 1.0f);
  const float s = fp8::block_scale(0.0f, true);
  int e = 0;
  EXPECT_EQ(std::frexp(s, &e), 0.5f);  // a power of two
  EXPECT_GE(s, 1e-4f / 448.0f);
  EXPECT_LT(s / 2, 1e-4f / 448.0f);
  // The block's largest |x| goes to +-448 exactly with FP32 scales.
  std::vector<float> x(128 * 128);
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (float& v : x) v = f32_of_bf16(bf16_of(n(rng)));
  size_t arg = 0;
  for (size_t i = 0; i < x.size(); ++i)
    if (std::fabs(x[i]) > std::fabs(x[arg])) arg = i;
  std::vector<uint16_t> bf(x.size());
  for (size_t i = 0; i < x.size(); ++i) bf[i] = bf16_of(x[i]);
  std::vector<uint8_t> q(x.size());
  float scale = 0;
  fp8::quantize_tensor(bf.data(), DType::BF16, 128, 128, ScaleFormat::fp32, q.data(), &scale);
  EXPECT_EQ(q[arg] & 0x7F, 0x7E);
}

TEST(Fp8Quantizer, F16AndF32SourcesEqualTheirFloatValues) {
  std::mt19937 rng(9);
  std::normal_distribution<float> n(0.0f, 3.0f);
  const int64_t rows = 150, cols = 140;
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (float& v : x) v = n(rng);
  // F32 source: the values as they are.
  const Quantized want = reference_tensor(x, rows, cols, false);
  std::vector<uint8_t> q(x.size());
  std::vector<float> s(want.scales.size());
  fp8::quantize_tensor(x.data(), DType::F32, rows, cols, ScaleFormat::fp32, q.data(), s.data());
  EXPECT_EQ(q, want.q);
  EXPECT_EQ(s, want.scales);
  // F16 source: values exact in half precision (small integers / 64).
  std::vector<uint16_t> h(x.size());
  std::vector<float> xh(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const int k = static_cast<int>(std::lround(x[i] * 64)) % 2000;
    xh[i] = static_cast<float>(k) / 64;
    // Half encoding of k / 64 (|k| < 2048: exact), built from its fields.
    const float a = std::fabs(xh[i]);
    uint16_t bits = 0;
    if (a != 0) {
      int e = 0;
      const float m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
      bits =
          static_cast<uint16_t>(((e - 1 + 15) << 10) | static_cast<int>(std::ldexp(m * 2 - 1, 10)));
    }
    h[i] = static_cast<uint16_t>(bits | (xh[i] < 0 ? 0x8000 : 0));
  }
  const Quantized want_h = reference_tensor(xh, rows, cols, true);
  fp8::quantize_tensor(h.data(), DType::F16, rows, cols, ScaleFormat::ue8m0, q.data(), s.data());
  EXPECT_EQ(q, want_h.q);
  EXPECT_EQ(s, want_h.scales);
}

TEST(Fp8Quantizer, PartsFromSeveralPlacesEqualOneDenseSource) {
  // A 100 x 300 tile assembled from four rectangles of a column-major source
  // (the gathered path) gives the bytes of the dense row-major one.
  const int64_t rows = 100, cols = 300;
  std::mt19937 rng(13);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<uint16_t> dense(static_cast<size_t>(rows * cols)), colmajor(dense.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const uint16_t v = bf16_of(n(rng));
      dense[static_cast<size_t>(r * cols + c)] = v;
      colmajor[static_cast<size_t>(c * rows + r)] = v;
    }
  std::vector<uint8_t> want_q(dense.size()), got_q(dense.size());
  std::vector<float> want_s(3), got_s(3);
  fp8::quantize_tensor(dense.data(), DType::BF16, rows, cols, ScaleFormat::fp32, want_q.data(),
                       want_s.data());
  fp8::QuantProgram program;
  fp8::QuantTile t;
  t.rows = rows;
  t.cols = cols;
  t.dst = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(got_q.data()));
  t.dst_row_stride = cols;
  t.scale = static_cast<int64_t>(reinterpret_cast<std::uintptr_t>(got_s.data()));
  std::vector<fp8::QuantPart> parts;
  const auto base = reinterpret_cast<std::uintptr_t>(colmajor.data());
  for (auto [r0, nr, c0, nc] : {std::array<int32_t, 4>{0, 40, 0, 200},
                                {40, 60, 0, 200},
                                {0, 70, 200, 100},
                                {70, 30, 200, 100}}) {
    fp8::QuantPart p;
    p.src = static_cast<int64_t>(base + static_cast<std::uintptr_t>((c0 * rows + r0) * 2));
    p.row_stride = 1;
    p.col_stride = rows;
    p.row0 = r0;
    p.rows = nr;
    p.col0 = c0;
    p.cols = nc;
    parts.push_back(p);
  }
  program.add(t, parts);
  EXPECT_EQ(program.blocks(), 3);
  fp8::execute_quant_host(program, 0, 0);
  EXPECT_EQ(got_q, want_q);
  EXPECT_EQ(got_s, want_s);
}

TEST(Fp8Quantizer, ProgramRefusesBadTiles) {
  fp8::QuantProgram program;
  fp8::QuantTile t;
  t.rows = 129;
  t.cols = 4;
  fp8::QuantPart p;
  p.rows = 129;
  p.cols = 4;
  EXPECT_THROW(program.add(t, {&p, 1}), Error);  // more than one block row
  t.rows = p.rows = 8;
  t.src_dtype = DType::I32;
  EXPECT_THROW(program.add(t, {&p, 1}), Error);  // not a float source
  t.src_dtype = DType::BF16;
  p.cols = 3;
  EXPECT_THROW(program.add(t, {&p, 1}), Error);  // parts do not cover the tile
  p.cols = 4;
  p.col0 = 1;
  EXPECT_THROW(program.add(t, {&p, 1}), Error);  // part outside the tile
  p.col0 = 0;
  program.add(t, {&p, 1});
  EXPECT_EQ(program.tiles().size(), 1u);
}

}  // namespace
}  // namespace weightsync
