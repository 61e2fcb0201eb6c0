"""Hostile inputs to the custom calls (issue 28): each is refused with a message naming what is
wrong, in the Python wrapper and, past it, in the C++ handler; none aborts the process or reads
memory it should not."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import bf16, f32

ROOT = Path(__file__).resolve().parents[1]
CPU = jax.devices("cpu")[0]


def run_py(code: str, env: dict | None = None, timeout: int = 240):
    e = dict(os.environ)
    e.pop("BARO_CPU_THREADS", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=e,
                          cwd=ROOT, timeout=timeout)


# ---- BARO_CPU_THREADS ----

def test_cpu_threads_that_cannot_start_run_on_the_calling_thread():
    """With the address space capped below what a thread stack needs, the threads parallel_for
    asks for cannot start: before, `terminate called without an active exception`; now the rows
    of the threads that did not start run on the calling thread, with the bytes of one thread."""
    r = run_py("""
        import os, resource, threading
        import numpy as np, jax, jax.numpy as jnp
        import custom_calls as cc
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((64, 512), dtype=np.float32)).astype(jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((512, 512), dtype=np.float32)).astype(jnp.bfloat16)
        f = jax.jit(cc.matmul)
        os.environ["BARO_CPU_THREADS"] = "1"
        want = np.asarray(f(x, w))
        os.environ["BARO_CPU_THREADS"] = "4096"  # capped at 4 x the hardware threads
        vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))
        try:  # the limit bites: no thread can start
            t = threading.Thread(target=lambda: None); t.start(); t.join(); print("a thread started")
        except RuntimeError:
            print("threads refused")
        got = np.asarray(f(x, w))
        print("same bytes", got.tobytes() == want.tobytes())
    """)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "terminate called" not in r.stderr
    assert r.stdout.split() == ["threads", "refused", "same", "bytes", "True"], r.stdout


@pytest.mark.parametrize("value", ["100000", "-1", "0", "many", "2.5"])
def test_cpu_threads_out_of_range_is_an_error_naming_it(value, monkeypatch):
    x, w = jnp.zeros((3, 8), jnp.bfloat16), jnp.zeros((5, 8), jnp.bfloat16)
    monkeypatch.setenv("BARO_CPU_THREADS", value)
    with pytest.raises(ValueError, match=rf"baro_matmul: BARO_CPU_THREADS must be an integer in \[1, 4096\], "
                                         rf"got '{value}'"):
        cc.matmul(x, w)


def test_cpu_threads_any_count_gives_the_same_bytes(monkeypatch):
    rng = np.random.default_rng(1)
    x, w = jnp.asarray(bf16(rng, 37, 300)), jnp.asarray(bf16(rng, 650, 300))
    outs = []
    for n in ("1", "2", "3", "4096"):
        monkeypatch.setenv("BARO_CPU_THREADS", n)
        outs.append(np.asarray(jax.jit(cc.matmul)(x, w)).tobytes())
    assert len(set(outs)) == 1


# ---- eps ----

BAD_EPS = [float("nan"), -1e-6, float("inf"), 1e39, True, "1e-6"]


def norm_calls(eps):
    x, w = jnp.ones((3, 8), jnp.float32), jnp.ones((8,), jnp.float32)
    o, z, gw = jnp.ones((3, 2, 4), jnp.float32), jnp.ones((3, 8), jnp.float32), jnp.ones((4,), jnp.float32)
    return {"baro_rmsnorm": lambda: cc.rmsnorm(x, w, eps), "baro_add_rmsnorm": lambda: cc.add_rmsnorm(x, x, w, eps),
            "baro_gated_norm": lambda: cc.gated_norm(o, z, gw, eps),
            "baro_attention": lambda: cc.attention(jnp.ones((1, 12 * 16), jnp.float32), jnp.ones((16,)), jnp.ones((16,)),
                                                   jnp.ones((1, 4)), jnp.ones((1, 4)), jnp.zeros((8, 2, 16), jnp.bfloat16),
                                                   jnp.zeros((8, 2, 16), jnp.bfloat16), 0, 1, eps=eps)}


@pytest.mark.parametrize("eps", BAD_EPS, ids=repr)
def test_wrappers_refuse_bad_eps(eps):
    for op, call in norm_calls(eps).items():
        with pytest.raises(ValueError, match=rf"^{op}: eps must be a (finite number >= 0 \(in float32\)|real number), "
                                             rf"got "):
            call()


def test_wrappers_take_eps_zero_and_small():
    for eps in (0.0, 1e-6, np.float32(1e-5), 1):
        for call in norm_calls(eps).values():
            jax.block_until_ready(call())


@pytest.mark.parametrize("eps", [np.float32("nan"), np.float32(-1e-6), np.float32("-inf")], ids=repr)
def test_handlers_refuse_bad_eps(eps):
    """Past the wrappers, a direct ffi_call: the handler returns InvalidArgument naming eps."""
    S = jax.ShapeDtypeStruct
    x, w = jnp.ones((3, 8), jnp.float32), jnp.ones((8,), jnp.float32)
    calls = {
        "baro_rmsnorm": lambda: jax.ffi.ffi_call("baro_rmsnorm", S((3, 8), jnp.bfloat16))(x, w, eps=eps),
        "baro_add_rmsnorm": lambda: jax.ffi.ffi_call("baro_add_rmsnorm", (S((3, 8), jnp.float32),
                                                                          S((3, 8), jnp.bfloat16)))(x, x, w, eps=eps),
        "baro_gated_norm": lambda: jax.ffi.ffi_call("baro_gated_norm", S((3, 8), jnp.bfloat16))(
            jnp.ones((3, 2, 4)), jnp.ones((3, 8)), jnp.ones((4,)), eps=eps, z_col=np.int64(0)),
        "baro_attention": lambda: jax.ffi.ffi_call("baro_attention", (S((1, 64), jnp.bfloat16), S((8, 2, 16), jnp.bfloat16),
                                                                      S((8, 2, 16), jnp.bfloat16)))(
            jnp.ones((1, 12 * 16)), jnp.ones((16,)), jnp.ones((16,)), jnp.ones((1, 4)), jnp.ones((1, 4)),
            jnp.zeros((8, 2, 16), jnp.bfloat16), jnp.zeros((8, 2, 16), jnp.bfloat16), jnp.int32(0), jnp.int32(1),
            eps=eps),
    }
    with jax.default_device(CPU):
        for op, call in calls.items():
            with pytest.raises(Exception, match=rf"{op}: eps must be a finite number >= 0, got "):
                jax.block_until_ready(call())


# ---- attention positions ----

def att_args(S=16):
    return (jnp.ones((2, 12 * 16), jnp.float32), jnp.ones((16,)), jnp.ones((16,)), jnp.ones((2, 4)), jnp.ones((2, 4)),
            jnp.zeros((S, 2, 16), jnp.bfloat16), jnp.zeros((S, 2, 16), jnp.bfloat16))


@pytest.mark.parametrize("pos", [2 ** 32 + 5, 2 ** 31, np.int64(2 ** 31), np.uint32(2 ** 32 - 1), -2 ** 31 - 1,
                                 np.array(2 ** 33, np.int64)], ids=repr)
def test_attention_refuses_a_position_past_int32(pos):
    with pytest.raises(ValueError, match=r"baro_attention: pos=-?\d+ does not fit in int32"):
        cc.attention(*att_args(), pos, 2)


def test_attention_refuses_positions_it_knows_are_out_of_the_cache():
    with pytest.raises(ValueError, match=r"baro_attention: pos must be >= 0, got -3"):
        cc.attention(*att_args(), -3, 2)
    with pytest.raises(ValueError, match=r"baro_attention: n_valid must be in \[0, m=2\], got 3"):
        cc.attention(*att_args(), 0, 3)
    with pytest.raises(ValueError, match=r"baro_attention: pos \+ n_valid = 15 \+ 2 exceeds the cache length S=16"):
        cc.attention(*att_args(), np.int64(15), np.int32(2))
    o, _, _ = cc.attention(*att_args(), np.int64(14), 2)  # a wider integer that fits is taken
    assert o.shape == (2, 64)


def test_attention_refuses_a_traced_position_that_could_be_past_int32():
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in att_args()]
    for dt in (np.uint32, np.int16):
        pos = jax.ShapeDtypeStruct((), dt)
        if dt == np.uint32:
            with pytest.raises(ValueError, match=r"baro_attention: pos must be an int32 scalar, got a traced uint32"):
                jax.eval_shape(lambda p: cc.attention(*args, p, 2), pos)
        else:  # a type that always fits is converted
            jax.eval_shape(lambda p: cc.attention(*args, p, 2), pos)


def test_attention_handler_checks_what_a_traced_position_holds():
    f = jax.jit(lambda p: cc.attention(*att_args(), p, np.int32(2))[0])
    with jax.default_device(CPU):
        for p, msg in ((-(2 ** 31), r"pos must be >= 0, got -2147483648"),
                       (2 ** 31 - 1, r"pos \+ n_valid = 2147483647 \+ 2 exceeds the cache length S=16")):
            with pytest.raises(Exception, match=msg):
                jax.block_until_ready(f(jnp.int32(p)))


# ---- moe_pairs' expert_base ----

def pairs_args(E=8, El=4, D=16, I=8):
    rng = np.random.default_rng(3)
    return (jnp.asarray(bf16(rng, 3, D)), jnp.asarray(bf16(rng, E, D)), jnp.asarray(bf16(rng, El, 2 * I, D)),
            jnp.asarray(bf16(rng, El, D, I)))


@pytest.mark.parametrize("base", [-1, 5, 8, 2 ** 31 - 1, -(2 ** 31)])
def test_moe_pairs_refuses_an_expert_base_out_of_range(base):
    with pytest.raises(ValueError, match=rf"baro_moe_pairs: expert_base must be in \[0, E - El\] = \[0, 4\] "
                                         rf"\(E=8 experts, El=4 in this shard\), got {base}"):
        cc.moe_pairs(*pairs_args(), np.array([base], np.int32), 2)
    # traced: the CPU handler refuses it (a GPU gives NaN pairs, never reads past the shard)
    f = jax.jit(lambda b: cc.moe_pairs(*pairs_args(), b, 2)[0])
    with pytest.raises(Exception, match=rf"baro_moe_pairs: expert_base must be in \[0, E - El\] = \[0, 4\].*got {base}"):
        jax.block_until_ready(f(jnp.array([base], jnp.int32)))


def test_moe_pairs_takes_every_base_in_range():
    for base in range(5):
        y, w, ids = cc.moe_pairs(*pairs_args(), np.array([base], np.int32), 2)
        ids = np.asarray(ids)
        local = (ids >= base) & (ids < base + 4)
        assert np.all(np.asarray(y)[~local] == 0) and np.all(np.isfinite(np.asarray(y)))


# ---- rows mode of conv_proj and delta ----
# One token of each of P sequences in one call (rows=True / the `rows` attribute): the window and
# the state hold the P sequences side by side, so their shapes carry P. A mismatch is refused by
# the wrapper and, past it, by the handler, naming the operand; nothing is read out of bounds.

RP, RC, RW, RNK, RNV, RDK, RDV = 3, 8, 13, 2, 4, 16, 16
RCY = 2 * RNK * RDK + RNV * RDV


def rows_conv_args(P=RP, win_cols=RP * RC, x_dtype=jnp.float32):
    rng = np.random.default_rng(6)
    return (jnp.asarray(f32(rng, P, RW)).astype(x_dtype), jnp.asarray(bf16(rng, RC, 4)),
            jnp.asarray(bf16(rng, 3, win_cols)))


def rows_delta_args(P=RP, state_rows=RP * RNV):
    rng = np.random.default_rng(7)
    return (jnp.asarray(f32(rng, P, RCY)), jnp.asarray(f32(rng, P, RNV)), jnp.asarray(f32(rng, P, RNV)),
            jnp.asarray(f32(rng, RNV)), jnp.asarray(f32(rng, RNV)), jnp.asarray(f32(rng, state_rows, RDK, RDV)))


ROWS_WRAPPER_CASES = {
    "conv window of one sequence": (lambda: cc.conv(*rows_conv_args(win_cols=RC), 1, rows=True),
                                    r"baro_conv_proj: window must have shape \[3, P\*C\] = \[3, 24\] with rows=True "
                                    r"\(P=3 rows of x, C=8 from w\), got shape \[3, 8\]"),
    "conv window one column short": (lambda: cc.conv(*rows_conv_args(win_cols=RP * RC - 1), 1, rows=True),
                                     r"baro_conv_proj: window must have shape \[3, P\*C\] = \[3, 24\]"),
    "conv bf16 x": (lambda: cc.conv(*rows_conv_args(x_dtype=jnp.bfloat16), 1, rows=True),
                    r"baro_conv: rows=True takes x as the f32 projection \[P, W\] \(baro_conv_proj\), got dtype "
                    r"bfloat16"),
    "conv no rows": (lambda: cc.conv(*rows_conv_args(P=0, win_cols=0), 1, rows=True),
                     r"baro_conv_proj: rows=True needs x \[P, W\] with P >= 1"),
    "conv rows not a bool": (lambda: cc.conv(*rows_conv_args(), 1, rows=np.int64(1)),
                             r"baro_conv: rows must be a static bool, got int64"),
    "delta state of one sequence": (lambda: cc.delta(*rows_delta_args(state_rows=RNV), 1, rows=True),
                                    r"baro_delta: state must have shape \[P\*nv, dk, dv\] = \[12, dk, dv\] with "
                                    r"rows=True \(P=3 rows of y, nv=4 from A_log\), got shape \[4, 16, 16\]"),
    "delta state one head over": (lambda: cc.delta(*rows_delta_args(state_rows=RP * RNV + 1), 1, rows=True),
                                  r"baro_delta: state must have shape \[P\*nv, dk, dv\] = \[12, dk, dv\]"),
    "delta no rows": (lambda: cc.delta(*rows_delta_args(P=0, state_rows=0), 1, rows=True),
                      r"baro_delta: rows=True needs y \[P, C\] with P >= 1"),
    "delta rows not a bool": (lambda: cc.delta(*rows_delta_args(), 1, rows=1),
                              r"baro_delta: rows must be a static bool, got int"),
}


@pytest.mark.parametrize("case", list(ROWS_WRAPPER_CASES))
def test_rows_mode_wrappers_refuse_mismatched_operands(case):
    call, msg = ROWS_WRAPPER_CASES[case]
    with pytest.raises(ValueError, match=msg):
        call()


def _conv_proj_call(P_out, C_out, win_cols):
    S = jax.ShapeDtypeStruct
    return jax.ffi.ffi_call("baro_conv_proj", (S((P_out, C_out), jnp.float32), S((3, win_cols), jnp.bfloat16)))


def _delta_call(o_shape, state_rows):
    S = jax.ShapeDtypeStruct
    return jax.ffi.ffi_call("baro_delta", (S(o_shape, jnp.float32), S((state_rows, RDK, RDV), jnp.float32)))


ROWS_HANDLER_CASES = {
    "conv window of one sequence": (
        lambda: _conv_proj_call(RP, RC, RC)(*rows_conv_args(win_cols=RC), jnp.int32(1), rows=np.int64(1), packed=np.int64(0)),
        r"baro_conv_proj: window must have shape \[3, 24\], got \[3, 8\]"),
    "conv y of the folded call": (
        lambda: _conv_proj_call(1, RP * RC, RP * RC)(*rows_conv_args(), jnp.int32(1), rows=np.int64(1), packed=np.int64(0)),
        r"baro_conv_proj: y \(result\) must have shape \[3, 8\], got \[1, 24\]"),
    "conv rows 2": (
        lambda: _conv_proj_call(RP, RC, RP * RC)(*rows_conv_args(), jnp.int32(1), rows=np.int64(2), packed=np.int64(0)),
        r"baro_conv_proj: rows must be 0 or 1, got 2"),
    "conv packed 2": (
        lambda: _conv_proj_call(RP, RC, RP * RC)(*rows_conv_args(), jnp.int32(1), rows=np.int64(1), packed=np.int64(2)),
        r"baro_conv_proj: packed must be 0 or 1, got 2"),
    "conv n_valid past the one token": (
        lambda: _conv_proj_call(RP, RC, RP * RC)(*rows_conv_args(), jnp.int32(2), rows=np.int64(1), packed=np.int64(0)),
        r"baro_conv_proj: n_valid must be in \[0, m=1\], got 2"),
    "conv bf16 x": (
        lambda: jax.ffi.ffi_call("baro_conv", (jax.ShapeDtypeStruct((RP, RC), jnp.float32),
                                               jax.ShapeDtypeStruct((3, RP * RC), jnp.bfloat16)))(
            rows_conv_args(x_dtype=jnp.bfloat16)[0][:, :RC], *rows_conv_args()[1:], jnp.int32(1), rows=np.int64(1)),
        r"baro_conv: rows must be 0 \(rows mode takes the f32 projection x \[P, W\]: baro_conv_proj\), got 1"),
    "delta state of one sequence": (
        lambda: _delta_call((RP, RNV, RDV), RNV)(*rows_delta_args(state_rows=RNV), jnp.int32(1), b_col=np.int64(0),
                                                 a_col=np.int64(0), rows=np.int64(1)),
        r"baro_delta: state must have shape \[P\*nv, dk, dv\] in rows mode \(P=3 rows of y, nv=4 from A_log\), "
        r"got \[4, 16, 16\]"),
    "delta o of the folded call": (
        lambda: _delta_call((1, RP * RNV, RDV), RP * RNV)(*rows_delta_args(), jnp.int32(1), b_col=np.int64(0),
                                                          a_col=np.int64(0), rows=np.int64(1)),
        r"baro_delta: o \(result\) must have shape \[3, 4, 16\], got \[1, 12, 16\]"),
    "delta folded gates": (
        lambda: _delta_call((RP, RNV, RDV), RP * RNV)(*(a.reshape(1, -1) if i in (1, 2) else a
                                                        for i, a in enumerate(rows_delta_args())),
                                                      jnp.int32(1), b_col=np.int64(0), a_col=np.int64(0),
                                                      rows=np.int64(1)),
        r"baro_delta: b must have shape \[3, W\] with b_col \+ nv <= W \(b_col=0, nv=4\), got \[1, 12\]"),
    "delta rows -1": (
        lambda: _delta_call((RP, RNV, RDV), RP * RNV)(*rows_delta_args(), jnp.int32(1), b_col=np.int64(0),
                                                      a_col=np.int64(0), rows=np.int64(-1)),
        r"baro_delta: rows must be 0 or 1, got -1"),
    "delta n_valid past the one token": (
        lambda: _delta_call((RP, RNV, RDV), RP * RNV)(*rows_delta_args(), jnp.int32(2), b_col=np.int64(0),
                                                      a_col=np.int64(0), rows=np.int64(1)),
        r"baro_delta: n_valid must be in \[0, m=1\], got 2"),
}


@pytest.mark.parametrize("case", list(ROWS_HANDLER_CASES))
def test_rows_mode_handlers_refuse_mismatched_operands(case):
    """Past the wrappers, a direct ffi_call: the handler returns InvalidArgument naming the operand."""
    call, msg = ROWS_HANDLER_CASES[case]
    with jax.default_device(CPU):
        with pytest.raises(Exception, match=msg):
            jax.block_until_ready(call())


# ---- HostStore and FetchRing ----

def store_arrays(E=5, D=32, I=16):
    rng = np.random.default_rng(4)
    return jnp.asarray(bf16(rng, E, 2 * I, D)), jnp.asarray(bf16(rng, E, D, I))


def moe_host_args(E=5, D=32, I=16, k=2):
    rng = np.random.default_rng(5)
    return (jnp.asarray(bf16(rng, 1, D)), jnp.asarray(bf16(rng, E, D)), jnp.zeros((k, 2 * I, D), jnp.bfloat16),
            jnp.zeros((k, D, I), jnp.bfloat16), jnp.full((E,), -1, jnp.int32), jnp.asarray(bf16(rng, 2 * I, D)),
            jnp.asarray(bf16(rng, D, I)), jnp.asarray(bf16(rng, 1, D)))


def test_host_store_refuses_raw_addresses():
    gu, dn = store_arrays()
    other_gu, other_dn = store_arrays()
    addr = int(other_gu.addressable_data(0).unsafe_buffer_pointer())
    with pytest.raises(TypeError):
        cc.HostStore(gu, dn, addr, addr)  # addresses are read from the arrays, never given
    store = cc.HostStore(gu, dn)
    own = {int(gu.addressable_data(0).unsafe_buffer_pointer()), int(dn.addressable_data(0).unsafe_buffer_pointer())}
    assert store.gate_up_addr not in own and store.down_addr not in own  # its own copy
    shared = cc.HostStore(gu, dn, unsafe_share=True)
    assert shared.gate_up_addr == int(gu.addressable_data(0).unsafe_buffer_pointer())
    for s in (store, shared):
        with pytest.raises(AttributeError, match="a HostStore is read-only"):
            s.gate_up_addr = addr
        with pytest.raises(AttributeError, match="a HostStore is read-only"):
            s._gate_up = other_gu
        with pytest.raises(AttributeError, match="a HostStore is read-only"):
            del s.down_addr
    with pytest.raises(TypeError, match="unsafe_share must be a bool"):
        cc.HostStore(gu, dn, unsafe_share="no")


def test_a_store_outlives_the_arrays_it_was_built_from_in_a_cached_graph():
    """The addresses are baked into the compiled graph, where no check runs on a later call: the
    store's own copy keeps them valid when the arrays it was built from are deleted."""
    rng = np.random.default_rng(17)
    gu, dn = (jnp.asarray(bf16(rng, 5, 32, 32)), jnp.asarray(bf16(rng, 5, 32, 16)))
    want_gu, want_dn = np.asarray(gu).copy(), np.asarray(dn).copy()
    store = cc.host_store(gu, dn)
    args = moe_host_args()
    graph = jax.jit(lambda *a: cc.moe_host(*a, top_k=2, host=store))
    first = np.asarray(graph(*args))
    gu.delete()
    dn.delete()
    junk = [jnp.asarray(bf16(rng, 5, 32, 32)) for _ in range(4)]  # reuse of freed buffers, if any were
    again = np.asarray(graph(*args))  # the cached graph: no Python check runs here
    assert again.tobytes() == first.tobytes()
    ref = cc.moe_host(*args, top_k=2, host=cc.host_store(jnp.asarray(want_gu), jnp.asarray(want_dn)))
    assert np.asarray(ref).tobytes() == first.tobytes()
    assert np.asarray(cc.moe_host(*args, top_k=2, host=store)).tobytes() == first.tobytes()  # every use
    pg, pd = cc.FetchRing(2, entries=2).fetch(jnp.zeros((2, 32, 32), jnp.bfloat16),
                                              jnp.zeros((2, 32, 16), jnp.bfloat16), store, [4], [1])
    assert np.asarray(pg)[1].tobytes() == want_gu[4].tobytes() and np.asarray(pd)[1].tobytes() == want_dn[4].tobytes()
    del junk


