// baro_delta_blocked (GPU): the chunk-aligned delta rule (docs/DESIGN.md §9,
// docs/NUMERICS.md "delta_blocked"), CUDA cores only, fp32 throughout. (The opt-in
// tensor-core instance, BARO_DELTA_BLOCKED_MMA=1 on CUDA, is described above
// delta_blocked_mma_kernel below: same rule, its own bits.)
//
// Layout: one CTA per value head (grid nv), one thread per state column d
// (NT = 128 threads, dv <= 128); thread d holds S0[:, d] (DK floats) in
// registers. One CTA per head because pending_k / pending_c are shared by all
// columns of a head and are updated in place (aliased): a column split over
// CTAs would let one CTA overwrite them while another still reads the old
// rows. Within the CTA there is no such race: thread d alone reads and writes
// column d of S0 and of pending_u; pending_k / pending_c are written between
// barriers.
//
// Rows are processed in passes: a pass is up to SEG consecutive valid rows
// of one block (SEG = 64 on CUDA, 16 on HIP: LDS is 64 KB). Per pass:
//   1. normalise q, k of the pass's rows (one warp per row: lane-strided fmaf
//      chain of squares + the 16..1 butterfly, common.cuh warp_sumsq), gates
//      beta, g per row; then ONE thread forms c_i = c_{i-1} + g_i in slot
//      order (c_{i-1} from the pending slot when the pass starts mid-block);
//   2. in parallel over (row i, slot j <= i): akk = exp(c_i - c_j) * dot(k_i,
//      k_j), aqk = exp(c_i - c_j) * dot(q_i, k_j); and over (row, column d):
//      ks0 = dot(S0[:, d], k_i), qs0 = dot(S0[:, d], q_i). These only depend on S0 and the rows, not on
//      u: this is where prefill gains over the token scan;
//   3. sequential over the pass's rows, per column (no barrier: thread d owns
//      u[:, d]): u_i[d] = beta * ((v[d] - G*ks0) - sum_{j<i} akk_j u_j[d]);
//      o_i[d] = G * qs0 + sum_{j<=i} aqk_j u_j[d];
//   4. when the pass ends in slot B-1 (the block closes): pending_k[j] *=
//      exp(c_{B-1} - c_j) in place (a rounded product, as the contract's
//      e_j * k_j[r]), S0[r, d] = G * S0[r, d] + sum_{j<B} ek_j[r] u_j[d],
//      then every pending slot is set to +0.
//
// The order of every sum (the GPU's, written in NUMERICS "delta_blocked"):
// every dot over dk is ONE fmaf chain from +0, index ascending (exactly the
// CPU's baro::dot order); every sum over slots is one fmaf chain from +0, slot
// ascending, over j < i (u), j <= i (o, the j = i term last) or all B slots
// (the close): the contract's order. Each value depends only on its own
// indices and operands, never on which rows share the call or the pass, so a
// row gives the same bits at m = 1 (decode) and inside any prefill chunk, and
// SEG (CUDA 64, HIP 16) does not change any bit. Only the q/k L2 norms use the
// GPU's warp order (as the token kernel's HIP path does). No tensor cores: the
// operands are fp32 (a bf16 mma would change the values, one TF32 mma drops 13
// mantissa bits), and a 3xTF32 split would need its own fixed order proven
// row-invariant on the card first.
//
// CUDA keeps the block's pending rows in shared memory (loaded once: slots
// < pos % B; written back once: the slots the call changed); HIP works on the
// pending result buffers in global memory in place. Same arithmetic.
// Scratch-free: command-buffer compatible.
#include <cmath>
#include <cstdint>

#include "common.cuh"
#include "contract.h"
#include "ffi_gpu.h"
#include "launch.h"

