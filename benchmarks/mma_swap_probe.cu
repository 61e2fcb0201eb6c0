// Does mma.sync m16n8k16 give the same bits with its operands' roles swapped? The decode GEMMs
// of 2 to 16 rows (gemm_row1.cuh's 16-row stream) put a step's token rows in A (16 rows, most of
// them zero at 8 sequences) and 8 output columns of W in B. Swapped, W's rows would be A (16
// output columns per mma) and the tokens B (8 per mma): half the mmas per W byte at 8 rows and
// every lane's products real. That keeps the one dot order only if the instruction sums a
// k-step's 16 products the same way whichever operand holds which factor. This checks it, value
// for value: C[token][col] walked the usual way (dot.cuh's mma_16816, K ascending in 16-wide
// steps into one fp32 accumulator) against D[col][token] walked swapped over the same bytes.
//
// Cases: K of 16 to 4096; tokens 1, 2, 5, 8 (rows past them zero, as in a slot); operands of
// ordinary scale, with exponents spread over 2^-24..2^24 (products that cancel and round inside a
// k-step), and from a non-zero fp32 start. One JSON line per case, then {"all_equal": ...}; exit
// status 0 only when every value is equal.
//
// On the GPU machine (~5 s): nvcc -O3 -std=c++17 --fmad=false -arch=sm_90 -Icsrc/gpu -Icsrc/common
//   benchmarks/mma_swap_probe.cu -o /tmp/mma_swap_probe && /tmp/mma_swap_probe
// (run_gpu.sh mma_swap).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../csrc/gpu/common.cuh"
#include "../csrc/gpu/dot.cuh"
#include "probe_host.h"

using namespace baro_gpu;

constexpr int kWarps = 32;  // independent trials per launch, each its own slice of the data

// X: per warp [16][K] token rows (rows >= m zero); W: per warp [16][K] weight rows (16 columns).
// C0: per warp [16][16] fp32 start values (token, column). out: per warp [16][16] (token, column).
__global__ void usual(const uint16_t* X, const uint16_t* W, const float* C0, int K, float* out) {
  const int w = warp_id(), lane = lane_id();
  const uint16_t* x = X + static_cast<size_t>(w) * 16 * K;
  const uint16_t* wt = W + static_cast<size_t>(w) * 16 * K;
  float c[2][4];
  for (int nt = 0; nt < 2; ++nt)
    for (int i = 0; i < 4; ++i) c[nt][i] = C0[w * 256 + frag_row(i) * 16 + 8 * nt + frag_col(i)];
  for (int k0 = 0; k0 < K; k0 += 16) {
    FragA a;
    load_a(a, x + k0, K);  // A: tokens x k
    for (int nt = 0; nt < 2; ++nt) {
      FragB b;
      load_b_nk(b, wt + static_cast<size_t>(8 * nt) * K + k0, K);  // B: k x 8 columns
      mma_16816(c[nt], a, b);
    }
  }
  for (int nt = 0; nt < 2; ++nt)
    for (int i = 0; i < 4; ++i) out[w * 256 + frag_row(i) * 16 + 8 * nt + frag_col(i)] = c[nt][i];
}

__global__ void swapped(const uint16_t* X, const uint16_t* W, const float* C0, int K, float* out) {
  const int w = warp_id(), lane = lane_id();
  (void)lane;
  const uint16_t* x = X + static_cast<size_t>(w) * 16 * K;
  const uint16_t* wt = W + static_cast<size_t>(w) * 16 * K;
  float c[2][4];  // two token tiles: tokens 0-7 and 8-15; element (column, token)
  for (int tt = 0; tt < 2; ++tt)
    for (int i = 0; i < 4; ++i) c[tt][i] = C0[w * 256 + (8 * tt + frag_col(i)) * 16 + frag_row(i)];
  for (int k0 = 0; k0 < K; k0 += 16) {
    FragA a;
    load_a(a, wt + k0, K);  // A: 16 columns x k
    for (int tt = 0; tt < 2; ++tt) {
      FragB b;
      load_b_nk(b, x + static_cast<size_t>(8 * tt) * K + k0, K);  // B: k x 8 tokens
      mma_16816(c[tt], a, b);
    }
  }
  for (int tt = 0; tt < 2; ++tt)
    for (int i = 0; i < 4; ++i) out[w * 256 + (8 * tt + frag_col(i)) * 16 + frag_row(i)] = c[tt][i];
}

