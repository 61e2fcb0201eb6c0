// baro_conv (and baro_conv_proj), baro_delta, baro_delta_blocked (CPU): Gated DeltaNet causal conv
// (window 4, SiLU), the gated delta-rule recurrence with fp32 state, and the
// chunk-aligned (blocked) form of the same rule (docs/DESIGN.md §9, docs/NUMERICS.md).
#include <vector>

#include "dot.h"
#include "contract.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kConvK = 4;  // kernel width; the window holds kConvK-1 rows

// The conv over m tokens of P rows of C channels (P > 1 in rows mode only, where m = 1), whose
// input x(t, c) (bf16 bits) is token t, channel c < P*C; channel p*C + c takes w's row c. Shared by
// baro_conv (x bf16 [m, C]) and baro_conv_proj (x the f32 projection [m, W], or [P, W] in rows
// mode, rounded here).
template <class X>
ffi::Error conv_rows(const char* op, X x_at, int64_t m, int64_t Cw, int64_t P, ffi::Buffer<ffi::BF16> w,
                     ffi::Buffer<ffi::BF16> window, ffi::Buffer<ffi::S32> n_valid_buf,
                     ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::BF16> window_out) {
  if (auto err = baro::check_conv_rest(op, m, Cw, P, w, window, n_valid_buf, *y, *window_out); err.failure())
    return err;
  const int64_t C = P * Cw;
  const int64_t n_valid = n_valid_buf.typed_data()[0];
  BARO_CHECK(n_valid >= 0 && n_valid <= m, op,
             "n_valid must be in [0, m=" << m << "], got " << n_valid);

  baro::copy_if_not_aliased(window, window_out);
  uint16_t* win = window_out->typed_data();
  const uint16_t* wp = w.typed_data();
  float* yp = y->typed_data();

  // u[t] for t in [-3, m): window rows then x rows.
  auto u = [&](int64_t t, int64_t c) -> uint16_t {
    return t < 0 ? win[(t + kConvK - 1) * C + c] : x_at(t, c);
  };
  baro::parallel_for(C, 8.0 * m, [&](int64_t c0, int64_t c1) {
    uint16_t tap[kConvK];
    for (int64_t c = c0; c < c1; ++c) {
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t j = 0; j < kConvK; ++j) tap[j] = u(t - (kConvK - 1) + j, c);
        yp[t * C + c] = baro::silu(baro::dot(wp + c % Cw * kConvK, tap, kConvK));
      }
    }
  });
  // New window: last 3 rows of [window; x[:n_valid]] (computed before writing).
  std::vector<uint16_t> nw((kConvK - 1) * C);
  for (int64_t r = 0; r < kConvK - 1; ++r) {
    const int64_t t = n_valid - (kConvK - 1) + r;
    for (int64_t c = 0; c < C; ++c) nw[r * C + c] = u(t, c);
  }
  std::copy(nw.begin(), nw.end(), win);
  return ffi::Error::Success();
}

ffi::Error ConvImpl(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                    ffi::Buffer<ffi::BF16> window, ffi::Buffer<ffi::S32> n_valid_buf, int64_t rows,
                    ffi::ResultBuffer<ffi::F32> y,
                    ffi::ResultBuffer<ffi::BF16> window_out) {
  const char* op = "baro_conv";
  BARO_RETURN_IF(baro::expect_no_rows_mode(op, rows));
  BARO_RETURN_IF(baro::expect_rank(op, "x", x, 2));
  const int64_t m = x.dimensions()[0], C = x.dimensions()[1];
  const uint16_t* xp = x.typed_data();
  return conv_rows(op, [&](int64_t t, int64_t c) { return xp[t * C + c]; }, m, C, 1, w, window, n_valid_buf, y,
                   window_out);
}

