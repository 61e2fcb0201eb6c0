// baro_moe (CPU): router softmax, top-k (ties to the lower id), renormalise,
// per (row, slot) SwiGLU expert, combine in slot order, gated shared expert.
// Each (row, slot) pair is computed directly; no grouping by expert is needed
// on CPU, and nothing a row computes depends on the other rows.
#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <string>
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

// Router softmax (fp32) and top-k (descending p, ties to the lower expert id) of one row:
// sel[0..K) the experts in slot order, p[E] the probabilities, *wsum their sum. The one
// routing code of baro_moe, baro_moe_slots and baro_moe_route (the same ids by construction).
inline void route_row(const uint16_t* hr, const uint16_t* rp, int64_t D, int64_t E, int64_t K,
                      float* p, char* taken, int64_t* sel, float* wsum_out) {
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
  std::fill(taken, taken + E, 0);
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
  *wsum_out = wsum;
}

// routed += wk * bf16(y) in the pair's slot turn (baro_moe's combine step; baro_moe_combine runs
// the same one over pairs computed elsewhere). Every expert's output enters the sum rounded to
// bf16, as a bf16 model's experts return it (NUMERICS.md, moe step 3), so a GPU path may store
// the pair rows as bf16 and give the same bits.
inline void accumulate_pair(float wk, const float* y, int64_t D, float* routed) {
  for (int64_t d = 0; d < D; ++d) routed[d] = std::fma(wk, baro::round_bf16(y[d]), routed[d]);
}

// out = routed + sigmoid(shared_gate . h) * bf16(shared_expert(h)): the last step of a row.
inline void finish_row(const uint16_t* hr, const float* routed, const uint16_t* sgup, const uint16_t* sdnp,
                       const uint16_t* sgp, int64_t D, int64_t Is, uint16_t* act, float* shared, float* orow) {
  swiglu(hr, sgup, sdnp, D, Is, act, shared);
  const float sg = baro::sigmoid(baro::dot(hr, sgp, D));
  for (int64_t d = 0; d < D; ++d) orow[d] = routed[d] + sg * baro::round_bf16(shared[d]);
}

// The MoE over m rows. slots == nullptr: expert e's weights are w_gate_up[e] / w_down[e];
// else they are the pool's slot slots[e] (S slots); a routed expert with no slot is an error,
// unless a host store is given (host_gu / host_dn, [E, ...]): then its weights are read there.
ffi::Error moe_rows(const baro::MoeDims& dims, const uint16_t* hp, const uint16_t* rp,
                    const uint16_t* gup, const uint16_t* dnp, const int32_t* slots, int64_t S,
                    const uint16_t* sgup, const uint16_t* sdnp, const uint16_t* sgp, int32_t top_k,
                    float* outp, const uint16_t* host_gu = nullptr, const uint16_t* host_dn = nullptr) {
  const bool host = host_gu != nullptr && host_dn != nullptr;
  const int64_t m = dims.m, D = dims.D, E = dims.E, I = dims.I, Is = dims.Is;
  const int64_t K = top_k;
  std::mutex bad_mu;  // the first (row, expert) routed to an expert with no slot
  int64_t bad_row = -1, bad_expert = -1, bad_slot = 0;
  const double cost = static_cast<double>(E) * D + (K * 3.0 * I + 3.0 * Is) * D;
  baro::parallel_for(m, cost, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(E), y(D), routed(D), shared(D);
    std::vector<uint16_t> act(std::max(I, Is));
    std::vector<int64_t> sel(K);
    std::vector<char> taken(E);
    for (int64_t i = i0; i < i1; ++i) {
      const uint16_t* hr = hp + i * D;
      float wsum;
      route_row(hr, rp, D, E, K, p.data(), taken.data(), sel.data(), &wsum);
      if (slots != nullptr && !host) {  // every routed expert must be resident
        bool ok = true;
        for (int64_t s = 0; s < K && ok; ++s) {
          const int32_t sl = slots[sel[s]];
          if (sl < 0 || sl >= S) {
            ok = false;
            std::lock_guard<std::mutex> lock(bad_mu);
            if (bad_row < 0 || i < bad_row) bad_row = i, bad_expert = sel[s], bad_slot = sl;
          }
        }
        if (!ok) {
          std::fill(outp + i * D, outp + (i + 1) * D, std::numeric_limits<float>::quiet_NaN());
          continue;
        }
      }
      // 3-4. experts in slot order
      std::fill(routed.begin(), routed.end(), 0.0f);
      for (int64_t s = 0; s < K; ++s) {
        const int64_t e = sel[s];
        const int64_t w = slots != nullptr ? slots[e] : e;
        const bool from_host = host && (w < 0 || w >= S);  // not resident: the store's copy
        const uint16_t* gu = from_host ? host_gu + e * 2 * I * D : gup + w * 2 * I * D;
        const uint16_t* dn = from_host ? host_dn + e * D * I : dnp + w * D * I;
        const float wk = p[e] / wsum;
        swiglu(hr, gu, dn, D, I, act.data(), y.data());
        accumulate_pair(wk, y.data(), D, routed.data());
      }
      // 5. shared expert, gated
      finish_row(hr, routed.data(), sgup, sdnp, sgp, D, Is, act.data(), shared.data(), outp + i * D);
    }
  });
  if (bad_row >= 0)
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "baro_moe_slots: row " + std::to_string(bad_row) + " routes to expert " +
                          std::to_string(bad_expert) + ", whose slot is " + std::to_string(bad_slot) +
                          " (not resident: slots must map every routed expert into [0, " +
                          std::to_string(S) + "))");
  return ffi::Error::Success();
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
  return moe_rows(dims, h.typed_data(), router.typed_data(), w_gate_up.typed_data(), w_down.typed_data(),
                  nullptr, 0, shared_gate_up.typed_data(), shared_down.typed_data(),
                  shared_gate.typed_data(), top_k, out->typed_data());
}