namespace baro_gpu {
namespace {

constexpr int kNT = 128;                 // threads per CTA = max dv
constexpr int kSeg = BARO_HIP ? 16 : 64;  // rows per pass (speed only)
constexpr int kMaxB = 64;
constexpr bool kSmemPending = !BARO_HIP;

BARO_DEV int64_t clamp_rows(const int32_t* p, int64_t m) {
  int64_t v = *p;
  return v < 0 ? 0 : (v > m ? m : v);
}

// dot over DK, one fmaf chain from +0, index ascending (a, b 16-byte aligned).
template <int DK>
BARO_DEV float dot_chain(const float* a, const float* b) {
  float acc = 0.0f;
#pragma unroll 8
  for (int r = 0; r < DK; r += 4) {
    const float4 x = *reinterpret_cast<const float4*>(a + r);
    const float4 y = *reinterpret_cast<const float4*>(b + r);
    acc = fmaf(x.x, y.x, acc);
    acc = fmaf(x.y, y.y, acc);
    acc = fmaf(x.z, y.z, acc);
    acc = fmaf(x.w, y.w, acc);
  }
  return acc;
}

// dot(S0[:, d], x) with the column in registers: the same chain as dot_chain.
template <int DK>
BARO_DEV float dot_col(const float (&s)[DK], const float* x) {
  float acc = 0.0f;
#pragma unroll
  for (int r = 0; r < DK; r += 4) {
    const float4 y = *reinterpret_cast<const float4*>(x + r);
    acc = fmaf(s[r + 0], y.x, acc);
    acc = fmaf(s[r + 1], y.y, acc);
    acc = fmaf(s[r + 2], y.z, acc);
    acc = fmaf(s[r + 3], y.w, acc);
  }
  return acc;
}

struct Smem {
  float* Kp;  // [B][ldk] pending k (CUDA: shared; HIP: the pending_k result, in place)
  float* Up;  // [B][ldu] pending u
  float* Cp;  // [B] pending c
  float* Qs;  // [kSeg][ldq] q of the pass's rows
  float* KS;  // [kSeg][kNT] S0^T k of the pass's rows
  float* QS;  // [kSeg][kNT] S0^T q of the pass's rows
  float* Akk;  // [kSeg][B]
  float* Aqk;  // [kSeg][B]
  float* beta;  // [kSeg]
  float* g;     // [kSeg] g, then G = exp(c)
  float* e;     // [B] close coefficients
  // The MMA instance only (delta_blocked_mma_kernel): S0 in shared memory, and the slot sums
  // over the row tile's earlier 16-slot tiles.
  float* S;   // [DK][kLdC] the CTA's columns of S0
  float* Ru;  // [16][kLdC] sum over the earlier tiles' slots of akk_j u_j[d], per row of the tile
  float* Ro;  // [16][kLdC] the same with aqk_j
  float* V;   // [kWin][kLdC] v of the pass's rows in the CTA's columns (read ahead of the chain)
};

// Rows n..m-1 of o get +0 in the CTA's columns (padded rows leave no other trace); the pending
// slots < i0 (the only ones read) into shared memory on CUDA: k and c when with_kc, u of the
// CTA's columns col0 + (0 .. ncols-1) (thread t: column col0 + t, shared column t). Shared by
// both instances.
template <int DK>
BARO_DEV void load_pending(const DeltaBlockedArgs& a, const Smem& sm, int h, int i0, int ldk, int ldu,
                           int64_t n, int col0, int ncols, bool with_kc) {
  const int tid = static_cast<int>(threadIdx.x), nv = a.nv, dv = a.dv, B = a.B;
  const int d = col0 + tid;
  const bool has = tid < ncols && d < dv;
  for (int64_t t = n; t < a.m; ++t)
    if (has) a.o[(t * nv + h) * dv + d] = 0.0f;
  if (n == 0) return;
  if constexpr (kSmemPending) {
    const float* pk_in = a.pk_in + static_cast<int64_t>(h) * B * DK;
    const float* pu_in = a.pu_in + static_cast<int64_t>(h) * B * dv;
    const float* pc_in = a.pc_in + static_cast<int64_t>(h) * B;
    if (with_kc) {
      for (int i = tid; i < i0 * DK; i += kNT) sm.Kp[(i / DK) * ldk + i % DK] = pk_in[i];
      for (int j = tid; j < i0; j += kNT) sm.Cp[j] = pc_in[j];
    }
    if (has)
      for (int j = 0; j < i0; ++j) sm.Up[j * ldu + tid] = pu_in[static_cast<int64_t>(j) * dv + d];
  }
  // (HIP: the results already hold the operands: copy_if_not_aliased_async ran first.)
}

// The gate g = -exp(A_log) * softplus(a + dt_bias): one definition for the pass and for
// delta_blocked_pending_kernel, which must give the same bits (as must inv_norm_lane below,
// which both the MMA instance's pass and the pending kernel use).
BARO_DEV float gate_g(float a_val, float neg_exp_A, float dt_bias) { return neg_exp_A * softplusf_(a_val + dt_bias); }

// A row of DK floats held across a warp: lane l has x[l + 32 e] in v[e] (0 past DK).
template <int DK>
struct LaneRow {
  float v[(DK + BARO_WARP - 1) / BARO_WARP];
};

template <int DK>
BARO_DEV void load_lane_row(const float* x, LaneRow<DK>& r) {
  const int lane = lane_id();
#pragma unroll
  for (int e = 0; e * BARO_WARP < DK; ++e) r.v[e] = lane + e * BARO_WARP < DK ? x[lane + e * BARO_WARP] : 0.0f;
}

// inv_norm's value from the lane's registers: the same lane chain (x[lane]^2, x[lane+32]^2, ...
// fmaf from +0) and butterfly as warp_sumsq, so the same bits (for DK <= 128 warp_sumsq takes
// only its one-step loop).
template <int DK>
BARO_DEV float inv_norm_lane(const LaneRow<DK>& r) {
  const int lane = lane_id();
  float acc = 0.0f;
#pragma unroll
  for (int e = 0; e * BARO_WARP < DK; ++e)
    if (lane + e * BARO_WARP < DK) acc = fmaf(r.v[e], r.v[e], acc);
  return 1.0f / sqrtf(warp_sum(acc) + 1e-6f);
}

// Step 1 of a pass (rows r0 .. r0+len-1 in slots sa ..): normalised q into Qs rows qrow0 ..,
// normalised k into Kp slots sa .., beta, and (one thread, slot order) c_i = c_{i-1} + g_i into
// Cp with G_i = exp(c_i) into g. Ends after a barrier.
// AHEAD (the MMA instance; the CUDA-core instance keeps its code as it was): each warp holds its
// next (row, q|k) item's elements while it reduces the current one, so the rows' global reads
// overlap instead of costing a latency each, and the chain of c is the adds alone, exp(c) after
// it in parallel. The values are the same either way (the same lane chain and butterfly, the same
// c and exp(c)).
template <int DK, bool AHEAD>
BARO_DEV void pass_rows(const DeltaBlockedArgs& a, const Smem& sm, int kh, int h, int64_t r0, int sa, int len,
                        int qrow0, int ldq, int ldk, float neg_exp_A, float dt_bias) {
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id();
  constexpr int NW = kNT / BARO_WARP;
  const int nk = a.nk, nv = a.nv;
  const int64_t C = static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(nv) * a.dv;
  if constexpr (AHEAD) {
    // item t: row r0 + t / 2, its q (t even) or k (t odd)
    auto src = [&](int t) {
      return a.y + (r0 + (t >> 1)) * C + static_cast<int64_t>((t & 1) ? nk + kh : kh) * DK;
    };
    LaneRow<DK> cur, nxt;
    if (warp < 2 * len) load_lane_row<DK>(src(warp), cur);
    for (int t = warp; t < 2 * len; t += NW) {
      if (t + NW < 2 * len) load_lane_row<DK>(src(t + NW), nxt);
      const int tt = t >> 1;
      const float rs = inv_norm_lane<DK>(cur);
#pragma unroll
      for (int e = 0; e * BARO_WARP < DK; ++e) {
        const int r = lane + e * BARO_WARP;
        if (r >= DK) continue;
        if ((t & 1) == 0)
          sm.Qs[(qrow0 + tt) * ldq + r] = (cur.v[e] * rs) * a.scale;
        else
          sm.Kp[(sa + tt) * ldk + r] = cur.v[e] * rs;
      }
      cur = nxt;
    }
  } else {
    for (int t = warp; t < 2 * len; t += NW) {
      const int tt = t >> 1;
      const float* yr = a.y + (r0 + tt) * C;
      if ((t & 1) == 0) {
        const float* q = yr + static_cast<int64_t>(kh) * DK;
        const float rq = 1.0f / sqrtf(warp_sumsq(q, DK) + 1e-6f);
        for (int r = lane; r < DK; r += BARO_WARP) sm.Qs[(qrow0 + tt) * ldq + r] = (q[r] * rq) * a.scale;
      } else {
        const float* k = yr + static_cast<int64_t>(nk + kh) * DK;
        const float rk = 1.0f / sqrtf(warp_sumsq(k, DK) + 1e-6f);
        for (int r = lane; r < DK; r += BARO_WARP) sm.Kp[(sa + tt) * ldk + r] = k[r] * rk;
      }
    }
  }
  for (int tt = tid; tt < len; tt += kNT) {
    const int64_t row = r0 + tt;
    sm.beta[tt] = sigmoidf_(a.b[row * nv + h]);
    sm.g[tt] = gate_g(a.a[row * nv + h], neg_exp_A, dt_bias);
  }
  __syncthreads();
  if constexpr (AHEAD) {
    if (tid == 0) {  // c_i = c_{i-1} + g_i, slot order
      float c = sa == 0 ? 0.0f : sm.Cp[sa - 1];
      for (int tt = 0; tt < len; ++tt) {
        c = sa + tt == 0 ? sm.g[tt] : c + sm.g[tt];
        sm.Cp[sa + tt] = c;
      }
    }
    __syncthreads();
    for (int tt = tid; tt < len; tt += kNT) sm.g[tt] = expf(sm.Cp[sa + tt]);  // G_i
  } else if (tid == 0) {  // c_i = c_{i-1} + g_i, slot order; G_i = exp(c_i)
    for (int tt = 0; tt < len; ++tt) {
      const int i = sa + tt;
      const float c = i == 0 ? sm.g[tt] : sm.Cp[i - 1] + sm.g[tt];
      sm.Cp[i] = c;
      sm.g[tt] = expf(c);
    }
  }
  __syncthreads();
}

// One row's u and o in one column (steps 3-4 of NUMERICS "delta_blocked"): su and so start at
// the sums over slots < j0 (+0 in the CUDA-core instance, the mma over the row's earlier tiles in
// the MMA instance), then one fmaf chain over slots j0 .. i-1, the j = i term of o last. up is
// the column's pending u (slot j at up[j * ldu]); writes u_i there and returns o_i.
BARO_DEV float row_uo(const float* akk, const float* aqk, float* up, int ldu, int j0, int i, float su, float so,
                      float beta, float G, float v, float ks0, float qs0) {
  for (int j = j0; j < i; ++j) {
    const float uj = up[j * ldu];
    su = fmaf(akk[j], uj, su);
    so = fmaf(aqk[j], uj, so);
  }
  const float u = beta * ((v - G * ks0) - su);
  up[i * ldu] = u;
  so = fmaf(aqk[i], u, so);
  return G * qs0 + so;
}

// The close's first half: e_j = exp(c_{B-1} - c_j), pending_k[j] *= e_j in place (the
// contract's rounded e_j * k_j[r]). Ends after a barrier.
BARO_DEV void close_scale_k(const Smem& sm, int B, int DK, int ldk) {
  const int tid = static_cast<int>(threadIdx.x);
  __syncthreads();  // every read of Kp / Cp / Aqk of the pass is done
  const float cl = sm.Cp[B - 1];
  for (int j = tid; j < B; j += kNT) sm.e[j] = expf(cl - sm.Cp[j]);
  __syncthreads();
  for (int i = tid; i < B * DK; i += kNT) {
    const int j = i / DK, r = i % DK;
    sm.Kp[j * ldk + r] = sm.e[j] * sm.Kp[j * ldk + r];
  }
  __syncthreads();
}

// The close's last step, after the state update: every pending slot -> +0 (u: the CTA's
// ncols shared columns).
BARO_DEV void close_clear(const Smem& sm, int B, int DK, int ldk, int ldu, int ncols) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid < ncols)
    for (int j = 0; j < B; ++j) sm.Up[j * ldu + tid] = 0.0f;
  __syncthreads();
  for (int i = tid; i < B * DK; i += kNT) sm.Kp[(i / DK) * ldk + i % DK] = 0.0f;
  for (int j = tid; j < B; j += kNT) sm.Cp[j] = 0.0f;
}

