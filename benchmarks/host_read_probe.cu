// How fast the GPU reads pinned host memory, by the two ways tier decode can move an expert:
// the copy engines (cudaMemcpyAsync, what the cache path and the prefill's staging use) and
// the SMs' own loads (what baro_moe_host's staging kernel does, csrc/gpu/moe_stage.cuh), from
// host memory allocated two ways: cudaHostAlloc (as PJRT's pinned_host allocator does) and
// 2 MB-aligned memory advised for transparent huge pages, then cudaHostRegister'ed (fewer
// IOMMU translations per byte, where the kernel gives huge pages). One JSON object per line.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/host_read_probe.cu -o /tmp/host_read_probe
//   /tmp/host_read_probe [MiB=1024] [repeats=5]
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#define CHECK(x)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (x);                                                                         \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "host_read_probe: %s failed: %s\n", #x, cudaGetErrorString(e_));       \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

// The staging kernel's loop: VEC 16-byte loads in flight per thread before its stores.
template <int VEC>
__global__ void __launch_bounds__(256) read_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t n) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * 256 * VEC;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * 256 * VEC + threadIdx.x; base < n; base += step) {
    uint4 v[VEC];
#pragma unroll
    for (int u = 0; u < VEC; ++u)
      if (base + u * 256 < n) v[u] = src[base + u * 256];
#pragma unroll
    for (int u = 0; u < VEC; ++u)
      if (base + u * 256 < n) dst[base + u * 256] = v[u];
  }
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// GB/s of fn() moving `bytes`, the median of `repeats` timed runs after one warm run.
template <class F>
static double rate(F fn, size_t bytes, int repeats) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  fn();
  CHECK(cudaDeviceSynchronize());
  std::vector<double> gbs;
  for (int r = 0; r < repeats; ++r) {
    CHECK(cudaEventRecord(a));
    fn();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    gbs.push_back(bytes / (ms * 1e-3) / 1e9);
  }
  CHECK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(gbs);
}

// kB of the mapping at p that the kernel backs with huge pages (/proc/self/smaps), -1 if unknown.
static long huge_kb(const void* p) {
  std::ifstream f("/proc/self/smaps");
  std::string line;
  const auto at = reinterpret_cast<uintptr_t>(p);
  bool in = false;
  while (std::getline(f, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && line.find(':') != std::string::npos &&
        line.find('-') < line.find(' ')) {
      in = at >= lo && at < hi;
      continue;
    }
    long kb = 0;
    if (in && std::sscanf(line.c_str(), "AnonHugePages: %ld kB", &kb) == 1) return kb;
  }
  return -1;
}

static void probe(const char* kind, const uint8_t* host, size_t bytes, uint8_t* dev, int repeats, long huge) {
  const int64_t n = static_cast<int64_t>(bytes / 16);
  const double dma = rate([&] { CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice)); }, bytes, repeats);
  std::printf("{\"memory\": \"%s\", \"huge_pages_kb\": %ld, \"bytes\": %zu, \"way\": \"copy engine\", \"gb_s\": %.2f}\n",
              kind, huge, bytes, dma);
  const uint4* src = nullptr;
  CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(const_cast<uint4**>(&src)), const_cast<uint8_t*>(host), 0));
  for (int grid : {132, 264, 528, 1056, 2112}) {
    const double k8 = rate([&] { read_kernel<8><<<grid, 256>>>(src, reinterpret_cast<uint4*>(dev), n); }, bytes, repeats);
    const double k2 = rate([&] { read_kernel<2><<<grid, 256>>>(src, reinterpret_cast<uint4*>(dev), n); }, bytes, repeats);
    std::printf("{\"memory\": \"%s\", \"huge_pages_kb\": %ld, \"bytes\": %zu, \"way\": \"kernel loads\", \"blocks\": %d, "
                "\"threads\": 256, \"gb_s_8_loads\": %.2f, \"gb_s_2_loads\": %.2f}\n",
                kind, huge, bytes, grid, k8, k2);
  }
  std::fflush(stdout);
}

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 5;
  if (mib < 2 || repeats < 1) {
    std::fprintf(stderr, "usage: host_read_probe [MiB >= 2] [repeats >= 1]\n");
    return 2;
  }
  const size_t bytes = mib << 20;
  int d = 0;
  cudaDeviceProp prop{};
  CHECK(cudaGetDevice(&d));
  CHECK(cudaGetDeviceProperties(&prop, d));
  std::printf("{\"device\": \"%s\", \"sms\": %d, \"pci_bus\": %d, \"mib\": %zu, \"repeats\": %d}\n", prop.name,
              prop.multiProcessorCount, prop.pciBusID, mib, repeats);
  uint8_t* dev = nullptr;
  CHECK(cudaMalloc(&dev, bytes));

  uint8_t* pinned = nullptr;
  CHECK(cudaHostAlloc(reinterpret_cast<void**>(&pinned), bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(pinned, 1, bytes);
  probe("cudaHostAlloc", pinned, bytes, dev, repeats, huge_kb(pinned));
  CHECK(cudaFreeHost(pinned));

  void* thp = nullptr;
  if (posix_memalign(&thp, size_t{2} << 20, bytes) != 0) {
    std::fprintf(stderr, "host_read_probe: posix_memalign failed\n");
    return 1;
  }
  const int adv = madvise(thp, bytes, MADV_HUGEPAGE);
  std::memset(thp, 1, bytes);  // touch after the advice, so the pages are huge where they can be
  CHECK(cudaHostRegister(thp, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable));
  probe(adv == 0 ? "registered, MADV_HUGEPAGE" : "registered (madvise refused)", static_cast<uint8_t*>(thp), bytes,
        dev, repeats, huge_kb(thp));
  CHECK(cudaHostUnregister(thp));
  std::free(thp);
  CHECK(cudaFree(dev));
  return 0;
}
