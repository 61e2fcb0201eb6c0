"""Checks over several ops: the small (command-buffer) ops against the allocator ops, values
against baro_jax.ops_xla, the C++ handlers' own shape checks, the GPU limits refused before the
call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import EPS, assert_close, assert_same_bits, bf16, f32, i32, put
from kernel_util import (AT_H, AT_HKV, AT_POS, COS, CPU, CV_C, DT_DK, DT_NK, GN_DV, GN_NV, MM_K, MM_N,
                         MO_D, MO_K, NORM_D, SIN, att_setup, delta_setup, moe_weights,
                         moe_weights_sized, platform, poison)


def test_handler_validates_shapes():
    """The C++ handlers validate shapes themselves (bypassing the Python checks)."""
    with jax.default_device(CPU):
        _handler_validates_shapes()


def _handler_validates_shapes():
    x = jnp.zeros((3, 8), jnp.bfloat16)
    w = jnp.zeros((5, 7), jnp.bfloat16)
    call = jax.ffi.ffi_call("baro_matmul", jax.ShapeDtypeStruct((3, 5), jnp.float32))
    with pytest.raises(Exception, match=r"baro_matmul: w must have shape \[N, K\] with K = x.shape\[1\] = 8, got \[5, 7\]"):
        call(x, w, bf16_cols=np.int64(0)).block_until_ready()
    w = jnp.zeros((5, 8), jnp.bfloat16)
    for bad in (3, -2, 6):  # odd, negative, past N = 5
        with pytest.raises(Exception, match=rf"baro_matmul: bf16_cols must be even and in \[0, N=5\], got {bad}"):
            call(x, w, bf16_cols=np.int64(bad)).block_until_ready()
    st = jnp.zeros((4, 16, 16), jnp.float32)
    call = jax.ffi.ffi_call("baro_delta", (jax.ShapeDtypeStruct((2, 4, 16), jnp.float32), st))
    y = jnp.zeros((2, 100), jnp.float32)
    cols = dict(b_col=np.int64(0), a_col=np.int64(0), rows=np.int64(0))
    with pytest.raises(Exception, match=r"baro_delta: y width 100 must be 2\*nk\*dk \+ nv\*dv"):
        call(y, jnp.zeros((2, 4)), jnp.zeros((2, 4)), jnp.zeros(4), jnp.zeros(4), st,
             jnp.int32(2), **cols)[0].block_until_ready()
    # the gate columns, past the Python checks: b's nv = 4 gates from column 3 of a [2, 6] array
    y = jnp.zeros((2, 2 * 1 * 16 + 4 * 16), jnp.float32)
    with pytest.raises(Exception, match=r"baro_delta: b must have shape \[2, W\] with b_col \+ nv <= W "
                                        r"\(b_col=3, nv=4\), got \[2, 6\]"):
        call(y, jnp.zeros((2, 6)), jnp.zeros((2, 4)), jnp.zeros(4), jnp.zeros(4), st,
             jnp.int32(2), b_col=np.int64(3), a_col=np.int64(0), rows=np.int64(0))[0].block_until_ready()
    call = jax.ffi.ffi_call("baro_gated_norm", jax.ShapeDtypeStruct((2, 8), jnp.bfloat16))
    with pytest.raises(Exception, match=r"baro_gated_norm: z must have shape \[2, W\] with z_col \+ nv\*dv <= W "
                                        r"\(z_col=5, nv\*dv=8\), got shape \[2, 12\]"):
        call(jnp.zeros((2, 2, 4)), jnp.zeros((2, 12)), jnp.zeros(4), eps=np.float32(1e-6),
             z_col=np.int64(5)).block_until_ready()
    call = jax.ffi.ffi_call("baro_conv_proj", (jax.ShapeDtypeStruct((2, 8), jnp.float32),
                                               jax.ShapeDtypeStruct((3, 8), jnp.bfloat16)))
    with pytest.raises(Exception, match=r"baro_conv_proj: x must have at least C=8 columns \(C from w\), "
                                        r"got shape \[2, 6\]"):
        call(jnp.zeros((2, 6)), jnp.zeros((8, 4), jnp.bfloat16), jnp.zeros((3, 8), jnp.bfloat16),
             jnp.int32(2), rows=np.int64(0), packed=np.int64(0))[0].block_until_ready()


# Calls of <= 16 rows (decode) go through the _small ops (their GPU scratch is a result
# buffer, so the handlers allocate nothing and may run inside XLA's command buffers);
# BARO_CMDBUF_OPS=0 puts them on the allocator ops. Same kernels, so the same bytes.
@pytest.mark.parametrize("m", [1, 2, 16])
def test_small_ops_equal_allocator_ops(platform, m, monkeypatch):
    rng = np.random.default_rng(1500 + m)
    E, D, I, Is, k = 8, 256, 64, 64, 3
    h = bf16(rng, m, D)
    wd = put(platform, *moe_weights_sized(rng, E, D, I, Is))
    outs = {}
    for knob in ("1", "0"):
        monkeypatch.setenv("BARO_CMDBUF_OPS", knob)
        poison(platform, (m, D))  # a fresh jit per setting: the wrapper picks the op when traced
        outs[knob] = np.asarray(jax.jit(lambda *a: cc.moe(*a, top_k=k))(put(platform, h), *wd))
        hlo = jax.jit(lambda *a: cc.moe(*a, top_k=k)).lower(put(platform, h), *wd).as_text()
        assert ("baro_moe_small" in hlo) == (knob == "1"), f"m={m} BARO_CMDBUF_OPS={knob}: wrong op in the HLO"
    assert np.all(np.isfinite(outs["1"]))
    assert_same_bits(outs["1"], outs["0"], f"moe m={m}: small op vs allocator op")
    # attention: a decode-shaped call at a position past several 512-position splits
    H, Hkv, hd, S = 4, 2, 64, 3000
    qkv = (rng.standard_normal((m, (2 * H + 2 * Hkv) * hd)) * 0.5).astype(np.float32)
    qn, kn = (rng.standard_normal(hd) * 0.1).astype(np.float32), (rng.standard_normal(hd) * 0.1).astype(np.float32)
    cos = rng.standard_normal((m, hd // 4)).astype(np.float32)
    sin = rng.standard_normal((m, hd // 4)).astype(np.float32)
    kc, vc = bf16(rng, S, Hkv, hd), bf16(rng, S, Hkv, hd)
    pos = np.int32(2500)
    got = {}
    for knob in ("1", "0"):
        monkeypatch.setenv("BARO_CMDBUF_OPS", knob)
        f = jax.jit(lambda *a: cc.attention(*a))
        o, k2, v2 = f(*put(platform, qkv, qn, kn, cos, sin, kc, vc), pos, np.int32(m))
        got[knob] = [np.asarray(x) for x in (o, k2, v2)]
    for a, b, what in zip(got["1"], got["0"], ("o", "k_cache", "v_cache")):
        assert_same_bits(a, b, f"attention m={m} {what}: small op vs allocator op")
    monkeypatch.delenv("BARO_CMDBUF_OPS", raising=False)


@pytest.mark.parametrize("op", ["matmul", "rmsnorm", "gated_norm", "attention", "conv",
                                "delta", "moe"])
def test_vs_ops_xla(platform, op):
    import baro_jax.ops_xla as X
    rng = np.random.default_rng(800)
    m = 9
    if op == "matmul":
        a = put(platform, bf16(rng, m, MM_K), bf16(rng, MM_N, MM_K))
        assert_close(cc.matmul(*a), X.matmul(*a), 1e-5, "matmul vs ops_xla")
    elif op == "rmsnorm":
        a = put(platform, f32(rng, m, NORM_D), f32(rng, NORM_D, scale=0.2))
        assert_close(cc.rmsnorm(*a, EPS), X.rmsnorm(*a, EPS), 2 ** -7, "rmsnorm vs ops_xla")
    elif op == "gated_norm":
        a = put(platform, f32(rng, m, GN_NV, GN_DV), f32(rng, m, GN_NV * GN_DV), f32(rng, GN_DV))
        assert_close(cc.gated_norm(*a, EPS), X.gated_norm(*a, EPS), 2 ** -6, "gated_norm vs ops_xla")
    elif op == "attention":
        qkv, qn, kn, kc, vc = att_setup(rng, m, AT_POS)
        # ops_xla attends over the whole cache with a mask, so unwritten rows must
        # be finite there (the engine zero-initialises caches); no NaN poison here.
        kc[AT_POS:], vc[AT_POS:] = 0, 0
        a = put(platform, qkv, qn, kn, COS[AT_POS:AT_POS + m], SIN[AT_POS:AT_POS + m], kc, vc)
        got = cc.attention(*a, i32(AT_POS), i32(m), eps=EPS)
        ref = X.attention(*a, i32(AT_POS), i32(m), num_heads=AT_H, num_kv_heads=AT_HKV, eps=EPS)
        assert_close(got[0], ref[0], 2e-2, "attention o vs ops_xla")
        sl = slice(AT_POS, AT_POS + m)
        assert_close(np.asarray(got[1])[sl], np.asarray(ref[1])[sl], 2 ** -7, "k_cache vs ops_xla")
    elif op == "conv":
        a = put(platform, bf16(rng, m, CV_C), bf16(rng, CV_C, 4, scale=0.5), bf16(rng, 3, CV_C))
        got, ref = cc.conv(*a, i32(m)), X.conv(*a, i32(m))
        assert_close(got[0], ref[0], 1e-5, "conv y vs ops_xla")
        assert_same_bits(got[1], ref[1], "conv window vs ops_xla")
    elif op == "delta":
        a = put(platform, *delta_setup(rng, m))
        got, ref = cc.delta(*a, i32(m)), X.delta(*a, i32(m), nk=DT_NK, dk=DT_DK)
        assert_close(got[0], ref[0], 1e-4, "delta o vs ops_xla")
        assert_close(got[1], ref[1], 1e-4, "delta state vs ops_xla")
    elif op == "moe":
        h = put(platform, bf16(rng, m, MO_D))
        w = put(platform, *moe_weights(rng))
        assert_close(cc.moe(h, *w, MO_K), X.moe(h, *w, top_k=MO_K), 1e-3, "moe vs ops_xla")


def test_gpu_limits_are_refused_before_the_call(monkeypatch):
    """What only the CPU kernels can run is refused in Python when the call goes to a GPU, each
    limit named (a GPU handler's error inside command-buffer capture would crash the process);
    the same shapes still trace for the CPU."""
    import importlib
    lib = importlib.import_module("custom_calls._lib")
    S = jax.ShapeDtypeStruct
    f32, b16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
    one = S((), i32)
    hd, H, Hkv, m = 24, 4, 2, 3  # head_dim 24: not a multiple of 16

    def attention():
        return cc.attention(S((m, (2 * H + 2 * Hkv) * hd), f32), S((hd,), f32), S((hd,), f32), S((m, 4), f32),
                            S((m, 4), f32), S((32, Hkv, hd), b16), S((32, Hkv, hd), b16), one, one)

    nv, nk, dk, dv = 4, 2, 24, 16
    y, g = S((m, 2 * nk * dk + nv * dv), f32), S((m, nv), f32)

    def delta():
        return cc.delta(y, g, g, S((nv,), f32), S((nv,), f32), S((nv, dk, dv), f32), one)

    def delta_blocked():
        y2 = S((m, 2 * nk * 32 + nv * 130), f32)
        return cc.delta_blocked(y2, g, g, S((nv,), f32), S((nv,), f32), S((nv, 32, 130), f32), S((nv, 65, 32), f32),
                                S((nv, 65, 130), f32), S((nv, 65), f32), one, one)

    E, D = 9000, 16

    def route():
        return cc.moe_route(S((m, D), b16), S((E, D), b16), 2)

    cases = [(attention, r"baro_attention: the GPU kernel cannot run this call: head_dim=24 \(a multiple of 16"),
             (delta, r"baro_delta: the GPU kernel cannot run this call: dk=24 \(key head dims 16, 32, 64, 128\)"),
             (delta_blocked, r"baro_delta_blocked: .*dv=130 \(value head dims up to 128\); B=65 \(blocks"),
             (route, r"baro_moe_route: the GPU kernel cannot run this call: E=9000 experts \(at most 8192\)")]
    for fn, _ in cases:  # on the CPU they trace (a fresh lambda each time: eval_shape caches traces)
        jax.eval_shape(lambda: fn())
    monkeypatch.setattr(lib, "gpu_platform", lambda args: "CUDA")
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            jax.eval_shape(lambda: fn())