// Results on CUDA: the pending slots the call changed (all of them when a block closed): k and
// c when with_kc, u of the CTA's columns (as load_pending).
template <int DK>
BARO_DEV void store_pending(const DeltaBlockedArgs& a, const Smem& sm, int h, int i0, int64_t n, bool closed,
                            int ldk, int ldu, int col0, int ncols, bool with_kc) {
  if constexpr (kSmemPending) {
    const int tid = static_cast<int>(threadIdx.x), B = a.B, dv = a.dv;
    const int d = col0 + tid;
    float* const pk_g = a.pk_out + static_cast<int64_t>(h) * B * DK;
    float* const pu_g = a.pu_out + static_cast<int64_t>(h) * B * dv;
    float* const pc_g = a.pc_out + static_cast<int64_t>(h) * B;
    const int lo = closed ? 0 : i0;
    const int hi = closed ? B : i0 + static_cast<int>(n);
    if (with_kc) {
      for (int i = lo * DK + tid; i < hi * DK; i += kNT) pk_g[i] = sm.Kp[(i / DK) * ldk + i % DK];
      for (int j = lo + tid; j < hi; j += kNT) pc_g[j] = sm.Cp[j];
    }
    if (tid < ncols && d < dv)
      for (int j = lo; j < hi; ++j) pu_g[static_cast<int64_t>(j) * dv + d] = sm.Up[j * ldu + tid];
  }
}

