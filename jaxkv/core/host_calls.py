"""The host engine's calls around an allocation, each one compiled (numba) call: a manager's checked calls
(`allocate_checked`, `reserve_checked`, `free_checked`, `append_checked`, with its counts), and the frees,
rollbacks, copy releases, lookups and key appends of every config. A checked call returns a refusal and changes
nothing where the call is invalid; the manager's general path then names what is wrong.

Dimensions and structures as in `jaxkv.core.host_types`; a function comes before those that call it.
"""

from __future__ import annotations

import numpy as np
from numba import boolean, int64, types, uint32

from jaxkv.core.host_index import lookup, uncache
from jaxkv.core.host_pool import _jit, _release_one, free_slots, release_range
from jaxkv.core.host_step import allocate
from jaxkv.core.host_tails import cache_state_blocks, lookup_partial, register_tails
from jaxkv.core.host_types import COUNTS, INDEX, POOL, REQUESTS, RULES, Rows
from jaxkv.core.state import MAMBA


@_jit(boolean(int64[::1], int64))
def _repeats(rows, num_slots):
    """Whether a slot comes twice in int64[R] rows."""
    seen = np.zeros(num_slots, np.bool_)
    for s in rows:
        if seen[s]:
            return True
        seen[s] = True
    return False


@_jit(types.void(int64[::1], POOL))
def release_copies(dsts, p):
    """The copies into `dsts` were applied: source, then destination, drop their pins."""
    for d in dsts:
        src = p.copy_src[d]
        if src:
            p.copy_src[d] = 0
            p.counts[0] += _release_one(src, False, p.nxt, p.prv, p.ref, p.group_of)
            p.counts[0] += _release_one(d, False, p.nxt, p.prv, p.ref, p.group_of)


@_jit(
    types.UniTuple(int64, 3)(
        int64[::1], int64[::1], int64[::1], boolean[::1], COUNTS, int64, int64[::1], RULES, POOL, INDEX, REQUESTS,
        int64[:, ::1],
    )
)  # fmt: skip
def allocate_checked(slots_of, new, hits, must_fit, c, max_model_len, release, r, p, index, q, copies):
    """`host_step.allocate` of a manager's call (`jaxkv.manager.KVCacheManager.allocate_slots_batch`) with its
    checks and its counts `c`: int64[R] slots, new tokens and hit tokens, bool[R] whole-request flags; the
    copies into `release` were applied first (`release_copies`). Returns (-1, 0, 0) and changes nothing where a
    row is invalid (a slot twice, a count negative or past `max_model_len`, a hit not on a request's first call
    or not below its tokens, tokens past the request's) or has a rollback pending; otherwise `allocate`'s, with
    the counts of the rows that succeed advanced."""
    num_rows = slots_of.shape[0]
    if _repeats(slots_of, c.computed.shape[0]):
        return -1, 0, 0
    for i in range(num_rows):
        s, k, h = slots_of[i], new[i], hits[i]
        n, total = c.computed[s], c.computed[s] + h + k
        bad_hit = h > 0 and (n > 0 or h >= c.tokens[s])
        if not (0 <= k <= max_model_len and 0 <= h <= max_model_len) or bad_hit or total > c.tokens[s]:
            return -1, 0, 0
        if c.pending[s]:
            return -1, 0, 0
    full, shared, prompt = np.zeros(num_rows, np.int64), np.zeros(num_rows, np.int64), np.zeros(num_rows, np.int64)
    for i in range(num_rows):
        s = slots_of[i]
        full[i] = c.tokens[s] if must_fit[i] else 0
        shared[i] = c.shared[s] if c.computed[s] == 0 else 0
        prompt[i] = c.prompt[s] if r.has_partial else 0
        c.written[s] = c.computed[s]  # the call says the rows' earlier steps ran
    release_copies(release, p)
    rows = Rows(slots_of, new, np.zeros(num_rows, np.int64), hits, full, shared, prompt)
    num_ok, num_hit, num_copies = allocate(rows, True, r, p, index, q, copies)
    for i in range(num_ok):
        s = slots_of[i]
        c.computed[s] += new[i] + hits[i]
        c.written[s] += hits[i]  # claimed hits hold cached content
    return num_ok, num_hit, num_copies


