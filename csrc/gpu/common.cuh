// baro_jax GPU: scalar helpers shared by every kernel (bf16 conversion, the
// elementwise functions, fixed-order warp reductions).
//
// Fixed order: a row reduction is always "lane l accumulates elements
// l, l+32, l+64, ... sequentially (explicit fmaf for squares), then the xor
// butterfly 16, 8, 4, 2, 1". The code never depends on m, on the row's
// position in a tile or on the block shape, so a row gets the same bits in a
// decode call (m = 1) and in a prefill call (m = C). Every lane ends with the
// same value (fp add/max are commutative, the butterfly is symmetric).
//
// Compiled with --fmad=false (nvcc) / -ffp-contract=off (hipcc): every fused
// multiply-add in this directory is an explicit fmaf.
#pragma once

#include <cmath>
#include <cstdint>

#include "portability.h"

namespace baro_gpu {

// ---- bf16 (stored as uint16_t) ----
BARO_DEV float bf16_to_f32(uint16_t b) {
  return __uint_as_float(static_cast<uint32_t>(b) << 16);
}

// Round-to-nearest-even, NaN stays a quiet NaN, sign kept (same as csrc/common/dot.h).
BARO_DEV uint16_t f32_to_bf16(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// f rounded to bf16 precision, kept as float (csrc/common/dot.h's round_bf16)
BARO_DEV float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// ---- elementwise (fp32, same formulas as the CPU kernels) ----
BARO_DEV float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
BARO_DEV float siluf_(float x) { return x * sigmoidf_(x); }
BARO_DEV float softplusf_(float x) { return fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x))); }
// 1 / sqrt(ss / n + eps)
BARO_DEV float inv_rms(float ss, float n, float eps) { return 1.0f / sqrtf(ss / n + eps); }

// ---- warp reductions (fixed butterfly) ----
BARO_DEV float warp_sum(float v) {
#pragma unroll
  for (int o = BARO_WARP / 2; o >= 1; o >>= 1) v = v + shfl_xor(v, o);
  return v;
}

BARO_DEV float warp_max(float v) {
#pragma unroll
  for (int o = BARO_WARP / 2; o >= 1; o >>= 1) v = fmaxf(v, shfl_xor(v, o));
  return v;
}

// Sum of squares of x[0..n) by one warp: lane-strided fmaf chain + butterfly.
// The lane's chain is x[lane]^2, x[lane+32]^2, ... in that order; the loads of
// 8 steps are issued before their fmas so a row costs a few memory latencies,
// not one per step (a single decode row is latency-bound).
BARO_DEV float warp_sumsq(const float* __restrict__ x, int n) {
  float acc = 0.0f;
  int i = lane_id();
  for (; i + 7 * BARO_WARP < n; i += 8 * BARO_WARP) {
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = x[i + j * BARO_WARP];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf(v[j], v[j], acc);
  }
  for (; i < n; i += BARO_WARP) acc = fmaf(x[i], x[i], acc);
  return warp_sum(acc);
}

BARO_DEV int imin(int a, int b) { return a < b ? a : b; }
BARO_DEV int imax(int a, int b) { return a > b ? a : b; }

}  // namespace baro_gpu
