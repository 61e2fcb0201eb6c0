"""Order-changing variants: opt-in ops objects built from the ordered backend with overrides.

A variant changes the summation order of one or more ops, so batched prefill
is no longer byte-identical to replay: variants FAIL the identity gate by
design and are judged by teacher-forced agreement instead
(`benchmarks/agreement.py`, bar 99%). None is on by default; select one with
`--variant NAME`, `baro_jax.load(..., variant=NAME)` or `BARO_VARIANT=NAME` (settings.py).

- ``xla``: the whole plain-jnp backend (``ops_xla``), every op.
- ``attn-fast``: prefill attention (m > 1 rows) through
  ``jax.nn.dot_product_attention`` (cuDNN flash attention on a CUDA GPU, XLA
  elsewhere); q/k head norms, rope and the cache write are ``ops_xla``'s.
  Decode (m = 1) stays on the ordered kernel. Everything else is ordered.
- ``delta-chunk``: the prefill delta rule (m > 1) in its chunked (dense WY)
  form, ``train_model.chunked_delta``; decode (m = 1) stays ordered.
  Everything else is ordered.

The ops objects are made once per name (they are static jit arguments: the
same object means the same compiled graph).
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from . import ops_xla
from .ops import get_ops as backend_ops
from .settings import VARIANTS
from .train_model import chunked_delta

OP_NAMES = ("matmul", "gdn_projection", "rmsnorm", "add_rmsnorm", "gated_norm", "attention", "conv", "delta",
            "delta_blocked", "moe")
DELTA_CHUNK = 64  # rows per WY block of the delta-chunk variant (the training script's chunk)
f32 = jnp.float32


def unknown(name) -> ValueError:
    return ValueError(f"unknown variant {name!r}; choose one of {', '.join(VARIANTS)} "
                      "(or none: the ordered backend, the default)")


def check(name: str | None) -> str | None:
    """None / '' / 'none' -> None (no variant); a known name -> itself; else a ValueError naming the choices."""
    if name is None or name == "" or name == "none":
        return None
    if name not in VARIANTS:
        raise unknown(name)
    return name


class VariantOps:
    """An ops object (same attributes as ops_ordered / ops_xla) with some ops overridden.

    Hashed by identity: one instance per variant name (see get_ops)."""

    def __init__(self, name: str, base, overrides: dict):
        self.name = name
        self.overridden = tuple(sorted(overrides))
        for op in OP_NAMES:
            setattr(self, op, overrides.get(op, getattr(base, op)))

    def __repr__(self):
        if len(self.overridden) == len(OP_NAMES):
            return f"<baro_jax variant {self.name!r}: every op order-changing>"
        return f"<baro_jax variant {self.name!r}: {', '.join(self.overridden)} order-changing, the rest ordered>"


# ----------------------------------------------------------------------------- attn-fast

def attention_impl(setting: str = "auto") -> str:
    """settings.attn_impl made concrete: 'cudnn' on a CUDA GPU, 'xla' elsewhere, unless set."""
    if setting != "auto":
        return setting
    if jax.default_backend() != "gpu":
        return "xla"
    try:
        cuda = "cuda" in jax.devices()[0].client.platform_version.lower()
    except Exception:  # noqa: BLE001 (an unknown client: take the portable path)
        cuda = False
    return "cudnn" if cuda else "xla"


_FALLBACKS: list = []  # (reason) when cuDNN refused the shapes and XLA ran instead


def _fast_attention(ordered_attention, impl_setting: str):
    def attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, n_valid, *, num_heads, num_kv_heads, eps):
        m = qkv.shape[0]
        if m == 1:  # decode stays on the ordered kernel
            return ordered_attention(qkv, q_norm, k_norm, cos, sin, k_cache, v_cache, pos, n_valid,
                                     num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps)
        S, hkv, hd = k_cache.shape
        H = num_heads
        A = k_cache.dtype
        qg = qkv[:, : 2 * H * hd].reshape(m, H, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = qkv[:, 2 * H * hd: (2 * H + hkv) * hd].reshape(m, hkv, hd)
        v = qkv[:, (2 * H + hkv) * hd:].reshape(m, hkv, hd)
        # NUMERICS.md steps 1-3: head norms (fp32), rope, round to A, write rows pos+i for i < n_valid.
        q = ops_xla.rope(ops_xla.head_rmsnorm(q, q_norm, eps), cos, sin).astype(A)
        k = ops_xla.rope(ops_xla.head_rmsnorm(k, k_norm, eps), cos, sin).astype(A)
        k_cache = ops_xla._write_rows(k_cache, k, pos, n_valid)
        v_cache = ops_xla._write_rows(v_cache, v.astype(A), pos, n_valid)
        # Row i attends to cache rows 0..pos+i. Rows at or past pos+n_valid were not written by this
        # call (they may hold anything): zeroed, so no NaN can reach a valid row through a 0 weight.
        written = (jnp.arange(S) < pos + n_valid)[:, None, None]
        kc = jnp.where(written, k_cache, jnp.zeros((), A))
        vc = jnp.where(written, v_cache, jnp.zeros((), A))
        mask = (jnp.arange(S)[None, :] <= (pos + jnp.arange(m))[:, None])[None, None]  # [1, 1, m, S]
        impl = attention_impl(impl_setting)
        args = (q[None], kc[None], vc[None])
        kw = dict(mask=mask, scale=hd ** -0.5)
        try:
            o = jax.nn.dot_product_attention(*args, implementation=impl, **kw)
        except Exception as e:  # cuDNN refuses some shapes at trace time: say so, run XLA's
            if impl != "cudnn":
                raise
            _FALLBACKS.append(repr(e))
            warnings.warn(f"attn-fast: cuDNN refused these shapes ({e}); using XLA's dot_product_attention")
            o = jax.nn.dot_product_attention(*args, implementation="xla", **kw)
        o = o[0].astype(f32) * jax.nn.sigmoid(gate)  # step 5, as the ordered op (attn in A here)
        return o.astype(A).reshape(m, H * hd), k_cache, v_cache

    return attention


# ----------------------------------------------------------------------------- delta-chunk

def _chunked_delta(ordered_delta):
    def delta(y, b, a, A_log, dt_bias, state, n_valid, *, nk, dk, b_col=0, a_col=0, rows=False):
        m = y.shape[0]
        if m == 1 or rows:  # decode (one token, of one sequence or of many) stays on the ordered kernel
            return ordered_delta(y, b, a, A_log, dt_bias, state, n_valid, nk=nk, dk=dk, b_col=b_col, a_col=a_col,
                                 rows=rows)
        nv, _, dv = state.shape
        b, a = b[:, b_col:b_col + nv], a[:, a_col:a_col + nv]
        q, k, v, beta, g = ops_xla.delta_inputs(y, b, a, A_log, dt_bias, nk=nk, dk=dk, nv=nv, dv=dv)
        # Padded rows (i >= n_valid) get k = v = beta = 0 and g = 0 (decay 1): they leave the state as it
        # is (where, not a product, so a non-finite padded input cannot leak).
        valid = jnp.arange(m) < n_valid
        k = jnp.where(valid[:, None, None], k, 0.0)
        v = jnp.where(valid[:, None, None], v, 0.0)
        beta = jnp.where(valid[:, None], beta, 0.0)
        g = jnp.where(valid[:, None], g, 0.0)
        o, S = chunked_delta(q[None], k[None], v[None], beta[None], g[None], chunk=min(DELTA_CHUNK, m),
                             state=state[None])
        return o[0], S[0]

    return delta


# ----------------------------------------------------------------------------- selection

_CACHE: dict = {}


def get_ops(name: str, attn_impl: str = "auto"):
    """The ops object of a variant (made once per name and attention setting)."""
    name = check(name)
    if name is None:
        raise ValueError("no variant named: use baro_jax.ops.get_ops('ordered') for the default")
    key = (name, attn_impl if name == "attn-fast" else None)
    if key not in _CACHE:
        if name == "xla":
            _CACHE[key] = VariantOps(name, ops_xla, {op: getattr(ops_xla, op) for op in OP_NAMES})
        else:
            base = backend_ops("ordered")
            if name == "attn-fast":
                _CACHE[key] = VariantOps(name, base, {"attention": _fast_attention(base.attention, attn_impl)})
            else:
                _CACHE[key] = VariantOps(name, base, {"delta": _chunked_delta(base.delta)})
    return _CACHE[key]
