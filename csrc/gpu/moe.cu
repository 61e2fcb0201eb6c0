// baro_moe (GPU): router matmul, softmax + top-k (ties to the lower id) +
// renormalisation per row, (row, slot) pairs grouped by expert on the device
// (parallel counting sort, stable by pair index), grouped gate/up GEMM with
// bf16(silu(g)*u) fused into its epilogue (or a separate pass when the fused
// kernel cannot run) -> grouped down GEMM (one fp32 row per pair), combine per
// row in slot order, shared expert times sigmoid(shared gate).
//
// Row independence: every GEMM goes through gemm.cuh (an output row depends
// only on its own A row and the weights, whatever tile it shares), the
// softmax/top-k of a row is done by one warp with fixed code, the combine of
// a row reads only its own pairs. So a row's output bits do not depend on
// which other rows are in the call (decode m = 1 vs prefill m = C).
//
// Weights are read once per (expert tile, N tile): an expert used by r pairs
// of the call is read ceil(r / BM) times, not once per token.
#include <cstdint>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>

#include "contract.h"
#include "common.cuh"
#include "ffi_gpu.h"
#include "gemm.cuh"
#include "launch.h"
#include "moe_route.cuh"
#include "moe_stage.cuh"
#include "host_store.h"
#include "scratch_layout.h"

namespace baro_gpu {

constexpr int kTopkWarps = 4;          // rows per block in moe_topk_kernel
constexpr int kGroupChunk = 512;       // pairs per block in the grouping kernels
static_assert(kGroupChunk == baro::scratch::kGroupChunk, "scratch_layout.h sizes the grouping chunks");
constexpr int kGroupThreads = 256;
constexpr int kScanThreads = 1024;     // moe_scan_kernel is a single block
constexpr int kSortMaxE = kMoeMaxExperts;  // per-chunk counts live in shared memory
constexpr int kElemThreads = 256;
constexpr int kMinGroupBM = 16;        // smallest GEMM BM of m > 1 calls: sizes the tile list
static_assert(kMinGroupBM == baro::scratch::kMinGroupBM, "scratch_layout.h sizes the tile list");
constexpr int kCombineAhead = 8;       // slots whose values moe_combine_kernel reads before it adds

template <int kPer>
__global__ void __launch_bounds__(kTopkWarps * BARO_WARP)
    moe_topk_kernel(float* __restrict__ probs, int64_t ld, int32_t* __restrict__ ids, float* __restrict__ wts,
                    int64_t m, int E, int k) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kTopkWarps + warp_id();
  if (row >= m) return;
  topk_row<kPer>(probs + row * ld, ids + row * k, wts + row * k, E, k);
}
// ld: the logits' row stride (E, or E + 1 with the shared gate's logit after each row's E)
static gpuError_t launch_topk(float* probs, int64_t ld, int32_t* ids, float* wts, int64_t m, int E, int k,
                              gpuStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((m + kTopkWarps - 1) / kTopkWarps);
  const auto topk = E <= BARO_WARP * kTopkRegPerSmall ? moe_topk_kernel<kTopkRegPerSmall>
                    : E <= BARO_WARP * kTopkRegPer    ? moe_topk_kernel<kTopkRegPer>
                                                      : moe_topk_kernel<0>;
  topk<<<blocks, kTopkWarps * BARO_WARP, 0, stream>>>(probs, ld, ids, wts, m, E, k);
  return gpuGetLastError();
}

// ---- grouping of the P = m*k pairs (p = row*k + slot) by expert ----
// Result, stable by p within each expert: srow[pos] = row of the pair at
// sorted position pos, inv[p] = its sorted position; tiles[t] = (expert,
// start, count <= bm) in expert order; *n_tiles. Integer counts only, so the
// result is exact whatever the thread timing. Three launches:
//  1. count: cnt[c][e] = pairs of chunk c (kGroupChunk pairs) routed to e;
//  2. scan (one block): expert offsets, the tile list, and cnt[c][e] turned
//     into the sorted position of chunk c's first pair of expert e;
//  3. place: per chunk, pairs in ascending p take consecutive positions.
// A call with one chunk (P <= kGroupChunk: decode, short chunks) runs the
// same three steps in one block (moe_group_one_kernel), saving two launches.
// share_rows > 0 (launch_moe's fold of m > 1 rows): the shared expert is group share_group at
// sorted positions [P, P + share_rows), row i at P + i, in tiles of bm after the routed ones.

__global__ void __launch_bounds__(kGroupThreads)
    moe_count_kernel(const int32_t* __restrict__ ids, int64_t P, int E, int32_t* __restrict__ cnt) {
  extern __shared__ int32_t scnt[];  // [E]
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kGroupThreads) scnt[e] = 0;
  __syncthreads();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kGroupChunk;
  const int n = static_cast<int>(P - base < kGroupChunk ? P - base : kGroupChunk);
  for (int q = tid; q < n; q += kGroupThreads) atomicAdd(&scnt[clamp_expert(ids[base + q], E)], 1);
  __syncthreads();
  int32_t* out = cnt + static_cast<int64_t>(blockIdx.x) * E;
  for (int e = tid; e < E; e += kGroupThreads) out[e] = scnt[e];
}

// Inclusive scan of v over the block (Hillis-Steele in shared memory).
BARO_DEV int64_t block_scan_incl(int64_t v, int64_t* sh) {
  const int tid = threadIdx.x;
  sh[tid] = v;
  __syncthreads();
  for (int o = 1; o < kScanThreads; o <<= 1) {
    const int64_t add = tid >= o ? sh[tid - o] : 0;
    __syncthreads();
    sh[tid] += add;
    __syncthreads();
  }
  const int64_t r = sh[tid];
  __syncthreads();
  return r;
}

// Body of the scan, for a block of kScanThreads; cnt may be global or shared.
// skip: an expert with no slot (slots[e] < 0) keeps its pairs' sorted positions but gets no
// tiles (baro_moe_pairs: another shard's expert; its rows are never computed nor read).
BARO_DEV void group_scan(int32_t* cnt, int n_chunks, int E, int bm, int32_t* __restrict__ tiles,
                         int32_t* __restrict__ n_tiles, int64_t max_tiles, int64_t* sh,
                         const int32_t* __restrict__ slots, int S, int skip, int64_t share_base,
                         int share_rows, int share_group) {
  const int tid = threadIdx.x;
  const int per = (E + kScanThreads - 1) / kScanThreads;  // contiguous experts per thread
  const int e_lo = imin(tid * per, E), e_hi = imin(e_lo + per, E);
  int64_t my_pairs = 0, my_tiles = 0;
  auto tiled = [&](int e) { return !(skip && slots != nullptr && slots[e] < 0); };
  for (int e = e_lo; e < e_hi; ++e) {
    int64_t tot = 0;
    for (int c = 0; c < n_chunks; ++c) tot += cnt[static_cast<int64_t>(c) * E + e];
    my_pairs += tot;
    if (tiled(e)) my_tiles += (tot + bm - 1) / bm;
  }
  // pack (pairs, tiles): both < 2^31, so one 64-bit scan carries the two
  const uint64_t packed = static_cast<uint64_t>(
      block_scan_incl(static_cast<int64_t>((static_cast<uint64_t>(my_pairs) << 32) |
                                           static_cast<uint64_t>(my_tiles)),
                      sh));
  int64_t off = static_cast<int64_t>(packed >> 32) - my_pairs;
  int64_t nt = static_cast<int64_t>(packed & 0xffffffffull) - my_tiles;
  for (int e = e_lo; e < e_hi; ++e) {
    int64_t run = off;
    for (int c = 0; c < n_chunks; ++c) {
      int32_t* q = cnt + static_cast<int64_t>(c) * E + e;
      const int32_t v = *q;
      *q = static_cast<int32_t>(run);
      run += v;
    }
    const int64_t tot = tiled(e) ? run - off : 0;
    for (int64_t st = 0; st < tot; st += bm, ++nt) {
      if (nt < max_tiles) {
        tiles[3 * nt + 0] = weight_group(e, slots, S);
        tiles[3 * nt + 1] = static_cast<int32_t>(off + st);
        tiles[3 * nt + 2] = static_cast<int32_t>(tot - st < bm ? tot - st : bm);
      }
    }
    off = run;
  }
  if (tid == kScanThreads - 1) {  // its nt is the routed tiles' total
    for (int st = 0; st < share_rows; st += bm, ++nt) {
      if (nt < max_tiles) {
        tiles[3 * nt + 0] = share_group;
        tiles[3 * nt + 1] = static_cast<int32_t>(share_base + st);
        tiles[3 * nt + 2] = share_rows - st < bm ? share_rows - st : bm;
      }
    }
    *n_tiles = static_cast<int32_t>(nt < max_tiles ? nt : max_tiles);
  }
}
// srow[share_base + i] = i: the shared expert's rows (group_scan's share_rows).
BARO_DEV void share_rows_place(int32_t* __restrict__ srow, int64_t share_base, int share_rows) {
  for (int i = threadIdx.x; i < share_rows; i += blockDim.x) srow[share_base + i] = i;
}

__global__ void __launch_bounds__(kScanThreads)
    moe_scan_kernel(int32_t* __restrict__ cnt, int n_chunks, int E, int bm,
                    int32_t* __restrict__ tiles, int32_t* __restrict__ n_tiles, int64_t max_tiles,
                    const int32_t* __restrict__ slots, int S, int skip, int32_t* __restrict__ srow,
                    int64_t share_base, int share_rows, int share_group) {
  __shared__ int64_t sh[kScanThreads];
  group_scan(cnt, n_chunks, E, bm, tiles, n_tiles, max_tiles, sh, slots, S, skip, share_base, share_rows,
             share_group);
  share_rows_place(srow, share_base, share_rows);
}

