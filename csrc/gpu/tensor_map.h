// baro_jax GPU (CUDA, sm_90): TMA, shared by the wgmma kernels (sm_90a) and gemm_row1's TMA
// instance (sm_90): the driver's tensor-map encoder and the 2-D box copy into shared memory.
#pragma once

#include <cuda.h>  // CUtensorMap (the encoder is looked up through the runtime: no libcuda link)
#include <cudaTypedefs.h>

#include <cstdint>

#include "portability.h"

namespace baro_gpu {

// One 2-D box at (column x, row y) of the tensor map into shared memory dst, completion counted on
// bar. Elements outside the tensor come back as zeros (CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE).
BARO_DEV void tma_box(uint32_t dst, const CUtensorMap* map, int x, int y, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
      : "memory");
}

// The driver's tensor-map encoder, looked up once (per translation unit) through the runtime;
// null where it is absent.
static inline PFN_cuTensorMapEncodeTiled_v12000 tma_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &p, cudaEnableDefault, &q);
#endif
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) {
      (void)cudaGetLastError();
      p = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace baro_gpu
