"""The host backend's block pool: reference counts, cached groups and the free order as arrays, with the loops
over a call's blocks compiled by numba (a step pops, releases and counts hundreds of blocks: as Python
statements that was most of a step's bookkeeping, compiled it is tens of nanoseconds a block).

Dimensions: N blocks (block 0, the null block, included), K blocks passed to one call, R ranges.

    ref       int32[N]   table entries holding each block; 0 = free
    group_of  int32[N]   group a block is cached for; -1: not cached
    nxt, prv  int32[N]   the free order as a doubly linked list through the free blocks, block 0 its sentinel
                         (never free): `nxt[0]` is popped first, `prv[0]` is the last

(columns of one int32[N, 8] array, `new_pool`, so that a block's fields share a cache line; the loops take
any strides).

A released block that is not cached (or is released with `evict_first`) goes to the front, so it is reused
first; a released cached block goes to the back, so the least recently freed cached block is evicted first;
a hit on a free block unlinks it from the middle. The order equals `jaxkv.core.pool`'s ring without its stale
entries.
"""

from __future__ import annotations

import hashlib
import pathlib

import numba
import numpy as np
from numba.core import caching

from jaxkv.planner.specs import NULL_BLOCK

# The host engine's modules: each compiled function inlines those it calls from the others.
_ENGINE_FILES = sorted(pathlib.Path(__file__).parent.glob("host_*.py"))
_ENGINE_DIGEST = hashlib.sha256(b"".join(path.read_bytes() for path in _ENGINE_FILES)).hexdigest()


def _stamped(locator: type) -> type:
    """numba's cache `locator` for the engine's modules, its files named and stamped by all their sources: numba
    stamps a cached function with its own file's time and size only, so a change to a function it calls in
    another module would leave it stale, calling the old code (and an old file may not even load)."""

    class EngineLocator(locator):
        def get_source_stamp(self):
            return _ENGINE_DIGEST

        def get_disambiguator(self):
            return f"{super().get_disambiguator()}-{_ENGINE_DIGEST[:16]}"

        @classmethod
        def from_function(cls, py_func, py_file):
            if pathlib.Path(py_file) not in _ENGINE_FILES:
                return None
            return super().from_function(py_func, py_file)

    return EngineLocator


caching.CacheImpl._locator_classes[:0] = [
    _stamped(caching.UserProvidedCacheLocator),  # where NUMBA_CACHE_DIR is set
    _stamped(caching.InTreeCacheLocator),
]


def _jit(signature):
    """Compiled for one signature when this module is imported (from numba's cache after the first time, which
    the engine's sources stamp), so that no call pays a compilation; the arrays are C-contiguous (`::1`) and of
    exactly these dtypes."""
    return numba.njit(signature, cache=True, nogil=True)


_ARRAYS = "int32[:], int32[:], int32[:], int32[:]"  # nxt, prv, ref, group_of (columns of one array)


def new_pool(num_blocks: int) -> np.ndarray:
    """int32[N, 8]: per block (ref, group_of, nxt, prv) and four more columns (the engine's: its index fields and
    pending copies, `jaxkv.core.host_types.pool`), one block's fields in one cache line: a pool whose blocks
    1..N-1 are all free, in id order."""
    fields = np.zeros((num_blocks, 8), np.int32)
    fields[:, 1] = -1
    set_order(fields[:, 2], fields[:, 3], np.arange(1, num_blocks, dtype=np.int32))
    return fields


def set_order(nxt: np.ndarray, prv: np.ndarray, order: np.ndarray) -> None:
    """Links the free blocks `order` (int[F], first popped first) in that order."""
    chain = np.concatenate([[NULL_BLOCK], np.asarray(order, np.int32), [NULL_BLOCK]]).astype(np.int32)
    nxt[chain[:-1]] = chain[1:]
    prv[chain[1:]] = chain[:-1]


@_jit("int32[::1](int32[:], int64)")
def free_order(nxt, num_free):
    """int32[F]: the free blocks, first popped first."""
    out = np.empty(num_free, np.int32)
    b = nxt[0]
    for i in range(num_free):
        out[i] = b
        b = nxt[b]
    return out


@_jit("void(int32[:], int32[:], int64)")
def unlink(nxt, prv, b):
    p, q = prv[b], nxt[b]
    nxt[p] = q
    prv[q] = p


@_jit("void(int32[:], int32[:], int64, int64)")
def link_after(nxt, prv, a, b):
    """Links block b after a in the free order (a = 0: at the front; a = prv[0]: at the back)."""
    nxt[b], prv[b] = nxt[a], a
    prv[nxt[a]] = b
    nxt[a] = b


@_jit(f"int64(int64, boolean, {_ARRAYS})")
def _release_one(b, evict_first, nxt, prv, ref, group_of):
    if b == NULL_BLOCK:
        return 0
    ref[b] -= 1
    if ref[b]:
        return 0
    if group_of[b] >= 0 and not evict_first:
        link_after(nxt, prv, prv[0], b)
    else:
        link_after(nxt, prv, 0, b)
    return 1


@_jit(f"int64(int32[:, :, ::1], int64, int64, int64, int64, int64, {_ARRAYS})")
def release_range(tables, g, s, lo, hi, evict_from, nxt, prv, ref, group_of):
    """Releases `tables[g, s, lo:hi]`, last entry first, and nulls it; entries from `evict_from` on (-1: none)
    go to the front even where cached, before the others. Returns how many blocks became free."""
    freed = 0
    cut = hi if evict_from < 0 else min(max(evict_from, lo), hi)
    for j in range(hi - 1, cut - 1, -1):
        freed += _release_one(tables[g, s, j], True, nxt, prv, ref, group_of)
    for j in range(cut - 1, lo - 1, -1):
        freed += _release_one(tables[g, s, j], False, nxt, prv, ref, group_of)
    tables[g, s, lo:hi] = NULL_BLOCK
    return freed


@_jit(f"int64(int64[::1], int64[::1], int64[:, ::1], int64[::1], int32[:, :, ::1], {_ARRAYS})")
def free_slots(rows, num_computed, first_live, block_size, tables, nxt, prv, ref, group_of):
    """Releases the held table entries of slots `rows`, slot by slot, group by group (`release_range` of
    [first_live, the count's table length)), and zeroes their counts. Returns how many blocks became free."""
    freed = 0
    for s in rows:
        for g in range(block_size.shape[0]):
            hi = -(-num_computed[s] // block_size[g])
            freed += release_range(tables, g, s, first_live[s, g], hi, -1, nxt, prv, ref, group_of)
            first_live[s, g] = 0
        num_computed[s] = 0
    return freed
