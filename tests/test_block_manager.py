"""block_manager.BlockManager and the scheduler's admission by pages: pages given and taken back,
a sequence waiting while pages are short, one that could never fit refused."""
import numpy as np
import pytest

from baro_jax.block_manager import BlockManager, pages_for, positions_of
from baro_jax.sampling import Sampling
from baro_jax.scheduler import Scheduler, Sequence


def test_pages_and_positions():
    assert [pages_for(n, 64) for n in (1, 63, 64, 65, 128, 129)] == [1, 1, 1, 2, 2, 3]
    # the prompt's positions, then every new token but the last (never fed back)
    assert positions_of(10, 0) == 10 and positions_of(10, 1) == 10 and positions_of(10, 7) == 16


def test_allocate_and_release_keep_every_page_once():
    rng = np.random.default_rng(3)
    bm = BlockManager(slots=4, pages=11, page=64, length=256)
    assert bm.table.shape == (4, 4) and np.all(bm.table == -1)
    held = {}
    for _ in range(200):
        slot = int(rng.integers(0, 4))
        if slot in held:
            bm.release(slot)
            del held[slot]
            assert np.all(bm.table[slot] == -1)
        else:
            n = int(rng.integers(1, 257))
            if not bm.can_allocate(n):
                assert bm.need(n) > len(bm.free)
                continue
            v = bm.version
            given = bm.allocate(slot, n)
            assert bm.version == v + 1
            held[slot] = pages_for(n, 64)
            assert list(given[:held[slot]]) == list(bm.table[slot, :held[slot]]) and np.all(given[held[slot]:] == -1)
        mapped = bm.table[bm.table >= 0]
        # every page is either mapped once or free, never both
        assert len(set(mapped.tolist())) == len(mapped) == sum(held.values()) == bm.used
        assert sorted(mapped.tolist() + bm.free) == list(range(11))


def test_misuse_is_an_error():
    bm = BlockManager(slots=2, pages=3, page=64, length=256)
    bm.allocate(0, 100)
    with pytest.raises(RuntimeError, match="slot 0 still holds pages"):
        bm.allocate(0, 10)
    with pytest.raises(RuntimeError, match="2 pages asked, 1 free"):
        bm.allocate(1, 65)
    with pytest.raises(ValueError, match="length 100 must be a multiple of its page size 64"):
        BlockManager(slots=1, pages=1, page=64, length=100)


def test_refuses_what_could_never_fit():
    bm = BlockManager(slots=2, pages=3, page=64, length=256)
    bm.check_fits(192)  # three pages: the whole pool, fine
    with pytest.raises(ValueError, match="193 KV positions needs 4 pages of 64; the pool has 3 pages in all"):
        bm.check_fits(193)
    with pytest.raises(ValueError, match="257 KV positions does not fit a slot of 256 positions"):
        BlockManager(slots=2, pages=8, page=64, length=256).check_fits(257)


def _seq(i, prompt, new):
    return Sequence(index=i, prompt_ids=list(range(1, prompt + 1)), max_new_tokens=new, sampling=Sampling())


def test_admission_waits_for_pages_in_arrival_order():
    """Three free slots but four pages: after the first sequence (2 pages) the second (3 pages)
    waits, and so does the small third behind it (arrival order), until the first finishes and
    gives its pages back; a cancelled running sequence gives its pages back too."""
    bm = BlockManager(slots=3, pages=4, page=64, length=256)
    sched = Scheduler(3, bm)
    a, b, c = _seq(0, 100, 20), _seq(1, 70, 60), _seq(2, 5, 3)
    assert (a.positions, b.positions, c.positions) == (119, 129, 7)
    for s in (a, b, c):
        sched.add(s)
    assert sched.admit() == [a]
    assert bm.used == 2 and list(sched.waiting) == [b, c] and len(sched.free) == 2
    assert sched.admit() == []  # still short: nothing changes
    sched.finish(a, "length")
    assert bm.used == 0 and np.all(bm.table[a.slot] == -1)
    assert sched.admit() == [b, c] and bm.used == 4 and not sched.waiting
    assert np.count_nonzero(bm.table[b.slot] >= 0) == 3 and np.count_nonzero(bm.table[c.slot] >= 0) == 1
    assert sched.cancel(b) and bm.used == 1 and b.finish_reason == "cancelled"
    d = _seq(3, 150, 40)  # 189 positions: 3 pages, free again
    sched.add(d)
    assert sched.admit() == [d] and bm.used == 4


def test_cancel_takes_out_the_sequence_it_is_given_not_an_equal_one():
    """Two waiting sequences with equal fields (the same index and prompt: a caller's numbering
    is its own) are two requests: cancelling the second leaves the first waiting and takes the
    second out. Before, the waiting queue was searched by field equality: the first was removed
    (it would never run nor end) and the cancelled second stayed queued, was admitted, and held
    its slot and pages for ever (a cancelled sequence never decodes)."""
    rng = np.random.default_rng()
    prompt, new = int(rng.integers(1, 100)), int(rng.integers(1, 60))
    bm = BlockManager(slots=2, pages=4, page=64, length=256)
    sched = Scheduler(2, bm)
    a, b = _seq(7, prompt, new), _seq(7, prompt, new)
    sched.add(a)
    sched.add(b)
    assert sched.cancel(b) and b.finish_reason == "cancelled" and a.finish_reason is None
    assert len(sched.waiting) == 1 and sched.waiting[0] is a
    assert sched.admit() == [a] and a.slot is not None and b.slot is None
    assert not sched.cancel(b)  # ended already
    sched.finish(a, "length")
    assert sched.done and bm.used == 0 and np.all(bm.table == -1)
