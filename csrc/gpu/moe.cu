// baro_moe (GPU): router matmul, softmax + top-k (ties to the lower id) +
// renormalisation per row, (row, slot) pairs grouped by expert on the device
// (deterministic counting sort), grouped gate/up GEMM -> bf16(silu(g)*u) ->
// grouped down GEMM (one fp32 row per pair), combine per row in slot order,
// shared expert times sigmoid(shared gate).
//
// Row independence: every GEMM goes through gemm.cuh (an output row depends
// only on its own A row and the weights, whatever tile it shares), the
// softmax/top-k of a row is done by one warp with fixed code, the combine of
// a row reads only its own pairs. So a row's output bits do not depend on
// which other rows are in the call (decode m = 1 vs prefill m = C).
//
// Weights are read once per (expert tile, N tile): an expert used by r pairs
// of the call is read ceil(r / BM) times, not once per token.
#include <cstdint>
#include <optional>
#include <string>

#include "contract.h"
#include "common.cuh"
#include "ffi_gpu.h"
#include "gemm.cuh"
#include "launch.h"

namespace baro_gpu {

constexpr int kTopkWarps = 4;          // rows per block in moe_topk_kernel
constexpr int kSortThreads = 1024;     // moe_sort_kernel is a single block
constexpr int kSortChunk = 2048;       // expert ids staged in shared memory per pass
constexpr int kSortMaxE = kMoeMaxExperts;  // counts live in shared memory
constexpr int kElemThreads = 256;
constexpr int kMinGroupBM = 16;        // smallest GEMM BM: sizes the tile list

// probs[m][E] holds the logits on entry and the softmax probabilities after.
__global__ void __launch_bounds__(kTopkWarps * BARO_WARP)
    moe_topk_kernel(float* __restrict__ probs, int32_t* __restrict__ ids, float* __restrict__ wts,
                    int64_t m, int E, int k) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kTopkWarps + warp_id();
  if (row >= m) return;
  const int lane = lane_id();
  float* p = probs + row * E;  // lane l only ever touches p[l + 32q]
  float mx = -INFINITY;
  for (int e = lane; e < E; e += BARO_WARP) mx = fmaxf(mx, p[e]);
  mx = warp_max(mx);
  float sum = 0.0f;
  for (int e = lane; e < E; e += BARO_WARP) {
    const float ex = expf(p[e] - mx);
    p[e] = ex;
    sum = sum + ex;
  }
  sum = warp_sum(sum);
  for (int e = lane; e < E; e += BARO_WARP) p[e] = p[e] / sum;

  // top-k: descending p, ties to the lower id; taken entries become -2.
  float wsum = 0.0f;
  for (int s = 0; s < k; ++s) {
    float bp = -1.0f;
    int be = 0x7fffffff;
    for (int e = lane; e < E; e += BARO_WARP) {
      const float v = p[e];
      if (v > bp) {  // strict: the first (lowest) id of this lane wins ties
        bp = v;
        be = e;
      }
    }
#pragma unroll
    for (int o = BARO_WARP / 2; o >= 1; o >>= 1) {
      const float op = shfl_xor(bp, o);
      const int oe = shfl_xor(be, o);
      if (op > bp || (op == bp && oe < be)) {
        bp = op;
        be = oe;
      }
    }
    if (be < 0 || be >= E) {  // only with NaN probabilities: stay in bounds
      be = 0;
      bp = 0.0f;
    }
    if ((be & (BARO_WARP - 1)) == lane) p[be] = -2.0f;
    if (lane == 0) {
      ids[row * k + s] = be;
      wts[row * k + s] = bp;
    }
    wsum = wsum + bp;
  }
  if (lane == 0)
    for (int s = 0; s < k; ++s) wts[row * k + s] = wts[row * k + s] / wsum;
}

