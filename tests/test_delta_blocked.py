"""Kernel tests for baro_delta_blocked, the chunk-aligned delta rule (docs/DESIGN.md §9,
docs/NUMERICS.md "delta_blocked"), on CPU and (tests marked `gpu`, deselected by default, run with
`pytest -m gpu`) on the GPU: each platform against itself (the GPU sums in its own fixed order,
NUMERICS "delta_blocked"), and both against the same float64 and ops_xla references.

  * bytes: m rows in one call == m one-row calls (outputs and every state leaf:
    S0, pending_k, pending_u, pending_c), and == other splits of the same rows
    (1+rest, rest+1, a random split, padded chunks of 7 with garbage pad rows);
    calls start on a block boundary, mid-block, and in the block's last slot;
  * n_valid < m: padded rows (garbage inputs) leave no trace, their o is 0;
    outputs are poisoned (NaN) before each call so an unwritten element shows;
  * values: within tolerance of a float64 numpy run of the PER-TOKEN recurrence
    (the blocked formulas are exact algebra, docs/DESIGN.md §9: only fp32 rounding
    differs) and of the jnp reference ops_xla.delta_blocked;
  * errors: bad shapes give messages naming the argument.

B is the pending buffers' length: 64 (the model's) and 8 (crosses many blocks
cheaply). Gates at the model's magnitudes (A ~ U(1, 16), dt ~ logU(1e-3, 1e-1)).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from baro_jax import ops_xla as X


J = jax.jit(cc.delta_blocked)
J_DONATE = jax.jit(cc.delta_blocked, donate_argnums=(5, 6, 7, 8))
J_XLA = jax.jit(X.delta_blocked, static_argnames=("nk", "dk"))
CPU = jax.devices("cpu")[0]

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def _device(p):
    try:
        devs = jax.devices(p)
    except RuntimeError:
        pytest.skip(f"no {p} device")
    if p == "gpu":
        if not {"CUDA", "ROCM"} & set(cc.available_platforms()):
            pytest.fail(f"GPU present but the baro GPU library is not loaded: {cc.load_errors()}")
        plat = "ROCM" if "rocm" in str(getattr(devs[0].client, "platform_version", "")).lower() else "CUDA"
        if "baro_delta_blocked" not in cc._lib._registered.get(plat, set()):
            pytest.fail(f"the GPU library does not export BaroDeltaBlockedGpu: rebuild it ({cc.load_errors()})")
    return devs[0]


@pytest.fixture(params=PLATFORMS)
def platform(request):
    """The device the kernel runs on (as tests/kernel_util.py's fixture)."""
    return _device(request.param)

# (nk, nv, dk, dv, B)
SHAPES = [(1, 2, 128, 128, 64), (2, 4, 16, 24, 8)]
M_LIST = [1, 2, 7, 63, 64, 65, 150]
# Rows already in the block before the call (its pos % B): a boundary, mid-block, the last slot;
# the call's pos is BASE_BLOCKS * B + pre, so absolute positions are not small.
PRE = ["boundary", "mid", "last"]
BASE_BLOCKS = 3
# Tolerances (assert_close: |got - ref| <= rel * (|ref| + max|ref|)). Only fp32 rounding differs:
# the blocked form is the per-token rule in exact arithmetic (docs/DESIGN.md §9). Measured on these inputs:
# <= 4e-7 against float64 and against ops_xla; the bar is 1e-5. The strong-gate test (|c| in the
# hundreds, where exp(c_i - c_j) of fp32 prefix sums loses ~|c| * 2^-24 absolute) uses 1e-4.
TOL_F64 = 1e-5
TOL_XLA = 1e-5
TOL_STRONG = 1e-4


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def assert_same_bits(got, want, what):
    g, w = bits(got), bits(want)
    assert g.shape == w.shape, f"{what}: shape {g.shape} != {w.shape}"
    if not np.array_equal(g, w):
        bad = np.argwhere(g != w)
        raise AssertionError(f"{what}: {len(bad)} of {g.size} elements differ in bits, first at {tuple(bad[0])}")


def assert_close(got, ref, rel, what):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.all(np.isfinite(got)), f"{what}: non-finite values"
    scale = np.max(np.abs(ref)) if ref.size else 0.0
    err = np.abs(got - ref)
    tol = rel * (np.abs(ref) + scale)
    if not np.all(err <= tol):
        i = np.unravel_index(np.argmax(err - tol), err.shape)
        raise AssertionError(f"{what}: max error {err.max():.3g} (scale {scale:.3g}); worst at {i}: "
                             f"got {got[i]!r}, ref {ref[i]!r}")


def i32(v):
    return np.asarray(v, np.int32)


def poison(shape, dev=CPU):
    jnp.full(shape, jnp.nan, jnp.float32, device=dev).block_until_ready().delete()


def garbage(rng, n, a):
    return (rng.standard_normal((n,) + a.shape[1:]) * 7).astype(np.float32)


def inputs(rng, T, nk, nv, dk, dv):
    """T rows of model-like inputs and the constants."""
    y = rng.standard_normal((T, 2 * nk * dk + nv * dv)).astype(np.float32)
    b = rng.standard_normal((T, nv)).astype(np.float32)
    a = rng.standard_normal((T, nv)).astype(np.float32)
    A_log = np.log(rng.uniform(1.0, 16.0, nv)).astype(np.float32)
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), nv))
    dt_bias = np.log(np.expm1(dt)).astype(np.float32)
    return y, b, a, A_log, dt_bias