@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_a_deleted_shared_store_is_refused_by_every_use(which):
    gu, dn = store_arrays()
    store = cc.host_store(gu, dn, unsafe_share=True)
    ring = cc.FetchRing(2, entries=2)
    pools = (jnp.zeros((2, 32, 32), jnp.bfloat16), jnp.zeros((2, 32, 16), jnp.bfloat16))
    ring.fetch(*pools, store, [1], [0])  # alive: fine
    (gu if which == "gate_up" else dn).delete()
    msg = rf"the host store's {which} array has been deleted"
    with pytest.raises(ValueError, match=rf"baro_moe_host: {msg}"):
        cc.moe_host(*moe_host_args(), top_k=2, host=store)
    with pytest.raises(ValueError, match=rf"baro_fetch_experts: {msg}"):
        ring.fetch(jnp.zeros((2, 32, 32), jnp.bfloat16), jnp.zeros((2, 32, 16), jnp.bfloat16), store, [1], [0])
    with pytest.raises(ValueError, match=r"baro_moe_host: host (gate_up|down) has been deleted"):
        cc.host_store(gu, dn)
    assert ring.runs == 1  # nothing refused reached the handler


def test_fetch_ring_refuses_deleted_pools_and_keeps_its_own_buffer():
    gu, dn = store_arrays()
    store = cc.host_store(gu, dn)
    ring = cc.FetchRing(2, entries=2)
    pg, pd = jnp.zeros((2, 32, 32), jnp.bfloat16), jnp.zeros((2, 32, 16), jnp.bfloat16)
    pg2, pd2 = ring.fetch(pg, pd, store, [3], [1])  # the pools are donated: the old ones are gone
    with pytest.raises(ValueError, match=r"baro_fetch_experts: pool_gu has been deleted"):
        ring.fetch(pg, pd, store, [3], [1])
    assert np.asarray(pg2)[1].tobytes() == np.asarray(gu)[3].tobytes()
    with pytest.raises(AttributeError):
        ring.addr = int(pg2.addressable_data(0).unsafe_buffer_pointer())
    with pytest.raises(AttributeError):
        ring.buf = np.zeros_like(ring.buf)
    assert ring.addr == ring.buf.ctypes.data


