"""A first-in first-out queue of block ids in numpy arrays, for the host backend's free order.

N blocks. Appends, pops from the front and removals from the middle, each a few array operations
however many blocks they move: a removed block's entry stays in the buffer, stale, until the front
passes it or the buffer is compacted (an entry is live while `pos[block]` is its own position).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class BlockQueue:
    """Blocks oldest first: buf[lo:hi] int32 holds them and stale entries; pos int64[N] is each queued
    block's position in buf (-1: not queued)."""

    def __init__(self, num_blocks: int, blocks: Iterable[int] = ()):
        self.pos = np.full(num_blocks, -1, np.int64)
        self.buf = np.zeros(2 * num_blocks + 64, np.int32)
        self.lo = self.hi = self.size = 0
        self.extend(np.fromiter(blocks, np.int64))

    def __len__(self) -> int:
        return self.size

    def __contains__(self, block: int) -> bool:
        return self.pos[block] >= 0

    def _live(self, lo: int, hi: int) -> np.ndarray:
        """The live blocks of buf[lo:hi], in order."""
        chunk = self.buf[lo:hi]
        return chunk[self.pos[chunk] == np.arange(lo, hi)]

    def __iter__(self) -> Iterator[int]:
        return iter(self._live(self.lo, self.hi).tolist())

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockQueue) and list(self) == list(other)

    def remove(self, block: int) -> None:
        self.pos[block] = -1
        self.size -= 1

    def extend(self, blocks: np.ndarray | list[int]) -> None:
        """Appends distinct blocks that are not queued, in order."""
        num = len(blocks)
        if self.hi + num > len(self.buf):  # compact: live entries to the front (size <= N fits twice)
            live = self._live(self.lo, self.hi)
            self.buf[: len(live)] = live
            self.pos[live] = np.arange(len(live))
            self.lo, self.hi = 0, len(live)
        self.buf[self.hi : self.hi + num] = blocks
        self.pos[self.buf[self.hi : self.hi + num]] = np.arange(self.hi, self.hi + num)
        self.hi += num
        self.size += num

    def pop_front(self, num: int) -> list[int]:
        """Takes the `num` oldest blocks (num <= len(self)), oldest first."""
        taken = []
        while num:
            end = min(self.lo + max(2 * num, 64), self.hi)  # stale entries may lie between
            chunk = self.buf[self.lo : end]
            idx = np.flatnonzero(self.pos[chunk] == np.arange(self.lo, end))[:num]
            blocks = chunk[idx]
            self.pos[blocks] = -1
            self.lo = self.lo + int(idx[-1]) + 1 if len(idx) == num else end
            taken += blocks.tolist()
            num -= len(idx)
        self.size -= len(taken)
        return taken
