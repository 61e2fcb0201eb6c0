// baro_attention's per-row arithmetic on CPU, shared by baro_attention (csrc/cpu/attention.cc,
// one sequence) and baro_attention_rows (csrc/cpu/attention_rows.cc, each row its own slot of
// a KV pool). Both kernels call these functions for every row, so a row's k/v cache bytes and
// its output depend only on its own inputs, its position and its cache: the order is
// docs/NUMERICS.md "CPU", attention.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "dot.h"

namespace baro {
namespace attn {

constexpr int64_t kBlock = 64;  // KV block, aligned to absolute positions

// t = (x * r) * (1 + w), r = 1/sqrt(dot(x,x)/hd + eps); then rotary on the
// first R dims (pairs j, j+R/2); result written to out (fp32).
inline void norm_rope(const float* x, const float* w, const float* c, const float* s, int64_t hd,
                      int64_t R2, float eps, float* out) {
  const float r = inv_rms(dot(x, x, hd), static_cast<float>(hd), eps);
  for (int64_t d = 0; d < hd; ++d) out[d] = (x[d] * r) * (1.0f + w[d]);
  for (int64_t j = 0; j < R2; ++j) {
    const float a = out[j], b = out[j + R2];
    out[j] = a * c[j] - b * s[j];
    out[j + R2] = b * c[j] + a * s[j];
  }
}

// One kv head of one row: k normed and rotated, k and v rounded to bf16, stored at kdst / vdst.
// tmp: hd floats.
inline void write_kv(const float* xk, const float* xv, const float* kw, const float* c, const float* s,
                     int64_t hd, int64_t R2, float eps, float* tmp, uint16_t* kdst, uint16_t* vdst) {
  norm_rope(xk, kw, c, s, hd, R2, eps, tmp);
  for (int64_t d = 0; d < hd; ++d) {
    kdst[d] = f32_to_bf16(tmp[d]);
    vdst[d] = f32_to_bf16(xv[d]);
  }
}

// Per-thread work buffers of attend_head.
struct HeadScratch {
  std::vector<float> qf, acc, pv, s;
  std::vector<uint16_t> q;
  explicit HeadScratch(int64_t hd) : qf(hd), acc(hd), pv(hd), s(kBlock), q(hd) {}
};

// One q head of one row at absolute position p: q from its query xq (normed, rotated, bf16),
// the online softmax over cache rows 0 .. p in blocks [64b, 64b + 64), then the gate.
// block(j0) gives (k, v): the head's kv head in cache row j0 of the block that starts there;
// the block's rows follow it row_stride elements apart (a contiguous cache, or one page of a
// paged pool: a page holds whole blocks, so the arithmetic and its order are the same).
template <class Block>
inline void attend_head_blocks(const float* xq, const float* gate, const float* qw, const float* c, const float* sn,
                               Block block, int64_t row_stride, int64_t p, int64_t hd, int64_t R2, float eps,
                               float scale, HeadScratch& w, uint16_t* orow) {
  norm_rope(xq, qw, c, sn, hd, R2, eps, w.qf.data());
  for (int64_t d = 0; d < hd; ++d) w.q[d] = f32_to_bf16(w.qf[d]);
  float* s = w.s.data();
  float* acc = w.acc.data();
  float* pv = w.pv.data();
  float mx = -std::numeric_limits<float>::infinity();
  float l = 0.0f;
  std::fill(acc, acc + hd, 0.0f);
  for (int64_t j0 = 0; j0 <= p; j0 += kBlock) {
    const int64_t nj = std::min(kBlock, p + 1 - j0);
    const auto kv = block(j0);
    const uint16_t* kb = kv.first;
    const uint16_t* vb = kv.second;
    float mb = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < nj; ++j) {
      s[j] = dot(w.q.data(), kb + j * row_stride, hd) * scale;
      mb = std::fmax(mb, s[j]);
    }
    const float mn = std::fmax(mx, mb);
    const float alpha = std::exp(mx - mn);
    float lb = 0.0f;
    for (int64_t j = 0; j < nj; ++j) {
      s[j] = std::exp(s[j] - mn);
      lb = lb + s[j];
    }
    for (int64_t d = 0; d < hd; ++d) pv[d] = dot(s, 1, vb + d, row_stride, nj);
    l = l * alpha + lb;
    for (int64_t d = 0; d < hd; ++d) acc[d] = acc[d] * alpha + pv[d];
    mx = mn;
  }
  for (int64_t d = 0; d < hd; ++d) orow[d] = f32_to_bf16((acc[d] / l) * sigmoid(gate[d]));
}

// attend_head_blocks on a contiguous cache: kbase / vbase point at the head's kv head in cache
// row 0 (row_stride elements per row).
inline void attend_head(const float* xq, const float* gate, const float* qw, const float* c, const float* sn,
                        const uint16_t* kbase, const uint16_t* vbase, int64_t row_stride, int64_t p,
                        int64_t hd, int64_t R2, float eps, float scale, HeadScratch& w, uint16_t* orow) {
  attend_head_blocks(
      xq, gate, qw, c, sn,
      [&](int64_t j0) { return std::make_pair(kbase + j0 * row_stride, vbase + j0 * row_stride); }, row_stride, p,
      hd, R2, eps, scale, w, orow);
}

}  // namespace attn
}  // namespace baro
