// baro_delta (GPU): the gated delta-rule recurrence with fp32 state.
//
// The state columns S[:, c] of a value head are independent (kv[c], d[c], the
// update and o[c] only touch column c), so a block owns kCols columns of one
// value head and walks the valid rows in order. The recurrence is strictly
// sequential per token, so what matters is the per-token critical path and
// the number of warps in flight, not the arithmetic (4 flops per state
// element per token).
//
// CUDA layout: L lanes (8; 4 when dk = 16) share one column, each lane holding
// R = dk / L rows of it in registers: rows 4*(sub + L*i) + u (i < R/4, u < 4),
// so the L lanes of a column read one contiguous float4 each from the staged
// k and q (conflict-free, broadcast across the columns of a warp).
//
// Summation order of kv = S^T k and o = S^T q, the same code for every token,
// every m and every block (so m = 1 decode and prefill give the same bits):
//   1. in the lane, two accumulators a0 (u = 0, 2) and a1 (u = 1, 3), each an
//      fmaf chain over i ascending, u ascending; partial = a0 + a1;
//   2. xor butterfly over the L lanes of the column, offsets 16, 8, .. 32/L
//      (symmetric: every lane of the column ends with the same bits).
// The rounding points of docs/NUMERICS.md stay: S *= exp(g) (rounded), kv
// from the rounded S, d = (v - kv) * beta, S = fmaf(k, d, S), o from the new S.
//
// Tokens are staged kT at a time into shared memory with cp.async, double
// buffered: batch b+1 is in flight while batch b is consumed. Each block
// normalises its key head's q/k rows of the batch in place (one warp per row:
// lane float4 squares as an fmaf chain, then the 16..1 butterfly; independent
// of m and of the row's slot in the batch) and computes exp(g), beta per token
// with fixed per-row code. No scratch buffers: command-buffer compatible.
//
// The arithmetic of all of it (row sums and scales of q/k, the gates, decay and kv, the
// butterflies, the update, o's partials and their tree) is one set of device helpers
// (delta_sumsq4 .. delta_o_sum), shared by delta_kernel and by the pipelined one-token kernel
// delta_one_kernel (BARO_DELTA_ONE=pipe), so both run one order.
//
// HIP keeps the simple kernel (one thread per column, sequential chains over
// all dk rows): it has no cp.async, and 64 KB of LDS does not fit the stages.
//
// Rows mode (DeltaArgs::rows = P > 1, one token): P sequences' rows of y, b and a side by side,
// the state [P*nv, dk, dv]; every instance runs value head j of the P*nv as head j % nv of y's
// row j / nv. Only addresses change: a row index and a head of the row per value head.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common.cuh"
#include "contract.h"
#include "ffi_gpu.h"
#include "launch.h"

