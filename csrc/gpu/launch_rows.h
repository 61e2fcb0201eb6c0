// baro_jax GPU: framework-free host launchers of the many-sequence ops (pointers, sizes, a
// stream), as launch.h for the one-sequence ones. Only enqueue work; device scalars and the
// per-row slot / position arrays are read by the kernels.
#pragma once

#include <cstddef>
#include <cstdint>

#include "launch.h"
#include "portability.h"

namespace baro_gpu {

// ---- baro_attention_rows (attention_rows.cu) ----
// a holds the call's m rows (qkv, cos, sin, out as baro_attention's), a.k_cache / a.v_cache the
// KV pages [NP][page][Hkv][hd], a.S = T * page the positions a slot's table row maps, a.pos the
// rows' positions [m]; a.n_valid is not read (each row's view sets it).
// Slot s's position j lives in page table[s * T + j / page] (-1: none; reads as zeros), row
// j % page. Row r: slot[r] in [0, P), pos[r] in [0, S) and its position's page mapped is attended
// as baro_attention's one-row call on the contiguous cache the slot's pages stand for;
// slot[r] == -1 writes nothing and gives o[r] = 0; any other row writes nothing and gives
// o[r] = NaN (never read or written outside the pages).
struct AttentionRowsArgs {
  AttentionArgs a;
  const int32_t* slot;   // [m] device
  const int32_t* table;  // [P, T] device
  int64_t P, T, NP;
  int page;              // a multiple of 64 (the KV block)
};
// Rows up to which each row's KV splits run in parallel blocks with the partials in the scratch
// (then the in-order merge); more rows walk their splits inside one block (the same merge
// arithmetic, no scratch). custom_calls/attention_rows.py PARALLEL_ROWS.
constexpr int64_t kRowsParallelMax = 16;
// The scratch a call needs: m x (one row's split partials, those of baro_attention's one-row
// call, rounded to 256 bytes) when m <= kRowsParallelMax, else 0.
size_t attention_rows_scratch_bytes(const AttentionRowsArgs& r);
// "" when the kernels can run the call, else why not (baro_attention's limits, the grid's).
const char* attention_rows_unsupported(const AttentionRowsArgs& r);
gpuError_t launch_attention_rows(const AttentionRowsArgs& r, void* scratch, gpuStream_t stream);

// ---- baro_log_softmax (log_softmax.cu) ----
gpuError_t launch_log_softmax(const float* x, float* y, int64_t m, int64_t V, gpuStream_t stream);

// ---- baro_topk_rows (topk_rows.cu) ----
// vals / ids [m, k]: each row's k (<= 256) largest of x [m, V], largest first (contract_rows.h).
gpuError_t launch_topk_rows(const float* x, float* vals, int32_t* ids, int64_t m, int64_t V, int k,
                            gpuStream_t stream);

}  // namespace baro_gpu
