// baro_jax GPU: THE dot helper. Every dot product in csrc/gpu (matmul, MoE
// experts and router, attention QK^T and PV) goes through mma_16816 below;
// there is exactly one order per platform.
//
// Interface (both platforms): a warp-level 16x8x16 multiply-accumulate
//     C[16 x 8] += A[16 x 16] * B[16 x 8]
// with A and B in shared memory (bf16) and C in registers in the PTX
// m16n8k16 accumulator layout: lane = 4*g + t (g = lane/4, t = lane%4) holds
//     c[0] = C[g][2t], c[1] = C[g][2t+1], c[2] = C[g+8][2t], c[3] = C[g+8][2t+1].
// Callers walk K in ascending 16-wide steps into ONE fp32 accumulator
// fragment, no split-K. Then the value of C[r][n] depends only on row r of A
// and column n of B, never on the other rows of the tile (docs/DESIGN.md §2:
// measured row- and tile-invariant on H200).
//
// Operand addressing:
//   load_a(f, p, ld):     A[r][k] = p[r*ld + k]            (row-major, r < 16, k < 16)
//   load_b_nk(f, p, ld):  B[k][n] = p[n*ld + k]            (W[N,K] rows, n < 8)
//   load_b_kn(f, p, ld):  B[k][n] = p[k*ld + n]            (V[j][d] rows, k < 16)
// ld in elements, even; p 4-byte aligned.
//
// NVIDIA: mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32. Fragment
// layout (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point
// type"): A regs {A[g][2t..2t+1], A[g+8][2t..2t+1], A[g][2t+8..2t+9],
// A[g+8][2t+8..2t+9]}, B regs {B[2t..2t+1][g], B[2t+8..2t+9][g]}, the lower k
// index in the low 16 bits.
//
// AMD (HIP): no tensor cores are used. The same C layout is computed by each
// lane as a sequential fp32 fmaf chain over k = 0..15 (so over a whole K walk
// the order is simply k ascending, one accumulator). The "fragments" are just
// shared-memory references, so A and B must stay in shared memory, unchanged,
// until mma_16816 has run (true for every caller: load and mma happen in the
// same k-step, between the same pair of __syncthreads).
#pragma once

#include <cstdint>

#include "common.cuh"
#include "portability.h"

namespace baro_gpu {

#if BARO_HIP

struct FragA {
  const uint16_t* p;
  int ld;
};
struct FragB {
  const uint16_t* p;
  int sn, sk;  // element (n, k) at p[n*sn + k*sk]
};

BARO_DEV void load_a(FragA& f, const uint16_t* p, int ld) {
  f.p = p;
  f.ld = ld;
}
BARO_DEV void load_b_nk(FragB& f, const uint16_t* p, int ld) {
  f.p = p;
  f.sn = ld;
  f.sk = 1;
}
BARO_DEV void load_b_kn(FragB& f, const uint16_t* p, int ld) {
  f.p = p;
  f.sn = 1;
  f.sk = ld;
}

BARO_DEV void mma_16816(float c[4], const FragA& a, const FragB& b) {
  const int lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = g + 8 * (i >> 1);
    const int n = 2 * t + (i & 1);
    const uint16_t* ar = a.p + r * a.ld;
    const uint16_t* bc = b.p + n * b.sn;
    float acc = c[i];
#pragma unroll
    for (int k = 0; k < 16; ++k) acc = fmaf(bf16_to_f32(ar[k]), bf16_to_f32(bc[k * b.sk]), acc);
    c[i] = acc;
  }
}

#else  // NVIDIA tensor cores

struct FragA {
  uint32_t r[4];
};
struct FragB {
  uint32_t r[2];
};

BARO_DEV uint32_t lds32(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
BARO_DEV uint32_t pack2(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

BARO_DEV void load_a(FragA& f, const uint16_t* p, int ld) {
  const int lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  f.r[0] = lds32(p + g * ld + 2 * t);
  f.r[1] = lds32(p + (g + 8) * ld + 2 * t);
  f.r[2] = lds32(p + g * ld + 2 * t + 8);
  f.r[3] = lds32(p + (g + 8) * ld + 2 * t + 8);
}

BARO_DEV void load_b_nk(FragB& f, const uint16_t* p, int ld) {
  const int lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  f.r[0] = lds32(p + g * ld + 2 * t);
  f.r[1] = lds32(p + g * ld + 2 * t + 8);
}

BARO_DEV void load_b_kn(FragB& f, const uint16_t* p, int ld) {
  const int lane = lane_id();
  const int g = lane >> 2, t = lane & 3;
  f.r[0] = pack2(p[(2 * t) * ld + g], p[(2 * t + 1) * ld + g]);
  f.r[1] = pack2(p[(2 * t + 8) * ld + g], p[(2 * t + 9) * ld + g]);
}

BARO_DEV void mma_16816(float c[4], const FragA& a, const FragB& b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[0]), "r"(b.r[1]));
}

#endif

// Position of accumulator element i (0..3) of this lane inside the 16x8 tile.
BARO_DEV int frag_row(int i) { return (lane_id() >> 2) + 8 * (i >> 1); }
BARO_DEV int frag_col(int i) { return 2 * (lane_id() & 3) + (i & 1); }

}  // namespace baro_gpu