# ---- a broken kernel library ----

def test_a_broken_library_is_reported_not_taken_for_absent(tmp_path):
    """A libbaro_cpu.so that exists but does not load: custom_calls says which file and why, and
    the ordered backend is unavailable *and broken* (so nothing falls back to xla quietly)."""
    (tmp_path / "libbaro_cpu.so").write_bytes(b"not an ELF file\n" * 64)
    r = run_py("""
        import json
        from baro_jax.ops import BackendUnavailable, get_ops, ordered_status
        ok, reason, broken = ordered_status()
        try:
            get_ops("ordered")
            err = None
        except BackendUnavailable as e:
            err = (str(e), e.broken, e.path)
        try:
            import custom_calls
            imp = None
        except ImportError as e:
            imp = (str(e), e.broken, e.path, e.error)
        print(json.dumps({"status": [ok, reason, broken], "get_ops": err, "import": imp}))
    """, env={"BARO_LIB_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    out = json.loads(r.stdout.strip().splitlines()[-1])
    path = str(tmp_path / "libbaro_cpu.so")
    ok, reason, broken = out["status"]
    assert not ok and broken and path in reason and "could not be loaded" in reason
    msg, e_broken, e_path = out["get_ops"]
    assert e_broken and e_path == path and path in msg and ("invalid ELF header" in msg or "file too short" in msg)
    imsg, i_broken, i_path, i_error = out["import"]
    assert i_broken and i_path == path and i_error and i_error in imsg


def test_the_library_loads_where_it_is_fine():
    from baro_jax.ops import get_ops, ordered_status
    assert ordered_status() == (True, "", False)
    assert get_ops("ordered").gpu_platform() is None  # on the CPU
    assert cc.gpu_platform() is None