// baro_conv_proj: x is the GDN input projection, f32 [m, W]; the conv input is its first C
// columns rounded to bf16 (C from w), the rounding XLA's convert does before baro_conv. Rows mode:
// x [P, W] is P sequences' one token each, run as one token of P*C channels (channel p*C + c from
// row p), the window [3, P*C].
ffi::Error ConvProjImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                        ffi::Buffer<ffi::BF16> window, ffi::Buffer<ffi::S32> n_valid_buf, int64_t rows,
                        int64_t packed, ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::BF16> window_out) {
  const char* op = "baro_conv_proj";
  int64_t m = 0, W = 0, C = 0, P = 1;
  if (auto err = baro::check_conv_proj_x(op, x, w, rows, packed, m, W, C, P); err.failure()) return err;
  const float* xp = x.typed_data();
  if (packed) {  // baro_matmul's bf16 columns, already rounded
    const uint16_t* x16 = reinterpret_cast<const uint16_t*>(xp);
    return conv_rows(op, [&](int64_t t, int64_t c) { return x16[(t + c / C) * 2 * W + c % C]; }, m, C, P, w, window,
                     n_valid_buf, y, window_out);
  }
  return conv_rows(op, [&](int64_t t, int64_t c) { return baro::f32_to_bf16(xp[(t + c / C) * W + c % C]); }, m, C,
                   P, w, window, n_valid_buf, y, window_out);
}

// One delta-rule row's inputs for value head j (key head kh) of y's row i, the same for
// baro_delta and baro_delta_blocked: q = l2norm(q) * dk^-0.5, k = l2norm(k) (into q, k),
// beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias), v the row's value slice.
struct DeltaInputs {
  const float *y, *b, *a, *A_log, *dt_bias;  // b, a: row i's gates at b[i * b_ld], a[i * a_ld]
  int64_t C, nk, nv, dk, dv;                 // C, nk, nv: of one row of y
  float scale;
  int64_t b_ld, a_ld;
};
struct DeltaRow {
  const float* v;
  float beta, g;
};
constexpr float kDeltaL2Eps = 1e-6f;

inline DeltaRow delta_row(const DeltaInputs& in, int64_t i, int64_t j, int64_t kh, float* q, float* k) {
  const int64_t dk = in.dk;
  const float* yr = in.y + i * in.C;
  const float* qs = yr + kh * dk;
  const float* ks = yr + in.nk * dk + kh * dk;
  const float rq = 1.0f / std::sqrt(baro::dot(qs, qs, dk) + kDeltaL2Eps);
  const float rk = 1.0f / std::sqrt(baro::dot(ks, ks, dk) + kDeltaL2Eps);
  for (int64_t d = 0; d < dk; ++d) {
    q[d] = (qs[d] * rq) * in.scale;
    k[d] = ks[d] * rk;
  }
  return DeltaRow{yr + 2 * in.nk * dk + j * in.dv, baro::sigmoid(in.b[i * in.b_ld + j]),
                  -std::exp(in.A_log[j]) * baro::softplus(in.a[i * in.a_ld + j] + in.dt_bias[j])};
}

