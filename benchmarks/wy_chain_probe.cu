// What the WY form of the blocked delta rule (docs/PERF.md, open levers: "the chunk-aligned delta
// rule as MMAs") would leave on the sequential chain, timed alone before any of it is built into
// the library. Per value head, per 64-row block b, with S0 the state at the block's start and the
// S0-free operands formed beforehand for every block at once (here random, at realistic scales):
//   U   = X - W S0                      (64 x dv, K = dk)
//   O   = G (Q S0) + Aqk U              (64 x dv, K = dk and K = 64; Aqk lower triangular)
//   S0' = GB S0 + (e K)^T U             (dk x dv, K = 64)
// Products in 3xTF32 mma.sync.m16n8k8 (x = hi + lo; lo_a hi_b, hi_a lo_b, hi_a hi_b into one fp32
// accumulator), the blocked rule's precision. The grid is value heads x dv / 32 column slices,
// 4 (or 8) warps a CTA, one CTA an SM; the S0-free operands sit in global memory as fp32 in mma-fragment
// order (a lane's four A values of a tile in one 16-byte word), are copied by cp.async into shared
// memory a phase ahead and split when a warp loads its tile; S0 and U are shared memory in
// B-fragment order, split once when written. (Split A operands would not fit: 272 KB a CTA.)
//
// Then the part off the chain (wy_prep: one CTA per (head, block), all at once) forms those
// operands from the rule's own inputs (normalised q, k, v, beta, the log-decay gate), and prep +
// chain are checked against the per-token recurrence in float64. wy_prep_regs is the same prep with
// the substitution in registers and the outputs written as whole float4 words; its outputs are
// compared byte for byte with wy_prep's.
//
// Prints JSON lines: per variant the time of one layer's chain over N tokens (ms; the fastest of
// the repeats, cudaEvent), its TF32 rate, and (check) the largest error against a float64 run of
// the same formulas on the host (rows of 2 heads, relative to the largest magnitude). Variants:
// `loads` (the above), `no_loads` (the staged operands never refreshed: the chain's mma and
// shared-memory work alone, so the gap to `loads` is what the copies cost), `loads_8warps` (two
// warps a scheduler); `prep` and `prep_regs` (their times), the prep + chain check and the
// prep_regs byte check.
//
// On the GPU machine (~20 s at 8,192 tokens, ~60 s at 32,768, mostly the host's float64): nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/wy_chain_probe.cu
//   -o /tmp/wy_chain_probe && /tmp/wy_chain_probe [tokens (8192)]
// (run_gpu.sh wy_probe). Exit status 0 when both float64 checks' errors are within 1e-4 and the two
// preps' outputs are the same bytes.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "probe_host.h"

