// baro_jax GPU: the Hopper (sm_90a) helpers shared by the wgmma kernels (attention_wgmma.cu,
// gemm_wgmma.cu): mbarriers, wgmma shared-memory descriptors and fences (TMA boxes and the
// tensor-map encoder are tensor_map.h's, which sm_90 code uses too). Include only from a
// translation unit built for sm_90a (gpu.cmake's BARO_WGMMA object); the wgmma instructions here
// exist nowhere else.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "portability.h"
#include "tensor_map.h"

namespace baro_gpu {

BARO_DEV uint32_t wg_smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// ---- mbarriers ----
BARO_DEV void wg_mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// The issuing thread's arrival, announcing the bytes the stage's TMA copies will complete.
BARO_DEV void wg_mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// A plain arrival (a consumer releasing a ring stage).
BARO_DEV void wg_mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Until the phase of this parity has completed (the stage's bytes have all landed).
BARO_DEV void wg_mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// ---- wgmma (PTX ISA: asynchronous warpgroup matrix multiply) ----
// Shared-memory matrix descriptor, no swizzle, base offset 0: start address, leading and stride
// byte offsets, each in 16-byte units.
BARO_DEV uint64_t wg_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = wg_smem_addr(p);
  return static_cast<uint64_t>((a & 0x3FFFFu) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}
// The descriptor of the address `bytes` past the one d describes (bytes: a multiple of 16): d's start
// field plus bytes / 16. That field holds address bits 4..17 and shared-memory addresses stay below
// 256 KB, so the sum never carries out of it: the same 64 bits wg_desc gives for the new address, in
// one 32-bit add of a constant instead of the address, mask, shift and or of each wgmma's operand.
BARO_DEV uint64_t wg_desc_at(uint64_t d, uint32_t bytes) {
  return (d & ~uint64_t{0xffffffffu}) | static_cast<uint32_t>(static_cast<uint32_t>(d) + (bytes >> 4));
}
// The same with the 128-byte swizzle (layout type 1): the tile's boxes must sit on 1024 bytes.
BARO_DEV uint64_t wg_desc_sw128(const void* p, uint32_t lbo, uint32_t sbo) {
  return wg_desc(p, lbo, sbo) | (static_cast<uint64_t>(1) << 62);
}
BARO_DEV void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
BARO_DEV void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
BARO_DEV void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Until at most N of this thread's committed wgmma groups are still in flight.
template <int N>
BARO_DEV void wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// This thread's generic-proxy shared-memory writes (st.shared, completed cp.async) made visible
// to the async proxy that wgmma reads through (then a barrier for the other threads').
BARO_DEV void wg_fence_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving accumulator reads or writes across an asynchronous wgmma.
template <int N, int W>
BARO_DEV void wg_hold(float (&d)[N][W]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int i = 0; i < W; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
}

// ---- clusters of two CTAs (attention's pairs, the grouped GEMM's pairs) ----
BARO_DEV uint32_t wg_cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
BARO_DEV void wg_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Arrival on the mbarrier at this CTA's offset bar in CTA rank of the cluster (itself included).
// It releases a stage whose reads (wgmma, waited for) and zero fills (fenced for the async proxy)
// all came before the barrier this thread passed or waited on: the peer's copies into the stage
// follow it causally, so no cluster-scope release (a GPU-wide MEMBAR and an L1 invalidate per
// arrival in SASS) is needed.
BARO_DEV void wg_mbar_arrive_cta(uint32_t bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
// One box into the same offset dst of both CTAs of the pair, completing on bar in each.
BARO_DEV void wg_tma_box_pair(uint32_t dst, const CUtensorMap* map, int x, int j0, uint32_t bar) {
  const uint16_t mask = 3;
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(j0), "r"(bar), "h"(mask)
      : "memory");
}

// ---- host ----
// The launch attribute of clusters of two CTAs along x.
static inline cudaLaunchAttribute wg_pair_cluster_attr() {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 2;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}
// The only device the sm_90a image runs on: sm_90 (not forward compatible).
static inline bool wg_device_is_sm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major == 9 && minor == 0;
}

}  // namespace baro_gpu