// One warp walks the chunk's pairs in ascending p, 32 at a time: a lane's rank
// among the lanes of its step with the same expert, plus the expert's running
// position pos[e], is its sorted position. sid: the chunk's n expert ids.
BARO_DEV void group_place(const int32_t* sid, int32_t* pos, int n, int64_t base, int k,
                          int32_t* __restrict__ srow, int32_t* __restrict__ inv) {
  const int lane = lane_id();
  for (int s0 = 0; s0 < n; s0 += BARO_WARP) {
    const int q = s0 + lane;
    const int len = imin(BARO_WARP, n - s0);
    const int e = q < n ? sid[q] : -1;
    int rank = 0, same = 0;
#if BARO_HIP
    for (int j = 0; j < len; ++j) {
      const int ej = sid[s0 + j];
      if (ej == e) {
        same += 1;
        if (j < lane) rank += 1;
      }
    }
#else
    // the same two counts from one match over the warp (lanes past n hold -1, no expert): the
    // loop above, 32 shared-memory reads a lane per step, was most of the grouping's 13 us at
    // 512 pairs (H200, 64 sequences)
    (void)len;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    same = __popc(peers);
    rank = __popc(peers & ((1u << lane) - 1u));
#endif
    int32_t at = 0;
    if (q < n) at = pos[e] + rank;
    warp_sync();  // every lane has read pos[e] before the first lane of e advances it
    if (q < n) {
      if (rank == 0) pos[e] += same;
      const int64_t pair = base + q;
      srow[at] = static_cast<int32_t>(pair / k);
      inv[pair] = at;
    }
    warp_sync();
  }
}

__global__ void __launch_bounds__(kGroupThreads)
    moe_place_kernel(const int32_t* __restrict__ ids, int64_t P, int k, int E,
                     const int32_t* __restrict__ cnt, int32_t* __restrict__ srow,
                     int32_t* __restrict__ inv) {
  extern __shared__ int32_t sm[];  // [E] running positions, then [kGroupChunk] ids
  int32_t* pos = sm;
  int32_t* sid = sm + E;
  const int tid = threadIdx.x;
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kGroupChunk;
  const int n = static_cast<int>(P - base < kGroupChunk ? P - base : kGroupChunk);
  const int32_t* c = cnt + static_cast<int64_t>(blockIdx.x) * E;
  for (int e = tid; e < E; e += kGroupThreads) pos[e] = c[e];
  for (int q = tid; q < n; q += kGroupThreads) sid[q] = clamp_expert(ids[base + q], E);
  __syncthreads();
  if (tid < BARO_WARP) group_place(sid, pos, n, base, k, srow, inv);
}

// P <= kGroupChunk (decode, short chunks): count, scan and place in one
// block, the same arithmetic as the three-launch path with one chunk.
BARO_DEV void group_one_block(const int32_t* __restrict__ ids, int P, int k, int E, int bm,
                              int32_t* __restrict__ srow, int32_t* __restrict__ inv, int32_t* __restrict__ tiles,
                              int32_t* __restrict__ n_tiles, int64_t max_tiles, const int32_t* __restrict__ slots,
                              int S, int skip, int share_rows, int share_group) {
  __shared__ int64_t sh[kScanThreads];
  __shared__ int32_t sid[kGroupChunk];
  extern __shared__ int32_t pos[];  // [E]: counts, then running positions
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kScanThreads) pos[e] = 0;
  for (int q = tid; q < P; q += kScanThreads) sid[q] = clamp_expert(ids[q], E);
  __syncthreads();
  for (int q = tid; q < P; q += kScanThreads) atomicAdd(&pos[sid[q]], 1);
  __syncthreads();
  group_scan(pos, 1, E, bm, tiles, n_tiles, max_tiles, sh, slots, S, skip, P, share_rows,
             share_group);  // pos[e] = expert offset
  share_rows_place(srow, P, share_rows);
  __syncthreads();
  if (tid < BARO_WARP) group_place(sid, pos, P, 0, k, srow, inv);
}
__global__ void __launch_bounds__(kScanThreads)
    moe_group_one_kernel(const int32_t* __restrict__ ids, int P, int k, int E, int bm,
                         int32_t* __restrict__ srow, int32_t* __restrict__ inv,
                         int32_t* __restrict__ tiles, int32_t* __restrict__ n_tiles,
                         int64_t max_tiles, const int32_t* __restrict__ slots, int S, int skip,
                         int share_rows, int share_group) {
  group_one_block(ids, P, k, E, bm, srow, inv, tiles, n_tiles, max_tiles, slots, S, skip, share_rows, share_group);
}

// BARO_MOE_ROUTE_GROUP=1 (opt-in until measured on a GPU): the top-k of every row and the
// grouping of its P = m k <= kGroupChunk pairs in one block, one launch a layer fewer (at 8
// sequences the top-k kernel was 3.4 us of a layer's 10.7 us of routing kernels, 177cd38).
// Warp w takes rows w, w + 32, ... with moe_topk_kernel's topk_row, then the block groups as
// moe_group_one_kernel does: the same functions on the same values, so the same ids, weights,
// sorted rows and tiles. The block's global stores of ids are visible to its threads after the
// barrier.
template <int kPer>
__global__ void __launch_bounds__(kScanThreads, 1)  // one block: the top-k rows get 64 registers, no spills
    moe_topk_group_one_kernel(float* __restrict__ probs, int64_t ld, int32_t* __restrict__ ids,
                              float* __restrict__ wts, int m, int E, int k, int bm, int32_t* __restrict__ srow,
                              int32_t* __restrict__ inv, int32_t* __restrict__ tiles, int32_t* __restrict__ n_tiles,
                              int64_t max_tiles, const int32_t* __restrict__ slots, int S, int skip, int share_rows,
                              int share_group) {
  for (int row = warp_id(); row < m; row += kScanThreads / BARO_WARP)
    topk_row<kPer>(probs + static_cast<int64_t>(row) * ld, ids + static_cast<int64_t>(row) * k,
                   wts + static_cast<int64_t>(row) * k, E, k);
  __syncthreads();
  group_one_block(ids, m * k, k, E, bm, srow, inv, tiles, n_tiles, max_tiles, slots, S, skip, share_rows,
                  share_group);
}

template <int kPer>
__global__ void __launch_bounds__(BARO_WARP)
    moe_route_one_kernel(float* __restrict__ probs, int32_t* __restrict__ ids, float* __restrict__ wts,
                         int E, int k, int bm, int32_t* __restrict__ srow, int32_t* __restrict__ inv,
                         int32_t* __restrict__ tiles, int32_t* __restrict__ n_tiles, int64_t max_tiles,
                         const int32_t* __restrict__ slots, int S, int skip, int fold_group,
                         uint32_t* __restrict__ counters = nullptr, int n_counters = 0, int host = 0) {
  grid_dependency_wait();  // launch_dependent after the router GEMM
  route_one_row<kPer>(probs, ids, wts, E, k, bm, srow, inv, tiles, n_tiles, max_tiles, slots, S, skip, fold_group,
                      host);
  for (int i = lane_id(); i < n_counters; i += BARO_WARP) counters[i] = 0u;  // the down GEMM's combine
}

// act[s][n] = bf16(silu(gu[s][n]) * gu[s][I + n])
__global__ void __launch_bounds__(kElemThreads)
    swiglu_kernel(const float* __restrict__ gu, uint16_t* __restrict__ act, int64_t rows,
                  int64_t I) {
  const int64_t total = rows * I;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kElemThreads) {
    const int64_t s = idx / I, n = idx % I;
    const float g = gu[s * 2 * I + n];
    const float u = gu[s * 2 * I + I + n];
    act[idx] = f32_to_bf16(siluf_(g) * u);
  }
}

// dst[pos] = h[srow[pos]] (bf16 rows of D, 16-byte copies; D % 8 == 0, h's rows on 16 bytes): the pairs'
// rows in sorted order, so that a grouped GEMM reads them in place (BARO_GEMM_WGMMA_GROUPED=sorted).
// A copy: the bits of every row unchanged.
__global__ void __launch_bounds__(kElemThreads)
    moe_sort_rows_kernel(const uint16_t* __restrict__ h, int64_t lda, const int32_t* __restrict__ srow,
                         uint16_t* __restrict__ dst, int64_t rows, int64_t D) {
  const int64_t per_row = D / 8;
  const int64_t total = rows * per_row;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kElemThreads) {
    const int64_t pos = idx / per_row, c = idx % per_row;
    const uint4 v = *reinterpret_cast<const uint4*>(h + static_cast<int64_t>(srow[pos]) * lda + 8 * c);
    *reinterpret_cast<uint4*>(dst + pos * D + 8 * c) = v;
  }
}

