// baro_attention_rows (CPU): m rows, row r the token of sequence slot[r] at absolute position
// pos[r], over paged KV pools: pages [NP, page, Hkv, hd] and one table [P, T] that maps a slot's
// position j to page table[slot][j / page], row j % page (-1: no page; its positions read as
// zeros). Every row runs baro_attention's per-row code (attention_row.h: the same functions, not
// a copy) and a page holds whole 64-position KV blocks, so row r's output and KV rows are the
// bytes of baro_attention(qkv[r:r+1], ..., cache, pos[r], 1) on the contiguous cache [T * page,
// Hkv, hd] the slot's pages stand for (docs/FFI.md).
#include <algorithm>
#include <utility>
#include <vector>

#include "attention_row.h"
#include "contract_rows.h"
#include "dot.h"
#include "ffi_util.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error AttentionRowsImpl(ffi::Buffer<ffi::F32> qkv, ffi::Buffer<ffi::F32> q_norm, ffi::Buffer<ffi::F32> k_norm,
                             ffi::Buffer<ffi::F32> cos, ffi::Buffer<ffi::F32> sin, ffi::Buffer<ffi::BF16> k_pages,
                             ffi::Buffer<ffi::BF16> v_pages, ffi::Buffer<ffi::S32> table_buf, ffi::Buffer<ffi::S32> slot_buf,
                             ffi::Buffer<ffi::S32> pos_buf, float eps, ffi::ResultBuffer<ffi::BF16> o,
                             ffi::ResultBuffer<ffi::BF16> k_out, ffi::ResultBuffer<ffi::BF16> v_out,
                             ffi::ResultBuffer<ffi::U8>) {
  const char* op = "baro_attention_rows";
  baro::AttentionRowsDims dims;
  if (auto err = baro::check_attention_rows(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, table_buf, slot_buf,
                                            pos_buf, *o, *k_out, *v_out, dims);
      err.failure())
    return err;
  BARO_RETURN_IF(baro::expect_eps(op, eps));
  const int64_t m = dims.m, hd = dims.hd, P = dims.P, S = dims.S, Hkv = dims.Hkv, H = dims.H, R2 = dims.R2;
  const int64_t NP = dims.NP, page = dims.page, T = dims.T;
  const int32_t* slot = slot_buf.typed_data();
  const int32_t* pos = pos_buf.typed_data();
  const int32_t* table = table_buf.typed_data();
  // Refused before anything is written: a bad table or row must not leave half a call in the pool.
  // A page mapped twice would let one slot's writes show up in another's cache.
  std::vector<std::pair<int32_t, int64_t>> mapped;
  for (int64_t e = 0; e < P * T; ++e) {
    BARO_CHECK(table[e] >= -1 && table[e] < NP, op,
               "table[" << e / T << ", " << e % T << "] = " << table[e] << " is outside [-1, NP=" << NP
                        << ") (-1 marks no page)");
    if (table[e] >= 0) mapped.emplace_back(table[e], e);
  }
  std::sort(mapped.begin(), mapped.end());
  for (size_t k = 1; k < mapped.size(); ++k)
    BARO_CHECK(mapped[k].first != mapped[k - 1].first, op,
               "page " << mapped[k].first << " is mapped twice: table[" << mapped[k - 1].second / T << ", "
                       << mapped[k - 1].second % T << "] and table[" << mapped[k].second / T << ", "
                       << mapped[k].second % T << "]");
  std::vector<std::pair<int64_t, int64_t>> used;
  used.reserve(m);
  for (int64_t r = 0; r < m; ++r) {
    BARO_CHECK(slot[r] >= -1 && slot[r] < P, op,
               "row " << r << ": slot " << slot[r] << " is outside [-1, P=" << P << ") (-1 marks a padding row)");
    if (slot[r] == -1) continue;
    BARO_CHECK(pos[r] >= 0 && pos[r] < S, op,
               "row " << r << " (slot " << slot[r] << "): pos " << pos[r] << " is outside [0, S=" << S << ")");
    BARO_CHECK(table[slot[r] * T + pos[r] / page] >= 0, op,
               "row " << r << " (slot " << slot[r] << "): pos " << pos[r] << " is in table[" << slot[r] << ", "
                      << pos[r] / page << "], which maps no page (-1): its k/v has nowhere to go");
    used.emplace_back(slot[r], pos[r]);
  }
  // Two rows writing one pool row would leave it to whichever ran last.
  std::sort(used.begin(), used.end());
  for (size_t k = 1; k < used.size(); ++k)
    BARO_CHECK(used[k] != used[k - 1], op,
               "two rows write slot " << used[k].first << " at pos " << used[k].second);

  baro::copy_if_not_aliased(k_pages, k_out);
  baro::copy_if_not_aliased(v_pages, v_out);
  uint16_t* kp = k_out->typed_data();
  uint16_t* vp = v_out->typed_data();
  uint16_t* out = o->typed_data();
  const float* x = qkv.typed_data();
  const float* qw = q_norm.typed_data();
  const float* kw = k_norm.typed_data();
  const float* cp = cos.typed_data();
  const float* sp = sin.typed_data();
  const int64_t W = (2 * H + 2 * Hkv) * hd;
  const int64_t row_stride = Hkv * hd;         // pool elements per position
  const int64_t page_stride = page * row_stride;  // pool elements per page
  // what the positions of an unmapped page read: zeros, as the prefill's gather gives them
  const std::vector<uint16_t> zero_page(page_stride, uint16_t{0});
  // element offset of position j of slot s (its page is mapped)
  auto at = [&](int64_t s, int64_t j) { return table[s * T + j / page] * page_stride + (j % page) * row_stride; };
  const int64_t group = H / Hkv;
  const float scale = baro::inv_sqrt_scale(hd);

  // 1. Every row's K/V first, so a row attends to the rows of its slot written by this call
  //    (a prefill chunk), as baro_attention's rows do.
  std::vector<float> tmp(hd);
  for (int64_t r = 0; r < m; ++r) {
    if (slot[r] < 0) continue;
    const float* xr = x + r * W;
    const int64_t base = at(slot[r], pos[r]);
    for (int64_t g = 0; g < Hkv; ++g)
      baro::attn::write_kv(xr + 2 * H * hd + g * hd, xr + 2 * H * hd + Hkv * hd + g * hd, kw, cp + r * R2,
                           sp + r * R2, hd, R2, eps, tmp.data(), kp + base + g * hd, vp + base + g * hd);
  }
  // 2. Per (row, q head): row r sees rows 0 .. pos[r] of its slot. Padding rows give zeros.
  double ctx = 0.0;
  for (int64_t r = 0; r < m; ++r) ctx += slot[r] < 0 ? 0.0 : static_cast<double>(pos[r]) + 1.0;
  baro::parallel_for(m * H, 2.0 * (ctx / m + 1.0) * hd, [&](int64_t t0, int64_t t1) {
    baro::attn::HeadScratch w(hd);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / H, h = t % H;
      uint16_t* orow = out + r * H * hd + h * hd;
      if (slot[r] < 0) {
        std::fill(orow, orow + hd, uint16_t{0});
        continue;
      }
      const int64_t g = h / group;
      const float* xr = x + r * W;
      const int64_t s = slot[r];
      // a 64-position block lies in one page (page % 64 == 0): its rows are row_stride apart
      auto block = [&](int64_t j0) {
        if (table[s * T + j0 / page] < 0) return std::make_pair(zero_page.data(), zero_page.data());
        const int64_t base = at(s, j0) + g * hd;
        return std::make_pair(static_cast<const uint16_t*>(kp + base), static_cast<const uint16_t*>(vp + base));
      };
      baro::attn::attend_head_blocks(xr + h * 2 * hd, xr + h * 2 * hd + hd, qw, cp + r * R2, sp + r * R2, block,
                                     row_stride, pos[r], hd, R2, eps, scale, w, orow);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BaroAttentionRowsCpu, AttentionRowsImpl,
                              BARO_BIND_ATTENTION_ROWS_ARGS(ffi::Ffi::Bind()));
