"""baro_matmul: the GEMM's bytes for every row count and tile config, the one-row streaming kernel,
errors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import J_MATMUL, assert_close, assert_same_bits, bf16, put, ref_matmul
from kernel_util import MM_K, MM_N, M_LIST, force_tile, gemm_tiles_for, platform, poison


@pytest.mark.parametrize("m", M_LIST)
def test_matmul(platform, m):
    rng = np.random.default_rng(100 + m)
    x, w = bf16(rng, m, MM_K), bf16(rng, MM_N, MM_K)
    full = np.asarray(J_MATMUL(*put(platform, x, w)))
    for i in range(m):
        one = np.asarray(J_MATMUL(*put(platform, x[i:i + 1], w)))
        assert_same_bits(one[0], full[i], f"matmul row {i} of m={m}")
    perm = rng.permutation(m)
    assert_same_bits(np.asarray(J_MATMUL(*put(platform, x[perm], w))), full[perm],
                     "matmul permuted rows")
    # eager call = jitted call
    assert_same_bits(np.asarray(cc.matmul(*put(platform, x, w))), full, "matmul eager vs jit")
    assert full.dtype == np.float32
    assert_close(full, ref_matmul(x, w), 1e-5, "matmul vs float64")


@pytest.mark.parametrize("m,K", [(2, 200), (17, 2056), (130, 203), (300, 200), (300, 2056), (17, 272),
                                 (300, 1040), (212, 272)])
def test_matmul_tiles(platform, m, K, monkeypatch):
    """Several row and N tiles of the large configs, K past a whole BK (200,
    2056 = 16*128 + 8: a half-filled last 16-step) and K % 8 != 0 (203: no
    16-byte loads, the simple kernel walks each 128-row slot in sub-tiles);
    K % 16 == 0 (272, 1040) puts forced 16-row slots on the stream (19 slots at
    m = 300), the others on gemm_rows16. The last 128-row tile's valid rows (2 at m = 130, 44 at
    300, 84 at 212) leave the pipelined kernel's warps 1, 3, none or 2 of their 4 m fragments
    to walk (gemm.cuh skips the rest)."""
    N = 264  # 2 full 128-column tiles and a partial one
    rng = np.random.default_rng(900 + m + K)
    x, w = bf16(rng, m, K), bf16(rng, N, K)
    wd = put(platform, w)
    poison(platform, (m, N))
    full = np.asarray(J_MATMUL(put(platform, x), wd))
    assert np.all(np.isfinite(full)), "matmul left elements unwritten"
    rows = range(m) if m <= 130 or platform.platform == "gpu" else sorted({0, 1, 63, 64, 127, 128, m - 1})
    for i in rows:
        one = np.asarray(J_MATMUL(put(platform, x[i:i + 1]), wd))
        assert_same_bits(one[0], full[i], f"matmul m={m} K={K} row {i} vs one-row call")
    for tile in gemm_tiles_for(platform):
        force_tile(monkeypatch, tile)
        poison(platform, (m, N))
        got = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b))(put(platform, x), wd))
        assert_same_bits(got, full, f"matmul m={m} K={K} forced tile {tile}")
        if tile == "16-simple":  # m = 1 on the simple kernel too
            one = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b))(put(platform, x[m - 1:]), wd))
            assert_same_bits(one[0], full[m - 1], f"matmul K={K} one row on the simple kernel")
    force_tile(monkeypatch, None)
    assert_close(full, ref_matmul(x, w), 1e-5, f"matmul m={m} K={K} vs float64")


# The one-row streaming kernel (gemm_row1.cuh, every m = 1 call with K % 16 == 0 on
# CUDA) against gemm_rows16 (BARO_GEMM_ROW1=off) and against the row inside batched
# calls (16-row and pipelined tiles). N = 1 (one unit), 40 (a partial 8-column unit),
# 4801 (more units than the persistent grid's warps: each warp streams several);
# K = 272 and 1040 end on a partial 256-wide stage; K = 2056 (K % 16 == 8) falls back
# to gemm_rows16.
@pytest.mark.parametrize("N,K", [(1, 2048), (40, 96), (264, 272), (4801, 1040), (40, 2056)])
def test_matmul_row1(platform, N, K, monkeypatch):
    rng = np.random.default_rng(1300 + N + K)
    x, w = bf16(rng, 130, K), bf16(rng, N, K)
    wd = put(platform, w)
    run = jax.jit(lambda a, b: cc.matmul(a, b))
    full = np.asarray(run(put(platform, x), wd))  # pipelined tiles
    few = np.asarray(run(put(platform, x[:3]), wd))  # 16-row tiles
    assert_same_bits(few, full[:3], f"matmul N={N} K={K} 3 rows vs 130")
    for i in (0, 2):
        for knob in (None, "off"):
            if knob is None:
                monkeypatch.delenv("BARO_GEMM_ROW1", raising=False)
            else:
                monkeypatch.setenv("BARO_GEMM_ROW1", knob)
            poison(platform, (1, N))  # a fresh jit: the launcher reads the knob when the graph is built
            one = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b))(put(platform, x[i:i + 1]), wd))
            assert np.all(np.isfinite(one)), f"matmul N={N} K={K} one row left elements unwritten"
            assert_same_bits(one[0], full[i], f"matmul N={N} K={K} row {i} one-row call (ROW1={knob})")
    monkeypatch.delenv("BARO_GEMM_ROW1", raising=False)
    assert_close(full[:3], ref_matmul(x[:3], w), 1e-5, f"matmul N={N} K={K} vs float64")


# The stream over 16-row slots (gemm_row1.cuh, SLOT16: by default plain GEMMs of 2 to 16 rows;
# BARO_GEMM_SMALL=stream: every 16-row slot, up to 64 rows when 64-row tiles would leave SMs
# idle) against the pipelined 130-row call and gemm_rows16, under the stream's speed knobs: units of 1, 2 or 4 n-tiles, 128-wide k stages (many per unit),
# one warp per SM (each warp wraps over many units), 16-byte cp.async copies. m = 2 (rows 1..15
# of the A fragment zero), 7, 16 (a full slot), 17 (a second slot of one row), 40 and 64 (slots
# of one column unit side by side). N = 1, 40 (a partial 8-column unit), 264, 4801 (more units
# than warps); K = 96 (one stage), 272 and 1040 (a partial last stage).
STREAM_KNOBS = [{}, {"BARO_GEMM_SMALL": "rows16"}] + [
    {"BARO_GEMM_SMALL": "stream", **kn} for kn in (
        {}, {"BARO_ROW1_NT": "1"}, {"BARO_ROW1_NT": "2"}, {"BARO_ROW1_NT": "4"}, {"BARO_ROW1_KCHUNK": "128"},
        {"BARO_ROW1_BPS": "1"}, {"BARO_ROW1_COPY": "lsu"})]


@pytest.mark.parametrize("N,K", [(1, 272), (40, 96), (264, 1040), (4801, 272)])
def test_matmul_stream16(platform, N, K, monkeypatch):
    if platform.platform != "gpu":
        pytest.skip("the 16-row stream is a CUDA kernel")
    rng = np.random.default_rng(1700 + N + K)
    x, w = bf16(rng, 130, K), bf16(rng, N, K)
    wd = put(platform, w)
    full = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b))(put(platform, x), wd))  # pipelined tiles
    names = sorted({n for kn in STREAM_KNOBS for n in kn})
    for m in (2, 7, 16, 17, 40, 64):
        lo = int(rng.integers(0, 130 - m + 1))  # a fresh window of rows each time
        for knobs in STREAM_KNOBS:
            for n in names:
                monkeypatch.delenv(n, raising=False)
            for n, v in knobs.items():
                monkeypatch.setenv(n, v)
            poison(platform, (m, N))  # a fresh jit: the launcher reads the knobs when the graph is built
            got = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b))(put(platform, x[lo:lo + m]), wd))
            assert np.all(np.isfinite(got)), f"matmul N={N} K={K} m={m} {knobs}: elements unwritten"
            assert_same_bits(got, full[lo:lo + m], f"matmul N={N} K={K} m={m} {knobs} vs the 130-row call")
    for n in names:
        monkeypatch.delenv(n, raising=False)


# The stream's blocks that load a plain call's A slot once and share it among their warps
# (BARO_ROW1_ASHARED=1, gemm_row1.cuh ASHARED; opt-in: its bytes pass on the GPU, its speed does not) against the
# default stream over 16-row slots (the knob off) and against one-row calls (gemm_row1's one-row
# kernel), at the model's shapes: in_proj (12352 x 2048), out_proj and attention o (2048 x 4096),
# qkv (9216 x 2048); 4801 x 1040 (a last k stage of one 16-step: the fragment loads past K land in
# the pad after A); 264 x 4224 (under BARO_ROW1_KCHUNK=128, 33 k stages: A pieces of 2 stages);
# 264 x 8192 (at m = 16, A leaves no room for the rings: =require fails there, =1 falls back to the
# default instance; fewer rows fit). m: 2 (rows 2..15 of the fragment zero), 3, 8 (a decode step of
# 8), 13, 16 (a full slot). Under the speed knobs: one warp per block (each warp streams several
# units, later ones finding A landed), 8 warps per block, units of 1 or 4 n-tiles, 128-wide k
# stages (32 A pieces at K = 4096), 16-byte cp.async for W (A stays on bulk copies). The knob is
# =require wherever A fits, so a fallback to the default instance fails instead of passing.
ASHARED_M = (2, 3, 8, 13, 16)
ASHARED_FALLBACK = {(264, 8192, 16)}  # (N, K, m) whose A does not fit beside two stages per warp
ASHARED_KNOBS = [{}, {"BARO_ROW1_BPS": "1"}, {"BARO_ROW1_BPS": "8"}, {"BARO_ROW1_NT": "1"}, {"BARO_ROW1_NT": "4"},
                 {"BARO_ROW1_KCHUNK": "128"}, {"BARO_ROW1_COPY": "lsu"}]
ASHARED_NAMES = ("BARO_ROW1_ASHARED", "BARO_GEMM_SMALL", "BARO_GEMM_TILE", "BARO_ROW1_BPS", "BARO_ROW1_NT",
                 "BARO_ROW1_KCHUNK", "BARO_ROW1_STAGES", "BARO_ROW1_COPY", "BARO_GEMM_ROW1")


def set_only(monkeypatch, names, knobs):
    """Exactly `knobs` of `names` set in the environment (the others unset)."""
    for n in names:
        monkeypatch.delenv(n, raising=False)
    for n, v in knobs.items():
        monkeypatch.setenv(n, v)


def knob_matmul(platform, monkeypatch, names, wd, N, K):
    """call(x, knobs): cc.matmul(x, W) on poisoned outputs with exactly `knobs` of `names` set while
    its graph is built (a fresh jit: the launcher reads the knobs then), every element checked written."""
    def call(x, knobs):
        set_only(monkeypatch, names, knobs)
        poison(platform, (x.shape[0], N))
        out = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b))(put(platform, x), wd))
        set_only(monkeypatch, names, {})
        assert np.all(np.isfinite(out)), f"matmul N={N} K={K} m={x.shape[0]} {knobs}: elements unwritten"
        return out
    return call


# The stream's TMA instance (BARO_ROW1_TMA=1, gemm_row1.cuh Row1Maps; opt-in, first run on a GPU
# pending): each 128-wide k sub-stage filled by two tensor copies (W's unit rows, A's rows) instead
# of one bulk copy per row, against the default bulk-copy stream, bytes on poisoned outputs, fresh
# inputs for every m. m = 1 is gemm_row1's one-row instance, 2 to 16 the 16-row stream; every row
# of the m-row call must equal its one-row call too. Shapes: the model's in_proj (12352 x 2048),
# out_proj / attention o (2048 x 4096) and qkv (9216 x 2048); 4801 x 1040 (a last unit of one
# column, a last sub-stage of one 16-step: the box past K comes back as zeros); 264 x 4224 (33
# sub-stages: a last stage of one); 264 x 144 (K under two sub-stages). Under the speed knobs:
# one and eight blocks per SM (smaller rings: stages of fewer sub-stages), units of 1 and 4
# n-tiles. require fails a call on the stream that the instance cannot take, so the bytes cannot
# come from the default kernel.
TMA_M = (1, 2, 3, 8, 13, 16)
TMA_KNOBS = [{}, {"BARO_ROW1_BPS": "1"}, {"BARO_ROW1_BPS": "8"}, {"BARO_ROW1_NT": "1"}, {"BARO_ROW1_NT": "4"}]
# The stream's swapped-operand instance (BARO_ROW1_SWAP=1, gemm_row1.cuh SWAP; opt-in, first run
# on a GPU pending): W's unit rows as the mma's 16-row operand, the call's rows as its 8-wide one
# (a second 8 past 8 rows), against the default stream (the rows as the 16-row operand), the same
# shapes: 264 and 4801 end in a unit whose second 16-column tile or most of it lies past N (rows
# never copied, never stored). m: 1 (gemm_row1's one-row layout), 2, 3, 5, 8, 13 and 16 (both
# token halves). Units of 2 n-tiles (BARO_ROW1_NT=1 asks for 1: the instance takes 2) and 4,
# 128-wide k stages, one and eight blocks per SM, 16-byte cp.async copies. =require throughout:
# a plain call that fell back to the default instance would fail.
SWAP_M = (1, 2, 3, 5, 8, 13, 16)
SWAP_KNOBS = [{}, {"BARO_ROW1_NT": "1"}, {"BARO_ROW1_NT": "4"}, {"BARO_ROW1_KCHUNK": "128"},
              {"BARO_ROW1_BPS": "1"}, {"BARO_ROW1_BPS": "8"}, {"BARO_ROW1_COPY": "lsu"}]
STREAM_SHAPES = [(12352, 2048), (2048, 4096), (9216, 2048), (4801, 1040), (264, 4224), (264, 8192), (264, 144)]
# per lever: its m, its speed knobs, the (N, K, m) it falls back at, a seed
STREAM_LEVERS = {"BARO_ROW1_ASHARED": (ASHARED_M, ASHARED_KNOBS, ASHARED_FALLBACK, 3100),
                 "BARO_ROW1_TMA": (TMA_M, TMA_KNOBS, set(), 3700),
                 "BARO_ROW1_SWAP": (SWAP_M, SWAP_KNOBS, set(), 4300)}
STREAM_NAMES = ASHARED_NAMES + ("BARO_ROW1_TMA", "BARO_ROW1_SWAP")


@pytest.mark.parametrize("lever", list(STREAM_LEVERS))
@pytest.mark.parametrize("N,K", STREAM_SHAPES)
def test_matmul_stream_levers(platform, lever, N, K, monkeypatch):
    if platform.platform != "gpu":
        pytest.skip("the stream's instances are CUDA kernels")
    ms, knob_sets, fallback, seed = STREAM_LEVERS[lever]
    rng = np.random.default_rng(seed + N + K)
    w = bf16(rng, N, K)
    call = knob_matmul(platform, monkeypatch, STREAM_NAMES, put(platform, w), N, K)
    for m in ms:
        x = bf16(rng, m, K)  # fresh inputs for every m
        want = call(x, {lever: "0"})  # the default: the stream, one bulk copy per row, A in every stage
        for i in range(m if m > 1 else 0):  # m = 1: gemm_row1's one-row kernel
            one = call(x[i:i + 1], {lever: "require"})
            assert_same_bits(one[0], want[i], f"matmul N={N} K={K} m={m} row {i}: one-row {lever} call vs the stream")
        mode = "require"
        if (N, K, m) in fallback:
            with pytest.raises(Exception, match="baro_matmul: kernel launch failed"):
                call(x, {lever: "require"})
            mode = "1"
        for knobs in knob_sets:
            got = call(x, {lever: mode, **knobs})
            assert_same_bits(got, want, f"matmul N={N} K={K} m={m} {knobs}: {lever}={mode} vs off")
    assert_close(want, ref_matmul(x, w), 1e-5, f"matmul N={N} K={K} m={m} vs float64")


# One stream instance under require at a time: two fail the call (a byte test under require must
# not pass on another instance), and one set to require is the only one tried, whatever else is on.
def test_matmul_stream_levers_require_one(platform, monkeypatch):
    if platform.platform != "gpu":
        pytest.skip("the stream's instances are CUDA kernels")
    rng = np.random.default_rng(4700)
    N, K, m = 264, 1040, 8
    x, w = bf16(rng, m, K), bf16(rng, N, K)
    call = knob_matmul(platform, monkeypatch, STREAM_NAMES, put(platform, w), N, K)
    want = call(x, {})
    for a, b in (("BARO_ROW1_SWAP", "BARO_ROW1_TMA"), ("BARO_ROW1_SWAP", "BARO_ROW1_ASHARED"),
                 ("BARO_ROW1_TMA", "BARO_ROW1_ASHARED")):
        with pytest.raises(Exception, match="baro_matmul: kernel launch failed"):
            call(x, {a: "require", b: "require"})
        for req, on in ((a, b), (b, a)):
            assert_same_bits(call(x, {req: "require", on: "1"}), want, f"{req}=require with {on}=1")


# The opt-in sm_90a wgmma + TMA GEMM (csrc/gpu/gemm_wgmma.cu, BARO_GEMM_WGMMA): plain calls of
# 64 rows or more, the same bytes as the mma.sync kernels. require turns a fallback into an error,
# so the test cannot pass on the default kernel. m: one 64-row tile, one row past it, a tile short
# of 128, exactly 128, partial last tiles; N: one 128-column tile, a partial one (200), many (2048),
# and 1544 (12352 / 8: a partial last tile of a wide projection); K: one 64-wide stage, 2048, and
# 2056 (K % 16 == 8: a half-filled last 16-step, the stage past it skipped). Both tile heights
# (BARO_GEMM_TILE=64 / 128 pick BM) and the default pick, each with the ring of 4 stages and of 3
# (BARO_GEMM_WGMMA_RING: two blocks per SM), then both rings in the column-fast walk (BARO_PIPE_ORDER=cols),
# then 256-row W tiles (BARO_GEMM_WGMMA_BN; N = 200: a second half partly past N, 1544: a last tile of
# 8 columns in its first box, so three of its four W boxes are not issued), then the persistent grid
# (BARO_GEMM_WGMMA_PERSIST=1: the resident blocks, =3: three).
WGMMA_M = [64, 65, 127, 128, 300, 1024]


@pytest.mark.parametrize("N,K", [(128, 64), (200, 2048), (2048, 64), (1544, 2048), (200, 2056), (128, 4096)])
def test_matmul_wgmma_same_bytes(platform, N, K, monkeypatch):
    if platform.platform != "gpu":
        pytest.skip("BARO_GEMM_WGMMA picks a CUDA kernel")
    # skip only on a GPU known not to be sm_90: a missing or differently spelled attribute runs the
    # test, where BARO_GEMM_WGMMA=require turns a fallback into an error instead of a vacuous pass
    cap = str(getattr(platform, "compute_capability", "") or "")
    if cap and cap.replace(".", "") != "90":
        pytest.skip(f"the wgmma GEMM runs on sm_90 only, this GPU is {cap} (elsewhere the knob falls back)")
    rng = np.random.default_rng(2500 + N + K)
    w = bf16(rng, N, K)
    wd = put(platform, w)

    def call(x, knob, tile=None, ring="4", order="auto", bn="128", persist="0"):
        force_tile(monkeypatch, tile)
        monkeypatch.setenv("BARO_GEMM_WGMMA_PERSIST", persist)
        monkeypatch.setenv("BARO_GEMM_WGMMA", knob)
        monkeypatch.setenv("BARO_GEMM_WGMMA_RING", ring)
        monkeypatch.setenv("BARO_PIPE_ORDER", order)
        monkeypatch.setenv("BARO_GEMM_WGMMA_BN", bn)
        poison(platform, (x.shape[0], N))  # a fresh jit: the launcher reads the knobs when the graph is built
        out = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b))(put(platform, x), wd))
        monkeypatch.delenv("BARO_GEMM_WGMMA", raising=False)
        monkeypatch.delenv("BARO_GEMM_WGMMA_RING", raising=False)
        monkeypatch.delenv("BARO_PIPE_ORDER", raising=False)
        monkeypatch.delenv("BARO_GEMM_WGMMA_BN", raising=False)
        monkeypatch.delenv("BARO_GEMM_WGMMA_PERSIST", raising=False)
        force_tile(monkeypatch, None)
        return out

    for m in WGMMA_M:
        x = bf16(rng, m, K)  # fresh inputs for every m
        want = call(x, "0")
        assert np.all(np.isfinite(want)), f"matmul N={N} K={K} m={m}: the default left elements unwritten"
        for tile in (None, "64", "128"):
            for ring in ("3", "4"):  # the ring of 4 last: `got` below is the default's
                got = call(x, "require", tile, ring)
                what = f"matmul N={N} K={K} m={m} tile {tile} ring {ring}"
                assert np.all(np.isfinite(got)), f"{what}: wgmma left elements unwritten"
                assert_same_bits(got, want, f"{what}: BARO_GEMM_WGMMA vs the default")
        # the column-fast walk of the grid (BARO_PIPE_ORDER=cols; plain calls walk rows under auto)
        for ring in ("3", "4"):
            assert_same_bits(call(x, "require", None, ring, "cols"), want,
                             f"matmul N={N} K={K} m={m} ring {ring} cols: BARO_GEMM_WGMMA vs the default")
        # 256-row W tiles (BARO_GEMM_WGMMA_BN: two m64n128 halves per k16 step), both tile heights
        for tile in ("64", "128"):
            for ring, order in (("4", "auto"), ("3", "cols")):
                assert_same_bits(call(x, "require", tile, ring, order, "plain"), want,
                                 f"matmul N={N} K={K} m={m} tile {tile} ring {ring} {order} BN 256: "
                                 "BARO_GEMM_WGMMA vs the default")
        # the persistent grid (BARO_GEMM_WGMMA_PERSIST: a block walks several tiles on one ring; =3:
        # three blocks, so every block walks many tiles here, idle and live warpgroups in turn)
        for tile, ring, order, bn, persist in (("64", "4", "auto", "128", "1"), ("128", "3", "cols", "128", "3"),
                                               ("128", "4", "auto", "plain", "3"), ("64", "3", "cols", "plain", "3"),
                                               ("128", "3", "auto", "plain", "1")):
            assert_same_bits(call(x, "require", tile, ring, order, bn, persist), want,
                             f"matmul N={N} K={K} m={m} tile {tile} ring {ring} {order} BN {bn} persist {persist}: "
                             "BARO_GEMM_WGMMA vs the default")
        # the decode path: a row of the wgmma call against a one-row call
        for i in sorted({0, m // 2, m - 1, int(rng.integers(0, m))}):
            one = call(x[i:i + 1], "0")
            assert_same_bits(one[0], got[i], f"matmul N={N} K={K} m={m} row {i}: wgmma vs one-row call")
    assert_close(got, ref_matmul(x, w), 1e-5, f"matmul N={N} K={K} wgmma vs float64")
    # more tiles than the persistent grid has blocks where N is wide (2048, 1544): a block walks
    # several tiles on one ring, in either walk and tile width
    x = bf16(rng, 3000, K)
    want = call(x, "0")
    for tile, ring, order, bn in (("128", "3", "auto", "128"), ("128", "4", "cols", "plain"), ("64", "4", "auto", "plain")):
        assert_same_bits(call(x, "require", tile, ring, order, bn, "1"), want,
                         f"matmul N={N} K={K} m=3000 tile {tile} ring {ring} {order} BN {bn} persistent: "
                         "BARO_GEMM_WGMMA vs the default")


# bf16_cols (the GDN projection's conv channels): the first S columns rounded to bf16, packed two
# to a word at the start of each row, the rest fp32 in place; the same values as the fp32 call and
# XLA's convert of them. Rows: one, two, odd, a 64-row tile and one past it (the wgmma kernel's
# plain calls), several tiles; S: none, inside the first 128-column tile, on a 256-column tile's
# edge, inside a 256-wide tile (its columns split between the two stores), all columns. On a GPU
# every kernel: the default pick (the wgmma epilogue at 64 rows and more on sm_90, the stream and
# the one-row kernel below), each forced tile, and the wgmma kernel refused (mma.sync, then the
# packing pass). Poisoned outputs: a column neither store reaches shows up as NaN.
def _packed_call(platform, x, wd, S):
    poison(platform, (x.shape[0], wd.shape[0]))
    y = np.asarray(jax.jit(lambda a, b: cc.matmul(a, b, bf16_cols=S))(put(platform, x), wd))
    return y.view(np.uint16).reshape(x.shape[0], 2 * wd.shape[0])[:, :S], y[:, S:]


@pytest.mark.parametrize("m", [1, 2, 37, 64, 65, 300])
def test_matmul_packs_bf16_columns(platform, m, monkeypatch):
    N, K = 520, 272
    rng = np.random.default_rng(3100 + m)
    x, w = bf16(rng, m, K), bf16(rng, N, K)
    wd = put(platform, w)
    full = np.asarray(J_MATMUL(put(platform, x), wd))
    rounded = np.asarray(jax.jit(lambda a: a.astype(jnp.bfloat16))(put(platform, full))).view(np.uint16)
    arms = [(None, {})]
    if platform.platform == "gpu":
        arms += [(t, {}) for t in ("16-simple", "16-stream", "64", "128")]
        arms += [(None, {"BARO_GEMM_WGMMA": "0"}), ("128", {"BARO_GEMM_WGMMA_BN": "plain"})]
    for tile, env in arms:
        force_tile(monkeypatch, tile)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        for S in (0, 40, 256, 384, N):
            p16, p32 = _packed_call(platform, x, wd, S)
            what = f"matmul m={m} bf16_cols={S} tile {tile} {env}"
            assert_same_bits(p16, rounded[:, :S], f"{what}: packed columns vs bf16 of the fp32 call")
            assert_same_bits(p32, full[:, S:], f"{what}: fp32 columns vs the fp32 call")
        for k in env:
            monkeypatch.delenv(k)
    force_tile(monkeypatch, None)


def test_matmul_packed_errors(platform):
    rng = np.random.default_rng(2)
    x, w = put(platform, bf16(rng, 3, 8), bf16(rng, 6, 8))
    for bad in (3, -2, 8):
        with pytest.raises(ValueError, match=rf"baro_matmul: bf16_cols must be even and in \[0, N=6\], got {bad}"):
            cc.matmul(x, w, bf16_cols=bad)
    with pytest.raises(ValueError, match=r"baro_matmul: bf16_cols must be a static Python int, got float"):
        cc.matmul(x, w, bf16_cols=2.0)
    with pytest.raises(ValueError, match=r"baro_matmul: bf16_cols must be a static Python int, got bool"):
        cc.matmul(x, w, bf16_cols=True)


def test_matmul_errors(platform):
    rng = np.random.default_rng(1)
    x, w = put(platform, bf16(rng, 3, 8), bf16(rng, 5, 8))
    with pytest.raises(ValueError, match=r"baro_matmul: x must have dtype bfloat16.*got dtype float32"):
        cc.matmul(x.astype(jnp.float32), w)
    with pytest.raises(ValueError, match=r"baro_matmul: w must have shape \[\*, 8\], got shape \[5, 7\]"):
        cc.matmul(x, w[:, :7])
    with pytest.raises(ValueError, match=r"baro_matmul: x must have rank 2"):
        cc.matmul(x[None], w)
    with pytest.raises(ValueError, match=r"baro_matmul: w must have dtype bfloat16"):
        jax.jit(cc.matmul)(x, w.astype(jnp.float16))
