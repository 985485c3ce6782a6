"""The host backend's prefix-cache index: the device index's arrays (`jaxkv.prefix.index.IndexState`), probed
and updated by loops compiled with numba.

Dimensions: E entries (B buckets × W ways, bucket-major), G groups, N blocks, K keys or fields passed to one call,
R rows, S slots, U units per slot.

    slots        uint32[E, FIELDS + G]  per entry: the key's four words, the fields held (`COUNT_WORD`; 0: the
                                        way is free) and one block per group (0: none)
    block_slot   int32[N]               e × G + g of the field holding a cached block; -1: none
    keys         uint32[S, U, 4]        each slot's unit keys (the device's `req_hashes`)

A key's bucket is its first word's low bits (`jaxkv.prefix.index.bucket_of`); a new key takes the first free way
of its bucket and is not indexed when the bucket is full. `cached_in_pass[b] == pass_id`: block b was indexed by
the current caching pass, which does not replace it.
"""

from __future__ import annotations

import numpy as np

from jaxkv.core.host_pool import _jit, link_after, unlink
from jaxkv.core.state import CHUNKED_LOCAL, FULL, SLIDING_WINDOW
from jaxkv.prefix.index import COUNT_WORD, FIELDS

_INDEX = "uint32[:, ::1], int32[:], int32[:]"  # slots, block_slot, group_of
_POOL = "int32[:], int32[:], int32[:], int32[:]"  # cached_in_pass, ref, nxt, prv


