"""The paged pool in a batch: with KV pages scarce some sequences wait for pages while slots are
free, and every sequence still gets its bytes alone (tokens, logprobs, final state); a pool of
other prompts compiles nothing new; a sequence the pages could never hold is refused at add();
the budget sizes slots and pages."""
import numpy as np
import pytest

import baro_jax
from baro_jax import batch as B
from baro_jax import budget
from baro_jax import pool as Pool
from baro_jax.block_manager import pages_for
from baro_jax.scheduler import Sequence

from test_batch import NEW, PROMPTS, same

PAGE = 64


@pytest.fixture(scope="module")
def eng():
    return baro_jax.load("tiny", backend="ordered", progress=False)


def _seqs(eng, prompts, news):
    return [Sequence(index=i, prompt_ids=eng.encode(p), max_new_tokens=n, sampling=baro_jax.Sampling(),
                     eos_ids=eng.eos_ids) for i, (p, n) in enumerate(zip(prompts, news))]


def _run(eng, seqs, pages, slots=4):
    """Rounds of a BatchRun of `pages` pages until done; returns the sequences and whether a
    round ever left a sequence waiting beside a free slot (waiting for pages)."""
    run = B.BatchRun(eng.runner, eng.tokenizer, seqs, slots=slots, length=1024, chunk=16, logprobs=2,
                     keep_states=True, block=eng.runner.decode_block, pages=pages)
    waited, together = False, 0
    while not run.done:
        run.step()
        waited = waited or bool(run.sched.waiting and run.sched.free)
        together = max(together, len(run.sched.running))
        assert run.blocks.used <= pages
    assert run.blocks.used == 0 and len(run.blocks.free) == pages
    return sorted(seqs, key=lambda s: s.index), waited, together


def test_scarce_pages_make_sequences_wait_with_their_bytes_alone(eng):
    seqs = _seqs(eng, PROMPTS, NEW)
    need = [pages_for(s.positions, PAGE) for s in seqs]
    pages = max(need) + 1  # the largest sequence fits, never all four slots' sequences at once
    assert pages < sum(sorted(need)[-4:])
    done, waited, together = _run(eng, seqs, pages)
    assert waited, "some sequence should have waited for pages beside a free slot"
    assert together >= 2, "short sequences should have shared the pages"
    for i, seq in enumerate(done):
        alone = eng.generate(PROMPTS[i], NEW[i], logprobs=2, keep_state=True)
        got = baro_jax.GenerateResult(prompt_ids=seq.prompt_ids, generated_ids=seq.generated, text="",
                                      prefill_seconds=0.0, prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0,
                                      model="", backend="", prefill_mode="batch", chunk=16, mode="", variant="",
                                      state=seq.state, logprobs=seq.logprobs, top_logprobs=seq.top_logprobs,
                                      prompt_logprobs=None, finish_reason=seq.finish_reason)
        assert same(eng.cfg, alone, got) is None, (i, same(eng.cfg, alone, got))


def test_scarce_pages_compile_nothing_per_request(eng):
    """The step graphs depend on the slots, the decode rows' bucket, the pool's length and page
    count and the chunk: once each bucket has run (1, 2 and 4 rows, a whole and a shorter block,
    a step in one pass with a prefill chunk, a step alone), a pool of other prompts with the same
    sizes compiles nothing."""
    _run(eng, _seqs(eng, PROMPTS[:4], NEW[:4]), pages=3)
    block = eng.runner.decode_block
    for n in (1, 2, 3, 4):  # n one-token prompts at once: steps of up to n rows, then blocks of them
        _run(eng, _seqs(eng, ["x"] * n, [block + 2] * n), pages=3)
    # the fourth waits for the first's page, then prefills in slot 0 beside slot 2's steps: 4 rows
    _run(eng, _seqs(eng, ["x"] * 4, [1] + [block + 2] * 3), pages=3)
    sampled = _seqs(eng, ["x"] * 3, [4] * 3)  # sampled rows decode one step a call: steps alone of 4, 2, 1 rows
    for s in sampled:
        s.sampling = baro_jax.Sampling(temperature=0.8, seed=s.index)
    _run(eng, sampled, pages=3)
    graphs = (B.PREFILL, B.DECODE, B.DECODE_BLOCK, B.MIXED, B.CLEAR, B.TAKE)
    sizes = [g._cache_size() for g in graphs]
    _run(eng, _seqs(eng, ["import sys", "z" * 41, "for k in d:\n    pass", "yy", PROMPTS[5]], [6, 2, 9, 4, 3]),
         pages=3)
    assert [g._cache_size() for g in graphs] == sizes


def test_a_sequence_the_pages_never_hold_is_refused_at_add(eng):
    run = B.BatchRun(eng.runner, eng.tokenizer, [], slots=2, length=1024, chunk=16, logprobs=None,
                     keep_states=False, pages=2)
    long = Sequence(index=0, prompt_ids=list(range(1, 120)), max_new_tokens=20, sampling=baro_jax.Sampling())
    with pytest.raises(ValueError, match="138 KV positions needs 3 pages of 64; the pool has 2 pages in all"):
        run.add(long)
    assert run.done  # nothing was queued