namespace baro_gpu {
namespace {

BARO_DEV int64_t delta_rows(const int32_t* p, int64_t m) {
  int64_t v = *p;
  return v < 0 ? 0 : (v > m ? m : v);
}

#if !BARO_HIP

// COLS: state columns per block (32, or 16 for two blocks per SM). It only
// groups columns; every column's arithmetic is the same either way.
// KT: tokens per staged batch (32; 1 for one-token calls). It only groups
// tokens into copies; every token runs the same code in the same order.
// MINB: blocks per SM the registers must allow (__launch_bounds__).
// COLS_FAST: the grid's x walks a head's column blocks (adjacent blocks read one head's
// contiguous state) instead of the heads.
// KV_GATHER: how the token's kv partials meet across a column's lanes (delta_kv_sum_v: 0 the
// butterfly, 1 / 2 the same value in fewer dependent round trips).
// STAGE_FIXED: the per-batch work in fewer instructions, the same copies and values: the 16-byte
// staging gives each thread one fixed chunk of a token's q, k or v columns and steps it token by
// token (one pointer add a copy) instead of dividing a flat copy index per copy, and the q/k
// normalisation forms each row's scale on one lane instead of on every lane of the warp. The
// many-token default (BARO_DELTA_STAGE=fixed): the delta op -18% at 4,096 and 8,192 tokens on an
// H100, an 8k prefill +5.7% (docs/PERF.md 2026-12-06). Four helper warps doing that work while the
// column warps walk the batch before were slower (+10%: the scan is issue-bound, and the helpers'
// instructions share the schedulers), and were removed.
template <int DK, int COLS, int KT = 32, int MINB = 1, bool COLS_FAST = false, int KV_GATHER = 0,
          bool STAGE_FIXED = false>
struct DeltaCfg {
  static constexpr int kKvGather = KV_GATHER;
  static constexpr bool kStageFixed = STAGE_FIXED;
  static constexpr int kT = KT;
  static constexpr int kMinBlocks = MINB;
  static constexpr bool kColsFast = COLS_FAST;
  static constexpr int kCols = COLS;
  static constexpr int L = DK >= 32 ? 8 : 4;  // lanes per column
  static constexpr int R = DK / L;            // state rows per lane
  static constexpr int CW = BARO_WARP / L;    // columns per warp
  static constexpr int kThreads = kCols * L;
  static constexpr int kWarps = kThreads / BARO_WARP;
  // one stage buffer (floats): q[kT][DK] k[kT][DK] v[kT][kCols] gate[kT][2]
  static constexpr int kQ = 0, kK = kT * DK, kV = 2 * kT * DK, kG = 2 * kT * DK + kT * kCols;
  static constexpr int kTileLd = kCols + 1;  // state tile row stride (bank spread)
  // a stage buffer also carries the state tile in and out
  static constexpr int kBuf = ((kG + 2 * kT > DK * kTileLd ? kG + 2 * kT : DK * kTileLd) + 3) / 4 * 4;
  static constexpr int kOpart = kT * kCols * L;  // o partials, after the two stage buffers
  static constexpr int kNormRows = 8;        // rows one warp normalises together (ILP)
  static_assert(R % 4 == 0 && R >= 4, "lane rows come in float4 groups");
  static_assert(DK / 4 <= BARO_WARP, "one float4 per lane per q/k row");
  static_assert(kCols % CW == 0 && kThreads % BARO_WARP == 0, "whole warps");
  static_assert(DK * kTileLd <= kBuf, "the state tile is staged in one stage buffer");
  static_assert(kBuf % 4 == 0 && kK % 4 == 0 && kV % 4 == 0 && kG % 2 == 0, "aligned slots");
};

BARO_DEV void cp_async16(float* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
BARO_DEV void cp_async4(float* smem, const float* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem) : "memory");
}
BARO_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
BARO_DEV void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
template <int N>
BARO_DEV void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// ---- The arithmetic, one copy for every instance (the order of the top comment) ----

// A lane's part of a q/k row's sum of squares: its float4 as an fmaf chain (x, y, z, w).
BARO_DEV float delta_sumsq4(float4 x) {
  float acc = 0.0f;
  acc = fmaf(x.x, x.x, acc);
  acc = fmaf(x.y, x.y, acc);
  acc = fmaf(x.z, x.z, acc);
  acc = fmaf(x.w, x.w, acc);
  return acc;
}
// The whole row's sum (after the warp's 16..1 butterfly) -> the row's scale.
BARO_DEV float delta_rnorm(float ss) { return 1.0f / sqrtf(ss + 1e-6f); }
// Normalised q (sc = scale) or k (sc = 1: x * 1.0f is exact).
BARO_DEV float4 delta_scale4(float4 x, float r, float sc) {
  return make_float4((x.x * r) * sc, (x.y * r) * sc, (x.z * r) * sc, (x.w * r) * sc);
}
// (exp(g), beta) of one token and head from its raw b, a.
BARO_DEV float2 delta_gates(float b, float a, float neg_exp_A, float dt_bias) {
  const float beta = sigmoidf_(b);
  const float g = neg_exp_A * softplusf_(a + dt_bias);
  return make_float2(expf(g), beta);
}
// S *= exp(g) (rounded) on the lane's rows, and the lane's kv partial from the decayed S:
// a0 over u = 0, 2 and a1 over u = 1, 3, i ascending, then a0 + a1.
template <int R>
BARO_DEV float delta_decay_kv(float (&s)[R], const float4 (&k)[R / 4], float e) {
  float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
  for (int i = 0; i < R / 4; ++i) {
    float* si = s + 4 * i;
    si[0] = si[0] * e;
    a0 = fmaf(si[0], k[i].x, a0);
    si[1] = si[1] * e;
    a1 = fmaf(si[1], k[i].y, a1);
    si[2] = si[2] * e;
    a0 = fmaf(si[2], k[i].z, a0);
    si[3] = si[3] * e;
    a1 = fmaf(si[3], k[i].w, a1);
  }
  return a0 + a1;
}
// kv over the L lanes of a column: xor butterfly, offsets 16, 8, .. 32/L (every lane of the
// column ends with the same bits).
template <int CW>
BARO_DEV float delta_kv_sum(float kv) {
#pragma unroll
  for (int off = BARO_WARP / 2; off >= CW; off >>= 1) kv = kv + shfl_xor(kv, off);
  return kv;
}
// The same value with fewer dependent shuffle round trips (the kv sum is on the token's chain):
// the butterfly leaves at lane x, for L = 8 (offsets 16, 8, 4),
//   ((p(x) + p(x^16)) + (p(x^8) + p(x^24))) + ((p(x^4) + p(x^20)) + (p(x^12) + p(x^28))),
// every node a + b with a the lane's own side (a + b == b + a, so the operand order at a node is
// free). KV_GATHER 1: the seven partners' partials by independent shuffles, then that tree (one
// round trip, seven shuffles); 2: the first level as the butterfly's, then the three partners'
// first-level sums (two round trips, four shuffles). L = 4 (offsets 16, 8): (p + p^16) + (p^8 + p^24).
template <int CW, int KV_GATHER>
BARO_DEV float delta_kv_sum_v(float kv) {
  if constexpr (KV_GATHER == 0 || CW == BARO_WARP / 2) {
    return delta_kv_sum<CW>(kv);
  } else if constexpr (CW == BARO_WARP / 4) {  // L = 4
    const float p16 = shfl_xor(kv, 16), p8 = shfl_xor(kv, 8), p24 = shfl_xor(kv, 24);
    return (kv + p16) + (p8 + p24);
  } else {
    static_assert(CW == BARO_WARP / 8, "L = 8 lanes a column (offsets 16, 8, 4)");
    if constexpr (KV_GATHER == 1) {
      const float p16 = shfl_xor(kv, 16), p8 = shfl_xor(kv, 8), p24 = shfl_xor(kv, 24);
      const float p4 = shfl_xor(kv, 4), p20 = shfl_xor(kv, 20), p12 = shfl_xor(kv, 12), p28 = shfl_xor(kv, 28);
      return ((kv + p16) + (p8 + p24)) + ((p4 + p20) + (p12 + p28));
    } else {
      const float a = kv + shfl_xor(kv, 16);
      const float a8 = shfl_xor(a, 8), a4 = shfl_xor(a, 4), a12 = shfl_xor(a, 12);
      return (a + a8) + (a4 + a12);
    }
  }
}
// S = fmaf(k, d, S) on the lane's rows.
template <int R>
BARO_DEV void delta_update(float (&s)[R], const float4 (&k)[R / 4], float d) {
#pragma unroll
  for (int i = 0; i < R / 4; ++i) {
    float* si = s + 4 * i;
    si[0] = fmaf(k[i].x, d, si[0]);
    si[1] = fmaf(k[i].y, d, si[1]);
    si[2] = fmaf(k[i].z, d, si[2]);
    si[3] = fmaf(k[i].w, d, si[3]);
  }
}
// The lane's o partial: b0 over u = 0, 2 and b1 over u = 1, 3, i ascending, then b0 + b1.
template <int R>
BARO_DEV float delta_o_partial(const float (&s)[R], const float4 (&q)[R / 4]) {
  float b0 = 0.0f, b1 = 0.0f;
#pragma unroll
  for (int i = 0; i < R / 4; ++i) {
    b0 = fmaf(s[4 * i + 0], q[i].x, b0);
    b1 = fmaf(s[4 * i + 1], q[i].y, b1);
    b0 = fmaf(s[4 * i + 2], q[i].z, b0);
    b1 = fmaf(s[4 * i + 3], q[i].w, b1);
  }
  return b0 + b1;
}
// o of a column from its L lanes' partials p[sub]: ((p0 + p1) + (p2 + p3)) + ((p4 + p5) +
// (p6 + p7)) for L = 8, (p0 + p1) + (p2 + p3) for L = 4. flush_o adds the partials staged in
// shared memory in that tree; in registers it is the xor butterfly with the offsets ascending
// (sub ^ 1, sub ^ 2, sub ^ 4: lane offsets CW, 2 CW, ..), the same sums (a + b == b + a).
BARO_DEV float delta_o_tree4(float4 x) { return (x.x + x.y) + (x.z + x.w); }
template <int CW>
BARO_DEV float delta_o_sum(float o) {
#pragma unroll
  for (int off = CW; off < BARO_WARP; off <<= 1) o = o + shfl_xor(o, off);
  return o;
}

template <typename Cf, int DK, int COLS>
__global__ void __launch_bounds__(Cf::kThreads, Cf::kMinBlocks) delta_kernel(DeltaArgs a) {
  constexpr int kT = Cf::kT;
  constexpr int kCols = COLS;
  constexpr int L = Cf::L, R = Cf::R, CW = Cf::CW, NT = Cf::kThreads, NW = Cf::kWarps;
  extern __shared__ __align__(16) float smem[];

  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id();
  const int j = static_cast<int>(Cf::kColsFast ? blockIdx.y : blockIdx.x);  // value head
  const int c0 = static_cast<int>(Cf::kColsFast ? blockIdx.x : blockIdx.y) * kCols;
  const int cl = warp * CW + lane % CW;  // this lane's column within the block
  const int sub = lane / CW;             // which rows of the column
  const int nk = a.nk, nv = a.nv, dv = a.dv, H = a.rows * nv;
  const int ncols = imin(kCols, dv - c0);
  const bool has = cl < ncols;
  const int kh = (j % nv) / (nv / nk);  // head j is y's row j / nv's head j % nv (row 0 unless rows mode)
  const int64_t C = static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(nv) * dv;
  const int64_t m = a.m;
  const int64_t nvld = delta_rows(a.n_valid, m);
  // 16-byte copies need aligned rows: y aligned, and C, the v offset and c0
  // multiples of 4 floats (2*nk*DK always is; dv decides the rest).
  const bool vec = (reinterpret_cast<uintptr_t>(a.y) & 15u) == 0 && (dv & 3) == 0;
  const float neg_exp_A = -expf(a.A_log[j % nv]);
  const float dt_bias = a.dt_bias[j % nv];
  const float scale = a.scale;

  // Padded rows leave no trace in the state and read as zeros.
  for (int64_t i = tid; i < (m - nvld) * ncols; i += NT) {
    const int64_t t = nvld + i / ncols;
    a.o[(t * H + j) * dv + c0 + i % ncols] = 0.0f;
  }

  // Raw q/k rows of key head kh, this block's v columns, b and a for tokens
  // [t0, t0 + nt) into buf (one cp.async group).
  auto stage = [&](float* buf, int64_t t0, int nt) {
    const int seq = j / nv, jh = j - seq * nv;  // (recomputed here: fewer registers live in the loop)
    if (Cf::kStageFixed && vec) {
      constexpr int QC = DK / 4, VC = kCols / 4, PER = 2 * QC + VC, TPP = NT / PER;  // tokens a pass
      static_assert(TPP >= 1, "one token's chunks fit the block");
      const int r = tid % PER, t_in = tid / PER;
      int64_t src_off;
      int dst, dst_step;
      bool ok = true;
      if (r < QC) {
        src_off = static_cast<int64_t>(kh) * DK + 4 * r, dst = Cf::kQ + 4 * r, dst_step = DK;
      } else if (r < 2 * QC) {
        src_off = static_cast<int64_t>(nk + kh) * DK + 4 * (r - QC), dst = Cf::kK + 4 * (r - QC), dst_step = DK;
      } else {
        const int q = r - 2 * QC;
        src_off = static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(jh) * dv + c0 + 4 * q;
        dst = Cf::kV + 4 * q, dst_step = kCols, ok = 4 * q < ncols;
      }
      if (t_in < TPP && ok) {
        const float* src = a.y + (seq + t0 + t_in) * C + src_off;
        for (int tt = t_in; tt < nt; tt += TPP, src += TPP * C) cp_async16(buf + dst + tt * dst_step, src);
      }
    } else if (vec) {
      constexpr int QC = DK / 4, VC = kCols / 4, PER = 2 * QC + VC;
      for (int i = tid; i < nt * PER; i += NT) {
        const int tt = i / PER, r = i % PER;
        const float* row = a.y + (seq + t0 + tt) * C;
        if (r < QC) {
          cp_async16(buf + Cf::kQ + tt * DK + 4 * r, row + kh * DK + 4 * r);
        } else if (r < 2 * QC) {
          const int q = r - QC;
          cp_async16(buf + Cf::kK + tt * DK + 4 * q, row + (nk + kh) * DK + 4 * q);
        } else {
          const int q = r - 2 * QC;
          if (4 * q < ncols)
            cp_async16(buf + Cf::kV + tt * kCols + 4 * q,
                       row + static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(jh) * dv + c0 + 4 * q);
        }
      }
    } else {
      constexpr int PER = 2 * DK + kCols;
      for (int i = tid; i < nt * PER; i += NT) {
        const int tt = i / PER, r = i % PER;
        const float* row = a.y + (seq + t0 + tt) * C;
        if (r < DK) {
          cp_async4(buf + Cf::kQ + tt * DK + r, row + kh * DK + r);
        } else if (r < 2 * DK) {
          cp_async4(buf + Cf::kK + tt * DK + (r - DK), row + (nk + kh) * DK + (r - DK));
        } else if (r - 2 * DK < ncols) {
          cp_async4(buf + Cf::kV + tt * kCols + (r - 2 * DK),
                    row + static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(jh) * dv + c0 + (r - 2 * DK));
        }
      }
    }
    for (int i = tid; i < 2 * nt; i += NT) {
      const float* src = (i & 1) ? a.a + (seq + t0 + (i >> 1)) * a.a_ld : a.b + (seq + t0 + (i >> 1)) * a.b_ld;
      cp_async4(buf + Cf::kG + i, src + jh);
    }
    cp_async_commit();
  };

  // In place: q <- q * (1/sqrt(sum q^2 + 1e-6)) * scale, k likewise without
  // scale; (b, a) <- (exp(g), beta). Row rho < nt is q of token rho, else k of
  // token rho - nt; warp w takes rows w, w + NW, ... kNormRows at a time.
  auto normalise = [&](float* buf, int nt) {
    constexpr int G = Cf::kNormRows;
    const bool mine = lane < DK / 4;
    for (int base = warp; base < 2 * nt; base += NW * G) {
      float4 x[G];
      float ss[G];
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int rho = base + g * NW;
        x[g] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (rho < 2 * nt && mine) {
          const float* p = buf + (rho < nt ? Cf::kQ + rho * DK : Cf::kK + (rho - nt) * DK);
          x[g] = *reinterpret_cast<const float4*>(p + 4 * lane);
        }
        ss[g] = delta_sumsq4(x[g]);
      }
#pragma unroll
      for (int off = BARO_WARP / 2; off >= 1; off >>= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) ss[g] = ss[g] + shfl_xor(ss[g], off);
      }
      // Every lane holds all G sums. kStageFixed: lane g alone forms row g's scale (one
      // square root and division for the G rows, not G) and the lanes take it by shuffle: the
      // same function of the same sum, so the same bits.
      float rl = 0.0f;
      if constexpr (Cf::kStageFixed) {
        float mine_ss = ss[0];
#pragma unroll
        for (int g = 1; g < G; ++g) mine_ss = lane == g ? ss[g] : mine_ss;
        rl = delta_rnorm(mine_ss);
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const int rho = base + g * NW;
        const float rg = Cf::kStageFixed ? __shfl_sync(0xffffffffu, rl, g) : 0.0f;
        if (rho < 2 * nt && mine) {
          const float r = Cf::kStageFixed ? rg : delta_rnorm(ss[g]);
          const float sc = rho < nt ? scale : 1.0f;
          float* p = buf + (rho < nt ? Cf::kQ + rho * DK : Cf::kK + (rho - nt) * DK);
          *reinterpret_cast<float4*>(p + 4 * lane) = delta_scale4(x[g], r, sc);
        }
      }
    }
    // Gates on the last warp's lanes (the q/k rows above are spread from warp 0).
    const int gt = tid - (NT - BARO_WARP);
    for (int tt = gt; tt >= 0 && tt < nt; tt += BARO_WARP) {
      float* gp = buf + Cf::kG + 2 * tt;
      const float2 eb = delta_gates(gp[0], gp[1], neg_exp_A, dt_bias);
      gp[0] = eb.x;
      gp[1] = eb.y;
    }
  };

  // State tile [DK][kCols] in through buf 1 (coalesced rows of the column
  // block), together with batch 0 into buf 0.
  if (nvld > 0) stage(smem, 0, static_cast<int>(nvld < kT ? nvld : kT));
  {
    float* tile = (smem + Cf::kBuf);
    const float* Sin = a.state_in + static_cast<int64_t>(j) * DK * dv + c0;
    for (int i = tid; i < DK * kCols; i += NT) {
      const int r = i / kCols, cc = i % kCols;
      if (cc < ncols)
        cp_async4(tile + r * Cf::kTileLd + cc, Sin + static_cast<int64_t>(r) * dv + cc);
      else
        tile[r * Cf::kTileLd + cc] = 0.0f;
    }
    cp_async_commit();
  }
  cp_async_wait_all();
  __syncthreads();
  float s[R];