template <int DK>
__global__ void __launch_bounds__(kNT, 1) delta_blocked_kernel(DeltaBlockedArgs a) {
  extern __shared__ __align__(16) float smem[];
  const int tid = static_cast<int>(threadIdx.x);
  const int h = static_cast<int>(blockIdx.x);  // value head
  const int nk = a.nk, nv = a.nv, dv = a.dv, B = a.B;
  const int kh = h / (nv / nk);
  const int d = tid;
  const bool has = d < dv;
  const int64_t C = static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(nv) * dv;
  const int64_t m = a.m;
  const int64_t n = clamp_rows(a.n_valid, m);
  const int64_t pos = *a.pos < 0 ? 0 : *a.pos;
  const int i0 = static_cast<int>(pos % B);

  // Shared layout (offsets in floats, each a multiple of 4).
  const int ldq = DK + 4;
  Smem sm;
  int ldk, ldu;
  {
    float* p = smem;
    sm.Qs = p; p += kSeg * ldq;
    sm.KS = p; p += kSeg * kNT;
    sm.QS = p; p += kSeg * kNT;
    sm.Akk = p; p += kSeg * kMaxB;
    sm.Aqk = p; p += kSeg * kMaxB;
    sm.beta = p; p += kSeg;
    sm.g = p; p += kSeg;
    sm.e = p; p += kMaxB;
    if constexpr (kSmemPending) {
      ldk = DK + 4;  // float4 reads of 8 consecutive slots hit distinct banks
      ldu = kNT;
      sm.Kp = p; p += kMaxB * ldk;
      sm.Up = p; p += kMaxB * ldu;
      sm.Cp = p; p += kMaxB;
    } else {
      ldk = DK;
      ldu = dv;
      sm.Kp = a.pk_out + static_cast<int64_t>(h) * B * DK;
      sm.Up = a.pu_out + static_cast<int64_t>(h) * B * dv;
      sm.Cp = a.pc_out + static_cast<int64_t>(h) * B;
    }
  }

  // Padded rows: o = 0, no trace in the state; the pending slots < pos % B (the only ones read).
  load_pending<DK>(a, sm, h, i0, ldk, ldu, n, 0, kNT, true);
  if (n == 0) return;

  // S0 column d into registers.
  float s[DK];
  {
    const float* S = a.s0_in + static_cast<int64_t>(h) * DK * dv;
#pragma unroll
    for (int r = 0; r < DK; ++r) s[r] = has ? S[static_cast<int64_t>(r) * dv + d] : 0.0f;
  }

  const float neg_exp_A = -expf(a.A_log[h]);
  const float dt_bias = a.dt_bias[h];
  bool closed = false;

  for (int64_t r0 = 0; r0 < n;) {
    const int sa = static_cast<int>((pos + r0) % B);
    int len = B - sa;
    if (len > kSeg) len = kSeg;
    if (n - r0 < len) len = static_cast<int>(n - r0);

    // 1. q, k, gates of the pass's rows.
    pass_rows<DK, false>(a, sm, kh, h, r0, sa, len, 0, ldq, ldk, neg_exp_A, dt_bias);

    // 2. coefficients over (row, slot j <= i), and ks0 per (row, column).
    for (int idx = tid; idx < len * B; idx += kNT) {
      const int tt = idx / B, j = idx % B, i = sa + tt;
      if (j > i) continue;
      const float* kj = sm.Kp + j * ldk;
      const float w = expf(sm.Cp[i] - sm.Cp[j]);
      sm.Aqk[tt * kMaxB + j] = w * dot_chain<DK>(sm.Qs + tt * ldq, kj);
      if (j < i) sm.Akk[tt * kMaxB + j] = w * dot_chain<DK>(sm.Kp + i * ldk, kj);
    }
    if (has) {
      int tt = 0;
      for (; tt + 1 < len; tt += 2) {  // four independent chains (ILP); each is dot_col's chain
        const float x0 = dot_col<DK>(s, sm.Kp + (sa + tt) * ldk);
        const float y0 = dot_col<DK>(s, sm.Qs + tt * ldq);
        const float x1 = dot_col<DK>(s, sm.Kp + (sa + tt + 1) * ldk);
        const float y1 = dot_col<DK>(s, sm.Qs + (tt + 1) * ldq);
        sm.KS[tt * kNT + d] = x0;
        sm.QS[tt * kNT + d] = y0;
        sm.KS[(tt + 1) * kNT + d] = x1;
        sm.QS[(tt + 1) * kNT + d] = y1;
      }
      if (tt < len) {
        sm.KS[tt * kNT + d] = dot_col<DK>(s, sm.Kp + (sa + tt) * ldk);
        sm.QS[tt * kNT + d] = dot_col<DK>(s, sm.Qs + tt * ldq);
      }
    }
    __syncthreads();

    // 3. u and o, row by row; thread d owns column d of u.
    if (has) {
      for (int tt = 0; tt < len; ++tt) {
        const int i = sa + tt;
        const int64_t row = r0 + tt;
        const float* akk = sm.Akk + tt * kMaxB;
        const float* aqk = sm.Aqk + tt * kMaxB;
        const float G = sm.g[tt];
        const float v = a.y[row * C + static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(h) * dv + d];
        a.o[(row * nv + h) * dv + d] = row_uo(akk, aqk, sm.Up + d, ldu, 0, i, 0.0f, 0.0f, sm.beta[tt], G, v,
                                              sm.KS[tt * kNT + d], sm.QS[tt * kNT + d]);
      }
    }

    // 4. the block closes: S_B = G * S0 + sum_j (e_j k_j) u_j^T; pending slots -> +0.
    if (sa + len == B) {
      closed = true;
      close_scale_k(sm, B, DK, ldk);
      const float G = sm.g[len - 1];
      if (has) {
#pragma unroll
        for (int r = 0; r < DK; r += 4) {
          float c0 = 0.0f, c1 = 0.0f, c2 = 0.0f, c3 = 0.0f;
          for (int j = 0; j < B; ++j) {
            const float uj = sm.Up[j * ldu + d];
            const float4 ek = *reinterpret_cast<const float4*>(sm.Kp + j * ldk + r);
            c0 = fmaf(ek.x, uj, c0);
            c1 = fmaf(ek.y, uj, c1);
            c2 = fmaf(ek.z, uj, c2);
            c3 = fmaf(ek.w, uj, c3);
          }
          s[r + 0] = G * s[r + 0] + c0;
          s[r + 1] = G * s[r + 1] + c1;
          s[r + 2] = G * s[r + 2] + c2;
          s[r + 3] = G * s[r + 3] + c3;
        }
      }
      close_clear(sm, B, DK, ldk, ldu, dv);  // thread d read only column d of Up above
    }
    __syncthreads();  // the pass's Qs / KS / coefficients are free again
    r0 += len;
  }

  // Results: S0 (only when a block closed: else the result already holds it),
  // and on CUDA the pending slots the call changed.
  if (closed && has) {
    float* S = a.s0_out + static_cast<int64_t>(h) * DK * dv;
#pragma unroll
    for (int r = 0; r < DK; ++r) S[static_cast<int64_t>(r) * dv + d] = s[r];
  }
  store_pending<DK>(a, sm, h, i0, n, closed, ldk, ldu, 0, kNT, true);
}

