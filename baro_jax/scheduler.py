"""Continuous batching: which sequence holds which slot, and what each step runs.

A fixed pool of `slots` sequence slots (pool.py) and its KV pages (block_manager.py). Waiting
sequences take free slots in arrival order, each with the pages of its prompt and max_new_tokens
reserved up front; while the oldest waiting one finds too few free pages, it and those behind it
wait. A sequence with prompt tokens left gets the next prefill chunk (one chunk per step, the
oldest first); every sequence whose prompt is in decodes one token per decode step, all of them
in one call. A finished sequence frees its slot and its pages at once, for the next waiting one.
Sequences may join while others run (add) and leave before they end (cancel), as a server's requests do.
A sequence may name another whose prompt starts as its own does (fork_of, fork_at: the samples of
one prompt, or continuations of one prompt being scored); admitted while that one has not yet
prefilled past the shared tokens, it is not prefilled itself up to them but takes a copy of that
one's state there (that one's chunk is cut at the point, BatchRun._chunk_inputs and _chunk_done);
otherwise it prefills its own. Nothing here
depends on another sequence's numbers: the scheduler decides only when a sequence's rows run,
never how (every row's arithmetic is its own), so a sequence's bytes are the same in any batch.
"""
from __future__ import annotations

import collections
import heapq
import dataclasses

from .block_manager import BlockManager, positions_of
from .sampling import Sampling


@dataclasses.dataclass(eq=False)
class Sequence:
    """One request on its way through the batch. Compared by identity: two requests with equal
    fields are still two (the queue's cancel must take out the one it is given)."""
    index: int                 # its place in the caller's list
    prompt_ids: list
    max_new_tokens: int
    sampling: Sampling
    stop_ids: frozenset = frozenset()
    stop_strings: tuple = ()
    eos_ids: frozenset = frozenset()
    want_prompt_logprobs: bool = False
    prompt_top_n: int = 0      # the k most likely ids and values at each prompt position too
    slot: int | None = None
    prefilled: int = 0         # prompt tokens in the slot's state
    generated: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    top_logprobs: list = dataclasses.field(default_factory=list)
    prompt_logprobs: list | None = None
    prompt_top_logprobs: list | None = None
    finish_reason: str | None = None
    state: tuple | None = None  # the slot's state when it finished (when asked)
    first_token_s: float | None = None
    token_times: list = dataclasses.field(default_factory=list)
    # a sequence added before this one whose prompt starts with the same fork_at tokens (None: all
    # of this one's prompt; the same prompt logprob asks), whose state after them this one copies
    # instead of prefilling them, while linked (the scheduler unlinks it where the copy cannot happen: that
    # one was already past them when this one got a slot, or it ended)
    fork_of: "Sequence | None" = None
    fork_at: int | None = None

    @property
    def pos(self) -> int:
        """The position of the next token fed to the slot (the last generated one)."""
        return len(self.prompt_ids) + len(self.generated) - 1

    @property
    def shared(self) -> int:
        """The prompt tokens it takes from fork_of's state."""
        return len(self.prompt_ids) if self.fork_at is None else self.fork_at

    @property
    def decoding(self) -> bool:
        return self.prefilled == len(self.prompt_ids) and self.finish_reason is None

    @property
    def positions(self) -> int:
        """KV positions the sequence may write (the pages reserved for it)."""
        return positions_of(len(self.prompt_ids), self.max_new_tokens)


class Scheduler:
    def __init__(self, slots: int, blocks: BlockManager):
        self.blocks = blocks
        self.waiting: collections.deque = collections.deque()  # add() appends
        # a min-heap: a new sequence takes the lowest free slot, so the running ones stay packed at
        # the pool's start and a decode step runs only the slots up to the highest one in use
        self.free = list(range(slots))
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.finished: list[Sequence] = []

    def add(self, seq: Sequence):
        """A sequence that arrives while others run: it waits behind the ones already waiting."""
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> bool:
        """End a sequence before its end (finish_reason "cancelled"): a waiting one never runs, a
        running one gives its slot back for the next admit. Whether it was still waiting or running."""
        if seq.finish_reason is not None:
            return False
        if seq.slot is not None and self.running.get(seq.slot) is seq:
            self.finish(seq, "cancelled")
            return True
        try:
            self.waiting.remove(seq)
        except ValueError:
            return False
        seq.finish_reason = "cancelled"
        self._unlink_forks(seq)
        self.finished.append(seq)
        return True

    def _unlink_forks(self, seq: Sequence):
        """The sequences waiting for seq's prompt state prefill their own (seq ended first)."""
        for s in list(self.running.values()) + list(self.waiting):
            if s.fork_of is seq:
                s.fork_of = None

    def forks_of(self, seq: Sequence) -> list[Sequence]:
        """The running sequences that take a copy of seq's state once it has prefilled their shared tokens."""
        return [s for s in self.running.values() if s.fork_of is seq]

    def drain_finished(self) -> list[Sequence]:
        """The sequences finished since the last call (a long-running loop keeps none of them)."""
        out, self.finished = self.finished, []
        return out

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running

    def admit(self) -> list[Sequence]:
        """Waiting sequences placed in free slots with their pages (in arrival order: the oldest
        waiting one that finds too few free pages holds back the ones behind it, so a long
        sequence is not passed over for ever); the caller zeroes each slot and its new pages."""
        placed = []
        while self.waiting and self.free and self.blocks.can_allocate(self.waiting[0].positions):
            seq = self.waiting.popleft()
            src = seq.fork_of
            if src is not None and not (src.slot is not None and self.running.get(src.slot) is src
                                        and src.prefilled < seq.shared):
                seq.fork_of = None  # too late (or too early) to copy: it prefills its own prompt
            seq.slot = heapq.heappop(self.free)
            self.blocks.allocate(seq.slot, seq.positions)
            self.running[seq.slot] = seq
            placed.append(seq)
        return placed

    def next_prefill(self) -> Sequence | None:
        """The oldest running sequence with prompt tokens still to prefill (and none to copy)."""
        pending = [s for s in self.running.values() if s.prefilled < len(s.prompt_ids) and s.fork_of is None]
        return min(pending, key=lambda s: s.index) if pending else None

    def decoding(self) -> list[Sequence]:
        return [s for s in self.running.values() if s.decoding]

    def pack(self) -> list[tuple[int, int]]:
        """Running sequences moved into the lowest free slots below them, highest first, until the
        ones in use are slots 0 .. n-1: a sequence that ends leaves a hole, and a decode step runs
        every slot up to the highest one in use. Returns the (from, to) moves; the caller moves
        each slot's state (the pages follow their table row here)."""
        moves = []
        while self.running and self.free and self.free[0] < max(self.running):
            src, dst = max(self.running), heapq.heappop(self.free)
            seq = self.running.pop(src)
            self.blocks.move(src, dst)
            seq.slot = dst
            self.running[dst] = seq
            heapq.heappush(self.free, src)
            moves.append((src, dst))
        return moves

    def finish(self, seq: Sequence, reason: str):
        seq.finish_reason = reason
        self._unlink_forks(seq)
        del self.running[seq.slot]
        self.blocks.release(seq.slot)
        heapq.heappush(self.free, seq.slot)
        self.finished.append(seq)