// Single block. Pairs p = row*k + slot, expert ids[p]. Output, stable by p
// within each expert: srow[pos] = row of the pair at sorted position pos,
// inv[p] = its sorted position; tiles[t] = (expert, start, count <= bm) in
// expert order; *n_tiles. Counts and offsets live in shared memory
// (E <= kSortMaxE, host-checked).
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_kernel(const int32_t* __restrict__ ids, int64_t P, int k, int E, int bm,
                    int32_t* __restrict__ srow, int32_t* __restrict__ inv,
                    int32_t* __restrict__ tiles, int32_t* __restrict__ n_tiles,
                    int64_t max_tiles) {
  __shared__ int32_t sid[kSortChunk];
  __shared__ int32_t cnt[kSortMaxE];
  const int tid = threadIdx.x;
  for (int e = tid; e < E; e += kSortThreads) cnt[e] = 0;
  __syncthreads();
  // pass 1: counts per expert (each expert owned by one thread)
  for (int64_t base = 0; base < P; base += kSortChunk) {
    const int n = static_cast<int>(P - base < kSortChunk ? P - base : kSortChunk);
    for (int q = tid; q < n; q += kSortThreads) sid[q] = ids[base + q];
    __syncthreads();
    for (int e = tid; e < E; e += kSortThreads) {
      int c = 0;
      for (int q = 0; q < n; ++q) c += (sid[q] == e) ? 1 : 0;
      cnt[e] += c;
    }
    __syncthreads();
  }
  // exclusive scan + tile list (serial, expert order); cnt becomes the offset
  if (tid == 0) {
    int64_t off = 0, nt = 0;
    for (int e = 0; e < E; ++e) {
      const int32_t c = cnt[e];
      cnt[e] = static_cast<int32_t>(off);
      for (int32_t st = 0; st < c; st += bm) {
        if (nt < max_tiles) {
          tiles[3 * nt + 0] = e;
          tiles[3 * nt + 1] = static_cast<int32_t>(off + st);
          tiles[3 * nt + 2] = c - st < bm ? c - st : bm;
        }
        ++nt;
      }
      off += c;
    }
    *n_tiles = static_cast<int32_t>(nt < max_tiles ? nt : max_tiles);
  }
  __syncthreads();
  // pass 2: placement, ascending p within each expert
  for (int64_t base = 0; base < P; base += kSortChunk) {
    const int n = static_cast<int>(P - base < kSortChunk ? P - base : kSortChunk);
    for (int q = tid; q < n; q += kSortThreads) sid[q] = ids[base + q];
    __syncthreads();
    for (int e = tid; e < E; e += kSortThreads) {
      int32_t pos = cnt[e];
      for (int q = 0; q < n; ++q) {
        if (sid[q] == e) {
          const int64_t pair = base + q;
          srow[pos] = static_cast<int32_t>(pair / k);
          inv[pair] = pos;
          ++pos;
        }
      }
      cnt[e] = pos;
    }
    __syncthreads();
  }
}

// act[s][n] = bf16(silu(gu[s][n]) * gu[s][I + n])
__global__ void __launch_bounds__(kElemThreads)
    swiglu_kernel(const float* __restrict__ gu, uint16_t* __restrict__ act, int64_t rows,
                  int64_t I) {
  const int64_t total = rows * I;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kElemThreads) {
    const int64_t s = idx / I, n = idx % I;
    const float g = gu[s * 2 * I + n];
    const float u = gu[s * 2 * I + I + n];
    act[idx] = f32_to_bf16(siluf_(g) * u);
  }
}

// out[i][d] = routed + sigmoid(sgl[i]) * sout[i][d],
// routed = fma over slots in order of w[i,s] * ys[inv[i*k+s]][d], from 0.
__global__ void __launch_bounds__(kElemThreads)
    moe_combine_kernel(const float* __restrict__ ys, const int32_t* __restrict__ inv,
                       const float* __restrict__ wts, const float* __restrict__ sout,
                       const float* __restrict__ sgl, float* __restrict__ out, int64_t m,
                       int64_t D, int k) {
  const int64_t total = m * D;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kElemThreads + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * kElemThreads) {
    const int64_t i = idx / D, d = idx % D;
    float routed = 0.0f;
    for (int s = 0; s < k; ++s) {
      const int64_t pair = i * k + s;
      routed = fmaf(wts[pair], ys[static_cast<int64_t>(inv[pair]) * D + d], routed);
    }
    const float sg = sigmoidf_(sgl[i]);
    out[idx] = routed + sg * sout[idx];
  }
}

// ---- scratch layout ----
struct MoeScratch {
  float* logits;     // [m, E]
  int32_t* ids;      // [P]
  float* wts;        // [P]
  int32_t* srow;     // [P]
  int32_t* inv;      // [P]
  int32_t* tiles;    // [max_tiles, 3]
  int32_t* n_tiles;  // [1]
  float* gu;         // [P, 2I]
  uint16_t* act;     // [P, I]
  float* ys;         // [P, D]
  float* sgu;        // [m, 2Is]
  uint16_t* sact;    // [m, Is]
  float* sout;       // [m, D]
  float* sgl;        // [m]
};

static int64_t moe_max_tiles(const MoeArgs& a) {
  const int64_t P = a.m * a.top_k;
  return P / kMinGroupBM + (a.E < P ? a.E : P) + 1;
}

