"""The decode step is one compiled graph for every position: no recompilation per token."""
import baro_jax
from baro_jax import engine


def test_decode_step_compiles_once_across_positions():
    eng = baro_jax.load("tiny", progress=False)
    state = eng.new_state(64)
    logits, state = eng.decode_step(3, state, 0)
    compiled = engine._STEP._cache_size()
    for pos, tok in enumerate([5, 17, 200, 42, 9, 100], start=1):
        logits, state = eng.decode_step(tok, state, pos)
    assert engine._STEP._cache_size() == compiled, "decode_step recompiled for a new position or token"
    # a prefill chunk of another size is its own graph; decoding after it reuses the decode graph
    pre = eng.prefill(list(range(10, 40)), chunk=16, state=eng.new_state(64))
    after_prefill = engine._STEP._cache_size()
    eng.decode_step(7, pre.state, 30)
    assert engine._STEP._cache_size() == after_prefill
