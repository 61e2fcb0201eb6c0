// The GPU scratch sizes (csrc/common/scratch_layout.h) as C functions of the CPU library, which
// is always built: custom_calls sizes the _small ops' scratch results with them, and
// baro_jax.budget plans the MoE's allocator scratch, from the definition the GPU handlers use.
#include <cstdint>

#include "scratch_layout.h"

extern "C" {

// baro_moe / baro_moe_slots / baro_moe_host: the bytes of moe.cu's layout for a plan (fold,
// fused, tail, stage as 0/1; see MoePlanFlags). Negative dims give -1.
__attribute__((visibility("default"))) int64_t baro_moe_scratch_bytes(int64_t m, int64_t E, int64_t k, int64_t I,
                                                                      int64_t Is, int64_t D, int fold, int fused,
                                                                      int tail, int stage) {
  if (m < 0 || E < 0 || k < 0 || I < 0 || Is < 0 || D < 0) return -1;
  baro::scratch::MoePlanFlags f;
  f.fold = fold != 0;
  f.fused = fused != 0;
  f.tail = tail != 0;
  f.stage = stage != 0;
  return baro::scratch::moe_layout(m, E, k, I, Is, D, f).total;
}

// baro_attention(_small): the split partials of one call on CUDA (hip = 0) or HIP (hip = 1).
__attribute__((visibility("default"))) int64_t baro_attention_scratch_bytes(int64_t m, int64_t S, int64_t H,
                                                                            int64_t Hkv, int64_t hd, int hip) {
  if (m < 0 || S < 0 || H < 0 || Hkv < 0 || hd < 0) return -1;
  return baro::scratch::attention_bytes(m, S, H, Hkv, hd, hip != 0);
}

}  // extern "C"