// baro_moe_slots: baro_moe with the routed experts in a pool of S slots, addressed
// through slots[E] (expert -> slot, -1 = not resident). Same bytes as baro_moe when every
// routed expert's slot holds that expert's weights.
ffi::Error MoeSlotsImpl(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> router,
                        ffi::Buffer<ffi::BF16> w_gate_up_pool, ffi::Buffer<ffi::BF16> w_down_pool,
                        ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::BF16> shared_gate_up,
                        ffi::Buffer<ffi::BF16> shared_down, ffi::Buffer<ffi::BF16> shared_gate,
                        int32_t top_k, ffi::ResultBuffer<ffi::F32> out) {
  baro::MoeDims dims;
  int64_t S = 0;
  if (auto err = baro::check_moe_slots(h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up,
                                       shared_down, shared_gate, top_k, *out, dims, S);
      err.failure())
    return err;
  return moe_rows(dims, h.typed_data(), router.typed_data(), w_gate_up_pool.typed_data(),
                  w_down_pool.typed_data(), slots.typed_data(), S, shared_gate_up.typed_data(),
                  shared_down.typed_data(), shared_gate.typed_data(), top_k, out->typed_data());
}

// The _small variants (m <= 16, custom_calls/moe.py) carry a scratch result for the GPU
// kernels; the CPU kernels need none and leave it unwritten.
ffi::Error MoeSmallImpl(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> router, ffi::Buffer<ffi::BF16> w_gate_up,
                        ffi::Buffer<ffi::BF16> w_down, ffi::Buffer<ffi::BF16> shared_gate_up,
                        ffi::Buffer<ffi::BF16> shared_down, ffi::Buffer<ffi::BF16> shared_gate, int32_t top_k,
                        ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::U8>) {
  return MoeImpl(h, router, w_gate_up, w_down, shared_gate_up, shared_down, shared_gate, top_k, out);
}
ffi::Error MoeSlotsSmallImpl(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> router,
                             ffi::Buffer<ffi::BF16> w_gate_up_pool, ffi::Buffer<ffi::BF16> w_down_pool,
                             ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::BF16> shared_gate_up,
                             ffi::Buffer<ffi::BF16> shared_down, ffi::Buffer<ffi::BF16> shared_gate, int32_t top_k,
                             ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::U8>) {
  return MoeSlotsImpl(h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down, shared_gate,
                      top_k, out);
}

