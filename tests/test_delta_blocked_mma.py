"""GPU tests of the blocked delta rule's tensor-core instance (BARO_DELTA_BLOCKED_MMA=1,
csrc/gpu/delta_blocked.cu `delta_blocked_mma_kernel`, docs/DESIGN.md §9), marked `gpu`; one CPU
test checks the float64 blocked reference they use against the CPU kernel.

Its products are 3xTF32 mma.sync tiles at absolute slots, so its bits are its own (not the
CUDA-core instance's); what the contract needs is that prefill and decode agree under it:

  * bytes: n rows in one call == n one-row calls (the decode path: the same kernel at m = 1)
    == other splits, padded chunks and n_valid < n, for n in {1, 2, 63, 64, 65, 200, 1000},
    starting at several slots of the block (0, 16-slot-tile aligned or not, the 32-slot window's
    edges, the last slot), outputs poisoned before every call (tests/test_delta_blocked.py's
    check_rows_equal_one_row_calls, with the knob on for every call of the test); every state
    leaf is compared, so pending_k / pending_c, which the instance's second kernel writes after
    the column-split grid, are checked too, aliased and donated;
  * values: every output and state leaf within the rule's documented error (NUMERICS.md
    "delta_blocked": TOL_F64 = 1e-5 at the model's gates, TOL_STRONG = 1e-4 at |c| ~ 600) of a
    float64 run of the blocked formulas themselves (not an identity check);
  * the knob reaches the kernel: with it on the bits differ from the CUDA-core instance's.

HIP has no tensor-core instance (the knob is ignored there): these tests skip on ROCm.
"""
from __future__ import annotations

import jax
import numpy as np
import pytest

import test_delta_blocked as T

# (nk, nv, dk, dv, B): the model's heads; dv not a multiple of 8 with B = 8 (one partial slot
# tile, the close's single 8-slot step); B = 48 (the second 32-slot window is partial).
MODEL = (16, 32, 128, 128, 64)
SMALL = [(2, 4, 16, 24, 8), (1, 2, 32, 40, 48)]
N_ROWS = [1, 2, 63, 64, 65, 200, 1000]
# rows already in the block before the call: 0 (block start), 5 (inside the first 16-slot
# tile), 16 (a tile start), 31 / 33 (either side of the 32-slot window edge), 63 (last slot)
PRE_MODEL = [0, 5, 16, 31, 33, 63]


@pytest.fixture
def gpu(monkeypatch):
    dev = T._device("gpu")
    if "rocm" in str(getattr(dev.client, "platform_version", "")).lower():
        pytest.skip("the tensor-core instance is CUDA only (HIP ignores BARO_DELTA_BLOCKED_MMA)")
    _switch(monkeypatch, "1")
    yield dev
    monkeypatch.delenv("BARO_DELTA_BLOCKED_MMA")
    jax.clear_caches()  # the later tests' graphs are the CUDA-core instance's


def _switch(monkeypatch, value: str):
    """Set the knob and drop jax's compiled graphs: the knob picks one kernel launch or two, and a
    graph XLA captured (a CUDA command buffer) under the other setting cannot be updated to the
    other count (CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE; seen on an H100 when the CUDA-core tests
    had compiled the same shapes earlier in the process)."""
    monkeypatch.setenv("BARO_DELTA_BLOCKED_MMA", value)
    jax.clear_caches()


@pytest.mark.gpu
@pytest.mark.parametrize("pre", PRE_MODEL)
@pytest.mark.parametrize("m", N_ROWS)
def test_mma_rows_equal_one_row_calls(gpu, m, pre):
    T.check_rows_equal_one_row_calls(gpu, MODEL, m, pre, seed=12000 + 17 * m + pre, extra_splits=m <= 200)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SMALL, ids=T.ids)