// out[i][d] = routed + sigmoid(sgl[i * sgl_ld]) * bf16(sout[i][d]),
// routed = fma over slots in order of w[i,s] * bf16(ys[inv[i*k+s]][d]), from 0 (inv == nullptr:
// ys holds the pairs in (row, slot) order, baro_moe_combine's y). YT: the pair rows as the down
// GEMM stored them, fp32 (rounded here) or already rounded to bf16 (half the bytes, the same
// values). V consecutive d per thread (16- / 8-byte loads when V = 4); the arithmetic of
// each element is the same for every V.
template <int V, class YT = float>
__global__ void __launch_bounds__(kElemThreads)
    moe_combine_kernel(const YT* __restrict__ ys, const int32_t* __restrict__ inv,
                       const float* __restrict__ wts, const float* __restrict__ sout,
                       const float* __restrict__ sgl, int64_t sgl_ld, float* __restrict__ out, int64_t m,
                       int64_t D, int k, const int32_t* __restrict__ ids,
                       const int32_t* __restrict__ slots, int S) {
  grid_dependency_wait();  // launch_dependent in the one-token fold
  const int64_t DV = D / V;
  const int64_t total = m * DV;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kElemThreads) {
    const int64_t i = idx / DV, d = (idx % DV) * V;
    float routed[V];
#pragma unroll
    for (int j = 0; j < V; ++j) routed[j] = 0.0f;
    // Slots in groups of kCombineAhead: a group's weights, rows and values are read first
    // (a decode row is a handful of threads: one memory latency per slot was the cost),
    // then the fmas run in slot order.
    for (int s0 = 0; s0 < k; s0 += kCombineAhead) {
      float wv[kCombineAhead];
      const YT* yp[kCombineAhead];
#pragma unroll
      for (int u = 0; u < kCombineAhead; ++u) {
        const int s = s0 + u;
        wv[u] = 0.0f;
        yp[u] = ys;
        if (s < k) {
          const int64_t pair = i * k + s;
          float w = wts[pair];
          if (slots != nullptr) {  // a routed expert with no slot: the row is NaN, loudly
            const int sl = slots[ids[pair]];  // ids are in [0, E) (moe_topk_kernel)
            if (sl < 0 || sl >= S) w = __int_as_float(0x7fc00000);
          }
          wv[u] = w;
          yp[u] = ys + static_cast<int64_t>(inv != nullptr ? inv[pair] : pair) * D + d;
        }
      }
      float yv[kCombineAhead][V];
#pragma unroll
      for (int u = 0; u < kCombineAhead; ++u) {
        if (s0 + u < k) {
          if constexpr (V == 4 && std::is_same<YT, float>::value) {
            const float4 t = *reinterpret_cast<const float4*>(yp[u]);
            yv[u][0] = round_bf16(t.x);
            yv[u][1] = round_bf16(t.y);
            yv[u][2] = round_bf16(t.z);
            yv[u][3] = round_bf16(t.w);
          } else if constexpr (V == 8) {  // bf16 rows only (combine() launches no fp32 V = 8)
            static_assert(std::is_same<YT, uint16_t>::value, "V = 8 reads bf16 pair rows");
            const uint4 t = *reinterpret_cast<const uint4*>(yp[u]);
            const uint32_t w4[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              yv[u][2 * q] = __uint_as_float(w4[q] << 16);
              yv[u][2 * q + 1] = __uint_as_float(w4[q] & 0xffff0000u);
            }
          } else if constexpr (V == 4) {
            const uint2 t = *reinterpret_cast<const uint2*>(yp[u]);
            yv[u][0] = __uint_as_float(t.x << 16);
            yv[u][1] = __uint_as_float(t.x & 0xffff0000u);
            yv[u][2] = __uint_as_float(t.y << 16);
            yv[u][3] = __uint_as_float(t.y & 0xffff0000u);
          } else if constexpr (std::is_same<YT, float>::value) {
#pragma unroll
            for (int j = 0; j < V; ++j) yv[u][j] = round_bf16(yp[u][j]);
          } else {
#pragma unroll
            for (int j = 0; j < V; ++j) yv[u][j] = bf16_to_f32(yp[u][j]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kCombineAhead; ++u) {
        if (s0 + u < k) {
#pragma unroll
          for (int j = 0; j < V; ++j) routed[j] = fmaf(wv[u], yv[u][j], routed[j]);
        }
      }
    }
    const float sg = sigmoidf_(sgl[i * sgl_ld]);
    const float* so = sout + i * D + d;
    float* o = out + i * D + d;
    if constexpr (V == 8) {  // the shared row and the output as two 16-byte accesses each
      float sv[8];
      *reinterpret_cast<float4*>(sv) = reinterpret_cast<const float4*>(so)[0];
      *reinterpret_cast<float4*>(sv + 4) = reinterpret_cast<const float4*>(so)[1];
      float ov[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) ov[j] = routed[j] + sg * round_bf16(sv[j]);
      reinterpret_cast<float4*>(o)[0] = *reinterpret_cast<const float4*>(ov);
      reinterpret_cast<float4*>(o)[1] = *reinterpret_cast<const float4*>(ov + 4);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) o[j] = routed[j] + sg * round_bf16(so[j]);
    }
  }
}

// ---- scratch layout ----
struct MoeScratch {
  float* logits;     // [m, E]
  int32_t* ids;      // [P]
  float* wts;        // [P]
  int32_t* srow;     // [P]
  int32_t* inv;      // [P]
  int32_t* tiles;    // [max_tiles, 3]
  int32_t* n_tiles;  // [1]
  int32_t* cnt;      // [n_chunks, E] grouping counts / positions
  float* gu;         // [P, 2I] (only when the SwiGLU is not fused)
  uint16_t* act;     // [P, I]
  float* ys;         // [P, D]
  float* sgu;        // [m, 2Is]
  uint16_t* sact;    // [m, Is]
  float* sout;       // [m, D]
  float* sgl;        // [m]
  uint32_t* tail_cnt;  // [moe_tail_counters] (plan.tail): the down GEMM's column-unit counts
  uint16_t* stage_gu;  // [top_k, 2I, D] (plan.stage): pair j's expert from the host store
  uint16_t* stage_dn;  // [top_k, D, I]
};

// One counter per 8 output columns of the down GEMM (its smallest column unit).
static int64_t moe_tail_counters(const MoeArgs& a) { return baro::scratch::moe_tail_counters(a.D); }

// The slot table the combine checks to make an unslotted expert's rows NaN: none when the
// host store supplies those experts (baro_moe_host).
static const int32_t* nan_row_slots(const MoeArgs& a) { return a.host_gu != nullptr ? nullptr : a.slots; }

// What both of gemm_row1's MoE kinds read: the routing (ids, weights, sorted rows, the slot
// table) and the combine's counters.
static Row1Moe moe_row1_tail(const MoeArgs& a, const MoeScratch& s, int kind) {
  Row1Moe mo;
  mo.kind = kind;
  mo.k = a.top_k;
  mo.S = static_cast<int>(a.S);
  mo.slots = a.slots;
  mo.ids = s.ids;
  mo.wts = s.wts;
  mo.inv = s.inv;
  mo.counters = s.tail_cnt;
  mo.n_counters = static_cast<int>(moe_tail_counters(a));
  return mo;
}

// Sizes the tile list for the smallest BM, so it holds any config's tiles (one-row
// tiles only when m == 1: gemm_pick_grouped picks kRow1 for one token only).
// The tile list for tiles of bm rows; the scratch holds the smallest BM's (scratch_layout.h).
// folded: the layout's fold flag (moe_layout), room for the shared expert's ceil(m / bm) tiles.
static int64_t moe_max_tiles(const MoeArgs& a, int bm, bool folded) {
  return baro::scratch::moe_tiles_for(a.m, a.E, a.top_k, bm, folded);
}

static int64_t moe_chunks(const MoeArgs& a) { return baro::scratch::moe_chunks(a.m, a.top_k); }

// The grouped GEMM config, and whether gate/up runs with the fused SwiGLU
// epilogue (then the fp32 gu buffer is not needed). Depends only on the
// shapes and the operand pointers, so scratch sizing and launch agree.
// fold (one token, I == Is, every GEMM on gemm_row1): the router and the shared gate in one
// GEMM (N = E + 1), the shared expert as one more row of the grouped gate/up and down GEMMs,
// top-k and grouping in one warp: 5 launches instead of 9, same bits (every output is the
// same dot in the same order; only which launch computes it changes). BARO_MOE_FOLD=0: off.
// tail (fold, CUDA): the route runs inside the gate/up GEMM (every warp routes for itself)
// and the combine inside the down GEMM (the warp finishing a column unit's last slot):
// 3 launches, same bits (route_one_row and the combine's expressions are moe_route_one_kernel's
// and moe_combine_kernel's; the kernel tests compare). BARO_MOE_TAIL=0: the 5 launches;
// BARO_MOE_TAIL=combine: 4, the route kernel (which zeroes the counters) and the combine inside
// the down GEMM (on the H200 the per-warp route cost the gate/up GEMM ~6 us, the route kernel
// 4.6 us plus a gap: docs/PERF.md).
// share: the shared expert as ceil(m / bm) more tiles of the grouped gate/up and down GEMMs
// (rows P + i), instead of a gate/up and a down GEMM of its own; gate_tail: the shared gate's
// logit as the router GEMM's column E. The fold has both; so do calls of m > 1 rows whose
// GEMMs run on 16-row slots (a decode step of many sequences), where they save launches whose
// cost was their K walk, not their bytes (H200, 64 sequences: 12.6 + 5.0 + 8.0 us a layer).
// Same bits: the same dots in the same order, computed by other launches. BARO_MOE_FOLD=0
// turns all of it off.
struct MoePlan {
  GemmConfig cfg;
  bool fused;
  bool fold;
  bool share;
  bool gate_tail;
  bool folded() const { return share || gate_tail; }  // the layout's fold pieces
  bool tail;        // the combine inside the down GEMM
  bool tail_route;  // and the route inside the gate/up GEMM
  // baro_moe_host: the routed experts with no slot are copied from the host store into the
  // call's scratch (one slot per pair) by moe_stage_misses_kernel before the gate/up GEMM,
  // which then reads them as device memory. BARO_MOE_HOST=direct: the GEMMs read the store.
  bool stage;
};
constexpr int32_t kSharedGroup = -2;  // the tile group of the folded shared expert (GemmParams::last_group)

static GemmParams moe_gate_up_params(const MoeArgs& a) {
  GemmParams p;
  p.A = a.h;
  p.lda = a.D;
  p.W = a.w_gate_up;
  p.ldw = a.D;
  p.w_group_stride = 2 * a.I * a.D;
  p.N = 2 * a.I;
  p.K = a.D;
  return p;
}

// The grouped down GEMM over act [rows, I] (rows in sorted-pair order).
static GemmParams moe_down_params(const MoeArgs& a, const uint16_t* act) {
  GemmParams p;
  p.A = act;
  p.lda = a.I;
  p.W = a.w_down;
  p.ldw = a.I;
  p.w_group_stride = a.D * a.I;
  p.N = a.D;
  p.K = a.I;
  return p;
}

static bool aligned16(const void* p) { return is_aligned(p, 16); }

// The router GEMM with the shared gate's row after the router's E (N = E + 1, row stride
// E + 1 in the logits): the fold and gate_tail (C and the launch are the caller's).
static GemmParams moe_router_params(const MoeArgs& a) {
  GemmParams p;
  p.A = a.h;
  p.lda = a.D;
  p.W = a.router;
  p.ldw = a.D;
  p.W_tail = a.s_gate;
  p.n_split = a.E;
  p.M = a.m;
  p.N = a.E + 1;
  p.K = a.D;
  p.ldc = a.E + 1;
  return p;
}

static MoePlan moe_plan(const MoeArgs& a) {
  MoePlan pl;
  pl.cfg = gemm_pick_grouped(a.m * a.top_k, a.E, a.m);
  const GemmParams gu = moe_gate_up_params(a);
  pl.fused = gemm_fused_swiglu_ok(pl.cfg) && gemm_vec_ok(gu);
  const GemmParams down = moe_down_params(a, a.h);  // (its real A, the act scratch, is 256-byte aligned)
  pl.fold = a.m == 1 && pl.cfg == GemmConfig::kRow1 && pl.fused && a.I == a.Is && !a.skip_unslotted &&
            a.top_k <= BARO_WARP && a.E <= BARO_WARP * kTopkRegPer && baro::knobs::on(baro::knobs::kMoeFold) &&
            gemm_row1_runs(gu) && gemm_row1_runs(down) && aligned16(a.router) && aligned16(a.s_gate) &&
            aligned16(a.s_gate_up) && aligned16(a.s_down);
  pl.tail = pl.fold && !baro::knobs::is(baro::knobs::kMoeTail, "0") && moe_max_tiles(a, 1, true) <= row1_moe_route_max_tiles();
  pl.stage = pl.fold && a.host_gu != nullptr && !baro::knobs::is(baro::knobs::kMoeHost, "direct");
  pl.tail_route = pl.tail && !baro::knobs::is(baro::knobs::kMoeTail, "combine") && !pl.stage;  // the copies need the ids first
  const bool fold_knob = baro::knobs::on(baro::knobs::kMoeFold);
  GemmParams sgu = gu, sdn = down;
  sgu.W_last = a.s_gate_up;
  sgu.last_group = kSharedGroup;
  sdn.W_last = a.s_down;
  sdn.last_group = kSharedGroup;
  pl.share = pl.fold || (a.m > 1 && fold_knob && pl.fused && a.Is > 0 && a.I == a.Is && a.host_gu == nullptr &&
                         !a.skip_unslotted && aligned16(a.s_gate_up) && aligned16(a.s_down) &&
                         gemm_split_w_runs(sgu, pl.cfg) && gemm_split_w_runs(sdn, pl.cfg));
  GemmParams rt = moe_router_params(a);
  pl.gate_tail = pl.fold || (a.m > 1 && fold_knob && a.s_gate != nullptr && a.Is > 0 && aligned16(a.s_gate) &&
                             gemm_split_w_runs(rt, gemm_pick(a.m, a.E + 1)));
  return pl;
}

// Computes the layout (csrc/common/scratch_layout.h, whose sizes the CPU library exports to
// custom_calls and the budget); fills *s when base != nullptr. Returns total bytes.
static size_t moe_layout(const MoeArgs& a, char* base, MoeScratch* s) {
  const MoePlan pl = moe_plan(a);
  baro::scratch::MoePlanFlags f;
  f.fold = pl.folded();
  f.fused = pl.fused;
  f.tail = pl.tail;
  f.stage = pl.stage;
  const baro::scratch::MoeOffsets o = baro::scratch::moe_layout(a.m, a.E, a.top_k, a.I, a.Is, a.D, f);
  auto at = [&](int64_t off) -> char* { return base != nullptr && off >= 0 ? base + off : nullptr; };
  MoeScratch t;
  t.logits = reinterpret_cast<float*>(at(o.logits));
  t.ids = reinterpret_cast<int32_t*>(at(o.ids));
  t.wts = reinterpret_cast<float*>(at(o.wts));
  t.srow = reinterpret_cast<int32_t*>(at(o.srow));
  t.inv = reinterpret_cast<int32_t*>(at(o.inv));
  t.tiles = reinterpret_cast<int32_t*>(at(o.tiles));
  t.n_tiles = reinterpret_cast<int32_t*>(at(o.n_tiles));
  t.cnt = reinterpret_cast<int32_t*>(at(o.cnt));
  t.gu = reinterpret_cast<float*>(at(o.gu));
  t.act = reinterpret_cast<uint16_t*>(at(o.act));
  t.ys = reinterpret_cast<float*>(at(o.ys));
  t.sgu = reinterpret_cast<float*>(at(o.sgu));
  t.sact = reinterpret_cast<uint16_t*>(at(o.sact));
  t.sout = reinterpret_cast<float*>(at(o.sout));
  t.sgl = reinterpret_cast<float*>(at(o.sgl));
  t.tail_cnt = reinterpret_cast<uint32_t*>(at(o.tail_cnt));
  t.stage_gu = reinterpret_cast<uint16_t*>(at(o.stage_gu));
  t.stage_dn = reinterpret_cast<uint16_t*>(at(o.stage_dn));
  if (s) *s = t;
  return static_cast<size_t>(o.total);
}

bool moe_runs_fold(const MoeArgs& a) { return a.m >= 1 && moe_plan(a).fold; }

size_t moe_scratch_bytes(const MoeArgs& a) {
  if (a.m <= 0) return 0;
  return moe_layout(a, nullptr, nullptr);
}

// The gate/up GEMM's A rows copied into sorted order first (BARO_GEMM_WGMMA_GROUPED=sorted): prefill
// calls on the pipelined configs, every pair placed (no slot pool), no shared expert folded in.
static bool moe_sorted_a(const MoeArgs& a, const MoePlan& pl) {
  return wgmma_grouped_sorted(a.m * a.top_k) &&
         (pl.cfg == GemmConfig::kPipe64 || pl.cfg == GemmConfig::kPipe128) && !pl.share && !pl.fold &&
         a.slots == nullptr && !a.skip_unslotted && a.D % 8 == 0;
}

static unsigned elem_blocks(int64_t total) {
  int64_t b = (total + kElemThreads - 1) / kElemThreads;
  if (b > 65535 * 16) b = 65535 * 16;  // grid-stride loops cover the rest
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

#define BARO_MOE_TRY(expr)           \
  do {                               \
    gpuError_t _e = (expr);          \
    if (_e != gpuSuccess) return _e; \
  } while (0)

// act[rows, I] = bf16(silu(x . W[:I]^T) * (x . W[I:]^T)) for the shared
// expert: fused when the pipelined config runs, else the GEMM into gu and a
// separate pass (the same two fp32 values meet in the same expression).
static gpuError_t shared_swiglu(const MoeArgs& a, const MoeScratch& s, gpuStream_t stream) {
  const int64_t m = a.m, D = a.D, Is = a.Is;
  GemmParams p;
  p.A = a.h;
  p.lda = D;
  p.W = a.s_gate_up;
  p.ldw = D;
  p.M = m;
  p.N = 2 * Is;
  p.K = D;
  const GemmConfig cfg = gemm_pick(m, 2 * Is);
  const int64_t slots = (m + gemm_bm(cfg) - 1) / gemm_bm(cfg);
  if (gemm_fused_swiglu_ok(cfg) && gemm_vec_ok(p)) {
    p.Act = s.sact;
    p.swiglu_I = Is;
    p.ldc = Is;
    return launch_gemm(p, cfg, slots, stream);
  }
  p.C = s.sgu;
  p.ldc = 2 * Is;
  BARO_MOE_TRY(launch_gemm(p, cfg, slots, stream));
  swiglu_kernel<<<elem_blocks(m * Is), kElemThreads, 0, stream>>>(s.sgu, s.sact, m, Is);
  return gpuGetLastError();
}

static gpuError_t stage_misses(const MoeArgs& a, const MoeScratch& s, gpuStream_t stream) {
  const int64_t gu_vecs = 2 * a.I * a.D / 8, dn_vecs = a.D * a.I / 8;  // D, I multiples of 16 (the fold)
  const int64_t want = (gu_vecs + dn_vecs + kStageThreads * kStageVec - 1) / (kStageThreads * kStageVec);
  // an expert of the model's shape is 192 blocks' worth (6 MB in flight: far past what the link
  // needs to stay full); bigger ones loop
  const unsigned grid = static_cast<unsigned>(want < kStageMaxBlocks ? want : kStageMaxBlocks);
  moe_stage_misses_kernel<<<grid, kStageThreads, 0, stream>>>(
      s.ids, a.slots, static_cast<int>(a.S), a.top_k, reinterpret_cast<const uint4*>(a.host_gu),
      reinterpret_cast<const uint4*>(a.host_dn), gu_vecs, dn_vecs, reinterpret_cast<uint4*>(s.stage_gu),
      reinterpret_cast<uint4*>(s.stage_dn));
  return gpuGetLastError();
}

// Steps 1-5 of launch_moe: routing, grouping, grouped gate/up + SwiGLU and down, so that
// s.ys[s.inv[pair]] is each (row, slot) pair's expert output (pairs of experts without tiles,
// a.skip_unslotted, are left unwritten). ys16 (the combine's caller): the down GEMM may store the
// pair rows rounded to bf16 (the wgmma kernel does, at prefill sizes); *ys16 then says it did.
static gpuError_t routed_experts(const MoeArgs& a, const MoeScratch& s, const MoePlan& pl,
                                 gpuStream_t stream, bool* ys16 = nullptr) {
  const int64_t m = a.m, P = a.m * a.top_k, D = a.D, E = a.E, I = a.I;
  const int bm = gemm_bm(pl.cfg);
  const int64_t max_tiles = moe_max_tiles(a, bm, pl.folded());
  const int64_t n_chunks = moe_chunks(a);
  if (n_chunks > 0x7fffffffLL) return gpuErrorInvalidValue;
  const size_t cnt_smem = sizeof(int32_t) * static_cast<size_t>(E);
  if (pl.fold) {
    // 1. router logits [E] and the shared gate's logit after them, one GEMM
    GemmParams p = moe_router_params(a);
    p.C = s.logits;
    BARO_MOE_TRY(launch_gemm(p, GemmConfig::kRow1, 1, stream));
    // 2-3. top-k and grouping, the shared expert's tile last (tail: in the gate/up GEMM)
    if (!pl.tail_route) {
      const auto route = E <= BARO_WARP * kTopkRegPerSmall ? moe_route_one_kernel<kTopkRegPerSmall>
                                                           : moe_route_one_kernel<kTopkRegPer>;
      BARO_MOE_TRY(launch_dependent(route, dim3(1), dim3(BARO_WARP), 0, stream, s.logits, s.ids, s.wts,
                                    static_cast<int>(E), a.top_k, bm, s.srow, s.inv, s.tiles, s.n_tiles, max_tiles,
                                    a.slots, static_cast<int>(a.S), 0, kSharedGroup, s.tail_cnt,
                                    pl.tail ? static_cast<int>(moe_tail_counters(a)) : 0,
                                    pl.stage ? kHostByPair : a.host_gu ? kHostByExpert : 0));
      if (pl.stage) BARO_MOE_TRY(stage_misses(a, s, stream));
    }
  } else {
  // BARO_MOE_ROUTE_GROUP: top-k and grouping in one block where the pairs are one chunk;
  // require refuses the call before any of its work is queued where they are not
  namespace kn = baro::knobs;
  const bool fused_route = !kn::is(kn::kMoeRouteGroup, "0") && n_chunks == 1;
  if (kn::is(kn::kMoeRouteGroup, "require") && !fused_route) return gpuErrorInvalidValue;
  // 1. router logits [m, E] (gate_tail: [m, E + 1], the shared gate's logit last)
  if (pl.gate_tail) {
    GemmParams p = moe_router_params(a);
    p.C = s.logits;
    const GemmConfig rcfg = gemm_pick(m, E + 1);
    BARO_MOE_TRY(launch_gemm(p, rcfg, (m + gemm_bm(rcfg) - 1) / gemm_bm(rcfg), stream));
  } else {
    BARO_MOE_TRY(launch_matmul(a.h, a.router, s.logits, m, E, D, stream));
  }
  // 2. softmax + top-k per row; 3. group pairs by expert (tiles of bm pairs), share: the shared
  // expert's tiles last (BARO_MOE_ROUTE_GROUP: both in one block where the pairs are one chunk)
  const int share_rows = pl.share ? static_cast<int>(m) : 0;
  const int64_t ld = pl.gate_tail ? E + 1 : E;
  if (fused_route) {
    const auto route = E <= BARO_WARP * kTopkRegPerSmall ? moe_topk_group_one_kernel<kTopkRegPerSmall>
                       : E <= BARO_WARP * kTopkRegPer    ? moe_topk_group_one_kernel<kTopkRegPer>
                                                         : moe_topk_group_one_kernel<0>;
    route<<<1, kScanThreads, cnt_smem, stream>>>(s.logits, ld, s.ids, s.wts, static_cast<int>(m), static_cast<int>(E),
                                                 a.top_k, bm, s.srow, s.inv, s.tiles, s.n_tiles, max_tiles, a.slots,
                                                 static_cast<int>(a.S), a.skip_unslotted ? 1 : 0, share_rows,
                                                 kSharedGroup);
  } else {
  BARO_MOE_TRY(launch_topk(s.logits, ld, s.ids, s.wts, m, static_cast<int>(E), a.top_k, stream));
  if (n_chunks == 1) {
    moe_group_one_kernel<<<1, kScanThreads, cnt_smem, stream>>>(
        s.ids, static_cast<int>(P), a.top_k, static_cast<int>(E), bm, s.srow, s.inv, s.tiles,
        s.n_tiles, max_tiles, a.slots, static_cast<int>(a.S), a.skip_unslotted ? 1 : 0, share_rows, kSharedGroup);
  } else {
    moe_count_kernel<<<static_cast<unsigned>(n_chunks), kGroupThreads, cnt_smem, stream>>>(
        s.ids, P, static_cast<int>(E), s.cnt);
    BARO_MOE_TRY(gpuGetLastError());
    moe_scan_kernel<<<1, kScanThreads, 0, stream>>>(s.cnt, static_cast<int>(n_chunks),
                                                    static_cast<int>(E), bm, s.tiles, s.n_tiles,
                                                    max_tiles, a.slots, static_cast<int>(a.S),
                                                    a.skip_unslotted ? 1 : 0, s.srow, P, share_rows,
                                                    kSharedGroup);
    BARO_MOE_TRY(gpuGetLastError());
    moe_place_kernel<<<static_cast<unsigned>(n_chunks), kGroupThreads,
                       cnt_smem + sizeof(int32_t) * kGroupChunk, stream>>>(
        s.ids, P, a.top_k, static_cast<int>(E), s.cnt, s.srow, s.inv);
  }
  }
  BARO_MOE_TRY(gpuGetLastError());
  }
  // 4. grouped gate/up: act[pos] = swiglu(h[srow[pos]] . w_gate_up[e]^T)   [P, I]
  {
    GemmParams p = moe_gate_up_params(a);
    p.a_rows = s.srow;
    // BARO_GEMM_WGMMA_GROUPED=sorted (prefill): the pairs' rows of h copied into sorted order first,
    // into ys (fp32 [P, D], free until the down GEMM writes it: [P, D] bf16 takes half), so that the
    // gate/up GEMM reads its A in place, by TMA on the wgmma kernel, as the down GEMM does (the
    // wgmma kernel gathers no rows). A copy, so the same operand bits and the same chains.
    if (moe_sorted_a(a, pl) && gemm_vec_ok(p)) {
      uint16_t* sorted = reinterpret_cast<uint16_t*>(s.ys);
      moe_sort_rows_kernel<<<elem_blocks(P * (D / 8)), kElemThreads, 0, stream>>>(a.h, p.lda, s.srow, sorted, P, D);
      BARO_MOE_TRY(gpuGetLastError());
      p.A = sorted;
      p.lda = D;
      p.a_rows = nullptr;
      p.a_total_rows = P;
    }
    p.tiles = s.tiles;
    p.n_tiles = s.n_tiles;
    p.w_groups = a.slots != nullptr ? a.S : E;  // for the wgmma GEMM's map of W (BARO_GEMM_WGMMA_GROUPED=sorted)
    if (pl.share) {  // the shared expert's gate/up rows for the last tiles
      p.W_last = a.s_gate_up;
      p.last_group = kSharedGroup;
    }
    if (pl.fold) {
      p.W_host = pl.stage ? s.stage_gu : a.host_gu;
      p.w_host_mapped = pl.stage ? 0 : 1;
      p.pdl = 1;  // after the router GEMM (and the route kernel, and the staging copies)
    }
    if (pl.tail_route) {  // 2-3 in every warp of this GEMM (block 0 stores them for step 5)
      Row1Moe& mo = p.moe;
      mo = moe_row1_tail(a, s, Row1Moe::kRoute);
      mo.logits = s.logits;
      mo.E = static_cast<int>(E);
      mo.fold_group = kSharedGroup;
      mo.host = a.host_gu ? kHostByExpert : 0;  // (stage: the route kernel, not here)
      mo.srow = s.srow;
      mo.tiles = s.tiles;
      mo.n_tiles = s.n_tiles;
      mo.max_tiles = max_tiles;
    }
    if (pl.fused) {
      p.Act = s.act;
      p.swiglu_I = I;
      p.ldc = I;
      BARO_MOE_TRY(launch_gemm(p, pl.cfg, max_tiles, stream));
    } else {
      p.C = s.gu;
      p.ldc = 2 * I;
      BARO_MOE_TRY(launch_gemm(p, pl.cfg, max_tiles, stream));
      swiglu_kernel<<<elem_blocks(P * I), kElemThreads, 0, stream>>>(s.gu, s.act, P, I);
      BARO_MOE_TRY(gpuGetLastError());
    }
  }
  // 5. grouped down: ys[pos] = act[pos] . w_down[e]^T   [P, D]
  {
    GemmParams p = moe_down_params(a, s.act);
    p.C = s.ys;
    p.ldc = D;
    p.tiles = s.tiles;
    p.n_tiles = s.n_tiles;
    p.w_groups = a.slots != nullptr ? a.S : E;  // the pool's slots or the experts
    p.a_total_rows = P + (pl.share ? m : 0);    // act: the pairs, then the shared expert's rows
    if (pl.share) {
      p.W_last = a.s_down;
      p.last_group = kSharedGroup;
    }
    if (pl.fold) {
      p.W_host = pl.stage ? s.stage_dn : a.host_dn;
      p.w_host_mapped = pl.stage ? 0 : 1;
      p.pdl = 1;
    }
    if (pl.tail) {  // 7 as the last slot of each column unit lands
      Row1Moe& mo = p.moe;
      mo = moe_row1_tail(a, s, Row1Moe::kCombine);
      mo.slots = nan_row_slots(a);
      mo.sout = s.ys + a.top_k * D;  // the shared expert is grouped row k
      mo.sgl = s.logits + E;         // its gate logit after the router's
      mo.out = a.out;
    }
    // bf16 pair rows for the combine kernel only (the tail's combine and moe_pairs read fp32)
    if (ys16 != nullptr && !pl.tail && !pl.share && D % 2 == 0 && baro::knobs::on(baro::knobs::kMoePairs16)) {
      p.C16 = reinterpret_cast<uint16_t*>(s.ys);
      p.ldc16 = p.ldc;
      p.c16_cols = D;
    }
    BARO_MOE_TRY(launch_gemm(p, pl.cfg, max_tiles, stream, p.C16 != nullptr ? ys16 : nullptr));
  }
  return gpuSuccess;
}

// Step 7: out = routed + sigmoid(sgl) * sout, routed the slot-order fma over the pairs of ys
// (through inv, or in (row, slot) order when inv == nullptr); row i's gate logit at sgl[i * sgl_ld].
// ys16: ys holds the pair rows as bf16 (routed_experts' down GEMM stored them so).
static gpuError_t combine(const MoeArgs& a, const float* ys, const int32_t* inv, const float* wts,
                          const float* sout, const float* sgl, int64_t sgl_ld, const int32_t* ids,
                          gpuStream_t stream, bool ys16 = false) {
  const int64_t m = a.m, D = a.D;
  const bool v4 = D % 4 == 0 && aligned16(a.out) && aligned16(ys);
  const int32_t* slots = nan_row_slots(a);
  // always after the kernels that made ys in this handler; V columns a thread
  auto go = [&](auto kernel, int V, const auto* y) {
    return launch_dependent(kernel, dim3(elem_blocks(m * D / V)), dim3(kElemThreads), 0, stream, y, inv, wts, sout,
                            sgl, sgl_ld, a.out, m, D, a.top_k, ids, slots, static_cast<int>(a.S));
  };
  if (ys16) {
    const uint16_t* y16 = reinterpret_cast<const uint16_t*>(ys);
    // BARO_MOE_COMBINE_WIDE (on): 8 columns a thread, every access 16 bytes (the pair rows' eight
    // bf16, the shared row's and the output's two float4 each): the MoE op -2.4% / -2.8% at 4,096 /
    // 8,192 rows on an H100 (docs/PERF.md 2026-12-07)
    if (v4 && D % 8 == 0 && aligned16(sout) && baro::knobs::on(baro::knobs::kMoeCombineWide))
      return go(moe_combine_kernel<8, uint16_t>, 8, y16);
    return v4 ? go(moe_combine_kernel<4, uint16_t>, 4, y16) : go(moe_combine_kernel<1, uint16_t>, 1, y16);
  }
  return v4 ? go(moe_combine_kernel<4>, 4, ys) : go(moe_combine_kernel<1>, 1, ys);
}

// Step 6: the shared expert's output sout [m, D] (unless folded) and its gate logit sgl [m]
// (unless gate_tail put it after the router's).
static gpuError_t shared_expert(const MoeArgs& a, const MoeScratch& s, const MoePlan& pl, gpuStream_t stream) {
  if (!pl.share) {
    BARO_MOE_TRY(shared_swiglu(a, s, stream));
    BARO_MOE_TRY(launch_matmul(s.sact, a.s_down, s.sout, a.m, a.D, a.Is, stream));
  }
  if (pl.gate_tail) return gpuSuccess;
  return launch_matmul(a.h, a.s_gate, s.sgl, a.m, 1, a.D, stream);
}

gpuError_t launch_moe(const MoeArgs& a, void* scratch, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (a.m <= 0) return gpuSuccess;
  if (a.top_k < 1 || a.top_k > a.E || a.E > kSortMaxE || scratch == nullptr)
    return gpuErrorInvalidValue;
  MoeScratch s;
  moe_layout(a, static_cast<char*>(scratch), &s);
  const MoePlan pl = moe_plan(a);
  if ((a.host_gu != nullptr || a.host_dn != nullptr) && (!pl.fold || !a.host_gu || !a.host_dn))
    return gpuErrorInvalidValue;  // the handler says why first (moe_runs_fold)
  bool ys16 = false;
  BARO_MOE_TRY(routed_experts(a, s, pl, stream, &ys16));  // 1-5 (fold: and 6; tail: and 7)
  if (pl.tail) return gpuSuccess;
  BARO_MOE_TRY(shared_expert(a, s, pl, stream));  // 6, what is not folded
  // share: row i of the shared expert is grouped row P + i (fp32: no bf16 pair rows with share);
  // gate_tail: its logit is column E
  const float* sout = pl.share ? s.ys + a.m * a.top_k * a.D : s.sout;
  const float* sgl = pl.gate_tail ? s.logits + a.E : s.sgl;
  return combine(a, s.ys, s.inv, s.wts, sout, sgl, pl.gate_tail ? a.E + 1 : 1, s.ids, stream, ys16);  // 7
}

// ---- expert parallel: baro_moe_pairs and baro_moe_combine ----

// slots[e] = e - base for this shard's experts [base, base + El), -1 for the others (every
// expert when base is outside [0, E - El]: the GPU cannot refuse a device value, so such a
// shard computes nothing and moe_pairs_out_kernel gives NaN).
__device__ inline bool moe_base_ok(int64_t b, int E, int El) { return b >= 0 && b <= E - El; }
__global__ void __launch_bounds__(kElemThreads)
    moe_local_slots_kernel(const int32_t* __restrict__ base, int E, int El, int32_t* __restrict__ slots) {
  const int64_t b = *base;
  const bool ok = moe_base_ok(b, E, El);
  for (int e = blockIdx.x * kElemThreads + threadIdx.x; e < E; e += gridDim.x * kElemThreads) {
    const int64_t l = e - b;
    slots[e] = ok && l >= 0 && l < El ? static_cast<int32_t>(l) : -1;
  }
}

// y[pair] = ys[inv[pair]] for a pair of this shard's experts, else 0 (NaN for every pair when
// expert_base is out of range); w, ids copied out.
__global__ void __launch_bounds__(kElemThreads)
    moe_pairs_out_kernel(const float* __restrict__ ys, const int32_t* __restrict__ inv,
                         const float* __restrict__ wts, const int32_t* __restrict__ ids,
                         const int32_t* __restrict__ slots, float* __restrict__ y, float* __restrict__ w,
                         int32_t* __restrict__ ids_out, int64_t P, int64_t D, const int32_t* __restrict__ base,
                         int E, int El) {
  const int64_t total = P * D;
  const bool ok = moe_base_ok(*base, E, El);
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kElemThreads) {
    const int64_t pair = idx / D, d = idx - pair * D;
    const bool local = slots[ids[pair]] >= 0;  // ids are in [0, E) (moe_topk_kernel)
    y[idx] = !ok ? __int_as_float(0x7fc00000) : local ? ys[static_cast<int64_t>(inv[pair]) * D + d] : 0.0f;
    if (d == 0) {
      w[pair] = wts[pair];
      ids_out[pair] = ids[pair];
    }
  }
}

size_t moe_pairs_scratch_bytes(const MoeArgs& a) {
  if (a.m <= 0) return 0;
  return moe_layout(a, nullptr, nullptr) + static_cast<size_t>(baro::scratch::up256(4 * a.E));
}

gpuError_t launch_moe_pairs(const MoeArgs& a, int64_t El, const int32_t* expert_base, float* y, float* w,
                            int32_t* ids, void* scratch, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (a.m <= 0) return gpuSuccess;
  if (a.top_k < 1 || a.top_k > a.E || a.E > kSortMaxE || El < 1 || El > a.E || scratch == nullptr)
    return gpuErrorInvalidValue;
  MoeScratch s;
  const size_t main_bytes = moe_layout(a, static_cast<char*>(scratch), &s);
  int32_t* slots = reinterpret_cast<int32_t*>(static_cast<char*>(scratch) + main_bytes);
  moe_local_slots_kernel<<<elem_blocks(a.E), kElemThreads, 0, stream>>>(
      expert_base, static_cast<int>(a.E), static_cast<int>(El), slots);
  BARO_MOE_TRY(gpuGetLastError());
  MoeArgs b = a;  // the shard's experts are the pool, addressed through the slot table
  b.slots = slots;
  b.S = El;
  b.skip_unslotted = true;
  BARO_MOE_TRY(routed_experts(b, s, moe_plan(b), stream));
  const int64_t P = a.m * a.top_k;
  moe_pairs_out_kernel<<<elem_blocks(P * a.D), kElemThreads, 0, stream>>>(
      s.ys, s.inv, s.wts, s.ids, slots, y, w, ids, P, a.D, expert_base, static_cast<int>(a.E), static_cast<int>(El));
  return gpuGetLastError();
}

// The shared-expert pieces of moe_layout: sgu, sact, sout, sgl (scratch_layout.h).
static size_t moe_combine_layout(const MoeArgs& a, char* base, MoeScratch* s) {
  const baro::scratch::MoeCombineOffsets o = baro::scratch::moe_combine_layout(a.m, a.Is, a.D);
  MoeScratch t{};
  if (base != nullptr) {
    t.sgu = reinterpret_cast<float*>(base + o.sgu);
    t.sact = reinterpret_cast<uint16_t*>(base + o.sact);
    t.sout = reinterpret_cast<float*>(base + o.sout);
    t.sgl = reinterpret_cast<float*>(base + o.sgl);
  }
  if (s) *s = t;
  return static_cast<size_t>(o.total);
}

size_t moe_combine_scratch_bytes(const MoeArgs& a) {
  return a.m <= 0 ? 0 : moe_combine_layout(a, nullptr, nullptr);
}

gpuError_t launch_moe_combine(const MoeArgs& a, const float* y, const float* w, void* scratch,
                              gpuStream_t stream) {
  (void)gpuGetLastError();
  if (a.m <= 0) return gpuSuccess;
  if (a.top_k < 1 || scratch == nullptr) return gpuErrorInvalidValue;
  MoeScratch s;
  moe_combine_layout(a, static_cast<char*>(scratch), &s);
  MoeArgs b = a;
  b.slots = nullptr;
  const MoePlan separate{};  // the shared expert and its gate as GEMMs of their own
  BARO_MOE_TRY(shared_expert(b, s, separate, stream));
  return combine(b, y, nullptr, w, s.sout, s.sgl, 1, nullptr, stream);
}

// baro_moe_route: steps 1-2 of launch_moe (the same kernels), ids straight into the result.
size_t moe_route_scratch_bytes(int64_t m, int64_t E, int k) {
  return static_cast<size_t>(baro::scratch::moe_route_bytes(m, E, k));
}

gpuError_t launch_moe_route(const uint16_t* h, const uint16_t* router, int32_t* ids, int64_t m,
                            int64_t D, int64_t E, int k, void* scratch, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (m <= 0) return gpuSuccess;
  if (k < 1 || k > E || E > kSortMaxE || scratch == nullptr) return gpuErrorInvalidValue;
  float* logits = static_cast<float*>(scratch);
  float* wts = reinterpret_cast<float*>(static_cast<char*>(scratch) +
                                        ((sizeof(float) * m * E + 255) & ~static_cast<size_t>(255)));
  BARO_MOE_TRY(launch_matmul(h, router, logits, m, E, D, stream));
  return launch_topk(logits, E, ids, wts, m, static_cast<int>(E), k, stream);
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handler (same operands/attrs/results as BaroMoeCpu, see docs/FFI.md).
// baro_moe / baro_moe_slots use the XLA scratch allocator, so they are not
// command-buffer compatible. The _small variants (decode: m <= 16) take their
// scratch as one more result buffer sized by the wrapper (custom_calls/moe.py),
// allocate nothing, and declare the command-buffer trait, so a decode step's
// MoE stays inside XLA's command buffers.
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

using baro_gpu::ScratchSource;
using baro_gpu::take_scratch;

// The launch shared by baro_moe and baro_moe_slots (slots == nullptr: baro_moe).
ffi::Error run_moe(const char* op, gpuStream_t stream, ScratchSource scratch,
                   const baro::MoeDims& dims, int32_t top_k, ffi::Buffer<ffi::BF16>& h,
                   ffi::Buffer<ffi::BF16>& router, ffi::Buffer<ffi::BF16>& w_gate_up,
                   ffi::Buffer<ffi::BF16>& w_down, const int32_t* slots, int64_t S,
                   ffi::Buffer<ffi::BF16>& shared_gate_up, ffi::Buffer<ffi::BF16>& shared_down,
                   ffi::Buffer<ffi::BF16>& shared_gate, ffi::Result<ffi::Buffer<ffi::F32>>& out,
                   const uint16_t* host_gu = nullptr, const uint16_t* host_dn = nullptr) {
  const int64_t m = dims.m, D = dims.D, E = dims.E, I = dims.I, Is = dims.Is;
  BARO_CHECK(E <= baro_gpu::kMoeMaxExperts, op,
             "the GPU kernel supports at most " << baro_gpu::kMoeMaxExperts << " experts, got E=" << E);
  BARO_CHECK(m * top_k < (int64_t{1} << 31) - 1 && E < (int64_t{1} << 31), op,
             "m * top_k = " << m * top_k << " (row, slot) pairs is too many for one GPU call");
  BARO_CHECK(S < (int64_t{1} << 31), op, "too many pool slots: " << S);
  if (m == 0) return ffi::Error::Success();

  baro_gpu::MoeArgs a;
  a.h = h.typed_data();
  a.router = router.typed_data();
  a.w_gate_up = w_gate_up.typed_data();
  a.w_down = w_down.typed_data();
  a.s_gate_up = shared_gate_up.typed_data();
  a.s_down = shared_down.typed_data();
  a.s_gate = shared_gate.typed_data();
  a.out = out->typed_data();
  a.m = m;
  a.D = D;
  a.E = E;
  a.I = I;
  a.Is = Is;
  a.top_k = top_k;
  a.slots = slots;
  a.S = S;
  a.host_gu = host_gu;
  a.host_dn = host_dn;
  if (host_gu != nullptr)
    BARO_CHECK(baro_gpu::moe_runs_fold(a), op,
               "the GPU reads experts from the host store only in the one-token path (m = 1, the shared "
               "expert as wide as a routed one, top_k <= 32, BARO_MOE_FOLD unset); got m="
                   << m << ", I=" << I << ", Is=" << Is << ", top_k=" << top_k);
  void* mem = nullptr;
  if (auto err = take_scratch(op, scratch, baro_gpu::moe_scratch_bytes(a), &mem); err.failure()) return err;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_moe(a, mem, stream));
  return ffi::Error::Success();
}

ffi::Error moe_common(const char* op, gpuStream_t stream, ScratchSource scratch, ffi::Buffer<ffi::BF16> h,
                      ffi::Buffer<ffi::BF16> router, ffi::Buffer<ffi::BF16> w_gate_up,
                      ffi::Buffer<ffi::BF16> w_down, ffi::Buffer<ffi::BF16> shared_gate_up,
                      ffi::Buffer<ffi::BF16> shared_down, ffi::Buffer<ffi::BF16> shared_gate,
                      int32_t top_k, ffi::ResultBuffer<ffi::F32> out) {
  baro::MoeDims dims;
  if (auto err = baro::check_moe(h, router, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate,
                                 top_k, *out, dims);
      err.failure())
    return err;
  return run_moe(op, stream, scratch, dims, top_k, h, router, w_gate_up, w_down, nullptr, 0,
                 shared_gate_up, shared_down, shared_gate, out);
}

ffi::Error MoeGpuImpl(gpuStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::BF16> h,
                      ffi::Buffer<ffi::BF16> router, ffi::Buffer<ffi::BF16> w_gate_up,
                      ffi::Buffer<ffi::BF16> w_down, ffi::Buffer<ffi::BF16> shared_gate_up,
                      ffi::Buffer<ffi::BF16> shared_down, ffi::Buffer<ffi::BF16> shared_gate,
                      int32_t top_k, ffi::ResultBuffer<ffi::F32> out) {
  return moe_common("baro_moe", stream, ScratchSource{&scratch, nullptr}, h, router, w_gate_up, w_down,
                    shared_gate_up, shared_down, shared_gate, top_k, out);
}

ffi::Error MoeSmallGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> router,
                           ffi::Buffer<ffi::BF16> w_gate_up, ffi::Buffer<ffi::BF16> w_down,
                           ffi::Buffer<ffi::BF16> shared_gate_up, ffi::Buffer<ffi::BF16> shared_down,
                           ffi::Buffer<ffi::BF16> shared_gate, int32_t top_k, ffi::ResultBuffer<ffi::F32> out,
                           ffi::ResultBuffer<ffi::U8> scratch) {
  return moe_common("baro_moe_small", stream, ScratchSource{nullptr, &scratch}, h, router, w_gate_up, w_down,
                    shared_gate_up, shared_down, shared_gate, top_k, out);
}

