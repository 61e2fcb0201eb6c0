// baro_jax: the shape contract of the many-sequence targets (docs/FFI.md "baro_attention_rows",
// "baro_log_softmax"), checked by one function per target that the CPU and GPU handlers both
// call, as contract.h does for the one-sequence targets.
#pragma once

#include <cstdint>

#include "ffi_util.h"
#include "xla/ffi/api/ffi.h"

// Operands, attribute and results of baro_attention_rows, appended to a binding that already
// holds its platform's contexts. The last result is the GPU split partials (sized by
// custom_calls/attention_rows.py; the CPU ignores it), so the GPU handler allocates nothing.
#define BARO_BIND_ATTENTION_ROWS_ARGS(bind)                                                         \
  (bind)                                                                                            \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* qkv [m, (2H+2Hkv)*hd] */                       \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* q_norm [hd] */                                 \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* k_norm [hd] */                                 \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* cos [m, R2] */                                 \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* sin [m, R2] */                                 \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* k_pages [NP, page, Hkv, hd] */                \
      .Arg<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* v_pages [NP, page, Hkv, hd] */                \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* table [P, T] (-1: no page) */                  \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* slot [m] (-1: padding) */                      \
      .Arg<::xla::ffi::Buffer<::xla::ffi::S32>>() /* pos [m] */                                     \
      .Attr<float>("eps")                                                                           \
      .Ret<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* o [m, H*hd] */                                \
      .Ret<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* k_pages */                                    \
      .Ret<::xla::ffi::Buffer<::xla::ffi::BF16>>() /* v_pages */                                    \
      .Ret<::xla::ffi::Buffer<::xla::ffi::U8>>() /* scratch */

#define BARO_BIND_LOG_SOFTMAX_ARGS(bind)                                                            \
  (bind)                                                                                            \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* logits [m, V] */                               \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>() /* out [m, V] */

// baro_topk_rows: each row's k largest logits (IEEE total order: +NaN > +inf > ... > +0 > -0 > ...
// > -inf > -NaN, as lax.top_k orders them), largest first, equal bit patterns by lower id.
#define BARO_BIND_TOPK_ROWS_ARGS(bind)                                                              \
  (bind)                                                                                            \
      .Arg<::xla::ffi::Buffer<::xla::ffi::F32>>() /* logits [m, V] */                               \
      .Attr<int32_t>("k")                                                                           \
      .Ret<::xla::ffi::Buffer<::xla::ffi::F32>>() /* vals [m, k] */                                 \
      .Ret<::xla::ffi::Buffer<::xla::ffi::S32>>() /* ids [m, k] */