ffi::Error DeltaImpl(ffi::Buffer<ffi::F32> yb, ffi::Buffer<ffi::F32> b,
                     ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> A_log,
                     ffi::Buffer<ffi::F32> dt_bias, ffi::Buffer<ffi::F32> state,
                     ffi::Buffer<ffi::S32> n_valid_buf, int64_t b_col, int64_t a_col, int64_t rows,
                     ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> state_out) {
  const char* op = "baro_delta";
  baro::DeltaDims dims;
  if (auto err = baro::check_delta(yb, b, a, A_log, dt_bias, state, n_valid_buf, *o, *state_out, dims, op,
                                   b_col, a_col, rows);
      err.failure())
    return err;
  const int64_t m = dims.m, C = dims.C, nv = dims.nv, dk = dims.dk, dv = dims.dv, nk = dims.nk;
  // The call's value heads: rows mode's P rows of nv each, head j of y's row j / nv (local head
  // j % nv); else nv of the m tokens' rows.
  const int64_t H = dims.P * nv;
  const int64_t n_valid = n_valid_buf.typed_data()[0];
  BARO_CHECK(n_valid >= 0 && n_valid <= m, op,
             "n_valid must be in [0, m=" << m << "], got " << n_valid);

  baro::copy_if_not_aliased(state, state_out);
  float* S_all = state_out->typed_data();
  float* op_ = o->typed_data();
  const DeltaInputs in{yb.typed_data(), b.typed_data() + dims.b_off, a.typed_data() + dims.a_off, A_log.typed_data(),
                       dt_bias.typed_data(), C, nk, nv, dk, dv, baro::inv_sqrt_scale(dk), dims.b_ld, dims.a_ld};
  const int64_t ratio = nv / nk;

  for (int64_t i = n_valid; i < m; ++i)
    std::fill(op_ + i * H * dv, op_ + (i + 1) * H * dv, 0.0f);

  // Value heads are independent; each walks the valid rows in order.
  baro::parallel_for(H, 4.0 * n_valid * dk * dv, [&](int64_t j0, int64_t j1) {
    std::vector<float> q(dk), k(dk), kv(dv), del(dv);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t seq = j / nv, jh = j % nv, kh = jh / ratio;  // y's row of head j: 0 unless rows mode
      float* S = S_all + j * dk * dv;
      for (int64_t i = 0; i < n_valid; ++i) {
        const DeltaRow r = delta_row(in, seq + i, jh, kh, q.data(), k.data());
        const float* vs = r.v;
        const float beta = r.beta;
        const float e = std::exp(r.g);
        for (int64_t t = 0; t < dk * dv; ++t) S[t] = S[t] * e;
        for (int64_t d = 0; d < dv; ++d) {
          kv[d] = baro::dot(S + d, dv, k.data(), 1, dk);
          del[d] = (vs[d] - kv[d]) * beta;
        }
        for (int64_t r = 0; r < dk; ++r) {
          for (int64_t d = 0; d < dv; ++d) {
            S[r * dv + d] = std::fma(k[r], del[d], S[r * dv + d]);
          }
        }
        float* orow = op_ + i * H * dv + j * dv;
        for (int64_t d = 0; d < dv; ++d) orow[d] = baro::dot(S + d, dv, q.data(), 1, dk);
      }
    }
  });
  return ffi::Error::Success();
}

// ---- baro_delta_blocked ------------------------------------------------------------
// One value head's block state: S0 [dk, dv] (state at the current block's start) and the
// pending rows of the block, slots [0, B): K [B, dk], U [B, dv], Cl [B] (local prefix
// log-decay). Slots >= the row's index in its block are never read.
struct BlockHead {
  float* S0;
  float* K;
  float* U;
  float* Cl;
};

// Scratch for one row (sized once per thread).
struct BlockScratch {
  std::vector<float> akk, aqk, u, ek;
  BlockScratch(int64_t B, int64_t dk, int64_t dv) : akk(B), aqk(B), u(dv), ek(B * dk) {}
};