#if !BARO_HIP
// ---------------------------------------------------------------------------
// The MMA instance (BARO_DELTA_BLOCKED_MMA=1, CUDA only): the same block rule with its
// products on the tensor cores, its own bits (docs/NUMERICS.md "delta_blocked", GPU).
//
// Precision: the rule is fp32 on fp32 operands (q, k, S0, u, e_j k_j: nothing is rounded to
// bf16), so a bf16 mma or one TF32 mma (10 mantissa bits) would be a different, coarser rule.
// Each product is 3xTF32: x = hi + lo with hi = tf32(x) (cvt.rna), lo = tf32(x - hi) (the
// remainder is exact in fp32), and a b ~ lo_a hi_b + hi_a lo_b + hi_a hi_b, the three mmas in
// that order into one fp32 accumulator (the dropped lo_a lo_b and lo's own rounding are
// ~2^-21 of |a b|: fp32's order of error, not TF32's 2^-11).
//
// Order (what makes a value a function of its own indices only): every product is
// mma.sync.m16n8k8 over its K in ascending 8-wide steps into one accumulator from +0, no
// split-K; the tiles are at absolute slots (rows of a 16-slot tile at slot % 16, slot columns
// at slot % 8, state rows and columns at their index), so a row's operands sit in the same
// fragment positions whether it is decoded alone (the tile's other rows zero or stale, their
// outputs discarded) or inside any prefill chunk. An mma's output element depends only on its
// own A row, B column and accumulator; the GPU tests check the resulting bytes (decode ==
// prefill at every split) on the card.
//
//   ks0, qs0  = K S0, Q S0 over dk (tiles of 16 slots x 8 columns);
//   akk, aqk  = exp(c_i - c_j) * (k_i . k_j), (q_i . k_j) over dk (16 slots x 8 slots);
//   u_i[d]    = beta * ((v - G * ks0) - s), s = [mma over the slots of the row's earlier
//               16-slot tiles] then one fmaf chain over the row's own tile's slots j < i;
//   o_i[d]    = G * qs0 + s, s = [mma over the earlier tiles] then the fmaf chain over the own
//               tile's slots j < i, the j = i term last;
//   close     = S0[r, d] = G * S0[r, d] + [mma over all B slots of (e_j k_j[r]) u_j[d]].
// The forward substitution stays sequential only inside a 16-slot tile (at most 15 fmaf steps
// per row and column); the rest are mma tiles. Slots past a row never enter its sums: the mma
// parts cover only whole tiles of earlier slots and the chain stops at the row (the contract's
// select, never 0 * garbage).
//
// Layout: grid nv x ceil(dv / 32), one CTA of 4 warps per (value head, 32 state columns): the
// columns of S0, u, o are independent (every product over columns reads only its own column
// of S0 / U), so the head's work splits over 4 CTAs at dv = 128 (128 CTAs for the model's 32
// heads, where one CTA per head left 100 of 132 SMs idle). What the columns share (q, k, c,
// akk, aqk) each CTA forms itself, by the same code on the same operands: the same bits.
// pending_k / pending_c are read by all of a head's CTAs and, aliased, updated in place, so
// this grid never writes them: delta_blocked_pending_kernel, launched after it, writes the
// call's rows into them (recomputed by the same definitions). S0 and the pending u of the
// CTA's columns live in shared memory (mma B/C operands); passes are at most the 32 slots of
// an aligned window [32w, 32w + 32), so a pass spans at most two row tiles; the mma tiles
// (row tile x 8-column tile x which product) are dealt round-robin over the warps.
// ---------------------------------------------------------------------------
namespace mma3 {

constexpr int kWin = 32;         // rows per pass: an aligned window of 32 slots (two row tiles)
constexpr int kCols = 32;        // state columns per CTA (grid nv x ceil(dv / 32): 128 CTAs at the model's 32 heads)
constexpr int kLdC = kCols + 8;  // S0 / Up / KS / QS / Ru / Ro rows: (8 k + n) % 32 distinct for a B fragment
constexpr int kLdA = kMaxB + 4;  // Akk / Aqk rows: (4 g + k) % 32 distinct for an A fragment

// x as (hi, lo) tf32 values (the 3xTF32 split).
BARO_DEV void split(float x, uint32_t& hi, uint32_t& lo) {
  uint32_t h, l;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(h) : "f"(x));
  const float r = x - __uint_as_float(h);
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(l) : "f"(r));
  hi = h;
  lo = l;
}

BARO_DEV void mma_tf32(float c[4], const uint32_t a[4], const uint32_t b[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// c[t] (16 x 8, t < NT) += A (16 x 8*ksteps) * B_t (8*ksteps x 8), 3xTF32, k ascending.
// fa(row, k) gives A's element (row < 16); fb(k, col) B's (col < 8*NT: tile t holds columns
// 8t .. 8t+7). Fragments as the PTX ISA's m16n8k8 .tf32: g = lane / 4, q = lane % 4;
// A (g, q), (g+8, q), (g, q+4), (g+8, q+4); B (q, g), (q+4, g); C (g, 2q), (g, 2q+1),
// (g+8, 2q), (g+8, 2q+1).
template <int NT, class FA, class FB>
BARO_DEV void tiles(float (&c)[NT][4], int ksteps, FA fa, FB fb) {
  const int lane = lane_id(), g = lane >> 2, q = lane & 3;
  for (int s = 0; s < ksteps; ++s) {
    const int k0 = 8 * s;
    uint32_t ah[4], al[4];
    split(fa(g, k0 + q), ah[0], al[0]);
    split(fa(g + 8, k0 + q), ah[1], al[1]);
    split(fa(g, k0 + q + 4), ah[2], al[2]);
    split(fa(g + 8, k0 + q + 4), ah[3], al[3]);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      uint32_t bh[2], bl[2];
      split(fb(k0 + q, 8 * t + g), bh[0], bl[0]);
      split(fb(k0 + q + 4, 8 * t + g), bh[1], bl[1]);
      mma_tf32(c[t], al, bh);
      mma_tf32(c[t], ah, bl);
      mma_tf32(c[t], ah, bh);
    }
  }
}

template <int NT>
BARO_DEV void zero(float (&c)[NT][4]) {
#pragma unroll
  for (int t = 0; t < NT; ++t) c[t][0] = c[t][1] = c[t][2] = c[t][3] = 0.0f;
}

// Each element (row, col) of c as out(row, col, value), tile t at columns 8t.
template <int NT, class F>
BARO_DEV void each(const float (&c)[NT][4], F out) {
  const int lane = lane_id(), g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    out(g, 8 * t + 2 * q, c[t][0]);
    out(g, 8 * t + 2 * q + 1, c[t][1]);
    out(g + 8, 8 * t + 2 * q, c[t][2]);
    out(g + 8, 8 * t + 2 * q + 1, c[t][3]);
  }
}

}  // namespace mma3