def zero_block(nv, dk, dv, B, rng=None):
    S0 = (rng.standard_normal((nv, dk, dv)) * 0.5).astype(np.float32) if rng is not None \
        else np.zeros((nv, dk, dv), np.float32)
    return (S0, np.zeros((nv, B, dk), np.float32), np.zeros((nv, B, dv), np.float32), np.zeros((nv, B), np.float32))


def call(fn, rows, consts, st, pos, n_valid, pad_to=None, rng=None, dev=CPU):
    """One call on dev; rows padded with garbage up to pad_to. Returns (o [numpy], state tuple [jax])."""
    y, b, a = rows
    n = y.shape[0]
    if pad_to is not None and pad_to > n:
        y, b, a = (np.concatenate([x, garbage(rng, pad_to - n, x)]) for x in (y, b, a))
    poison((y.shape[0], st[0].shape[0], st[0].shape[2]), dev)
    out = fn(*(jax.device_put(x, dev) for x in (y, b, a)), *(jax.device_put(x, dev) for x in consts),
             *(jax.device_put(x, dev) for x in st), jax.device_put(i32(pos), dev), jax.device_put(i32(n_valid), dev))
    return np.asarray(out[0]), tuple(out[1:])


def run_chunks(rows, consts, st, pos, chunks, pad_to=None, rng=None, dev=CPU):
    """The rows through calls of `chunks` rows each (padded to pad_to); valid outputs and final state."""
    outs, r = [], 0
    st = tuple(jax.device_put(s, dev) for s in st)
    for c in chunks:
        o, st = call(J, [x[r:r + c] for x in rows], consts, st, pos + r, c, pad_to, rng, dev)
        outs.append(o[:c])
        r += c
    nv, dv = st[0].shape[0], st[0].shape[2]
    return np.concatenate(outs) if outs else np.zeros((0, nv, dv), np.float32), [np.asarray(s) for s in st]


def host(st):
    return [np.asarray(s) for s in st]


LEAVES = ("S0", "pending_k", "pending_u", "pending_c")


def same_state(got, want, what):
    for g, w, n in zip(got, want, LEAVES):
        assert_same_bits(g, w, f"{what}: {n}")


# ---------------------------------------------------------------------------
# float64 references
# ---------------------------------------------------------------------------

