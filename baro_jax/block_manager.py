"""Which KV pages of the pool (pool.py) each sequence slot holds: the free-page list and the
page table.

A sequence gets every page it can ever write when it is admitted: those of its prompt and its
max_new_tokens (pages_for), so a running sequence never runs out and never waits mid-way; it gives
them all back when it finishes or is cancelled. A sequence that needs more pages than are free
waits; one that needs more than the pool has could never run and is refused (check_fits).
"""
from __future__ import annotations

import numpy as np


def pages_for(positions: int, page: int) -> int:
    """Pages that hold `positions` positions (0 .. positions - 1)."""
    return -(-positions // page)


def positions_of(prompt_len: int, max_new_tokens: int) -> int:
    """KV positions a sequence writes: its prompt, then each generated token but the last (which
    is never fed back)."""
    return prompt_len + max(max_new_tokens - 1, 0)


class BlockManager:
    """`pages` pages of `page` positions for `slots` slots of up to `length` positions each.

    table: the host page table [slots, length / page] int32 (-1: no page), the one every attention
    layer reads; the caller puts it on the device when `version` has changed."""

    def __init__(self, slots: int, pages: int, page: int, length: int):
        if length % page:
            raise ValueError(f"the pool's length {length} must be a multiple of its page size {page}")
        self.page, self.pages = page, pages
        self.table = np.full((slots, length // page), -1, np.int32)
        self.free = list(range(pages - 1, -1, -1))  # pop() gives page 0 first
        self.version = 0  # counts table changes

    def need(self, positions: int) -> int:
        return pages_for(positions, self.page)

    def check_fits(self, positions: int, what: str = "a sequence"):
        """ValueError when `positions` could never fit: more pages than the pool has, or more
        positions than a slot's table row maps."""
        n = self.need(positions)
        if n > self.table.shape[1]:
            raise ValueError(f"{what} of {positions} KV positions does not fit a slot of "
                             f"{self.table.shape[1] * self.page} positions")
        if n > self.pages:
            raise ValueError(f"{what} of {positions} KV positions needs {n} pages of {self.page}; the pool has "
                             f"{self.pages} pages in all, so it could never run")

    def can_allocate(self, positions: int) -> bool:
        return self.need(positions) <= len(self.free)

    def allocate(self, slot: int, positions: int) -> np.ndarray:
        """Map the first pages of `slot`'s table row to free pages, enough for `positions`; returns
        the page ids given ([T] int32, -1 padded), which the caller zeroes before the slot runs."""
        n = self.need(positions)
        if n > len(self.free):
            raise RuntimeError(f"slot {slot}: {n} pages asked, {len(self.free)} free (admit checks can_allocate)")
        if np.any(self.table[slot] >= 0):
            raise RuntimeError(f"slot {slot} still holds pages")
        given = np.full((self.table.shape[1],), -1, np.int32)
        given[:n] = [self.free.pop() for _ in range(n)]
        self.table[slot] = given
        self.version += 1
        return given

    def release(self, slot: int):
        """The slot's pages back to the free list (a finished or cancelled sequence)."""
        row = self.table[slot]
        self.free.extend(int(p) for p in row[row >= 0][::-1])
        self.table[slot] = -1
        self.version += 1

    def move(self, src: int, dst: int):
        """Slot src's pages become slot dst's (a table row moves; no page does)."""
        if np.any(self.table[dst] >= 0):
            raise RuntimeError(f"slot {dst} still holds pages")
        self.table[dst] = self.table[src]
        self.table[src] = -1
        self.version += 1

    @property
    def used(self) -> int:
        return self.pages - len(self.free)
