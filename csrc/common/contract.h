// baro_jax: the shape contract of the FFI targets (docs/FFI.md),
// checked by one function per target that the CPU and the GPU handlers both
// call, so the two platforms accept and reject exactly the same calls with the
// same messages. Each check also returns the sizes the kernels need.
#pragma once

#include <cstdint>

#include "ffi_util.h"
#include "xla/ffi/api/ffi.h"

// The operands, attributes and results of the targets that have a _small twin (the same
// call plus a last `scratch` u8 result, docs/FFI.md), appended to a binding that already holds
// its platform's contexts: the CPU and GPU handlers and both variants bind one list.
#define BARO_BIND_MOE_ARGS(bind)                                                                    \
  (bind)                                                                                            \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* h */                                          \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* router [E, D] */                              \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* w_gate_up [E, 2I, D] */                       \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* w_down [E, D, I] */                           \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* shared_gate_up */                             \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* shared_down */                                \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* shared_gate */                                \
      .Attr<int32_t>("top_k")                                                                       \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>() /* out */
#define BARO_BIND_MOE_SLOTS_OPERANDS(bind)                                                          \
  (bind)                                                                                            \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* h */                                          \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* router */                                     \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* w_gate_up_pool [S, 2I, D] */                  \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* w_down_pool [S, D, I] */                      \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* slots [E] */                                   \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* shared_gate_up */                             \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* shared_down */                                \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* shared_gate */                                \
      .Attr<int32_t>("top_k")
#define BARO_BIND_MOE_SLOTS_ARGS(bind) \
  BARO_BIND_MOE_SLOTS_OPERANDS(bind).Ret<::xla::ffi::Buffer<::xla::ffi::F32>>() /* out */
// baro_moe_host_small: baro_moe_slots' operands, then the host store's addresses (the routed
// experts with no slot are read there: [E, 2I, D] and [E, D, I] bf16), out and the scratch.
#define BARO_BIND_MOE_HOST_ARGS(bind)                                                               \
  BARO_BIND_MOE_SLOTS_OPERANDS(bind)                                                                \
      .Attr<int64_t>("host_gate_up") /* address of the store's gate_up [E, 2I, D] */                \
      .Attr<int64_t>("host_down")    /* address of the store's down [E, D, I] */                    \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>() /* out */                                         \
      .Ret<::xla::ffi::Buffer<::xla::ffi::U8>>() /* scratch */
#define BARO_BIND_ATTENTION_ARGS(bind)                                                              \
  (bind)                                                                                            \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* qkv */                                         \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* q_norm */                                      \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* k_norm */                                      \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* cos */                                         \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* sin */                                         \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* k_cache */                                    \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* v_cache */                                    \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* pos */                                         \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* n_valid */                                     \
      .Attr<float>("eps")                                                                           \
      .Ret<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* o */                                          \
      .Ret<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* k_cache */                                    \
      .Ret<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* v_cache */
// The _small variants' last result.
#define BARO_BIND_SCRATCH(bind) (bind).Ret<::xla::ffi::Buffer<::xla::ffi::U8>>() /* scratch */