#pragma unroll
  for (int i = 0; i < R / 4; ++i)
#pragma unroll
    for (int u = 0; u < 4; ++u) s[4 * i + u] = (smem + Cf::kBuf)[(4 * (sub + L * i) + u) * Cf::kTileLd + cl];

  // o partials [kT][kCols][L] of the batch, reduced over the L lanes by
  // flush_o in one fixed tree, the same for every token.
  float* const opart = smem + 2 * Cf::kBuf;
  auto flush_o = [&](int64_t t0, int nt) {
    for (int i = tid; i < nt * kCols; i += NT) {
      const int tt = i / kCols, cc = i % kCols;
      if (cc >= ncols) continue;
      const float4* p = reinterpret_cast<const float4*>(opart + (tt * kCols + cc) * L);
      const float4 x0 = p[0];
      float o;
      if constexpr (L == 8) {
        const float4 x1 = p[1];
        o = delta_o_tree4(x0) + delta_o_tree4(x1);
      } else {
        o = delta_o_tree4(x0);
      }
      a.o[((t0 + tt) * H + j) * dv + c0 + cc] = o;
    }
  };
  int b = 0;
  int64_t prev_t0 = 0;
  int prev_nt = 0;
  for (int64_t t0 = 0; t0 < nvld; t0 += kT, b ^= 1) {
    const int nt = static_cast<int>(nvld - t0 < kT ? nvld - t0 : kT);
    float* cur = smem + b * Cf::kBuf;
    // Batch t0 has landed (own copies) and is visible (barrier); the barrier
    // also ends every read of the other buffer (last batch / state tile) and
    // every write of the previous batch's o partials.
    cp_async_wait_all();
    __syncthreads();
    if (t0 + kT < nvld)
      stage(smem + (b ^ 1) * Cf::kBuf, t0 + kT, static_cast<int>(nvld - t0 - kT < kT ? nvld - t0 - kT : kT));
    flush_o(prev_t0, prev_nt);
    normalise(cur, nt);
    __syncthreads();

    // Token tt's o partial is formed in iteration tt + 1, in the same row
    // loop as token tt+1's decay and kv (two independent chains), so the
    // only per-token dependency is decay -> kv -> butterfly -> d -> update.
    // The next token's k and gates are loaded before the butterfly.
    const float4* k4 = reinterpret_cast<const float4*>(cur + Cf::kK) + sub;
    const float4* q4 = reinterpret_cast<const float4*>(cur + Cf::kQ) + sub;
    const float* vv = cur + Cf::kV + cl;
    const float2* gg = reinterpret_cast<const float2*>(cur + Cf::kG);
    float* op = opart + cl * L + sub;
    float4 ka[R / 4], kb[R / 4], qq[R / 4];
#pragma unroll
    for (int i = 0; i < R / 4; ++i) {
      ka[i] = k4[L * i];
      qq[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    float2 eb = gg[0];
    // One token: kk holds its k (loaded one token ahead), kn receives the
    // next token's. Two register sets, called alternately, so no copies.
    auto step = [&](int tt, const float4 (&kk)[R / 4], float4 (&kn)[R / 4]) {
      // o partial of token tt - 1 (from the state before this token's decay) and this
      // token's decay and kv: two independent chains the unrolled code interleaves.
      const float ob = delta_o_partial<R>(s, qq);
      const float kvp = delta_decay_kv<R>(s, kk, eb.x);
      if (tt > 0) op[(tt - 1) * kCols * L] = ob;
      const float v = has ? vv[tt * kCols] : 0.0f;
      const float beta = eb.y;
      const int tn = tt + 1 < nt ? tt + 1 : tt;
#pragma unroll
      for (int i = 0; i < R / 4; ++i) {
        qq[i] = q4[tt * (DK / 4) + L * i];
        kn[i] = k4[tn * (DK / 4) + L * i];
      }
      eb = gg[tn];
      const float kv = delta_kv_sum_v<CW, Cf::kKvGather>(kvp);
      const float d = (v - kv) * beta;
      delta_update<R>(s, kk, d);
    };
    int tt = 0;
    for (; tt + 1 < nt; tt += 2) {
      step(tt, ka, kb);
      step(tt + 1, kb, ka);
    }
    if (tt < nt) step(tt, ka, kb);
    op[(nt - 1) * kCols * L] = delta_o_partial<R>(s, qq);
    prev_t0 = t0;
    prev_nt = nt;
  }

  // State out through buf 0 (no copies are pending: the last batch staged
  // nothing). The block read its whole tile before the loop, so state_out may
  // be state_in.
  __syncthreads();
  flush_o(prev_t0, prev_nt);
  float* tile = smem;
#pragma unroll
  for (int i = 0; i < R / 4; ++i)
#pragma unroll
    for (int u = 0; u < 4; ++u) tile[(4 * (sub + L * i) + u) * Cf::kTileLd + cl] = s[4 * i + u];
  __syncthreads();
  float* Sout = a.state_out + static_cast<int64_t>(j) * DK * dv + c0;
  for (int i = tid; i < DK * kCols; i += NT) {
    const int r = i / kCols, cc = i % kCols;
    if (cc < ncols) Sout[static_cast<int64_t>(r) * dv + cc] = tile[r * Cf::kTileLd + cc];
  }
}

// ---- One token, pipelined: a persistent grid over (head, column block) tiles ----
//
// A one-token call is one state tile in and out per (head, column block) and little
// arithmetic, so the time is the copies. Each block walks the tiles w = blockIdx.x,
// + gridDim.x, .. (a head's column blocks adjacent) through a ring of P + 2 buffers: while
// tile n computes, tiles n+1 .. n+P are in flight (cp.async, one group each) and tile n-1
// drains from shared memory to state_out in 16-byte coalesced stores. One barrier per tile.
// The arithmetic is delta_kernel's for one token, through the same helpers: every warp forms
// the q and k row sums itself (delta_kernel's normalise: a lane's float4, then the 16..1
// butterfly) and scales its lanes' float4s; the gates by delta_gates; o's lane partials summed
// by the ascending butterfly, flush_o's tree. No scratch: command-buffer compatible.
template <int DK, int P, int MINB>
struct DeltaOneCfg {
  static constexpr int kDk = DK;
  static constexpr int kCols = 32;
  static constexpr int L = DK >= 32 ? 8 : 4;  // lanes per column, as DeltaCfg
  static constexpr int R = DK / L;
  static constexpr int CW = BARO_WARP / L;
  static constexpr int kThreads = kCols * L;
  static constexpr int kMinBlocks = MINB;
  static constexpr int kAhead = P;         // tiles in flight while one computes
  static constexpr int kBufs = P + 2;      // + the computing tile + the draining one
  // one buffer (floats): state tile [DK][32] (16-byte chunks swizzled by row), q[DK], k[DK],
  // v[32], then b, a, A_log, dt_bias of the head
  static constexpr int kQ = DK * kCols, kK = kQ + DK, kV = kK + DK, kG = kV + kCols;
  static constexpr int kBuf = kG + 4;
  static_assert(kBuf % 4 == 0 && kQ % 4 == 0 && kV % 4 == 0, "16-byte slots");
  static_assert(R % 4 == 0 && DK / 4 <= BARO_WARP, "as DeltaCfg");
  // The tile's element (r, c): row r of 32 floats, its 16-byte chunk c / 4 xor-ed with the
  // lane group of r, so a warp's register loads and stores (8 rows x 4 columns for L = 8,
  // 4 rows x 8 columns for L = 4) and the row-wise 16-byte copies are conflict-free.
  static BARO_DEV int at(int r, int c) {
    return r * kCols + ((((c >> 2) ^ (((r >> 2) & (L - 1)) * (8 / L))) << 2) | (c & 3));
  }
};

// VEC: 16-byte copies of the state and of y (aligned, dv a multiple of 4), else 4-byte ones.
template <typename Cf, bool VEC>
__global__ void __launch_bounds__(Cf::kThreads, Cf::kMinBlocks)
    delta_one_kernel(DeltaArgs a, int ncb, int tiles) {
  constexpr int DK = Cf::kDk, kCols = Cf::kCols;
  constexpr int L = Cf::L, R = Cf::R, CW = Cf::CW, NT = Cf::kThreads, NB = Cf::kBufs, P = Cf::kAhead;
  extern __shared__ __align__(16) float smem[];

  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id();
  const int cl = warp * CW + lane % CW;  // this lane's column within the tile
  const int sub = lane / CW;             // which rows of the column
  const int nk = a.nk, nv = a.nv, dv = a.dv, group = nv / nk;
  const int64_t C = static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(nv) * dv;  // y's row
  const bool run = delta_rows(a.n_valid, 1) > 0;  // n_valid 0: o = 0, the state copied through
  const float scale = a.scale;
  const int G = static_cast<int>(gridDim.x);

  // 16-byte copies (VEC): thread tid moves the chunk of columns cq .. cq + 3 of rows
  // cr + kRowsPer * p; the swizzle repeats every 4 L rows, so one smem offset and stride.
  constexpr int kChunks = kCols / 4, kRowsPer = NT / kChunks, kPasses = DK / kRowsPer;
  static_assert(kRowsPer % (4 * L) == 0 && DK % kRowsPer == 0, "whole passes");
  static_assert(DK / 2 + kChunks <= NT, "q, k, v chunks in one pass");
  const int cr = tid / kChunks, cq = 4 * (tid % kChunks);
  const int soff = Cf::at(cr, cq);
  const int64_t goff = static_cast<int64_t>(cr) * dv + cq;
  // 4-byte copies (!VEC): thread tid moves column ec of rows er + L * p.
  const int ec = tid % kCols, er = tid / kCols;

  // Tile w's state, q/k rows of its key head, v columns and gate scalars into buf (one group,
  // empty past the last tile, so the group count stays one per tile).
  auto fetch = [&](int w, float* buf) {
    if (w < tiles) {
      const int j = w / ncb, c0 = (w % ncb) * kCols;
      const int seq = j / nv, jh = j - seq * nv;  // y's row of head j (0 unless rows mode), its head there
      const int ncols = imin(kCols, dv - c0), kh = jh / group;
      const float* Sin = a.state_in + static_cast<int64_t>(j) * DK * dv + c0;
      const float* yr = a.y + seq * C;
      const float* yq = yr + static_cast<int64_t>(kh) * DK;
      const float* yk = yr + static_cast<int64_t>(nk + kh) * DK;
      const float* yv = yr + static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(jh) * dv + c0;
      if constexpr (VEC) {
#pragma unroll
        for (int p = 0; p < kPasses; ++p) {
          float* dst = buf + soff + p * kRowsPer * kCols;
          if (cq < ncols)
            cp_async16(dst, Sin + goff + static_cast<int64_t>(p) * kRowsPer * dv);
          else
            *reinterpret_cast<float4*>(dst) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        if (tid < DK / 4)
          cp_async16(buf + Cf::kQ + 4 * tid, yq + 4 * tid);
        else if (tid < DK / 2)
          cp_async16(buf + Cf::kK + 4 * (tid - DK / 4), yk + 4 * (tid - DK / 4));
        else if (tid < DK / 2 + kChunks && 4 * (tid - DK / 2) < ncols)
          cp_async16(buf + Cf::kV + 4 * (tid - DK / 2), yv + 4 * (tid - DK / 2));
      } else {
        const float* src = Sin + static_cast<int64_t>(er) * dv + ec;
#pragma unroll 1
        for (int r = er; r < DK; r += NT / kCols, src += static_cast<int64_t>(NT / kCols) * dv) {
          if (ec < ncols)
            cp_async4(buf + Cf::at(r, ec), src);
          else
            buf[Cf::at(r, ec)] = 0.0f;
        }
        for (int i = tid; i < 2 * DK + kCols; i += NT) {
          if (i < DK)
            cp_async4(buf + Cf::kQ + i, yq + i);
          else if (i < 2 * DK)
            cp_async4(buf + Cf::kK + (i - DK), yk + (i - DK));
          else if (i - 2 * DK < ncols)
            cp_async4(buf + Cf::kV + (i - 2 * DK), yv + (i - 2 * DK));
        }
      }
      if (tid < 4) {
        const float* src = tid == 0 ? a.b + seq * a.b_ld : tid == 1 ? a.a + seq * a.a_ld : tid == 2 ? a.A_log : a.dt_bias;
        cp_async4(buf + Cf::kG + tid, src + jh);
      }
    }
    cp_async_commit();
  };

  // Tile w's state from buf to state_out, 16-byte rows of the column block where they fit.
  auto drain = [&](int w, const float* buf) {
    const int j = w / ncb, c0 = (w % ncb) * kCols;
    const int ncols = imin(kCols, dv - c0);
    float* Sout = a.state_out + static_cast<int64_t>(j) * DK * dv + c0;
    if constexpr (VEC) {
      if (cq < ncols) {
#pragma unroll
        for (int p = 0; p < kPasses; ++p)
          *reinterpret_cast<float4*>(Sout + goff + static_cast<int64_t>(p) * kRowsPer * dv) =
              *reinterpret_cast<const float4*>(buf + soff + p * kRowsPer * kCols);
      }
    } else if (ec < ncols) {
      float* dst = Sout + static_cast<int64_t>(er) * dv + ec;
#pragma unroll 1
      for (int r = er; r < DK; r += NT / kCols, dst += static_cast<int64_t>(NT / kCols) * dv) *dst = buf[Cf::at(r, ec)];
    }
  };

  // The lane's rows 4 * (sub + L * i) + u of column cl: one offset per (i, u) past `base`.
  const int base = Cf::at(4 * sub, cl);

  int w = static_cast<int>(blockIdx.x);
#pragma unroll
  for (int p = 0; p < P; ++p) fetch(w + p * G, smem + p * Cf::kBuf);
  int nb = 0;  // buffer of tile w
  for (; w < tiles; w += G, nb = nb + 1 == NB ? 0 : nb + 1) {
    float* buf = smem + nb * Cf::kBuf;
    // Tile w has landed (own copies) and is visible (barrier); the barrier also ends the
    // previous iteration: its drain of tile w - 2G (buffer nb - 2, reused below) and its
    // writes of tile w - G's new state (drained below).
    cp_async_wait<P - 1>();
    __syncthreads();
    const int nf = nb + P >= NB ? nb + P - NB : nb + P;
    fetch(w + P * G, smem + nf * Cf::kBuf);
    if (w >= G) drain(w - G, smem + (nb == 0 ? NB - 1 : nb - 1) * Cf::kBuf);

    const int j = w / ncb, c0 = (w % ncb) * kCols;
    const bool has = cl < dv - c0;
    if (!run) {
      if (sub == 0 && has) a.o[static_cast<int64_t>(j) * dv + c0 + cl] = 0.0f;
      continue;  // the tile goes out as it came in
    }
    const float4* q4 = reinterpret_cast<const float4*>(buf + Cf::kQ);
    const float4* k4 = reinterpret_cast<const float4*>(buf + Cf::kK);
    // q and k row sums, both rows in every warp (delta_kernel's normalise, per row)
    float ssq = 0.0f, ssk = 0.0f;
    {
      const bool mine = lane < DK / 4;
      const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      ssq = delta_sumsq4(mine ? q4[lane] : z);
      ssk = delta_sumsq4(mine ? k4[lane] : z);
#pragma unroll
      for (int off = BARO_WARP / 2; off >= 1; off >>= 1) {
        ssq = ssq + shfl_xor(ssq, off);
        ssk = ssk + shfl_xor(ssk, off);
      }
    }
    const float* gp = buf + Cf::kG;
    const float2 eb = delta_gates(gp[0], gp[1], -expf(gp[2]), gp[3]);
    const float rk = delta_rnorm(ssk);
    float s[R];
    float4 kk[R / 4];
#pragma unroll
    for (int i = 0; i < R / 4; ++i) {
      kk[i] = delta_scale4(k4[sub + L * i], rk, 1.0f);
#pragma unroll
      for (int u = 0; u < 4; ++u) s[4 * i + u] = buf[base + (4 * L * i + u) * kCols];
    }
    const float kv = delta_kv_sum<CW>(delta_decay_kv<R>(s, kk, eb.x));
    const float v = has ? buf[Cf::kV + cl] : 0.0f;
    const float d = (v - kv) * eb.y;
    delta_update<R>(s, kk, d);
    const float rq = delta_rnorm(ssq);
    float4 qq[R / 4];
#pragma unroll
    for (int i = 0; i < R / 4; ++i) qq[i] = delta_scale4(q4[sub + L * i], rq, scale);
    const float o = delta_o_sum<CW>(delta_o_partial<R>(s, qq));
    if (sub == 0 && has) a.o[static_cast<int64_t>(j) * dv + c0 + cl] = o;
    // the new state over the old, each lane on the elements it read (drained next iteration)
#pragma unroll
    for (int i = 0; i < R / 4; ++i)
#pragma unroll
      for (int u = 0; u < 4; ++u) buf[base + (4 * L * i + u) * kCols] = s[4 * i + u];
  }
  // the last tile
  if (w >= G) {  // always: the grid is at most one block per tile
    __syncthreads();
    drain(w - G, smem + (nb == 0 ? NB - 1 : nb - 1) * Cf::kBuf);
  }
}

template <int DK, int P, int MINB>
gpuError_t launch_delta_one(const DeltaArgs& a, gpuStream_t stream) {
  using Cf = DeltaOneCfg<DK, P, MINB>;
  const int ncb = (a.dv + Cf::kCols - 1) / Cf::kCols;
  const int64_t tiles = static_cast<int64_t>(a.rows) * a.nv * ncb;  // < 2^30 (launch_delta_dk)
  const int64_t slots = static_cast<int64_t>(MINB) * sm_count();
  const unsigned grid = static_cast<unsigned>(tiles < slots ? tiles : slots);
  // 16-byte copies: aligned rows of y and of the state (dv a multiple of 4 floats)
  const bool vec = is_aligned(a.y, 16) && is_aligned(a.state_in, 16) && is_aligned(a.state_out, 16) &&
                   (a.dv & 3) == 0;
  const size_t smem = sizeof(float) * Cf::kBufs * Cf::kBuf;  // 70,208 B for dk = 128, P = 2
  auto kernel = vec ? delta_one_kernel<Cf, true> : delta_one_kernel<Cf, false>;
  if (smem > 48 * 1024) {
    gpuError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    // MINB blocks of 70 KB need most of the SM's 228 KB as shared memory (the kernel reads
    // nothing through L1)
    if (e == gpuSuccess)
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
    if (e != gpuSuccess) return e;
  }
  kernel<<<grid, Cf::kThreads, smem, stream>>>(a, ncb, static_cast<int>(tiles));
  return gpuGetLastError();
}

template <int DK, int COLS, int KT = 32, int MINB = 1, bool COLS_FAST = false, int KV_GATHER = 0,
          bool STAGE_FIXED = false>
gpuError_t launch_delta_cols(const DeltaArgs& a, gpuStream_t stream) {
  using Cf = DeltaCfg<DK, COLS, KT, MINB, COLS_FAST, KV_GATHER, STAGE_FIXED>;
  const int64_t col_blocks = (a.dv + COLS - 1) / COLS;
  const int64_t heads = static_cast<int64_t>(a.rows) * a.nv;
  if (col_blocks > 65535 || (COLS_FAST && heads > 65535)) return gpuErrorInvalidValue;
  const dim3 grid = COLS_FAST ? dim3(static_cast<unsigned>(col_blocks), static_cast<unsigned>(heads))
                              : dim3(static_cast<unsigned>(heads), static_cast<unsigned>(col_blocks));
  const size_t smem = sizeof(float) * (2 * Cf::kBuf + Cf::kOpart);  // 107,008 B for dk = 128, COLS = 32
  if (smem > 48 * 1024) {
    const gpuError_t e = cudaFuncSetAttribute(
        delta_kernel<Cf, DK, COLS>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != gpuSuccess) return e;
  }
  delta_kernel<Cf, DK, COLS><<<grid, Cf::kThreads, smem, stream>>>(a);
  return gpuGetLastError();
}

// Columns per block: 32 by default; BARO_DELTA_COLS=16 gives twice the blocks
// (two per SM). Speed only: the bits are the same. Read per call, as every knob.
int delta_cols() { return baro::knobs::is(baro::knobs::kDeltaCols, "16") ? 16 : 32; }

// One token (a decode step; many sequences' heads side by side in one call): a block's work is
// one state tile in and out, so the time is copy latency, and the blocks an SM holds decide it.
// One-token batches shrink the stage buffers to the tile (35 KB instead of 105 KB for dk = 128)
// and the register bound lets three blocks share an SM instead of two: 135 us instead of 165
// per layer for 64 sequences on the H200 (four blocks, with spills, 139). BARO_DELTA_ONE: cols
// (a head's column blocks adjacent in the grid), heads (the heads adjacent, as the 32-token
// kernel), pipe (delta_one_kernel: a persistent grid, three blocks per SM, two tiles in flight
// per block while one computes and one drains), off (the 32-token kernel). Same bits.
// auto: pipe where a block gets more than one tile to overlap (more tiles than SMs: 64 sequences
// on the H200, 131 -> 77 us per layer, a step 24.2 -> 22.6 ms, cc73a2a), cols otherwise (one
// sequence: 128 tiles, nothing to overlap; measured there at 250 tok/s).
template <int DK>
gpuError_t launch_delta_dk(const DeltaArgs& a, gpuStream_t stream) {
  namespace k = baro::knobs;
  if (a.m == 1 && delta_cols() == 32 && !k::is(k::kDeltaOne, "off")) {
    const int64_t heads = static_cast<int64_t>(a.rows) * a.nv;
    const int64_t tiles = heads * ((a.dv + 31) / 32);
    const bool pipe = k::is(k::kDeltaOne, "pipe") || (k::is(k::kDeltaOne, "auto") && tiles > sm_count());
    if (pipe && tiles < (int64_t{1} << 30)) return launch_delta_one<DK, 2, 3>(a, stream);
    if ((k::is(k::kDeltaOne, "auto") || k::is(k::kDeltaOne, "cols")) && heads <= 65535)
      return launch_delta_cols<DK, 32, 1, 3, true>(a, stream);
    return launch_delta_cols<DK, 32, 1, 3>(a, stream);
  }
  if (delta_cols() == 16) return launch_delta_cols<DK, 16>(a, stream);
  if (k::is(k::kDeltaKv, "gather")) return launch_delta_cols<DK, 32, 32, 1, false, 1>(a, stream);
  if (k::is(k::kDeltaKv, "two")) return launch_delta_cols<DK, 32, 32, 1, false, 2>(a, stream);
  if (k::is(k::kDeltaStage, "index")) return launch_delta_cols<DK, 32>(a, stream);
  return launch_delta_cols<DK, 32, 32, 1, false, 0, true>(a, stream);
}

#else  // BARO_HIP: one thread per column, the q/k norms by one warp each

template <int DK>
__global__ void __launch_bounds__(kDeltaColsPerBlock) delta_kernel(DeltaArgs a) {
  static_assert(kDeltaColsPerBlock == 2 * BARO_WARP, "warp 0: q norm, warp 1: k norm");
  __shared__ float qn[DK];
  __shared__ float kn[DK];
  __shared__ float gates[2];  // exp(g), beta

  const int j = blockIdx.x;  // value head
  const int c = static_cast<int>(blockIdx.y) * kDeltaColsPerBlock + static_cast<int>(threadIdx.x);
  const bool has = c < a.dv;
  const int nk = a.nk, nv = a.nv, dv = a.dv, H = a.rows * nv;
  const int seq = j / nv, jh = j - seq * nv;  // y's row of head j (0 unless rows mode), its head there
  const int kh = jh / (nv / nk);
  const int64_t C = static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(nv) * dv;
  const int64_t m = a.m;
  const int64_t nvld = delta_rows(a.n_valid, m);
  const int warp = warp_id(), lane = lane_id();

  float s[DK];
  const float* Sin = a.state_in + static_cast<int64_t>(j) * DK * dv;
#pragma unroll
  for (int r = 0; r < DK; ++r) s[r] = has ? Sin[static_cast<int64_t>(r) * dv + c] : 0.0f;

  const float A_log = a.A_log[jh], dt_bias = a.dt_bias[jh];
  for (int64_t t = 0; t < nvld; ++t) {
    const float* yr = a.y + (seq + t) * C;
    __syncthreads();  // previous row's qn/kn/gates fully consumed
    if (warp == 0) {
      const float* q = yr + static_cast<int64_t>(kh) * DK;
      const float rq = 1.0f / sqrtf(warp_sumsq(q, DK) + 1e-6f);
      for (int r = lane; r < DK; r += BARO_WARP) qn[r] = (q[r] * rq) * a.scale;
    } else {
      const float* k = yr + static_cast<int64_t>(nk + kh) * DK;
      const float rk = 1.0f / sqrtf(warp_sumsq(k, DK) + 1e-6f);
      for (int r = lane; r < DK; r += BARO_WARP) kn[r] = k[r] * rk;
      if (lane == 0) {
        const float beta = sigmoidf_(a.b[(seq + t) * a.b_ld + jh]);
        const float g = -expf(A_log) * softplusf_(a.a[(seq + t) * a.a_ld + jh] + dt_bias);
        gates[0] = expf(g);
        gates[1] = beta;
      }
    }
    __syncthreads();
    if (has) {
      const float e = gates[0], beta = gates[1];
      float kv = 0.0f;
#pragma unroll
      for (int r = 0; r < DK; ++r) {
        s[r] = s[r] * e;
        kv = fmaf(s[r], kn[r], kv);
      }
      const float v = yr[static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(jh) * dv + c];
      const float d = (v - kv) * beta;
      float ov = 0.0f;
#pragma unroll
      for (int r = 0; r < DK; ++r) {
        s[r] = fmaf(kn[r], d, s[r]);
        ov = fmaf(s[r], qn[r], ov);
      }
      a.o[(t * H + j) * dv + c] = ov;
    }
  }
  if (has) {
    for (int64_t t = nvld; t < m; ++t) a.o[(t * H + j) * dv + c] = 0.0f;  // padded rows
    float* Sout = a.state_out + static_cast<int64_t>(j) * DK * dv;
#pragma unroll
    for (int r = 0; r < DK; ++r) Sout[static_cast<int64_t>(r) * dv + c] = s[r];
  }
}

template <int DK>
gpuError_t launch_delta_dk(const DeltaArgs& a, gpuStream_t stream) {
  const int64_t col_blocks = (a.dv + kDeltaColsPerBlock - 1) / kDeltaColsPerBlock;
  const int64_t heads = static_cast<int64_t>(a.rows) * a.nv;
  if (col_blocks > 65535 || heads > 0x7fffffffLL) return gpuErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(col_blocks));
  delta_kernel<DK><<<grid, kDeltaColsPerBlock, 0, stream>>>(a);
  return gpuGetLastError();
}

#endif  // BARO_HIP

}  // namespace

