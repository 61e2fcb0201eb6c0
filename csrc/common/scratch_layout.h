// baro_jax kernel library: the GPU scratch layouts, as plain C++.
//
// The GPU handlers lay their scratch out with these functions (csrc/gpu/moe.cu moe_layout,
// csrc/gpu/attention.cu), and the CPU library, which is always built, exports their sizes as
// C functions (csrc/cpu/scratch.cc) that custom_calls and baro_jax.budget call through ctypes:
// the bytes a _small op's scratch result holds and the bytes the budget plans for are the ones
// the kernels take, from one definition.
//
// Every piece is rounded up to 256 bytes, in the order the kernels use them.
#pragma once

#include <cstdint>

namespace baro {
namespace scratch {

constexpr int64_t up256(int64_t b) { return (b + 255) / 256 * 256; }

// ---- MoE (csrc/gpu/moe.cu) ----
constexpr int64_t kGroupChunk = 512;  // pairs per block in the grouping kernels
constexpr int64_t kMinGroupBM = 16;   // smallest GEMM BM of m > 1 calls: sizes the tile list

// What of the optional pieces a call's plan (moe.cu moe_plan) uses.
struct MoePlanFlags {
  bool fold = false;   // the shared gate as a logit, the shared expert as m more grouped rows (moe.cu MoePlan)
  bool fused = true;   // gate/up with the SwiGLU in its epilogue: no fp32 gu buffer
  bool tail = false;   // the route and combine inside the grouped GEMMs: the down GEMM's counters
  bool stage = false;  // baro_moe_host: the misses staged in the scratch, one slot per pair
};

// The tile list's length for tiles of bm rows: the routed pairs' tiles, then one more, or room
// for the folded shared expert's m rows. The scratch holds the smallest BM's (one-row tiles only
// when m == 1).
constexpr int64_t moe_tiles_for(int64_t m, int64_t E, int64_t k, int64_t bm, bool fold) {
  const int64_t P = m * k;
  return P / bm + (E < P ? E : P) + (fold ? (m + bm - 1) / bm : 1);
}
constexpr int64_t moe_max_tiles(int64_t m, int64_t E, int64_t k, bool fold) {
  return moe_tiles_for(m, E, k, m == 1 ? 1 : kMinGroupBM, fold);
}
constexpr int64_t moe_chunks(int64_t m, int64_t k) { return (m * k + kGroupChunk - 1) / kGroupChunk; }
constexpr int64_t moe_tail_counters(int64_t D) { return (D + 7) / 8; }

// Byte offsets of each piece (-1: not in this plan) and the total.
struct MoeOffsets {
  int64_t logits, ids, wts, srow, inv, tiles, n_tiles, cnt, gu, act, ys, sgu, sact, sout, sgl;
  int64_t tail_cnt, stage_gu, stage_dn, total;
};

inline MoeOffsets moe_layout(int64_t m, int64_t E, int64_t k, int64_t I, int64_t Is, int64_t D,
                             MoePlanFlags f) {
  MoeOffsets o{};
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = off;
    off += up256(bytes);
    return at;
  };
  const int64_t P = m * k, R = P + (f.fold ? m : 0);  // grouped rows: the pairs, and the folded shared expert
  o.logits = take(4 * (m * E + (f.fold ? m : 0)));  // fold: the shared gate's logit after each row's E
  o.ids = take(4 * P);
  o.wts = take(4 * P);
  o.srow = take(4 * R);
  o.inv = take(4 * P);
  o.tiles = take(4 * 3 * moe_max_tiles(m, E, k, f.fold));
  o.n_tiles = take(4);
  o.cnt = take(4 * moe_chunks(m, k) * E);
  o.gu = f.fused ? -1 : take(4 * P * 2 * I);
  o.act = take(2 * R * I);
  o.ys = take(4 * R * D);
  o.sgu = take(4 * m * 2 * Is);
  o.sact = take(2 * m * Is);
  o.sout = take(4 * m * D);
  o.sgl = take(4 * m);
  o.tail_cnt = f.tail ? take(4 * moe_tail_counters(D)) : -1;
  o.stage_gu = f.stage ? take(2 * k * 2 * I * D) : -1;
  o.stage_dn = f.stage ? take(2 * k * D * I) : -1;
  o.total = m <= 0 ? 0 : off;
  return o;
}

// baro_moe_pairs: moe's layout, then the shard's slot table [E] int32.
inline int64_t moe_pairs_bytes(int64_t m, int64_t E, int64_t k, int64_t I, int64_t Is, int64_t D,
                               MoePlanFlags f) {
  return m <= 0 ? 0 : moe_layout(m, E, k, I, Is, D, f).total + up256(4 * E);
}

// baro_moe_combine: the shared-expert pieces sgu, sact, sout, sgl.
struct MoeCombineOffsets {
  int64_t sgu, sact, sout, sgl, total;
};
inline MoeCombineOffsets moe_combine_layout(int64_t m, int64_t Is, int64_t D) {
  MoeCombineOffsets o{};
  o.sgu = 0;
  o.sact = o.sgu + up256(4 * m * 2 * Is);
  o.sout = o.sact + up256(2 * m * Is);
  o.sgl = o.sout + up256(4 * m * D);
  o.total = m <= 0 ? 0 : o.sgl + up256(4 * m);
  return o;
}

// baro_moe_route: the logits [m, E] and weights [m, k].
constexpr int64_t moe_route_bytes(int64_t m, int64_t E, int64_t k) { return up256(4 * m * E) + up256(4 * m * k); }

// ---- attention (csrc/gpu/attention.cu, attention_fa.cuh) ----
constexpr int64_t kAttnSplit = 512;  // KV positions per split
constexpr int64_t kAttnRows = 16;    // HIP: query rows per block
constexpr int64_t kFaPairRows = 16;  // CUDA: rows per warp pair
constexpr int64_t kFaSmallPairs = 1, kFaBigPairs = 4;

// The split partials of a decode-style call (m <= 16; prefill calls take none): o [slots, hd]
// f32, then (max, sum) [slots, 2] f32. CUDA: slots = kv heads x splits x rows padded to the 16-
// or 64-row tile; HIP: q heads x splits x kAttnRows.
inline int64_t attention_bytes(int64_t m, int64_t S, int64_t H, int64_t Hkv, int64_t hd, bool hip) {
  if (m <= 0 || m > 16 || Hkv <= 0) return 0;
  const int64_t splits = (S + kAttnSplit - 1) / kAttnSplit;
  int64_t slots;
  if (hip) {
    slots = H * splits * kAttnRows;
  } else {
    const int64_t rows = m * (H / Hkv);
    const int64_t tr = kFaPairRows * (rows <= kFaPairRows ? kFaSmallPairs : kFaBigPairs);
    slots = Hkv * splits * ((rows + tr - 1) / tr * tr);
  }
  return up256(4 * slots * hd) + 4 * slots * 2;
}

}  // namespace scratch
}  // namespace baro