// kind 0: N(0, 1); kind 1: N(0, 1) * 2^u, u uniform in [-24, 24]
static std::vector<uint16_t> operand(std::mt19937& g, size_t n, int kind) {
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::uniform_int_distribution<int> E(-24, 24);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = to_bf16(kind ? std::ldexp(N(g), E(g)) : N(g));
  return v;
}

static bool run_case(std::mt19937& g, int K, int m, int kind, bool start) {
  auto X = operand(g, static_cast<size_t>(kWarps) * 16 * K, kind);
  for (int w = 0; w < kWarps; ++w)  // a slot of m rows: the rest zero, as the kernels' fragments make them
    for (int r = m; r < 16; ++r) std::memset(&X[(static_cast<size_t>(w) * 16 + r) * K], 0, 2 * K);
  const auto W = operand(g, static_cast<size_t>(kWarps) * 16 * K, kind);
  std::vector<float> c0(kWarps * 256, 0.0f);
  if (start) {
    std::normal_distribution<float> N(0.0f, 4.0f);
    for (auto& v : c0) v = N(g);
  }
  uint16_t *dX = dev(X), *dW = dev(W);
  float* dC = dev(c0);
  float *r = nullptr, *s = nullptr;
  cudaMalloc(&r, kWarps * 256 * 4);
  cudaMalloc(&s, kWarps * 256 * 4);
  usual<<<1, kWarps * 32>>>(dX, dW, dC, K, r);
  swapped<<<1, kWarps * 32>>>(dX, dW, dC, K, s);
  const cudaError_t e = cudaDeviceSynchronize();
  std::vector<float> hr(kWarps * 256), hs(kWarps * 256);
  cudaMemcpy(hr.data(), r, hr.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(hs.data(), s, hs.size() * 4, cudaMemcpyDeviceToHost);
  size_t differ = 0, checked = 0;
  double max_rel = 0.0;
  for (int w = 0; w < kWarps; ++w)
    for (int tok = 0; tok < m; ++tok)
      for (int col = 0; col < 16; ++col) {
        const float a = hr[w * 256 + tok * 16 + col], b = hs[w * 256 + tok * 16 + col];
        ++checked;
        if (std::memcmp(&a, &b, 4) != 0) {
          ++differ;
          const double d = std::fabs(static_cast<double>(a) - b) / (std::fabs(static_cast<double>(a)) + 1e-30);
          if (d > max_rel) max_rel = d;
        }
      }
  cudaFree(dX);
  cudaFree(dW);
  cudaFree(dC);
  cudaFree(r);
  cudaFree(s);
  std::printf("{\"K\": %d, \"tokens\": %d, \"operands\": \"%s\", \"start\": %s, \"values\": %zu, \"differ\": %zu, "
              "\"max_rel_diff\": %.3g, \"cuda\": \"%s\"}\n",
              K, m, kind ? "exponents 2^-24..2^24" : "normal", start ? "true" : "false", checked, differ, max_rel,
              cudaGetErrorString(e));
  return e == cudaSuccess && differ == 0;
}

int main() {
  std::mt19937 g(20261205);
  bool ok = true;
  for (int K : {16, 256, 2048, 4096})
    for (int m : {1, 2, 5, 8})
      for (int kind : {0, 1})
        for (bool start : {false, true}) ok &= run_case(g, K, m, kind, start);
  std::printf("{\"all_equal\": %s}\n", ok ? "true" : "false");
  return ok ? 0 : 1;
}