// THE per-row code of the chunk-aligned delta rule (NUMERICS.md, "delta_blocked"): row at
// slot i = position % B of its block, with q (normalised, scaled), k (normalised), v, beta,
// g already formed. Every call of the op, whatever m, runs exactly this for each valid row
// in order, so m rows in one call == m one-row calls, bytes.
void blocked_row(const BlockHead& h, int64_t i, int64_t B, int64_t dk, int64_t dv,
                 const float* q, const float* k, const float* v, float beta, float g,
                 float* orow, BlockScratch& sc) {
  const float c = i == 0 ? g : h.Cl[i - 1] + g;  // c_i = c_{i-1} + g_i, c_0 = g_0
  const float G = std::exp(c);                   // G_i = exp(c_i)
  // Row coefficients over the block's slots j < i (and j = i for o): exp(c_i - c_j) * (x . k_j).
  for (int64_t j = 0; j < i; ++j) {
    const float w = std::exp(c - h.Cl[j]);
    const float* kj = h.K + j * dk;
    sc.akk[j] = w * baro::dot(k, kj, dk);
    sc.aqk[j] = w * baro::dot(q, kj, dk);
  }
  sc.aqk[i] = std::exp(c - c) * baro::dot(q, k, dk);  // exp(0) = 1: the j = i term
  // u_i = beta * ((v - G * S0^T k) - sum_{j<i} akk_j u_j)
  for (int64_t d = 0; d < dv; ++d) {
    const float ks0 = baro::dot(h.S0 + d, dv, k, 1, dk);
    float s = 0.0f;
    for (int64_t j = 0; j < i; ++j) s = std::fma(sc.akk[j], h.U[j * dv + d], s);
    sc.u[d] = beta * ((v[d] - G * ks0) - s);
  }
  // o_i = G * S0^T q + sum_{j<=i} aqk_j u_j   (slot i is u_i itself)
  for (int64_t d = 0; d < dv; ++d) {
    const float qs0 = baro::dot(h.S0 + d, dv, q, 1, dk);
    float s = 0.0f;
    for (int64_t j = 0; j < i; ++j) s = std::fma(sc.aqk[j], h.U[j * dv + d], s);
    s = std::fma(sc.aqk[i], sc.u[d], s);
    orow[d] = G * qs0 + s;
  }
  if (i < B - 1) {  // the row becomes pending slot i
    std::copy(k, k + dk, h.K + i * dk);
    std::copy(sc.u.begin(), sc.u.end(), h.U + i * dv);
    h.Cl[i] = c;
    return;
  }
  // i = B - 1: S_B = G * S0 + sum_{j<B} (exp(c - c_j) * k_j) u_j^T, then the pending rows clear.
  for (int64_t j = 0; j < B; ++j) {
    const float e = std::exp(c - (j < i ? h.Cl[j] : c));
    const float* kj = j < i ? h.K + j * dk : k;
    for (int64_t r = 0; r < dk; ++r) sc.ek[j * dk + r] = e * kj[r];
  }
  for (int64_t r = 0; r < dk; ++r) {
    for (int64_t d = 0; d < dv; ++d) {
      float acc = 0.0f;
      for (int64_t j = 0; j < i; ++j) acc = std::fma(sc.ek[j * dk + r], h.U[j * dv + d], acc);
      acc = std::fma(sc.ek[i * dk + r], sc.u[d], acc);
      h.S0[r * dv + d] = G * h.S0[r * dv + d] + acc;
    }
  }
  std::fill(h.K, h.K + B * dk, 0.0f);
  std::fill(h.U, h.U + B * dv, 0.0f);
  std::fill(h.Cl, h.Cl + B, 0.0f);
}