// baro_moe_slots: the grouped GEMMs' weight group is the expert's slot (slots[e]) in the
// pool instead of e; everything else, so every bit, is baro_moe's.
ffi::Error moe_slots_common(const char* op, gpuStream_t stream, ScratchSource scratch, ffi::Buffer<ffi::BF16> h,
                            ffi::Buffer<ffi::BF16> router, ffi::Buffer<ffi::BF16> w_gate_up_pool,
                            ffi::Buffer<ffi::BF16> w_down_pool, ffi::Buffer<ffi::S32> slots,
                            ffi::Buffer<ffi::BF16> shared_gate_up, ffi::Buffer<ffi::BF16> shared_down,
                            ffi::Buffer<ffi::BF16> shared_gate, int32_t top_k,
                            ffi::ResultBuffer<ffi::F32> out) {
  baro::MoeDims dims;
  int64_t S = 0;
  if (auto err = baro::check_moe_slots(h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up,
                                       shared_down, shared_gate, top_k, *out, dims, S);
      err.failure())
    return err;
  return run_moe(op, stream, scratch, dims, top_k, h, router, w_gate_up_pool, w_down_pool,
                 slots.typed_data(), S, shared_gate_up, shared_down, shared_gate, out);
}

// baro_moe_host_small: baro_moe_slots whose routed experts with no slot are read from the host
// store at host_gate_up / host_down ([E, 2I, D] / [E, D, I] bf16) by the one-token kernels
// (16-byte loads over the host link) instead of coming out NaN. The same weights in the same
// order, so baro_moe's bytes.
ffi::Error MoeHostSmallGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> router,
                               ffi::Buffer<ffi::BF16> w_gate_up_pool, ffi::Buffer<ffi::BF16> w_down_pool,
                               ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::BF16> shared_gate_up,
                               ffi::Buffer<ffi::BF16> shared_down, ffi::Buffer<ffi::BF16> shared_gate, int32_t top_k,
                               int64_t host_gate_up, int64_t host_down, ffi::ResultBuffer<ffi::F32> out,
                               ffi::ResultBuffer<ffi::U8> scratch) {
  const char* op = "baro_moe_host";
  baro::MoeDims dims;
  int64_t S = 0;
  if (auto err = baro::check_moe_host(h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down,
                                      shared_gate, top_k, host_gate_up, host_down, *out, dims, S);
      err.failure())
    return err;
  const uint16_t *gu = nullptr, *dn = nullptr;
  if (auto err = host_store_pointer(op, "host_gate_up", host_gate_up, stream, &gu); err.failure()) return err;
  if (auto err = host_store_pointer(op, "host_down", host_down, stream, &dn); err.failure()) return err;
  return run_moe(op, stream, ScratchSource{nullptr, &scratch}, dims, top_k, h, router, w_gate_up_pool, w_down_pool,
                 slots.typed_data(), S, shared_gate_up, shared_down, shared_gate, out, gu, dn);
}

