"""Long-context identity: one long seeded random prompt, batched prefill at several chunks
against replay, every comparison in bytes.

Replay of a long prompt is slow (the decode step per token), so the replay is planned against a
deadline from a measured decode rate, and can run in two parts across two processes: the first
part's state is saved with its leaves' raw bytes (save_replay) and the second resumes from it
(load_replay), refusing a file saved for another model, seed, length or state length.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable

import numpy as np

from .digests import differing_leaves, host_leaves, same_bytes
from .records import echo


def seeded_prompt(vocab_size: int, n: int, seed: int) -> list[int]:
    """The n-token prompt of a length: the same for every run with the same seed."""
    return [int(x) for x in np.random.default_rng(seed + n).integers(0, vocab_size, n)]


def peak_gb() -> float | None:
    """Peak device memory in use so far (GB), None where the device keeps no stats (CPU)."""
    import jax

    try:
        st = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001  (CPU devices may not keep stats)
        st = {}
    v = st.get("peak_bytes_in_use")
    return None if v is None else v / 1e9


def replay_file(directory: str, n: int) -> str:
    return os.path.join(directory, f"replay_{n}.npz")


def save_replay(path: str, state, meta: dict):
    """The state's leaves as raw bytes with their dtypes and shapes, and meta, in one .npz
    (raw bytes because numpy has no bfloat16 of its own to save)."""
    leaves = host_leaves(state)
    meta = {**meta, "leaves": [{"dtype": str(a.dtype), "shape": list(a.shape)} for a in leaves]}
    np.savez(path, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
             **{f"leaf{i}": np.frombuffer(a.tobytes(), np.uint8) for i, a in enumerate(leaves)})


def saved_meta(path: str) -> dict:
    """The meta dict of a save_replay file."""
    with np.load(path) as f:
        return json.loads(f["meta"].tobytes().decode())


def load_replay(path: str, like, expect: dict):
    """The state saved by save_replay, placed as the leaves of `like` (a fresh state of the
    same shape) are, after checking that its meta matches `expect`; returns (state, meta).
    A mismatch raises ValueError naming the field."""
    import jax
    import jax.numpy as jnp

    with np.load(path) as f:
        meta = json.loads(f["meta"].tobytes().decode())
        for k, v in expect.items():
            if meta.get(k) != v:
                raise ValueError(f"{path} was saved with {k}={meta.get(k)!r}, this run has {v!r}")
        ref, treedef = jax.tree_util.tree_flatten(like)
        if len(meta["leaves"]) != len(ref):
            raise ValueError(f"{path} holds {len(meta['leaves'])} state leaves, expected {len(ref)}")
        leaves = []
        for i, (info, r) in enumerate(zip(meta["leaves"], ref)):
            a = np.frombuffer(f[f"leaf{i}"].tobytes(), jnp.dtype(info["dtype"])).reshape(info["shape"])
            if a.shape != r.shape or a.dtype != r.dtype:
                raise ValueError(f"{path} leaf {i} is {a.dtype}{list(a.shape)}, expected {r.dtype}{list(r.shape)}")
            leaves.append(jax.device_put(a, r.sharding))
    return jax.tree_util.tree_unflatten(treedef, leaves), meta


def replay_range(eng, ids, state, start: int, stop: int, log: Callable[[str], None] | None = None):
    """The decode step once per token of ids[start:stop] on a state holding ids[:start], as the
    replay prefill runs them (Engine._replay_span: device blocks of the prompt's tokens); returns
    (the last step's logits, the state)."""
    import jax

    said = [start // 8192]

    def progress(done, _total):
        if log and done // 8192 > said[0]:
            said[0] = done // 8192
            log(f"replay {done}/{stop}")

    lg, state = eng._replay_span(ids, state, start, stop, progress if log else None)
    return lg, jax.block_until_ready(state)


def greedy_after(eng, logits, state, pos: int, n: int) -> list[int]:
    """n greedy tokens (at least one) from the last prompt position's logits, the rest through
    Engine.greedy_decode (its blocks: the same bits as decode steps)."""
    import jax

    from baro_jax.sampling import greedy

    tok = int(greedy(logits))
    if n <= 1:
        return [tok]
    toks, state = eng.greedy_decode(tok, state, pos, n - 1)
    jax.block_until_ready(state)
    return [tok] + toks


def batched_arm(eng, ids, chunk: int, state_len: int, new_tokens: int) -> dict:
    """Batched prefill at `chunk` on a fresh state, then the greedy tokens; host copies of the
    state, last logits and tokens, and the prefill's seconds (compile included)."""
    t = time.perf_counter()
    pre = eng.prefill(ids, "batch", chunk, state=eng.new_state(state_len))
    secs = time.perf_counter() - t
    st, lg = host_leaves(pre.state), np.asarray(pre.logits)
    toks = greedy_after(eng, pre.logits, pre.state, len(ids), new_tokens)
    return {"chunk": chunk, "seconds": secs, "state": st, "logits": lg, "tokens": toks}


def decode_rate(eng, ids, state_len: int, steps: int = 32) -> float:
    """Greedy decode tokens per second after a short prefill: what a replay of the length costs."""
    import jax

    probe = eng.prefill(ids[:64], "batch", 64, state=eng.new_state(state_len))
    t = time.perf_counter()
    _, st = eng.greedy_decode(1, probe.state, min(64, len(ids)), steps)
    jax.block_until_ready(st)
    return steps / (time.perf_counter() - t)


def compare_arm(arm: dict, ref: dict) -> dict:
    """A batched arm against the replay: leaves differing, logits and tokens equal, identical."""
    diff = differing_leaves(arm["state"], ref["state"])
    out = {"state_leaves": len(ref["state"]), "state_leaves_differing": len(diff),
           "first_differing_leaf": diff[0] if diff else None,
           "logits_equal": same_bytes(arm["logits"], ref["logits"]),
           "tokens_equal": list(arm["tokens"]) == list(ref["tokens"])}
    out["identical"] = not diff and out["logits_equal"] and out["tokens_equal"]
    return out


def run_length(eng, n: int, chunks: list[str], new_tokens: int, *, seed: int, model: str, deadline_s: float,
               started: float, resume_dir: str | None = None, log: Callable[[str], None] | None = echo) -> dict:
    """One length: the batched arms (chunks: ints or "default", the engine's pick), then the
    replay unless the measured decode rate says it would end more than deadline_s seconds after
    `started` (a time.perf_counter() value; then the row says "skipped" and why). resume_dir: continue a replay whose first
    part replay_first_part saved there. Returns the length's row; every compared arm has
    "identical"."""
    from baro_jax.shapes import state_length

    say = log or (lambda _msg: None)
    row = {"prompt_tokens": n, "new_tokens": new_tokens, "arms": []}
    ids = seeded_prompt(eng.cfg.vocab_size, n, seed)
    L = state_length(n + new_tokens, eng.cfg.max_context)
    row["state_length"] = L
    batched = []
    for c in chunks:
        c = str(c).strip()
        chunk = eng.pick_chunk(n, new_tokens) if c == "default" else int(c)
        b = batched_arm(eng, ids, chunk, L, new_tokens)
        b["requested"] = c
        batched.append(b)
        say(f"n={n} batched chunk {chunk}: {b['seconds']:.1f}s ({n / b['seconds']:.0f} tok/s incl. compile)")
    rate = decode_rate(eng, ids, L)
    left_tokens = n
    if resume_dir is not None:  # only the part after the saved state is left to run
        left_tokens = n - saved_meta(replay_file(resume_dir, n))["replayed"]
    est = left_tokens / rate
    row["replay_rate_estimate_tok_s"] = rate
    left = deadline_s - (time.perf_counter() - started)
    if est > left:
        row["replay"] = {"skipped": True,
                         "reason": f"replay of {n} tokens at ~{rate:.0f} tok/s needs ~{est:.0f}s; "
                                   f"{left:.0f}s left before --deadline-s {deadline_s:.0f}"}
        say(f"n={n}: replay skipped ({row['replay']['reason']})")
        row["peak_device_gb"] = peak_gb()
        row["arms"] = [{k: b[k] for k in ("chunk", "requested", "seconds")} for b in batched]
        return row

    t = time.perf_counter()
    if resume_dir is not None:
        path = replay_file(resume_dir, n)
        st, saved = load_replay(path, eng.new_state(L),
                                {"model": model, "seed": seed, "prompt_tokens": n, "state_length": L})
        start = saved["replayed"]
        say(f"n={n} resuming the replay at {start} from {path} (first part {saved['seconds']:.0f}s, "
            f"commit {saved.get('commit')})")
        lg, st = replay_range(eng, ids, st, start, n, log=lambda m: say(f"n={n} {m}"))
        prior = saved["seconds"]
        row["replay_parts"] = {"first": {"tokens": start, "seconds": prior, "commit": saved.get("commit")},
                               "second": {"tokens": n - start}}
    else:
        def progress(done, total):
            if done % 8192 == 0:
                say(f"n={n} replay {done}/{total}")

        pre = eng.prefill(ids, "replay", state=eng.new_state(L), progress=progress)
        lg, st, prior = pre.logits, pre.state, 0.0
        del pre
    rsecs = time.perf_counter() - t + prior
    ref = {"state": host_leaves(st), "logits": np.asarray(lg)}
    ref["tokens"] = greedy_after(eng, lg, st, n, new_tokens)
    row["replay"] = {"seconds": rsecs, "tokens_per_s": n / rsecs}
    say(f"n={n} replay: {rsecs:.1f}s ({n / rsecs:.0f} tok/s)")
    for b in batched:
        arm = {"chunk": b["chunk"], "requested": b["requested"], "seconds": b["seconds"], **compare_arm(b, ref)}
        row["arms"].append(arm)
        say(f"n={n} chunk {b['chunk']}: {'IDENTICAL' if arm['identical'] else 'DIFFERENT'} "
            f"(state leaves differing {arm['state_leaves_differing']}/{arm['state_leaves']}, "
            f"logits {arm['logits_equal']}, tokens {arm['tokens_equal']})")
    row["peak_device_gb"] = peak_gb()
    return row


def replay_first_part(eng, n: int, stop: int, new_tokens: int, *, seed: int, model: str, save_dir: str,
                      commit: str | None = None, log: Callable[[str], None] | None = echo) -> dict:
    """Replay the first `stop` tokens of length n's prompt and save the state under save_dir for
    run_length(resume_dir=save_dir). Returns {"replayed", "of", "seconds", "saved", "state_length"}."""
    from baro_jax.shapes import state_length

    if not 1 <= stop < n:
        raise ValueError(f"--replay-stop must be in 1..{n - 1}, got {stop}")
    say = log or (lambda _msg: None)
    ids = seeded_prompt(eng.cfg.vocab_size, n, seed)
    L = state_length(n + new_tokens, eng.cfg.max_context)
    t = time.perf_counter()
    _, st = replay_range(eng, ids, eng.new_state(L), 0, stop, log=lambda m: say(f"n={n} {m} (of {n})"))
    secs = time.perf_counter() - t
    os.makedirs(save_dir, exist_ok=True)
    path = replay_file(save_dir, n)
    save_replay(path, st, {"model": model, "seed": seed, "prompt_tokens": n, "state_length": L,
                           "replayed": stop, "seconds": secs, "commit": commit})
    say(f"n={n} replayed {stop} tokens in {secs:.1f}s ({stop / secs:.0f} tok/s); state saved to {path}")
    return {"replayed": stop, "of": n, "seconds": secs, "saved": path, "state_length": L}