bool delta_supported_dk(int dk) { return dk == 16 || dk == 32 || dk == 64 || dk == 128; }

gpuError_t launch_delta(const DeltaArgs& a, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (a.nv <= 0 || a.dv <= 0 || a.rows <= 0) return gpuSuccess;
  if (!delta_supported_dk(a.dk) || a.nk <= 0 || a.nv % a.nk != 0) return gpuErrorInvalidValue;
  switch (a.dk) {
    case 16: return launch_delta_dk<16>(a, stream);
    case 32: return launch_delta_dk<32>(a, stream);
    case 64: return launch_delta_dk<64>(a, stream);
    case 128: return launch_delta_dk<128>(a, stream);
    default: return gpuErrorInvalidValue;
  }
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handler (same operands/results as BaroDeltaCpu, docs/FFI.md)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

ffi::Error DeltaGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> yb, ffi::Buffer<ffi::F32> b,
                        ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> A_log,
                        ffi::Buffer<ffi::F32> dt_bias, ffi::Buffer<ffi::F32> state,
                        ffi::Buffer<ffi::S32> n_valid_buf, int64_t b_col, int64_t a_col, int64_t rows,
                        ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> state_out) {
  const char* op = "baro_delta";
  baro::DeltaDims dims;
  if (auto err = baro::check_delta(yb, b, a, A_log, dt_bias, state, n_valid_buf, *o, *state_out, dims, op,
                                   b_col, a_col, rows);
      err.failure())
    return err;
  const int64_t m = dims.m, nv = dims.nv, dk = dims.dk, dv = dims.dv, nk = dims.nk, P = dims.P;
  BARO_CHECK(baro_gpu::delta_supported_dk(static_cast<int>(dk)), op,
             "the GPU kernel supports key head dims 16, 32, 64, 128; got dk=" << dk);
  BARO_CHECK(P * nv <= 0x7fffffffLL && dv <= 65535LL * baro_gpu::kDeltaColsPerBlock &&
                 nk <= 0x7fffffffLL,
             op, "state shape " << baro::dims_str(state.dimensions()) << " too large for the GPU grid");

  baro_gpu::DeltaArgs args;
  args.y = yb.typed_data();
  args.b = b.typed_data() + dims.b_off;
  args.a = a.typed_data() + dims.a_off;
  args.b_ld = dims.b_ld;
  args.a_ld = dims.a_ld;
  args.A_log = A_log.typed_data();
  args.dt_bias = dt_bias.typed_data();
  // Each block reads its whole (head, column block) state tile before it
  // writes it, and no two blocks share a tile: correct aliased or not.
  args.state_in = state.typed_data();
  args.state_out = state_out->typed_data();
  args.n_valid = n_valid_buf.typed_data();
  args.o = o->typed_data();
  args.m = m;
  args.nk = static_cast<int>(nk);
  args.nv = static_cast<int>(nv);
  args.dk = static_cast<int>(dk);
  args.dv = static_cast<int>(dv);
  args.rows = static_cast<int>(P);
  args.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)));
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_delta(args, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroDeltaGpu, baro::KnobChecked<DeltaGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // y
                                  .Arg<ffi::Buffer<ffi::F32>>()   // b
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a
                                  .Arg<ffi::Buffer<ffi::F32>>()   // A_log
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dt_bias
                                  .Arg<ffi::Buffer<ffi::F32>>()   // state
                                  .Arg<ffi::Buffer<ffi::S32>>()   // n_valid
                                  .Attr<int64_t>("b_col")  // b's first gate column (-1: b is [m, nv])
                                  .Attr<int64_t>("a_col")
                                  .Attr<int64_t>("rows")  // 1: rows mode (y [P, C], state [P*nv, dk, dv])
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // state
                              {ffi::Traits::kCmdBufferCompatible});
