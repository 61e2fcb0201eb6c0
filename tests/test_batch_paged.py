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
    """The step graphs depend on the slots, the pool's length and page count and the chunk: a
    second pool of other prompts with the same sizes compiles nothing."""
    _run(eng, _seqs(eng, PROMPTS[:4], NEW[:4]), pages=3)
    graphs = (B.PREFILL, B.DECODE, B.DECODE_BLOCK, B.CLEAR, B.TAKE)
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
    assert seen_paged


def test_memory_error_names_the_pages(eng, monkeypatch):
    """A budget that holds the slots but not the longest sequence's pages says so."""
    monkeypatch.setattr(budget, "batch_slots", lambda *a, **k: (2, 1))
    with pytest.raises(MemoryError, match="the KV pages of the longest sequence \\(2 pages of 64 positions"):
        eng.generate_batch(["a" * 100, "b"], 10)