// baro_moe_host_small: baro_moe_slots whose routed experts with no slot are read from the
// host store at the given addresses (the whole [E, ...] arrays; custom_calls/moe.py takes them
// from live arrays it checked). Same bytes as baro_moe: the same weights in the same order.
ffi::Error MoeHostSmallImpl(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> router,
                            ffi::Buffer<ffi::BF16> w_gate_up_pool, ffi::Buffer<ffi::BF16> w_down_pool,
                            ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::BF16> shared_gate_up,
                            ffi::Buffer<ffi::BF16> shared_down, ffi::Buffer<ffi::BF16> shared_gate, int32_t top_k,
                            int64_t host_gate_up, int64_t host_down, ffi::ResultBuffer<ffi::F32> out,
                            ffi::ResultBuffer<ffi::U8>) {
  baro::MoeDims dims;
  int64_t S = 0;
  if (auto err = baro::check_moe_host(h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down,
                                      shared_gate, top_k, host_gate_up, host_down, *out, dims, S);
      err.failure())
    return err;
  return moe_rows(dims, h.typed_data(), router.typed_data(), w_gate_up_pool.typed_data(),
                  w_down_pool.typed_data(), slots.typed_data(), S, shared_gate_up.typed_data(),
                  shared_down.typed_data(), shared_gate.typed_data(), top_k, out->typed_data(),
                  reinterpret_cast<const uint16_t*>(host_gate_up), reinterpret_cast<const uint16_t*>(host_down));
}

// baro_moe_route: the expert ids [m, top_k] (slot order) baro_moe routes each row to.
ffi::Error MoeRouteImpl(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> router, int32_t top_k,
                        ffi::ResultBuffer<ffi::S32> ids) {
  int64_t m = 0, D = 0, E = 0;
  if (auto err = baro::check_moe_route(h, router, top_k, *ids, m, D, E); err.failure()) return err;
  const uint16_t* hp = h.typed_data();
  const uint16_t* rp = router.typed_data();
  int32_t* op = ids->typed_data();
  const int64_t K = top_k;
  baro::parallel_for(m, static_cast<double>(E) * D, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(E);
    std::vector<char> taken(E);
    std::vector<int64_t> sel(K);
    for (int64_t i = i0; i < i1; ++i) {
      float wsum;
      route_row(hp + i * D, rp, D, E, K, p.data(), taken.data(), sel.data(), &wsum);
      for (int64_t s = 0; s < K; ++s) op[i * K + s] = static_cast<int32_t>(sel[s]);
    }
  });
  return ffi::Error::Success();
}

// baro_moe_pairs: baro_moe's routing and, for the pairs whose expert is in this shard
// (expert_base .. expert_base + El - 1), the expert output y_k (the same swiglu as baro_moe);
// the other pairs' y rows are 0. w = p[e] / wsum and ids as baro_moe computes them.
ffi::Error MoePairsImpl(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::BF16> router,
                        ffi::Buffer<ffi::BF16> w_gate_up, ffi::Buffer<ffi::BF16> w_down,
                        ffi::Buffer<ffi::S32> expert_base, int32_t top_k, ffi::ResultBuffer<ffi::F32> y,
                        ffi::ResultBuffer<ffi::F32> w, ffi::ResultBuffer<ffi::S32> ids) {
  baro::MoePairsDims d;
  if (auto err = baro::check_moe_pairs(h, router, w_gate_up, w_down, expert_base, top_k, *y, *w, *ids, d);
      err.failure())
    return err;
  const int64_t m = d.m, D = d.D, E = d.E, El = d.El, I = d.I, K = top_k;
  const int64_t base = expert_base.typed_data()[0];
  BARO_CHECK(base >= 0 && base <= E - El, "baro_moe_pairs",
             "expert_base must be in [0, E - El] = [0, " << E - El << "] (E=" << E << " experts, El=" << El
                                                      << " in this shard), got " << base);
  const uint16_t* hp = h.typed_data();
  const uint16_t* rp = router.typed_data();
  const uint16_t* gup = w_gate_up.typed_data();
  const uint16_t* dnp = w_down.typed_data();
  float* yp = y->typed_data();
  float* wp = w->typed_data();
  int32_t* ip = ids->typed_data();
  const double cost = static_cast<double>(E) * D + (K * 3.0 * I) * D;
  baro::parallel_for(m, cost, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(E);
    std::vector<uint16_t> act(I);
    std::vector<int64_t> sel(K);
    std::vector<char> taken(E);
    for (int64_t i = i0; i < i1; ++i) {
      const uint16_t* hr = hp + i * D;
      float wsum;
      route_row(hr, rp, D, E, K, p.data(), taken.data(), sel.data(), &wsum);
      for (int64_t s = 0; s < K; ++s) {
        const int64_t e = sel[s];
        wp[i * K + s] = p[e] / wsum;
        ip[i * K + s] = static_cast<int32_t>(e);
        float* yr = yp + (i * K + s) * D;
        const int64_t le = e - base;
        if (le >= 0 && le < El)
          swiglu(hr, gup + le * 2 * I * D, dnp + le * D * I, D, I, act.data(), yr);
        else
          std::fill(yr, yr + D, 0.0f);
      }
    }
  });
  return ffi::Error::Success();
}

