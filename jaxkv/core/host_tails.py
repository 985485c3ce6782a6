"""The host engine's rules for hits inside blocks and for state groups, compiled (numba): the prompt-tail
entries (`jaxkv.prefix.tails`), the states saved at block ends, and the lookup whose hits may end at any unit.
The same outcome as the jitted engine's (`jaxkv.prefix.state`), block id for block id.

Dimensions as in `jaxkv.core.host_types`; a function comes before those that call it.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import boolean, int64, types

from jaxkv.core.host_index import _hit_blocks, _unindex, cache, find, uncache
from jaxkv.core.host_pool import _jit, unlink
from jaxkv.core.host_types import INDEX, POOL, REQUESTS, RULES
from jaxkv.core.state import FULL, MAMBA
from jaxkv.prefix.index import FIELDS

_ROWS = int64[::1]


@_jit(int64(int64, RULES, REQUESTS))
def tail_of(s, r, q):
    """p*: slot s's prompt tail's final unit boundary (0: no prompt length)."""
    prompt_len = q.prompt_len[s]
    if prompt_len <= 0:
        return 0
    return min((prompt_len - 1) // r.unit, q.num_hashed[s]) * r.unit


@_jit(types.void(int64, RULES, POOL, INDEX, REQUESTS))
def cache_state_blocks(s, r, p, index, q):
    """Indexes the states slot s's computed tokens end on, where they end a block and a unit key."""
    n = q.num_computed[s]
    if n == 0 or n % r.unit or n // r.unit > q.num_hashed[s]:
        return
    num_groups = r.block_size.shape[0]
    groups, blocks = np.empty(num_groups, np.int64), np.empty(num_groups, np.int32)
    k = 0
    for g in range(num_groups):
        bs = r.block_size[g]
        if r.kind[g] == MAMBA and n % bs == 0:
            block = q.tables[g, s, n // bs - 1]
            if block != 0 and p.group_of[block] < 0:
                groups[k], blocks[k] = g, block
                k += 1
    if k:
        cache(q.keys[s, n // r.unit - 1], groups[:k], blocks[:k], False, 0, r.ways, index, p.block_slot, p.group_of,
              p.cached_in_pass, p.ref, p.nxt, p.prv)  # fmt: skip


@_jit(int64(int64[::1], boolean, RULES, POOL, INDEX, REQUESTS, int64[:, ::1]))
def register_tails(rows, move, r, p, index, q, copies):
    """Indexes the prompt-tail blocks of slots `rows` (the partial groups' blocks holding the tail's final unit
    boundary where it lies inside them: an attention block its computed tokens reach past it, a state block
    whose state ends there). At an allocation's start (`move`) a state block's owner moves to a fresh block with
    a pinned copy, as far as free blocks last: `copies` gets (row, group, source, destination, valid tokens)
    rows. Returns how many."""
    num_groups = r.block_size.shape[0]
    groups, blocks = np.empty(num_groups, np.int64), np.empty(num_groups, np.int32)
    moving = np.zeros((rows.shape[0], num_groups), np.bool_)
    num_moving = 0
    for i in range(rows.shape[0]):
        s = rows[i]
        n, tail = q.num_computed[s], tail_of(s, r, q)
        if tail == 0:
            continue
        k = 0
        for g in range(num_groups):
            if not r.partial[g]:
                continue
            bs = r.block_size[g]
            j = tail // bs
            block = q.tables[g, s, j]
            if tail % bs == 0 or block == 0 or p.group_of[block] >= 0:
                continue
            if r.kind[g] == FULL and n >= tail and (j + 1) * bs > n:
                groups[k], blocks[k] = g, block
                k += 1
            elif r.kind[g] == MAMBA and n == tail:
                if move:
                    num_moving += 1
                    if num_moving > p.counts[0]:
                        continue
                groups[k], blocks[k] = g, block
                k += 1
        if k == 0:
            continue
        cache(q.keys[s, tail // r.unit - 1], groups[:k], blocks[:k], False, 0, r.ways, index, p.block_slot,
              p.group_of, p.cached_in_pass, p.ref, p.nxt, p.prv)  # fmt: skip
        for m in range(k):
            g = groups[m]
            moving[i, g] = move and r.kind[g] == MAMBA and p.group_of[blocks[m]] == g
    num_copies = 0
    for i in range(rows.shape[0]):
        s = rows[i]
        for g in range(num_groups):
            if not moving[i, g]:
                continue
            tail, bs = tail_of(s, r, q), r.block_size[g]
            src, dst = q.tables[g, s, tail // bs], p.nxt[0]
            unlink(p.nxt, p.prv, dst)
            p.ref[dst] = 2  # the table entry and the copy's pin
            p.group_of[dst] = -1
            if p.block_slot[dst] >= 0:  # a popped cached block leaves the index
                _unindex(dst, index, p.block_slot)
            p.counts[0] -= 1
            q.tables[g, s, tail // bs] = dst
            p.copy_src[dst] = src
            copies[num_copies, 0], copies[num_copies, 1] = i, g
            copies[num_copies, 2], copies[num_copies, 3] = src, dst
            copies[num_copies, 4] = tail - tail // bs * bs
            num_copies += 1
    return num_copies


@_jit(types.void(int64[::1], int64, int64[::1], boolean[::1], int64[::1], RULES, POOL, INDEX, REQUESTS))
def uncache_filled_tails(slots_of, num_ok, n_eff, hit_ok, lookahead, r, p, index, q):
    """A partially indexed prompt-tail block of an attention group that rows [0, num_ok)'s scheduled tokens
    fill leaves the index (the caching pass indexes it whole)."""
    for i in range(num_ok):
        s = slots_of[i]
        tail = tail_of(s, r, q)
        n = q.num_computed[s]
        hashed_len = min(q.num_hashed[s] * r.unit, n - lookahead[i])
        for g in range(r.block_size.shape[0]):
            bs = r.block_size[g]
            if not r.partial[g] or r.kind[g] != FULL or tail % bs == 0:
                continue
            j = tail // bs
            start = n_eff[i] // bs if hit_ok[i] else q.num_cached[s, g]
            block = q.tables[g, s, j]
            if block != 0 and j >= start and (j + 1) * bs <= min(n, hashed_len) and p.group_of[block] >= 0:
                uncache(block, index, p.block_slot, p.group_of)


@_jit(types.UniTuple(int64, 2)(INDEX, numba.uint32[:, ::1], int64, RULES))
def lookup_partial(index, keys, bound, r):
    """The hit of unit keys `keys` at most `bound` tokens where hits may end inside blocks: the longest whole
    number of units valid for every group, and the shared length (the full-attention groups' own longest).
    A partial state group is valid where the unit's entry holds its state; a partial attention group where its
    blocks before are all indexed and the unit's entry holds the block (or the hit ends a block); another group
    where the hit ends its block and `host_index._hit_blocks` reaches it."""
    num_groups, unit = r.block_size.shape[0], r.unit
    num_units = bound // unit
    indexed = np.zeros((num_units, num_groups), np.int32)
    for u in range(num_units):
        e = find(index, r.ways, keys[u])
        if e >= 0:
            for g in range(num_groups):
                indexed[u, g] = index[e, FIELDS + g]
    first_miss = np.zeros(num_groups, np.int64)  # per group, its first block not indexed
    for g in range(num_groups):
        while first_miss[g] < num_units // r.step[g] and indexed[(first_miss[g] + 1) * r.step[g] - 1, g]:
            first_miss[g] += 1
    hit = shared = -1
    for u in range(num_units, 0, -1):
        h, all_valid, full_valid = u * unit, True, False
        for g in range(num_groups):
            bs = r.block_size[g]
            keyed = indexed[u - 1, g] != 0
            if r.partial[g] and r.kind[g] == MAMBA:
                valid = keyed
            elif r.partial[g]:
                valid = h // bs <= first_miss[g] and (h % bs == 0 or keyed)
            else:
                valid = h % bs == 0 and (
                    _hit_blocks(indexed, g, r.kind[g], bs, r.window[g], r.step[g], h // bs) == h // bs
                )
            all_valid = all_valid and valid
            full_valid = full_valid or (valid and r.kind[g] == FULL)
        if all_valid and hit < 0:
            hit = h
        if full_valid and shared < 0:
            shared = h
        if hit >= 0 and shared >= 0:
            break
    hit = max(hit, 0)
    has_full = False
    for g in range(num_groups):
        has_full = has_full or r.kind[g] == FULL
    return hit, max(shared, 0) if has_full else hit