def formed64(y, b, a, A_log, dt_bias, nk, nv, dk, dv):
    """q, k (normalised, per value head), v, beta, g in float64 (NUMERICS.md, delta)."""
    y = y.astype(np.float64)
    T = y.shape[0]
    q = y[:, :nk * dk].reshape(T, nk, dk)
    k = y[:, nk * dk:2 * nk * dk].reshape(T, nk, dk)
    v = y[:, 2 * nk * dk:].reshape(T, nv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    rep = nv // nk
    q, k = np.repeat(q, rep, axis=1), np.repeat(k, rep, axis=1)
    beta = 1.0 / (1.0 + np.exp(-b.astype(np.float64)))
    x = a.astype(np.float64) + dt_bias.astype(np.float64)
    g = -np.exp(A_log.astype(np.float64)) * (np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x))))
    return q, k, v, beta, g


def token64(q, k, v, beta, g, S):
    """The per-token recurrence in float64: S *= e^g; d = (v - S^T k) beta; S += k d^T; o = S^T q."""
    S = S.astype(np.float64).copy()
    T, nv, dv = v.shape
    o = np.zeros((T, nv, dv))
    for t in range(T):
        for h in range(nv):
            S[h] *= np.exp(g[t, h])
            d = (v[t, h] - S[h].T @ k[t, h]) * beta[t, h]
            S[h] += np.outer(k[t, h], d)
            o[t, h] = S[h].T @ q[t, h]
    return o, S


def state_of_block(st, pos):
    """The per-token state S at position pos from a blocked state (float64):
    S = G_{i-1} S0 + sum_{j<i} exp(c_{i-1} - c_j) k_j u_j^T with i = pos % B rows pending."""
    S0, K, U, Cl = (np.asarray(s, np.float64) for s in st)
    i = pos % K.shape[1]
    if i == 0:
        return S0
    c = Cl[:, i - 1]
    e = np.exp(c[:, None] - Cl[:, :i])
    return np.exp(c)[:, None, None] * S0 + np.einsum("hj,hjk,hjv->hkv", e, K[:, :i], U[:, :i])