template <int DK>
__global__ void __launch_bounds__(kNT, 1) delta_blocked_mma_kernel(DeltaBlockedArgs a) {
  using namespace mma3;
  extern __shared__ __align__(16) float smem[];
  constexpr int NW = kNT / BARO_WARP;
  constexpr int NCT = kCols / 8;  // the CTA's 8-column tiles
  const int tid = static_cast<int>(threadIdx.x), warp = warp_id();
  const int h = static_cast<int>(blockIdx.x);  // value head
  const int cb = static_cast<int>(blockIdx.y) * kCols;  // the CTA's first state column
  const int nk = a.nk, nv = a.nv, dv = a.dv, B = a.B;
  const int kh = h / (nv / nk);
  const int d = cb + tid;  // thread tid < kCols: state column d, shared column tid
  const bool has = tid < kCols && d < dv;
  const int64_t C = static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(nv) * dv;
  const int64_t n = clamp_rows(a.n_valid, a.m);
  const int64_t pos = *a.pos < 0 ? 0 : *a.pos;
  const int i0 = static_cast<int>(pos % B);

  constexpr int ldq = DK + 4, ldk = DK + 4, ldu = kLdC;
  Smem sm;
  {
    float* p = smem;
    sm.S = p; p += DK * kLdC;
    sm.Up = p; p += kMaxB * ldu;
    sm.KS = p; p += kWin * kLdC;
    sm.QS = p; p += kWin * kLdC;
    sm.Ru = p; p += 16 * kLdC;
    sm.Ro = p; p += 16 * kLdC;
    sm.V = p; p += kWin * kLdC;
    sm.Kp = p; p += kMaxB * ldk;
    sm.Qs = p; p += kWin * ldq;
    sm.Akk = p; p += kWin * kLdA;
    sm.Aqk = p; p += kWin * kLdA;
    sm.Cp = p; p += kMaxB;
    sm.beta = p; p += kWin;
    sm.g = p; p += kWin;
    sm.e = p; p += kMaxB;
  }

  // Every pending word starts as +0 in shared memory (then the slots < pos % B are loaded):
  // slots >= pos % B as the contract has them, slots past B up to kMaxB (the close's last
  // 8-slot step reads them) and columns past dv; the coefficient rows too. An mma tile then
  // never reads uninitialised words (outputs of such rows and columns are discarded, but every
  // operand stays finite and fixed).
  for (int i = tid; i < kMaxB * ldk; i += kNT) sm.Kp[i] = 0.0f;
  for (int i = tid; i < kMaxB * ldu; i += kNT) sm.Up[i] = 0.0f;
  for (int i = tid; i < 2 * kWin * kLdA; i += kNT) sm.Akk[i] = 0.0f;  // Akk, Aqk adjacent
  __syncthreads();
  // pending_k / pending_c are read here (slots < pos % B) by every column CTA of the head and
  // written only by delta_blocked_pending_kernel after this grid: no CTA can overwrite them
  // while another still reads them.
  load_pending<DK>(a, sm, h, i0, ldk, ldu, n, cb, kCols, true);
  if (n == 0) return;
  // The CTA's columns of S0 into shared memory; columns past dv are +0 (an mma's columns past
  // dv stay 0).
  {
    const float* S = a.s0_in + static_cast<int64_t>(h) * DK * dv;
    if (tid < kCols)
      for (int r = 0; r < DK; ++r) sm.S[r * kLdC + tid] = has ? S[static_cast<int64_t>(r) * dv + d] : 0.0f;
  }

  const float neg_exp_A = -expf(a.A_log[h]);
  const float dt_bias = a.dt_bias[h];
  bool closed = false;

  for (int64_t r0 = 0; r0 < n;) {
    const int sa = static_cast<int>((pos + r0) % B);
    const int w0 = sa & ~(kWin - 1);  // the pass's window [w0, w0 + 32)
    int len = imin(B, w0 + kWin) - sa;
    if (n - r0 < len) len = static_cast<int>(n - r0);
    const int se = sa + len;  // one past the pass's last slot
    // Window rows outside the pass: q = +0 (their outputs are discarded).
    for (int i = tid; i < kWin * DK; i += kNT) {
      const int wr = i / DK, sl = w0 + wr;
      if (sl < sa || sl >= se) sm.Qs[wr * ldq + i % DK] = 0.0f;
    }

    // 1. q (window row slot - w0), k, gates, c of the pass's rows.
    pass_rows<DK, true>(a, sm, kh, h, r0, sa, len, sa - w0, ldq, ldk, neg_exp_A, dt_bias);
    const int t_lo = sa >> 4, t_hi = (se - 1) >> 4;  // the row tiles the pass touches
    const int ntl = t_hi - t_lo + 1;
    // v of the pass's rows (independent loads, issued together: off the chain's critical path)
    if (has)
      for (int tt = 0; tt < len; ++tt)
        sm.V[(sa - w0 + tt) * kLdC + tid] =
            a.y[(r0 + tt) * C + static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(h) * dv + d];

    // 2a. akk, aqk: per (row tile, 8-slot column tile, which), dealt over the warps; slot
    //     columns up to the tile's last slot (and < B). Kept where j < i (akk) / j <= i (aqk).
    //     Every column CTA of the head computes them (the same bits: the same operands and code).
    {
      const int nct = imin((t_hi + 1) * 16, (B + 7) & ~7) / 8;  // column tiles of the last row tile
      const int per = 2 * nct;
      for (int it = warp; it < ntl * per; it += NW) {
        const int t = t_lo + it / per, ct = (it % per) >> 1;
        const bool qk = (it & 1) != 0;
        if (8 * ct >= imin((t + 1) * 16, B)) continue;  // past the row tile's last slot (warp-uniform)
        float c[1][4];
        zero(c);
        static_assert(ldq == ldk, "one A row stride for q and k rows");
        const float* arow = qk ? sm.Qs + (16 * t - w0) * ldq : sm.Kp + 16 * t * ldk;
        tiles<1>(c, DK / 8, [&](int r, int k) { return arow[r * ldk + k]; },
                 [&](int k, int j) { return sm.Kp[(8 * ct + j) * ldk + k]; });
        float* A = qk ? sm.Aqk : sm.Akk;
        each(c, [&](int r, int jj, float v) {
          const int i = 16 * t + r, j = 8 * ct + jj;
          if (i < sa || i >= se || j > i || (!qk && j == i)) return;
          A[(i - w0) * kLdA + j] = expf(sm.Cp[i] - sm.Cp[j]) * v;
        });
      }
    }
    // 2b. ks0, qs0 of the touched row tiles in the CTA's columns: per (row tile, column tile,
    //     which), dealt over the warps.
    for (int it = warp; it < ntl * NCT * 2; it += NW) {
      const int t = t_lo + it / (2 * NCT), ct = (it % (2 * NCT)) >> 1;
      const bool qk = (it & 1) != 0;
      float c[1][4];
      zero(c);
      const float* arow = qk ? sm.Qs + (16 * t - w0) * ldq : sm.Kp + 16 * t * ldk;
      const float* Sc = sm.S + 8 * ct;
      tiles<1>(c, DK / 8, [&](int r, int k) { return arow[r * ldk + k]; },
               [&](int k, int col) { return Sc[k * kLdC + col]; });
      float* out = (qk ? sm.QS : sm.KS) + (16 * t - w0) * kLdC + 8 * ct;
      each(c, [&](int r, int col, float v) { out[r * kLdC + col] = v; });
    }
    __syncthreads();

    // 3. per row tile: the mma over the earlier tiles' slots (u of slots < 16 t are final:
    //    pending, or this pass's earlier tile), then the chain over the tile's own slots.
    for (int t = t_lo; t <= t_hi; ++t) {
      for (int it = warp; it < NCT * 2; it += NW) {
        const int ct = it >> 1;
        const bool qk = (it & 1) != 0;
        float c[1][4];
        zero(c);
        const float* ar = (qk ? sm.Aqk : sm.Akk) + (16 * t - w0) * kLdA;
        const float* Uc = sm.Up + 8 * ct;
        tiles<1>(c, 2 * t, [&](int r, int j) { return ar[r * kLdA + j]; },
                 [&](int j, int col) { return Uc[j * ldu + col]; });
        float* out = (qk ? sm.Ro : sm.Ru) + 8 * ct;
        each(c, [&](int r, int col, float v) { out[r * kLdC + col] = v; });
      }
      __syncthreads();
      if (has) {
        const int ilo = imax(sa, 16 * t), ihi = imin(se, 16 * t + 16);
        for (int i = ilo; i < ihi; ++i) {
          const int tt = i - sa, wr = i - w0;
          const int64_t row = r0 + tt;
          const float* akk = sm.Akk + wr * kLdA;
          const float* aqk = sm.Aqk + wr * kLdA;
          const float G = sm.g[tt];
          const float v = sm.V[wr * kLdC + tid];
          a.o[(row * nv + h) * dv + d] =
              row_uo(akk, aqk, sm.Up + tid, ldu, 16 * t, i, sm.Ru[(i - 16 * t) * kLdC + tid],
                     sm.Ro[(i - 16 * t) * kLdC + tid], sm.beta[tt], G, v, sm.KS[wr * kLdC + tid],
                     sm.QS[wr * kLdC + tid]);
        }
      }
      __syncthreads();  // the tile's u before the next tile's mma reads them; Ru / Ro free
    }

    // 4. the block closes: S0[r, d] = G * S0[r, d] + sum_j (e_j k_j[r]) u_j[d] (one mma
    //    accumulator from +0 over the B slots, then the contract's G * S0 + acc), per (16-row
    //    tile of S0, column tile), dealt over the warps.
    if (se == B) {
      closed = true;
      close_scale_k(sm, B, DK, ldk);
      const float G = sm.g[len - 1];
      for (int it = warp; it < (DK / 16) * NCT; it += NW) {
        const int rt = it / NCT, ct = it % NCT;
        float c[1][4];
        zero(c);
        const float* Uc = sm.Up + 8 * ct;
        tiles<1>(c, (B + 7) / 8, [&](int r, int j) { return sm.Kp[j * ldk + 16 * rt + r]; },
                 [&](int j, int col) { return Uc[j * ldu + col]; });
        float* Sr = sm.S + 16 * rt * kLdC + 8 * ct;
        each(c, [&](int r, int col, float v) { Sr[r * kLdC + col] = G * Sr[r * kLdC + col] + v; });
      }
      __syncthreads();  // every warp's reads of Up / Kp are done
      close_clear(sm, B, DK, ldk, ldu, kCols);
    }
    __syncthreads();  // the pass's Qs / KS / coefficients are free again
    r0 += len;
  }

  if (closed && has) {
    float* S = a.s0_out + static_cast<int64_t>(h) * DK * dv;
    for (int r = 0; r < DK; ++r) S[static_cast<int64_t>(r) * dv + d] = sm.S[r * kLdC + tid];
  }
  store_pending<DK>(a, sm, h, i0, n, closed, ldk, ldu, cb, kCols, false);
}