namespace baro {

struct MatmulDims {
  int64_t m, K, N;
};

// bf16_cols: y's first bf16_cols columns are returned rounded to bf16 and packed two to a float32
// word at the start of each row (uint16 element i * 2N + c), the rest as float32 in place
// (docs/FFI.md); 0: every column float32. Even, so that no word holds one of each.
inline ::xla::ffi::Error check_matmul(const ::xla::ffi::Buffer<::xla::ffi::BF16>& x,
                                      const ::xla::ffi::Buffer<::xla::ffi::BF16>& w,
                                      const ::xla::ffi::Buffer<::xla::ffi::F32>& y, int64_t bf16_cols,
                                      MatmulDims& d) {
  const char* op = "baro_matmul";
  BARO_RETURN_IF(expect_rank(op, "x", x, 2));
  BARO_RETURN_IF(expect_rank(op, "w", w, 2));
  d.m = x.dimensions()[0];
  d.K = x.dimensions()[1];
  d.N = w.dimensions()[0];
  BARO_CHECK(w.dimensions()[1] == d.K, op,
             "w must have shape [N, K] with K = x.shape[1] = " << d.K << ", got "
                 << dims_str(w.dimensions()));
  BARO_RETURN_IF(expect_shape(op, "y (result)", y, {d.m, d.N}));
  BARO_CHECK(bf16_cols >= 0 && bf16_cols <= d.N && bf16_cols % 2 == 0, op,
             "bf16_cols must be even and in [0, N=" << d.N << "], got " << bf16_cols);
  return ::xla::ffi::Error::Success();
}

struct DeltaDims {
  int64_t m, C, nv, dk, dv, nk;  // C, nv, nk: of one row of y
  int64_t P = 1;                 // rows of y per token: P in rows mode (m = 1), else 1
  int64_t b_ld = 0, a_ld = 0;    // row strides of b and a (their widths)
  int64_t b_off = 0, a_off = 0;  // the first gate column of b and a
};

// The `rows` attribute of baro_conv_proj and baro_delta: 0, or 1 for rows mode (P sequences,
// one token each, as one call: docs/FFI.md). "" when fine.
inline std::string expect_rows_attr(const char* op, int64_t rows) {
  if (rows == 0 || rows == 1) return "";
  std::ostringstream s;
  s << op << ": rows must be 0 or 1, got " << rows;
  return s.str();
}

// b or a of baro_delta: col < 0, exactly [m, nv]; col >= 0, [m, W] with the nv gates of a row at
// columns col .. col + nv (the model passes the GDN projection whole). Sets *ld to the width and
// *off to the first gate column.
inline std::string expect_gate_columns(const char* op, const char* name, const ::xla::ffi::Buffer<::xla::ffi::F32>& g,
                                       int64_t m, int64_t nv, int64_t col, int64_t* ld, int64_t* off) {
  if (col < 0) {
    *ld = nv;
    *off = 0;
    return expect_shape(op, name, g, {m, nv});
  }
  auto d = g.dimensions();
  if (d.size() == 2 && d[0] == m && col + nv <= d[1]) {
    *ld = d[1];
    *off = col;
    return "";
  }
  std::ostringstream s;
  s << op << ": " << name << " must have shape [" << m << ", W] with " << name << "_col + nv <= W (" << name
    << "_col=" << col << ", nv=" << nv << "), got " << dims_str(d);
  return s.str();
}

inline ::xla::ffi::Error check_delta(const ::xla::ffi::Buffer<::xla::ffi::F32>& y,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& b,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& a,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& A_log,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& dt_bias,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& state,
                                     const ::xla::ffi::Buffer<::xla::ffi::S32>& n_valid,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& o,
                                     const ::xla::ffi::Buffer<::xla::ffi::F32>& state_out,
                                     DeltaDims& d, const char* op = "baro_delta", int64_t b_col = -1,
                                     int64_t a_col = -1, int64_t rows = 0) {
  BARO_RETURN_IF(expect_rows_attr(op, rows));
  BARO_RETURN_IF(expect_rank(op, "y", y, 2));
  BARO_RETURN_IF(expect_rank(op, "state", state, 3));
  d.C = y.dimensions()[1];
  d.dk = state.dimensions()[1];
  d.dv = state.dimensions()[2];
  if (rows) {  // row p of y is sequence p's token; its nv heads (from A_log) are state rows p*nv ..
    BARO_RETURN_IF(expect_rank(op, "A_log", A_log, 1));
    d.m = 1;
    d.P = y.dimensions()[0];
    d.nv = A_log.dimensions()[0];
    BARO_CHECK(d.P >= 1 && d.nv >= 1, op,
               "rows mode needs y [P, C] with P >= 1 and A_log [nv] with nv >= 1, got y "
                   << dims_str(y.dimensions()) << " and A_log " << dims_str(A_log.dimensions()));
    BARO_CHECK(state.dimensions()[0] == d.P * d.nv, op,
               "state must have shape [P*nv, dk, dv] in rows mode (P=" << d.P << " rows of y, nv=" << d.nv
                                                                      << " from A_log), got "
                                                                      << dims_str(state.dimensions()));
  } else {
    d.m = y.dimensions()[0];
    d.P = 1;
    d.nv = state.dimensions()[0];
  }
  BARO_CHECK(d.nv > 0 && d.dk > 0 && d.dv > 0, op,
             "state must have non-empty shape [nv, dk, dv], got " << dims_str(state.dimensions()));
  BARO_CHECK(d.C > d.nv * d.dv && (d.C - d.nv * d.dv) % (2 * d.dk) == 0, op,
             "y width " << d.C << " must be 2*nk*dk + nv*dv with nv=" << d.nv << ", dk=" << d.dk
                        << ", dv=" << d.dv << " (from state)");
  d.nk = (d.C - d.nv * d.dv) / (2 * d.dk);
  BARO_CHECK(d.nv % d.nk == 0, op,
             "nv=" << d.nv << " value heads must be a multiple of nk=" << d.nk << " key heads");
  BARO_RETURN_IF(expect_gate_columns(op, "b", b, d.m * d.P, d.nv, b_col, &d.b_ld, &d.b_off));
  BARO_RETURN_IF(expect_gate_columns(op, "a", a, d.m * d.P, d.nv, a_col, &d.a_ld, &d.a_off));
  BARO_RETURN_IF(expect_shape(op, "A_log", A_log, {d.nv}));
  BARO_RETURN_IF(expect_shape(op, "dt_bias", dt_bias, {d.nv}));
  BARO_RETURN_IF(expect_shape(op, "n_valid", n_valid, {}));
  BARO_RETURN_IF(expect_shape(op, "o (result)", o, {d.m * d.P, d.nv, d.dv}));
  BARO_RETURN_IF(expect_shape(op, "state (result)", state_out, {d.P * d.nv, d.dk, d.dv}));
  return ::xla::ffi::Error::Success();
}

struct DeltaBlockedDims {
  int64_t m, C, nv, dk, dv, nk, B;
};

// baro_delta_blocked: delta's operands (with S0 as `state`) plus the pending rows of the
// current block; B (the block length) is implied by the pending buffers' shape.
inline ::xla::ffi::Error check_delta_blocked(
    const ::xla::ffi::Buffer<::xla::ffi::F32>& y, const ::xla::ffi::Buffer<::xla::ffi::F32>& b,
    const ::xla::ffi::Buffer<::xla::ffi::F32>& a, const ::xla::ffi::Buffer<::xla::ffi::F32>& A_log,
    const ::xla::ffi::Buffer<::xla::ffi::F32>& dt_bias, const ::xla::ffi::Buffer<::xla::ffi::F32>& s0,
    const ::xla::ffi::Buffer<::xla::ffi::F32>& pk, const ::xla::ffi::Buffer<::xla::ffi::F32>& pu,
    const ::xla::ffi::Buffer<::xla::ffi::F32>& pc, const ::xla::ffi::Buffer<::xla::ffi::S32>& pos,
    const ::xla::ffi::Buffer<::xla::ffi::S32>& n_valid, const ::xla::ffi::Buffer<::xla::ffi::F32>& o,
    const ::xla::ffi::Buffer<::xla::ffi::F32>& s0_out, const ::xla::ffi::Buffer<::xla::ffi::F32>& pk_out,
    const ::xla::ffi::Buffer<::xla::ffi::F32>& pu_out, const ::xla::ffi::Buffer<::xla::ffi::F32>& pc_out,
    DeltaBlockedDims& d) {
  const char* op = "baro_delta_blocked";
  DeltaDims dd;
  if (auto err = check_delta(y, b, a, A_log, dt_bias, s0, n_valid, o, s0_out, dd, op); err.failure())
    return err;
  BARO_RETURN_IF(expect_rank(op, "pending_k", pk, 3));
  const int64_t B = pk.dimensions()[1];
  BARO_CHECK(B >= 1, op, "pending_k must have shape [nv, B, dk] with B >= 1, got " << dims_str(pk.dimensions()));
  BARO_RETURN_IF(expect_shape(op, "pending_k", pk, {dd.nv, B, dd.dk}));
  BARO_RETURN_IF(expect_shape(op, "pending_u", pu, {dd.nv, B, dd.dv}));
  BARO_RETURN_IF(expect_shape(op, "pending_c", pc, {dd.nv, B}));
  BARO_RETURN_IF(expect_shape(op, "pos", pos, {}));
  BARO_RETURN_IF(expect_shape(op, "pending_k (result)", pk_out, {dd.nv, B, dd.dk}));
  BARO_RETURN_IF(expect_shape(op, "pending_u (result)", pu_out, {dd.nv, B, dd.dv}));
  BARO_RETURN_IF(expect_shape(op, "pending_c (result)", pc_out, {dd.nv, B}));
  d = DeltaBlockedDims{dd.m, dd.C, dd.nv, dd.dk, dd.dv, dd.nk, B};
  return ::xla::ffi::Error::Success();
}

struct AttentionDims {
  int64_t m, hd, S, Hkv, H, R2;
};

inline ::xla::ffi::Error check_attention(
    const ::xla::ffi::Buffer<::xla::ffi::F32>& qkv, const ::xla::ffi::Buffer<::xla::ffi::F32>& q_norm,
    const ::xla::ffi::Buffer<::xla::ffi::F32>& k_norm, const ::xla::ffi::Buffer<::xla::ffi::F32>& cos,
    const ::xla::ffi::Buffer<::xla::ffi::F32>& sin, const ::xla::ffi::Buffer<::xla::ffi::BF16>& k_cache,
    const ::xla::ffi::Buffer<::xla::ffi::BF16>& v_cache, const ::xla::ffi::Buffer<::xla::ffi::S32>& pos_buf,
    const ::xla::ffi::Buffer<::xla::ffi::S32>& n_valid_buf, const ::xla::ffi::Buffer<::xla::ffi::BF16>& o,
    const ::xla::ffi::Buffer<::xla::ffi::BF16>& k_out, const ::xla::ffi::Buffer<::xla::ffi::BF16>& v_out,
    AttentionDims& d) {
  const char* op = "baro_attention";
  BARO_RETURN_IF(expect_rank(op, "qkv", qkv, 2));
  BARO_RETURN_IF(expect_rank(op, "q_norm", q_norm, 1));
  BARO_RETURN_IF(expect_rank(op, "k_cache", k_cache, 3));
  BARO_RETURN_IF(expect_rank(op, "cos", cos, 2));
  const int64_t m = qkv.dimensions()[0], W = qkv.dimensions()[1];
  const int64_t hd = q_norm.dimensions()[0];
  const int64_t S = k_cache.dimensions()[0], Hkv = k_cache.dimensions()[1];
  const int64_t R2 = cos.dimensions()[1];
  BARO_CHECK(hd > 0, op, "q_norm must be non-empty (its length is head_dim)");
  BARO_CHECK(Hkv > 0, op, "k_cache must have at least one kv head, got shape "
                              << dims_str(k_cache.dimensions()));
  BARO_RETURN_IF(expect_shape(op, "k_norm", k_norm, {hd}));
  BARO_RETURN_IF(expect_shape(op, "k_cache", k_cache, {S, Hkv, hd}));
  BARO_RETURN_IF(expect_shape(op, "v_cache", v_cache, {S, Hkv, hd}));
  BARO_CHECK(W % hd == 0 && W / hd > 2 * Hkv && (W / hd - 2 * Hkv) % 2 == 0, op,
             "qkv width " << W << " must be (2*H + 2*Hkv) * head_dim with head_dim="
                          << hd << ", Hkv=" << Hkv);
  const int64_t H = (W / hd - 2 * Hkv) / 2;
  BARO_CHECK(H % Hkv == 0, op,
             "number of q heads " << H << " must be a multiple of Hkv=" << Hkv);
  BARO_RETURN_IF(expect_shape(op, "cos", cos, {m, R2}));
  BARO_RETURN_IF(expect_shape(op, "sin", sin, {m, R2}));
  BARO_CHECK(2 * R2 <= hd, op,
             "rotary dims 2*cos.shape[1]=" << 2 * R2 << " exceed head_dim=" << hd);
  BARO_RETURN_IF(expect_shape(op, "pos", pos_buf, {}));
  BARO_RETURN_IF(expect_shape(op, "n_valid", n_valid_buf, {}));
  BARO_RETURN_IF(expect_shape(op, "o (result)", o, {m, H * hd}));
  BARO_RETURN_IF(expect_shape(op, "k_cache (result)", k_out, {S, Hkv, hd}));
  BARO_RETURN_IF(expect_shape(op, "v_cache (result)", v_out, {S, Hkv, hd}));
  d = AttentionDims{m, hd, S, Hkv, H, R2};
  return ::xla::ffi::Error::Success();
}

// The routed experts' weights (gate rows first): gate_up [n, 2I, D] and down [n, D, I],
// named gu_name / dn_name (ranks checked by the caller); sets I. Returns "" or the
// message, as expect_shape does.
inline std::string expect_expert_weights(const char* op, const char* gu_name, const ::xla::ffi::Buffer<::xla::ffi::BF16>& gate_up,
                                         const char* dn_name, const ::xla::ffi::Buffer<::xla::ffi::BF16>& down, int64_t n, int64_t D, int64_t& I) {
  const int64_t I2 = gate_up.dimensions()[1];
  I = I2 / 2;
  if (I2 % 2 != 0 || I2 <= 0) {
    std::ostringstream m;
    m << op << ": " << gu_name << ".shape[1] must be 2*I (even, > 0), got " << I2;
    return m.str();
  }
  std::string e = expect_shape(op, gu_name, gate_up, {n, 2 * I, D});
  return e.empty() ? expect_shape(op, dn_name, down, {n, D, I}) : e;
}

// The shared expert and its gate: shared_gate_up [2Is, D] (gate rows first), shared_down
// [D, Is], shared_gate [1, D] (the rank of shared_gate_up checked by the caller); sets Is.
inline std::string expect_shared_expert(const char* op, const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_gate_up, const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_down,
                                        const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_gate, int64_t D, int64_t& Is) {
  const int64_t Is2 = shared_gate_up.dimensions()[0];
  Is = Is2 / 2;
  if (Is2 % 2 != 0 || Is2 <= 0) {
    std::ostringstream m;
    m << op << ": shared_gate_up.shape[0] must be 2*Is (even, > 0), got " << Is2;
    return m.str();
  }
  for (std::string e : {expect_shape(op, "shared_gate_up", shared_gate_up, {2 * Is, D}),
                        expect_shape(op, "shared_down", shared_down, {D, Is}),
                        expect_shape(op, "shared_gate", shared_gate, {1, D})})
    if (!e.empty()) return e;
  return "";
}

struct MoeDims {
  int64_t m, D, E, I, Is;
};

inline ::xla::ffi::Error check_moe(const ::xla::ffi::Buffer<::xla::ffi::BF16>& h, const ::xla::ffi::Buffer<::xla::ffi::BF16>& router, const ::xla::ffi::Buffer<::xla::ffi::BF16>& w_gate_up,
                                   const ::xla::ffi::Buffer<::xla::ffi::BF16>& w_down, const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_gate_up,
                                   const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_down, const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_gate, int32_t top_k,
                                   const ::xla::ffi::Buffer<::xla::ffi::F32>& out, MoeDims& d) {
  const char* op = "baro_moe";
  BARO_RETURN_IF(expect_rank(op, "h", h, 2));
  BARO_RETURN_IF(expect_rank(op, "router", router, 2));
  BARO_RETURN_IF(expect_rank(op, "w_gate_up", w_gate_up, 3));
  BARO_RETURN_IF(expect_rank(op, "shared_gate_up", shared_gate_up, 2));
  const int64_t m = h.dimensions()[0], D = h.dimensions()[1];
  const int64_t E = router.dimensions()[0];
  int64_t I = 0, Is = 0;
  BARO_RETURN_IF(expect_shape(op, "router", router, {E, D}));
  BARO_RETURN_IF(expect_expert_weights(op, "w_gate_up", w_gate_up, "w_down", w_down, E, D, I));
  BARO_RETURN_IF(expect_shared_expert(op, shared_gate_up, shared_down, shared_gate, D, Is));
  BARO_CHECK(top_k >= 1 && top_k <= E, op, "top_k must be in [1, E=" << E << "], got " << top_k);
  BARO_RETURN_IF(expect_shape(op, "out (result)", out, {m, D}));
  d = MoeDims{m, D, E, I, Is};
  return ::xla::ffi::Error::Success();
}

// baro_moe_slots: baro_moe's operands with the routed experts in a pool of S slots,
// w_gate_up_pool [S, 2I, D], w_down_pool [S, D, I], and slots [E] int32 (expert -> slot,
// -1 = not resident) after w_down_pool. *S is the pool's slot count.
inline ::xla::ffi::Error check_moe_slots(const ::xla::ffi::Buffer<::xla::ffi::BF16>& h, const ::xla::ffi::Buffer<::xla::ffi::BF16>& router,
                                         const ::xla::ffi::Buffer<::xla::ffi::BF16>& w_gate_up_pool, const ::xla::ffi::Buffer<::xla::ffi::BF16>& w_down_pool,
                                         const ::xla::ffi::Buffer<::xla::ffi::S32>& slots, const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_gate_up,
                                         const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_down, const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_gate, int32_t top_k,
                                         const ::xla::ffi::Buffer<::xla::ffi::F32>& out, MoeDims& d, int64_t& S,
                                         const char* op = "baro_moe_slots") {
  BARO_RETURN_IF(expect_rank(op, "h", h, 2));
  BARO_RETURN_IF(expect_rank(op, "router", router, 2));
  BARO_RETURN_IF(expect_rank(op, "w_gate_up_pool", w_gate_up_pool, 3));
  BARO_RETURN_IF(expect_rank(op, "shared_gate_up", shared_gate_up, 2));
  const int64_t m = h.dimensions()[0], D = h.dimensions()[1];
  const int64_t E = router.dimensions()[0];
  S = w_gate_up_pool.dimensions()[0];
  int64_t I = 0, Is = 0;
  BARO_RETURN_IF(expect_shape(op, "router", router, {E, D}));
  BARO_CHECK(S >= 1, op, "w_gate_up_pool must hold at least one slot, got shape " << dims_str(w_gate_up_pool.dimensions()));
  BARO_RETURN_IF(expect_expert_weights(op, "w_gate_up_pool", w_gate_up_pool, "w_down_pool", w_down_pool, S, D, I));
  BARO_RETURN_IF(expect_shape(op, "slots", slots, {E}));
  BARO_RETURN_IF(expect_shared_expert(op, shared_gate_up, shared_down, shared_gate, D, Is));
  BARO_CHECK(top_k >= 1 && top_k <= E, op, "top_k must be in [1, E=" << E << "], got " << top_k);
  BARO_RETURN_IF(expect_shape(op, "out (result)", out, {m, D}));
  d = MoeDims{m, D, E, I, Is};
  return ::xla::ffi::Error::Success();
}

// baro_moe_host: baro_moe_slots' operands, and the host store's two addresses, which must be set
// (what they point at is the caller's contract: custom_calls/moe.py hands over live arrays).
inline ::xla::ffi::Error check_moe_host(const ::xla::ffi::Buffer<::xla::ffi::BF16>& h, const ::xla::ffi::Buffer<::xla::ffi::BF16>& router,
                                        const ::xla::ffi::Buffer<::xla::ffi::BF16>& w_gate_up_pool, const ::xla::ffi::Buffer<::xla::ffi::BF16>& w_down_pool,
                                        const ::xla::ffi::Buffer<::xla::ffi::S32>& slots, const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_gate_up,
                                        const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_down, const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_gate, int32_t top_k,
                                        int64_t host_gate_up, int64_t host_down, const ::xla::ffi::Buffer<::xla::ffi::F32>& out,
                                        MoeDims& d, int64_t& S) {
  const char* op = "baro_moe_host";
  if (auto err = check_moe_slots(h, router, w_gate_up_pool, w_down_pool, slots, shared_gate_up, shared_down, shared_gate,
                                 top_k, out, d, S, op);
      err.failure())
    return err;
  BARO_CHECK(host_gate_up != 0 && host_down != 0, op,
             "host_gate_up and host_down must be the store's addresses, got " << host_gate_up << " and " << host_down);
  return ::xla::ffi::Error::Success();
}

// baro_moe_route: h [m, D], router [E, D] -> ids [m, top_k] int32 (baro_moe's routing).
inline ::xla::ffi::Error check_moe_route(const ::xla::ffi::Buffer<::xla::ffi::BF16>& h, const ::xla::ffi::Buffer<::xla::ffi::BF16>& router, int32_t top_k,
                                         const ::xla::ffi::Buffer<::xla::ffi::S32>& ids, int64_t& m, int64_t& D, int64_t& E) {
  const char* op = "baro_moe_route";
  BARO_RETURN_IF(expect_rank(op, "h", h, 2));
  BARO_RETURN_IF(expect_rank(op, "router", router, 2));
  m = h.dimensions()[0];
  D = h.dimensions()[1];
  E = router.dimensions()[0];
  BARO_RETURN_IF(expect_shape(op, "router", router, {E, D}));
  BARO_CHECK(top_k >= 1 && top_k <= E, op, "top_k must be in [1, E=" << E << "], got " << top_k);
  BARO_RETURN_IF(expect_shape(op, "ids (result)", ids, {m, top_k}));
  return ::xla::ffi::Error::Success();
}

// baro_moe_pairs (expert parallel): baro_moe's routing over all E experts (router [E, D]) and
// the per-(row, slot) expert outputs of the pairs whose expert is in this shard:
// w_gate_up [El, 2I, D] / w_down [El, D, I] hold experts expert_base .. expert_base + El - 1.
// Results: y [m, top_k, D] f32 (0 for a pair of another shard), w [m, top_k] f32 (the
// renormalised routing weight of each pair), ids [m, top_k] int32 (the routed expert).
struct MoePairsDims {
  int64_t m, D, E, El, I;
};

inline ::xla::ffi::Error check_moe_pairs(const ::xla::ffi::Buffer<::xla::ffi::BF16>& h, const ::xla::ffi::Buffer<::xla::ffi::BF16>& router,
                                         const ::xla::ffi::Buffer<::xla::ffi::BF16>& w_gate_up, const ::xla::ffi::Buffer<::xla::ffi::BF16>& w_down,
                                         const ::xla::ffi::Buffer<::xla::ffi::S32>& expert_base, int32_t top_k,
                                         const ::xla::ffi::Buffer<::xla::ffi::F32>& y, const ::xla::ffi::Buffer<::xla::ffi::F32>& w,
                                         const ::xla::ffi::Buffer<::xla::ffi::S32>& ids, MoePairsDims& d) {
  const char* op = "baro_moe_pairs";
  BARO_RETURN_IF(expect_rank(op, "h", h, 2));
  BARO_RETURN_IF(expect_rank(op, "router", router, 2));
  BARO_RETURN_IF(expect_rank(op, "w_gate_up", w_gate_up, 3));
  const int64_t m = h.dimensions()[0], D = h.dimensions()[1];
  const int64_t E = router.dimensions()[0];
  const int64_t El = w_gate_up.dimensions()[0];
  int64_t I = 0;
  BARO_RETURN_IF(expect_shape(op, "router", router, {E, D}));
  BARO_CHECK(El >= 1 && El <= E, op, "w_gate_up must hold 1..E=" << E << " experts, got shape "
                                         << dims_str(w_gate_up.dimensions()));
  BARO_RETURN_IF(expect_expert_weights(op, "w_gate_up", w_gate_up, "w_down", w_down, El, D, I));
  BARO_RETURN_IF(expect_shape(op, "expert_base", expert_base, {1}));
  BARO_CHECK(top_k >= 1 && top_k <= E, op, "top_k must be in [1, E=" << E << "], got " << top_k);
  BARO_RETURN_IF(expect_shape(op, "y (result)", y, {m, top_k, D}));
  BARO_RETURN_IF(expect_shape(op, "w (result)", w, {m, top_k}));
  BARO_RETURN_IF(expect_shape(op, "ids (result)", ids, {m, top_k}));
  d = MoePairsDims{m, D, E, El, I};
  return ::xla::ffi::Error::Success();
}

// baro_moe_combine: baro_moe's combine of per-pair outputs y [m, k, D] f32 with weights
// w [m, k] f32 (slot order), plus the gated shared expert of h [m, D].
struct MoeCombineDims {
  int64_t m, D, K, Is;
};

inline ::xla::ffi::Error check_moe_combine(const ::xla::ffi::Buffer<::xla::ffi::BF16>& h, const ::xla::ffi::Buffer<::xla::ffi::F32>& y,
                                           const ::xla::ffi::Buffer<::xla::ffi::F32>& w, const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_gate_up,
                                           const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_down, const ::xla::ffi::Buffer<::xla::ffi::BF16>& shared_gate,
                                           const ::xla::ffi::Buffer<::xla::ffi::F32>& out, MoeCombineDims& d) {
  const char* op = "baro_moe_combine";
  BARO_RETURN_IF(expect_rank(op, "h", h, 2));
  BARO_RETURN_IF(expect_rank(op, "y", y, 3));
  BARO_RETURN_IF(expect_rank(op, "shared_gate_up", shared_gate_up, 2));
  const int64_t m = h.dimensions()[0], D = h.dimensions()[1];
  const int64_t K = y.dimensions()[1];
  int64_t Is = 0;
  BARO_CHECK(K >= 1, op, "y must have shape [m, k, D] with k >= 1, got " << dims_str(y.dimensions()));
  BARO_RETURN_IF(expect_shape(op, "y", y, {m, K, D}));
  BARO_RETURN_IF(expect_shape(op, "w", w, {m, K}));
  BARO_RETURN_IF(expect_shared_expert(op, shared_gate_up, shared_down, shared_gate, D, Is));
  BARO_RETURN_IF(expect_shape(op, "out (result)", out, {m, D}));
  d = MoeCombineDims{m, D, K, Is};
  return ::xla::ffi::Error::Success();
}

struct RmsnormDims {
  int64_t m, D;
};

inline ::xla::ffi::Error check_rmsnorm(const ::xla::ffi::Buffer<::xla::ffi::F32>& x, const ::xla::ffi::Buffer<::xla::ffi::F32>& w, const ::xla::ffi::Buffer<::xla::ffi::BF16>& y,
                                       RmsnormDims& d) {
  const char* op = "baro_rmsnorm";
  BARO_RETURN_IF(expect_rank(op, "x", x, 2));
  d = RmsnormDims{x.dimensions()[0], x.dimensions()[1]};
  BARO_RETURN_IF(expect_shape(op, "w", w, {d.D}));
  BARO_RETURN_IF(expect_shape(op, "y (result)", y, {d.m, d.D}));
  return ::xla::ffi::Error::Success();
}

// baro_add_rmsnorm: s = x + y, h = rmsnorm(s) (the residual add before a norm, one call).
inline ::xla::ffi::Error check_add_rmsnorm(const ::xla::ffi::Buffer<::xla::ffi::F32>& x,
                                           const ::xla::ffi::Buffer<::xla::ffi::F32>& y,
                                           const ::xla::ffi::Buffer<::xla::ffi::F32>& w,
                                           const ::xla::ffi::Buffer<::xla::ffi::F32>& s,
                                           const ::xla::ffi::Buffer<::xla::ffi::BF16>& h, RmsnormDims& d) {
  const char* op = "baro_add_rmsnorm";
  BARO_RETURN_IF(expect_rank(op, "x", x, 2));
  d = RmsnormDims{x.dimensions()[0], x.dimensions()[1]};
  BARO_RETURN_IF(expect_shape(op, "y", y, {d.m, d.D}));
  BARO_RETURN_IF(expect_shape(op, "w", w, {d.D}));
  BARO_RETURN_IF(expect_shape(op, "s (result)", s, {d.m, d.D}));
  BARO_RETURN_IF(expect_shape(op, "h (result)", h, {d.m, d.D}));
  return ::xla::ffi::Error::Success();
}

// baro_conv's `rows` attribute: 0 only (rows mode reads the f32 projection: baro_conv_proj).
inline std::string expect_no_rows_mode(const char* op, int64_t rows) {
  if (rows == 0) return "";
  std::ostringstream s;
  s << op << ": rows must be 0 (rows mode takes the f32 projection x [P, W]: baro_conv_proj), got " << rows;
  return s.str();
}

// baro_conv_proj's x: the f32 projection [m, W] with at least C = w's rows columns. Rows mode
// (rows = 1): x's rows are P sequences' one token each, the call one token (m = 1) of P*C
// channels; else P = 1.
// packed = 1: the C columns are baro_matmul's bf16_cols >= C columns, bf16 packed at the start of
// each row (uint16 element t * 2W + c), read as they are.
inline ::xla::ffi::Error check_conv_proj_x(const char* op, const ::xla::ffi::Buffer<::xla::ffi::F32>& x,
                                           const ::xla::ffi::Buffer<::xla::ffi::BF16>& w, int64_t rows,
                                           int64_t packed, int64_t& m, int64_t& W, int64_t& C, int64_t& P) {
  BARO_RETURN_IF(expect_rows_attr(op, rows));
  BARO_CHECK(packed == 0 || packed == 1, op, "packed must be 0 or 1, got " << packed);
  BARO_RETURN_IF(expect_rank(op, "x", x, 2));
  BARO_RETURN_IF(expect_rank(op, "w", w, 2));
  m = x.dimensions()[0];
  W = x.dimensions()[1];
  C = w.dimensions()[0];
  BARO_CHECK(C <= W, op, "x must have at least C=" << C << " columns (C from w), got shape " << dims_str(x.dimensions()));
  P = 1;
  if (rows) {
    BARO_CHECK(m >= 1, op, "rows mode needs x [P, W] with P >= 1, got shape " << dims_str(x.dimensions()));
    P = m;
    m = 1;
  }
  return ::xla::ffi::Error::Success();
}

// baro_conv and baro_conv_proj past x, for m tokens of P rows of C channels (P > 1 in rows mode
// only, where m = 1 and channel p*C + c of the call is row p's channel c): w [C, 4], window
// [3, P*C], n_valid [], y (result) [m*P, C], window (result) [3, P*C].
inline ::xla::ffi::Error check_conv_rest(const char* op, int64_t m, int64_t C, int64_t P,
                                         const ::xla::ffi::Buffer<::xla::ffi::BF16>& w,
                                         const ::xla::ffi::Buffer<::xla::ffi::BF16>& window,
                                         const ::xla::ffi::Buffer<::xla::ffi::S32>& n_valid,
                                         const ::xla::ffi::Buffer<::xla::ffi::F32>& y,
                                         const ::xla::ffi::Buffer<::xla::ffi::BF16>& window_out) {
  constexpr int64_t K = 4;
  BARO_RETURN_IF(expect_shape(op, "w", w, {C, K}));
  BARO_RETURN_IF(expect_shape(op, "window", window, {K - 1, P * C}));
  BARO_RETURN_IF(expect_shape(op, "n_valid", n_valid, {}));
  BARO_RETURN_IF(expect_shape(op, "y (result)", y, {m * P, C}));
  BARO_RETURN_IF(expect_shape(op, "window (result)", window_out, {K - 1, P * C}));
  return ::xla::ffi::Error::Success();
}

struct GatedNormDims {
  int64_t m, nv, dv;
  int64_t z_ld;  // z's row stride (its width); the gate of row i is z[i][z_col .. z_col + nv*dv)
};

inline ::xla::ffi::Error check_gated_norm(const ::xla::ffi::Buffer<::xla::ffi::F32>& o, const ::xla::ffi::Buffer<::xla::ffi::F32>& z, const ::xla::ffi::Buffer<::xla::ffi::F32>& w,
                                          int64_t z_col, const ::xla::ffi::Buffer<::xla::ffi::BF16>& y, GatedNormDims& d) {
  const char* op = "baro_gated_norm";
  BARO_RETURN_IF(expect_rank(op, "o", o, 3));
  d = GatedNormDims{o.dimensions()[0], o.dimensions()[1], o.dimensions()[2], 0};
  BARO_RETURN_IF(expect_rank(op, "z", z, 2));
  d.z_ld = z.dimensions()[1];
  BARO_CHECK(z_col >= 0 && z.dimensions()[0] == d.m && z_col + d.nv * d.dv <= d.z_ld, op,
             "z must have shape [" << d.m << ", W] with z_col + nv*dv <= W (z_col=" << z_col
                                   << ", nv*dv=" << d.nv * d.dv << "), got shape "
                                   << dims_str(z.dimensions()));
  BARO_RETURN_IF(expect_shape(op, "w", w, {d.dv}));
  BARO_RETURN_IF(expect_shape(op, "y (result)", y, {d.m, d.nv * d.dv}));
  return ::xla::ffi::Error::Success();
}

}  // namespace baro