@_jit(
    types.UniTuple(int64, 2)(
        int64[::1], int64[::1], COUNTS, int64, int64[::1], int64[::1], RULES, POOL, INDEX, REQUESTS, int64[:, ::1]
    )
)
def reserve_checked(slots_of, wanted, c, max_model_len, release, reserved, r, p, index, q, copies):
    """A device loop's reservation (`jaxkv.manager.KVCacheManager.hand_over`) for int64[R] slots of decoding
    requests (one token not computed) wanting `wanted` int64[R] tokens, with the manager's counts `c`:
    `reserved` gets each row's slots (its wanted tokens, at most the tokens it may still produce, and with state
    groups at most to its state block's end: `jaxkv.manager.device_loop.reservation`), taken as lookahead slots
    by one `allocate` after `release_copies(release)`; the rows that succeed count them as pending rollback.
    Returns (rows that succeed, copies made), or (-1, 0) and changes nothing where a slot comes twice, a row is
    not decoding or has a rollback pending (the general path rolls it back first). The counts were checked."""
    num_rows = slots_of.shape[0]
    if _repeats(slots_of, c.computed.shape[0]):
        return -1, 0
    for i in range(num_rows):
        s = slots_of[i]
        if c.tokens[s] - c.computed[s] != 1 or c.pending[s] != 0:
            return -1, 0
    zeros, prompt = np.zeros(num_rows, np.int64), np.zeros(num_rows, np.int64)
    for i in range(num_rows):
        s = slots_of[i]
        reserved[i] = min(wanted[i], max_model_len - c.computed[s] - 1)
        for g in range(r.block_size.shape[0]):
            if r.kind[g] == MAMBA:
                reserved[i] = min(reserved[i], r.block_size[g] - c.computed[s] % r.block_size[g])
        prompt[i] = c.prompt[s] if r.has_partial else 0
        c.written[s] = c.computed[s]  # the rows' last steps ran: they sampled the tokens not computed
    release_copies(release, p)
    rows = Rows(slots_of, reserved, reserved, zeros, zeros, zeros, prompt)
    num_ok, _, num_copies = allocate(rows, False, r, p, index, q, copies)
    for i in range(num_ok):
        c.pending[slots_of[i]] += reserved[i]
    return num_ok, num_copies


