// The two facts the opt-in wgmma prefill attention (csrc/gpu/attention_wgmma.cu) stands on,
// checked alone, with its own helpers (this file includes it): for bf16 inputs,
//  S:  wgmma m64n32k16 with A (Q) and B (K) from shared memory in the kernel's blocked layout,
//      walking the head dims in ascending 16-wide steps from a zeroed accumulator;
//  PV: wgmma m64n{16,32,64,128}k16 with A (P) from registers (fa_load_a) and B (V) from shared
//      memory read transposed, 4 key steps ascending onto a non-zero accumulator (o * alpha);
// give, register for register, the bits of mma.sync m16n8k16 (dot.cuh's mma_16816, the order
// attn_fa_kernel and every decode kernel use) over the same operands. A wrong descriptor gives
// garbage; a different internal order gives ulps. Both print as JSON lines, one per case.
//
// On the GPU machine (~10 s): nvcc -O3 -std=c++17 --fmad=false -DBARO_WGMMA=1
//   --generate-code=arch=compute_90a,code=sm_90a
//   -Icsrc/gpu -Icsrc/common benchmarks/wgmma_probe.cu -o /tmp/wgmma_probe && /tmp/wgmma_probe
// (run_gpu.sh attn_wgmma, its probe part). Exit status 0 only when every case is equal.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../csrc/gpu/attention_wgmma.cu"
#include "probe_host.h"

namespace baro_gpu {
bool pdl_enabled() { return false; }  // matmul.cu's, which this probe does not link
}  // namespace baro_gpu

using namespace baro_gpu;

constexpr int kProbeHd = 256;   // the S walk: 16 k-steps; the V tile's row length
constexpr int kProbeThreads = 128;  // one warpgroup

// Reference S: warp w, rows 16w.., columns nbase..nbase+31 (4 n-tiles), k ascending, from zero.
__global__ void ref_s(const uint16_t* Q, const uint16_t* K, int nbase, float* out) {
  const int w = warp_id(), lane = lane_id();
  float d[4][4] = {};
  for (int k0 = 0; k0 < kProbeHd; k0 += 16) {
    FragA a;
    load_a(a, Q + (16 * w) * kProbeHd + k0, kProbeHd);
    for (int u = 0; u < 4; ++u) {
      FragB b;
      load_b_nk(b, K + (nbase + 8 * u) * kProbeHd + k0, kProbeHd);
      mma_16816(d[u], a, b);
    }
  }
  for (int u = 0; u < 4; ++u)
    for (int i = 0; i < 4; ++i) out[((w * 32 + lane) * 4 + u) * 4 + i] = d[u][i];
}

// Global row-major [rows][hd] -> shared, attention_wgmma.cu's blocked layout.
BARO_DEV void to_blocked(uint16_t* dst, const uint16_t* src, int rows) {
  for (int e = threadIdx.x; e < rows * kProbeHd; e += blockDim.x)
    dst[wg_off<kProbeHd>(e / kProbeHd, e % kProbeHd)] = src[e];
}

__global__ void wg_s(const uint16_t* Q, const uint16_t* K, int nbase, float* out) {
  extern __shared__ uint4 smem4[];
  uint16_t* Qs = reinterpret_cast<uint16_t*>(smem4);
  uint16_t* Kt = Qs + 64 * kProbeHd;
  to_blocked(Qs, Q, 64);
  to_blocked(Kt, K, 64);
  wg_fence_proxy();
  __syncthreads();
  const int w = warp_id(), lane = lane_id();
  constexpr uint32_t kRowGroup = WgLayout<kProbeHd>::kRowGroup;
  float d[4][4] = {};
  wg_hold(d);
  wg_fence();
  for (int k0 = 0; k0 < kProbeHd; k0 += 16)  // attention_wgmma.cu's S walk, verbatim
    wg_mma_s(d, wg_desc(Qs + k0 * 8, 128, kRowGroup),
             wg_desc(Kt + (nbase / 8) * (kProbeHd / 8) * 64 + k0 * 8, 128, kRowGroup));
  wg_commit();
  wg_wait_all();
  wg_hold(d);
  for (int u = 0; u < 4; ++u)
    for (int i = 0; i < 4; ++i) out[((w * 32 + lane) * 4 + u) * 4 + i] = d[u][i];
}

// Reference P V: warp w, rows 16w.., dims dbase..dbase+8*NT-1, o0 first, 4 key steps ascending.
template <int NT>
__global__ void ref_pv(const uint16_t* P, const uint16_t* V, const float* o0, int dbase, float* out) {
  const int w = warp_id(), lane = lane_id();
  float d[NT][4];
  for (int u = 0; u < NT; ++u)
    for (int i = 0; i < 4; ++i) d[u][i] = o0[((w * 32 + lane) * NT + u) * 4 + i];
  for (int kk = 0; kk < 4; ++kk) {
    FragA a;
    load_a(a, P + (16 * w) * 64 + 16 * kk, 64);
    for (int u = 0; u < NT; ++u) {
      FragB b;
      load_b_kn(b, V + (16 * kk) * kProbeHd + dbase + 8 * u, kProbeHd);
      mma_16816(d[u], a, b);
    }
  }
  for (int u = 0; u < NT; ++u)
    for (int i = 0; i < 4; ++i) out[((w * 32 + lane) * NT + u) * 4 + i] = d[u][i];
}

