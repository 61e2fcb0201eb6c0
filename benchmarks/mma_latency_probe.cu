// How fast can one fp32 accumulator walk K? The decode GEMMs keep the one dot order (each
// output one accumulator, K ascending in 16-wide steps), so at few rows the time of a GEMM is at
// least (K / 16) dependent tensor-core steps: out_proj's K = 4096 is 256 of them, and at 8 rows
// its 2048 columns give only 256 such chains for the card's 528 sub-partitions. This measures
// the cycles one step of a chain costs, on one warp (mma.sync m16n8k16) and on one warpgroup
// (wgmma m64nNk16, N = 8 / 16 / 32, both operands in shared memory, a chain of steps in one
// commit group), with 1, 2, 4 and 8 chains interleaved: where the cycles per step stop falling as
// chains are added, the tensor pipe is the limit; until then the dependency is.
//
// Values do not matter here (random bf16 operands, results stored so nothing is dropped). One
// JSON line per case: {"op", "chains", "steps", "cycles_per_step"} (cycles of the SM clock, the
// median of 5 launches, each one block on an idle card).
//
// On the GPU machine (~5 s): nvcc -O3 -std=c++17 --generate-code=arch=compute_90a,code=sm_90a -Icsrc/gpu -Icsrc/common
//   benchmarks/mma_latency_probe.cu -o /tmp/mma_latency_probe && /tmp/mma_latency_probe
// (run_gpu.sh mma_latency).
#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "../csrc/gpu/common.cuh"
#include "../csrc/gpu/dot.cuh"
#include "../csrc/gpu/wgmma_util.cuh"
#include "probe_host.h"

using namespace baro_gpu;

constexpr int kSteps = 1024;  // dependent steps per chain

// One warp: C independent accumulators, each advanced kSteps times by mma.sync, interleaved.
template <int C>
__global__ void mma_chain(const uint32_t* ops, float* out, long long* cycles) {
  const int lane = threadIdx.x;
  FragA a;
  FragB b;
  for (int i = 0; i < 4; ++i) a.r[i] = ops[lane * 6 + i];
  for (int i = 0; i < 2; ++i) b.r[i] = ops[lane * 6 + 4 + i];
  float acc[C][4] = {};
  __syncwarp();
  const long long t0 = clock64();
#pragma unroll 4
  for (int s = 0; s < kSteps; ++s)
#pragma unroll
    for (int c = 0; c < C; ++c) mma_16816(acc[c], a, b);
  __syncwarp();
  const long long t1 = clock64();
  float sum = 0.0f;
  for (int c = 0; c < C; ++c)
    for (int i = 0; i < 4; ++i) sum += acc[c][i];
  out[lane] = sum;
  if (lane == 0) *cycles = t1 - t0;
}

// wgmma m64nNk16, A and B from shared memory (no swizzle: 8x8 core matrices, 128 bytes each).
template <int N>
BARO_DEV void wg_mma(float (&d)[N / 2], uint64_t da, uint64_t db);
template <>
BARO_DEV void wg_mma<8>(float (&d)[4], uint64_t da, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db));
}
template <>
BARO_DEV void wg_mma<16>(float (&d)[8], uint64_t da, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, 0, "
      "0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(da), "l"(db));
}
template <>
BARO_DEV void wg_mma<32>(float (&d)[16], uint64_t da, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
      "%12, %13, %14, %15}, %16, %17, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db));
}

// One warpgroup: C accumulators of m64nN, each advanced kSteps times; BATCH steps of every
// chain are issued per commit group (then wait), as a pipelined main loop would between stages.
template <int N, int C, int BATCH>
__global__ void wgmma_chain(const uint16_t* ops, float* out, long long* cycles) {
  __shared__ __align__(128) uint16_t sa[64 * 16];  // A: 64 x 16
  __shared__ __align__(128) uint16_t sb[N * 16];   // B: N x 16 (K-major)
  for (int i = threadIdx.x; i < 64 * 16; i += blockDim.x) sa[i] = ops[i];
  for (int i = threadIdx.x; i < N * 16; i += blockDim.x) sb[i] = ops[64 * 16 + i];
  wg_fence_proxy();
  __syncthreads();
  // core matrices of 8 rows x 16 bytes: leading (k) offset 128 B, stride (8 rows) 256 B
  const uint64_t da = wg_desc(sa, 128, 256), db = wg_desc(sb, 128, 256);
  float d[C][N / 2] = {};
  wg_hold(d);
  const long long t0 = clock64();
  for (int s = 0; s < kSteps; s += BATCH) {
    wg_fence();
#pragma unroll
    for (int j = 0; j < BATCH; ++j)
#pragma unroll
      for (int c = 0; c < C; ++c) wg_mma<N>(d[c], da, db);
    wg_commit();
    wg_wait_all();
  }
  wg_hold(d);
  const long long t1 = clock64();
  float sum = 0.0f;
  for (int c = 0; c < C; ++c)
    for (int i = 0; i < N / 2; ++i) sum += d[c][i];
  out[threadIdx.x] = sum;
  if (threadIdx.x == 0) *cycles = t1 - t0;
}

template <typename F>
static double median_cycles(F launch, long long* dcyc) {
  std::vector<long long> v;
  for (int r = 0; r < 5; ++r) {
    launch();
    long long c = 0;
    cudaMemcpy(&c, dcyc, sizeof c, cudaMemcpyDeviceToHost);
    v.push_back(c);
  }
  std::sort(v.begin(), v.end());
  return static_cast<double>(v[2]);
}

int main() {
  std::mt19937 g(20261205);
  std::vector<uint32_t> ops32(32 * 6);
  for (auto& x : ops32) x = (static_cast<uint32_t>(to_bf16(0.01f * (g() % 200))) << 16) | to_bf16(0.01f);
  uint32_t* d_ops32 = dev(ops32);
  std::vector<uint16_t> ops16 = rand_bf16(g, 64 * 16 + 32 * 16, 0.05f);
  uint16_t* d_ops16 = dev(ops16);
  float* d_out = dev(std::vector<float>(128));
  long long* d_cyc = dev(std::vector<long long>(1));
  bool ok = true;
  auto report = [&](const char* op, int chains, int batch, double cyc) {
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) ok = false;
    std::printf("{\"op\": \"%s\", \"chains\": %d, \"batch\": %d, \"steps\": %d, \"cycles_per_step\": %.2f, \"cuda\": \"%s\"}\n",
                op, chains, batch, kSteps, cyc / kSteps, cudaGetErrorString(e));
  };
#define MMA(C) report("mma.sync.m16n8k16", C, 1, median_cycles([&] { mma_chain<C><<<1, 32>>>(d_ops32, d_out, d_cyc); }, d_cyc))
  MMA(1);
  MMA(2);
  MMA(4);
  MMA(8);
#undef MMA
#define WG(N, C, B)                                                                                           \
  report("wgmma.m64n" #N "k16", C, B,                                                                         \
         median_cycles([&] { wgmma_chain<N, C, B><<<1, 128>>>(d_ops16, d_out, d_cyc); }, d_cyc))
#define WG_ALL(B) \
  WG(8, 1, B);    \
  WG(8, 2, B);    \
  WG(8, 4, B);    \
  WG(16, 1, B);   \
  WG(16, 4, B);   \
  WG(32, 1, B);   \
  WG(32, 4, B)
  WG_ALL(1);
  WG_ALL(8);
  WG_ALL(32);
#undef WG_ALL
#undef WG
  std::printf("{\"ok\": %s}\n", ok ? "true" : "false");
  return ok ? 0 : 1;
}