@_jit("int64(uint32[:, ::1], int64, uint32[::1])")
def find(slots, ways, key):
    """The entry holding `key` (uint32[4]), -1: none."""
    bucket = int(key[0]) & (slots.shape[0] // ways - 1)
    for e in range(bucket * ways, bucket * ways + ways):
        if (
            slots[e, COUNT_WORD]
            and slots[e, 0] == key[0]
            and slots[e, 1] == key[1]
            and slots[e, 2] == key[2]
            and slots[e, 3] == key[3]
        ):
            return e
    return -1


@_jit("void(int64, uint32[:, ::1], int32[:])")
def _unindex(block, slots, block_slot):
    e, g = divmod(block_slot[block], slots.shape[1] - FIELDS)
    slots[e, FIELDS + g] = 0
    slots[e, COUNT_WORD] -= 1  # at 0 the way is free
    block_slot[block] = -1


@_jit(f"void(int64, {_INDEX})")
def uncache(block, slots, block_slot, group_of):
    """Takes a cached block out of the index."""
    _unindex(block, slots, block_slot)
    group_of[block] = -1


@_jit(f"void(uint32[::1], int64[::1], int32[::1], boolean, int32, int64, {_INDEX}, {_POOL})")
def cache(key, groups, blocks, replace, pass_id, ways, slots, block_slot, group_of, cached_in_pass, ref, nxt, prv):
    """Indexes `blocks` (one per group of `groups`, ascending) under `key` where the key's entry and bucket have
    room. With `replace` (an allocation's caching pass) a block held under (key, group) before this pass first
    leaves the index (a free one moves to the front of the free order)."""
    e = find(slots, ways, key)
    if e >= 0 and replace:
        for i in range(groups.shape[0]):
            old = slots[e, FIELDS + groups[i]]
            if old == 0 or old == blocks[i] or cached_in_pass[old] == pass_id:
                continue
            uncache(old, slots, block_slot, group_of)
            if ref[old] == 0:
                unlink(nxt, prv, old)
                link_after(nxt, prv, 0, old)
    if e < 0 or slots[e, COUNT_WORD] == 0:  # a new entry (or one the replacement emptied): a free way
        if groups.shape[0] == 0:
            return
        bucket = int(key[0]) & (slots.shape[0] // ways - 1)
        if e < 0:
            for way in range(bucket * ways, bucket * ways + ways):
                if slots[way, COUNT_WORD] == 0:
                    e = way
                    break
            if e < 0:
                return
        slots[e, :4] = key
    num_groups = slots.shape[1] - FIELDS
    for i in range(groups.shape[0]):
        g, b = groups[i], blocks[i]
        if slots[e, FIELDS + g] == 0:
            slots[e, FIELDS + g] = b
            slots[e, COUNT_WORD] += 1
            block_slot[b] = e * num_groups + g
            group_of[b] = g
            if replace:
                cached_in_pass[b] = pass_id


@_jit(
    "void(int64, int64[::1], int64[::1], int64[::1], int32[:, :, ::1], uint32[:, :, ::1], int32, int64,"
    f" {_INDEX}, {_POOL}, int64[::1], int32[::1])"
)
def index_row(
    s, start, end, step, tables, keys, pass_id, ways, slots, block_slot, group_of, cached_in_pass, ref, nxt, prv,
    groups, blocks,
):  # fmt: skip
    """Indexes slot s's blocks [start, end) of `tables[g, s]`, per group g, one entry per block-end unit (block j
    ends at unit (j + 1) · step[g] − 1), in unit order, each holding the groups' blocks that end there (null
    table entries left out). `groups`, `blocks`: scratch of G entries."""
    num_groups = step.shape[0]
    lo, hi = -1, 0
    for g in range(num_groups):
        if end[g] > start[g]:
            first = (start[g] + 1) * step[g] - 1
            lo = first if lo < 0 else min(lo, first)
            hi = max(hi, end[g] * step[g])
    for unit in range(max(lo, 0), hi):
        k = 0
        for g in range(num_groups):
            j = (unit + 1) // step[g] - 1
            if (unit + 1) % step[g] == 0 and start[g] <= j < end[g] and tables[g, s, j] != 0:
                groups[k], blocks[k] = g, tables[g, s, j]
                k += 1
        if k:
            cache(keys[s, unit], groups[:k], blocks[:k], True, pass_id, ways, slots, block_slot, group_of,
                  cached_in_pass, ref, nxt, prv)  # fmt: skip


@_jit("int64(int32[:, ::1], int64, int64, int64, int64, int64, int64)")
def _hit_blocks(indexed, g, kind, block_size, window, step, max_blocks):
    """`rules.hit_blocks_reference` of group g at `max_blocks`: block j is cached where
    `indexed[(j + 1) · step − 1, g]` is not null."""
    if kind == FULL or kind == CHUNKED_LOCAL:
        j = 0 if kind == FULL else max_blocks // (window // block_size) * (window // block_size)
        while j < max_blocks and indexed[(j + 1) * step - 1, g]:
            j += 1
        return j
    if kind == SLIDING_WINDOW:
        num_needed = -(-(window - 1) // block_size)
        if num_needed == 0:
            return max_blocks
        run = 0
        for j in range(max_blocks - 1, -1, -1):
            run = run + 1 if indexed[(j + 1) * step - 1, g] else 0
            if run >= num_needed:
                return j + run
        return run
    for j in range(max_blocks - 1, -1, -1):  # a state group: the latest saved state
        if indexed[(j + 1) * step - 1, g]:
            return j + 1
    return 0


@_jit(
    "UniTuple(int64, 2)(uint32[:, ::1], int64, uint32[:, ::1], int64, int64, int64[::1], int64[::1], int64[::1],"
    " int64[::1])"
)
def lookup(slots, ways, keys, num_tokens, bound, kind, block_size, window, step):
    """vLLM's fixed point for a request of `num_tokens` tokens with unit keys `keys`, hits at most `bound` tokens:
    (hit, shared length: the full-attention groups' own longest hit). Keys are probed in order up to where every
    full-attention group has missed a block (no hit reaches past it)."""
    num_groups, num_units = kind.shape[0], bound // (block_size[0] // step[0])
    indexed = np.zeros((num_units, num_groups), np.int32)
    missed = np.zeros(num_groups, np.bool_)
    num_full = 0
    for g in range(num_groups):
        num_full += kind[g] == FULL
    num_missed = 0
    for unit in range(num_units):
        e = find(slots, ways, keys[unit])
        for g in range(num_groups):
            indexed[unit, g] = slots[e, FIELDS + g] if e >= 0 else 0
            if kind[g] == FULL and not missed[g] and (unit + 1) % step[g] == 0 and indexed[unit, g] == 0:
                missed[g] = True
                num_missed += 1
        if num_full and num_missed == num_full:
            break
    hit = max(num_tokens - 1, 0) if keys.shape[0] else 0
    while True:
        new_hit = hit
        for g in range(num_groups):
            max_blocks = min(new_hit, bound) // block_size[g]
            new_hit = _hit_blocks(indexed, g, kind[g], block_size[g], window[g], step[g], max_blocks) * block_size[g]
        if new_hit == hit:
            break
        hit = new_hit
    shared = -1
    for g in range(num_groups):
        if kind[g] == FULL:
            own = _hit_blocks(indexed, g, kind[g], block_size[g], window[g], step[g], bound // block_size[g])
            shared = max(shared, own * block_size[g])
    return hit, hit if shared < 0 else shared