namespace {

constexpr int kB = 64;      // rows a block
constexpr int kDk = 128;    // key dim (S0 rows)
constexpr int kDv = 128;    // value dim (S0 columns)
constexpr int kCols = 32;   // state columns a CTA
constexpr int kNT = kCols / 8;

// Fragment-order sizes (fp32 words: a0..a3 per lane per 16x8 A tile).
constexpr int kWWords = (kB / 16) * (kDk / 8) * 32 * 4;   // W or Q: 64 x 128
constexpr int kAWords = (kB / 16) * (kB / 8) * 32 * 4;    // Aqk: 64 x 64
constexpr int kEWords = (kDk / 16) * (kB / 8) * 32 * 4;   // (eK)^T: 128 x 64
// B-fragment tiles (8 x 8: per lane hi b0, hi b1, lo b0, lo b1)
constexpr int kSTiles = (kDk / 8) * kNT;                  // S0 slice: 128 x 32
constexpr int kUTiles = (kB / 8) * kNT;                   // U: 64 x 32
constexpr size_t kSmemWords = 2 * kWWords + kAWords + kEWords + 4 * 32 * (kSTiles + kUTiles);

__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// An A tile's four fp32 values (this lane's) as hi and lo tf32 words.
struct ATile {
  uint32_t h[4], l[4];
};
__device__ __forceinline__ ATile split_a(const float4 v) {
  ATile t;
  const float x[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    t.h[e] = tf32(x[e]);
    t.l[e] = tf32(x[e] - __uint_as_float(t.h[e]));
  }
  return t;
}

// c += A B in 3xTF32: B tile bt (hi b0, b1, lo b0, b1).
__device__ __forceinline__ void mma3(float c[4], const ATile& a, const uint4& bt) {
  mma(c, a.l, bt.x, bt.y);
  mma(c, a.h, bt.z, bt.w);
  mma(c, a.h, bt.x, bt.y);
}

// Writes value v at (k, n) of a B-fragment-ordered matrix (tiles [k / 8][n / 8], lane (n % 8) * 4 +
// k % 4, component k % 8 / 4 for hi and 2 + that for lo).
__device__ __forceinline__ void put_b(uint32_t* tiles, int k, int n, float v) {
  const int t = (k / 8) * kNT + n / 8, lane = (n % 8) * 4 + (k % 4), half = (k % 8) / 4;
  uint32_t* p = tiles + (t * 32 + lane) * 4;
  const uint32_t hi = tf32(v);
  p[half] = hi;
  p[2 + half] = tf32(v - __uint_as_float(hi));
}

__device__ __forceinline__ void cp16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

struct Args {
  const float *w, *q, *aqk, *ek;     // [h][b][fragment words]
  const float *x, *g, *gb;           // x [h][b][64][dv], g [h][b][64], gb [h][b]
  float *s, *o;                      // s [h][dk][dv] in/out, o [h][b * 64 + i][dv]
  int nblk;
};

// NWARP = 4: warp w has the block rows 16w.. (phases 1, 2a) and the state rows 32w.. (the close),
// all kNT column tiles; NWARP = 8: warps w and w + 4 share those rows and take half the column
// tiles each (two warps a scheduler to hide the chain's latencies, the same mma count).
template <bool LOADS, int NWARP>
__global__ void __launch_bounds__(NWARP * 32, 1) wy_chain(Args a) {
  constexpr int NTW = kNT * 4 / NWARP;  // column tiles a warp
  extern __shared__ __align__(16) uint32_t sm[];
  float* sW = reinterpret_cast<float*>(sm);
  float* sQ = sW + kWWords;
  float* sA = sQ + kWWords;
  float* sE = sA + kAWords;
  uint32_t* sS = sm + 2 * kWWords + kAWords + kEWords;
  uint32_t* sU = sS + 4 * 32 * kSTiles;
  const int lane = threadIdx.x % 32, g = lane / 4, qd = lane % 4;
  const int w = (threadIdx.x / 32) % 4, nt0 = (threadIdx.x / 128) * NTW;
  const int h = blockIdx.y, col0 = blockIdx.x * kCols;
  const size_t hb = static_cast<size_t>(h) * a.nblk;
  auto copy = [&](float* dst, const float* src, int words) {
    for (int i = 4 * static_cast<int>(threadIdx.x); i < words; i += 4 * NWARP * 32) cp16(dst + i, src + i);
  };
  // f(n, e, row, col) over this warp's C elements of a 16-row tile at row0 (col: the CTA's column)
  auto each_c = [&](int row0, auto f) {
#pragma unroll
    for (int n = 0; n < NTW; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(n, e, row0 + g + 8 * (e / 2), (nt0 + n) * 8 + 2 * qd + (e % 2));
  };
  // the state: this warp's rows 32w .. 32w + 31 (two 16-row C tiles) of its column tiles
  float s[2][NTW][4];
  auto state = [&](int r, int c) -> float& {
    return a.s[(static_cast<size_t>(h) * kDk + r) * kDv + col0 + c];
  };
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
    each_c(32 * w + 16 * mt, [&](int n, int e, int r, int c) {
      s[mt][n][e] = state(r, c);
      put_b(sS, r, c, s[mt][n][e]);
    });
  copy(sW, a.w + hb * kWWords, kWWords);
  copy(sQ, a.q + hb * kWWords, kWWords);
  copy(sA, a.aqk + hb * kAWords, kAWords);
  copy(sE, a.ek + hb * kEWords, kEWords);
  cp_commit();
  cp_wait_all();
  __syncthreads();
  for (int b = 0; b < a.nblk; ++b) {
    const size_t bi = hb + b;
    // X of this warp's rows, read before the products so its latency hides under them
    float x[NTW][4];
    each_c(16 * w, [&](int n, int e, int i, int c) { x[n][e] = a.x[(bi * kB + i) * kDv + col0 + c]; });
    // phase 1: W S0 and Q S0 over dk
    float ws[NTW][4] = {}, qs[NTW][4] = {};
#pragma unroll 4
    for (int kt = 0; kt < kDk / 8; ++kt) {
      const ATile wa = split_a(reinterpret_cast<const float4*>(sW)[(w * (kDk / 8) + kt) * 32 + lane]);
      const ATile qa = split_a(reinterpret_cast<const float4*>(sQ)[(w * (kDk / 8) + kt) * 32 + lane]);
#pragma unroll
      for (int n = 0; n < NTW; ++n) {
        const uint4 bt = reinterpret_cast<const uint4*>(sS)[(kt * kNT + nt0 + n) * 32 + lane];
        mma3(ws[n], wa, bt);
        mma3(qs[n], qa, bt);
      }
    }
    each_c(16 * w, [&](int n, int e, int i, int c) { put_b(sU, i, c, x[n][e] - ws[n][e]); });
    if (LOADS) cp_wait_all();  // A and E of this block
    __syncthreads();
    if (LOADS && b + 1 < a.nblk) {  // sW, sQ are free: the next block's
      copy(sW, a.w + (bi + 1) * kWWords, kWWords);
      copy(sQ, a.q + (bi + 1) * kWWords, kWWords);
      cp_commit();
    }
    // phase 2a: O = G (Q S0) + Aqk U over the slots up to the warp's last row
    float o[NTW][4] = {};
    for (int kt = 0; kt <= 2 * w + 1; ++kt) {
      const ATile aa = split_a(reinterpret_cast<const float4*>(sA)[(w * (kB / 8) + kt) * 32 + lane]);
#pragma unroll
      for (int n = 0; n < NTW; ++n) mma3(o[n], aa, reinterpret_cast<const uint4*>(sU)[(kt * kNT + nt0 + n) * 32 + lane]);
    }
    each_c(16 * w, [&](int n, int e, int i, int c) {
      a.o[((static_cast<size_t>(h) * a.nblk + b) * kB + i) * kDv + col0 + c] = fmaf(a.g[bi * kB + i], qs[n][e], o[n][e]);
    });
    // phase 2b: S0' = GB S0 + (eK)^T U over the block's 64 rows
    const float gb = a.gb[bi];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int n = 0; n < NTW; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] *= gb;
#pragma unroll 2
    for (int kt = 0; kt < kB / 8; ++kt) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        const ATile ea = split_a(reinterpret_cast<const float4*>(sE)[((2 * w + mt) * (kB / 8) + kt) * 32 + lane]);
#pragma unroll
        for (int n = 0; n < NTW; ++n)
          mma3(s[mt][n], ea, reinterpret_cast<const uint4*>(sU)[(kt * kNT + nt0 + n) * 32 + lane]);
      }
    }
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
      each_c(32 * w + 16 * mt, [&](int n, int e, int r, int c) { put_b(sS, r, c, s[mt][n][e]); });
    if (LOADS) cp_wait_all();  // W and Q of the next block
    __syncthreads();
    if (LOADS && b + 1 < a.nblk) {  // sA, sE are free
      copy(sA, a.aqk + (bi + 1) * kAWords, kAWords);
      copy(sE, a.ek + (bi + 1) * kEWords, kEWords);
      cp_commit();
    }
  }
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
    each_c(32 * w + 16 * mt, [&](int n, int e, int r, int c) { state(r, c) = s[mt][n][e]; });
}

