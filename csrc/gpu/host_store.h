// baro_jax GPU: the host store's addresses as the device sees them (host code), for the calls
// that read experts from pinned host memory: baro_moe_host (moe.cu) and baro_fetch_experts
// (fetch.cu).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "ffi_gpu.h"

namespace ffi = xla::ffi;

// A host-store address the kernels may read: pinned host memory the device maps, or device
// memory (on a 64-bit CUDA host with unified addressing, the same address). Returns the
// device-side address. While the stream is being captured into a graph no query is made (it
// is not a stream operation XLA's capture allows for certain): the address is used as given,
// which unified addressing makes the device's; XLA runs a command buffer's handlers once
// uncaptured first, and the Python side hands over only live pinned-host or device arrays.
inline ffi::Error host_store_pointer(const char* op, const char* name, int64_t addr, gpuStream_t stream,
                                     const uint16_t** out) {
#if BARO_HIP
  (void)out;
  (void)stream;
  return ffi::Error::InvalidArgument(std::string(op) + ": reading experts from the host store is CUDA-only so far");
#else
  // device addresses of the stores checked so far (a store's address is stable while it lives)
  static std::mutex mu;
  static std::unordered_map<int64_t, const uint16_t*> checked;
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cap) != cudaSuccess || cap != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    std::lock_guard<std::mutex> lock(mu);
    const auto it = checked.find(addr);
    *out = it != checked.end() ? it->second : reinterpret_cast<const uint16_t*>(addr);
    return ffi::Error::Success();
  }
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(addr));
  (void)cudaGetLastError();
  BARO_CHECK(e == cudaSuccess && (attr.type == cudaMemoryTypeHost || attr.type == cudaMemoryTypeDevice) &&
                 attr.devicePointer != nullptr, op,
             name << " is not pinned host or device memory the device can read (cudaPointerGetAttributes: "
                  << (e == cudaSuccess ? "type " + std::to_string(static_cast<int>(attr.type)) : cudaGetErrorString(e))
                  << ")");
  *out = static_cast<const uint16_t*>(attr.devicePointer);
  std::lock_guard<std::mutex> lock(mu);
  checked[addr] = *out;
  return ffi::Error::Success();
#endif
}
