// baro_attention (CPU): q/k head RMSNorm, partial rotary, KV-cache write,
// causal online-softmax attention over 64-blocks aligned to absolute
// positions, output gate. See docs/FFI.md and docs/NUMERICS.md.
#include <limits>
#include <vector>

#include "attention_row.h"
#include "dot.h"
#include "contract.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error AttentionImpl(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> q_norm,
                         ffi::Buffer<ffi::F32> k_norm, ffi::Buffer<ffi::F32> cos,
                         ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::BF16> k_cache,
                         ffi::Buffer<ffi::BF16> v_cache, ffi::Buffer<ffi::S32> pos_buf,
                         ffi::Buffer<ffi::S32> n_valid_buf, float eps,
                         ffi::ResultBuffer<ffi::BF16> o,
                         ffi::ResultBuffer<ffi::BF16> k_out,
                         ffi::ResultBuffer<ffi::BF16> v_out) {
  const char* op = "baro_attention";
  baro::AttentionDims dims;
  if (auto err = baro::check_attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos_buf, n_valid_buf,
                                       *o, *k_out, *v_out, dims);
      err.failure())
    return err;
  BARO_RETURN_IF(baro::expect_eps(op, eps));
  const int64_t m = dims.m, hd = dims.hd, S = dims.S, Hkv = dims.Hkv, H = dims.H, R2 = dims.R2;
  const int64_t W = (2 * H + 2 * Hkv) * hd;  // qkv row width

  const int64_t pos = pos_buf.typed_data()[0];
  const int64_t n_valid = n_valid_buf.typed_data()[0];
  BARO_CHECK(pos >= 0, op, "pos must be >= 0, got " << pos);
  BARO_CHECK(n_valid >= 0 && n_valid <= m, op,
             "n_valid must be in [0, m=" << m << "], got " << n_valid);
  BARO_CHECK(pos + n_valid <= S, op,
             "pos + n_valid = " << pos << " + " << n_valid
                                << " exceeds the cache length S=" << S);

  baro::copy_if_not_aliased(k_cache, k_out);
  baro::copy_if_not_aliased(v_cache, v_out);
  uint16_t* kc = k_out->typed_data();
  uint16_t* vc = v_out->typed_data();
  uint16_t* op_ = o->typed_data();
  const float* x = qkv.typed_data();
  const float* qw = q_norm.typed_data();
  const float* kw = k_norm.typed_data();
  const float* cp = cos.typed_data();
  const float* sp = sin.typed_data();
  const int64_t row_stride = Hkv * hd;  // cache elements per position
  const int64_t group = H / Hkv;
  const float scale = baro::inv_sqrt_scale(hd);

  // 1. Normalise + rotate k, round k and v to bf16 and store them at pos+i.
  std::vector<float> tmp(hd);
  for (int64_t i = 0; i < n_valid; ++i) {
    const float* xr = x + i * W;
    const int64_t p = pos + i;
    for (int64_t g = 0; g < Hkv; ++g)
      baro::attn::write_kv(xr + 2 * H * hd + g * hd, xr + 2 * H * hd + Hkv * hd + g * hd, kw, cp + i * R2,
                           sp + i * R2, hd, R2, eps, tmp.data(), kc + p * row_stride + g * hd,
                           vc + p * row_stride + g * hd);
  }
  // Padded rows: output 0.
  for (int64_t i = n_valid; i < m; ++i)
    std::fill(op_ + i * H * hd, op_ + (i + 1) * H * hd, uint16_t{0});

  // 2. Attention per (row, q head); row i sees cache rows 0 .. pos+i.
  const double avg_ctx = static_cast<double>(pos) + 0.5 * n_valid + 1.0;
  baro::parallel_for(n_valid * H, 2.0 * avg_ctx * hd, [&](int64_t t0, int64_t t1) {
    baro::attn::HeadScratch w(hd);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i = t / H, h = t % H;
      const int64_t g = h / group;
      const float* xr = x + i * W;
      baro::attn::attend_head(xr + h * 2 * hd, xr + h * 2 * hd + hd, qw, cp + i * R2, sp + i * R2, kc + g * hd,
                              vc + g * hd, row_stride, pos + i, hd, R2, eps, scale, w, op_ + i * H * hd + h * hd);
    }
  });
  return ffi::Error::Success();
}

// baro_attention_small (m <= 16, custom_calls/attention.py): the scratch result is the GPU
// kernels' split partials; the CPU kernel needs none and leaves it unwritten.
ffi::Error AttentionSmallImpl(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> q_norm, ffi::Buffer<ffi::F32> k_norm,
                              ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::BF16> k_cache,
                              ffi::Buffer<ffi::BF16> v_cache, ffi::Buffer<ffi::S32> pos_buf,
                              ffi::Buffer<ffi::S32> n_valid_buf, float eps, ffi::ResultBuffer<ffi::BF16> o,
                              ffi::ResultBuffer<ffi::BF16> k_out, ffi::ResultBuffer<ffi::BF16> v_out,
                              ffi::ResultBuffer<ffi::U8>) {
  return AttentionImpl(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos_buf, n_valid_buf, eps, o, k_out, v_out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAttentionCpu, baro::KnobChecked<AttentionImpl>::Call, BARO_BIND_ATTENTION_ARGS(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAttentionSmallCpu, baro::KnobChecked<AttentionSmallImpl>::Call,
                              BARO_BIND_SCRATCH(BARO_BIND_ATTENTION_ARGS(ffi::Ffi::Bind())));