@pytest.mark.parametrize("m", [1, 7, 65, 150])
def test_mma_small_shapes_rows_equal_one_row_calls(gpu, shape, m):
    B = shape[4]
    for pre in sorted({0, 3, B // 2 + 1, B - 1}):
        T.check_rows_equal_one_row_calls(gpu, shape, m, pre, seed=13000 + 17 * m + pre + shape[2])


def blocked64(q, k, v, beta, g, S0, B):
    """The blocked formulas (docs/DESIGN.md §9) in float64 over rows starting at a block boundary:
    per row i of its block, c_i = c_{i-1} + g_i, G = exp(c_i),
    u_i = beta (v - G S0^T k - sum_{j<i} e^{c_i - c_j} (k . k_j) u_j),
    o_i = G S0^T q + sum_{j<=i} e^{c_i - c_j} (q . k_j) u_j, and at the block's last slot
    S0 <- G S0 + sum_j e^{c_i - c_j} k_j u_j^T. Returns o and (S0, pending_k, pending_u, pending_c)."""
    Tn, nv, dv = v.shape
    dk = k.shape[2]
    S = S0.astype(np.float64).copy()
    Kp, Up, Cp = np.zeros((nv, B, dk)), np.zeros((nv, B, dv)), np.zeros((nv, B))
    o = np.zeros((Tn, nv, dv))
    for t in range(Tn):
        i = t % B
        c = g[t] if i == 0 else Cp[:, i - 1] + g[t]
        G = np.exp(c)
        w = np.exp(c[:, None] - Cp[:, :i])  # [nv, i]
        akk = w * np.einsum("hr,hjr->hj", k[t], Kp[:, :i])
        aqk = w * np.einsum("hr,hjr->hj", q[t], Kp[:, :i])
        ks0 = np.einsum("hrd,hr->hd", S, k[t])
        qs0 = np.einsum("hrd,hr->hd", S, q[t])
        u = beta[t][:, None] * (v[t] - G[:, None] * ks0 - np.einsum("hj,hjd->hd", akk, Up[:, :i]))
        o[t] = G[:, None] * qs0 + np.einsum("hj,hjd->hd", aqk, Up[:, :i]) \
            + np.einsum("hr,hr->h", q[t], k[t])[:, None] * u
        Kp[:, i], Up[:, i], Cp[:, i] = k[t], u, c
        if i == B - 1:
            e = np.exp(c[:, None] - Cp)
            S = G[:, None, None] * S + np.einsum("hj,hjr,hjd->hrd", e, Kp, Up)
            Kp[:], Up[:], Cp[:] = 0.0, 0.0, 0.0
    return o, (S, Kp, Up, Cp)


def check_values(dev, shape, m, pre, seed, tol, strong=False):
    nk, nv, dk, dv, B = shape
    s = T.setup(shape, m, pre, seed=seed, dev=dev)
    A_log, dt_bias = s["A_log"], s["dt_bias"]
    if strong:  # g ~ -10 per row: c reaches ~ -600 in a 64-row block, G underflows to 0
        A_log = np.log(np.full(nv, 8.0)).astype(np.float32)
        dt_bias = np.full(nv, 1.0, np.float32)
    consts = tuple(jax.device_put(x, dev) for x in (A_log, dt_bias))
    y, b, a = s["all_rows"]
    o_pre, st_pre = T.run_chunks([y[:pre], b[:pre], a[:pre]], consts, s["st0"], s["pos"] - pre, [1] * pre,
                                 dev=dev)
    o, st = T.run_chunks(s["rows"], consts, st_pre, s["pos"], [m], dev=dev)
    assert np.all(np.isfinite(o)) and all(np.all(np.isfinite(x)) for x in st)
    f = T.formed64(y, b, a, A_log, dt_bias, nk, nv, dk, dv)
    o_ref, st_ref = blocked64(*f, s["st0"][0], B)
    what = f"{T.ids(shape)} m={m} pre={pre}"
    T.assert_close(np.concatenate([o_pre, o]) if pre else o, o_ref, tol, f"{what}: o vs float64 blocked rule")
    for got, ref, name in zip(st, st_ref, T.LEAVES):
        T.assert_close(got, ref, tol, f"{what}: {name} vs float64 blocked rule")
    return o


@pytest.mark.gpu
@pytest.mark.parametrize("pre", [0, 5, 33])
@pytest.mark.parametrize("m", [7, 65, 200])
def test_mma_values_vs_float64_blocked_rule(gpu, m, pre):
    check_values(gpu, MODEL, m, pre, seed=14000 + 17 * m + pre, tol=T.TOL_F64)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SMALL, ids=T.ids)
def test_mma_small_shapes_values(gpu, shape):
    check_values(gpu, shape, 150, shape[4] // 2 + 1, seed=15000 + shape[2], tol=T.TOL_F64)


@pytest.mark.gpu
def test_mma_strong_gates(gpu):
    check_values(gpu, (1, 2, 16, 16, 64), 150, 33, seed=4242, tol=T.TOL_STRONG, strong=True)


@pytest.mark.gpu
def test_mma_knob_reaches_the_kernel(gpu, monkeypatch):
    """The same call with the knob off and on: bits differ (3xTF32 tiles vs fmaf chains), values
    agree within the rule's error. Were the knob not read, every test above would be testing the
    CUDA-core instance."""
    s = T.setup(MODEL, 200, 5, seed=16000, dev=gpu)
    outs = {}
    for knob in ("0", "1"):
        _switch(monkeypatch, knob)
        outs[knob] = T.run_chunks(s["rows"], s["consts"], s["st_pre"], s["pos"], [200], dev=gpu)
    (o0, st0), (o1, st1) = outs["0"], outs["1"]
    assert not np.array_equal(T.bits(o0), T.bits(o1)), "BARO_DELTA_BLOCKED_MMA=1 gave the CUDA-core bits"
    T.assert_close(o1, o0, T.TOL_F64, "o: mma vs CUDA-core instance")
    for g, w, name in zip(st1, st0, T.LEAVES):
        T.assert_close(g, w, T.TOL_F64, f"{name}: mma vs CUDA-core instance")


def test_float64_blocked_reference_matches_cpu_kernel():
    """The reference above against the CPU kernel (fp32, the contract's order) on the small
    shapes and a mid-block start, so a GPU failure of the value tests is the kernel's, not the
    reference's."""
    for shape in SMALL:
        check_values(T.CPU, shape, 150, shape[4] // 2 + 1, seed=17000 + shape[2], tol=T.TOL_F64)
    check_values(T.CPU, MODEL, 65, 5, seed=17001, tol=T.TOL_F64)
    check_values(T.CPU, (1, 2, 16, 16, 64), 150, 33, seed=4242, tol=T.TOL_STRONG, strong=True)
