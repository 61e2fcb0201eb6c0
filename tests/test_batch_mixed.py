"""A round's prefill chunk and decode step in one pass (model.mixed_forward, batch.MIXED): the
chunk's rows and the decode rows share every GEMM, norm and the MoE, so each row must keep the
bytes of its own pass. Checked at the model (random states, every output against forward and
decode_rows run apart) and in the pool (every sequence against its run alone, mixed rounds on
and off)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import baro_jax
from baro_jax import batch as B
from baro_jax import model as M
from baro_jax import pool as Pool
from baro_jax.config import FULL
from baro_jax.scheduler import Sequence

from batch_util import same
from test_batch import NEW, PROMPTS

PAGE = 64


@pytest.fixture(scope="module")
def eng():
    return baro_jax.load("tiny", backend="ordered", progress=False)


def _random_like(tree, rng):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(rng.standard_normal(a.shape).astype(np.float32) * 0.5,
                                                        a.dtype), tree)


def _same_bytes(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


@pytest.mark.parametrize("rows,chunk,n_valid,all_logits", [(1, 16, 16, False), (2, 16, 5, False),
                                                            (4, 7, 7, True), (3, 32, 19, False)])
def test_mixed_forward_is_forward_and_decode_rows_apart(eng, rows, chunk, n_valid, all_logits):
    """Fresh random states (a one-sequence state at position 40, a pool of `rows` slots with KV
    pages in shuffled order, one idle row), random tokens: mixed_forward's chunk logits, row logits,
    state and pool equal forward's and decode_rows' run apart, byte for byte."""
    cfg, params, rope = eng.cfg, eng.runner.params, eng.runner.rope
    ops = B.pooled_ops(eng.runner.ops)
    rng = np.random.default_rng(rows * 100 + chunk)
    S = 4 * PAGE
    state = _random_like(M.init_state(cfg, eng.runner.dtype, S), rng)
    pool = _random_like(Pool.init_pool(cfg, eng.runner.dtype, rows, rows * 4, PAGE), rng)
    table = jnp.asarray(rng.permutation(rows * 4).reshape(rows, 4).astype(np.int32))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, chunk).astype(np.int32))
    row_tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, rows).astype(np.int32))
    row_pos = jnp.asarray(rng.integers(1, S - 1, rows).astype(np.int32))
    slots = jnp.where(jnp.arange(rows) == rows - 1, -1, jnp.arange(rows)).astype(jnp.int32) if rows > 1 \
        else jnp.zeros((1,), jnp.int32)
    pos, nv = jnp.int32(40), jnp.int32(n_valid)

    one = jax.jit(lambda st: M.forward(params, st, tokens, pos, nv, rope, cfg=cfg, ops=ops, all_logits=all_logits))
    many = jax.jit(lambda pl: M.decode_rows(params, pl, table, row_tokens, slots, row_pos, rope, cfg=cfg, ops=ops))
    both = jax.jit(lambda st, pl: M.mixed_forward(params, st, tokens, pos, nv, pl, table, row_tokens, slots, row_pos,
                                                  rope, cfg=cfg, ops=ops, all_logits=all_logits))
    logits, st1 = one(state)
    rlogits, pool1 = many(pool)
    m_logits, m_rlogits, m_st, m_pool = both(state, pool)
    assert m_logits.shape == logits.shape and m_rlogits.shape == rlogits.shape
    assert np.asarray(m_logits).tobytes() == np.asarray(logits).tobytes(), "the chunk's logits differ"
    assert np.asarray(m_rlogits).tobytes() == np.asarray(rlogits).tobytes(), "the decode rows' logits differ"
    assert _same_bytes(m_st, st1), "the chunk's state differs"
    assert _same_bytes(m_pool, pool1), "the pool differs"
    assert any(t == FULL for t in cfg.layer_types) and any(t != FULL for t in cfg.layer_types)


def _run(eng, mixed: bool, *, sampled=(), prompt_logprobs=False):
    """A pool of 3 slots, the prompts arriving as slots free up (chunks of 8 rows beside decoding
    sequences), rounds until done."""
    seqs = []
    for i, (p, n) in enumerate(zip(PROMPTS, NEW)):
        s = baro_jax.Sampling(temperature=0.9, top_k=20, seed=7 + i) if i in sampled else baro_jax.Sampling()
        seqs.append(Sequence(index=i, prompt_ids=eng.encode(p), max_new_tokens=n, sampling=s, eos_ids=eng.eos_ids,
                             want_prompt_logprobs=prompt_logprobs))
    run = B.BatchRun(eng.runner, eng.tokenizer, seqs, slots=3, length=256, chunk=8, logprobs=2, keep_states=True,
                     block=eng.runner.decode_block, mixed=mixed)
    done = run.run()
    return done, run.steps


def _result(seq):
    return baro_jax.GenerateResult(prompt_ids=seq.prompt_ids, generated_ids=seq.generated, text="",
                                   prefill_seconds=0.0, prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0,
                                   model="", backend="", prefill_mode="batch", chunk=8, mode="", variant="",
                                   state=seq.state, logprobs=seq.logprobs, top_logprobs=seq.top_logprobs,
                                   prompt_logprobs=seq.prompt_logprobs, finish_reason=seq.finish_reason)


@pytest.mark.parametrize("sampled,prompt_logprobs", [((), False), ((1, 4, 5), True)])
def test_mixed_rounds_give_every_sequence_its_bytes_alone(eng, sampled, prompt_logprobs):
    """Rounds that prefill a chunk beside decoding sequences run it in one pass with their decode
    step (steps['mixed'] > 0; none with mixed off), and every sequence (greedy and sampled, with
    prompt logprobs) still gets generate()'s bytes alone: tokens, logprobs, top logprobs, prompt
    logprobs, final state."""
    on, steps_on = _run(eng, True, sampled=sampled, prompt_logprobs=prompt_logprobs)
    off, steps_off = _run(eng, False, sampled=sampled, prompt_logprobs=prompt_logprobs)
    assert steps_on["mixed"] > 0 and steps_off["mixed"] == 0, (steps_on, steps_off)
    assert steps_on["prefill"] == steps_off["prefill"]
    for i, (a_on, a_off) in enumerate(zip(on, off)):
        s = baro_jax.Sampling(temperature=0.9, top_k=20, seed=7 + i) if i in sampled else baro_jax.Sampling()
        alone = eng.generate(PROMPTS[i], NEW[i], logprobs=2, keep_state=True, sampling=s,
                             prompt_logprobs=prompt_logprobs)
        for got in (a_on, a_off):
            r = _result(got)
            assert same(eng.cfg, alone, r) is None, (i, same(eng.cfg, alone, r))
            if prompt_logprobs:
                assert _lp_bytes(alone.prompt_logprobs) == _lp_bytes(r.prompt_logprobs), i


def _lp_bytes(lps):
    """Prompt logprobs as bytes (the first token has none)."""
    assert lps is not None and len(lps) > 0
    return [None if x is None else np.asarray(x).tobytes() for x in lps]


def test_warm_up_compiles_every_graph_the_rounds_use(eng):
    """A pool of sizes no other test uses (4 slots: buckets 1, 2, 4; chunk 12): warm_up compiles
    its graphs (the caches grow), then staggered requests, greedy and sampled, short and over
    several chunks, joining while others decode, compile nothing more, and each still gets its
    bytes alone (sampled ones: plain temperature, a top_k, top_p over the whole vocabulary, drawn in
    the block and step graphs)."""
    from jax._src import monitoring

    graphs = (B.PREFILL, B.DECODE, B.DECODE_BLOCK, B.MIXED, B.CLEAR, B.MOVE, B.FORK, B.SAMPLE_ROWS)
    before = [g._cache_size() for g in graphs]
    run = B.open_run(eng, max_batch=4, length=320, chunk=12, logprobs=2, stop_width=4)
    assert run.row_buckets() == [1, 2, 4]
    seen, compiles = [], []

    def compiled(event, seconds=None, **kw):  # an executable made, or read from the persistent cache
        if event in ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits"):
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(compiled)
    monitoring.register_event_listener(compiled)
    try:
        # two threads compile every graph side by side first (all of them: none is a tier step), and
        # the calls that follow find them: nothing compiles after the last graph is reported ready
        n, seconds = run.warm_up(threads=2, on_graph=lambda i, total: seen.append((i, total, len(compiles))))
        after = len(compiles)
    finally:
        monitoring.unregister_event_duration_listener(compiled)
        monitoring.unregister_event_listener(compiled)
    assert n == len(seen) and seen[-1][:2] == (n, n) and seconds > 0
    assert [x[0] for x in seen] == list(range(1, n + 1))
    assert seen[-1][2] >= n and after == seen[-1][2], (seen[-1], after)
    warm = [g._cache_size() for g in graphs]
    assert all(w > b for w, b in zip(warm, before)), (before, warm)
    with pytest.raises(RuntimeError, match="empty pool"):
        run.add(Sequence(index=99, prompt_ids=[3, 4], max_new_tokens=2, sampling=baro_jax.Sampling()))
        run.warm_up()
    run.cancel(run.sched.waiting[0])
    run.sched.drain_finished()
    seqs = []
    for i, (p, m) in enumerate(zip(PROMPTS, NEW)):
        s = baro_jax.Sampling(temperature=0.8, seed=i) if i % 3 == 1 else baro_jax.Sampling()
        if i == 2:  # a top_k with top_p, drawn in the graph too
            s = baro_jax.Sampling(temperature=1.1, top_k=7, top_p=0.9, seed=i)
        if i == 5:  # top_p over the whole vocabulary: the row ranked whole, warmed up too
            s = baro_jax.Sampling(temperature=0.9, top_p=0.8, seed=i)
        seqs.append(Sequence(index=i, prompt_ids=eng.encode(p), max_new_tokens=m, sampling=s, eos_ids=eng.eos_ids))
    # a second sample of prompt 1, admitted beside it: it takes a copy of prompt 1's state (FORK)
    fork = Sequence(index=len(PROMPTS), prompt_ids=eng.encode(PROMPTS[1]), max_new_tokens=NEW[1],
                    sampling=baro_jax.Sampling(temperature=0.8, seed=77), eos_ids=eng.eos_ids, fork_of=seqs[1])
    for s in seqs[:3] + [fork]:
        run.add(s)
    rounds = 0
    while not run.done or rounds < 4:
        run.step()
        rounds += 1
        if rounds in (2, 4):  # arrivals while others decode
            for s in seqs[3:5] if rounds == 2 else seqs[5:]:
                run.add(s)
    assert run.steps["mixed"] > 0 and run.steps["forks"] == 1
    assert [g._cache_size() for g in graphs] == warm
    for s in seqs + [fork]:
        i = 1 if s is fork else s.index
        alone = eng.generate(PROMPTS[i], NEW[i], logprobs=2, sampling=s.sampling)
        assert s.generated == alone.generated_ids, s.index
        assert [x.tobytes() for x in s.logprobs] == [x.tobytes() for x in alone.logprobs], s.index