// pending_k / pending_c after delta_blocked_mma_kernel (stream order: every column CTA has
// read the old slots): the rows of the call in the block that holds pos + n (slots from
// pos % B, or from 0 when a block closed), k normalised and c = c_{i-1} + g_i by the pass's own
// definitions (inv_norm, gate_g, the same c expression in slot order), so the bytes are those
// the one-CTA-per-head instance would store; when a block closed, every other slot is +0.
template <int DK>
__global__ void __launch_bounds__(kNT, 1) delta_blocked_pending_kernel(DeltaBlockedArgs a) {
  __shared__ float gs[kMaxB];
  constexpr int NW = kNT / BARO_WARP;
  const int tid = static_cast<int>(threadIdx.x), lane = lane_id(), warp = warp_id();
  const int h = static_cast<int>(blockIdx.x);
  const int nk = a.nk, nv = a.nv, B = a.B;
  const int kh = h / (nv / nk);
  const int64_t C = static_cast<int64_t>(2 * nk) * DK + static_cast<int64_t>(nv) * a.dv;
  const int64_t n = clamp_rows(a.n_valid, a.m);
  if (n == 0) return;
  const int64_t pos = *a.pos < 0 ? 0 : *a.pos;
  const int i0 = static_cast<int>(pos % B);
  const bool closed = i0 + n >= B;
  const int64_t first = closed ? ((pos + n) / B) * B - pos : 0;  // the final block's first row
  const int s0 = closed ? 0 : i0;                                 // and its slot
  const int cnt = static_cast<int>(n - first);                    // its rows in this call
  float* const pk = a.pk_out + static_cast<int64_t>(h) * B * DK;
  float* const pc = a.pc_out + static_cast<int64_t>(h) * B;
  for (int t = warp; t < cnt; t += NW) {
    LaneRow<DK> k;
    load_lane_row<DK>(a.y + (first + t) * C + static_cast<int64_t>(nk + kh) * DK, k);
    const float rk = inv_norm_lane<DK>(k);
#pragma unroll
    for (int e = 0; e * BARO_WARP < DK; ++e)
      if (lane + e * BARO_WARP < DK) pk[(s0 + t) * DK + lane + e * BARO_WARP] = k.v[e] * rk;
  }
  const float neg_exp_A = -expf(a.A_log[h]);
  const float dt_bias = a.dt_bias[h];
  for (int t = tid; t < cnt; t += kNT) gs[t] = gate_g(a.a[(first + t) * nv + h], neg_exp_A, dt_bias);
  __syncthreads();
  if (tid == 0) {
    float c = s0 == 0 ? 0.0f : pc[s0 - 1];
    for (int t = 0; t < cnt; ++t) {
      c = s0 + t == 0 ? gs[t] : c + gs[t];
      pc[s0 + t] = c;
    }
  }
  if (closed) {
    for (int i = cnt * DK + tid; i < B * DK; i += kNT) pk[i] = 0.0f;
    for (int j = cnt + tid; j < B; j += kNT) pc[j] = 0.0f;
  }
}

size_t delta_blocked_mma_smem(int dk) {
  using namespace mma3;
  const size_t f = static_cast<size_t>(dk) * kLdC + static_cast<size_t>(kMaxB) * kLdC + 3 * kWin * kLdC +
                   2 * 16 * kLdC + static_cast<size_t>(kMaxB) * (dk + 4) + static_cast<size_t>(kWin) * (dk + 4) +
                   2 * kWin * kLdA + kMaxB + 2 * kWin + kMaxB;
  return f * sizeof(float);
}
#endif  // !BARO_HIP

size_t delta_blocked_smem(int dk) {
  size_t f = static_cast<size_t>(kSeg) * (dk + 4) + 2 * kSeg * kNT + 2 * kSeg * kMaxB + 2 * kSeg + kMaxB;
  if (kSmemPending) f += static_cast<size_t>(kMaxB) * (dk + 4) + kMaxB * kNT + kMaxB;
  return f * sizeof(float);
}

template <int DK>
gpuError_t launch_dk(const DeltaBlockedArgs& a, gpuStream_t stream) {
#if !BARO_HIP
  // The knob picks the arithmetic (the two instances' bits differ): read per call like every
  // knob, so a run must keep it fixed from its first token (docs/DESIGN.md §9).
  if (baro::knobs::on(baro::knobs::kDeltaBlockedMma)) {
    const size_t smem = delta_blocked_mma_smem(DK);  // dk = 128: 120,064 B
    if (smem > 48 * 1024) {
      const gpuError_t e = cudaFuncSetAttribute(delta_blocked_mma_kernel<DK>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem));
      if (e != gpuSuccess) return e;
    }
    const unsigned ncb = static_cast<unsigned>((a.dv + mma3::kCols - 1) / mma3::kCols);
    delta_blocked_mma_kernel<DK><<<dim3(static_cast<unsigned>(a.nv), ncb), kNT, smem, stream>>>(a);
    const gpuError_t e = gpuGetLastError();
    if (e != gpuSuccess) return e;
    // after the grid above (stream order): it writes the slots the grid's CTAs read
    delta_blocked_pending_kernel<DK><<<dim3(static_cast<unsigned>(a.nv)), kNT, 0, stream>>>(a);
    return gpuGetLastError();
  }