def test_budget_keeps_slots_and_gives_fewer_pages(eng):
    """Between a budget too small for one slot and one that holds every slot at full length, there
    are budgets that keep all the slots with fewer pages (a contiguous pool would have had fewer
    slots); every sizing fits the budget it came from."""
    cfg, dt = eng.cfg, eng.dtype
    length, chunk, want = 4096, 16, 8
    per_page, per_slot = Pool.page_bytes(cfg, dt, PAGE), Pool.slot_bytes(cfg, dt)
    full = want * (length // PAGE)
    assert budget.batch_slots(cfg, dt, 1e4, length, chunk, want, page=PAGE) == (want, full)
    seen_paged = False
    for gb in np.linspace(1.0, 1.6, 61):
        slots, pages = budget.batch_slots(cfg, dt, float(gb), length, chunk, want, page=PAGE)
        assert 0 <= slots <= want and 0 <= pages <= full
        assert (pages >= slots) if slots else pages == 0
        limit, _ = budget.budget_bytes(float(gb))
        # the count of the old contiguous pool: a whole slot of `length` positions each
        old = budget.batch_slots(cfg, dt, float(gb), length, chunk, want, page=length)[0]
        if slots == want and pages < full:
            seen_paged = True
            assert old < want, f"at {gb:.2f} GiB contiguous slots would fit all {want} too"
        if slots:
            assert slots * per_slot + pages * per_page <= limit
            # the count a run records (batch_counted_bytes) is the one the sizing kept inside the
            # budget, and with every slot kept, one more page would not have fitted
            counted = budget.batch_counted_bytes(cfg, dt, length, chunk, slots, pages, page=PAGE)
            assert counted + budget.runtime_reserve_bytes(limit) <= limit
            if slots == want and pages < full:
                assert counted + per_page + budget.runtime_reserve_bytes(limit) > limit
    assert seen_paged


def test_memory_error_names_the_pages(eng, monkeypatch):
    """A budget that holds the slots but not the longest sequence's pages says so."""
    monkeypatch.setattr(budget, "batch_slots", lambda *a, **k: (2, 1))
    with pytest.raises(MemoryError, match="the KV pages of the longest sequence \\(2 pages of 64 positions"):
        eng.generate_batch(["a" * 100, "b"], 10)


def _fresh(ids, new=3):
    return Sequence(index=0, prompt_ids=ids, max_new_tokens=new, sampling=baro_jax.Sampling())


@pytest.mark.parametrize("kw,err,msg", [
    (dict(page=32), ValueError, "page must be a positive multiple of 64"),
    (dict(page=0), ValueError, "page must be a positive multiple of 64"),
    (dict(pages=-1), ValueError, "pages must be >= 1, got -1"),
    (dict(pages=2.5), TypeError, "pages must be an integer"),
])
def test_bad_pool_sizes_are_refused_when_the_pool_is_made(eng, kw, err, msg):
    """A page size the attention kernels cannot read (or a page count that is no count) is
    refused by BatchRun itself, not by the first decode step's kernel after prompts ran."""
    with pytest.raises(err, match=msg):
        B.BatchRun(eng.runner, eng.tokenizer, [], slots=2, length=256, chunk=16, logprobs=None, keep_states=False,
                   **{"pages": 4, **kw})


def test_bad_sequences_are_refused_at_add_and_the_pool_runs_on(eng):
    """An empty prompt, ids outside the vocabulary, a negative max_new_tokens, and a sequence that
    was added before (twice, or again after it ended) are refused at add() with what is wrong;
    before, they were queued and broke a later round (an IndexError on the empty prompt's last
    token, a slot and its pages held for ever by the twice-added one, so the pool never ran
    dry). The pool then runs a good sequence to its bytes alone and gives every page back."""
    rng = np.random.default_rng()
    V = eng.cfg.vocab_size
    run = B.BatchRun(eng.runner, eng.tokenizer, [], slots=2, length=256, chunk=16, logprobs=0, keep_states=False,
                     pages=4)
    with pytest.raises(ValueError, match="the prompt is empty"):
        run.add(_fresh([]))
    with pytest.raises(ValueError, match=f"outside the vocabulary \\[0, {V}\\)"):
        run.add(_fresh([1, V, 2]))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0, got -2"):
        run.add(_fresh([1, 2], -2))
    assert run.done
    ids = rng.integers(1, V, int(rng.integers(2, 60))).tolist()
    good = _fresh(ids, 5)
    run.add(good)
    with pytest.raises(ValueError, match="already added to a pool"):
        run.add(good)
    steps = 0
    while not run.done:
        run.step()
        steps += 1
        assert steps < 50, "the pool never ran dry"
    with pytest.raises(ValueError, match="already added to a pool"):
        run.add(good)  # ended: its tokens would be taken for a decode in progress
    assert run.done and run.blocks.used == 0 and np.all(run.blocks.table == -1)
    alone = eng.generate(ids, 5, logprobs=0)
    assert good.generated == alone.generated_ids and good.finish_reason == alone.finish_reason
    assert [x.tobytes() for x in good.logprobs] == [x.tobytes() for x in alone.logprobs]


def test_a_tight_budget_gives_fewer_slots_rather_than_refuse_the_longest_sequence(eng):
    """With max_batch left to the budget, a budget that holds many one-page slots but then fewer
    pages than the longest sequence needs must give fewer slots (and so more pages), as the
    contiguous pool did, not refuse the batch: before, it sized the most slots of one page each
    and then raised MemoryError for the longest sequence's pages, which one slot fewer held."""
    rng = np.random.default_rng()
    cfg, dt, V = eng.cfg, eng.dtype, eng.cfg.vocab_size
    n_long, new_long = int(rng.integers(900, 960)), int(rng.integers(20, 40))
    longest = pages_for(n_long + new_long - 1, PAGE)
    prompts = [rng.integers(1, V, int(rng.integers(1, 30))).tolist() for _ in range(11)]
    prompts.insert(int(rng.integers(0, 12)), rng.integers(1, V, n_long).tolist())
    news = [new_long if len(p) == n_long else int(rng.integers(1, 8)) for p in prompts]
    # a budget whose most slots of one page each leave fewer pages than the longest needs, while
    # the contiguous pool (a page of the pool's whole length, 1024) had room for a slot or more
    tight = None
    for gb in np.linspace(1.0, 1.1, 4001):
        slots, pages = budget.batch_slots(cfg, dt, float(gb), 1024, 256, len(prompts), page=PAGE)
        contiguous = budget.batch_slots(cfg, dt, float(gb), 1024, 256, len(prompts), page=1024)[0]
        if 1 < slots < len(prompts) and pages < longest and contiguous >= 1:
            tight = float(gb)
            break
    assert tight is not None
    alone = [eng.generate(p, m, logprobs=0, stop_at_eos=False) for p, m in zip(prompts, news)]
    keep = eng.runner.settings
    eng.runner.settings = keep.replace(device_budget_gb=tight)
    try:
        got = eng.generate_batch(prompts, news, logprobs=0, stop_at_eos=False)
        stats = eng.last_batch_stats
    finally:
        eng.runner.settings = keep
    assert stats["pool_length"] == 1024 and stats["kv_pages"] >= longest and 1 <= stats["slots"] < len(prompts)
    per_page, per_slot = Pool.page_bytes(cfg, dt, PAGE), Pool.slot_bytes(cfg, dt)
    limit = budget.budget_bytes(tight)[0]
    assert stats["slots"] * per_slot + stats["kv_pages"] * per_page <= limit
    assert stats["budget_counted_bytes"] + budget.runtime_reserve_bytes(limit) <= limit
    for a, b in zip(alone, got):
        assert a.generated_ids == b.generated_ids
        assert [x.tobytes() for x in a.logprobs] == [x.tobytes() for x in b.logprobs]


@pytest.mark.parametrize("top", [-2, "big"])
def test_a_bad_prompt_top_n_is_refused_at_add(eng, top):
    """prompt_top_n outside [0, vocab] is refused at add(), naming it; before, a negative one gave
    empty top lists without a word, and one past the vocabulary failed inside jax's top_k after
    the prompt had run (in a server: the whole round, every request in it)."""
    V = eng.cfg.vocab_size
    k = -2 if top == -2 else V + int(np.random.default_rng().integers(1, 1000))
    run = B.BatchRun(eng.runner, eng.tokenizer, [], slots=1, length=256, chunk=16, logprobs=2, keep_states=False,
                     pages=4)
    s = Sequence(index=0, prompt_ids=[5, 6, 7, 8], max_new_tokens=2, sampling=baro_jax.Sampling(),
                 want_prompt_logprobs=True, prompt_top_n=k)
    with pytest.raises(ValueError, match=f"prompt_top_n must be (>= 0|<= {V}), got {k}"):
        run.add(s)
    assert run.done


def test_memory_error_counts_the_pages_one_slot_would_have(eng):
    """A budget that holds a slot but not the longest sequence's pages beside it: the MemoryError
    says how many pages one slot would have had (not 0, the count of a pool of no slots)."""
    rng = np.random.default_rng()
    cfg, dt, V = eng.cfg, eng.dtype, eng.cfg.vocab_size
    n = int(rng.integers(900, 1000))
    found = None
    for gb in np.linspace(1.0, 1.1, 4001):
        slots, pages = budget.batch_slots(cfg, dt, float(gb), 1024, 256, 1, page=PAGE)
        if slots == 1 and 0 < pages < pages_for(n, PAGE):
            found = float(gb), pages
            break
    assert found is not None
    keep = eng.runner.settings
    eng.runner.settings = keep.replace(device_budget_gb=found[0])
    try:
        with pytest.raises(MemoryError, match=f"the KV pages of the longest sequence \\({pages_for(n, PAGE)} pages of "
                                              f"64 positions.*; {found[1]} do$"):
            eng.generate_batch([rng.integers(1, V, n).tolist()], 1)
    finally:
        eng.runner.settings = keep
