"""Byte-level comparison and digests of engine states and logits.

Identity here means the same bytes: same dtype, same shape, same `tobytes()`. Nothing in this
module takes a tolerance; a NaN equals a NaN of the same bit pattern and 0.0 differs from -0.0,
which is what "batched prefill is bit-identical to replay" promises.
"""
from __future__ import annotations

import hashlib

import numpy as np


def same_bytes(a, b) -> bool:
    """Two arrays hold the same bytes, with the same dtype and shape."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def host_leaves(state) -> list[np.ndarray]:
    """Every leaf of a state pytree as a host numpy array, in tree order."""
    import jax

    return [np.asarray(a) for a in jax.tree_util.tree_leaves(state)]


def state_names(cfg) -> list[str]:
    """A name per state leaf, in the order host_leaves returns them: "L{layer}.{key}" with
    k, v for attention layers and conv, ssm (plus blk_k, blk_u, blk_c, the pending rows of the
    chunk-aligned delta rule's block, docs/DESIGN.md §9) for Gated DeltaNet layers."""
    names = []
    for i, t in enumerate(cfg.layer_types):
        keys = ["k", "v"] if t == "full_attention" else ["conv", "ssm"]
        if t != "full_attention" and getattr(cfg, "delta_rule", "token") == "blocked":
            keys += ["blk_k", "blk_u", "blk_c"]
        names += [f"L{i}.{k}" for k in sorted(keys)]  # tree_leaves visits dict keys sorted
    return names


def differing_leaves(a_list, b_list) -> list[int]:
    """Indices of the leaves whose bytes differ; a different leaf count is a difference at the
    first index one list lacks."""
    out = [i for i, (a, b) in enumerate(zip(a_list, b_list)) if not same_bytes(a, b)]
    if len(a_list) != len(b_list):
        out.append(min(len(a_list), len(b_list)))
    return out


def first_diff(a_list, b_list, names) -> str | None:
    """The name of the first leaf whose bytes differ, None when every leaf is the same."""
    diff = differing_leaves(a_list, b_list)
    if not diff:
        return None
    i = diff[0]
    return names[i] if i < len(names) else f"leaf {i}"


def arm_digest(state: list, logits, tokens) -> str:
    """sha256 over the state leaves' bytes, the logits' bytes and the tokens as int64: one
    string that two runs (another process, mode or device count) can compare."""
    h = hashlib.sha256()
    for a in state:
        h.update(np.asarray(a).tobytes())
    h.update(np.asarray(logits).tobytes())
    h.update(np.asarray(tokens, np.int64).tobytes())
    return h.hexdigest()
