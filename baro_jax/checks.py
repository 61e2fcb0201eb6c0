"""Argument checks for the public entry points: plain Python, before anything is dispatched.

Every message names the argument (and the CLI flag where there is one), says what was
expected and what was given. The kernels check their own operands too, but a wrong
token id, position or state must never reach them: the `xla` backend would answer with
silently wrong logits (a gather clips an out-of-range id, a scatter drops a row past
the cache, a negative position reads NaN).
"""
from __future__ import annotations

import math
import numbers
import operator

import numpy as np
import jax

from .config import FULL, Config
from .model import blocked_delta_shapes


def as_int(name: str, v, lo: int | None = None, hi: int | None = None) -> int:
    """v as a Python int: an int, a numpy integer or a 0-d integer array; never a bool, a
    float (1.0 included: a float id or position is a caller's bug, not something to truncate),
    a string or None."""
    if isinstance(v, (bool, np.bool_)) or isinstance(v, (float, np.floating, str, bytes)) or v is None:
        raise TypeError(f"{name} must be an integer, got {type(v).__name__} {v!r}")
    if hasattr(v, "dtype") and not np.issubdtype(np.dtype(v.dtype), np.integer):
        raise TypeError(f"{name} must be an integer, got an array of {np.dtype(v.dtype).name}")
    try:
        i = operator.index(v)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(v).__name__} {v!r:.60}") from None
    if lo is not None and i < lo:
        raise ValueError(f"{name} must be >= {lo}, got {i}")
    if hi is not None and i > hi:
        raise ValueError(f"{name} must be <= {hi}, got {i}")
    return i


def as_number(name: str, v, positive: bool = False) -> float:
    """A finite real number (int or float, not bool, not str)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(v).__name__} {v!r:.60}")
    f = float(v)
    if not math.isfinite(f):
        raise ValueError(f"{name} must be a finite number, got {f}")
    if positive and f <= 0:
        raise ValueError(f"{name} must be positive, got {v}")
    return f


def budget_gb(v) -> float | None:
    """device_budget_gb (--device-budget-gb): None, or a finite number > 0."""
    if v is None:
        return None
    return as_number("device_budget_gb (--device-budget-gb)", v, positive=True)


def token_ids(ids, vocab_size: int, what: str = "token ids") -> list[int]:
    """A sequence of token ids as a list of ints in [0, vocab_size), or a clear error."""
    if ids is None or isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{what} must be a sequence of integers, got {type(ids).__name__}")
    if isinstance(ids, (np.ndarray, jax.Array)):
        a = np.asarray(ids)
        if a.ndim != 1:
            raise ValueError(f"{what} must be one-dimensional, got shape {list(a.shape)}")
        if not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{what} must be integers, got an array of {a.dtype.name}")
        out = a.astype(np.int64).tolist()
    elif isinstance(ids, (list, tuple)) and all(type(i) is int for i in ids):  # the common case, fast
        out = list(ids)
    else:
        out = []
        for k, i in enumerate(ids):
            try:
                out.append(as_int(f"{what}[{k}]", i))
            except TypeError as e:
                raise TypeError(f"{e} (token ids are integers; a float is not truncated)") from None
    bad = [i for i in out if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
    return out


def token_id(tok, vocab_size: int, what: str = "token") -> int:
    t = as_int(what, tok)
    if not 0 <= t < vocab_size:
        raise ValueError(f"{what} {t} is outside the vocabulary [0, {vocab_size})")
    return t


def _leaf_desc(x) -> str:
    shape = getattr(x, "shape", None)
    dt = getattr(x, "dtype", None)
    if shape is None or dt is None:
        return type(x).__name__
    return f"{list(shape)} {np.dtype(dt).name}"


def state_length(cfg: Config, dtype, state, what: str) -> int | None:
    """Check that `state` is a live state of this model; its KV length (None: no attention layer).

    A state is a tuple of per-layer dicts (Engine.new_state). decode_step and prefill donate
    the state they are given: its buffers become the returned state's, and the old one is
    deleted. Passing it again is refused here, in those words, instead of XLA's message."""
    hint = "make one with Engine.new_state(length), or pass the state the last call returned"
    if not isinstance(state, (tuple, list)) or not all(isinstance(s, dict) for s in state):
        raise TypeError(f"{what}: state must be the tuple of per-layer dicts that Engine.new_state / prefill / "
                        f"decode_step return, got {type(state).__name__}; {hint}")
    if len(state) != cfg.num_layers:
        raise ValueError(f"{what}: this state belongs to a model with {len(state)} layers, this model has "
                         f"{cfg.num_layers} (a state from another model?); {hint}")
    adt = np.dtype(jax.numpy.dtype(dtype))
    S = None
    for i, (st, kind) in enumerate(zip(state, cfg.layer_types)):
        if kind == FULL:
            kv = st.get("k")
            L = getattr(kv, "shape", (None,))[0] if kv is not None else None
            want = {"k": ((L, cfg.num_kv_heads, cfg.head_dim), adt), "v": ((L, cfg.num_kv_heads, cfg.head_dim), adt)}
        else:
            want = {"conv": ((cfg.conv_kernel - 1, cfg.conv_dim), adt),
                    "ssm": ((cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim), np.dtype(np.float32))}
            if getattr(cfg, "delta_rule", "token") == "blocked":  # the pending rows of the delta block
                want.update({k: (shape, np.dtype(np.float32)) for k, shape in blocked_delta_shapes(cfg).items()})
        if set(st) != set(want):
            raise ValueError(f"{what}: this state does not belong to this model: layer {i} ({kind}) has entries "
                             f"{sorted(st)}, this model's has {sorted(want)} (a state from another model?); {hint}")
        for k, (shape, dt) in want.items():
            x = st[k]
            if isinstance(x, jax.Array) and x.is_deleted():
                raise ValueError(f"{what}: the state was already consumed: decode_step and prefill donate the state "
                                 f"they are given (its buffers are reused for the state they return, layer {i} "
                                 f"{k!r} is deleted); pass the state returned by the last call, not an earlier one")
            if (getattr(x, "shape", None) is None or tuple(x.shape) != shape
                    or np.dtype(getattr(x, "dtype", np.uint8)) != dt):
                raise ValueError(f"{what}: this state does not belong to this model: layer {i} {k!r} is "
                                 f"{_leaf_desc(x)}, this model needs {[('S' if d is None else d) for d in shape]} "
                                 f"{dt.name} (a state from another model or dtype?); {hint}")
        if kind == FULL:
            if S is not None and L != S:
                raise ValueError(f"{what}: the state's KV caches have different lengths ({S} and {L} at layer {i}); "
                                 f"{hint}")
            S = L
    return S


def positions(pos, n: int, state_len: int | None, max_context: int, what: str) -> int:
    """pos as an int with 0 <= pos and pos + n <= the state's KV length and the model's context."""
    p = as_int(f"{what}: pos", pos)
    span = f"position {p}" if n == 1 else f"positions {p}..{p + n - 1}"
    if p < 0:
        raise ValueError(f"{what}: pos must be >= 0, got {p}")
    if state_len is not None and p + n > state_len:
        raise ValueError(f"{what}: {span} does not fit the state's KV cache of {state_len} "
                         f"positions (make a longer one with Engine.new_state(length))")
    if p + n > max_context:
        raise ValueError(f"{what}: {span} is past the model's context of {max_context} "
                         f"(max_context; raise --max-context if the model allows)")
    return p
