// baro_jax GPU: helpers for the thin FFI handlers (host code only).
// Shape validation comes from csrc/common/ffi_util.h (shared with the CPU
// handlers, so both platforms check the same contract with the same messages).
#pragma once

#include <string>

#include "ffi_util.h"
#include "portability.h"
#include "xla/ffi/api/ffi.h"

namespace baro_gpu {

namespace ffi = xla::ffi;

inline ffi::Error gpu_error(const char* op, const char* what, gpuError_t e) {
  return ffi::Error::Internal(std::string(op) + ": " + what + " failed: " + gpuGetErrorString(e));
}

// Enqueues operand -> result copy when XLA did not alias them (it does when
// the Python wrapper sets input_output_aliases).
template <class Arg, class Ret>
inline gpuError_t copy_if_not_aliased_async(const Arg& arg, Ret& ret, gpuStream_t s) {
  if (arg.untyped_data() == ret->untyped_data() || arg.size_bytes() == 0) return gpuSuccess;
  return gpuMemcpyAsync(ret->untyped_data(), arg.untyped_data(), arg.size_bytes(),
                        gpuMemcpyDeviceToDevice, s);
}

}  // namespace baro_gpu

#define BARO_GPU_CHECK_LAUNCH(op, expr)                               \
  do {                                                                \
    gpuError_t _baro_e = (expr);                                      \
    if (_baro_e != gpuSuccess) return ::baro_gpu::gpu_error(op, "kernel launch", _baro_e); \
  } while (0)