// Computes the layout; fills *s when base != nullptr. Returns total bytes.
static size_t moe_layout(const MoeArgs& a, char* base, MoeScratch* s) {
  const int64_t m = a.m, P = a.m * a.top_k;
  size_t off = 0;
  auto take = [&](size_t bytes) -> char* {
    char* p = base ? base + off : nullptr;
    off += (bytes + 255) & ~static_cast<size_t>(255);
    return p;
  };
  MoeScratch t;
  t.logits = reinterpret_cast<float*>(take(sizeof(float) * m * a.E));
  t.ids = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * P));
  t.wts = reinterpret_cast<float*>(take(sizeof(float) * P));
  t.srow = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * P));
  t.inv = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * P));
  t.tiles = reinterpret_cast<int32_t*>(take(sizeof(int32_t) * 3 * moe_max_tiles(a)));
  t.n_tiles = reinterpret_cast<int32_t*>(take(sizeof(int32_t)));
  t.gu = reinterpret_cast<float*>(take(sizeof(float) * P * 2 * a.I));
  t.act = reinterpret_cast<uint16_t*>(take(sizeof(uint16_t) * P * a.I));
  t.ys = reinterpret_cast<float*>(take(sizeof(float) * P * a.D));
  t.sgu = reinterpret_cast<float*>(take(sizeof(float) * m * 2 * a.Is));
  t.sact = reinterpret_cast<uint16_t*>(take(sizeof(uint16_t) * m * a.Is));
  t.sout = reinterpret_cast<float*>(take(sizeof(float) * m * a.D));
  t.sgl = reinterpret_cast<float*>(take(sizeof(float) * m));
  if (s) *s = t;
  return off;
}

size_t moe_scratch_bytes(const MoeArgs& a) {
  if (a.m <= 0) return 0;
  return moe_layout(a, nullptr, nullptr);
}

static unsigned elem_blocks(int64_t total) {
  int64_t b = (total + kElemThreads - 1) / kElemThreads;
  if (b > 65535 * 16) b = 65535 * 16;  // grid-stride loops cover the rest
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

#define BARO_MOE_TRY(expr)           \
  do {                               \
    gpuError_t _e = (expr);          \
    if (_e != gpuSuccess) return _e; \
  } while (0)

gpuError_t launch_moe(const MoeArgs& a, void* scratch, gpuStream_t stream) {
  (void)gpuGetLastError();
  if (a.m <= 0) return gpuSuccess;
  if (a.top_k < 1 || a.top_k > a.E || a.E > kSortMaxE || scratch == nullptr)
    return gpuErrorInvalidValue;
  const int64_t m = a.m, P = a.m * a.top_k, D = a.D, E = a.E, I = a.I, Is = a.Is;
  MoeScratch s;
  moe_layout(a, static_cast<char*>(scratch), &s);

  // 1. router logits [m, E]
  BARO_MOE_TRY(launch_matmul(a.h, a.router, s.logits, m, E, D, stream));
  // 2. softmax + top-k per row
  moe_topk_kernel<<<static_cast<unsigned>((m + kTopkWarps - 1) / kTopkWarps),
                    kTopkWarps * BARO_WARP, 0, stream>>>(s.logits, s.ids, s.wts, m,
                                                         static_cast<int>(E), a.top_k);
  BARO_MOE_TRY(gpuGetLastError());
  // 3. group pairs by expert
  const GemmConfig gcfg = (P >= 32 * E) ? GemmConfig::kLarge : GemmConfig::kSmall;
  const int bm = gemm_bm(gcfg);
  const int64_t max_tiles = moe_max_tiles(a);
  moe_sort_kernel<<<1, kSortThreads, 0, stream>>>(s.ids, P, a.top_k, static_cast<int>(E), bm,
                                                   s.srow, s.inv, s.tiles, s.n_tiles, max_tiles);
  BARO_MOE_TRY(gpuGetLastError());
  // 4. grouped gate/up: gu[pos] = h[srow[pos]] . w_gate_up[e]^T   [P, 2I]
  {
    GemmParams p;
    p.A = a.h;
    p.lda = D;
    p.a_rows = s.srow;
    p.W = a.w_gate_up;
    p.ldw = D;
    p.w_group_stride = 2 * I * D;
    p.N = 2 * I;
    p.K = D;
    p.C = s.gu;
    p.ldc = 2 * I;
    p.tiles = s.tiles;
    p.n_tiles = s.n_tiles;
    BARO_MOE_TRY(launch_gemm(p, gcfg, max_tiles, stream));
  }
  swiglu_kernel<<<elem_blocks(P * I), kElemThreads, 0, stream>>>(s.gu, s.act, P, I);
  BARO_MOE_TRY(gpuGetLastError());
  // 5. grouped down: ys[pos] = act[pos] . w_down[e]^T   [P, D]
  {
    GemmParams p;
    p.A = s.act;
    p.lda = I;
    p.a_rows = nullptr;
    p.W = a.w_down;
    p.ldw = I;
    p.w_group_stride = D * I;
    p.N = D;
    p.K = I;
    p.C = s.ys;
    p.ldc = D;
    p.tiles = s.tiles;
    p.n_tiles = s.n_tiles;
    BARO_MOE_TRY(launch_gemm(p, gcfg, max_tiles, stream));
  }
  // 6. shared expert and its gate
  BARO_MOE_TRY(launch_matmul(a.h, a.s_gate_up, s.sgu, m, 2 * Is, D, stream));
  swiglu_kernel<<<elem_blocks(m * Is), kElemThreads, 0, stream>>>(s.sgu, s.sact, m, Is);
  BARO_MOE_TRY(gpuGetLastError());
  BARO_MOE_TRY(launch_matmul(s.sact, a.s_down, s.sout, m, D, Is, stream));
  BARO_MOE_TRY(launch_matmul(a.h, a.s_gate, s.sgl, m, 1, D, stream));
  // 7. combine
  moe_combine_kernel<<<elem_blocks(m * D), kElemThreads, 0, stream>>>(
      s.ys, s.inv, s.wts, s.sout, s.sgl, a.out, m, D, a.top_k);
  return gpuGetLastError();
}

}  // namespace baro_gpu

