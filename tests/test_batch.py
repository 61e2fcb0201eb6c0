"""Many sequences at once: each sequence of generate_batch gets the bytes it gets alone (tokens,
logprobs, final state), which equal its replay, whatever the other sequences, their number and
their arrival; no compilation per request."""
import dataclasses

import numpy as np
import pytest

import baro_jax
from baro_jax import batch as B
from batch_util import kv_rows, same

PROMPTS = [
    "import os\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n",
    "x",  # one token
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self",
    "for i in range(10):\n    print(",
    "from collections import OrderedDict\n\n\nclass LRU(OrderedDict):\n    \"\"\"A cache.\"\"\"\n\n    def get(",
    "    return",
]
NEW = [9, 14, 6, 11, 1, 8, 12]


@pytest.fixture(scope="module")
def eng():
    return baro_jax.load("tiny", backend="ordered", progress=False)


@pytest.fixture(scope="module")
def alone(eng):
    return [eng.generate(p, n, logprobs=2, keep_state=True) for p, n in zip(PROMPTS, NEW)]


def test_a_prefill_budget_runs_several_chunks_a_round_with_the_bytes_alone(eng, alone):
    """prefill_budget: a round prefills whole chunks, oldest prompt first, until the budget is spent
    (here up to 3 chunks of 8 rows, across prompts); every sequence still gets its bytes alone, and
    the prompts are in in fewer rounds than one chunk a round takes."""
    from baro_jax.scheduler import Sequence

    def run_all(budget):
        run = B.open_run(eng, max_batch=4, length=1024, chunk=8, logprobs=2, stop_width=4, prefill_budget=budget)
        seqs = [Sequence(index=i, prompt_ids=alone[i].prompt_ids, max_new_tokens=NEW[i],
                         sampling=baro_jax.Sampling(), eos_ids=eng.eos_ids) for i in (1, 3, 5, 6)]
        for s in seqs:
            run.add(s)
        rounds = 0
        while any(s.prefilled < len(s.prompt_ids) for s in seqs):
            before = run.steps["prefill"]
            run.step()
            rounds += 1
            assert run.steps["prefill"] - before <= max(1, (budget or 8) // 8)
        while not run.done:
            run.step()
        return seqs, rounds, run.steps["prefill"]

    got = eng.generate_batch([PROMPTS[i] for i in (1, 3, 5, 6)], [NEW[i] for i in (1, 3, 5, 6)], logprobs=2,
                             max_batch=4, chunk=8, prefill_budget=24)
    for i, r in zip((1, 3, 5, 6), got):
        assert same(eng.cfg, alone[i], r) is None, i
    one, rounds_one, chunks = run_all(None)
    three, rounds_three, chunks3 = run_all(24)
    assert chunks == chunks3 and rounds_three < rounds_one and rounds_three >= -(-chunks // 3)
    for s1, s3 in zip(one, three):
        a = alone[s1.index]
        for s in (s1, s3):
            assert s.generated == a.generated_ids and s.finish_reason == a.finish_reason, s.index
            assert [x.tobytes() for x in s.logprobs] == [x.tobytes() for x in a.logprobs], s.index


@pytest.mark.parametrize("max_batch,chunk", [(1, 16), (3, 7), (8, 32)])
def test_each_sequence_equals_its_run_alone(eng, alone, max_batch, chunk):
    """Mixed lengths (1 token to several chunks), fewer slots than prompts (sequences join as
    others finish), every slot count and prefill chunk: each result is its run alone, bytes."""
    got = eng.generate_batch(PROMPTS, NEW, logprobs=2, max_batch=max_batch, chunk=chunk, keep_states=True)
    assert [r.prompt_ids for r in got] == [a.prompt_ids for a in alone]
    for i, (a, b) in enumerate(zip(alone, got)):
        assert same(eng.cfg, a, b) is None, f"prompt {i}: {same(eng.cfg, a, b)}"
    stats = eng.last_batch_stats
    assert stats["slots"] == min(max_batch, len(PROMPTS)) and stats["steps"]["decode"] > 0


def test_alone_equals_replay(eng, alone):
    for i in (0, 1, 3):
        r = eng.generate(PROMPTS[i], NEW[i], prefill="replay", logprobs=2, keep_state=True)
        assert same(eng.cfg, r, alone[i]) is None, f"prompt {i}: replay vs batched prefill"


def test_sampled_sequences_equal_alone(eng):
    """Per-sequence temperature / top-k / top-p / seed, keyed on (seed, token index): the draws are
    the same alone and in any batch, and different seeds draw differently."""
    sps = [baro_jax.Sampling(temperature=0.9, top_p=0.95, seed=s) for s in range(len(PROMPTS))]
    sps[2] = baro_jax.Sampling(temperature=1.3, top_k=20, seed=99)
    sps[4] = baro_jax.Sampling()  # greedy beside sampled ones
    got = eng.generate_batch(PROMPTS, 10, sampling=sps, max_batch=4, chunk=16)
    for i, (p, s) in enumerate(zip(PROMPTS, sps)):
        a = eng.generate(p, 10, sampling=s, logprobs=0)
        assert same(eng.cfg, a, got[i]) is None, f"prompt {i}: {same(eng.cfg, a, got[i])}"
    other = eng.generate(PROMPTS[0], 10, sampling=baro_jax.Sampling(temperature=0.9, top_p=0.95, seed=12345))
    assert other.generated_ids != got[0].generated_ids


def test_prompt_logprobs_and_score(eng):
    """prompt_logprobs from the batch equal generate's alone; score(prompt, continuation) gives the
    bytes of the logprobs the sampler saw when it generated the continuation."""
    got = eng.generate_batch(PROMPTS[:4], 6, prompt_logprobs=True, max_batch=2, chunk=16)
    for p, r in zip(PROMPTS[:4], got):
        a = eng.generate(p, 6, prompt_logprobs=True, logprobs=0)
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(r.prompt_ids)
        assert [None if x is None else x.tobytes() for x in a.prompt_logprobs] == \
               [None if x is None else x.tobytes() for x in r.prompt_logprobs]
        s = eng.score(r.prompt_ids, r.generated_ids)
        assert s.tobytes() == np.asarray(r.logprobs, np.float32).tobytes()


def test_generate_top_logprobs_are_the_rows_largest(eng, alone):
    """generate's logprobs=k: each position's chosen value and its k most likely ids and values are
    those of the log-softmax row of that position's logits (taken on the device: ids by value,
    ties to the lower id, as a stable host sort gives them)."""
    from baro_jax.logprobs import row_logprobs

    for a in (alone[1], alone[5]):
        rows = eng.forced_logits(a.prompt_ids + a.generated_ids, start=len(a.prompt_ids) - 1)[:-1]
        lp = np.asarray(row_logprobs(eng.ops, rows))
        for i, t in enumerate(a.generated_ids):
            best = np.argsort(-lp[i], kind="stable")[:2]
            assert a.top_logprobs[i][0] == best.tolist(), i
            assert a.top_logprobs[i][1].tobytes() == lp[i, best].tobytes(), i
            assert np.float32(a.logprobs[i]).tobytes() == lp[i, t].tobytes(), i


def test_score_batch_gives_each_pair_its_score_alone(eng, alone):
    """score_batch: each pair's log-probabilities are score()'s bytes alone, which are the bytes
    the sampler saw generating that continuation; texts and id lists, pairs of any lengths, fewer
    slots than pairs; bad arguments are named."""
    pairs = [(alone[i].prompt_ids, alone[i].generated_ids) for i in (0, 1, 3, 6)]
    pairs += [("def f(x):", " return x + 1"), ([5], [9, 9, 9])]
    got = eng.score_batch([p for p, _ in pairs], [c for _, c in pairs], max_batch=2, chunk=16)
    assert len(got) == len(pairs)
    for (p, c), g in zip(pairs, got):
        assert g.dtype == np.float32 and g.tobytes() == eng.score(p, c).tobytes(), (p, c)
    for i, g in zip((0, 1, 3, 6), got):
        assert g.tobytes() == np.asarray(alone[i].logprobs, np.float32).tobytes()
    assert eng.score_batch([], []) == []
    for args, msg in ((("a", ["b"]), "prompts must be a list"), ((["a"], ["b", "c"]), "1 prompts and 2"),
                      ((["a", ""], ["b", "c"]), "prompt 1 is empty"), ((["a"], [[]]), "continuation 0 is empty"),
                      ((["a"], [[10**7]]), "outside the vocabulary")):
        with pytest.raises((TypeError, ValueError), match=msg):
            eng.score_batch(*args)
    for args, msg in ((("", "b"), "score: the prompt is empty"), (("a", []), "score: the continuation is empty")):
        with pytest.raises(ValueError, match=msg):
            eng.score(*args)


def test_score_batch_prefills_a_shared_prompt_once(eng):
    """Rollouts of one prompt scored together: the first pair's prefill is cut where the prompt ends
    (mid-chunk here: 50 tokens at chunk 16) and each later pair of that prompt copies its state
    there and prefills only its continuation; each array is still score()'s bytes alone, the
    first continuation token's logprob included (the row the copy came from predicts it)."""
    prompt = eng.encode(PROMPTS[1])
    assert len(prompt) % 16 and len(prompt) > 16
    conts = [eng.encode(c) for c in ("1) + fib(n - 2)\n", " - 1) + fib(n - 2)", "-1)+fib(n-2)\n\n\ndef")]
    ps = [prompt, prompt, PROMPTS[0], prompt]
    cs = conts[:2] + [" import sys"] + conts[2:]
    got = eng.score_batch(ps, cs, chunk=16, max_batch=4)
    for p, c, g in zip(ps, cs, got):
        assert g.tobytes() == eng.score(p, c).tobytes(), (p, c)
    steps = eng.last_batch_stats["steps"]
    assert steps["forks"] == 2, steps
    own = sum(-(-len(p + eng.encode(c) if isinstance(c, str) else p + c) // 16)
              for p, c in [(eng.encode(PROMPTS[0]), " import sys")])
    # the prompt's chunks once (cut at its end) and each continuation's own, not the prompt three times
    shared = -(-len(prompt) // 16) + sum(-(-len(c) // 16) for c in conts)
    assert steps["prefill"] == shared + own, (steps, shared, own)


def test_prompts_with_a_common_header_prefill_it_once(eng):
    """A few-shot header of 40 tokens before each question (chunk 16): the later prompts copy the
    first one's state where their common tokens end (its chunks cut there), so the batch prefills
    fewer chunks; every result is its run alone in ids, logprob and prompt logprob bytes, and
    share_prefixes=False gives the same bytes with no copies. A prompt that is another's prefix
    takes its first token from that one's row."""
    header = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return"
    prompts = [header + q for q in (" a - b\n\n\ndef mul(", " a-b\n\ndef div(a, b):\n    return a /", "")]
    prompts.append("import os\n")
    runs = {}
    for share in (True, False):
        got = eng.generate_batch(prompts, 6, logprobs=1, prompt_logprobs=True, chunk=16, share_prefixes=share)
        runs[share] = (got, dict(eng.last_batch_stats["steps"]))
    (got, steps), (own, own_steps) = runs[True], runs[False]
    assert steps["forks"] == 2 and own_steps["forks"] == 0
    assert steps["prefill"] < own_steps["prefill"], (steps, own_steps)
    for p, a, b in zip(prompts, got, own):
        alone = eng.generate(p, 6, logprobs=1, prompt_logprobs=True)
        for r in (a, b):
            assert same(eng.cfg, alone, r) is None, (p, same(eng.cfg, alone, r))
            assert [None if x is None else x.tobytes() for x in alone.prompt_logprobs] == \
                   [None if x is None else x.tobytes() for x in r.prompt_logprobs], p
    from baro_jax.scheduler import Sequence
    run = B.open_run(eng, max_batch=4, length=1024, chunk=16, logprobs=1, stop_width=4)
    seqs = [Sequence(index=i, prompt_ids=eng.encode(p), max_new_tokens=2, sampling=baro_jax.Sampling())
            for i, p in enumerate(prompts)]
    for s in seqs:
        run.add(s)
    assert seqs[0].fork_of is None and seqs[3].fork_of is None
    assert seqs[2].fork_of is seqs[0] and seqs[2].shared == len(seqs[2].prompt_ids)
    assert seqs[1].fork_of is seqs[0] and len(seqs[2].prompt_ids) <= seqs[1].fork_at < len(seqs[1].prompt_ids)
    while not run.done:  # ended sequences lead no chunk: a long-running pool keeps none of them
        run.step()
    assert run._heads == {}


def test_copies_chain_and_a_sequence_left_behind_by_a_copy_prefills_its_own(eng):
    """Two prompts alike, two samples each: the second prompt's first sample copies the first
    prompt's state (a shared chunk of tokens) and its own second sample copies that in turn, in
    the same round. Scored pairs: pair 1 copies pair 0's state where they part, past the end of
    its prompt, so pair 2 (which waits for pair 1's state at that end) prefills its own. Each
    result is its bytes alone, and nothing waits for ever."""
    p = eng.encode(PROMPTS[3])  # 87 tokens: several chunks of 16
    sp = baro_jax.Sampling(temperature=0.9, seed=3)
    got = eng.generate_batch([p, p], 4, sampling=sp, n=2, chunk=16, logprobs=0)
    assert eng.last_batch_stats["steps"]["forks"] == 3
    for i, r in enumerate(got):
        a = eng.generate(p, 4, sampling=dataclasses.replace(sp, seed=3 + i % 2), logprobs=0)
        assert same(eng.cfg, a, r) is None, (i, same(eng.cfg, a, r))
    a_, c0 = p[:40], p[40:]
    b = p[:60]  # starts as pair 0's prompt and continuation do
    ps, cs = [a_, b, b], [c0, p[60:70], [(p[60] + 1) % eng.cfg.vocab_size, 5, 6]]
    got = eng.score_batch(ps, cs, chunk=16, max_batch=3)
    for x, c, g in zip(ps, cs, got):
        assert g.tobytes() == eng.score(x, c).tobytes()
    assert eng.last_batch_stats["steps"]["forks"] == 1
    # the same chain in a pool whose sequences decode on: the one left behind is let go at the copy,
    # not when the sequence it waited for ends
    from baro_jax.scheduler import Sequence
    run = B.open_run(eng, max_batch=3, length=1024, chunk=16, logprobs=0, stop_width=4)
    lead = Sequence(index=0, prompt_ids=p, max_new_tokens=20, sampling=baro_jax.Sampling())
    mid = Sequence(index=1, prompt_ids=p[:70], max_new_tokens=20, sampling=baro_jax.Sampling())
    left = Sequence(index=2, prompt_ids=b + [(p[60] + 1) % eng.cfg.vocab_size], max_new_tokens=20,
                    sampling=baro_jax.Sampling(), fork_of=mid, fork_at=60)
    for x in (lead, mid, left):
        run.add(x)
    assert mid.fork_of is lead and mid.shared == 70
    while mid.prefilled < 70:
        run.step()
    assert left.fork_of is None and mid.finish_reason is None and left.prefilled == 0  # pending now
    while not run.done:
        run.step()
    for x in (lead, mid, left):
        assert x.generated == eng.generate(x.prompt_ids, 20, logprobs=0).generated_ids


def test_stops_and_finish_reasons(eng, alone):
    ref = alone[1]
    text = eng.tokenizer.decode(ref.generated_ids)
    seen = {0: [], 1: [], 2: []}

    def on_token(i, t):  # prompt 2 ends itself after its 4th token; the others run on
        seen[i].append(t)
        return not (i == 2 and len(seen[i]) == 4)

    got = eng.generate_batch([PROMPTS[1]] * 3, NEW[1], on_token=on_token, max_batch=3)
    assert got[0].generated_ids == ref.generated_ids and got[0].finish_reason == "length"
    assert got[2].finish_reason == "stop" and got[2].generated_ids == ref.generated_ids[:4] == seen[2]
    cut = ref.generated_ids[3]
    g = eng.generate_batch([PROMPTS[1]], NEW[1], stop_token_ids=[cut])[0]
    assert g.finish_reason == "stop" and g.generated_ids == ref.generated_ids[:ref.generated_ids.index(cut) + 1]
    word = text[5:8]
    g = eng.generate_batch([PROMPTS[1]], NEW[1], stop=[word])[0]
    assert g.finish_reason == "stop" and word not in g.text and text.startswith(g.text)


def test_stop_strings_end_where_the_whole_text_first_holds_them(eng):
    """A stop string ends its sequence at the first token after which the whole decoded text holds
    it (the check decodes a window of recent tokens): for substrings of a free run's text at many
    places and lengths (inside a token, across tokens, the whole text), and several at once."""
    free = eng.generate(PROMPTS[3], 40, stop_at_eos=False)
    dec = eng.tokenizer.decode
    ids, text = free.generated_ids, dec(free.generated_ids)
    rng = np.random.default_rng(7)
    stops = [[text[a:a + n]] for a, n in zip(rng.integers(0, len(text) - 1, 12), rng.integers(1, 9, 12))]
    stops += [[text[-3:]], [text], [text[5:7], text[20:30]], ["\u0000never"]]
    for stop in stops:
        stop = [s for s in stop if s]
        want = next((k for k in range(1, len(ids) + 1) if any(s in dec(ids[:k]) for s in stop)), None)
        got = eng.generate_batch([PROMPTS[3]], 40, stop=stop, stop_at_eos=False)[0]
        if want is None:
            assert got.generated_ids == ids and got.finish_reason == "length", stop
        else:
            assert got.generated_ids == ids[:want] and got.finish_reason == "stop", (stop, want, len(got.generated_ids))


def test_a_sequence_stopped_inside_a_device_block_keeps_its_state_at_the_stop(eng, alone):
    """Greedy rows run blocks of decode steps on the device; a row that meets a stop id mid-block
    (or whose callback ends it) must end there: its tokens, logprobs and state are those of the
    same sequence run alone for exactly as many tokens, while the other runs on."""
    ref = alone[1]
    cut_at = 5
    cut = ref.generated_ids[cut_at]
    assert cut not in ref.generated_ids[:cut_at]
    o = next(i for i, a in enumerate(alone) if i != 1 and cut not in a.generated_ids and len(a.generated_ids) > 6)
    want = eng.generate(PROMPTS[1], cut_at + 1, logprobs=2, keep_state=True)
    n = len(want.prompt_ids) + len(want.generated_ids) - 1
    for how in ("stop id", "callback"):
        kw = dict(stop_token_ids=[cut]) if how == "stop id" else dict(on_token=lambda i, t: not (i == 0 and t == cut))
        got = eng.generate_batch([PROMPTS[1], PROMPTS[o]], [NEW[1], NEW[o]], logprobs=2, keep_states=True,
                                 max_batch=2, **kw)
        assert got[0].finish_reason == "stop", how
        assert got[0].generated_ids == want.generated_ids, how
        assert [x.tobytes() for x in got[0].logprobs] == [x.tobytes() for x in want.logprobs], how
        assert kv_rows(eng.cfg, want.state, n) == kv_rows(eng.cfg, got[0].state, n), how
        assert same(eng.cfg, alone[o], got[1]) is None, how
        steps = eng.last_batch_stats["steps"]
        if how == "stop id":  # the device ran blocks of steps ...
            assert steps["decode_calls"] < steps["decode"], steps
        else:  # ... a callback with kept states runs one step per call
            assert steps["decode_calls"] == steps["decode"], steps


def test_chained_blocks_give_the_bytes_alone(eng, alone):
    """With nothing waiting for a slot, greedy blocks run one ahead (each queued from the last
    one's outputs before its ids are read): every sequence still gets its bytes alone, a row that
    ends on the device (its length, a stop id) stops there inside the chain, and one stopped here
    by a callback costs at most the block in flight."""
    old = eng.settings.decode_block
    eng.tune(decode_block=3)
    try:
        got = eng.generate_batch(PROMPTS, NEW, logprobs=2, keep_states=True, max_batch=len(PROMPTS))
        assert eng.last_batch_stats["steps"]["chained_calls"] > 0, eng.last_batch_stats
        for a, b in zip(alone, got):
            assert same(eng.cfg, a, b) is None, same(eng.cfg, a, b)
        ref = alone[3]
        cut = ref.generated_ids[7]
        assert cut not in ref.generated_ids[:7]
        want = eng.generate(PROMPTS[3], 8, logprobs=2, keep_state=True)
        for kw in (dict(stop_token_ids=[cut]), dict(on_token=lambda i, t: not (i == 0 and t == cut))):
            got = eng.generate_batch([PROMPTS[3], PROMPTS[0]], [NEW[3], 30], logprobs=2, max_batch=2,
                                     stop_at_eos=False, **kw)
            assert eng.last_batch_stats["steps"]["chained_calls"] > 0, eng.last_batch_stats
            assert got[0].finish_reason == "stop" and got[0].generated_ids == want.generated_ids, kw
            assert [x.tobytes() for x in got[0].logprobs] == [x.tobytes() for x in want.logprobs], kw
            other = eng.generate(PROMPTS[0], 30, logprobs=2, stop_at_eos=False)
            assert got[1].generated_ids == other.generated_ids, kw
            assert [x.tobytes() for x in got[1].logprobs] == [x.tobytes() for x in other.logprobs], kw
    finally:
        eng.tune(decode_block=old)


def test_sampled_sequences_run_in_chained_blocks_with_the_bytes_alone(eng):
    """Every sampled sequence is drawn inside the decode block's graph (sampling.sample_rows):
    plain temperature, top_k <= K_DEVICE with or without top_p, a wider top_k and top_p over the
    whole vocabulary (the row ranked whole). Such sequences chain blocks like greedy ones and
    still get the ids, logprobs and final state they get alone, where Engine.generate draws each
    token from its row by itself."""
    sps = [baro_jax.Sampling(temperature=1.0, seed=s) for s in range(len(PROMPTS))]
    sps[1] = baro_jax.Sampling(temperature=0.7, top_k=20, top_p=0.8, seed=2**62 + 3)
    sps[2] = baro_jax.Sampling()  # greedy beside them
    sps[3] = baro_jax.Sampling(temperature=1.5, top_k=5, seed=77)
    sps[5] = baro_jax.Sampling(temperature=0.3, top_k=64, top_p=0.9, seed=5)
    new = [n + 6 for n in NEW]
    old = eng.settings.decode_block
    eng.tune(decode_block=3)
    try:
        wide = list(sps)
        wide[0] = baro_jax.Sampling(temperature=1.0, top_p=0.9, seed=0)
        wide[4] = baro_jax.Sampling(temperature=0.9, top_k=100, seed=9)
        for rows, max_batch in ((sps, 3), (sps, len(PROMPTS)), (wide, len(PROMPTS))):
            got = eng.generate_batch(PROMPTS, new, sampling=rows, logprobs=2, keep_states=True, max_batch=max_batch,
                                     stop_at_eos=False)
            steps = eng.last_batch_stats["steps"]
            assert steps["decode_calls"] < steps["decode"], steps
            assert max_batch < len(PROMPTS) or steps["chained_calls"] > 0, steps
            for i, (p, s, n) in enumerate(zip(PROMPTS, rows, new)):
                a = eng.generate(p, n, sampling=s, logprobs=2, keep_state=True, stop_at_eos=False)
                assert same(eng.cfg, a, got[i]) is None, f"prompt {i} max_batch {max_batch}: {same(eng.cfg, a, got[i])}"
    finally:
        eng.tune(decode_block=old)


def test_generate_draws_a_sampled_sequence_in_blocks_with_the_bytes_of_single_steps(eng):
    """Engine.generate: a sequence drawn in the graph (plain temperature; top_k with top_p) runs
    decode blocks of 3 and 16 steps with the ids and final state of one step at a time, as a greedy
    one does; top_p over the whole vocabulary too."""
    import jax

    def leaves(st):
        return b"".join(np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(st))

    old = eng.settings.decode_block
    try:
        for s in (baro_jax.Sampling(temperature=1.0, seed=3), baro_jax.Sampling(temperature=0.7, top_k=20, top_p=0.8,
                                                                                  seed=2**62 + 1),
                  baro_jax.Sampling(temperature=1.0, top_p=0.9, seed=1)):
            runs = []
            for b in (1, 3, 16):
                eng.tune(decode_block=b)
                r = eng.generate("import os\nx = ", 20, sampling=s, stop_at_eos=False, keep_state=True)
                runs.append((r.generated_ids, leaves(r.state)))
            assert runs[1] == runs[0] and runs[2] == runs[0], s
            assert len(set(runs[0][0])) > 3, runs[0][0]  # a draw, not a run of one id
    finally:
        eng.tune(decode_block=old)


def test_no_compilation_per_request(eng):
    """The step graphs depend on the slot count, the decode rows' bucket, the pool's length and
    the chunk, not on the prompts: once a few batches have run (a decode step of 1 and of 2 rows,
    with and without idle slots' states kept, a whole and a shorter block: a handful of graphs,
    each compiled at its first use), a batch of other lengths compiles nothing."""
    eng.generate_batch(PROMPTS[:3], 4, max_batch=2, chunk=16)
    eng.generate_batch(["a", "bb" * 30, "def g(x):\n    return x", "q"], [3, 7, 2, 5], max_batch=2, chunk=16)
    eng.generate_batch(["a", "bb" * 30, "q"], [9, 2, 1], max_batch=2, chunk=16)  # slot 0 alone: 1 row
    graphs = (B.DECODE, B.DECODE_BLOCK, B.PREFILL, B.MIXED)
    sizes = [g._cache_size() for g in graphs]
    eng.generate_batch(["import sys", "z" * 41, "for k in d:", "yy"], [6, 2, 9, 4], max_batch=2, chunk=16)
    assert [g._cache_size() for g in graphs] == sizes


def test_n_samples_of_a_prompt_share_its_prefill_and_each_equals_its_run_alone(eng):
    """n samples per prompt: result i * n + j is prompt i's sample j, drawn at the prompt's seed + j,
    and equals generate(prompt, seed + j) alone in tokens, logprob and top bytes, prompt logprobs
    and final state; the prompt is prefilled once, its later samples copying its state (forks),
    so the batch runs the chunks of the distinct prompts only."""
    prompts = [PROMPTS[1], PROMPTS[2]]  # several chunks of 8, and one token
    sp = [baro_jax.Sampling(temperature=0.9, top_p=0.95, seed=7), baro_jax.Sampling(temperature=1.2, seed=30)]
    got = eng.generate_batch(prompts, [7, 5], sampling=sp, n=3, logprobs=2, prompt_logprobs=True, chunk=8,
                             keep_states=True)
    assert len(got) == 6
    stats = eng.last_batch_stats
    chunks = sum(-(-len(eng.encode(p)) // 8) for p in prompts)
    assert stats["steps"]["forks"] == 4 and stats["steps"]["prefill"] == chunks, stats["steps"]
    for i, (p, s) in enumerate(zip(prompts, sp)):
        for j in range(3):
            a = eng.generate(p, [7, 5][i], sampling=dataclasses.replace(s, seed=s.seed + j), logprobs=2,
                             prompt_logprobs=True, keep_state=True)
            r = got[i * 3 + j]
            assert same(eng.cfg, a, r) is None, f"prompt {i} sample {j}: {same(eng.cfg, a, r)}"
            assert [None if x is None else x.tobytes() for x in a.prompt_logprobs] == \
                   [None if x is None else x.tobytes() for x in r.prompt_logprobs], (i, j)
    assert len({tuple(r.generated_ids) for r in got[:3]}) > 1  # the seeds draw differently
    greedy = eng.generate_batch([PROMPTS[0]], 6, n=2, chunk=8)
    assert greedy[0].generated_ids == greedy[1].generated_ids == eng.generate(PROMPTS[0], 6).generated_ids


def test_a_sample_that_gets_no_slot_while_its_prompt_prefills_prefills_its_own(eng, alone):
    """One slot: a prompt's second sample is admitted only after the first has ended, too late to
    copy the prompt state, so it prefills its prompt itself; the bytes are the same either way.
    A sample whose first sample is cancelled while prefilling prefills its own too."""
    got = eng.generate_batch([PROMPTS[1]], NEW[1], n=2, logprobs=2, max_batch=1, chunk=8, keep_states=True)
    assert eng.last_batch_stats["steps"]["forks"] == 0
    for r in got:
        assert same(eng.cfg, alone[1], r) is None, same(eng.cfg, alone[1], r)
    from baro_jax.scheduler import Sequence
    run = B.open_run(eng, max_batch=2, length=1024, chunk=8, logprobs=2, stop_width=4)
    ids = alone[1].prompt_ids
    first = Sequence(index=0, prompt_ids=ids, max_new_tokens=NEW[1], sampling=baro_jax.Sampling(), eos_ids=eng.eos_ids)
    second = Sequence(index=1, prompt_ids=ids, max_new_tokens=NEW[1], sampling=baro_jax.Sampling(),
                      eos_ids=eng.eos_ids, fork_of=first)
    run.add(first)
    run.add(second)
    run.step()
    assert 0 < first.prefilled < len(ids) and second.prefilled == 0 and second.fork_of is first
    run.cancel(first)
    assert second.fork_of is None
    while not run.done:
        run.step()
    assert run.steps["forks"] == 0 and second.generated == alone[1].generated_ids
    assert [x.tobytes() for x in second.logprobs] == [x.tobytes() for x in alone[1].logprobs]
    lone = Sequence(index=4, prompt_ids=ids, max_new_tokens=2, sampling=baro_jax.Sampling())
    with pytest.raises(ValueError, match="fork_of must name a sequence added to this pool before it"):
        run.add(Sequence(index=5, prompt_ids=ids, max_new_tokens=2, sampling=baro_jax.Sampling(), fork_of=lone))
    other = [(ids[0] + 1) % eng.cfg.vocab_size] + ids[1:]
    with pytest.raises(ValueError, match="fork_of must name another sequence whose prompt starts with the 3 shared"):
        run.add(Sequence(index=2, prompt_ids=other, max_new_tokens=2, sampling=baro_jax.Sampling(), fork_of=first,
                         fork_at=3))
    with pytest.raises(ValueError, match=f"fork_at must be <= {len(ids)}, got {len(ids) + 1}"):
        run.add(Sequence(index=3, prompt_ids=ids, max_new_tokens=2, sampling=baro_jax.Sampling(), fork_of=first,
                         fork_at=len(ids) + 1))


@pytest.mark.parametrize("kw,msg", [
    (dict(n=0), "n must be >= 1"),
    (dict(n=2.5), "n must be an integer"),
    (dict(n=3, sampling=baro_jax.Sampling(temperature=1.0, seed=2**63 - 2)),
     r"sample j of a prompt draws with seed \+ j, and seed 9223372036854775806 \+ 2 is past the largest seed"),
    (dict(prompts="abc"), "prompts must be a list"),
    (dict(prompts=["a", []]), "prompt 1 is empty"),
    (dict(max_new_tokens=[3, 4]), "max_new_tokens has 2 entries for 3 prompts"),
    (dict(max_batch=0), "max_batch must be >= 1"),
    (dict(logprobs=-1), "logprobs must be >= 0"),
    (dict(stop=[""]), "stop must be a string or a list of non-empty strings"),
    (dict(stop_token_ids=[10**6]), "outside the vocabulary"),
    (dict(on_token=5), "on_token must be a callable"),
    (dict(prefill_budget=0), "prefill_budget must be >= 1"),
    (dict(prefill_budget=2.5), "prefill_budget must be an integer"),
    (dict(sampling=baro_jax.Sampling(top_k=3)), "temperature is 0"),
])
def test_bad_batch_arguments(eng, kw, msg):
    args = dict(prompts=["a", "b", "c"], max_new_tokens=3)
    args.update(kw)
    with pytest.raises((TypeError, ValueError), match=msg):
        eng.generate_batch(args.pop("prompts"), args.pop("max_new_tokens"), **args)


def test_the_blocked_delta_rule_is_refused_with_its_reason():
    """The pool holds no pending delta block (delta_rule 'blocked' keeps one per sequence): the
    batch and the server's pool say so and how to set the rule."""
    blocked = baro_jax.load("tiny", delta_rule="blocked", progress=False)
    for call in (lambda: blocked.generate_batch(["a"], 2), lambda: blocked.score_batch(["a"], ["b"]),
                 lambda: B.open_run(blocked, max_batch=2, length=64, chunk=8, logprobs=None, stop_width=1)):
        with pytest.raises(ValueError, match=r"runs the per-token delta rule \(delta_rule 'token', BARO_DELTA=token\), "
                                             r"not 'blocked': the sequence pool holds no pending delta block"):
            call()


def test_sequences_join_and_leave_a_running_pool(eng, alone):
    """A pool kept running (a server's): sequences added between rounds and one cancelled while it
    decodes get their bytes alone; the cancelled one's tokens are a prefix of its run alone, and
    every slot is free again at the end."""
    from baro_jax.scheduler import Sequence

    run = B.open_run(eng, max_batch=3, length=1024, chunk=16, logprobs=2, stop_width=4)
    seqs = {i: Sequence(index=i, prompt_ids=alone[i].prompt_ids, max_new_tokens=NEW[i], sampling=baro_jax.Sampling(),
                        eos_ids=eng.eos_ids) for i in (0, 1, 3, 5, 6)}
    run.add(seqs[1])
    run.add(seqs[3])
    finished = run.step() + run.step()
    run.add(seqs[0])  # joins while 1 and 3 run
    while not seqs[1].generated:
        finished += run.step()
    assert run.cancel(seqs[1]) and not run.cancel(seqs[1])
    run.add(seqs[5])
    run.add(seqs[6])
    assert run.cancel(seqs[6])  # still waiting: it never runs
    while not run.done:
        finished += run.step()
    assert sorted(s.index for s in finished) == [0, 1, 3, 5, 6]
    assert seqs[6].finish_reason == "cancelled" and not seqs[6].generated
    cut = seqs[1]
    assert cut.finish_reason == "cancelled" and 0 < len(cut.generated) < NEW[1]
    assert cut.generated == alone[1].generated_ids[:len(cut.generated)]
    for i in (0, 3, 5):
        s, a = seqs[i], alone[i]
        assert s.generated == a.generated_ids and s.finish_reason == a.finish_reason, i
        assert [x.tobytes() for x in s.logprobs] == [x.tobytes() for x in a.logprobs], i
        assert [(t, v.tobytes()) for t, v in s.top_logprobs] == [(t, v.tobytes()) for t, v in a.top_logprobs], i
    assert len(run.sched.free) == run.slots == 3 and not run.sched.running


def _five_slots(eng, prompts, new, block):
    """generate_batch over 5 slots at decode_block `block`: (results, step counts)."""
    old = eng.settings.decode_block
    eng.tune(decode_block=block)
    try:
        got = eng.generate_batch(prompts, new, logprobs=2, max_batch=5, chunk=16, keep_states=True)
    finally:
        eng.tune(decode_block=old)
    return got, eng.last_batch_stats["steps"]


def _check_alone(eng, alone, prompts, new, got):
    for i, (p, r) in enumerate(zip(prompts, got)):
        a = alone[PROMPTS.index(p)]
        want = eng.generate(p, new[i], logprobs=2, keep_state=True) if new[i] != NEW[PROMPTS.index(p)] else a
        assert same(eng.cfg, want, r) is None, f"prompt {i}: {same(eng.cfg, want, r)}"


@pytest.mark.parametrize("block", [1, 3])
def test_a_step_runs_the_slots_up_to_the_highest_one_decoding(eng, alone, block):
    """At low load a decode step computes the slots up to the highest one decoding, rounded up to a
    power of two, not every slot: once the short sequences of slots 1..4 end, slot 0's long one
    runs alone in 1-row steps (in a chain of greedy blocks too, whose rows shrink between blocks),
    and every sequence keeps the bytes it has alone."""
    prompts, new = [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[6]], [14, 2, 2, 1, 3]
    got, steps = _five_slots(eng, prompts, new, block)
    assert block == 1 or steps["chained_calls"] > 0, steps
    assert steps["decode"] >= 10 and steps["decode_rows"] < 5 * steps["decode"] - 8, steps
    _check_alone(eng, alone, prompts, new, got)


@pytest.mark.parametrize("block", [1, 4])
def test_a_sequence_left_alone_in_a_high_slot_moves_down(eng, alone, block):
    """The long sequence takes the highest slot (4) and the short ones below it end first: it then
    moves into slot 0 (its conv and delta state copied, its page-table row moved) and decodes in
    1-row steps instead of 5-row ones; it keeps the bytes it has alone, state included."""
    prompts, new = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[6], PROMPTS[1]], [2, 2, 1, 3, 14]
    got, steps = _five_slots(eng, prompts, new, block)
    assert steps["moves"] >= 1, steps
    # 13 of the long sequence's steps; unmoved, those after the short ones end would run 5 rows each
    assert steps["decode"] >= 13 and steps["decode_rows"] <= steps["decode"] + 4 * 4, steps
    _check_alone(eng, alone, prompts, new, got)


def test_pack_moves_the_highest_sequences_into_the_lowest_holes():
    """Scheduler.pack: holes below the highest running slot are filled from the top, each page
    row moving with its sequence; free slots stay a heap of what is left."""
    from baro_jax.block_manager import BlockManager
    from baro_jax.scheduler import Scheduler, Sequence

    bm = BlockManager(6, 12, 64, 128)
    sched = Scheduler(6, bm)
    seqs = [Sequence(index=i, prompt_ids=[1] * (10 + i), max_new_tokens=100, sampling=baro_jax.Sampling())
            for i in range(6)]
    for s in seqs:
        sched.add(s)
    sched.admit()
    rows = {s.index: bm.table[s.slot].copy() for s in seqs}
    for i in (0, 2, 3):
        sched.finish(seqs[i], "length")
    assert sched.pack() == [(5, 0), (4, 2)]
    assert sorted(sched.running) == [0, 1, 2] and sorted(sched.free) == [3, 4, 5]
    assert [seqs[5].slot, seqs[4].slot, seqs[1].slot] == [0, 2, 1]
    for s in (seqs[1], seqs[4], seqs[5]):
        assert np.array_equal(bm.table[s.slot], rows[s.index])
    assert np.all(bm.table[3:] == -1) and sched.pack() == []