ffi::Error MoeSlotsGpuImpl(gpuStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::BF16> h,
                           ffi::Buffer<ffi::BF16> router, ffi::Buffer<ffi::BF16> w_gate_up_pool,
                           ffi::Buffer<ffi::BF16> w_down_pool, ffi::Buffer<ffi::S32> slots,
                           ffi::Buffer<ffi::BF16> shared_gate_up, ffi::Buffer<ffi::BF16> shared_down,
                           ffi::Buffer<ffi::BF16> shared_gate, int32_t top_k,
                           ffi::ResultBuffer<ffi::F32> out) {
  return moe_slots_common("baro_moe_slots", stream, ScratchSource{&scratch, nullptr}, h, router, w_gate_up_pool,
                          w_down_pool, slots, shared_gate_up, shared_down, shared_gate, top_k, out);
}

ffi::Error MoeSlotsSmallGpuImpl(gpuStream_t stream, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> router,
                                ffi::Buffer<ffi::BF16> w_gate_up_pool, ffi::Buffer<ffi::BF16> w_down_pool,
                                ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::BF16> shared_gate_up,
                                ffi::Buffer<ffi::BF16> shared_down, ffi::Buffer<ffi::BF16> shared_gate,
                                int32_t top_k, ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::U8> scratch) {
  return moe_slots_common("baro_moe_slots_small", stream, ScratchSource{nullptr, &scratch}, h, router,
                          w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down, shared_gate, top_k,
                          out);
}