// ---- the S0-free part (the prep): one CTA per (value head, block), all at once ----
// From normalised q, k (key head h / (nv / nk)), v, beta and the log-decay gate of the block's 64
// rows: c_i = c_{i-1} + gate_i (from 0), G_i = e^c_i; akk = K K^T and aqk = Q K^T (3xTF32 mma,
// only the tiles at or below the diagonal); L_ij = beta_i e^(c_i - c_j) akk_ij (j < i);
// W_i = beta_i G_i k_i - sum_{j<i} L_ij W_j and X_i = beta_i v_i - sum_{j<i} L_ij X_j, one column a
// thread, each sum as four interleaved fmaf chains (j mod 4) added pairwise; then the chain's
// operands: W, Q, Aqk = e^(c_i - c_j) aqk_ij (j <= i) and (e K)^T with e_j = e^(c_63 - c_j) in
// fragment order, X, G and GB = G_63.
constexpr int kLd = kDk + 4;  // padded rows of K and Q / W in shared memory: fragment loads conflict-free
constexpr int kPrepThreads = 256;
constexpr int kLPacked = kB * (kB - 1) / 2;  // L's strictly lower triangle, row i from i (i - 1) / 2
constexpr size_t kPrepSmemFloats = 2 * kB * kLd + kB * kDv + kLPacked + 3 * kB;  // two CTAs an SM

struct PrepArgs {
  const float *q, *k;          // [nk][T][dk], normalised (q with its dk^-0.5)
  const float *v;              // [nv][T][dv]
  const float *beta, *gate;    // [nv][T]
  float *w, *qf, *aqk, *ek;    // fragment order, [h][b][words]
  float *x, *g, *gb;           // as Args
  int T, nblk, nk, nv;
};

// (row, col) of a rows x cols A matrix -> its word in fragment order (frag_a's layout).
__device__ __forceinline__ size_t frag_index(int row, int col, int cols) {
  const int mt = row / 16, kt = col / 8, g = row % 8, q = col % 4;
  const int e = (row % 16) / 8 + 2 * ((col % 8) / 4);
  return ((static_cast<size_t>(mt) * (cols / 8) + kt) * 32 + g * 4 + q) * 4 + e;
}

// acc = A B^T over dk on row tile mt, column tiles nt = first, first + kStep, ... up to the
// diagonal (nt <= 2 mt + 1), for 64 x dk row-major A and B in shared memory, 3xTF32, k ascending.
// wy_prep takes every column tile in one warp (kStep 1), wy_prep_regs splits them over two.
template <int kStep>
__device__ __forceinline__ void mma_rows_kt(float acc[kB / 8 / kStep][4], const float* sA, const float* sB,
                                            int mt, int first, int g, int qd) {
#pragma unroll 2
  for (int kt = 0; kt < kDk / 8; ++kt) {
    const float* ar = sA + (16 * mt + g) * kLd + 8 * kt + qd;
    const ATile at = split_a(make_float4(ar[0], ar[8 * kLd], ar[4], ar[8 * kLd + 4]));
#pragma unroll
    for (int n = 0; n < kB / 8 / kStep; ++n) {
      const int nt = kStep * n + first;
      if (nt > 2 * mt + 1) continue;
      const float* br = sB + (8 * nt + g) * kLd + 8 * kt + qd;
      const float b0 = br[0], b1 = br[4];
      const uint32_t h0 = tf32(b0), h1 = tf32(b1);
      const uint4 bt = make_uint4(h0, h1, tf32(b0 - __uint_as_float(h0)), tf32(b1 - __uint_as_float(h1)));
      mma3(acc[n], at, bt);
    }
  }
}

// Both preps' start: the block's k and q rows (and v into sX with kLoadV) into shared memory,
// beta, the prefix c of the log-decays in slot order, G = e^c (out to g and gb). Ends synced
// for everything but sG, which only its writer reads before the next barrier.
template <bool kLoadV>
__device__ __forceinline__ void prep_stage(const PrepArgs& a, float* sK, float* sQ, float* sX, float* sbeta,
                                           float* sc, float* sG) {
  const int tid = threadIdx.x, h = blockIdx.y, b = blockIdx.x, kh = h / (a.nv / a.nk);
  const size_t t0 = static_cast<size_t>(b) * kB;
  const size_t hb = static_cast<size_t>(h) * a.nblk + b;
  for (int idx = tid; idx < kB * kDk / 4; idx += kPrepThreads) {
    const int i = idx / (kDk / 4), c4 = idx % (kDk / 4);
    const float4 kv = reinterpret_cast<const float4*>(a.k + (static_cast<size_t>(kh) * a.T + t0 + i) * kDk)[c4];
    const float4 qv = reinterpret_cast<const float4*>(a.q + (static_cast<size_t>(kh) * a.T + t0 + i) * kDk)[c4];
    *reinterpret_cast<float4*>(sK + i * kLd + 4 * c4) = kv;
    *reinterpret_cast<float4*>(sQ + i * kLd + 4 * c4) = qv;
    if constexpr (kLoadV)
      *reinterpret_cast<float4*>(sX + i * kDv + 4 * c4) =
          reinterpret_cast<const float4*>(a.v + (static_cast<size_t>(h) * a.T + t0 + i) * kDv)[c4];
  }
  if (tid < kB) sbeta[tid] = a.beta[static_cast<size_t>(h) * a.T + t0 + tid];
  if (tid == 0) {  // the prefix of the log-decays, in slot order
    float c = 0.0f;
    for (int i = 0; i < kB; ++i) {
      c += a.gate[static_cast<size_t>(h) * a.T + t0 + i];
      sc[i] = c;
    }
  }
  __syncthreads();
  if (tid < kB) {
    sG[tid] = expf(sc[tid]);
    a.g[hb * kB + tid] = sG[tid];
    if (tid == kB - 1) a.gb[hb] = sG[tid];
  }
}