@_jit(types.void(int64[::1], int64[::1], RULES, POOL, INDEX, REQUESTS))
def _uncache_unwritten(rows, written, r, p, index, q):
    """For each row's slot whose last step is not known to have run (`written[i]` below its computed tokens),
    the cached blocks of its attention groups from its written tokens on leave the index."""
    for i in range(rows.shape[0]):
        s = rows[i]
        if written[i] >= q.num_computed[s]:
            continue
        for g in range(r.block_size.shape[0]):
            if r.kind[g] == MAMBA:
                continue
            for j in range(written[i] // r.block_size[g], q.tables.shape[2]):
                block = q.tables[g, s, j]
                if block != 0 and p.group_of[block] >= 0:
                    uncache(block, index, p.block_slot, p.group_of)


@_jit(types.void(int64[::1], int64[::1], RULES, POOL, INDEX, REQUESTS))
def free(rows, written, r, p, index, q):
    """Releases slots `rows`' blocks, each group tail first, slot by slot. `written`: int64[R] the tokens a
    forward pass is known to have written; a slot with fewer than its computed tokens saves no state and
    indexes no prompt tail of its last step, and its attention blocks from its written tokens on leave the
    index first."""
    if r.caching:
        ran = np.empty(rows.shape[0], np.int64)
        num_ran = 0
        for i in range(rows.shape[0]):
            if written[i] >= q.num_computed[rows[i]]:
                ran[num_ran] = rows[i]
                num_ran += 1
        if r.has_state:
            for i in range(num_ran):
                cache_state_blocks(ran[i], r, p, index, q)
        if r.has_partial:
            register_tails(ran[:num_ran], False, r, p, index, q, np.empty((0, 5), np.int64))
        _uncache_unwritten(rows, written, r, p, index, q)
    p.counts[0] += free_slots(rows, q.num_computed, q.first_live, r.block_size, q.tables, p.nxt, p.prv, p.ref,
                              p.group_of)  # fmt: skip
    for s in rows:
        q.num_hashed[s] = q.shared_len[s] = q.prompt_len[s] = 0
        q.num_cached[s] = 0


@_jit(boolean(int64[::1], COUNTS, RULES, POOL, INDEX, REQUESTS))
def free_checked(rows, c, r, p, index, q):
    """A manager's free call (`jaxkv.manager.KVCacheManager.free_batch`) of int64[R] slots with its counts `c`
    (computed and tokens zeroed): `free`, what its counts say was written. False, and nothing changed, where a
    slot comes twice or has a rollback pending."""
    if _repeats(rows, c.computed.shape[0]):
        return False
    written = np.empty(rows.shape[0], np.int64)
    for i in range(rows.shape[0]):
        s = rows[i]
        if c.pending[s]:
            return False
        written[i] = min(c.written[s], c.computed[s])
    free(rows, written, r, p, index, q)
    for s in rows:
        c.computed[s] = c.tokens[s] = 0
    return True


@_jit(types.void(int64[::1], int64[::1], RULES, POOL, REQUESTS))
def roll_back(rows, rejected, r, p, q):
    """Drops slot rows[i]'s last `rejected[i]` tokens (rejected drafts, unused lookahead slots) and releases the
    entries past the tokens it keeps, tail first."""
    for i in range(rows.shape[0]):
        s, k = rows[i], rejected[i]
        if k == 0:
            continue
        n, end = q.num_computed[s] - k, q.num_computed[s]
        for g in range(r.block_size.shape[0]):
            bs = r.block_size[g]
            lo = max(q.first_live[s, g], -(-n // bs))
            p.counts[0] += release_range(q.tables, g, s, lo, -(-end // bs), -1, p.nxt, p.prv, p.ref, p.group_of)
        q.num_computed[s] = n
        q.quiet_done[s] = -1


@_jit(types.UniTuple(int64, 2)(INDEX, uint32[:, ::1], int64, int64, RULES))
def lookup_one(index, keys, num_tokens, max_hit, r):
    """The hit of a request of `num_tokens` tokens with unit keys `keys` (uint32[U, 4]), at most `max_hit`
    tokens (-1: no bound; vLLM's EAGLE rule asks again with its last block less), and its shared length."""
    bound = min(max(num_tokens - 1, 0), keys.shape[0] * r.unit)
    if max_hit >= 0:
        if max_hit == 0:
            return 0, 0
        num_tokens, bound = max_hit + 1, min(bound, max_hit)
    if r.has_partial:
        return lookup_partial(index, keys, bound, r)
    return lookup(index, r.ways, keys, num_tokens, bound, r.kind, r.block_size, r.window, r.step)


@_jit(types.UniTuple(int64, 4)(int64[::1], int64[::1], boolean, RULES, INDEX, REQUESTS, int64[::1], int64[::1]))
def lookup_rows(rows, num_tokens, drop_last_block, r, index, q, hits, shared_len):
    """`lookup_one` of each row's slot, of `num_tokens[slot]` tokens and its unit keys: row i's hit into `hits[i]`,
    its shared length into `shared_len[slot]`. `drop_last_block`: vLLM's EAGLE rule, the hit found again with at
    most its last block less. Returns the rows with a key, their tokens, their hit tokens and their shared tokens
    past the hit."""
    num_keyed = keyed_tokens = hit_tokens = miss_tokens = 0
    max_block_size = r.block_size.max()
    for i in range(rows.shape[0]):
        s = rows[i]
        n, row_keys = num_tokens[s], q.keys[s, : q.num_hashed[s]]
        hit, shared = lookup_one(index, row_keys, n, -1, r)
        shared_len[s] = shared
        if drop_last_block and hit:
            hit = lookup_one(index, row_keys, n, max(hit - max_block_size, 0), r)[0]
        hits[i] = hit
        if q.num_hashed[s]:
            num_keyed += 1
            keyed_tokens += n
            hit_tokens += hit
            miss_tokens += shared - hit
    return num_keyed, keyed_tokens, hit_tokens, miss_tokens


@_jit(int64(int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64, int64, int64[::1]))
def append_checked(rows, lengths, req_tokens, req_written, req_computed, req_hashed, unit, max_model_len, to_hash):
    """A manager's token appends (`jaxkv.manager.KVCacheManager.append_token_ids_batch`) of int64[R] slots and
    their numbers of new tokens, with its per-request counts by slot (tokens, written, computed, tokens hashed):
    the tokens count, what was computed counts as written, and the slots whose tokens now complete a hash unit
    go to `to_hash` (int64[R]) in row order. Returns how many went there, or -1 and changes nothing where a
    slot comes twice or would pass `max_model_len`."""
    if _repeats(rows, req_tokens.shape[0]):
        return -1
    for i in range(rows.shape[0]):
        if req_tokens[rows[i]] + lengths[i] > max_model_len:
            return -1
    num_to_hash = 0
    for i in range(rows.shape[0]):
        s = rows[i]
        req_tokens[s] += lengths[i]
        req_written[s] = req_computed[s]
        if req_tokens[s] // unit > req_hashed[s] // unit:
            to_hash[num_to_hash] = s
            num_to_hash += 1
    return num_to_hash


@_jit(boolean(int64[::1], int64[::1], uint32[:, ::1], REQUESTS))
def append_keys(rows, counts, new_keys, q):
    """Slot rows[i]'s next counts[i] unit keys, the next rows of `new_keys` (uint32[K, 4]), after its
    `num_hashed`; their quiet bounds are cleared. False, and nothing changed, where a slot has no room."""
    for i in range(rows.shape[0]):
        if q.num_hashed[rows[i]] + counts[i] > q.keys.shape[1]:
            return False
    k = 0
    for i in range(rows.shape[0]):
        s = rows[i]
        for u in range(q.num_hashed[s], q.num_hashed[s] + counts[i]):
            q.keys[s, u] = new_keys[k]
            k += 1
        q.num_hashed[s] += counts[i]
        q.quiet_done[s] = -1
    return True
