"""Seeded random weights in the params tree (see weights.py), generated on the default device.

Each layer is one jitted program (one per layer kind is compiled) that draws a single
normal vector from the key fold_in(key(seed), i + 1) and cuts every tensor of the layer
out of it in a fixed order; embed / final_norm / lm_head come from fold_in(key(seed), 0).
So nothing goes through the host, layer i's weights do not depend on the other layers,
and the same (cfg, seed, dtype) gives the same params (threefry: the same bits on every
backend, up to the last ulp of the normal transform).

Scales keep activations finite and non-degenerate through any number of layers:
matrices ~ N(0, 1) / sqrt(fan_in) (output variance ~ input variance), zero-centred
RMSNorm weights ~ 0.1 N(0, 1) (so the scale 1 + w stays near 1), the gated norm's
plain weight ~ 1 + 0.1 N(0, 1), the conv taps ~ 0.5 N(0, 1), A_log = log U(1, 16),
dt_bias = softplus^-1(dt) with dt log-uniform in [1e-3, 1e-1] (the Mamba
initialisation, so decays exp(g) span fast to slow), the router ~ 2x the matrix
scale (router logits of std ~2: clearly non-uniform routing), lm_head ~ 4x
(logits of std ~4 over the vocabulary: a peaked next-token distribution, so
greedy decoding is not decided by noise), embeddings ~ N(0, 1).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import jax.scipy.special

from .config import FULL, Config
from .weights import param_shapes

__all__ = ["synthetic_params"]


def _fill(key, specs, dtype):
    """Draw every tensor of `specs` [(path, (shape, is_f32), kind, scale, offset)] from one
    normal vector (one RNG program however many tensors), in spec order."""
    sizes = [math.prod(sf[0]) for _, sf, *_ in specs]
    z = jax.random.normal(key, (sum(sizes),), jnp.float32)
    out, off = {}, 0
    for (path, (shape, f32), kind, scale, offset), n in zip(specs, sizes):
        x = z[off:off + n].reshape(shape)
        off += n
        if kind == "normal":
            x = x * jnp.float32(scale) + jnp.float32(offset)
        elif kind == "log_uniform_1_16":  # A_log = log U(1, 16)
            x = jnp.log(1.0 + 15.0 * jax.scipy.special.ndtr(x))
        elif kind == "dt_bias":  # inverse softplus of dt, dt log-uniform in [1e-3, 1e-1]
            u = jax.scipy.special.ndtr(x)
            dt = jnp.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            x = dt + jnp.log(-jnp.expm1(-dt))
        else:
            raise ValueError(kind)
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = x.astype(jnp.float32 if f32 else dtype)
    return out


# One compiled program per layer kind (and one for the rest): few compiles, no host round trips.
@functools.partial(jax.jit, static_argnames=("cfg", "kind", "dtype"))
def _layer(root, i, *, cfg: Config, kind: str, dtype):
    ls = param_shapes(cfg)["layers"][0]
    D = cfg.hidden_size
    m = ls["moe"]

    def mat(path, sf, fan_in, gain=1.0):
        return (path, sf, "normal", gain / math.sqrt(fan_in), 0.0)

    def znorm(path, sf):  # zero-centred RMSNorm weight (scale is 1 + w)
        return (path, sf, "normal", 0.1, 0.0)

    specs = [
        znorm(("in_norm",), ls["in_norm"]),
        znorm(("post_norm",), ls["post_norm"]),
        mat(("moe", "router"), m["router"], D, gain=2.0),
        mat(("moe", "gate_up"), m["gate_up"], D),
        mat(("moe", "down"), m["down"], cfg.moe_inter),
        mat(("moe", "shared_gate_up"), m["shared_gate_up"], D),
        mat(("moe", "shared_down"), m["shared_down"], cfg.shared_inter),
        mat(("moe", "shared_gate"), m["shared_gate"], D),
    ]
    if kind == FULL:
        a = ls["attn"]
        specs += [
            mat(("attn", "qkv"), a["qkv"], D),
            mat(("attn", "o"), a["o"], cfg.num_heads * cfg.head_dim),
            znorm(("attn", "q_norm"), a["q_norm"]),
            znorm(("attn", "k_norm"), a["k_norm"]),
        ]
    else:
        g = ls["gdn"]
        specs += [
            mat(("gdn", "in_proj"), g["in_proj"], D),
            mat(("gdn", "conv"), g["conv"], cfg.conv_kernel),
            (("gdn", "A_log"), g["A_log"], "log_uniform_1_16", 0.0, 0.0),
            (("gdn", "dt_bias"), g["dt_bias"], "dt_bias", 0.0, 0.0),
            (("gdn", "norm"), g["norm"], "normal", 0.1, 1.0),  # plain weight (not 1 + w)
            mat(("gdn", "out"), g["out"], cfg.lin_v_heads * cfg.lin_v_dim),
        ]
    return _fill(jax.random.fold_in(root, i + 1), specs, dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _top(root, *, cfg: Config, dtype):
    s = param_shapes(cfg)
    specs = [(("embed",), s["embed"], "normal", 1.0, 0.0), (("final_norm",), s["final_norm"], "normal", 0.1, 0.0)]
    if not cfg.tie_word_embeddings:
        specs.append((("lm_head",), s["lm_head"], "normal", 4.0 / math.sqrt(cfg.hidden_size), 0.0))
    return _fill(jax.random.fold_in(root, 0), specs, dtype)


def synthetic_params(cfg: Config, seed: int = 0, dtype=jnp.bfloat16, place_layer=None):
    """Random weights with cfg's shapes in the params tree, on the default device.

    `place_layer(layer) -> layer` is applied to each layer as soon as it is drawn (tier mode moves
    its routed experts to host memory, so at most one layer's experts are on the device at a time)."""
    place_layer = place_layer or (lambda lp: lp)
    dtype = jnp.dtype(dtype)
    root = jax.random.key(seed)
    # the static cfg keeps only what shapes depend on, so every layer of a kind shares one compile
    scfg = dataclasses.replace(cfg, max_context=0, num_layers=1)
    layers = tuple(place_layer(_layer(root, jnp.int32(i), cfg=dataclasses.replace(scfg, layer_types=(lt,)), kind=lt, dtype=dtype))
                   for i, lt in enumerate(cfg.layer_types))
    top = _top(root, cfg=dataclasses.replace(scfg, num_layers=0, layer_types=()), dtype=dtype)
    return {"embed": top["embed"], "final_norm": top["final_norm"],
            "lm_head": top["embed"] if cfg.tie_word_embeddings else top["lm_head"], "layers": layers}