// baro_moe_combine: baro_moe's combine over given pairs: routed = sum over slots in order of
// w[i,s] * y[i,s] (fma, from 0), then + sigmoid(shared_gate . h) * shared_expert(h).
ffi::Error MoeCombineImpl(ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::F32> y, ffi::Buffer<ffi::F32> w,
                          ffi::Buffer<ffi::BF16> shared_gate_up, ffi::Buffer<ffi::BF16> shared_down,
                          ffi::Buffer<ffi::BF16> shared_gate, ffi::ResultBuffer<ffi::F32> out) {
  baro::MoeCombineDims d;
  if (auto err = baro::check_moe_combine(h, y, w, shared_gate_up, shared_down, shared_gate, *out, d);
      err.failure())
    return err;
  const int64_t m = d.m, D = d.D, K = d.K, Is = d.Is;
  const uint16_t* hp = h.typed_data();
  const float* yp = y.typed_data();
  const float* wp = w.typed_data();
  float* op = out->typed_data();
  baro::parallel_for(m, (K + 3.0 * Is) * D, [&](int64_t i0, int64_t i1) {
    std::vector<float> routed(D), shared(D);
    std::vector<uint16_t> act(Is);
    for (int64_t i = i0; i < i1; ++i) {
      std::fill(routed.begin(), routed.end(), 0.0f);
      for (int64_t s = 0; s < K; ++s) accumulate_pair(wp[i * K + s], yp + (i * K + s) * D, D, routed.data());
      finish_row(hp + i * D, routed.data(), shared_gate_up.typed_data(), shared_down.typed_data(),
                 shared_gate.typed_data(), D, Is, act.data(), shared.data(), op + i * D);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoePairsCpu, baro::KnobChecked<MoePairsImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // router [E, D]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_gate_up [El, 2I, D]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w_down [El, D, I]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // expert_base [1]
                                  .Attr<int32_t>("top_k")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [m, k, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // w [m, k]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // ids [m, k]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeCombineCpu, baro::KnobChecked<MoeCombineImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::F32>>()   // y [m, k, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w [m, k]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // shared_gate_up
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // shared_down
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // shared_gate
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [m, D]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeCpu, baro::KnobChecked<MoeImpl>::Call, BARO_BIND_MOE_ARGS(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeSlotsCpu, baro::KnobChecked<MoeSlotsImpl>::Call, BARO_BIND_MOE_SLOTS_ARGS(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeSmallCpu, baro::KnobChecked<MoeSmallImpl>::Call,
                              BARO_BIND_SCRATCH(BARO_BIND_MOE_ARGS(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeSlotsSmallCpu, baro::KnobChecked<MoeSlotsSmallImpl>::Call,
                              BARO_BIND_SCRATCH(BARO_BIND_MOE_SLOTS_ARGS(ffi::Ffi::Bind())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeHostSmallCpu, baro::KnobChecked<MoeHostSmallImpl>::Call, BARO_BIND_MOE_HOST_ARGS(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroMoeRouteCpu, baro::KnobChecked<MoeRouteImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // h
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // router
                                  .Attr<int32_t>("top_k")
                                  .Ret<ffi::Buffer<ffi::S32>>()  // ids [m, top_k]
);