ffi::Error MoeRouteGpuImpl(gpuStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::BF16> h,
                           ffi::Buffer<ffi::BF16> router, int32_t top_k, ffi::ResultBuffer<ffi::S32> ids) {
  const char* op = "baro_moe_route";
  int64_t m = 0, D = 0, E = 0;
  if (auto err = baro::check_moe_route(h, router, top_k, *ids, m, D, E); err.failure()) return err;
  BARO_CHECK(E <= baro_gpu::kMoeMaxExperts, op,
             "the GPU kernel supports at most " << baro_gpu::kMoeMaxExperts << " experts, got E=" << E);
  if (m == 0) return ffi::Error::Success();
  void* mem = nullptr;
  if (auto err = take_scratch(op, ScratchSource{&scratch, nullptr}, baro_gpu::moe_route_scratch_bytes(m, E, top_k), &mem);
      err.failure())
    return err;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_moe_route(h.typed_data(), router.typed_data(),
                                                       ids->typed_data(), m, D, E, top_k, mem, stream));
  return ffi::Error::Success();
}

ffi::Error MoePairsGpuImpl(gpuStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::BF16> h,
                           ffi::Buffer<ffi::BF16> router, ffi::Buffer<ffi::BF16> w_gate_up,
                           ffi::Buffer<ffi::BF16> w_down, ffi::Buffer<ffi::S32> expert_base, int32_t top_k,
                           ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> w,
                           ffi::ResultBuffer<ffi::S32> ids) {
  const char* op = "baro_moe_pairs";
  baro::MoePairsDims d;
  if (auto err = baro::check_moe_pairs(h, router, w_gate_up, w_down, expert_base, top_k, *y, *w, *ids, d);
      err.failure())
    return err;
  BARO_CHECK(d.E <= baro_gpu::kMoeMaxExperts, op,
             "the GPU kernel supports at most " << baro_gpu::kMoeMaxExperts << " experts, got E=" << d.E);
  BARO_CHECK(d.m * top_k < (int64_t{1} << 31) - 1, op,
             "m * top_k = " << d.m * top_k << " (row, slot) pairs is too many for one GPU call");
  if (d.m == 0) return ffi::Error::Success();
  baro_gpu::MoeArgs a;
  a.h = h.typed_data();
  a.router = router.typed_data();
  a.w_gate_up = w_gate_up.typed_data();
  a.w_down = w_down.typed_data();
  a.m = d.m;
  a.D = d.D;
  a.E = d.E;
  a.I = d.I;
  a.Is = 0;  // no shared expert here (baro_moe_combine runs it)
  a.top_k = top_k;
  void* mem = nullptr;
  if (auto err = take_scratch(op, ScratchSource{&scratch, nullptr}, baro_gpu::moe_pairs_scratch_bytes(a), &mem); err.failure()) return err;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_moe_pairs(a, d.El, expert_base.typed_data(), y->typed_data(),
                                                       w->typed_data(), ids->typed_data(), mem, stream));
  return ffi::Error::Success();
}