__global__ void __launch_bounds__(kPrepThreads, 2) wy_prep(PrepArgs a) {
  extern __shared__ __align__(16) float ps[];
  float* sK = ps;                 // [64][kLd]
  float* sQ = sK + kB * kLd;      // [64][kLd], then W
  float* sX = sQ + kB * kLd;      // [64][dv]: v, then X in place
  float* sL = sX + kB * kDv;      // packed: L_ij at i (i - 1) / 2 + j, j < i
  float* sc = sL + kLPacked;      // c
  float* sbeta = sc + kB;
  float* sG = sbeta + kB;
  const int tid = threadIdx.x, lane = tid % 32, w = tid / 32, g = lane / 4, qd = lane % 4;
  const size_t hb = static_cast<size_t>(blockIdx.y) * a.nblk + blockIdx.x;
  prep_stage<true>(a, sK, sQ, sX, sbeta, sc, sG);
  // Q in fragment order for the chain (before sQ becomes W)
  for (int idx = tid; idx < kB * kDk; idx += kPrepThreads) {
    const int i = idx / kDk, r = idx % kDk;
    a.qf[hb * kWWords + frag_index(i, r, kDk)] = sQ[i * kLd + r];
  }
  // akk (warps 0-3) and aqk (warps 4-7), row tile w % 4, column tiles up to the diagonal
  {
    const int mt = w % 4;
    float acc[kB / 8][4] = {};
    mma_rows_kt<1>(acc, w < 4 ? sK : sQ, sK, mt, 0, g, qd);
#pragma unroll
    for (int nt = 0; nt < kB / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 16 * mt + g + 8 * (e / 2), j = 8 * nt + 2 * qd + (e % 2);
        const float decay = j <= i ? expf(sc[i] - sc[j]) : 0.0f;
        if (w < 4) {
          if (j < i) sL[i * (i - 1) / 2 + j] = sbeta[i] * decay * acc[nt][e];
        }
        else a.aqk[hb * kAWords + frag_index(i, j, kB)] = j <= i ? decay * acc[nt][e] : 0.0f;
      }
  }
  __syncthreads();
  // the substitution: thread t < 128 owns W's column t (into sQ), thread t >= 128 X's column t - 128
  {
    const bool isw = tid < kDk;
    const int col = isw ? tid : tid - kDk;
    float* dst = isw ? sQ + col : sX + col;
    const int ld = isw ? kLd : kDv;
    for (int i = 0; i < kB; ++i) {
      const float rhs = isw ? sbeta[i] * sG[i] * sK[i * kLd + col] : sbeta[i] * sX[i * kDv + col];
      float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
      int j = 0;
      const float* li = sL + i * (i - 1) / 2;
      for (; j + 3 < i; j += 4) {
        p0 = fmaf(li[j], dst[j * ld], p0);
        p1 = fmaf(li[j + 1], dst[(j + 1) * ld], p1);
        p2 = fmaf(li[j + 2], dst[(j + 2) * ld], p2);
        p3 = fmaf(li[j + 3], dst[(j + 3) * ld], p3);
      }
      if (j < i) p0 = fmaf(li[j], dst[j * ld], p0);
      if (j + 1 < i) p1 = fmaf(li[j + 1], dst[(j + 1) * ld], p1);
      if (j + 2 < i) p2 = fmaf(li[j + 2], dst[(j + 2) * ld], p2);
      dst[i * ld] = rhs - ((p0 + p1) + (p2 + p3));
    }
  }
  __syncthreads();
  for (int idx = tid; idx < kB * kDk; idx += kPrepThreads) {
    const int i = idx / kDk, r = idx % kDk;
    a.w[hb * kWWords + frag_index(i, r, kDk)] = sQ[i * kLd + r];
    a.x[(hb * kB + i) * kDv + r] = sX[i * kDv + r];
    // (e K)^T: row r (state row), column i (block row)
    a.ek[hb * kEWords + frag_index(r, i, kB)] = expf(sc[kB - 1] - sc[i]) * sK[i * kLd + r];
  }
}

// The same prep with its two costs on the H100 (0.89 + 1.18 ms at 8,192 tokens, 9841ac8) taken
// out: the substitution's running sums read W and X from shared memory (two loads an fma, ~18 us a
// CTA of load issue), and the fragment-order outputs went out one 4-byte word a thread, scattered
// over the tiles ((e K)^T's worst: a sector a word). Here a thread keeps its column of W or X in
// registers (the loops unrolled, L's row read as float4 broadcasts), and each output goes out
// as float4 words from consecutive threads. The arithmetic is wy_prep's, term for term (the same
// fmaf chains, mma k-steps and products), so its outputs are the same bytes: the probe compares
// them. Q K^T moves after the substitution, into L's space (L and Aqk rows 68 floats: 86 KB).
constexpr int kLdL = kB + 4;
constexpr size_t kPrepRegsSmemFloats = 2 * kB * kLd + kB * kLdL + 4 * kB;

