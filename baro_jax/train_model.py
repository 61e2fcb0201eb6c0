"""Training-only forward: a batch of whole sequences [B, T] at once.

It computes the same function as ``model.forward`` (one sequence, explicit
state, m rows per call) started from the zero state at position 0, with the
same building blocks of the ``xla`` backend (``ops_xla``: matmul, rmsnorm,
head_rmsnorm, rope, conv, delta_inputs, gated_norm) and the same rounding
points, except where training needs another evaluation order:

* the Gated DeltaNet recurrence runs in its chunked (WY) form: inside a chunk
  of ``chunk`` rows the delta rule is a unit lower-triangular solve and a few
  matmuls; a ``lax.scan`` carries the fp32 state from chunk to chunk. The
  algebra is exactly the per-row rule of NUMERICS.md (``S *= exp(g);
  d = (v - S^T k) beta; S += k d^T; o = S^T q``), only summed in another order;
* attention over the whole sequence is one causal ``jax.nn.dot_product_attention``
  (cuDNN flash attention on a GPU where it applies, plain XLA elsewhere);
* the routed experts run densely: every token through every expert, each
  output scaled by its routing weight, which is 0 for the experts outside the
  token's top k. So the output is the top-k mixture of NUMERICS.md; the
  probabilities and choices are returned for the load-balancing loss.

``tests/test_train_model.py`` checks that the logits equal
``baro_jax.load(ckpt, backend="xla", dtype="float32").prompt_logits(ids)``
within float32 tolerance.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from . import ops_xla as ops
from .config import FULL, Config
from .model import rope_tables

f32 = jnp.float32

__all__ = ["init_params", "cast_params", "forward_train", "chunked_delta", "f32_leaf_mask", "count_params"]


# ----------------------------------------------------------------------------- params

def f32_leaf_mask(params):
    """True for the leaves kept in fp32 at any compute dtype (norm weights, A_log, dt_bias)."""
    def mask_layer(lp):
        out = {"in_norm": True, "post_norm": True, "moe": {k: False for k in lp["moe"]}}
        if "attn" in lp:
            out["attn"] = {"qkv": False, "o": False, "q_norm": True, "k_norm": True}
        if "gdn" in lp:
            out["gdn"] = {"in_proj": False, "conv": False, "A_log": True, "dt_bias": True, "norm": True, "out": False}
        return out
    return {"embed": False, "final_norm": True, "lm_head": False,
            "layers": tuple(mask_layer(lp) for lp in params["layers"])}


def cast_params(params, dtype):
    """Matrices to the compute dtype, fp32 leaves stay fp32 (the loader's convention)."""
    return jax.tree.map(lambda p, keep: p.astype(f32) if keep else p.astype(dtype), params, f32_leaf_mask(params))


def count_params(params) -> int:
    return int(sum(int(math.prod(p.shape)) for p in jax.tree.leaves(params)))


def init_params(cfg: Config, key, *, out_scale: float | None = None):
    """Training initialisation (fp32 master weights) in the params tree of weights.py.

    Matrices ~ N(0, 1/fan_in); the projections that write into the residual stream
    (attention o, GDN out, expert and shared down) are further scaled by
    1/sqrt(2 * num_layers); embeddings ~ N(0, 1); lm_head ~ N(0, 1/D); router
    ~ N(0, 1/D); zero-centred norms 0 (scale 1); GDN gated norm 1; conv taps
    ~ N(0, 1/4); A_log = log U(1, 16); dt_bias = softplus^-1(dt), dt
    log-uniform in [1e-3, 1e-1] (the Mamba / Qwen3-Next initialisation).
    """
    D, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_inter, cfg.shared_inter
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    nv, dv = cfg.lin_v_heads, cfg.lin_v_dim
    out_scale = out_scale if out_scale is not None else 1.0 / math.sqrt(2 * cfg.num_layers)
    keys = iter(jax.random.split(key, 16 * (cfg.num_layers + 1)))

    def normal(shape, std):
        return jax.random.normal(next(keys), shape, f32) * f32(std)

    layers = []
    for lt in cfg.layer_types:
        lp = {
            "in_norm": jnp.zeros((D,), f32), "post_norm": jnp.zeros((D,), f32),
            "moe": {
                "router": normal((E, D), 1.0 / math.sqrt(D)),
                "gate_up": normal((E, 2 * I, D), 1.0 / math.sqrt(D)),
                "down": normal((E, D, I), out_scale / math.sqrt(I)),
                "shared_gate_up": normal((2 * Is, D), 1.0 / math.sqrt(D)),
                "shared_down": normal((D, Is), out_scale / math.sqrt(Is)),
                "shared_gate": normal((1, D), 1.0 / math.sqrt(D)),
            },
        }
        if lt == FULL:
            lp["attn"] = {
                "qkv": normal((cfg.attn_qkv_dim, D), 1.0 / math.sqrt(D)),
                "o": normal((D, H * hd), out_scale / math.sqrt(H * hd)),
                "q_norm": jnp.zeros((hd,), f32), "k_norm": jnp.zeros((hd,), f32),
            }
        else:
            u = jax.random.uniform(next(keys), (nv,), f32)
            dt = jnp.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            lp["gdn"] = {
                "in_proj": normal((cfg.gdn_in_dim, D), 1.0 / math.sqrt(D)),
                "conv": normal((cfg.conv_dim, cfg.conv_kernel), 0.5),
                "A_log": jnp.log(jax.random.uniform(next(keys), (nv,), f32, 1.0, 16.0)),
                "dt_bias": dt + jnp.log(-jnp.expm1(-dt)),
                "norm": jnp.ones((dv,), f32),
                "out": normal((D, nv * dv), out_scale / math.sqrt(nv * dv)),
            }
        layers.append(lp)
    embed = normal((cfg.vocab_size, D), 1.0)
    return {"embed": embed, "final_norm": jnp.zeros((D,), f32),
            "lm_head": embed if cfg.tie_word_embeddings else normal((cfg.vocab_size, D), 1.0 / math.sqrt(D)),
            "layers": tuple(layers)}


# ----------------------------------------------------------------------------- the chunked delta rule

def _unit_lower_inverse_fwd_subst(L):
    C = L.shape[-1]
    eye = jnp.eye(C, dtype=L.dtype)

    def body(i, T):
        li = lax.dynamic_index_in_dim(L, i, axis=-2, keepdims=True)           # [..., 1, C]
        ei = lax.dynamic_index_in_dim(eye, i, axis=0, keepdims=True)          # [1, C]
        row = ei - jnp.matmul(li, T, precision=lax.Precision.HIGHEST)        # rows >= i of T are still 0
        return lax.dynamic_update_index_in_dim(T, row, i, axis=-2)

    return lax.fori_loop(0, C, body, jnp.zeros_like(L), unroll=4)


@jax.custom_vjp
def unit_lower_inverse(L):
    """(I + L)^-1 for strictly lower-triangular L [..., C, C], by forward substitution, row by row.

    (Not lax.linalg.triangular_solve: its gradient hung XLA:CPU at batch sizes >= 16 here.)
    The backward pass needs no solve: d(M^-1) = -M^-T dT M^-T, kept strictly lower."""
    return _unit_lower_inverse_fwd_subst(L)


def _uli_fwd(L):
    T = _unit_lower_inverse_fwd_subst(L)
    return T, T


def _uli_bwd(T, dT):
    Tt = jnp.swapaxes(T, -1, -2)
    hi = lax.Precision.HIGHEST
    dM = -jnp.matmul(jnp.matmul(Tt, dT, precision=hi), Tt, precision=hi)
    return (jnp.tril(dM, -1),)


unit_lower_inverse.defvjp(_uli_fwd, _uli_bwd)


def chunked_delta(q, k, v, beta, g, chunk: int = 64, state=None):
    """Gated delta rule over whole sequences, chunk by chunk.

    q, k: [B, T, H, dk] (already normalised and, for q, scaled), v: [B, T, H, dv],
    beta, g: [B, T, H] (beta = sigmoid(b), g = log decay <= 0), all fp32.
    Returns (o [B, T, H, dv], final state [B, H, dk, dv]). Equal (up to summation
    order) to running ``ops_xla.delta``'s per-row recurrence from ``state`` (zero if None).
    """
    B, T, H, dk = q.shape
    dv = v.shape[-1]
    C = chunk
    pad = (-T) % C
    if pad:  # padded rows have k = v = beta = g = 0: they leave the state unchanged
        z = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, beta, g = map(z, (q, k, v, beta, g))
    n = (T + pad) // C

    def chunks(x):  # [B, T, H, ...] -> [n, B, H, C, ...]
        x = x.reshape((B, n, C, H) + x.shape[3:])
        return jnp.moveaxis(x, (1, 3), (0, 2))

    q, k, v, beta, g = (chunks(x.astype(f32)) for x in (q, k, v, beta, g))
    G = jnp.cumsum(g, axis=-1)                                # [n, B, H, C], inclusive
    incl = jnp.tril(jnp.ones((C, C), bool))                   # s <= t
    strict = jnp.tril(jnp.ones((C, C), bool), -1)             # s < t
    diff = G[..., :, None] - G[..., None, :]                  # G_t - G_s (<= 0 where s <= t)
    decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)
    hi = lax.Precision.HIGHEST
    kk = jnp.einsum("...tk,...sk->...ts", k, k, precision=hi)
    L = jnp.where(strict, beta[..., :, None] * kk * decay, 0.0)
    # d = (I + L)^-1 [beta v - beta exp(G) k S0]
    Tinv = unit_lower_inverse(L)
    u = jnp.einsum("...ts,...sv->...tv", Tinv, v * beta[..., None], precision=hi)
    w = jnp.einsum("...ts,...sk->...tk", Tinv, k * (beta * jnp.exp(G))[..., None], precision=hi)
    qk = jnp.einsum("...tk,...sk->...ts", q, k, precision=hi) * decay
    qg = q * jnp.exp(G)[..., None]
    kdec = k * jnp.exp(G[..., -1:] - G)[..., None]
    glast = jnp.exp(G[..., -1])[..., None, None]

    def step(S, xs):
        u_i, w_i, qk_i, qg_i, kdec_i, gl_i = xs
        d = u_i - jnp.einsum("bhck,bhkv->bhcv", w_i, S, precision=hi)
        o = jnp.einsum("bhck,bhkv->bhcv", qg_i, S, precision=hi) + jnp.einsum("bhts,bhsv->bhtv", qk_i, d, precision=hi)
        S = gl_i * S + jnp.einsum("bhck,bhcv->bhkv", kdec_i, d, precision=hi)
        return S, o

    S0 = jnp.zeros((B, H, dk, dv), f32) if state is None else state.astype(f32)
    S, o = lax.scan(step, S0, (u, w, qk, qg, kdec, glast))
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(B, n * C, H, dv)[:, :T]
    return o, S


