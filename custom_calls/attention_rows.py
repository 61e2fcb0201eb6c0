"""baro_attention_rows: attention for m rows that each belong to their own sequence slot of a
paged KV pool (many sequences in one call, docs/DESIGN.md §10); row r's bytes are baro_attention's
one-row call on the contiguous cache its slot's pages stand for (docs/FFI.md "baro_attention_rows")."""

from __future__ import annotations

import jax
import numpy as np

from . import _check as C
from ._lib import check_gpu_limits, check_runnable, ffi_call_small, gpu_platform, refuse_unmet, round256

OP = "baro_attention_rows"
SPLIT = 512  # KV positions per split, fixed in absolute positions (csrc/gpu/attention_common.cuh kAttnSplit)
PAGE_MULTIPLE = 64  # a page holds whole KV blocks of the kernels (csrc/common/contract_rows.h kRowsPageMultiple)
PARALLEL_ROWS = 16  # rows up to which the GPU runs each row's splits in parallel (csrc/gpu/attention_rows.cu)
_PAIR_ROWS, _SMALL_PAIRS, _BIG_PAIRS = 16, 1, 4  # the CUDA decode tile (csrc/gpu/attention_fa.cuh fa_plan)


def row_scratch_bytes(S: int, H: int, Hkv: int, hd: int) -> int:
    """The CUDA split partials of one row: those of baro_attention's one-row call (fa_plan with
    m = 1: the row's G = H / Hkv q heads per kv head padded to a 16- or 64-row tile), rounded
    to 256 bytes. csrc/gpu/attention_rows.cu checks the scratch it gets against the same sum."""
    G = H // Hkv
    tr = _PAIR_ROWS * (_SMALL_PAIRS if G <= _PAIR_ROWS else _BIG_PAIRS)
    slots = Hkv * (-(-S // SPLIT)) * (-(-G // tr) * tr)
    return round256(round256(4 * slots * hd) + 4 * slots * 2)


def scratch_bytes(m: int, S: int, H: int, Hkv: int, hd: int) -> int:
    """The scratch result of a call: each row's split partials when m <= PARALLEL_ROWS (the
    splits run in parallel blocks, then the merge), else none (each row's splits run in order
    inside one block, with the same merge arithmetic: the same bits)."""
    return m * row_scratch_bytes(S, H, Hkv, hd) if m <= PARALLEL_ROWS else 0


def attention_rows(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, table, slot, pos, eps=1e-6):
    """Gated causal attention for m rows, row r the token of sequence slot[r] at absolute
    position pos[r], over paged KV pools.

    qkv[m, (2H+2Hkv)*hd] f32 (per q head [query hd | gate hd], then k, then v), q_norm[hd],
    k_norm[hd] f32 (zero-centred weights), cos/sin[m, R/2] f32 (row r's position's),
    k_pages/v_pages[NP, page, Hkv, hd] bf16 (page a multiple of 64), table[P, T] int32 (slot s's
    position j lives in page table[s, j // page], row j % page; -1: no page), slot[m] int32
    (-1: a padding row), pos[m] int32, eps (static). Returns (o[m, H*hd] bf16, k_pages, v_pages);
    the pages are updated in place.

    A slot's pages stand for a contiguous cache of S = T * page positions in which the
    positions of unmapped pages read as zeros. Every row's k/v is written to its position's page
    before any row attends; row r then attends to its slot's positions 0 .. pos[r] (rows of one
    slot at consecutive positions are a prefill chunk). o[r] and the written rows are the bytes
    of custom_calls.attention(qkv[r:r+1], q_norm, k_norm, cos[r:r+1], sin[r:r+1], k_cache,
    v_cache, pos[r], 1) on that contiguous cache, on the same platform: the KV splits stay at
    absolute positions. Padding rows write nothing and give o[r] = 0. Rows must not share a
    (slot, pos); a page must not be mapped twice.

    Bad input: on CPU a table entry outside [-1, NP), a page mapped twice, a slot outside
    [-1, P), a pos outside [0, S), a row whose position's page is unmapped or two rows at one
    (slot, pos) fail the call, before anything is written. On a GPU (nothing syncs to check
    them) a row with a bad slot or pos, or whose position's page is unmapped or out of range,
    writes nothing and its o row is NaN (poisoned, never out of bounds); other out-of-range
    table entries read as zeros; rows sharing a (slot, pos) race.
    """
    C.rank(OP, "qkv", qkv, 2)
    m, W = qkv.shape
    if m < 1:
        raise ValueError(f"{OP}: qkv must have at least one row, got shape {list(qkv.shape)}")
    C.array(OP, "qkv", qkv, (m, W), C.F32)
    C.rank(OP, "q_norm", q_norm, 1)
    hd = q_norm.shape[0]
    if hd < 1:
        raise ValueError(f"{OP}: q_norm must be non-empty (its length is head_dim)")
    C.array(OP, "q_norm", q_norm, (hd,), C.F32)
    C.array(OP, "k_norm", k_norm, (hd,), C.F32)
    C.rank(OP, "k_pages", k_pages, 4)
    NP, page, Hkv = k_pages.shape[:3]
    if NP < 1 or Hkv < 1:
        raise ValueError(f"{OP}: k_pages must have shape [NP, page, Hkv, hd] with NP, Hkv >= 1, "
                         f"got shape {list(k_pages.shape)}")
    if page < PAGE_MULTIPLE or page % PAGE_MULTIPLE:
        raise ValueError(f"{OP}: the page size k_pages.shape[1]={page} must be a positive multiple of "
                         f"{PAGE_MULTIPLE} (a page holds whole KV blocks of the kernels)")
    C.array(OP, "k_pages", k_pages, (NP, page, Hkv, hd), C.BF16, dtype_note=C.BF16_NOTE)
    C.array(OP, "v_pages", v_pages, (NP, page, Hkv, hd), C.BF16, dtype_note=C.BF16_NOTE)
    C.rank(OP, "table", table, 2)
    P, T = table.shape
    if P < 1 or T < 1:
        raise ValueError(f"{OP}: table must have shape [P, T] with P, T >= 1, got shape {list(table.shape)}")
    C.array(OP, "table", table, (P, T), np.int32)
    S = T * page
    if S >= 2 ** 31:
        raise ValueError(f"{OP}: table width {T} x page {page} positions exceed the int32 positions")
    if W % hd or W // hd <= 2 * Hkv or (W // hd - 2 * Hkv) % 2:
        raise ValueError(f"{OP}: qkv must have shape [m, (2*H + 2*Hkv)*hd] with hd={hd}, "
                         f"Hkv={Hkv} (from q_norm, k_pages), got shape {list(qkv.shape)}")
    H = (W // hd - 2 * Hkv) // 2
    if H % Hkv:
        raise ValueError(f"{OP}: number of q heads H={H} (from qkv width {W}) must be a "
                         f"multiple of Hkv={Hkv}")
    C.rank(OP, "cos", cos, 2)
    R2 = cos.shape[1]
    C.array(OP, "cos", cos, (m, R2), C.F32)
    C.array(OP, "sin", sin, (m, R2), C.F32)
    if 2 * R2 > hd:
        raise ValueError(f"{OP}: cos/sin must have shape [m, R/2] with R <= hd={hd}, "
                         f"got shape {list(cos.shape)}")
    C.array(OP, "slot", slot, (m,), np.int32)
    C.array(OP, "pos", pos, (m,), np.int32)
    eps = C.f32_attr(OP, "eps", eps)
    args = (qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, table, slot, pos)
    if gpu_platform(args) == "ROCM":
        refuse_unmet(OP, [(False, "the HIP kernel is not written yet (CUDA and CPU have it)")])
    check_gpu_limits(OP, args, [(hd % 16 == 0 and hd <= 256, f"head_dim={hd} (a multiple of 16, at most 256)"),
                                (H <= 65535, f"H={H} q heads (at most 65535)"),
                                (-(-S // SPLIT) <= 65535,
                                 f"a table of S={S} positions (at most 65535 splits of {SPLIT})"),
                                (m * max(1, -(-(H // Hkv) // 64)) < 2 ** 31, f"m={m} rows (the grid)")])
    check_runnable(OP, args)
    pages_t = jax.ShapeDtypeStruct((NP, page, Hkv, hd), C.BF16)
    outs = (jax.ShapeDtypeStruct((m, H * hd), C.BF16), pages_t, pages_t)
    return ffi_call_small(OP, outs, scratch_bytes(m, S, H, Hkv, hd), args, {5: 1, 6: 2}, eps=eps)
