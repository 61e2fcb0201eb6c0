// baro_jax GPU: the per-row routing of the MoE as device functions (softmax + top-k of one
// row by one warp, the one-token top-k + grouping), shared by moe.cu's kernels and by
// gemm_row1's fused one-token gate/up (gemm_row1.cuh), so both give the same bits by
// running the same code.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.cuh"

namespace baro_gpu {

// A runtime-trip loop unrolled by 8 where the compiler does it (nvcc); hipcc warns that it
// cannot, so there it is a plain loop.
#if BARO_HIP
#define BARO_UNROLL_BY_8
#else
#define BARO_UNROLL_BY_8 _Pragma("unroll 8")
#endif

constexpr int kTopkRegPer = 16;  // E <= 512 in registers
// E <= 256 (Qwen3.5's 256 experts) holds 8 per lane: the entries past E are skipped by the
// e < E tests anyway, so the bits are kTopkRegPer's, in half the scan.
constexpr int kTopkRegPerSmall = 8;

// The largest bp of the warp, ties to the lowest be; every lane ends with the same pair. bp is
// a probability (>= 0, never NaN: the lane scan's > skips NaN) or the -1 of a lane with
// nothing left, so on CUDA the pair is two warp reductions of integers (redux.sync): the bits
// of a non-negative float order as signed ints do, and -1's are negative. A selection, not
// arithmetic, so both forms give the same pair; the route ran its k rounds of a 5-level
// butterfly of two shuffles on the critical path of every decode MoE layer.
BARO_DEV void warp_argmax(float& bp, int& be) {
#if !BARO_HIP && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const int key = __reduce_max_sync(0xffffffffu, __float_as_int(bp));
  be = __reduce_min_sync(0xffffffffu, __float_as_int(bp) == key ? be : 0x7fffffff);
  bp = __int_as_float(key);
#else
#pragma unroll
  for (int o = BARO_WARP / 2; o >= 1; o >>= 1) {
    const float op = shfl_xor(bp, o);
    const int oe = shfl_xor(be, o);
    if (op > bp || (op == bp && oe < be)) {
      bp = op;
      be = oe;
    }
  }
#endif
}

// probs[m][E] holds the logits on entry and the softmax probabilities after
// (taken entries -2). kPer > 0: E <= 32 * kPer, the row lives in registers
// (a decode row is latency-bound: one load wave instead of one per pass);
// kPer = 0: any E, in memory. Both run the same arithmetic in the same order:
// per lane e = lane, lane + 32, ... ascending, then the warp butterflies.
// One row by one warp: p = the row's E logits, ids / wts = its k outputs. Returns, in lane
// s < k, the expert of slot s (what ids[s] holds), so a caller need not read ids back.
// kWriteBack = false (register rows only): p is only read, the probabilities are not stored
// (the one-token route of gemm_row1's gate/up, where every warp routes for itself from the
// same logits while others still read them).
template <int kPer, bool kWriteBack = true>
BARO_DEV int topk_row(float* __restrict__ p, int32_t* __restrict__ ids, float* __restrict__ wts, int E, int k) {
  static_assert(kPer > 0 || kWriteBack, "the in-memory row is its own scratch");
  const int lane = lane_id();  // lane l only ever touches p[l + 32q]
  constexpr int kR = kPer > 0 ? kPer : 1;
  float v[kR];
  if constexpr (kPer > 0) {
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const int e = lane + BARO_WARP * q;
      v[q] = e < E ? p[e] : -INFINITY;
    }
  }
  auto val = [&](int q, int e) -> float {
    if constexpr (kPer > 0) return v[q]; else return p[e];
  };
  auto set = [&](int q, int e, float x) {
    if constexpr (kPer > 0) v[q] = x; else p[e] = x;
  };
  const int n_q = kPer > 0 ? kPer : (E + BARO_WARP - 1) / BARO_WARP;

  float mx = -INFINITY;
#pragma unroll
  for (int q = 0; q < n_q; ++q) {
    const int e = lane + BARO_WARP * q;
    if (e < E) mx = fmaxf(mx, val(q, e));
  }
  mx = warp_max(mx);
  float sum = 0.0f;
#pragma unroll
  for (int q = 0; q < n_q; ++q) {
    const int e = lane + BARO_WARP * q;
    if (e < E) {
      const float ex = expf(val(q, e) - mx);
      set(q, e, ex);
      sum = sum + ex;
    }
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int q = 0; q < n_q; ++q) {
    const int e = lane + BARO_WARP * q;
    if (e < E) set(q, e, val(q, e) / sum);
  }

  // top-k: descending p, ties to the lower id; taken entries become -2.
  float wsum = 0.0f;
  int picked = 0;
  float own_p = 0.0f;  // k <= BARO_WARP: lane s keeps slot s's p (no store and read-back)
  for (int s = 0; s < k; ++s) {
    float bp = -1.0f;
    int be = 0x7fffffff;
#pragma unroll
    for (int q = 0; q < n_q; ++q) {
      const int e = lane + BARO_WARP * q;
      if (e < E) {
        const float x = val(q, e);
        if (x > bp) {  // strict: the first (lowest) id of this lane wins ties
          bp = x;
          be = e;
        }
      }
    }
    warp_argmax(bp, be);
    if (be < 0 || be >= E) {  // only with NaN probabilities: stay in bounds
      be = 0;
      bp = 0.0f;
    }
    if ((be & (BARO_WARP - 1)) == lane) {
      if constexpr (kPer > 0) {
#pragma unroll
        for (int q = 0; q < kPer; ++q)
          if (lane + BARO_WARP * q == be) v[q] = -2.0f;
      } else {
        p[be] = -2.0f;
      }
    }
    // be, bp and wsum are the same in every lane after the butterfly
    if (lane == 0) ids[s] = be;
    if (k > BARO_WARP && lane == (s & (BARO_WARP - 1))) wts[s] = bp;
    if (lane == s) {
      picked = be;
      own_p = bp;
    }
    wsum = wsum + bp;
  }
  if (k <= BARO_WARP) {
    if (lane < k) wts[lane] = own_p / wsum;
  } else {
    for (int s = lane; s < k; s += BARO_WARP) wts[s] = wts[s] / wsum;  // a lane reads back its own stores
  }
  if constexpr (kPer > 0 && kWriteBack) {
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const int e = lane + BARO_WARP * q;
      if (e < E) p[e] = v[q];
    }
  }
  return picked;
}