// A ROWS x COLS matrix, element (r, c) = at(r, c), into fragment order (frag_index's layout) at dst:
// thread t writes float4 word t, t + blockDim, ...
template <int ROWS, int COLS, class At>
__device__ __forceinline__ void put_frag(float* dst, At at) {
  for (int o = threadIdx.x; o < ROWS * COLS / 4; o += kPrepThreads) {
    const int lane = o % 32, tile = o / 32, mt = tile / (COLS / 8), kt = tile % (COLS / 8);
    const int r = 16 * mt + lane / 4, c = 8 * kt + lane % 4;
    reinterpret_cast<float4*>(dst)[o] = make_float4(at(r, c), at(r + 8, c), at(r, c + 4), at(r + 8, c + 4));
  }
}

// sA K^T on this warp's half of the tiles (mma_rows_kt<2>), then into sLA (rows of kLdL) as
// wy_prep writes it:
// kL, L = beta_i e^(c_i - c_j) (k_i . k_j) for j < i; else Aqk = e^(c_i - c_j) (q_i . k_j), j <= i.
template <bool kL>
__device__ __forceinline__ void gram_into(float* sLA, const float* sA, const float* sK, const float* sc,
                                          const float* sbeta, int mt, int half, int g, int qd) {
  float acc[kB / 16][4] = {};
  mma_rows_kt<2>(acc, sA, sK, mt, half, g, qd);
#pragma unroll
  for (int n = 0; n < kB / 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = 16 * mt + g + 8 * (e / 2), j = 8 * (2 * n + half) + 2 * qd + (e % 2);
      if (kL ? j < i : j <= i)
        sLA[i * kLdL + j] = kL ? sbeta[i] * expf(sc[i] - sc[j]) * acc[n][e] : expf(sc[i] - sc[j]) * acc[n][e];
    }
}

__global__ void __launch_bounds__(kPrepThreads, 2) wy_prep_regs(PrepArgs a) {
  extern __shared__ __align__(16) float ps[];
  float* sK = ps;                 // [64][kLd]
  float* sQ = sK + kB * kLd;      // [64][kLd]: q, then W
  float* sLA = sQ + kB * kLd;     // [64][kLdL]: L (j < i), then Aqk (j <= i)
  float* sc = sLA + kB * kLdL;    // c
  float* sbeta = sc + kB;
  float* sG = sbeta + kB;
  float* se = sG + kB;            // e_j = e^(c_63 - c_j)
  const int tid = threadIdx.x, lane = tid % 32, w = tid / 32, g = lane / 4, qd = lane % 4;
  const int h = blockIdx.y;
  const size_t t0 = static_cast<size_t>(blockIdx.x) * kB;
  const size_t hb = static_cast<size_t>(h) * a.nblk + blockIdx.x;
  prep_stage<false>(a, sK, sQ, nullptr, sbeta, sc, sG);
  if (tid < kB) se[tid] = expf(sc[kB - 1] - sc[tid]);
  put_frag<kB, kDk>(a.qf + hb * kWWords, [&](int r, int c) { return sQ[r * kLd + c]; });
  const int mt = w % 4, half = w / 4;
  gram_into<true>(sLA, sK, sK, sc, sbeta, mt, half, g, qd);  // K K^T -> L
  __syncthreads();
  // the substitution, thread t < 128 on W's column t, t >= 128 on X's column t - 128
  const bool isw = tid < kDk;
  const int col = isw ? tid : tid - kDk;
  float d[kB];
#pragma unroll
  for (int i = 0; i < kB; ++i)
    d[i] = isw ? sbeta[i] * sG[i] * sK[i * kLd + col]
               : sbeta[i] * a.v[(static_cast<size_t>(h) * a.T + t0 + i) * kDv + col];
#pragma unroll
  for (int i = 1; i < kB; ++i) {
    const float* li = sLA + i * kLdL;
    float p0 = 0.0f, p1 = 0.0f, p2 = 0.0f, p3 = 0.0f;
#pragma unroll
    for (int j = 0; j + 3 < i; j += 4) {
      const float4 l4 = *reinterpret_cast<const float4*>(li + j);
      p0 = fmaf(l4.x, d[j], p0);
      p1 = fmaf(l4.y, d[j + 1], p1);
      p2 = fmaf(l4.z, d[j + 2], p2);
      p3 = fmaf(l4.w, d[j + 3], p3);
    }
    const int j = i & ~3;
    if (j < i) p0 = fmaf(li[j], d[j], p0);
    if (j + 1 < i) p1 = fmaf(li[j + 1], d[j + 1], p1);
    if (j + 2 < i) p2 = fmaf(li[j + 2], d[j + 2], p2);
    d[i] = d[i] - ((p0 + p1) + (p2 + p3));
  }
  __syncthreads();  // L read by all: its space takes Aqk
  gram_into<false>(sLA, sQ, sK, sc, sbeta, mt, half, g, qd);  // Q K^T -> Aqk
  __syncthreads();  // Q read by all: its space takes W
#pragma unroll
  for (int i = 0; i < kB; ++i) {
    if (isw) sQ[i * kLd + col] = d[i];
    else a.x[(hb * kB + i) * kDv + col] = d[i];
  }
  __syncthreads();
  put_frag<kB, kDk>(a.w + hb * kWWords, [&](int r, int c) { return sQ[r * kLd + c]; });
  put_frag<kB, kB>(a.aqk + hb * kAWords, [&](int r, int c) { return c <= r ? sLA[r * kLdL + c] : 0.0f; });
  put_frag<kDk, kB>(a.ek + hb * kEWords, [&](int r, int c) { return se[c] * sK[c * kLd + r]; });
}

