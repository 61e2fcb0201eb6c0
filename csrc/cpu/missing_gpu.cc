// Stub handlers registered for "CUDA" / "ROCM" when libbaro_cuda.so /
// libbaro_hip.so was not built: they accept any call and fail with a message
// that says how to build the GPU library.
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error MissingCuda(ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "baro_jax: a baro custom call ran on a CUDA GPU, but the CUDA "
                    "library libbaro_cuda.so was not built. Rebuild with nvcc on PATH: "
                    "BARO_GPU=cuda pip install --no-build-isolation --no-deps -e . "
                    "(see BUILD.md).");
}

ffi::Error MissingHip(ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    "baro_jax: a baro custom call ran on a ROCm GPU, but the HIP "
                    "library libbaro_hip.so was not built. Rebuild with hipcc on PATH: "
                    "BARO_GPU=hip pip install --no-build-isolation --no-deps -e . "
                    "(see BUILD.md).");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMissingCuda, MissingCuda,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMissingHip, MissingHip,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
