"""The training forward (batched, chunked delta rule) computes the inference forward's function.

A small random config with both layer types (attention not last), GQA 3, nv/nk 2 with dk != dv,
16 experts top 3 and Is != I is exported as a float32 checkpoint and loaded with
``baro_jax.load(..., backend="xla", dtype="float32")``; the logits of every position of
``Engine.prompt_logits`` must equal ``train_model.forward_train``'s within float32 tolerance.
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import baro_jax
from baro_jax import ops_xla
from baro_jax import train_model as TM
from baro_jax.config import FULL, LINEAR, Config
from baro_jax.export import params_to_hf, write_checkpoint
from baro_jax.weights import params_from_state_dict

TOL = 1e-4

CFG = Config(
    model_type="qwen3_5_moe_text", vocab_size=256, hidden_size=48, num_layers=4,
    layer_types=(LINEAR, FULL, LINEAR, LINEAR), num_heads=6, num_kv_heads=2, head_dim=16, rope_theta=1e4,
    partial_rotary_factor=0.5, lin_k_heads=2, lin_v_heads=4, lin_k_dim=8, lin_v_dim=16, conv_kernel=4,
    num_experts=16, top_k=3, moe_inter=16, shared_inter=24, max_context=1024).validate()
CFG2 = dataclasses.replace(CFG, num_layers=2, layer_types=(LINEAR, FULL))


def _params(cfg, seed=0):
    """Training init, with the zero / one vectors (norm weights) perturbed so every weight matters."""
    return _params_jit(cfg, jnp.uint32(seed))


@functools.partial(jax.jit, static_argnums=(0,))
def _params_jit(cfg, seed):
    p = TM.init_params(cfg, jax.random.key(seed))
    leaves, tree = jax.tree.flatten(p)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    leaves = [x + 0.2 * jax.random.normal(k, x.shape) if x.ndim == 1 and x.shape[0] > 4 else x
              for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, leaves)


def _forward(params, ids, cfg, **kw):
    """forward_train, jitted (op-by-op dispatch of the whole model would be slow)."""
    return jax.jit(functools.partial(TM.forward_train, cfg=cfg, **kw))(params, jnp.asarray(ids))


def _ids(B, T, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (B, T))


@pytest.fixture(scope="module")
def f32_reference(tmp_path_factory):
    """params, ids [2, 150] (crossing chunk boundaries 32 and 64, ending mid-chunk) and the inference
    engine's logits for them, from the float32 checkpoint written by export.write_checkpoint."""
    params = _params(CFG)
    path = str(tmp_path_factory.mktemp("train_model") / "ckpt")
    write_checkpoint(params, CFG, path, dtype="float32")
    eng = baro_jax.load(path, backend="xla", dtype="float32", progress=False)
    ids = _ids(2, 150)
    ref = np.stack([eng.prompt_logits(list(map(int, r))) for r in ids])
    return params, ids, ref


@pytest.mark.parametrize("attn,chunk", [("xla", 32), ("reference", 64), ("xla", 0)])
def test_logits_equal_inference_forward(f32_reference, attn, chunk):
    params, ids, ref = f32_reference
    got, router = _forward(params, ids, CFG, dtype=jnp.float32, chunk=chunk, attn=attn)
    got = np.asarray(got)
    scale = max(1.0, float(np.abs(ref).max()))
    diff = float(np.abs(got - ref).max())
    assert diff <= TOL * scale, (diff, scale)
    assert len(router) == CFG.num_layers
    assert router[0][1].shape == (2 * 150, CFG.top_k)


def test_bf16_forward_close_to_bf16_engine(tmp_path):
    params = _params(CFG2, seed=3)
    path = write_checkpoint(params, CFG2, str(tmp_path / "bf16"), dtype="bfloat16")
    eng = baro_jax.load(path, backend="xla", dtype="bfloat16", progress=False)
    ids = _ids(1, 130, seed=3)
    ref = eng.prompt_logits(list(map(int, ids[0])))
    got = np.asarray(_forward(params, ids, CFG2, dtype=jnp.bfloat16, chunk=64)[0][0])
    scale = max(1.0, float(np.abs(ref).max()))
    # other rounding points (dense expert mixing, attention output) and summation orders: bf16-sized differences
    assert float(np.abs(got - ref).max()) <= 5e-2 * scale
    nll = lambda lg: float(np.mean(jax.nn.logsumexp(lg[:-1], -1) - lg[np.arange(129), ids[0, 1:]]))
    assert abs(nll(got) - nll(ref)) < 1e-2