// ---------------------------------------------------------------------------
// FFI handler (same operands/attrs/results as BaroMoeCpu, see BUILD.md).
// Uses the XLA scratch allocator, so it is not command-buffer compatible.
// ---------------------------------------------------------------------------
namespace {

namespace ffi = xla::ffi;

ffi::Error MoeGpuImpl(gpuStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::BF16> h,
                      ffi::Buffer<ffi::BF16> router, ffi::Buffer<ffi::BF16> w_gate_up,
                      ffi::Buffer<ffi::BF16> w_down, ffi::Buffer<ffi::BF16> shared_gate_up,
                      ffi::Buffer<ffi::BF16> shared_down, ffi::Buffer<ffi::BF16> shared_gate,
                      int32_t top_k, ffi::ResultBuffer<ffi::F32> out) {
  const char* op = "baro_moe";
  baro::MoeDims dims;
  if (auto err = baro::check_moe(h, router, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate,
                                 top_k, *out, dims);
      err.failure())
    return err;
  const int64_t m = dims.m, D = dims.D, E = dims.E, I = dims.I, Is = dims.Is;
  BARO_CHECK(E <= baro_gpu::kMoeMaxExperts, op,
             "the GPU kernel supports at most " << baro_gpu::kMoeMaxExperts << " experts, got E=" << E);
  BARO_CHECK(m * top_k < (int64_t{1} << 31) - 1 && E < (int64_t{1} << 31), op,
             "m * top_k = " << m * top_k << " (row, slot) pairs is too many for one GPU call");
  if (m == 0) return ffi::Error::Success();

  baro_gpu::MoeArgs a;
  a.h = h.typed_data();
  a.router = router.typed_data();
  a.w_gate_up = w_gate_up.typed_data();
  a.w_down = w_down.typed_data();
  a.s_gate_up = shared_gate_up.typed_data();
  a.s_down = shared_down.typed_data();
  a.s_gate = shared_gate.typed_data();
  a.out = out->typed_data();
  a.m = m;
  a.D = D;
  a.E = E;
  a.I = I;
  a.Is = Is;
  a.top_k = top_k;
  const size_t bytes = baro_gpu::moe_scratch_bytes(a);
  std::optional<void*> mem = scratch.Allocate(bytes, 16);  // XLA accepts alignment <= 16
  if (!mem.has_value() || *mem == nullptr)
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      std::string(op) + ": could not allocate " + std::to_string(bytes) +
                          " bytes of GPU scratch");
  BARO_GPU_CHECK_LAUNCH(op, baro_gpu::launch_moe(a, *mem, stream));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeGpu, MoeGpuImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<gpuStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // router
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_gate_up
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_down
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // shared_gate_up
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // shared_down
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // shared_gate
                                  .Attr<int32_t>("top_k")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
);
