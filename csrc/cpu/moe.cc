// baro_moe (CPU): router softmax, top-k (ties to the lower id), renormalise,
// per (row, slot) SwiGLU expert, combine in slot order, gated shared expert.
// Each (row, slot) pair is computed directly; no grouping by expert is needed
// on CPU, and nothing a row computes depends on the other rows.
#include <limits>
#include <vector>

#include "contract.h"
#include "dot.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

// y[D] = down[D, I] . bf16(silu(gate_up[0:I] . h) * (gate_up[I:2I] . h))
inline void swiglu(const uint16_t* h, const uint16_t* gate_up, const uint16_t* down,
                   int64_t D, int64_t I, uint16_t* act, float* y) {
  std::vector<float> gu(2 * I);
  baro::dot_rows(h, gate_up, D, 2 * I, D, gu.data());
  for (int64_t n = 0; n < I; ++n) act[n] = baro::f32_to_bf16(baro::silu(gu[n]) * gu[I + n]);
  baro::dot_rows(act, down, I, D, I, y);
}

ffi::Error MoeImpl(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> router,
                   ffi::Buffer<ffi::BF16> w_gate_up, ffi::Buffer<ffi::BF16> w_down,
                   ffi::Buffer<ffi::BF16> shared_gate_up,
                   ffi::Buffer<ffi::BF16> shared_down,
                   ffi::Buffer<ffi::BF16> shared_gate, int32_t top_k,
                   ffi::ResultBuffer<ffi::F32> out) {
  baro::MoeDims dims;
  if (auto err = baro::check_moe(h, router, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate,
                                 top_k, *out, dims);
      err.failure())
    return err;
  const int64_t m = dims.m, D = dims.D, E = dims.E, I = dims.I, Is = dims.Is;

  const uint16_t* hp = h.typed_data();
  const uint16_t* rp = router.typed_data();
  const uint16_t* gup = w_gate_up.typed_data();
  const uint16_t* dnp = w_down.typed_data();
  const uint16_t* sgup = shared_gate_up.typed_data();
  const uint16_t* sdnp = shared_down.typed_data();
  const uint16_t* sgp = shared_gate.typed_data();
  float* outp = out->typed_data();
  const int64_t K = top_k;

  const double cost = static_cast<double>(E) * D + (K * 3.0 * I + 3.0 * Is) * D;
  baro::parallel_for(m, cost, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(E), y(D), routed(D), shared(D);
    std::vector<uint16_t> act(std::max(I, Is));
    std::vector<int64_t> sel(K);
    std::vector<char> taken(E);
    for (int64_t i = i0; i < i1; ++i) {
      const uint16_t* hr = hp + i * D;
      // 1. router softmax (fp32)
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < E; ++e) {
        p[e] = baro::dot(hr, rp + e * D, D);
        mx = std::fmax(mx, p[e]);
      }
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        p[e] = std::exp(p[e] - mx);
        sum = sum + p[e];
      }
      for (int64_t e = 0; e < E; ++e) p[e] = p[e] / sum;
      // 2. top-k, descending p, ties to the lower expert id
      std::fill(taken.begin(), taken.end(), 0);
      float wsum = 0.0f;
      for (int64_t s = 0; s < K; ++s) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
          if (taken[e]) continue;
          if (best < 0 || p[e] > p[best]) best = e;
        }
        taken[best] = 1;
        sel[s] = best;
        wsum = wsum + p[best];
      }
      // 3-4. experts in slot order
      std::fill(routed.begin(), routed.end(), 0.0f);
      for (int64_t s = 0; s < K; ++s) {
        const int64_t e = sel[s];
        const float wk = p[e] / wsum;
        swiglu(hr, gup + e * 2 * I * D, dnp + e * D * I, D, I, act.data(), y.data());
        for (int64_t d = 0; d < D; ++d) routed[d] = std::fma(wk, y[d], routed[d]);
      }
      // 5. shared expert, gated
      swiglu(hr, sgup, sdnp, D, Is, act.data(), shared.data());
      const float sg = baro::sigmoid(baro::dot(hr, sgp, D));
      float* orow = outp + i * D;
      for (int64_t d = 0; d < D; ++d) orow[d] = routed[d] + sg * shared[d];
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeCpu, MoeImpl,
                              ffi::Ffi::Bind()
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