template <int NT>
__global__ void wg_pv(const uint16_t* P, const uint16_t* V, const float* o0, int dbase, float* out) {
  extern __shared__ uint4 smem4[];
  uint16_t* Ps = reinterpret_cast<uint16_t*>(smem4);  // [64][kFaPld], as attention_wgmma.cu
  uint16_t* Vt = Ps + 64 * kFaPld;
  for (int e = threadIdx.x; e < 64 * 64; e += blockDim.x) Ps[(e / 64) * kFaPld + e % 64] = P[e];
  to_blocked(Vt, V, 64);
  wg_fence_proxy();
  __syncthreads();
  const int w = warp_id(), lane = lane_id();
  constexpr uint32_t kRowGroup = WgLayout<kProbeHd>::kRowGroup;
  float d[NT][4];
  for (int u = 0; u < NT; ++u)
    for (int i = 0; i < 4; ++i) d[u][i] = o0[((w * 32 + lane) * NT + u) * 4 + i];
  FragA pa[4];
  for (int kk = 0; kk < 4; ++kk) fa_load_a(pa[kk], Ps + (16 * w) * kFaPld + 16 * kk, kFaPld);
  wg_hold(d);
  wg_fence();
  for (int kk = 0; kk < 4; ++kk)  // attention_wgmma.cu's P V walk; dbase / 8 = its half * (hd / 16)
    wg_mma_pv(d, pa[kk], wg_desc(Vt + (2 * kk * (kProbeHd / 8) + dbase / 8) * 64, kRowGroup, 128));
  wg_commit();
  wg_wait_all();
  wg_hold(d);
  for (int u = 0; u < NT; ++u)
    for (int i = 0; i < 4; ++i) out[((w * 32 + lane) * NT + u) * 4 + i] = d[u][i];
}

static bool report(const char* name, int param, float* dref, float* dwg, size_t n) {
  std::vector<float> a(n), b(n);
  cudaMemcpy(a.data(), dref, n * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(b.data(), dwg, n * 4, cudaMemcpyDeviceToHost);
  const cudaError_t e = cudaGetLastError();
  size_t diff = 0;
  double worst = 0;
  for (size_t i = 0; i < n; ++i)
    if (std::memcmp(&a[i], &b[i], 4)) {
      ++diff;
      worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
    }
  const bool ok = e == cudaSuccess && diff == 0;
  std::printf("{\"case\": \"%s\", \"param\": %d, \"values\": %zu, \"differ\": %zu, \"max_abs_diff\": %.3g, "
              "\"cuda\": \"%s\", \"equal\": %s}\n",
              name, param, n, diff, worst, cudaGetErrorString(e), ok ? "true" : "false");
  return ok;
}

template <int NT>
static bool pv_case(const uint16_t* P, const uint16_t* V, const float* o0, float* r, float* x, int dbase) {
  const size_t smem = (64 * kFaPld + 64 * kProbeHd) * 2;
  cudaFuncSetAttribute(wg_pv<NT>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  ref_pv<NT><<<1, kProbeThreads>>>(P, V, o0, dbase, r);
  wg_pv<NT><<<1, kProbeThreads, smem>>>(P, V, o0, dbase, x);
  cudaDeviceSynchronize();
  char name[32];
  std::snprintf(name, sizeof name, "pv_n%d", 8 * NT);
  return report(name, dbase, r, x, 128 * NT * 4);
}

int main() {
  std::mt19937 g(20261202);
  const auto Q = rand_bf16(g, 64 * kProbeHd, 0.5f), K = rand_bf16(g, 64 * kProbeHd, 0.5f);
  const auto P = rand_bf16(g, 64 * 64, 0.1f), V = rand_bf16(g, 64 * kProbeHd, 1.0f);
  std::normal_distribution<float> N(0.0f, 3.0f);
  std::vector<float> o0(128 * 16 * 4);
  for (auto& v : o0) v = N(g);
  uint16_t *dQ = dev(Q), *dK = dev(K), *dP = dev(P), *dV = dev(V);
  float* dO = dev(o0);
  float *r = nullptr, *x = nullptr;
  cudaMalloc(&r, 128 * 16 * 4 * 4);
  cudaMalloc(&x, 128 * 16 * 4 * 4);
  bool ok = true;
  const size_t s_smem = 2 * 64 * kProbeHd * 2;
  cudaFuncSetAttribute(wg_s, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(s_smem));
  for (int nbase : {0, 32}) {  // warpgroup 0's and 1's key columns of a 64-key block
    ref_s<<<1, kProbeThreads>>>(dQ, dK, nbase, r);
    wg_s<<<1, kProbeThreads, s_smem>>>(dQ, dK, nbase, x);
    cudaDeviceSynchronize();
    ok &= report("s_n32", nbase, r, x, 128 * 16);
  }
  // the P V widths hd 256 / 128 / 64 / 32 give a warpgroup (hd / 2 dims), at both halves
  for (int dbase : {0, 128}) ok &= pv_case<16>(dP, dV, dO, r, x, dbase);
  for (int dbase : {0, 64}) ok &= pv_case<8>(dP, dV, dO, r, x, dbase);
  for (int dbase : {0, 32}) ok &= pv_case<4>(dP, dV, dO, r, x, dbase);
  for (int dbase : {0, 16}) ok &= pv_case<2>(dP, dV, dO, r, x, dbase);
  std::printf("{\"all_equal\": %s}\n", ok ? "true" : "false");
  return ok ? 0 : 1;
}
