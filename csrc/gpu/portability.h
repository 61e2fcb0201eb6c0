// baro_jax GPU portability layer: one source compiles under nvcc (CUDA) and
// hipcc (ROCm/HIP). Everything platform-specific in csrc/gpu goes through the
// names defined here; kernels never spell cuda* or hip* directly.
//
// Conventions used by every kernel:
// - A "warp" is always 32 lanes (BARO_WARP). On AMD (64-wide wavefronts) a
//   wavefront holds two of these logical warps; shuffles use width 32 so the
//   two halves never mix.
// - bf16 is stored as uint16_t and converted by bit manipulation
//   (csrc/gpu/common.cuh), identical on both platforms.
#pragma once

#include <cstdint>

#if defined(__HIPCC__) || defined(__HIP_PLATFORM_AMD__) || defined(__HIP_PLATFORM_HCC__)
#define BARO_HIP 1
#else
#define BARO_HIP 0
#endif

#if BARO_HIP
#include <hip/hip_runtime.h>

typedef hipStream_t gpuStream_t;
typedef hipError_t gpuError_t;
#define gpuSuccess hipSuccess
#define gpuGetLastError hipGetLastError
#define gpuGetErrorString hipGetErrorString
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemsetAsync hipMemsetAsync
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuMemcpyDefault hipMemcpyDefault
#define gpuErrorInvalidValue hipErrorInvalidValue
#define BARO_PLATFORM_NAME "ROCM"

#else  // CUDA
#include <cuda_runtime.h>

typedef cudaStream_t gpuStream_t;
typedef cudaError_t gpuError_t;
#define gpuSuccess cudaSuccess
#define gpuGetLastError cudaGetLastError
#define gpuGetErrorString cudaGetErrorString
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemsetAsync cudaMemsetAsync
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuMemcpyDefault cudaMemcpyDefault
#define gpuErrorInvalidValue cudaErrorInvalidValue
#define BARO_PLATFORM_NAME "CUDA"

// The tensor-core dot helper (mma.sync ... bf16) needs sm_80 or newer.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 800)
#error "baro_jax CUDA kernels need sm_80 or newer (bf16 mma.sync); set BARO_CUDA_ARCHS"
#endif
#endif

#define BARO_WARP 32
#define BARO_DEV __device__ __forceinline__

namespace baro_gpu {

// Lane within the logical 32-lane warp (blocks are 1-D, multiples of 32).
BARO_DEV int lane_id() { return static_cast<int>(threadIdx.x) & (BARO_WARP - 1); }
BARO_DEV int warp_id() { return static_cast<int>(threadIdx.x) / BARO_WARP; }

BARO_DEV float shfl_xor(float v, int mask) {
#if BARO_HIP
  return __shfl_xor(v, mask, BARO_WARP);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, BARO_WARP);
#endif
}

BARO_DEV int shfl_xor(int v, int mask) {
#if BARO_HIP
  return __shfl_xor(v, mask, BARO_WARP);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask, BARO_WARP);
#endif
}

// Lane src's v, to every lane of the logical warp.
BARO_DEV int shfl_idx(int v, int src) {
#if BARO_HIP
  return __shfl(v, src, BARO_WARP);
#else
  return __shfl_sync(0xffffffffu, v, src, BARO_WARP);
#endif
}

// Programmatic dependent launch (sm_90): a kernel enqueued by launch_dependent (launch.h) may
// be scheduled while the kernel before it on the stream is still draining; grid_dependency_wait
// holds it until that kernel has completed and its memory is visible. The kernels that may be
// launched so call it first, before any memory access, so only the launch latency overlaps and
// the arithmetic is the same as a plain launch's. A plain launch returns from it at once; HIP
// and sm_80 compile it to nothing.
BARO_DEV void grid_dependency_wait() {
#if !BARO_HIP && defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Orders shared-memory accesses among the lanes of one warp. AMD wavefronts
// execute in lockstep, so only CUDA (independent thread scheduling) needs it.
BARO_DEV void warp_sync() {
#if !BARO_HIP
  __syncwarp();
#endif
}

}  // namespace baro_gpu