#endif
  const size_t smem = delta_blocked_smem(DK);  // CUDA, dk = 128: 197,888 B
#if !BARO_HIP
  if (smem > 48 * 1024) {
    const gpuError_t e = cudaFuncSetAttribute(delta_blocked_kernel<DK>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem));
    if (e != gpuSuccess) return e;
  }
#endif
  delta_blocked_kernel<DK><<<dim3(static_cast<unsigned>(a.nv)), kNT, smem, stream>>>(a);
  return gpuGetLastError();
}

}  // namespace

const char* delta_blocked_unsupported(int dk, int dv, int B) {
  if (!(dk == 16 || dk == 32 || dk == 64 || dk == 128)) return "key head dims 16, 32, 64, 128";
  if (dv < 1 || dv > kNT) return "value head dims up to 128";
  if (B < 1 || B > kMaxB) return "blocks of at most 64 rows";
  return "";
}

gpuError_t launch_delta_blocked(const DeltaBlockedArgs& a, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (a.nv <= 0) return gpuSuccess;
  if (*delta_blocked_unsupported(a.dk, a.dv, a.B) || a.nk <= 0 || a.nv % a.nk != 0)
    return gpuErrorInvalidValue;
  switch (a.dk) {
    case 16: return launch_dk<16>(a, stream);
    case 32: return launch_dk<32>(a, stream);
    case 64: return launch_dk<64>(a, stream);
    case 128: return launch_dk<128>(a, stream);
    default: return gpuErrorInvalidValue;
  }
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handler (same operands/results and checks as BaroDeltaBlockedCpu)
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

ffi::Error DeltaBlockedGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::F32> yb, ffi::Buffer<ffi::F32> b,
                               ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> A_log,
                               ffi::Buffer<ffi::F32> dt_bias, ffi::Buffer<ffi::F32> s0,
                               ffi::Buffer<ffi::F32> pk, ffi::Buffer<ffi::F32> pu,
                               ffi::Buffer<ffi::F32> pc, ffi::Buffer<ffi::S32> pos_buf,
                               ffi::Buffer<ffi::S32> n_valid_buf, ffi::ResultBuffer<ffi::F32> o,
                               ffi::ResultBuffer<ffi::F32> s0_out, ffi::ResultBuffer<ffi::F32> pk_out,
                               ffi::ResultBuffer<ffi::F32> pu_out, ffi::ResultBuffer<ffi::F32> pc_out) {
  const char* op = "baro_delta_blocked";
  baro::DeltaBlockedDims dims;
  if (auto err = baro::check_delta_blocked(yb, b, a, A_log, dt_bias, s0, pk, pu, pc, pos_buf,
                                           n_valid_buf, *o, *s0_out, *pk_out, *pu_out, *pc_out, dims);
      err.failure())
    return err;
  const char* why = baro_gpu::delta_blocked_unsupported(static_cast<int>(dims.dk), static_cast<int>(dims.dv),
                                                        static_cast<int>(dims.B));
  BARO_CHECK(dims.dk <= 128 && dims.dv <= 128 && dims.B <= 64 && *why == '\0', op,
             "the GPU kernel supports " << why << "; got dk=" << dims.dk << ", dv=" << dims.dv
                                        << ", B=" << dims.B);
  BARO_CHECK(dims.nv <= 0x7fffffffLL, op, "nv=" << dims.nv << " too large for the GPU grid");
  // pos and n_valid live on the device: their range checks (the CPU handler's "pos must be
  // >= 0", "n_valid must be in [0, m]") cannot run here without a sync; the kernel clamps
  // them (n_valid to [0, m], pos to >= 0), as baro_delta's GPU kernel does.

  for (auto [arg, ret] : {std::pair{&s0, &s0_out}, std::pair{&pk, &pk_out}, std::pair{&pu, &pu_out},
                          std::pair{&pc, &pc_out}}) {
    const gpuError_t e = baro_gpu::copy_if_not_aliased_async(*arg, *ret, stream);
    if (e != gpuSuccess) return baro_gpu::gpu_error(op, "state copy", e);
  }
  baro_gpu::DeltaBlockedArgs args;
  args.y = yb.typed_data();
  args.b = b.typed_data();
  args.a = a.typed_data();
  args.A_log = A_log.typed_data();
  args.dt_bias = dt_bias.typed_data();
  // One CTA per value head reads all of its head's state before writing it (CUDA), or works
  // on the results in place after the copy above (HIP): correct aliased or not. The MMA
  // instance's CTAs read / write only their own columns of S0 and pending_u, and its second
  // kernel writes pending_k / pending_c after every CTA has read them.
  args.s0_in = s0_out->typed_data();
  args.pk_in = pk_out->typed_data();
  args.pu_in = pu_out->typed_data();
  args.pc_in = pc_out->typed_data();
  args.s0_out = s0_out->typed_data();
  args.pk_out = pk_out->typed_data();
  args.pu_out = pu_out->typed_data();
  args.pc_out = pc_out->typed_data();
  args.pos = pos_buf.typed_data();
  args.n_valid = n_valid_buf.typed_data();
  args.o = o->typed_data();
  args.m = dims.m;
  args.nk = static_cast<int>(dims.nk);
  args.nv = static_cast<int>(dims.nv);
  args.dk = static_cast<int>(dims.dk);
  args.dv = static_cast<int>(dims.dv);
  args.B = static_cast<int>(dims.B);
  args.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(dims.dk)));
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_delta_blocked(args, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroDeltaBlockedGpu, baro::KnobChecked<DeltaBlockedGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // y
                                  .Arg<ffi::Buffer<ffi::F32>>()   // b
                                  .Arg<ffi::Buffer<ffi::F32>>()   // a
                                  .Arg<ffi::Buffer<ffi::F32>>()   // A_log
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dt_bias
                                  .Arg<ffi::Buffer<ffi::F32>>()   // state (S0)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // pending_k
                                  .Arg<ffi::Buffer<ffi::F32>>()   // pending_u
                                  .Arg<ffi::Buffer<ffi::F32>>()   // pending_c
                                  .Arg<ffi::Buffer<ffi::S32>>()   // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()   // n_valid
                                  .Ret<ffi::Buffer<ffi::F32>>()   // o
                                  .Ret<ffi::Buffer<ffi::F32>>()   // state (S0)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // pending_k
                                  .Ret<ffi::Buffer<ffi::F32>>()   // pending_u
                                  .Ret<ffi::Buffer<ffi::F32>>(),  // pending_c
                              {ffi::Traits::kCmdBufferCompatible});