// ---- host ----
// A matrix rows x cols (row-major, m) into fragment order: tiles [rows / 16][cols / 8], lane,
// then a0..a3 with a0 (g, q), a1 (g + 8, q), a2 (g, q + 4), a3 (g + 8, q + 4).
void frag_a(const float* m, int rows, int cols, float* out) {
  for (int mt = 0; mt < rows / 16; ++mt)
    for (int kt = 0; kt < cols / 8; ++kt)
      for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, q = lane % 4;
        const int rr[4] = {g, g + 8, g, g + 8}, kk[4] = {q, q, q + 4, q + 4};
        float* p = out + ((mt * (cols / 8) + kt) * 32 + lane) * 4;
        for (int e = 0; e < 4; ++e) p[e] = m[(16 * mt + rr[e]) * cols + 8 * kt + kk[e]];
      }
}

// After the launches: their outputs o and state s to the host, or false (said on stderr).
bool fetch(const char* what, const float* o_dev, const float* s_dev, std::vector<float>& O, std::vector<float>& S1) {
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaMemcpy(O.data(), o_dev, O.size() * 4, cudaMemcpyDeviceToHost);
  if (e == cudaSuccess) e = cudaMemcpy(S1.data(), s_dev, S1.size() * 4, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) std::fprintf(stderr, "%s failed: %s\n", what, cudaGetErrorString(e));
  return e == cudaSuccess;
}

