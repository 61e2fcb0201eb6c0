// Host helpers of the standalone probes (wgmma_probe.cu, wgmma_attention_check.cu,
// mma_swap_probe.cu, mma_latency_probe.cu): bf16 rounding, random operands, a device copy that
// stops on failure.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

static uint16_t to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static std::vector<uint16_t> rand_bf16(std::mt19937& g, size_t n, float scale) {
  std::normal_distribution<float> N(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = to_bf16(N(g));
  return v;
}
template <typename T>
static T* dev(const std::vector<T>& h) {
  T* p = nullptr;
  cudaError_t e = cudaMalloc(&p, h.size() * sizeof(T));
  if (e == cudaSuccess) e = cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    std::fprintf(stderr, "device copy of %zu bytes: %s\n", h.size() * sizeof(T), cudaGetErrorString(e));
    std::exit(2);
  }
  return p;
}
