// baro_jax GPU: helpers for the thin FFI handlers (host code only).
// Shape validation comes from csrc/common/ffi_util.h (shared with the CPU
// handlers, so both platforms check the same contract with the same messages).
#pragma once

#include <optional>
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

// Where a handler's device scratch comes from: XLA's scratch allocator (the op then must not
// declare the command-buffer trait), or a result buffer the Python wrapper sized (the _small
// ops, which allocate nothing).
struct ScratchSource {
  ffi::ScratchAllocator* alloc = nullptr;
  ffi::Result<ffi::Buffer<ffi::U8>>* given = nullptr;
};

// *mem = `bytes` of device scratch from src (nullptr when bytes == 0 and nothing was given).
// A given buffer that is too small is an InvalidArgument naming both sizes.
inline ffi::Error take_scratch(const char* op, ScratchSource src, size_t bytes, void** mem) {
  *mem = nullptr;
  if (src.given != nullptr) {
    const size_t have = (*src.given)->element_count();
    if (have < bytes)
      return ffi::Error::InvalidArgument(std::string(op) + ": the scratch result holds " + std::to_string(have) +
                                         " bytes, the call needs " + std::to_string(bytes) +
                                         " (custom_calls sizes it; a stale wrapper?)");
    *mem = (*src.given)->untyped_data();
    return ffi::Error::Success();
  }
  if (bytes == 0) return ffi::Error::Success();
  std::optional<void*> m = src.alloc->Allocate(bytes, 16);  // XLA accepts alignment <= 16
  if (!m.has_value() || *m == nullptr)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(op) + ": could not allocate " + std::to_string(bytes) + " bytes of GPU scratch");
  *mem = *m;
  return ffi::Error::Success();
}

}  // namespace baro_gpu

#define BARO_GPU_CHECK_LAUNCH(op, expr)                               \
  do {                                                                \
    gpuError_t _baro_e = (expr);                                      \
    if (_baro_e != gpuSuccess) return ::baro_gpu::gpu_error(op, "kernel launch", _baro_e); \
  } while (0)