namespace baro {

// KV positions per KV block of the attention kernels (CPU attn::kBlock, CUDA kFaKB): a page
// holds whole blocks, so a block never straddles two pages and reads in the same order as from a
// contiguous cache.
constexpr int64_t kRowsPageMultiple = 64;

// S = T * page: the positions a slot's table row maps, the length of the contiguous cache the
// pages stand for (the KV splits stay at absolute positions of it).
struct AttentionRowsDims {
  int64_t m, hd, P, S, Hkv, H, R2, NP, page, T;
};

inline ::xla::ffi::Error check_attention_rows(
    const ::xla::ffi::Buffer<::xla::ffi::F32>& qkv, const ::xla::ffi::Buffer<::xla::ffi::F32>& q_norm,
    const ::xla::ffi::Buffer<::xla::ffi::F32>& k_norm, const ::xla::ffi::Buffer<::xla::ffi::F32>& cos,
    const ::xla::ffi::Buffer<::xla::ffi::F32>& sin, const ::xla::ffi::Buffer<::xla::ffi::BF16>& k_pages,
    const ::xla::ffi::Buffer<::xla::ffi::BF16>& v_pages, const ::xla::ffi::Buffer<::xla::ffi::S32>& table,
    const ::xla::ffi::Buffer<::xla::ffi::S32>& slot, const ::xla::ffi::Buffer<::xla::ffi::S32>& pos,
    const ::xla::ffi::Buffer<::xla::ffi::BF16>& o, const ::xla::ffi::Buffer<::xla::ffi::BF16>& k_out,
    const ::xla::ffi::Buffer<::xla::ffi::BF16>& v_out, AttentionRowsDims& d) {
  const char* op = "baro_attention_rows";
  BARO_RETURN_IF(expect_rank(op, "qkv", qkv, 2));
  BARO_RETURN_IF(expect_rank(op, "q_norm", q_norm, 1));
  BARO_RETURN_IF(expect_rank(op, "k_pages", k_pages, 4));
  BARO_RETURN_IF(expect_rank(op, "table", table, 2));
  BARO_RETURN_IF(expect_rank(op, "cos", cos, 2));
  const int64_t m = qkv.dimensions()[0], W = qkv.dimensions()[1];
  const int64_t hd = q_norm.dimensions()[0];
  const int64_t NP = k_pages.dimensions()[0], page = k_pages.dimensions()[1], Hkv = k_pages.dimensions()[2];
  const int64_t P = table.dimensions()[0], T = table.dimensions()[1];
  const int64_t R2 = cos.dimensions()[1];
  BARO_CHECK(m >= 1, op, "qkv must have at least one row, got shape " << dims_str(qkv.dimensions()));
  BARO_CHECK(hd > 0, op, "q_norm must be non-empty (its length is head_dim)");
  BARO_CHECK(NP >= 1 && Hkv >= 1, op,
             "k_pages must have NP >= 1 pages and Hkv >= 1 kv heads, got shape " << dims_str(k_pages.dimensions()));
  BARO_CHECK(page >= kRowsPageMultiple && page % kRowsPageMultiple == 0, op,
             "the page size k_pages.shape[1]=" << page << " must be a positive multiple of " << kRowsPageMultiple
                                               << " (the kernels' KV block)");
  BARO_CHECK(P >= 1 && T >= 1, op,
             "table must have shape [P, T] with P >= 1 slots and T >= 1 pages a slot, got "
                 << dims_str(table.dimensions()));
  BARO_CHECK(T * page < (int64_t{1} << 31), op,
             "table width " << T << " x page " << page << " positions exceed the int32 positions");
  BARO_RETURN_IF(expect_shape(op, "k_norm", k_norm, {hd}));
  BARO_RETURN_IF(expect_shape(op, "k_pages", k_pages, {NP, page, Hkv, hd}));
  BARO_RETURN_IF(expect_shape(op, "v_pages", v_pages, {NP, page, Hkv, hd}));
  BARO_CHECK(W % hd == 0 && W / hd > 2 * Hkv && (W / hd - 2 * Hkv) % 2 == 0, op,
             "qkv width " << W << " must be (2*H + 2*Hkv) * head_dim with head_dim=" << hd << ", Hkv=" << Hkv);
  const int64_t H = (W / hd - 2 * Hkv) / 2;
  BARO_CHECK(H % Hkv == 0, op, "number of q heads " << H << " must be a multiple of Hkv=" << Hkv);
  BARO_RETURN_IF(expect_shape(op, "cos", cos, {m, R2}));
  BARO_RETURN_IF(expect_shape(op, "sin", sin, {m, R2}));
  BARO_CHECK(2 * R2 <= hd, op, "rotary dims 2*cos.shape[1]=" << 2 * R2 << " exceed head_dim=" << hd);
  BARO_RETURN_IF(expect_shape(op, "slot", slot, {m}));
  BARO_RETURN_IF(expect_shape(op, "pos", pos, {m}));
  BARO_RETURN_IF(expect_shape(op, "o (result)", o, {m, H * hd}));
  BARO_RETURN_IF(expect_shape(op, "k_pages (result)", k_out, {NP, page, Hkv, hd}));
  BARO_RETURN_IF(expect_shape(op, "v_pages (result)", v_out, {NP, page, Hkv, hd}));
  d = AttentionRowsDims{m, hd, P, T * page, Hkv, H, R2, NP, page, T};
  return ::xla::ffi::Error::Success();
}

struct LogSoftmaxDims {
  int64_t m, V;
};

inline ::xla::ffi::Error check_log_softmax(const ::xla::ffi::Buffer<::xla::ffi::F32>& x,
                                           const ::xla::ffi::Buffer<::xla::ffi::F32>& out, LogSoftmaxDims& d) {
  const char* op = "baro_log_softmax";
  BARO_RETURN_IF(expect_rank(op, "logits", x, 2));
  const int64_t m = x.dimensions()[0], V = x.dimensions()[1];
  BARO_CHECK(m >= 1 && V >= 1, op, "logits must have shape [m, V] with m, V >= 1, got " << dims_str(x.dimensions()));
  BARO_RETURN_IF(expect_shape(op, "out (result)", out, {m, V}));
  d = LogSoftmaxDims{m, V};
  return ::xla::ffi::Error::Success();
}

// The selection key of a logit: its bits mapped so that unsigned order is the IEEE total order
// (negatives reversed below the positives). Equal keys are equal bit patterns.
inline uint32_t topk_key(uint32_t bits) { return bits ^ ((bits >> 31) ? 0xffffffffu : 0x80000000u); }

struct TopkRowsDims {
  int64_t m, V, k;
};

inline ::xla::ffi::Error check_topk_rows(const ::xla::ffi::Buffer<::xla::ffi::F32>& x, int32_t k,
                                         const ::xla::ffi::Buffer<::xla::ffi::F32>& vals,
                                         const ::xla::ffi::Buffer<::xla::ffi::S32>& ids, TopkRowsDims& d) {
  const char* op = "baro_topk_rows";
  BARO_RETURN_IF(expect_rank(op, "logits", x, 2));
  const int64_t m = x.dimensions()[0], V = x.dimensions()[1];
  BARO_CHECK(m >= 1 && V >= 1, op, "logits must have shape [m, V] with m, V >= 1, got " << dims_str(x.dimensions()));
  BARO_CHECK(V <= 0x7fffffffLL, op, "V=" << V << " ids do not fit int32");
  BARO_CHECK(k >= 1 && k <= V, op, "k must be in [1, V=" << V << "], got " << k);
  BARO_RETURN_IF(expect_shape(op, "vals (result)", vals, {m, k}));
  BARO_RETURN_IF(expect_shape(op, "ids (result)", ids, {m, k}));
  d = TopkRowsDims{m, V, k};
  return ::xla::ffi::Error::Success();
}

}  // namespace baro
