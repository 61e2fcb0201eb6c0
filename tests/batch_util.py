"""Byte comparisons of a sequence's results (test_batch.py, test_batch_tier.py)."""
import numpy as np

from baro_jax.config import FULL


def kv_rows(cfg, state, n):
    """The state's leaves as bytes, KV caches cut to the n positions a sequence has written (the
    pool's caches are longer than a sequence's own; past n both hold zeros)."""
    out = []
    for st, kind in zip(state, cfg.layer_types):
        for k in sorted(st):
            a = np.asarray(st[k])
            out.append((a[:n] if kind == FULL else a).tobytes())
    return out


def same(cfg, a, b):
    """a: a result alone, b: the same prompt's batch result; what differs, or None."""
    if a.generated_ids != b.generated_ids:
        return f"tokens {a.generated_ids} != {b.generated_ids}"
    if [x.tobytes() for x in a.logprobs] != [x.tobytes() for x in b.logprobs]:
        return "logprob bytes differ"
    if a.top_logprobs is not None and b.top_logprobs is not None:
        for (ia, va), (ib, vb) in zip(a.top_logprobs, b.top_logprobs):
            if ia != ib or va.tobytes() != vb.tobytes():
                return "top logprobs differ"
    if a.finish_reason != b.finish_reason:
        return f"finish {a.finish_reason} != {b.finish_reason}"
    n = len(a.prompt_ids) + len(a.generated_ids) - 1
    if a.state is not None and b.state is not None and kv_rows(cfg, a.state, n) != kv_rows(cfg, b.state, n):
        return "final state bytes differ"
    return None
