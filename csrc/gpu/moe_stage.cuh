// baro_jax GPU: baro_moe_host's staging of the routed experts with no pool slot, from the
// pinned host store into the call's device scratch, before the grouped GEMMs read them
// (launch_moe, moe.cu). Plain copies: no arithmetic, so nothing here touches the bits.
#pragma once

#include <cstdint>

#include "common.cuh"

namespace baro_gpu {

// baro_moe_host's staging: for each pair j whose expert e has no pool slot, the store's
// gate_up[e] and down[e] into scratch slot j, so the GEMMs read device memory. Over the host
// link a read takes a microsecond or two, so the link is full only with many reads in flight:
// every block of the grid copies its share of every missing pair, each thread keeping
// kStageVec 16-byte loads outstanding before it stores them. On the H200 it moves the misses at
// 51 GB/s, the link's rate for SM loads of pinned memory (copy engines 55): 790 us per layer for
// ~6.4 misses at 856b132 (benchmarks/results/decode_profile_tier_direct_h200.json,
// host_read_probe_h200.jsonl; docs/PERF.md, 2026-12-02).
constexpr int kStageThreads = 256, kStageVec = 8;
constexpr int64_t kStageMaxBlocks = 1024;
BARO_DEV void stage_copy(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kStageThreads * kStageVec;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kStageThreads * kStageVec + threadIdx.x; base < n;
       base += step) {
    uint4 v[kStageVec];
#pragma unroll
    for (int u = 0; u < kStageVec; ++u)  // every load issued before the first store
      if (base + u * kStageThreads < n) v[u] = src[base + u * kStageThreads];
#pragma unroll
    for (int u = 0; u < kStageVec; ++u)
      if (base + u * kStageThreads < n) dst[base + u * kStageThreads] = v[u];
  }
}

__global__ void __launch_bounds__(kStageThreads)
    moe_stage_misses_kernel(const int32_t* __restrict__ ids, const int32_t* __restrict__ slots, int S, int k,
                            const uint4* __restrict__ host_gu, const uint4* __restrict__ host_dn,
                            int64_t gu_vecs, int64_t dn_vecs, uint4* __restrict__ stage_gu,
                            uint4* __restrict__ stage_dn) {
  for (int j = 0; j < k; ++j) {
    const int e = ids[j];
    const int sl = slots[e];
    if (sl >= 0 && sl < S) continue;  // resident: the GEMMs read its pool slot
    stage_copy(host_gu + static_cast<int64_t>(e) * gu_vecs, stage_gu + static_cast<int64_t>(j) * gu_vecs, gu_vecs);
    stage_copy(host_dn + static_cast<int64_t>(e) * dn_vecs, stage_dn + static_cast<int64_t>(j) * dn_vecs, dn_vecs);
  }
}

}  // namespace baro_gpu
