// The element arithmetic of block FP8 quantization, shared word for word by
// the host quantizer (fp8.cpp) and the CUDA kernel (cuda/copy_kernel.cu), so
// both give the same bytes. Plain C++17 with __host__ __device__ under nvcc;
// no library headers.
//
// The formula (DESIGN.md "FP8 engines"; DeepGEMM's per_block_cast_to_fp8,
// which vLLM uses): per block, a = max(max|x| in FP32, 1e-4); s = a / 448 in
// FP32; with UE8M0 scales s = 2^ceil(log2 s); q = e4m3fn(x * (1/s)) with the
// reciprocal and the product in FP32, rounded to nearest even, saturating at
// 448. Every step is one correctly rounded FP32 operation, so the bits do not
// depend on the machine (no fused multiply-add can change them: the only sum,
// in the subnormal rounding below, adds to an exact product).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define WS_FP8_FN __host__ __device__ __forceinline__
#else
#define WS_FP8_FN inline
#endif

namespace weightsync::fp8 {

inline constexpr float kE4m3Max = 448.0f;
inline constexpr float kAmaxFloor = 1e-4f;  // torch's clamp(1e-4) on an FP32 tensor

WS_FP8_FN uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

WS_FP8_FN float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

WS_FP8_FN float bf16_to_f32(uint16_t h) {
  return bits_f32(static_cast<uint32_t>(h) << 16);
}

// IEEE half to float, exactly (subnormals, infinities and NaN included).
WS_FP8_FN float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7FFFu;
  if (em >= 0x7C00u) return bits_f32(sign | 0x7F800000u | ((em & 0x3FFu) << 13));
  if (em >= 0x0400u) return bits_f32(sign | ((em << 13) + 0x38000000u));
  const float v = static_cast<float>(em) * 5.9604644775390625e-8f;  // em * 2^-24, exact
  return sign ? -v : v;
}

// |x| ordered as an unsigned integer: the same order as the values for every
// non-NaN input (so the block maximum can be taken on the bits).
WS_FP8_FN uint32_t abs_bits_f32(float x) {
  return f32_bits(x) & 0x7FFFFFFFu;
}

// The block's scale from its max |x| (FP32).
WS_FP8_FN float block_scale(float amax, bool ue8m0) {
  const float a = amax >= kAmaxFloor ? amax : kAmaxFloor;  // a NaN amax takes the floor
  float s = a / kE4m3Max;
  if (ue8m0) {
    // 2^ceil(log2 s) from the bits: s is a positive normal float (>= 1e-4 / 448),
    // a power of two exactly when its mantissa is zero. (torch's
    // pow(2, ceil(log2(s))) rounds log2 to FP32 first; see docs/fp8.md.)
    const uint32_t u = f32_bits(s);
    if ((u & 0x7FFFFFu) != 0) s = bits_f32(((u >> 23) + 1) << 23);
  }
  return s;
}

// float -> float8_e4m3fn, round to nearest even, saturating at +-448; never
// NaN (a NaN input gives +-448).
WS_FP8_FN uint8_t e4m3_from_f32(float y) {
  const uint32_t u = f32_bits(y);
  const uint32_t sign = (u >> 24) & 0x80u;
  // |y| >= 448, infinities and NaN (whose bits order above all numbers): 448,
  // which the normal path below encodes as 0x7E.
  uint32_t b = u & 0x7FFFFFFFu;
  b = b < 0x43E00000u ? b : 0x43E00000u;
  // Normal results (|y| >= 2^-6): drop 20 mantissa bits, ties to even; a carry
  // into the exponent is the right result. Rebias 127 -> 7.
  const uint32_t normal = ((b + 0x7FFFFu + ((b >> 20) & 1u)) >> 20) - (120u << 3);
  // Subnormal results: round |y| / 2^-9 to an integer 0..8 (8 is 2^-6, the
  // smallest normal, whose encoding is 8 too) by adding 2^23 in FP32.
  const uint32_t sub = f32_bits(bits_f32(b) * 512.0f + 8388608.0f) - 0x4B000000u;
  const uint32_t r = b < 0x3C800000u ? sub : normal;
  return static_cast<uint8_t>(r | sign);
}

// float8_e4m3fn -> float (dequantizing in tests and tools).
WS_FP8_FN float e4m3_to_f32(uint8_t q) {
  const uint32_t sign = static_cast<uint32_t>(q & 0x80u) << 24;
  const uint32_t e = (q >> 3) & 0xFu, m = q & 0x7u;
  if ((q & 0x7Fu) == 0x7Fu) return bits_f32(sign | 0x7FC00000u);  // the one NaN code
  const float v = e == 0 ? static_cast<float>(m) * 0.001953125f   // m * 2^-9
                         : bits_f32(((e + 120u) << 23) | (m << 20));
  return sign ? -v : v;
}

}  // namespace weightsync::fp8
