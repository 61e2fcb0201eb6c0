"""model.gdn_rows (one decode row per pool slot) runs the conv and the delta rule in rows mode: the
kernels read each row's channels and heads where they sit. Its bytes (the layer's output rows, the
conv windows, the delta states) equal those of the formulation it replaced, which folded the P rows
into one row of P times the channels with XLA slices, a concatenate and tiled weights (kept below
as the reference), on the tiny config, over two chained steps, on the ordered and the xla backend."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import baro_jax
from baro_jax import model as M
from baro_jax.config import FULL
from baro_jax.ops import get_ops


def gdn_rows_folded(h, p, pool, cfg, ops):
    """model.gdn_rows as it was before rows mode (2619f8c), verbatim but for fold_rows inlined."""
    fold_rows = lambda x: x.reshape(1, -1)
    P = h.shape[0]
    C, nv, nk, dk = cfg.conv_dim, cfg.lin_v_heads, cfg.lin_k_heads, cfg.lin_k_dim
    nvdv = nv * cfg.lin_v_dim
    proj = ops.matmul(h, p["in_proj"])
    z_col, b_col, a_col = C, C + nvdv, C + nvdv + nv
    K1 = pool["conv"].shape[0]
    y, window = ops.conv(fold_rows(proj[:, :C]), jnp.tile(p["conv"], (P, 1)), pool["conv"].reshape(K1, P * C),
                         jnp.int32(1))
    y = y.reshape(P, C)
    qk = nk * dk
    y1 = jnp.concatenate([fold_rows(y[:, :qk]), fold_rows(y[:, qk:2 * qk]), fold_rows(y[:, 2 * qk:])], axis=1)
    o, ssm = ops.delta(y1, fold_rows(proj[:, b_col:b_col + nv]), fold_rows(proj[:, a_col:a_col + nv]),
                       jnp.tile(p["A_log"], P), jnp.tile(p["dt_bias"], P),
                       pool["ssm"].reshape((P * nv,) + pool["ssm"].shape[2:]), jnp.int32(1), nk=P * nk, dk=dk)
    o = o.reshape(P, nv, cfg.lin_v_dim)
    g = ops.gated_norm(o, proj, p["norm"], cfg.rms_eps, h.dtype, z_col=z_col)
    return ops.matmul(g, p["out"]), {"conv": window.reshape(K1, P, C), "ssm": ssm.reshape(pool["ssm"].shape)}


@pytest.fixture(scope="module")
def tiny():
    eng = baro_jax.load("tiny", backend="ordered", progress=False)
    layers = [i for i, kind in enumerate(eng.cfg.layer_types) if kind != FULL]
    return eng.cfg, [eng.params["layers"][i]["gdn"] for i in layers[:2]]


def leaves_bytes(tree):
    return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("backend", ["ordered", "xla"])
@pytest.mark.parametrize("P", [1, 3, 8])
def test_gdn_rows_equals_the_folded_formulation(tiny, backend, P):
    cfg, gdns = tiny
    ops = get_ops(backend)
    rng = np.random.default_rng(40 + P)
    nv, dk, dv, C = cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim, cfg.conv_dim
    new = jax.jit(lambda h, p, pool: M.gdn_rows(h, p, pool, cfg, ops))
    old = jax.jit(lambda h, p, pool: gdn_rows_folded(h, p, pool, cfg, ops))
    for p in gdns:
        pool = {"conv": jnp.asarray(rng.standard_normal((cfg.conv_kernel - 1, P, C)), jnp.bfloat16),
                "ssm": jnp.asarray(rng.standard_normal((P, nv, dk, dv)) * 0.3, jnp.float32)}
        st_new = st_old = pool
        for step in range(2):  # the second step starts from each formulation's own state
            h = jnp.asarray(rng.standard_normal((P, p["in_proj"].shape[1])), jnp.bfloat16)
            out_new, st_new = new(h, p, st_new)
            out_old, st_old = old(h, p, st_old)
            assert np.asarray(out_new).tobytes() == np.asarray(out_old).tobytes(), \
                f"{backend} P={P} step {step}: gdn_rows output differs from the folded formulation"
            assert leaves_bytes(st_new) == leaves_bytes(st_old), \
                f"{backend} P={P} step {step}: gdn_rows state differs from the folded formulation"
            assert np.all(np.isfinite(np.asarray(out_new, np.float32)))


def test_gdn_rows_has_no_fold_copies(tiny):
    """The rows-mode graph hands the projection and the pool to the kernels as they are: no slice,
    concatenate or tile (broadcast) of them is left in the decode layer."""
    cfg, gdns = tiny
    P = 8
    ops = get_ops("ordered")
    pool = {"conv": jnp.zeros((cfg.conv_kernel - 1, P, cfg.conv_dim), jnp.bfloat16),
            "ssm": jnp.zeros((P, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim), jnp.float32)}
    h = jnp.zeros((P, gdns[0]["in_proj"].shape[1]), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda h, p, pool: M.gdn_rows(h, p, pool, cfg, ops))(h, gdns[0], pool))
    for prim in ("slice", "concatenate", "broadcast_in_dim", "gather"):
        assert f" {prim}[" not in jaxpr, f"gdn_rows still runs {prim}: {jaxpr}"
    ref = str(jax.make_jaxpr(lambda h, p, pool: gdn_rows_folded(h, p, pool, cfg, ops))(h, gdns[0], pool))
    assert " concatenate[" in ref and " slice[" in ref  # the check above can fail
