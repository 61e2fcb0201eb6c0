// baro_jax: the one fixed-order CPU arithmetic shared by every CPU kernel.
//
// Every dot product in csrc/cpu goes through baro::dot below: one fp32
// accumulator starting at 0 (or at `init`), index ascending, explicit std::fma,
// bf16 -> f32 by a 16-bit shift. Compiled with -ffp-contract=off
// -fno-fast-math, so the compiler neither fuses nor reorders anything else.
// The result for one output element depends only on its own inputs, never on
// how many rows a call has or where the row sits.
//
// Convention: uint16_t storage always means bfloat16.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace baro {

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Round-to-nearest-even, NaN stays NaN (quiet), sign kept.
inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN
    return static_cast<uint16_t>((u >> 16) | 0x0040u);
  }
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

// Round a float to bf16 precision, keeping it as float.
inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

inline float load(float x) { return x; }
inline float load(uint16_t x) { return bf16_to_f32(x); }

// THE dot product: acc = init; for k ascending: acc = fma(a[k*sa], b[k*sb], acc).
template <class TA, class TB>
inline float dot(const TA* a, std::ptrdiff_t sa, const TB* b, std::ptrdiff_t sb,
                 int64_t n, float init = 0.0f) {
  float acc = init;
  for (int64_t k = 0; k < n; ++k) {
    acc = std::fma(load(a[k * sa]), load(b[k * sb]), acc);
  }
  return acc;
}

// out[r * os] = dot(a, b + r * ldb, n) for r < rows. Eight rows share each load of a so
// their independent fma chains overlap; every accumulator still runs dot's exact
// sequence (init 0, k ascending, one fma per step), so the bits equal dot's.
template <class TA, class TB>
inline void dot_rows(const TA* a, const TB* b, std::ptrdiff_t ldb, int64_t rows, int64_t n,
                     float* out, std::ptrdiff_t os = 1) {
  constexpr int R = 8;
  int64_t r = 0;
  for (; r + R <= rows; r += R) {
    const TB* br = b + r * ldb;
    float acc[R] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t k = 0; k < n; ++k) {
      const float ak = load(a[k]);
      for (int j = 0; j < R; ++j) acc[j] = std::fma(ak, load(br[j * ldb + k]), acc[j]);
    }
    for (int j = 0; j < R; ++j) out[(r + j) * os] = acc[j];
  }
  for (; r < rows; ++r) out[r * os] = dot(a, 1, b + r * ldb, 1, n);
}

// Contiguous shorthand.
template <class TA, class TB>
inline float dot(const TA* a, const TB* b, int64_t n) {
  return dot(a, 1, b, 1, n);
}

// Elementwise helpers (fp32, libm, no fusion).
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x * sigmoid(x); }
inline float softplus(float x) {
  return std::fmax(x, 0.0f) + std::log1p(std::exp(-std::fabs(x)));
}
// 1 / sqrt(ss / n + eps)
inline float inv_rms(float ss, float n, float eps) {
  return 1.0f / std::sqrt(ss / n + eps);
}
// float(1 / sqrt(double(n))): the attention / delta scale.
inline float inv_sqrt_scale(int64_t n) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
}

}  // namespace baro
