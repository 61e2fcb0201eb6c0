"""The decode step is one compiled graph for every position: no recompilation per token."""
import baro_jax
from baro_jax import runner


def test_decode_step_compiles_once_across_positions():
    eng = baro_jax.load("tiny", progress=False)
    state = eng.new_state(64)
    logits, state = eng.decode_step(3, state, 0)
    compiled = runner.FORWARD._cache_size()
    for pos, tok in enumerate([5, 17, 200, 42, 9, 100], start=1):
        logits, state = eng.decode_step(tok, state, pos)
    assert runner.FORWARD._cache_size() == compiled, "decode_step recompiled for a new position or token"
    # a prefill chunk of another size is its own graph; decoding after it reuses the decode graph
    pre = eng.prefill(list(range(10, 40)), chunk=16, state=eng.new_state(64))
    after_prefill = runner.FORWARD._cache_size()
    eng.decode_step(7, pre.state, 30)
    assert runner.FORWARD._cache_size() == after_prefill


def state_bytes(state):
    import jax
    import numpy as np

    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(state)]


def test_greedy_blocks_equal_per_token_decode(monkeypatch):
    """greedy_decode's device loop (blocks of steps, argmax on the device) gives the tokens and
    the state bytes of one decode_step call per token with host greedy sampling; a block size
    that does not divide n, and a run of 1-step calls, agree too. One compiled graph serves
    every block length (n is traced)."""
    from baro_jax.sampling import greedy

    eng = baro_jax.load("tiny", backend="ordered", progress=False)
    prompt = [11, 250, 3, 77, 19, 140, 8]
    n = 21
    ref_state = eng.prefill(prompt, state=eng.new_state(64)).state
    tok0 = 5
    ref, tok, st = [], tok0, ref_state
    for i in range(n):
        logits, st = eng.decode_step(tok, st, len(prompt) + i)
        tok = int(greedy(logits))
        ref.append(tok)
    ref_bytes = state_bytes(st)
    for block in (16, 5, 1):
        eng.tune(decode_block=block)
        start = eng.prefill(prompt, state=eng.new_state(64)).state
        compiled = runner.GREEDY._cache_size()
        toks, st2 = eng.greedy_decode(tok0, start, len(prompt), n)
        assert toks == ref, f"block {block}: tokens differ from per-token decode"
        assert state_bytes(st2) == ref_bytes, f"block {block}: state bytes differ from per-token decode"
        if block != 1:  # n = 21 runs blocks of two lengths (16 + 5, or 5 x 4 + 1): one graph
            assert runner.GREEDY._cache_size() <= compiled + 1, "a shorter last block recompiled"


def test_generate_greedy_blocks_match_step_loop(monkeypatch):
    monkeypatch.setenv("BARO_DECODE_BLOCK", "1")
    eng = baro_jax.load("tiny", progress=False)
    assert eng.settings.decode_block == 1
    a = eng.generate("the cat", 20, stop_at_eos=False)
    eng.tune(decode_block=8)
    b = eng.generate("the cat", 20, stop_at_eos=False)
    assert a.generated_ids == b.generated_ids and len(b.generated_ids) == 20
    import pytest

    for bad in ("zero", "0", "4097", "1.5"):
        monkeypatch.setenv("BARO_DECODE_BLOCK", bad)
        with pytest.raises(ValueError, match="BARO_DECODE_BLOCK must be"):
            baro_jax.load("tiny", progress=False)
    with pytest.raises(ValueError, match="decode_block must be"):
        eng.tune(decode_block=0)


def test_full_greedy_block_has_a_known_trip_count():
    """A full block is a loop of exactly `block` steps whose trip count XLA knows (its GPU
    runtime then runs the body without reading a predicate back to the host each step); the
    shorter last block's loop has a traced length, so its count is unknown."""
    import re

    import jax.numpy as jnp

    eng = baro_jax.load("tiny", backend="ordered", progress=False)
    st = eng.new_state(64)
    kw = dict(cfg=eng.cfg, ops=eng.ops, block=4)
    full = runner.GREEDY_FULL.lower(eng.params, st, jnp.int32(3), jnp.int32(0), rope=eng.rope, **kw)
    part = runner.GREEDY.lower(eng.params, st, jnp.int32(3), jnp.int32(0), jnp.int32(4), eng.rope, **kw)
    counts = lambda lowered: re.findall(r'known_trip_count":\{"n":"(\d+)"', lowered.compile().as_text())  # noqa: E731
    assert counts(full) == ["4"], counts(full)
    assert counts(part) == []