// The fastest of 10 runs of launch (cudaEvent, ms).
template <class F>
float fastest(F launch) {
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  float best = 1e30f;
  for (int rep = 0; rep < 10; ++rep) {
    cudaEventRecord(t0);
    launch();
    cudaEventRecord(t1);
    cudaEventSynchronize(t1);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, t0, t1);
    best = ms < best ? ms : best;
  }
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? std::atoi(argv[1]) : 8192;
  const int nv = 32, nblk = tokens / kB;
  if (nblk < 1) return 2;
  std::mt19937 rng(7);
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::uniform_real_distribution<float> U01(0.0f, 1.0f);
  const size_t nb = static_cast<size_t>(nv) * nblk;
  // natural layouts (kept for the float64 check of heads 0 and 1)
  std::vector<float> W(nb * kB * kDk), Q(nb * kB * kDk), A(nb * kB * kB), E(nb * kDk * kB), X(nb * kB * kDv);
  std::vector<float> G(nb * kB), GB(nb), S(static_cast<size_t>(nv) * kDk * kDv);
  for (auto& v : W) v = 0.02f * N(rng);
  for (auto& v : Q) v = 0.09f * N(rng);
  for (size_t bi = 0; bi < nb; ++bi)
    for (int i = 0; i < kB; ++i)
      for (int j = 0; j < kB; ++j) A[(bi * kB + i) * kB + j] = j <= i ? 0.1f * N(rng) : 0.0f;
  for (auto& v : E) v = 0.05f * N(rng);
  for (auto& v : X) v = N(rng);
  for (auto& v : G) v = 0.5f + 0.5f * U01(rng);
  for (auto& v : GB) v = 0.5f;
  for (auto& v : S) v = 0.1f * N(rng);
  std::vector<float> Wf(nb * kWWords), Qf(nb * kWWords), Af(nb * kAWords), Ef(nb * kEWords);
  for (size_t bi = 0; bi < nb; ++bi) {
    frag_a(&W[bi * kB * kDk], kB, kDk, &Wf[bi * kWWords]);
    frag_a(&Q[bi * kB * kDk], kB, kDk, &Qf[bi * kWWords]);
    frag_a(&A[bi * kB * kB], kB, kB, &Af[bi * kAWords]);
    frag_a(&E[bi * kDk * kB], kDk, kB, &Ef[bi * kEWords]);
  }
  Args a{};
  a.w = dev(Wf), a.q = dev(Qf), a.aqk = dev(Af), a.ek = dev(Ef);
  a.x = dev(X), a.g = dev(G), a.gb = dev(GB);
  float* s_dev = dev(S);
  float* o_dev = nullptr;
  cudaMalloc(&o_dev, nb * kB * kDv * sizeof(float));
  a.s = s_dev, a.o = o_dev, a.nblk = nblk;
  const size_t smem = kSmemWords * 4;
  cudaFuncSetAttribute(wy_chain<true, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  cudaFuncSetAttribute(wy_chain<false, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  cudaFuncSetAttribute(wy_chain<true, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  const dim3 grid(kDv / kCols, nv), block(4 * 32);
  // the check: heads 0 and 1 in float64, then one run of each checked variant from S
  std::vector<double> Oref(2 * static_cast<size_t>(nblk) * kB * kDv), Sref(2 * kDk * kDv);
  for (int h = 0; h < 2; ++h) {
    std::vector<double> s0(kDk * kDv), u(kB * kDv), s1(kDk * kDv);
    for (int i = 0; i < kDk * kDv; ++i) s0[i] = S[static_cast<size_t>(h) * kDk * kDv + i];
    for (int b = 0; b < nblk; ++b) {
      const size_t bi = static_cast<size_t>(h) * nblk + b;
      for (int i = 0; i < kB; ++i)
        for (int c = 0; c < kDv; ++c) {
          double ws = 0.0;
          for (int r = 0; r < kDk; ++r) ws += static_cast<double>(W[(bi * kB + i) * kDk + r]) * s0[r * kDv + c];
          u[i * kDv + c] = X[(bi * kB + i) * kDv + c] - ws;
        }
      for (int i = 0; i < kB; ++i)
        for (int c = 0; c < kDv; ++c) {
          double qs = 0.0, au = 0.0;
          for (int r = 0; r < kDk; ++r) qs += static_cast<double>(Q[(bi * kB + i) * kDk + r]) * s0[r * kDv + c];
          for (int j = 0; j < kB; ++j) au += static_cast<double>(A[(bi * kB + i) * kB + j]) * u[j * kDv + c];
          Oref[(bi * kB + i) * kDv + c] = G[bi * kB + i] * qs + au;
        }
      for (int r = 0; r < kDk; ++r)
        for (int c = 0; c < kDv; ++c) {
          double acc = GB[bi] * s0[r * kDv + c];
          for (int j = 0; j < kB; ++j) acc += static_cast<double>(E[(bi * kDk + r) * kB + j]) * u[j * kDv + c];
          s1[r * kDv + c] = acc;
        }
      s0 = s1;
    }
    for (int i = 0; i < kDk * kDv; ++i) Sref[static_cast<size_t>(h) * kDk * kDv + i] = s0[i];
  }
  std::vector<float> O(nb * kB * kDv), S1(S.size());
  double rel = 0.0;
  for (int variant = 0; variant < 2; ++variant) {
    cudaMemcpy(s_dev, S.data(), S.size() * 4, cudaMemcpyHostToDevice);
    if (variant == 0) wy_chain<true, 4><<<grid, block, smem>>>(a);
    else wy_chain<true, 8><<<grid, dim3(8 * 32), smem>>>(a);
    if (!fetch("chain", o_dev, s_dev, O, S1)) return 2;
    double err = 0.0, mag = 0.0;
    for (size_t i = 0; i < Oref.size(); ++i) {  // heads 0 and 1 are the first rows of O
      err = std::fmax(err, std::fabs(Oref[i] - O[i]));
      mag = std::fmax(mag, std::fabs(Oref[i]));
    }
    for (size_t i = 0; i < Sref.size(); ++i) {
      err = std::fmax(err, std::fabs(Sref[i] - S1[i]));
      mag = std::fmax(mag, std::fabs(Sref[i]));
    }
    const double r = err / (mag > 0 ? mag : 1.0);
    rel = std::fmax(rel, r);
    std::printf("{\"check\": \"float64\", \"variant\": \"%s\", \"heads\": 2, \"blocks\": %d, \"max_abs_err\": %.3e, "
                "\"max_abs\": %.3e, \"rel\": %.3e, \"ok\": %s}\n", variant == 0 ? "loads" : "loads_8warps", nblk, err,
                mag, r, r <= 1e-4 ? "true" : "false");
  }
  // timing
  const double mac = static_cast<double>(nv) * nblk * kDv *
                     (2.0 * kB * kDk + kB * kB / 2.0 + kDk * kB);  // W S0, Q S0, Aqk U (half), close
  const char* names[3] = {"loads", "no_loads", "loads_8warps"};
  for (int variant = 0; variant < 3; ++variant) {
    const float best = fastest([&] {
      if (variant == 0) wy_chain<true, 4><<<grid, block, smem>>>(a);
      else if (variant == 1) wy_chain<false, 4><<<grid, block, smem>>>(a);
      else wy_chain<true, 8><<<grid, dim3(8 * 32), smem>>>(a);
    });
    std::printf("{\"variant\": \"%s\", \"tokens\": %d, \"heads\": %d, \"ms\": %.4f, \"us_per_block\": %.3f, "
                "\"tf32_tflops_3x\": %.1f}\n", names[variant], tokens, nv, best,
                1e3 * best / nblk, 3.0 * 2.0 * mac / (best * 1e-3) / 1e12);
  }
  // ---- the whole WY layer from the rule's inputs: the prep, then the chain, against the per-token
  // recurrence in float64 (S = e^gate S; u = beta (v - S^T k); S += k u^T; o = S^T q) ----
  const int nk = 16, T = nblk * kB;
  std::vector<float> qn(static_cast<size_t>(nk) * T * kDk), kn(qn.size()), vv(static_cast<size_t>(nv) * T * kDv);
  std::vector<float> beta(static_cast<size_t>(nv) * T), gate(beta.size());
  for (size_t row = 0; row < static_cast<size_t>(nk) * T; ++row) {
    double sq = 0.0, sk = 0.0;
    for (int r = 0; r < kDk; ++r) {
      qn[row * kDk + r] = N(rng), kn[row * kDk + r] = N(rng);
      sq += double(qn[row * kDk + r]) * qn[row * kDk + r], sk += double(kn[row * kDk + r]) * kn[row * kDk + r];
    }
    for (int r = 0; r < kDk; ++r) {
      qn[row * kDk + r] = static_cast<float>(qn[row * kDk + r] / std::sqrt(sq) / std::sqrt(double(kDk)));
      kn[row * kDk + r] = static_cast<float>(kn[row * kDk + r] / std::sqrt(sk));
    }
  }
  for (auto& v : vv) v = N(rng);
  for (auto& v : beta) v = U01(rng);
  for (auto& v : gate) v = -0.3f * U01(rng);
  PrepArgs p{};
  p.q = dev(qn), p.k = dev(kn), p.v = dev(vv), p.beta = dev(beta), p.gate = dev(gate);
  float *pw, *pqf, *paqk, *pek, *px, *pg, *pgb;
  cudaMalloc(&pw, nb * kWWords * 4), cudaMalloc(&pqf, nb * kWWords * 4), cudaMalloc(&paqk, nb * kAWords * 4);
  cudaMalloc(&pek, nb * kEWords * 4), cudaMalloc(&px, nb * kB * kDv * 4), cudaMalloc(&pg, nb * kB * 4);
  cudaMalloc(&pgb, nb * 4);
  p.w = pw, p.qf = pqf, p.aqk = paqk, p.ek = pek, p.x = px, p.g = pg, p.gb = pgb;
  p.T = T, p.nblk = nblk, p.nk = nk, p.nv = nv;
  const size_t psmem = kPrepSmemFloats * 4;
  cudaFuncSetAttribute(wy_prep, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(psmem));
  const dim3 pgrid(nblk, nv);
  Args c = a;
  c.w = pw, c.q = pqf, c.aqk = paqk, c.ek = pek, c.x = px, c.g = pg, c.gb = pgb;
  cudaMemcpy(s_dev, S.data(), S.size() * 4, cudaMemcpyHostToDevice);
  wy_prep<<<pgrid, kPrepThreads, psmem>>>(p);
  wy_chain<true, 4><<<grid, block, smem>>>(c);
  if (!fetch("prep + chain", o_dev, s_dev, O, S1)) return 2;
  double err2 = 0.0, mag2 = 0.0;
  for (int h = 0; h < 2; ++h) {
    const int kh = h / (nv / nk);
    std::vector<double> st(kDk * kDv), u(kDv);
    for (int i = 0; i < kDk * kDv; ++i) st[i] = S[static_cast<size_t>(h) * kDk * kDv + i];
    for (int t = 0; t < T; ++t) {
      const float* kt = &kn[(static_cast<size_t>(kh) * T + t) * kDk];
      const float* qt = &qn[(static_cast<size_t>(kh) * T + t) * kDk];
      const double al = std::exp(double(gate[static_cast<size_t>(h) * T + t])), bt = beta[static_cast<size_t>(h) * T + t];
      for (auto& x : st) x *= al;
      for (int cc = 0; cc < kDv; ++cc) {
        double sk = 0.0;
        for (int r = 0; r < kDk; ++r) sk += st[r * kDv + cc] * kt[r];
        u[cc] = bt * (vv[(static_cast<size_t>(h) * T + t) * kDv + cc] - sk);
      }
      for (int r = 0; r < kDk; ++r)
        for (int cc = 0; cc < kDv; ++cc) st[r * kDv + cc] += kt[r] * u[cc];
      for (int cc = 0; cc < kDv; ++cc) {
        double o = 0.0;
        for (int r = 0; r < kDk; ++r) o += st[r * kDv + cc] * qt[r];
        err2 = std::fmax(err2, std::fabs(o - O[(static_cast<size_t>(h) * T + t) * kDv + cc]));
        mag2 = std::fmax(mag2, std::fabs(o));
      }
    }
    for (int i = 0; i < kDk * kDv; ++i) {
      err2 = std::fmax(err2, std::fabs(st[i] - S1[static_cast<size_t>(h) * kDk * kDv + i]));
      mag2 = std::fmax(mag2, std::fabs(st[i]));
    }
  }
  const double rel2 = err2 / (mag2 > 0 ? mag2 : 1.0);
  std::printf("{\"check\": \"prep+chain vs per-token float64\", \"heads\": 2, \"tokens\": %d, \"max_abs_err\": %.3e, "
              "\"max_abs\": %.3e, \"rel\": %.3e, \"ok\": %s}\n", T, err2, mag2, rel2, rel2 <= 1e-4 ? "true" : "false");
  // wy_prep_regs into buffers of its own, poisoned first: the same bytes as wy_prep's in every output
  PrepArgs p2 = p;
  const size_t sizes[7] = {nb * kWWords, nb * kWWords, nb * kAWords, nb * kEWords, nb * kB * kDv, nb * kB, nb};
  float* const firsts[7] = {pw, pqf, paqk, pek, px, pg, pgb};
  float** const outs[7] = {&p2.w, &p2.qf, &p2.aqk, &p2.ek, &p2.x, &p2.g, &p2.gb};
  for (int o = 0; o < 7; ++o) {
    cudaMalloc(outs[o], sizes[o] * 4);
    cudaMemset(*outs[o], 0xff, sizes[o] * 4);  // NaN words: an output left unwritten differs
  }
  const size_t p2smem = kPrepRegsSmemFloats * 4;
  cudaFuncSetAttribute(wy_prep_regs, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(p2smem));
  wy_prep_regs<<<pgrid, kPrepThreads, p2smem>>>(p2);
  if (cudaDeviceSynchronize() != cudaSuccess) {
    std::fprintf(stderr, "wy_prep_regs failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 2;
  }
  size_t differ = 0;
  for (int o = 0; o < 7; ++o) {
    std::vector<float> x1(sizes[o]), x2(sizes[o]);
    cudaMemcpy(x1.data(), firsts[o], sizes[o] * 4, cudaMemcpyDeviceToHost);
    cudaMemcpy(x2.data(), *outs[o], sizes[o] * 4, cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < sizes[o]; ++i) differ += std::memcmp(&x1[i], &x2[i], 4) != 0;
  }
  std::printf("{\"check\": \"prep_regs bytes == prep\", \"tokens\": %d, \"words_differing\": %zu, \"ok\": %s}\n", T,
              differ, differ == 0 ? "true" : "false");
  const float best = fastest([&] { wy_prep<<<pgrid, kPrepThreads, psmem>>>(p); });
  const float best2 = fastest([&] { wy_prep_regs<<<pgrid, kPrepThreads, p2smem>>>(p2); });
  std::printf("{\"variant\": \"prep\", \"tokens\": %d, \"heads\": %d, \"ms\": %.4f}\n", T, nv, best);
  std::printf("{\"variant\": \"prep_regs\", \"tokens\": %d, \"heads\": %d, \"ms\": %.4f}\n", T, nv, best2);
  if (cudaGetLastError() != cudaSuccess) return 2;
  return rel <= 1e-4 && rel2 <= 1e-4 && differ == 0 ? 0 : 1;
}