ffi::Error MoeCombineGpuImpl(gpuStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::BF16> h,
                             ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::BF16> shared_gate_up,
                             ffi::Buffer<ffi::BF16> shared_down, ffi::Buffer<ffi::BF16> shared_gate,
                             ffi::ResultBuffer<ffi::F32> out) {
  const char* op = "baro_moe_combine";
  baro::MoeCombineDims d;
  if (auto err = baro::check_moe_combine(h, y, w, shared_gate_up, shared_down, shared_gate, *out, d);
      err.failure())
    return err;
  BARO_CHECK(d.K < (int64_t{1} << 31) && d.m * d.K < (int64_t{1} << 31) - 1, op,
             "m * k = " << d.m * d.K << " pairs is too many for one GPU call");
  if (d.m == 0) return ffi::Error::Success();
  baro_gpu::MoeArgs a;
  a.h = h.typed_data();
  a.s_gate_up = shared_gate_up.typed_data();
  a.s_down = shared_down.typed_data();
  a.s_gate = shared_gate.typed_data();
  a.out = out->typed_data();
  a.m = d.m;
  a.D = d.D;
  a.E = d.K;
  a.I = 0;
  a.Is = d.Is;
  a.top_k = static_cast<int>(d.K);
  void* mem = nullptr;
  if (auto err = take_scratch(op, ScratchSource{&scratch, nullptr}, baro_gpu::moe_combine_scratch_bytes(a), &mem); err.failure()) return err;
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_moe_combine(a, y.typed_data(), w.typed_data(), mem, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoePairsGpu, baro::KnobChecked<MoePairsGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // router [E, D]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_gate_up [El, 2I, D]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_down [El, D, I]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // expert_base [1]
                                  .Attr<int32_t>("top_k")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [m, k, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // w [m, k]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // ids [m, k]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeCombineGpu, baro::KnobChecked<MoeCombineGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::F32>>()   // y [m, k, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [m, k]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // shared_gate_up
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // shared_down
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // shared_gate
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [m, D]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeGpu, baro::KnobChecked<MoeGpuImpl>::Call,
                              BARO_BIND_MOE_ARGS(ffi::Ffi::Bind()
                                                     .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                                     .Ctx<ffi::ScratchAllocator>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeSlotsGpu, baro::KnobChecked<MoeSlotsGpuImpl>::Call,
                              BARO_BIND_MOE_SLOTS_ARGS(ffi::Ffi::Bind()
                                                           .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                                           .Ctx<ffi::ScratchAllocator>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeSmallGpu, baro::KnobChecked<MoeSmallGpuImpl>::Call,
                              BARO_BIND_SCRATCH(BARO_BIND_MOE_ARGS(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>())),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeSlotsSmallGpu, baro::KnobChecked<MoeSlotsSmallGpuImpl>::Call,
                              BARO_BIND_SCRATCH(BARO_BIND_MOE_SLOTS_ARGS(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>())),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeHostSmallGpu, baro::KnobChecked<MoeHostSmallGpuImpl>::Call,
                              BARO_BIND_MOE_HOST_ARGS(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<gpuStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeRouteGpu, baro::KnobChecked<MoeRouteGpuImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // router
                                  .Attr<int32_t>("top_k")
                                  .Ret<ffi::Buffer<ffi::S32>>()  // ids [m, top_k]
);