def _recurrence(q, k, v, beta, g, S0):
    """ops_xla.delta's per-row loop, written on already formed inputs, per sequence."""
    def one(q, k, v, beta, g, S):
        def step(S, inp):
            qt, kt, vt, bt, gt = inp
            Sn = S * jnp.exp(gt)[:, None, None]
            d = (vt - jnp.einsum("hkv,hk->hv", Sn, kt)) * bt[:, None]
            Sn = Sn + kt[:, :, None] * d[:, None, :]
            return Sn, jnp.einsum("hkv,hk->hv", Sn, qt)
        S, o = jax.lax.scan(step, S, (q, k, v, beta, g))
        return o, S
    return jax.vmap(one)(q, k, v, beta, g, S0)


def test_chunked_delta_equals_recurrence_with_grads():
    B, T, H, dk, dv = 2, 45, 4, 8, 16
    ks = jax.random.split(jax.random.key(0), 6)
    q = ops_xla._l2norm(jax.random.normal(ks[0], (B, T, H, dk))) * dk ** -0.5
    k = ops_xla._l2norm(jax.random.normal(ks[1], (B, T, H, dk)))
    v = jax.random.normal(ks[2], (B, T, H, dv))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    g = -jax.nn.softplus(3 * jax.random.normal(ks[4], (B, T, H))) * 4  # fast and slow decays, some ~ -50
    S0 = jax.random.normal(ks[5], (B, H, dk, dv))
    w = jnp.cos(jnp.arange(dv))

    def value_and_grads(f):
        def loss(*a):
            o, S = f(*a)
            return jnp.sum(o * w) + jnp.sum(S), (o, S)
        return jax.jit(jax.value_and_grad(loss, argnums=range(6), has_aux=True))(q, k, v, beta, g, S0)

    (_, (o1, s1)), g1 = value_and_grads(_recurrence)
    for C in (16,):  # 45 rows: two whole chunks and a padded one
        (_, (o2, s2)), g2 = value_and_grads(lambda *a: TM.chunked_delta(*a[:5], C, a[5]))
        np.testing.assert_allclose(o2, o1, atol=2e-5, rtol=0)
        np.testing.assert_allclose(s2, s1, atol=2e-5, rtol=0)
        for a, b in zip(g1, g2):
            assert float(jnp.abs(a - b).max()) <= 1e-4 * max(1.0, float(jnp.abs(a).max()))


def test_export_is_the_loader_inverse():
    params = _params(CFG, seed=5)
    tensors = params_to_hf(params, CFG, np.float32)
    assert all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in tensors)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in tensors
    back = params_from_state_dict(tensors, CFG, dtype=jnp.float32)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # bf16 export: matrices rounded to nearest even, vectors kept fp32
    t16 = params_to_hf(params, CFG, ml_dtypes.bfloat16)
    assert t16["lm_head.weight"].dtype == ml_dtypes.bfloat16
    assert t16["model.language_model.layers.0.linear_attn.A_log"].dtype == np.float32


def test_load_balance_loss_and_a_training_step():
    E = 16
    N = 64
    uniform = (jnp.full((N, E), 1.0 / E), jnp.stack([jnp.arange(N) % E, (jnp.arange(N) + 1) % E], 1))
    assert abs(float(TM.load_balance_loss([uniform], E)) - 1.0) < 1e-6
    skew = (jax.nn.one_hot(jnp.zeros(N, int), E) * 0.9 + 0.1 / E, jnp.zeros((N, 2), int))
    assert float(TM.load_balance_loss([skew], E)) > 10.0

    cfg = CFG2
    params = _params(cfg, seed=7)
    ids = jnp.asarray(_ids(2, 65, seed=7))

    def loss(p):
        logits, router = TM.forward_train(p, ids[:, :-1], cfg=cfg, dtype=jnp.bfloat16, chunk=16)
        ce = jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, ids[:, 1:, None], -1)[..., 0])
        return ce + 0.01 * TM.load_balance_loss(router, cfg.num_experts)

    val, grads = jax.jit(jax.value_and_grad(loss))(params)
    assert math.isfinite(float(val)) and abs(float(val) - math.log(256)) < 3
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in leaves)
    # every kind of weight gets a gradient (router included, through the top-k weights and the aux loss)
    assert float(jnp.abs(grads["layers"][0]["moe"]["router"]).max()) > 0
    assert float(jnp.abs(grads["layers"][1]["attn"]["q_norm"]).max()) > 0
    assert float(jnp.abs(grads["layers"][0]["gdn"]["A_log"]).max()) > 0