# ----------------------------------------------------------------------------- blocks

def _attention(h, p, cfg: Config, cos, sin, A, impl):
    """Gated causal attention over [B, T] (NUMERICS.md attention, at pos 0, n_valid = T)."""
    B, T, D = h.shape
    H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = ops.matmul(h.reshape(B * T, D), p["qkv"])
    qg = qkv[:, :2 * H * hd].reshape(B * T, H, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = qkv[:, 2 * H * hd:(2 * H + Hkv) * hd].reshape(B * T, Hkv, hd)
    v = qkv[:, (2 * H + Hkv) * hd:].reshape(B * T, Hkv, hd)
    cb, sb = jnp.tile(cos, (B, 1)), jnp.tile(sin, (B, 1))
    q = ops.rope(ops.head_rmsnorm(q, p["q_norm"], cfg.rms_eps), cb, sb).astype(A).reshape(B, T, H, hd)
    k = ops.rope(ops.head_rmsnorm(k, p["k_norm"], cfg.rms_eps), cb, sb).astype(A).reshape(B, T, Hkv, hd)
    v = v.astype(A).reshape(B, T, Hkv, hd)
    if impl == "reference":
        rep = H // Hkv
        s = jnp.einsum("btgrd,bsgd->bgrts", q.reshape(B, T, Hkv, rep, hd), k,
                       preferred_element_type=f32) * f32(hd ** -0.5)
        mask = jnp.tril(jnp.ones((T, T), bool))
        pr = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        o = jnp.einsum("bgrts,bsgd->btgrd", pr.astype(A), v, preferred_element_type=f32).reshape(B * T, H, hd)
    else:
        o = jax.nn.dot_product_attention(q, k, v, scale=hd ** -0.5, is_causal=True,
                                         implementation=None if impl == "auto" else impl)
        o = o.reshape(B * T, H, hd).astype(f32)
    o = (o * jax.nn.sigmoid(gate)).astype(A).reshape(B * T, H * hd)
    return ops.matmul(o, p["o"]).reshape(B, T, D)


def _gdn(h, p, cfg: Config, A, chunk):
    """Gated DeltaNet over [B, T] from the zero state (conv window and delta state)."""
    B, T, D = h.shape
    C = cfg.conv_dim
    nv, dv, nk, dk = cfg.lin_v_heads, cfg.lin_v_dim, cfg.lin_k_heads, cfg.lin_k_dim
    nvdv = nv * dv
    proj = ops.matmul(h.reshape(B * T, D), p["in_proj"])
    mixed = proj[:, :C].astype(A).reshape(B, T, C)
    z = proj[:, C:C + nvdv]
    b = proj[:, C + nvdv:C + nvdv + nv]
    a = proj[:, C + nvdv + nv:]
    window = jnp.zeros((cfg.conv_kernel - 1, C), A)
    y = jax.vmap(lambda x: ops.conv(x, p["conv"], window, T)[0])(mixed)
    q, k, v, beta, g = ops.delta_inputs(y.reshape(B * T, C), b, a, p["A_log"], p["dt_bias"],
                                        nk=nk, dk=dk, nv=nv, dv=dv)
    rs = lambda x: x.reshape((B, T) + x.shape[1:])
    if chunk:
        o, _ = chunked_delta(rs(q), rs(k), rs(v), rs(beta), rs(g), chunk)
    else:  # the inference recurrence itself, per sequence (slow; for checks)
        st = jnp.zeros((nv, dk, dv), f32)
        o = jax.vmap(lambda yy, bb, aa: ops.delta(yy, bb, aa, p["A_log"], p["dt_bias"], st, T, nk=nk, dk=dk)[0])(
            y, rs(b), rs(a))
    gn = ops.gated_norm(o.reshape(B * T, nv, dv), z, p["norm"], cfg.rms_eps, A)
    return ops.matmul(gn, p["out"]).reshape(B, T, D)


def _moe(h, m, cfg: Config, A):
    """Top-k routed experts (computed densely, weight 0 outside the top k) plus the gated shared expert.
    h: [N, D] in A. Returns (out [N, D] fp32, router probs [N, E] fp32, top-k ids [N, k])."""
    N, D = h.shape
    E, I = cfg.num_experts, cfg.moe_inter
    p = jax.nn.softmax(ops.matmul(h, m["router"]), axis=-1)
    w, idx = lax.top_k(p, cfg.top_k)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    comb = jnp.zeros((N, E), f32)
    for s in range(cfg.top_k):
        comb = comb + jax.nn.one_hot(idx[:, s], E, dtype=f32) * w[:, s, None]
    gu = ops.matmul(h, m["gate_up"].reshape(E * 2 * I, D)).reshape(N, E, 2 * I)
    act = (jax.nn.silu(gu[..., :I]) * gu[..., I:]).astype(A)
    act = (act.astype(f32) * comb[..., None]).astype(A).reshape(N, E * I)
    down = jnp.transpose(m["down"], (1, 0, 2)).reshape(D, E * I)
    routed = ops.matmul(act, down)
    sgu = ops.matmul(h, m["shared_gate_up"])
    Is = sgu.shape[1] // 2
    s_out = ops.matmul((jax.nn.silu(sgu[:, :Is]) * sgu[:, Is:]).astype(A), m["shared_down"])
    sg = jax.nn.sigmoid(ops.matmul(h, m["shared_gate"]))
    return routed + sg * s_out, p, idx


def forward_train(params, tokens, *, cfg: Config, dtype=jnp.bfloat16, chunk: int = 64, attn: str = "auto",
                  remat: bool = False):
    """tokens [B, T] int -> (logits [B, T, V] fp32, router: tuple per layer of (probs [B*T, E], top-k ids)).

    ``params`` may hold fp32 master weights: matrices are cast to ``dtype`` here.
    ``chunk``: delta-rule chunk length (0: the per-row recurrence of ops_xla.delta).
    ``attn``: "auto" / "cudnn" / "xla" (jax.nn.dot_product_attention) or "reference" (plain einsum).
    """
    A = jnp.dtype(dtype)
    B, T = tokens.shape
    D = cfg.hidden_size
    p = cast_params(params, A)
    cos, sin = rope_tables(cfg, T)
    x = p["embed"][tokens].astype(f32)
    router = []

    def layer(x, lp, kind):
        h = ops.rmsnorm(x, lp["in_norm"], cfg.rms_eps, A)
        if kind == FULL:
            y = _attention(h, lp["attn"], cfg, cos, sin, A, attn)
        else:
            y = _gdn(h, lp["gdn"], cfg, A, chunk)
        x = x + y
        h2 = ops.rmsnorm(x, lp["post_norm"], cfg.rms_eps, A)
        out, pr, idx = _moe(h2.reshape(B * T, D), lp["moe"], cfg, A)
        return x + out.reshape(B, T, D), (pr, idx)

    for lp, kind in zip(p["layers"], cfg.layer_types):
        f = jax.checkpoint(layer, static_argnums=(2,)) if remat else layer
        x, r = f(x, lp, kind)
        router.append(r)
    hN = ops.rmsnorm(x, p["final_norm"], cfg.rms_eps, A).reshape(B * T, D)
    logits = ops.matmul(hN, p["lm_head"]).reshape(B, T, cfg.vocab_size)
    return logits, tuple(router)


def load_balance_loss(router, num_experts: int):
    """Switch / Qwen-MoE auxiliary loss, averaged over layers: E * sum_e f_e * P_e, where f_e is
    the fraction of top-k assignments that go to expert e and P_e its mean router probability
    (1.0 when routing is uniform)."""
    tot = 0.0
    for pr, idx in router:
        f = jnp.mean(jax.nn.one_hot(idx, num_experts, dtype=f32).sum(1), axis=0) / idx.shape[1]
        P = jnp.mean(pr, axis=0)
        tot = tot + num_experts * jnp.sum(lax.stop_gradient(f) * P)
    return tot / max(len(router), 1)
