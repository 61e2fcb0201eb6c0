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

// Registered for "CUDA" / "ROCM" for the targets that have a CPU kernel only (custom_calls/_lib.py,
// CPU_ONLY) when the GPU library is present but does not export them.
ffi::Error DeltaBlockedNoGpu(ffi::RemainingArgs, ffi::RemainingRets) {
  return ffi::Error(ffi::ErrorCode::kUnimplemented,
                    "baro_jax: baro_delta_blocked (the chunk-aligned delta rule, DESIGN §9; "
                    "BARO_DELTA=blocked / --delta-rule blocked) has no GPU kernel yet: it runs on "
                    "CPU only. Use the default per-token rule (BARO_DELTA=token) on a GPU.");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMissingCuda, MissingCuda,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMissingHip, MissingHip,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroDeltaBlockedNoGpu, DeltaBlockedNoGpu,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