ffi::Error DeltaBlockedImpl(ffi::Buffer<ffi::F32> yb, ffi::Buffer<ffi::F32> b,
                            ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> A_log,
                            ffi::Buffer<ffi::F32> dt_bias, ffi::Buffer<ffi::F32> s0,
                            ffi::Buffer<ffi::F32> pk, ffi::Buffer<ffi::F32> pu,
                            ffi::Buffer<ffi::F32> pc, ffi::Buffer<ffi::S32> pos_buf,
                            ffi::Buffer<ffi::S32> n_valid_buf, ffi::ResultBuffer<ffi::F32> o,
                            ffi::ResultBuffer<ffi::F32> s0_out, ffi::ResultBuffer<ffi::F32> pk_out,
                            ffi::ResultBuffer<ffi::F32> pu_out, ffi::ResultBuffer<ffi::F32> pc_out) {
  const char* op = "baro_delta_blocked";
  baro::DeltaBlockedDims dims;
  if (auto err = baro::check_delta_blocked(yb, b, a, A_log, dt_bias, s0, pk, pu, pc, pos_buf,
                                           n_valid_buf, *o, *s0_out, *pk_out, *pu_out, *pc_out, dims);
      err.failure())
    return err;
  const int64_t m = dims.m, C = dims.C, nv = dims.nv, dk = dims.dk, dv = dims.dv, nk = dims.nk,
                B = dims.B;
  const int64_t pos = pos_buf.typed_data()[0];
  const int64_t n_valid = n_valid_buf.typed_data()[0];
  BARO_CHECK(pos >= 0, op, "pos must be >= 0, got " << pos);
  BARO_CHECK(n_valid >= 0 && n_valid <= m, op,
             "n_valid must be in [0, m=" << m << "], got " << n_valid);

  baro::copy_if_not_aliased(s0, s0_out);
  baro::copy_if_not_aliased(pk, pk_out);
  baro::copy_if_not_aliased(pu, pu_out);
  baro::copy_if_not_aliased(pc, pc_out);
  float* op_ = o->typed_data();
  const DeltaInputs in{yb.typed_data(), b.typed_data(), a.typed_data(), A_log.typed_data(),
                       dt_bias.typed_data(), C, nk, nv, dk, dv, baro::inv_sqrt_scale(dk), nv, nv};
  const int64_t ratio = nv / nk;

  for (int64_t i = n_valid; i < m; ++i)
    std::fill(op_ + i * nv * dv, op_ + (i + 1) * nv * dv, 0.0f);

  // Value heads are independent; each walks the valid rows in order.
  baro::parallel_for(nv, 6.0 * n_valid * dk * dv, [&](int64_t j0, int64_t j1) {
    std::vector<float> q(dk), k(dk);
    BlockScratch sc(B, dk, dv);
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t kh = j / ratio;
      const BlockHead h{s0_out->typed_data() + j * dk * dv, pk_out->typed_data() + j * B * dk,
                        pu_out->typed_data() + j * B * dv, pc_out->typed_data() + j * B};
      for (int64_t i = 0; i < n_valid; ++i) {
        const DeltaRow r = delta_row(in, i, j, kh, q.data(), k.data());  // baro_delta's q, k, beta, g
        blocked_row(h, (pos + i) % B, B, dk, dv, q.data(), k.data(), r.v, r.beta, r.g,
                    op_ + i * nv * dv + j * dv, sc);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroConvCpu, baro::KnobChecked<ConvImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // x
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // window
                                  .Arg<ffi::Buffer<ffi::S32>>()   // n_valid
                                  .Attr<int64_t>("rows")          // 0 (rows mode is baro_conv_proj's)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // window
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroConvProjCpu, baro::KnobChecked<ConvProjImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x: the projection [m, W]
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // w
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // window
                                  .Arg<ffi::Buffer<ffi::S32>>()   // n_valid
                                  .Attr<int64_t>("rows")          // 1: rows mode (x [P, W], window [3, P*C])
                                  .Attr<int64_t>("packed")        // 1: x's C columns packed bf16 (baro_matmul)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // window
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroDeltaCpu, baro::KnobChecked<DeltaImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // y
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a
                                  .Arg<ffi::Buffer<ffi::F32>>()  // A_log
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dt_bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // state
                                  .Arg<ffi::Buffer<ffi::S32>>()  // n_valid
                                  .Attr<int64_t>("b_col")  // b's first gate column (-1: b is [m, nv])
                                  .Attr<int64_t>("a_col")
                                  .Attr<int64_t>("rows")  // 1: rows mode (y [P, C], state [P*nv, dk, dv])
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // state
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroDeltaBlockedCpu, baro::KnobChecked<DeltaBlockedImpl>::Call,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // y
                                  .Arg<ffi::Buffer<ffi::F32>>()  // b
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a
                                  .Arg<ffi::Buffer<ffi::F32>>()  // A_log
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dt_bias
                                  .Arg<ffi::Buffer<ffi::F32>>()  // state (S0)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pending_k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pending_u
                                  .Arg<ffi::Buffer<ffi::F32>>()  // pending_c
                                  .Arg<ffi::Buffer<ffi::S32>>()  // pos
                                  .Arg<ffi::Buffer<ffi::S32>>()  // n_valid
                                  .Ret<ffi::Buffer<ffi::F32>>()  // o
                                  .Ret<ffi::Buffer<ffi::F32>>()  // state (S0)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // pending_k
                                  .Ret<ffi::Buffer<ffi::F32>>()  // pending_u
                                  .Ret<ffi::Buffer<ffi::F32>>()  // pending_c
);
