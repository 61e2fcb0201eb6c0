"""baro_attention: splits, padded chunks and donated caches give the same bytes and caches; GQA
tiles, long context, the CUDA decode copies and the wgmma prefill kernel, errors and runtime
checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import (BF16, EPS, J_ATT, J_ATT_DONATE, assert_close, assert_same_bits, bf16,
                                  f32, f64, i32, put, rbf16, ref_attention, ref_rmsnorm, rope_tables,
                                  sigmoid)
from kernel_util import (AT_H, AT_HD, AT_POS, COS, CPU, M_LIST, SIN, att_setup, platform, poison,
                         splits_for)


TABLES = (COS, SIN)


def att_run(dev, qkv, qn, kn, kc, vc, pos0, chunks, pad_to=None, rng=None, donate=False,
            tables=None):
    """Runs attention over the rows of qkv in the given chunks (row counts),
    carrying the caches; optionally pads every chunk to pad_to rows with garbage."""
    COS, SIN = tables if tables is not None else (TABLES[0], TABLES[1])
    fn = J_ATT_DONATE if donate else J_ATT
    kc_d, vc_d = put(dev, kc, vc)
    qn_d, kn_d = put(dev, qn, kn)
    outs = []
    r = 0
    for c in chunks:
        rows = qkv[r:r + c]
        cos, sin = COS[pos0 + r: pos0 + r + c], SIN[pos0 + r: pos0 + r + c]
        n = c
        if pad_to is not None and c < pad_to:
            extra = pad_to - c
            rows = np.concatenate([rows, f32(rng, extra, qkv.shape[1], scale=5.0)])
            cos = np.concatenate([cos, f32(rng, extra, COS.shape[1])])
            sin = np.concatenate([sin, f32(rng, extra, SIN.shape[1])])
        o, kc_d, vc_d = fn(put(dev, rows), qn_d, kn_d, *put(dev, cos, sin),
                           kc_d, vc_d, i32(pos0 + r), i32(n), eps=EPS)
        outs.append(np.asarray(o)[:c])
        r += c
    return np.concatenate(outs), np.asarray(kc_d), np.asarray(vc_d)


@pytest.mark.parametrize("m,pos0", [(m, AT_POS) for m in M_LIST] + [(5, 0), (64, 0), (64, 1000), (1, 1030)])
def test_attention(platform, m, pos0):
    rng = np.random.default_rng(400 + m + pos0)
    qkv, qn, kn, kc, vc = att_setup(rng, m, pos0)
    o_full, kc_full, vc_full = att_run(platform, qkv, qn, kn, kc, vc, pos0, [m])
    assert o_full.dtype == BF16 and o_full.shape == (m, AT_H * AT_HD)

    # bytes: every split (incl. one row per call) gives the same outputs and caches
    for name, chunks in splits_for(m, rng).items():
        o, k2, v2 = att_run(platform, qkv, qn, kn, kc, vc, pos0, chunks)
        assert_same_bits(o, o_full, f"attention o, split {name}, m={m}")
        assert_same_bits(k2, kc_full, f"attention k_cache, split {name}, m={m}")
        assert_same_bits(v2, vc_full, f"attention v_cache, split {name}, m={m}")
    # padded chunks (n_valid < rows), as a prefill with chunk 7 / one padded call
    for pad_chunk in (7, m + 5):
        chunks = [min(pad_chunk, m - r) for r in range(0, m, pad_chunk)]
        o, k2, v2 = att_run(platform, qkv, qn, kn, kc, vc, pos0, chunks, pad_to=pad_chunk, rng=rng)
        assert_same_bits(o, o_full, f"attention o, padded chunk {pad_chunk}, m={m}")
        assert_same_bits(k2, kc_full, f"attention k_cache, padded chunk {pad_chunk}, m={m}")
        assert_same_bits(v2, vc_full, f"attention v_cache, padded chunk {pad_chunk}, m={m}")
    # donated (truly in-place) caches give the same bytes
    o, k2, v2 = att_run(platform, qkv, qn, kn, kc, vc, pos0, [m], donate=True)
    assert_same_bits(o, o_full, "attention o, donated caches")
    assert_same_bits(k2, kc_full, "attention k_cache, donated caches")

    # untouched cache rows are unchanged (history and the NaN poison)
    for name, c_full, c0 in (("k", kc_full, kc), ("v", vc_full, vc)):
        assert_same_bits(c_full[:pos0], c0[:pos0], f"{name}_cache history rows")
        assert_same_bits(c_full[pos0 + m:], c0[pos0 + m:], f"{name}_cache rows past pos+m")
        assert not np.any(np.isnan(c_full[pos0:pos0 + m].astype(np.float32))), \
            f"{name}_cache rows pos..pos+m not all written"

    # values vs float64 reference
    o_ref, kc_ref, vc_ref = ref_attention(qkv, qn, kn, COS[pos0:pos0 + m], SIN[pos0:pos0 + m],
                                          kc, vc, pos0, m, AT_H, EPS)
    assert_close(kc_full[pos0:pos0 + m], kc_ref[pos0:pos0 + m], 2 ** -7, "k_cache vs float64")
    assert_same_bits(vc_full, vc_ref, "v_cache vs reference (plain bf16 cast)")
    assert_close(o_full, o_ref, 1e-2, "attention o vs float64")


# GQA shapes: the model's (G = 8 q heads per kv head, head_dim 256, rotary 64)
# and smaller ones. The CUDA kernel's tile rows are (token, q head of one kv
# group) pairs: 16-row tiles when m*G <= 16, 64-row tiles otherwise; the KV
# splits run in parallel blocks when m <= 16, serially inside a block when
# m > 16. Each case below reaches a different tile / mode, and the one-row
# calls always take the decode path (a 16-row tile, split-parallel).
AT_GQA = {"g8_hd256": (16, 2, 256, 32), "g4_hd64": (8, 2, 64, 16), "g1_hd64": (2, 2, 64, 8)}
AT_GQA_S = 1400
_GQA_TABLES = {}


def gqa_tables(R2):
    if R2 not in _GQA_TABLES:
        _GQA_TABLES[R2] = rope_tables(AT_GQA_S + 64, R2)
    return _GQA_TABLES[R2]


@pytest.mark.parametrize("cfg", list(AT_GQA))
@pytest.mark.parametrize("m,pos0", [(1, 1030), (2, 37), (5, 1021), (16, 100), (37, 1000), (300, 900)])
def test_attention_gqa(platform, cfg, m, pos0):
    H, Hkv, hd, R2 = AT_GQA[cfg]
    if platform.platform == "cpu" and m * H * hd > 300 * 8 * 64:
        pytest.skip("CPU: the model-size case with 300 one-row calls is slow, and the CPU "
                    "kernel's order is covered by the smaller cases")
    tables = gqa_tables(R2)
    rng = np.random.default_rng(900 + m + pos0 + hd + H)
    qkv, qn, kn, kc, vc = att_setup(rng, m, pos0, S=AT_GQA_S, shape=(H, Hkv, hd))
    run = lambda chunks, **kw: att_run(platform, qkv, qn, kn, kc, vc, pos0, chunks, tables=tables, **kw)
    o_full, kc_full, vc_full = run([m])
    assert o_full.shape == (m, H * hd)
    assert np.all(np.isfinite(o_full.astype(np.float32))), "attention o: non-finite values"

    splits = splits_for(m, rng)
    if m > 3:
        splits.pop("1+rest")  # "rest+1" and "random" already mix large and one-row calls
    for name, chunks in splits.items():
        o, k2, v2 = run(chunks)
        assert_same_bits(o, o_full, f"attention o, split {name}, {cfg}, m={m}")
        assert_same_bits(k2, kc_full, f"attention k_cache, split {name}, {cfg}, m={m}")
        assert_same_bits(v2, vc_full, f"attention v_cache, split {name}, {cfg}, m={m}")
    # one padded call (n_valid = m < rows): padding rows must come back as exact zeros
    pad = m + 5
    rows = np.concatenate([qkv, f32(rng, 5, qkv.shape[1], scale=5.0)])
    cos = np.concatenate([tables[0][pos0:pos0 + m], f32(rng, 5, R2)])
    sin = np.concatenate([tables[1][pos0:pos0 + m], f32(rng, 5, R2)])
    o, k2, v2 = J_ATT(*put(platform, rows, qn, kn, cos, sin, kc, vc), i32(pos0), i32(m), eps=EPS)
    o = np.asarray(o)
    assert o.shape == (pad, H * hd)
    assert_same_bits(o[:m], o_full, f"attention o, padded to {pad}, {cfg}")
    assert_same_bits(o[m:], np.zeros_like(o[m:]), f"attention padding rows, {cfg}")
    assert_same_bits(np.asarray(k2), kc_full, f"attention k_cache, padded to {pad}, {cfg}")
    assert_same_bits(np.asarray(v2), vc_full, f"attention v_cache, padded to {pad}, {cfg}")
    for name, c_full, c0 in (("k", kc_full, kc), ("v", vc_full, vc)):
        assert_same_bits(c_full[:pos0], c0[:pos0], f"{name}_cache history rows")
        assert_same_bits(c_full[pos0 + m:], c0[pos0 + m:], f"{name}_cache rows past pos+m")

    # values vs float64 reference (a few rows: the reference is a Python loop)
    sel = sorted({0, m // 2, m - 1})
    o_ref, _, _ = ref_attention(qkv, qn, kn, tables[0][pos0:pos0 + m], tables[1][pos0:pos0 + m],
                                kc, vc, pos0, m, H, EPS, rows=sel)
    assert_close(o_full[sel], o_ref[sel], 1e-2, f"attention o vs float64, {cfg}")


def test_attention_long_context(platform):
    """Decode at 128k context (256 KV splits in parallel blocks) equals the rows
    of one serial prefill call over the same positions (GPU only: on CPU a 128k
    float64 reference and caches of 2 x 128 MB are too slow for CI)."""
    if platform.platform == "cpu":
        pytest.skip("long context: GPU only")
    H, Hkv, hd, R2 = AT_GQA["g8_hd256"]
    S, m, pos0 = 131072, 24, 131072 - 30
    cos_t, sin_t = rope_tables(S, R2)
    rng = np.random.default_rng(12)
    qkv, qn, kn, kc, vc = att_setup(rng, m, pos0, S=S, shape=(H, Hkv, hd))
    o_full, kc_full, vc_full = att_run(platform, qkv, qn, kn, kc, vc, pos0, [m], tables=(cos_t, sin_t))
    o, k2, v2 = att_run(platform, qkv, qn, kn, kc, vc, pos0, [1] * m, tables=(cos_t, sin_t))
    assert_same_bits(o, o_full, "attention o at 128k, one row per call vs one call")
    assert_same_bits(k2, kc_full, "attention k_cache at 128k")
    assert_same_bits(v2, vc_full, "attention v_cache at 128k")
    # float64 values of the last row
    i = m - 1
    p = pos0 + i
    K, V = f64(kc_full[:p + 1]), f64(vc_full[:p + 1])
    W = qkv.shape[1]
    for h in range(H):
        g = h // (H // Hkv)
        x = f64(qkv[i, 2 * h * hd: 2 * h * hd + hd])
        t = ref_rmsnorm(x[None], qn, EPS)[0]
        c, s_ = f64(cos_t[p]), f64(sin_t[p])
        a, b = t[:R2].copy(), t[R2:2 * R2].copy()
        t[:R2], t[R2:2 * R2] = a * c - b * s_, b * c + a * s_
        sc = K[:, g] @ rbf16(t) / np.sqrt(hd)
        e = np.exp(sc - sc.max())
        att = (e / e.sum()) @ V[:, g]
        ref = att * sigmoid(f64(qkv[i, 2 * h * hd + hd: 2 * h * hd + 2 * hd]))
        assert_close(o_full[i, h * hd:(h + 1) * hd], ref, 1e-2, f"attention o at 128k, head {h}")
    assert W == (2 * H + 2 * Hkv) * hd


def test_attention_no_recompile_and_nvalid0(platform):
    rng = np.random.default_rng(5)
    qkv, qn, kn, kc, vc = att_setup(rng, 3, 10)
    f = jax.jit(cc.attention, static_argnames=("eps",))
    args = put(platform, qkv, qn, kn, COS[10:13], SIN[10:13], kc, vc)
    o1, k1, v1 = f(*args, i32(10), i32(3), eps=EPS)
    n_compiled = f._cache_size()
    f(*args, i32(11), i32(2), eps=EPS)
    assert f._cache_size() == n_compiled, "pos / n_valid changes must not recompile"
    # n_valid = 0 leaves the caches untouched
    _, k0, v0 = f(*args, i32(10), i32(0), eps=EPS)
    assert_same_bits(k0, kc, "k_cache after n_valid=0")
    assert_same_bits(v0, vc, "v_cache after n_valid=0")
    # Python ints are accepted for pos / n_valid (eager)
    o2, _, _ = cc.attention(*args, 10, 3, eps=EPS)
    assert_same_bits(o2, o1, "attention with Python int pos")


def test_attention_errors(platform):
    rng = np.random.default_rng(6)
    qkv, qn, kn, kc, vc = att_setup(rng, 3, 4, S=16)
    cos, sin = COS[:3], SIN[:3]
    a = put(platform, qkv, qn, kn, cos, sin, kc, vc)
    with pytest.raises(ValueError, match=r"baro_attention: qkv must have shape \[m, \(2\*H \+ 2\*Hkv\)\*hd\]"):
        cc.attention(a[0][:, :-AT_HD], *a[1:], 4, 3)
    with pytest.raises(ValueError, match=r"baro_attention: k_cache must have dtype bfloat16.*got dtype float32"):
        cc.attention(*a[:5], a[5].astype(jnp.float32), a[6], 4, 3)
    with pytest.raises(ValueError, match=r"baro_attention: v_cache must have shape \[16, 2, 32\], got shape \[16, 2, 16\]"):
        cc.attention(*a[:6], a[6][..., :16], 4, 3)
    with pytest.raises(ValueError, match=r"baro_attention: sin must have shape \[3, 8\]"):
        cc.attention(*a[:4], a[4][:2], *a[5:], 4, 3)
    with pytest.raises(ValueError, match=r"baro_attention: qkv must have dtype float32"):
        cc.attention(a[0].astype(jnp.bfloat16), *a[1:], 4, 3)
    with pytest.raises(ValueError, match=r"baro_attention: pos must be an int32 scalar, got dtype float32"):
        cc.attention(*a, jnp.float32(4), 3)
    with pytest.raises(ValueError, match=r"baro_attention: n_valid must be a scalar"):
        cc.attention(*a, 4, jnp.array([3], jnp.int32))


def test_attention_runtime_checks():
    """Value checks done by the CPU handler (GPU kernels cannot check traced
    values without a sync, so this runs on CPU only)."""
    rng = np.random.default_rng(7)
    qkv, qn, kn, kc, vc = att_setup(rng, 3, 4, S=16)
    a = put(CPU, qkv, qn, kn, COS[:3], SIN[:3], kc, vc)
    with pytest.raises(Exception, match=r"pos \+ n_valid = 14 \+ 3 exceeds the cache length S=16"):
        J_ATT(*a, i32(14), i32(3), eps=EPS)[0].block_until_ready()
    with pytest.raises(Exception, match=r"n_valid must be in \[0, m=3\], got 4"):
        J_ATT(*a, i32(0), i32(4), eps=EPS)[0].block_until_ready()
    with pytest.raises(Exception, match=r"pos must be >= 0, got -1"):
        J_ATT(*a, i32(-1), i32(1), eps=EPS)[0].block_until_ready()


# The decode tile (m <= 16 rows of one kv group) runs two copies of its warp pair on CUDA, each
# accumulating P V for its half of the pair's head dims from the same S, maxima and sums
# (BARO_ATTN_DUP=1: one copy): the same bytes, for the compiled-in head dim (256) and a run-time
# one (64), inside the first split and past several, with a padded row (n_valid < m); and with
# the split kernel and merge launched as programmatic dependents (BARO_PDL=1).
@pytest.mark.parametrize("hd", [64, 256])
def test_attention_decode_copies_same_bytes(platform, hd, monkeypatch):
    if platform.platform == "cpu":
        pytest.skip("BARO_ATTN_DUP picks between two CUDA launch shapes")
    rng = np.random.default_rng(1700 + hd)
    H, Hkv, S = 4, 2, 3000
    for m, nv in ((1, 1), (2, 2), (3, 2)):
        qkv = (rng.standard_normal((m, (2 * H + 2 * Hkv) * hd)) * 0.5).astype(np.float32)
        qn = (rng.standard_normal(hd) * 0.1).astype(np.float32)
        kn = (rng.standard_normal(hd) * 0.1).astype(np.float32)
        cos = rng.standard_normal((m, hd // 4)).astype(np.float32)
        sin = rng.standard_normal((m, hd // 4)).astype(np.float32)
        kc, vc = bf16(rng, S, Hkv, hd), bf16(rng, S, Hkv, hd)
        for pos in (0, 700, 2500):
            got = {}
            for knob in ("0", "1", "pdl"):  # pdl: two copies, the split kernel and merge as dependent launches
                monkeypatch.setenv("BARO_ATTN_DUP", "0" if knob == "pdl" else knob)
                monkeypatch.setenv("BARO_PDL", "1" if knob == "pdl" else "0")
                poison(platform, (m, H * hd), jnp.bfloat16)
                f = jax.jit(lambda *a: cc.attention(*a))  # a fresh jit: the launcher reads the knob
                o, k2, v2 = f(*put(platform, qkv, qn, kn, cos, sin, kc, vc), np.int32(pos), np.int32(nv))
                got[knob] = [np.asarray(x) for x in (o, k2, v2)]
            assert np.all(np.isfinite(np.asarray(got["0"][0], np.float32))), f"hd={hd} m={m} pos={pos}"
            for other, name in (("1", "two copies vs one"), ("pdl", "BARO_PDL=1 vs plain launches")):
                for a, b, what in zip(got["0"], got[other], ("out", "k_cache", "v_cache")):
                    assert_same_bits(a, b, f"attention hd={hd} m={m} n_valid={nv} pos={pos} {what}: {name}")
    monkeypatch.delenv("BARO_ATTN_DUP", raising=False)
    monkeypatch.delenv("BARO_PDL", raising=False)


# The Hopper prefill kernel (BARO_ATTN_WGMMA, attention_wgmma.cu: wgmma, sm_90a; the default there)
# must give the mma.sync prefill kernel's bytes (BARO_ATTN_WGMMA=0) and so the decode path's, row for row: the model's G = 8 at
# head_dim 256 and G = 4 at 128 / 64, positions from 0 to past several 512-position splits, tiles
# with padding rows (m = 5, 300) and a padded call (n_valid < rows). m <= 16 runs the decode tiles
# whatever the knob says; those cases only check that the knob leaves them alone. pipe "1": the
# same under BARO_ATTN_PIPE=1 (each block's S issued a block early; TMA head dims 128 and 256,
# the rings at 64 ignore it) and 2 (also each block's P V left running through the next block's
# softmax, the split merge's O in scratch).
AT_WGMMA = {"g8_hd256": (16, 2, 256, 32), "g4_hd128": (8, 2, 128, 32), "g4_hd64": (8, 2, 64, 16)}
AT_WGMMA_S = 2900


@pytest.mark.parametrize("pipe", ["0", "1", "2"])
@pytest.mark.parametrize("cfg", list(AT_WGMMA))
def test_attention_wgmma_same_bytes(platform, cfg, pipe, monkeypatch):
    if platform.platform == "cpu":
        pytest.skip("BARO_ATTN_WGMMA picks a CUDA kernel")
    # skip only on a GPU known not to be sm_90: a missing or differently spelled attribute runs the
    # test, where BARO_ATTN_WGMMA=require turns a fallback into an error instead of a vacuous pass
    cap = str(getattr(platform, "compute_capability", "") or "")
    if cap and cap.replace(".", "") != "90":
        pytest.skip(f"the wgmma kernel runs on sm_90 only, this GPU is {cap} (elsewhere the knob falls back)")
    H, Hkv, hd, R2 = AT_WGMMA[cfg]
    tables = rope_tables(AT_WGMMA_S + 64, R2)

    def call(knob, rows, cos, sin, kc, vc, pos0, nv):
        monkeypatch.setenv("BARO_ATTN_WGMMA", knob)  # require: an error where it would fall back
        monkeypatch.setenv("BARO_ATTN_PIPE", pipe if knob != "0" else "0")
        poison(platform, (rows.shape[0], H * hd), jnp.bfloat16)
        f = jax.jit(lambda *a: cc.attention(*a, eps=EPS))  # a fresh jit: the launcher reads the knob
        out = f(*put(platform, rows, qn, kn, cos, sin, kc, vc), i32(pos0), i32(nv))
        return [np.asarray(x) for x in out]

    for m in M_LIST:
        for pos0 in (0, 37, 1000, 2500):
            rng = np.random.default_rng(2100 + m + pos0 + hd)
            qkv, qn, kn, kc, vc = att_setup(rng, m, pos0, S=AT_WGMMA_S, shape=(H, Hkv, hd))
            cos, sin = tables[0][pos0:pos0 + m], tables[1][pos0:pos0 + m]
            what = f"attention {cfg} m={m} pos={pos0}"
            want = call("0", qkv, cos, sin, kc, vc, pos0, m)
            got = call("require" if m > 16 else "1", qkv, cos, sin, kc, vc, pos0, m)
            assert np.all(np.isfinite(got[0].astype(np.float32))), f"{what}: non-finite o"
            for a, b, name in zip(got, want, ("out", "k_cache", "v_cache")):
                assert_same_bits(a, b, f"{what} {name}: BARO_ATTN_WGMMA vs the default")
            monkeypatch.delenv("BARO_ATTN_WGMMA", raising=False)
            one = att_run(platform, qkv, qn, kn, kc, vc, pos0, [1] * m, tables=tables)
            for a, b, name in zip(got, one, ("out", "k_cache", "v_cache")):
                assert_same_bits(a, b, f"{what} {name}: BARO_ATTN_WGMMA vs one row per call")
            if m > 16:  # a padded call: rows >= n_valid are garbage and come back as zeros
                pad = 5
                rows = np.concatenate([qkv, f32(rng, pad, qkv.shape[1], scale=5.0)])
                cos_p = np.concatenate([cos, f32(rng, pad, R2)])
                sin_p = np.concatenate([sin, f32(rng, pad, R2)])
                want = call("0", rows, cos_p, sin_p, kc, vc, pos0, m)
                got = call("require", rows, cos_p, sin_p, kc, vc, pos0, m)
                for a, b, name in zip(got, want, ("out", "k_cache", "v_cache")):
                    assert_same_bits(a, b, f"{what} padded {name}: BARO_ATTN_WGMMA vs the default")
                for a, b, name in zip((got[0][:m], got[1], got[2]), one, ("out", "k_cache", "v_cache")):
                    assert_same_bits(a, b, f"{what} padded {name}: vs one row per call")
                assert_same_bits(got[0][m:], np.zeros_like(got[0][m:]), f"{what} padding rows")
    monkeypatch.delenv("BARO_ATTN_WGMMA", raising=False)
    monkeypatch.delenv("BARO_ATTN_PIPE", raising=False)