BARO_DEV int clamp_expert(int e, int E) { return e < 0 ? 0 : (e >= E ? E - 1 : e); }

// The weight group of expert e: e itself, or its slot in the pool (baro_moe_slots), clamped
// into the pool so a non-resident expert (-1) never reads outside it; its rows are made NaN
// by the combine (moe_combine_kernel), so nothing reads another expert's weights silently.
BARO_DEV int weight_group(int e, const int32_t* slots, int S) {
  if (slots == nullptr) return e;
  const int s = slots[e];
  return s < 0 ? 0 : (s >= S ? S - 1 : s);
}

// host (baro_moe_host): an expert with no slot is read from outside the pool, group
// kHostGroup0 - x (below the folded shared expert's -2) instead of clamped into it. x is the
// expert (kHostByExpert: the GEMM reads the host store itself) or the pair's position
// (kHostByPair: the call staged pair j's expert in its scratch slot j first; one token, so a
// pair is its expert's only one).
constexpr int kHostGroup0 = -3;
constexpr int kHostByExpert = 1, kHostByPair = 2;
BARO_DEV int tile_group(int e, const int32_t* slots, int S, int host, int pair) {
  if (host && slots != nullptr && (slots[e] < 0 || slots[e] >= S)) return kHostGroup0 - (host == kHostByPair ? pair : e);
  return weight_group(e, slots, S);
}

// One token (m == 1, k <= 32, E <= 32 kTopkRegPer): top-k and grouping in one warp, one
// launch instead of two (the grouping block's scan was 3.4 us of a decode layer). The same
// top-k (topk_row) and the same result as moe_group_one_kernel: sorted position of pair s =
// pairs of lower experts + earlier pairs of its own expert (stable by pair), tiles of <= bm
// pairs per expert in expert order. fold_group < 0: one more tile (fold_group, k, 1) with
// srow[k] = 0, the shared expert as a k+1-th row of the grouped GEMMs (launch_moe).
// One warp; every lane calls it. The outputs may be global or shared memory.
template <int kPer, bool kWriteBack = true>
BARO_DEV void route_one_row(float* __restrict__ probs, int32_t* __restrict__ ids, float* __restrict__ wts,
                            int E, int k, int bm, int32_t* __restrict__ srow, int32_t* __restrict__ inv,
                            int32_t* __restrict__ tiles, int32_t* __restrict__ n_tiles, int64_t max_tiles,
                            const int32_t* __restrict__ slots, int S, int skip, int fold_group,
                            int host = 0) {
  // Every count below comes from the lanes' registers through shuffles (k <= 32: lane j holds
  // pair j's expert): the first version re-read ids from global memory inside O(k^3) loops,
  // hundreds of dependent round trips (13.6 us of a 1-warp kernel, 0.54 ms per decode token).
  const int lane = lane_id();
  const int picked = topk_row<kPer, kWriteBack>(probs, ids, wts, E, k);  // every lane takes part
  const int e = lane < k ? clamp_expert(picked, E) : E;
  const bool tiled = lane < k && !(skip && slots != nullptr && slots[e] < 0);
  int below = 0, before = 0, count = 0;  // pairs of lower experts; earlier pairs of e; pairs of e
BARO_UNROLL_BY_8
  for (int j = 0; j < k; ++j) {  // unrolled on CUDA: the shuffles are independent, issued back to back
    const int ej = shfl_idx(e, j);
    below += ej < e;
    before += ej == e && j < lane;
    count += ej == e;
  }
  // tiles of this pair's expert when the pair is its expert's first (stable by pair)
  const int own = before == 0 && tiled ? (count + bm - 1) / bm : 0;
  int64_t tiles_below = 0, total = 0;  // tiles of the experts below e; of every expert
BARO_UNROLL_BY_8
  for (int j = 0; j < k; ++j) {
    const int tj = shfl_idx(own, j);
    tiles_below += shfl_idx(e, j) < e ? tj : 0;
    total += tj;
  }
  if (lane < k) {
    const int at = below + before;
    srow[at] = 0;
    inv[lane] = at;
    int64_t nt = tiles_below;
    for (int st = 0; st < count && own > 0; st += bm, ++nt) {
      if (nt < max_tiles) {
        tiles[3 * nt + 0] = tile_group(e, slots, S, host, lane);
        tiles[3 * nt + 1] = below + st;
        tiles[3 * nt + 2] = count - st < bm ? count - st : bm;
      }
    }
  }
  if (lane == 0) {
    int64_t nt = total;
    if (fold_group < 0) {
      if (nt < max_tiles) {
        tiles[3 * nt + 0] = fold_group;
        tiles[3 * nt + 1] = k;
        tiles[3 * nt + 2] = 1;
      }
      srow[k] = 0;
      ++nt;
    }
    *n_tiles = static_cast<int32_t>(nt < max_tiles ? nt : max_tiles);
  }
}

}  // namespace baro_gpu
