"""Shared by the kernel tests (tests/test_kernels_*.py): the `platform` fixture, each op's
shapes and inputs, and the helpers more than one op's tests use.

For every op and several m:
  * bytes: m rows in one call == m calls of one row (and other splits, padded
    chunks, permuted rows), including the state that sequential ops carry;
  * values: within a stated tolerance of a float64 numpy reference
    (custom_calls/testing.py, from docs/NUMERICS.md) and of baro_jax.ops_xla;
  * errors: bad shapes/dtypes give clear messages.

Every test takes a `platform` parameter ("cpu", or "gpu" marked `gpu`, which
pytest deselects by default; run `pytest -m gpu` on a GPU machine).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import custom_calls as cc
from custom_calls.testing import BF16, bf16, f32, rope_tables


M_LIST = [1, 2, 5, 64, 300]


PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=PLATFORMS)
def platform(request):
    p = request.param
    try:
        devs = jax.devices(p)
    except RuntimeError:
        pytest.skip(f"no {p} device")
    if p == "gpu" and not {"CUDA", "ROCM"} & set(cc.available_platforms()):
        pytest.fail("GPU present but the baro GPU library is not loaded: "
                    f"{cc.load_errors()}")
    return devs[0]


def splits_for(m, rng):
    """Row splits: one row at a time, 1+rest, rest+1, a random split."""
    out = {"rows": [1] * m}
    if m >= 2:
        out["1+rest"] = [1, m - 1]
        out["rest+1"] = [m - 1, 1]
    if m >= 3:
        cuts = np.sort(rng.choice(np.arange(1, m), size=min(4, m - 1), replace=False))
        out["random"] = list(np.diff(np.concatenate([[0], cuts, [m]])).astype(int))
    return out


MM_K, MM_N = 96, 40


# GEMM tile configs (csrc/gpu/matmul.cu, env BARO_GEMM_TILE): the simple 16x32
# and 64x64 kernels, the pipelined 64x128 and 128x128 ones. Every config must
# give the bits of the one-row (decode, 16x32) call. Forcing is GPU-only and
# speed-only; on CPU the knob is ignored.
# "16": the 16-row slots on the default kernels (env BARO_GEMM_SMALL unset: gemm_row1.cuh's
# stream for a plain call of one slot where K % 16 == 0, else gemm_rows16); "16-stream": every
# 16-row slot on that stream (env BARO_GEMM_SMALL=stream), "16-lsu": so, with 16-byte cp.async
# copies instead of bulk ones (env BARO_ROW1_COPY=lsu).
# "16-simple": the 16-row slots on the simple synchronous kernel (env
# BARO_GEMM_SMALL=simple), which also runs every m = 1 call: the decode kernels and
# their predecessor must agree bit for bit.
# "16-rows16": gemm_rows16.cuh (env BARO_GEMM_SMALL=rows16); "16-deep" / "16-light": it with
# its deep or light cp.async ring (env BARO_ROWS16_RING; otherwise the kernel chooses: light
# for grouped calls); "16-w2" / "16-w1": its blocks of 2 or 1 warps (env BARO_ROWS16_WARPS).
# "64" / "128": the pipelined kernel with the ring its grid picks (deep at these tests' sizes);
# "-shallow" / "-deep": its 3-stage or 8 (BM 64) / 6 (BM 128) stage ring (env BARO_PIPE_RING).
# "16-tall" / "16-tall_light": gemm_rows16 with slots of 32 or 64 rows for plain GEMMs of more than
# 16 rows (env BARO_ROWS16_TALL=on; the deep ring at these sizes, or the light one).
# "-cols" (64, 128, 16-rows16) / "-rows" (128): the tiled kernels' grid with a slot's column tiles
# side by side, or a column tile's slots (env BARO_PIPE_ORDER; by default the grouped calls on
# the pipelined kernel take cols, every other call rows).
GEMM_TILES = ["16", "16-stream", "16-lsu", "16-simple", "16-rows16", "16-deep", "16-light", "16-w2", "16-w1", "16-tall",
              "16-tall_light", "simple", "64",
              "64-shallow", "128", "128-shallow", "128-deep", "64-cols", "128-cols", "128-rows", "16-rows16-cols"]
_TILE_KNOBS = ("BARO_GEMM_TILE", "BARO_GEMM_SMALL", "BARO_ROWS16_RING", "BARO_ROWS16_WARPS", "BARO_ROW1_COPY",
               "BARO_PIPE_RING", "BARO_ROWS16_TALL", "BARO_PIPE_ORDER")


def force_tile(monkeypatch, tile):
    for name in _TILE_KNOBS:
        monkeypatch.delenv(name, raising=False)
    if tile is None:
        return
    monkeypatch.setenv("BARO_GEMM_TILE", tile.split("-")[0])
    variant = tile.partition("-")[2]
    for order in ("cols", "rows"):
        if variant.endswith(order) and variant != "rows16":
            monkeypatch.setenv("BARO_PIPE_ORDER", order)
            variant = variant[:-len(order)].rstrip("-")
    if variant == "simple":
        monkeypatch.setenv("BARO_GEMM_SMALL", "simple")
    elif variant in ("rows16", "deep", "light", "w2", "w1", "tall", "tall_light") and tile.startswith("16"):
        monkeypatch.setenv("BARO_GEMM_SMALL", "rows16")
    if variant.startswith("tall"):
        monkeypatch.setenv("BARO_ROWS16_TALL", "on")
    if variant == "tall_light":
        monkeypatch.setenv("BARO_ROWS16_RING", "light")
    if variant in ("deep", "light") and tile.startswith("16"):
        monkeypatch.setenv("BARO_ROWS16_RING", variant)
    if variant in ("deep", "shallow") and not tile.startswith("16"):
        monkeypatch.setenv("BARO_PIPE_RING", variant)
    if variant in ("w2", "w1"):
        monkeypatch.setenv("BARO_ROWS16_WARPS", variant[1:])
    if variant in ("stream", "lsu"):
        monkeypatch.setenv("BARO_GEMM_SMALL", "stream")
    if variant == "lsu":
        monkeypatch.setenv("BARO_ROW1_COPY", "lsu")


def poison(dev, shape, dtype=jnp.float32):
    """Fill and free a NaN buffer of the result's size, so the allocator likely
    hands the same memory to the next result: an element the kernel forgets
    to write then shows up as NaN instead of a lucky leftover."""
    jnp.full(shape, jnp.nan, dtype, device=dev).block_until_ready().delete()


def gemm_tiles_for(platform):
    return GEMM_TILES if platform.platform == "gpu" else []


NORM_D = 80
GN_NV, GN_DV = 4, 16


AT_H, AT_HKV, AT_HD, AT_R2 = 4, 2, 32, 8
AT_POS = 37
AT_S = 1100  # room for rows that cross the GPU kernels' 512-position KV splits
AT_W = (2 * AT_H + 2 * AT_HKV) * AT_HD
COS, SIN = rope_tables(AT_S + 64, AT_R2)


def att_setup(rng, m, pos0, S=AT_S, shape=(AT_H, AT_HKV, AT_HD)):
    H, Hkv, hd = shape
    qkv = f32(rng, m, (2 * H + 2 * Hkv) * hd, scale=1.5)
    qn = f32(rng, hd, scale=0.2)
    kn = f32(rng, hd, scale=0.2)
    # history rows below pos0: random; everything else poisoned with NaN
    kc = np.full((S, Hkv, hd), np.nan, np.float32).astype(BF16)
    vc = kc.copy()
    kc[:pos0] = (rng.standard_normal((pos0, Hkv, hd), dtype=np.float32) * 2.0).astype(BF16)
    vc[:pos0] = rng.standard_normal((pos0, Hkv, hd), dtype=np.float32).astype(BF16)
    return qkv, qn, kn, kc, vc


CPU = jax.devices("cpu")[0]


CV_C = 48


DT_NK, DT_NV, DT_DK, DT_DV = 2, 4, 16, 16
DT_C = 2 * DT_NK * DT_DK + DT_NV * DT_DV


def delta_setup(rng, m):
    y = f32(rng, m, DT_C)
    b = f32(rng, m, DT_NV, scale=2.0)
    a = f32(rng, m, DT_NV, scale=2.0)
    A_log = f32(rng, DT_NV, scale=0.5)
    dt_bias = f32(rng, DT_NV, scale=0.5)
    state = f32(rng, DT_NV, DT_DK, DT_DV, scale=0.3)
    return y, b, a, A_log, dt_bias, state


MO_D, MO_E, MO_I, MO_IS, MO_K = 32, 8, 16, 24, 3


def moe_weights(rng):
    return (bf16(rng, MO_E, MO_D, scale=0.5),            # router
            bf16(rng, MO_E, 2 * MO_I, MO_D, scale=0.3),  # w_gate_up
            bf16(rng, MO_E, MO_D, MO_I, scale=0.3),      # w_down
            bf16(rng, 2 * MO_IS, MO_D, scale=0.3),       # shared_gate_up
            bf16(rng, MO_D, MO_IS, scale=0.3),           # shared_down
            bf16(rng, 1, MO_D, scale=0.3))               # shared_gate


def moe_weights_sized(rng, E, D, I, Is):
    return (bf16(rng, E, D, scale=0.5), bf16(rng, E, 2 * I, D, scale=0.3),
            bf16(rng, E, D, I, scale=0.3), bf16(rng, 2 * Is, D, scale=0.3),
            bf16(rng, D, Is, scale=0.3), bf16(rng, 1, D, scale=0.3))


def store_put(dev, a):
    """a into the host store as tier mode keeps it: pinned host memory on a GPU, else the device."""
    from jax.sharding import SingleDeviceSharding
    if dev.platform == "cpu":
        return jax.device_put(a, dev)
    return jax.device_put(a, SingleDeviceSharding(dev, memory_kind="pinned_host"))