def setup(shape, m, pre_kind, seed, dev=CPU):
    nk, nv, dk, dv, B = shape
    # pre_kind: a name, or the number of rows already in the block (tests/test_delta_blocked_mma.py)
    pre = pre_kind if isinstance(pre_kind, int) else {"boundary": 0, "mid": B // 2 + 1, "last": B - 1}[pre_kind]
    rng = np.random.default_rng(seed)
    T = pre + m
    y, b, a, A_log, dt_bias = inputs(rng, T, nk, nv, dk, dv)
    consts = tuple(jax.device_put(x, dev) for x in (A_log, dt_bias))
    st0 = zero_block(nv, dk, dv, B, rng)  # a random S0 at a block boundary
    base = BASE_BLOCKS * B
    # the block's first `pre` rows, one row per call (the decode arm), give the call's state
    o_pre, st_pre = run_chunks([y[:pre], b[:pre], a[:pre]], consts, st0, base, [1] * pre, dev=dev)
    rows = [y[pre:], b[pre:], a[pre:]]
    return dict(rng=rng, rows=rows, consts=consts, st0=st0, st_pre=st_pre, pos=base + pre, pre=pre,
                all_rows=(y, b, a), A_log=A_log, dt_bias=dt_bias, o_pre=o_pre, shape=shape)


def ids(shape):
    return "nk%d-nv%d-dk%d-dv%d-B%d" % shape


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("pre_kind", PRE)
@pytest.mark.parametrize("m", M_LIST)
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_rows_equal_one_row_calls(platform, shape, m, pre_kind):
    check_rows_equal_one_row_calls(platform, shape, m, pre_kind, seed=7000 + 13 * m + len(pre_kind) + shape[2])


def check_rows_equal_one_row_calls(dev, shape, m, pre_kind, seed, extra_splits=True):
    s = setup(shape, m, pre_kind, seed=seed, dev=dev)
    rows, consts, st_pre, pos, rng = s["rows"], s["consts"], s["st_pre"], s["pos"], s["rng"]
    nk, nv, dk, dv, B = shape
    o_full, st_full = run_chunks(rows, consts, st_pre, pos, [m], dev=dev)
    assert o_full.shape == (m, nv, dv)
    assert np.all(np.isfinite(o_full)) and all(np.all(np.isfinite(x)) for x in st_full)
    # the decode arm: one row per call, keeping every intermediate state
    st = tuple(jax.device_put(x, dev) for x in st_pre)
    states = [host(st)]
    for r in range(m):
        o1, st = call(J, [x[r:r + 1] for x in rows], consts, st, pos + r, 1, dev=dev)
        assert_same_bits(o1[0], o_full[r], f"{ids(shape)} m={m} {pre_kind}: row {r} o vs one-row call")
        states.append(host(st))
    same_state(st_full, states[m], f"{ids(shape)} m={m} {pre_kind}: state vs one-row calls")
    # pending slots at or past pos % B hold +0 (never read; kept clean so the arms' bytes agree)
    i_end = (pos + m) % B
    assert not np.any(bits(st_full[1][:, i_end:])) and not np.any(bits(st_full[2][:, i_end:]))
    assert not np.any(bits(st_full[3][:, i_end:]))
    # other splits of the same rows
    splits = {}
    if not extra_splits:
        m_splits = []
    else:
        m_splits = [7, m + 5]
    if m >= 2:
        splits["1+rest"], splits["rest+1"] = [1, m - 1], [m - 1, 1]
    if m >= 3:
        cuts = np.sort(rng.choice(np.arange(1, m), size=min(4, m - 1), replace=False))
        splits["random"] = list(np.diff(np.concatenate([[0], cuts, [m]])).astype(int))
    for name, chunks in splits.items():
        o, st2 = run_chunks(rows, consts, st_pre, pos, chunks, dev=dev)
        assert_same_bits(o, o_full, f"{ids(shape)} m={m} {pre_kind}: split {name} o")
        same_state(st2, st_full, f"{ids(shape)} m={m} {pre_kind}: split {name}")
    for pad in m_splits:
        chunks = [min(pad, m - r) for r in range(0, m, pad)]
        o, st2 = run_chunks(rows, consts, st_pre, pos, chunks, pad_to=pad, rng=rng, dev=dev)
        assert_same_bits(o, o_full, f"{ids(shape)} m={m} {pre_kind}: padded chunks of {pad} o")
        same_state(st2, st_full, f"{ids(shape)} m={m} {pre_kind}: padded chunks of {pad}")
    # n_valid < m: garbage rows leave no trace, their o is 0; aliased and donated state agree
    for nvld in sorted({0, m // 2, m - 1} & set(range(m))):
        padded = [x.copy() for x in rows]
        for x in padded:
            x[nvld:] = garbage(rng, m - nvld, x)
        for fn, what in ((J, "aliased"), (J_DONATE, "donated")):
            o, st2 = call(fn, padded, consts, tuple(jax.device_put(x, dev) for x in st_pre), pos, nvld, dev=dev)
            same_state(host(st2), states[nvld], f"{ids(shape)} m={m} {pre_kind} n_valid={nvld} ({what})")
            assert_same_bits(o[:nvld], o_full[:nvld], f"{ids(shape)} m={m} n_valid={nvld} o ({what})")
            assert_same_bits(o[nvld:], np.zeros_like(o[nvld:]), f"{ids(shape)} m={m} padded rows of o")


@pytest.mark.parametrize("pre_kind", PRE)
@pytest.mark.parametrize("m", [7, 65, 150])
@pytest.mark.parametrize("shape", SHAPES, ids=ids)
def test_values_vs_token_rule_and_xla(platform, shape, m, pre_kind):
    s = setup(shape, m, pre_kind, seed=8000 + 13 * m + len(pre_kind) + shape[2], dev=platform)
    nk, nv, dk, dv, B = shape
    rows, consts, st_pre, pos = s["rows"], s["consts"], s["st_pre"], s["pos"]
    o_full, st_full = run_chunks(rows, consts, st_pre, pos, [m], dev=platform)
    consts = tuple(jax.device_put(x, CPU) for x in consts)
    st_pre = tuple(jax.device_put(x, CPU) for x in st_pre)
    # float64 per-token recurrence over the block's earlier rows and the call's rows, from S0
    f = formed64(*s["all_rows"], s["A_log"], s["dt_bias"], nk, nv, dk, dv)
    o_ref, S_ref = token64(*f, s["st0"][0])
    o_all = np.concatenate([s["o_pre"], o_full]) if s["pre"] else o_full
    assert_close(o_all, o_ref, TOL_F64, f"{ids(shape)} m={m} {pre_kind}: o vs float64 token rule")
    assert_close(state_of_block(st_full, pos + m), S_ref, TOL_F64,
                 f"{ids(shape)} m={m} {pre_kind}: state vs float64 token rule")
    # the jnp reference (same formulas, XLA's summation order)
    ox, *stx = J_XLA(*(jax.device_put(x, CPU) for x in rows), *consts, *st_pre, i32(pos), i32(m), nk=nk, dk=dk)
    assert_close(o_full, ox, TOL_XLA, f"{ids(shape)} m={m} {pre_kind}: o vs ops_xla")
    for g, w, n in zip(st_full, stx, LEAVES):
        assert_close(g, w, TOL_XLA, f"{ids(shape)} m={m} {pre_kind}: {n} vs ops_xla")


@pytest.mark.parametrize("pre_kind", ["mid"])
def test_strong_gates(platform, pre_kind):
    """Gates far stronger than the model's (g ~ -10 per row: c reaches ~ -600 in a B = 64 block):
    G underflows to 0, nothing overflows, values stay within TOL_STRONG of float64."""
    dev = platform
    shape = (1, 2, 16, 16, 64)
    nk, nv, dk, dv, B = shape
    s = setup(shape, 150, pre_kind, seed=4242, dev=dev)
    rng = np.random.default_rng(5)
    A_log = np.log(np.full(nv, 8.0)).astype(np.float32)
    dt_bias = np.full(nv, 1.0, np.float32)
    consts = tuple(jax.device_put(x, dev) for x in (A_log, dt_bias))
    y, b, a = s["all_rows"]
    pre = s["pre"]
    st0 = zero_block(nv, dk, dv, B, rng)
    o_pre, st_pre = run_chunks([y[:pre], b[:pre], a[:pre]], consts, st0, s["pos"] - pre, [1] * pre, dev=dev)
    o, st = run_chunks(s["rows"], consts, st_pre, s["pos"], [150], dev=dev)
    assert np.all(np.isfinite(o)) and all(np.all(np.isfinite(x)) for x in st)
    assert st[3].min() < -300, st[3].min()
    f = formed64(y, b, a, A_log, dt_bias, nk, nv, dk, dv)
    o_ref, S_ref = token64(*f, st0[0])
    assert_close(np.concatenate([o_pre, o]), o_ref, TOL_STRONG, "strong gates: o vs float64 token rule")
    assert_close(state_of_block(st, s["pos"] + 150), S_ref, TOL_STRONG, "strong gates: state vs float64")
    o1, st1 = run_chunks(s["rows"], consts, st_pre, s["pos"], [1] * 150, dev=dev)
    assert_same_bits(o1, o, "strong gates: one-row calls o")
    same_state(st1, st, "strong gates: one-row calls")


def test_xla_reference_n_valid_and_splits():
    """ops_xla.delta_blocked honours n_valid (garbage rows leave no trace) and its own splits."""
    shape = (2, 4, 16, 24, 8)
    s = setup(shape, 30, "mid", seed=99)
    nk, nv, dk, dv, B = shape
    rows, consts, st_pre, pos, rng = s["rows"], s["consts"], s["st_pre"], s["pos"], s["rng"]
    full = J_XLA(*rows, *consts, *st_pre, i32(pos), i32(30), nk=nk, dk=dk)
    padded = [np.concatenate([x[:11], garbage(rng, 19, x)]) for x in rows]
    part = J_XLA(*padded, *consts, *st_pre, i32(pos), i32(11), nk=nk, dk=dk)
    assert not np.any(np.asarray(part[0])[11:])
    rest = J_XLA(*(x[11:] for x in rows), *consts, *part[1:], i32(pos + 11), i32(19), nk=nk, dk=dk)
    assert_close(np.concatenate([np.asarray(part[0])[:11], rest[0]]), full[0], 1e-5, "xla split o")
    for g, w, n in zip(rest[1:], full[1:], LEAVES):
        assert_close(g, w, 1e-5, f"xla split {n}")


def test_errors():
    shape = (2, 4, 16, 24, 8)
    nk, nv, dk, dv, B = shape
    rng = np.random.default_rng(1)
    y, b, a, A_log, dt_bias = inputs(rng, 3, nk, nv, dk, dv)
    S0, K, U, Cl = zero_block(nv, dk, dv, B)
    args = [y, b, a, A_log, dt_bias, S0, K, U, Cl]
    with pytest.raises(ValueError, match=r"baro_delta_blocked: y must have shape \[m, 2\*nk\*dk \+ nv\*dv\]"):
        cc.delta_blocked(y[:, :-1], *args[1:], 0, 3)
    with pytest.raises(ValueError, match=r"baro_delta_blocked: pending_u must have shape \[4, 8, 24\], got shape \[4, 7, 24\]"):
        cc.delta_blocked(*args[:7], U[:, :7], Cl, 0, 3)
    with pytest.raises(ValueError, match=r"baro_delta_blocked: pending_k must have shape \[4, 8, 16\]"):
        cc.delta_blocked(*args[:6], K[:, :, :8], U, Cl, 0, 3)
    with pytest.raises(ValueError, match=r"baro_delta_blocked: pending_c must have dtype float32"):
        cc.delta_blocked(*args[:8], Cl.astype(jnp.bfloat16), 0, 3)
    with pytest.raises(ValueError, match=r"baro_delta_blocked: pos must be a scalar"):
        cc.delta_blocked(*args, np.zeros(2, np.int32), 3)
    # run-time checks in the handler
    with pytest.raises(Exception, match=r"baro_delta_blocked: n_valid must be in \[0, m=3\], got 4"):
        jax.block_until_ready(J(*args, i32(0), i32(4)))
    with pytest.raises(Exception, match=r"baro_delta_blocked: pos must be >= 0, got -1"):
        jax.block_until_ready(J(*args, i32(-1), i32(3)))


@pytest.mark.gpu
@pytest.mark.parametrize("pre_kind", PRE)
@pytest.mark.parametrize("m", [1, 2, 63, 64, 65, 300])
def test_gpu_model_shape_rows_equal_one_row_calls(m, pre_kind):
    """The GPU against itself at the model's shape (dk = dv = 128, B = 64, nv = 32, nk = 16):
    m rows in one call == m one-row calls (decode), other splits, padded chunks, n_valid < m,
    starting on a block boundary, mid-block and in the last slot; m = 300 crosses 4-5 blocks."""
    check_rows_equal_one_row_calls(_device("gpu"), (16, 32, 128, 128, 64), m, pre_kind,
                                   seed=9000 + 13 * m + len(pre_kind))


def test_gpu_library_without_the_target_says_rebuild(monkeypatch):
    """A GPU library that predates BaroDeltaBlockedGpu gets the generic "rebuild" error (the GPU
    kernel exists now: csrc/gpu/delta_blocked.cu), naming the missing symbol."""
    from custom_calls import _lib

    assert "baro_delta_blocked" not in _lib.CPU_ONLY
    monkeypatch.setitem(_lib._libs, "CUDA", object())
    monkeypatch.setitem(_lib._registered, "CUDA", set(_lib.TARGETS) - {"baro_delta_blocked"})
    monkeypatch.setitem(_lib._errors, "CUDA", " missing symbol BaroDeltaBlockedGpu;")
    monkeypatch.setattr(_lib, "_array_platforms", lambda args: {"CUDA"})
    with pytest.raises(RuntimeError, match="baro_delta_blocked: cannot run on CUDA: .*rebuild.*BaroDeltaBlockedGpu"):
        _lib.check_runnable("baro_delta_blocked", ())
