"""The host backend's allocation as one compiled loop, for a prefix cache whose hits end at block boundaries
and configs without state groups (no copies, no prompt-tail entries): `jaxkv.core.host.HostState.allocate`'s
outcome, block id for block id, without a numpy call per phase.

Dimensions: R rows, G groups, S slots, M table entries per request, N blocks.

The phases, in the order of `jaxkv.core.step` (each over all rows before the next):
    plan claims    rows with a hit probe the index for its blocks (a claim missing a block is refused)
    gate           vLLM's sequential outcome: each row sees the blocks the rows before it take and free;
                   the first row that does not fit, fails its whole-request gate or its claim stops the batch
    claim hits     the rows that succeed take their hit's blocks
    release        rows before the stop (and a failed one whose gate passed) release entries behind their
                   windows; a windowed group's blocks from the shared length on go to the front
    take blocks    the rows that succeed pop new blocks (popped cached blocks leave the index)
    index          one caching pass over the rows that succeed

A row within its quiet bounds (`_set_quiet`, found after each allocation that runs its phases) takes,
releases and indexes nothing: it skips every phase and only advances its count.

A manager's calls on such configs are one compiled call each, its checks and the manager's per-request
counts included: `allocate_checked`, `reserve_checked` (a device loop's slots), `free_checked`, and (for every
host config) `append_checked` with `append_keys`. Each returns a refusal and changes nothing where the call is
invalid; the manager's general path then names what is wrong.

`rules`: int64[7, G], rows block size, max blocks per request, `keep_from_idx`'s (offset, unit, scale, div)
and units per block; `windowed`: bool[G], sliding or chunked groups. A function comes before those that call
it: numba compiles each function when it is defined.
"""

from __future__ import annotations

import numpy as np

from jaxkv.core.host_index import _INDEX, _POOL, STATE, _unindex, find, index_row, uncache
from jaxkv.core.host_pool import _jit, free_slots, release_range, unlink
from jaxkv.prefix.index import FIELDS


@_jit("int64(int64, int64, int64, int64, int64)")
def _keep_from(n, offset, unit, scale, div):
    """`jaxkv.core.state.keep_from_idx` of one group."""
    return max(n + offset, 0) // unit * scale // div


@_jit("void(int64, int64[:, ::1], int64, int64[::1], int64[:, ::1], int64[:, ::1], int64[::1], int64[::1], int64[::1])")
def _set_quiet(s, rules, unit, num_computed, first_live, num_cached, num_hashed, quiet_start, quiet_done):
    """Slot s's quiet bounds after an allocation that succeeded: while its computed tokens are at most
    `quiet_start[s]` when a call starts and at most `quiet_done[s]` after it, a call takes no block (its table
    covers them), releases none (no window's start passes a live block: `keep_from_idx` inverted) and
    indexes none (every block of its hashed tokens that they fill is indexed). Keys set later clear them."""
    start = done = 1 << 62
    hashed = num_hashed[s] * unit
    for g in range(rules.shape[1]):
        bs, offset, keep_unit, scale, div = rules[0, g], rules[2, g], rules[3, g], rules[4, g], rules[5, g]
        done = min(done, -(-num_computed[s] // bs) * bs)
        if hashed // bs > num_cached[s, g]:
            done = min(done, (num_cached[s, g] + 1) * bs - 1)
        if scale > 0:  # keep_from(n) <= first_live while n is at most this
            start = min(start, (((first_live[s, g] + 1) * div - 1) // scale + 1) * keep_unit - offset - 1)
    quiet_start[s], quiet_done[s] = start, done


@_jit(
    "UniTuple(int64, 3)(int64, int64, int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], boolean,"
    " int64[::1], int64[::1], boolean[::1], int64[:, ::1], int64[:, ::1], int64[:, ::1], boolean[::1], int64, int64,"
    " int32[:, :, ::1], int64[:, ::1], int64[::1], int64[:, ::1], int64[::1], int64[::1], uint32[:, :, ::1],"
    f" int32, int64, {_INDEX}, {_POOL}, int64[::1], boolean[::1], int64[::1], int64[::1])"
)
def _apply(
    num_ok, gated, slots_of, new, lookahead, hits, shared, record_shared, n, n_eff, hit_ok, keep, need,
    rules, windowed, unit, num_free, tables, first_live, num_computed, num_cached, shared_len, num_hashed, keys,
    pass_id, ways, slots, block_slot, group_of, cached_in_pass, ref, nxt, prv, entries, quiet, quiet_start,
    quiet_done,
):  # fmt: skip
    """The phases after the gate: rows [0, num_ok) succeed, rows [0, gated) without a hit release; `quiet`
    rows only advance their counts. Each row that succeeds and is not quiet gets its quiet bounds again (a failed
    row's stay valid: its releases only raise its first live entries)."""
    num_groups = rules.shape[1]
    block_size, step = rules[0], rules[6]
    num_hit = 0
    for i in range(num_ok):  # claim hits
        if not hit_ok[i]:
            continue
        s, h = slots_of[i], n_eff[i]
        num_hit += h
        for u in range(h // unit):
            entries[u] = find(slots, ways, keys[s, u])
        for g in range(num_groups):
            first = _keep_from(h, rules[2, g], rules[3, g], rules[4, g], rules[5, g])
            for j in range(first, h // block_size[g]):
                block = slots[entries[(j + 1) * step[g] - 1], FIELDS + g]
                if ref[block] == 0:
                    unlink(nxt, prv, block)
                    num_free -= 1
                ref[block] += 1
                tables[g, s, j] = block
            first_live[s, g] = first
        num_computed[s] = h
    for i in range(gated):  # release behind the windows
        if hits[i] or quiet[i]:
            continue
        s = slots_of[i]
        for g in range(num_groups):
            if keep[i, g] > first_live[s, g]:
                evict_from = shared_len[s] // block_size[g] if windowed[g] and shared_len[s] > 0 else -1
                num_free += release_range(tables, g, s, first_live[s, g], keep[i, g], evict_from, nxt, prv, ref,
                                          group_of)  # fmt: skip
        for g in range(num_groups):
            first_live[s, g] = keep[i, g]
    for i in range(num_ok):  # take blocks
        s = slots_of[i]
        if quiet[i]:
            num_computed[s] = n_eff[i] + new[i]
            continue
        for g in range(num_groups):
            first_new = -(-n_eff[i] // block_size[g])
            for j in range(first_new, first_new + need[i, g]):
                block = nxt[0]
                unlink(nxt, prv, block)
                ref[block] = 1
                group_of[block] = -1
                if block_slot[block] >= 0:  # a popped cached block leaves the index
                    _unindex(block, slots, block_slot)
                tables[g, s, j] = block
                num_free -= 1
        num_computed[s] = n_eff[i] + new[i]
    if num_ok:  # index: one caching pass
        start, end = np.empty(num_groups, np.int64), np.empty(num_groups, np.int64)
        groups, blocks = np.empty(num_groups, np.int64), np.empty(num_groups, np.int32)  # index_row's scratch
        for i in range(num_ok):
            s = slots_of[i]
            if quiet[i]:
                continue
            done = num_computed[s]
            for g in range(num_groups):
                start[g] = n_eff[i] // block_size[g] if hit_ok[i] else num_cached[s, g]
                end[g] = min(min(num_hashed[s] * unit, done - lookahead[i]), done) // block_size[g]
            index_row(s, start, end, step, tables, keys, pass_id, ways, slots, block_slot, group_of, cached_in_pass,
                      ref, nxt, prv, groups, blocks)  # fmt: skip
            for g in range(num_groups):
                num_cached[s, g] = max(start[g], end[g])
            if record_shared and n[i] == 0:
                shared_len[s] = max(shared[i], 0)
            _set_quiet(s, rules, unit, num_computed, first_live, num_cached, num_hashed, quiet_start, quiet_done)
    return num_ok, num_hit, num_free


@_jit(
    "UniTuple(int64, 3)(int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], boolean,"
    " int64[:, ::1], boolean[::1], int64, int64,"  # rows' inputs; rules (block size .. step), windowed; unit, free
    " int32[:, :, ::1], int64[:, ::1], int64[::1], int64[:, ::1], int64[::1], int64[::1], uint32[:, :, ::1],"
    f" int32, int64, {_INDEX}, {_POOL}, int64[::1], int64[::1])"
)
def allocate(
    slots_of, new, lookahead, hits, full, shared, record_shared,
    rules, windowed, unit, num_free,
    tables, first_live, num_computed, num_cached, shared_len, num_hashed, keys,
    pass_id, ways, slots, block_slot, group_of, cached_in_pass, ref, nxt, prv, quiet_start, quiet_done,
):  # fmt: skip
    """One allocation of int64[R] rows: slot, new tokens (lookahead included), lookahead tokens, hit tokens
    (0: none), whole-request tokens (0: no gate), shared length (recorded on a request's first allocation where
    `record_shared`). `rules`: int64[7, G] (block size, max blocks, keep offset, unit, scale, div, units per
    block). `quiet_start`, `quiet_done`: int64[S] (`_set_quiet`), -1 where unknown. Returns (rows that succeed,
    hit tokens claimed, free blocks after)."""
    num_rows, num_groups = slots_of.shape[0], rules.shape[1]
    block_size, max_blocks, step = rules[0], rules[1], rules[6]
    n = np.empty(num_rows, np.int64)
    n_eff = np.empty(num_rows, np.int64)
    hit_ok = np.zeros(num_rows, np.bool_)
    cost = np.zeros(num_rows, np.int64)  # blocks the row takes: new ones and free ones its claim takes
    taken_free = np.zeros(num_rows, np.int64)
    freed = np.zeros(num_rows, np.int64)
    keep = np.empty((num_rows, num_groups), np.int64)
    need = np.empty((num_rows, num_groups), np.int64)
    quiet = np.zeros(num_rows, np.bool_)  # rows within their quiet bounds: they only advance
    claimed = np.zeros(ref.shape[0], np.bool_)  # blocks this call's claims name
    entries = np.empty(keys.shape[1], np.int64)
    for i in range(num_rows):
        s = slots_of[i]
        n[i] = n_eff[i] = num_computed[s]
        h = hits[i]
        if h == 0:
            continue
        # Plan the claim: valid where the request computed nothing, the hit is whole units and blocks of every
        # group, and each block the groups' rules need is indexed.
        valid = n[i] == 0 and h % unit == 0 and h <= num_hashed[s] * unit
        for g in range(num_groups):
            valid = valid and h % block_size[g] == 0
        if not valid:
            continue
        for u in range(h // unit):
            entries[u] = find(slots, ways, keys[s, u])
        for g in range(num_groups):
            first = _keep_from(h, rules[2, g], rules[3, g], rules[4, g], rules[5, g])
            for j in range(first, h // block_size[g]):
                e = entries[(j + 1) * step[g] - 1]
                block = slots[e, FIELDS + g] if e >= 0 else 0
                if block == 0:
                    valid = False
                else:
                    if ref[block] == 0 and not claimed[block]:
                        taken_free[i] += 1
                    claimed[block] = True  # a refused claim's blocks count as claimed too
        hit_ok[i] = valid
        if valid:
            n_eff[i] = h
    take_before, free_before = 0, num_free
    num_ok, gated = num_rows, num_rows
    for i in range(num_rows):
        s = slots_of[i]
        cost[i] = taken_free[i]
        if hits[i] == 0 and full[i] <= 0 and 0 < n[i] <= quiet_start[s] and n[i] + new[i] <= quiet_done[s]:
            quiet[i] = True  # takes and frees nothing: it fits
            continue
        full_need = 0
        for g in range(num_groups):
            bs = block_size[g]
            table_len = -(-n_eff[i] // bs)
            kept = _keep_from(n_eff[i], rules[2, g], rules[3, g], rules[4, g], rules[5, g])
            keep[i, g] = max(first_live[s, g], min(kept, table_len))
            need[i, g] = -(-(n_eff[i] + new[i]) // bs) - table_len
            cost[i] += need[i, g]
            if full[i] > 0:
                full_need += max(0, min(-(-full[i] // bs), max_blocks[g]) - table_len)
            if hits[i] == 0:  # blocks its releases free: held by it alone, claimed by no row
                for j in range(first_live[s, g], keep[i, g]):
                    block = tables[g, s, j]
                    if ref[block] == 1 and not claimed[block]:
                        freed[i] += 1
        gate = full[i] <= 0 or take_before + full_need + taken_free[i] <= free_before
        fits = take_before + cost[i] <= free_before + freed[i] and (hit_ok[i] or hits[i] == 0)
        if not (fits and gate):
            num_ok = i
            gated = i + 1 if gate else i
            break
        take_before += cost[i]
        free_before += freed[i]
    return _apply(
        num_ok, gated, slots_of, new, lookahead, hits, shared, record_shared, n, n_eff, hit_ok, keep, need,
        rules, windowed, unit, num_free, tables, first_live, num_computed, num_cached, shared_len, num_hashed, keys,
        pass_id, ways, slots, block_slot, group_of, cached_in_pass, ref, nxt, prv, entries, quiet, quiet_start,
        quiet_done,
    )  # fmt: skip


@_jit("boolean(int64[::1], int64)")
def _repeats(rows, num_slots):
    """Whether a slot comes twice in int64[R] rows."""
    seen = np.zeros(num_slots, np.bool_)
    for s in rows:
        if seen[s]:
            return True
        seen[s] = True
    return False


@_jit(
    "void(int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int32[:, :, ::1], uint32[:, ::1], int32[:],"
    " int32[:])"
)
def uncache_unwritten(rows, written, num_computed, block_size, kind, tables, slots, block_slot, group_of):
    """For each row's slot whose last step is not known to have run (`written[i]` below its computed tokens),
    the cached blocks of its attention groups from its written tokens on leave the index."""
    for i in range(rows.shape[0]):
        s = rows[i]
        if written[i] >= num_computed[s]:
            continue
        for g in range(block_size.shape[0]):
            if kind[g] == STATE:
                continue
            for j in range(written[i] // block_size[g], tables.shape[2]):
                block = tables[g, s, j]
                if block != 0 and group_of[block] >= 0:
                    uncache(block, slots, block_slot, group_of)


@_jit(
    "UniTuple(int64, 3)(int64[::1], int64[::1], int64[::1], boolean[::1], int64[::1], int64[::1], int64[::1],"
    " int64[::1], int64,"  # rows' inputs; the manager's counts (computed, written, tokens, shared length), max len
    " int64[:, ::1], boolean[::1], int64, int64,"
    " int32[:, :, ::1], int64[:, ::1], int64[::1], int64[:, ::1], int64[::1], int64[::1], uint32[:, :, ::1],"
    f" int32, int64, {_INDEX}, {_POOL}, int64[::1], int64[::1])"
)
def allocate_checked(
    slots_of, new, hits, must_fit, req_computed, req_written, req_tokens, req_shared, max_model_len,
    rules, windowed, unit, num_free,
    tables, first_live, num_computed, num_cached, shared_len, num_hashed, keys,
    pass_id, ways, slots, block_slot, group_of, cached_in_pass, ref, nxt, prv, quiet_start, quiet_done,
):  # fmt: skip
    """`allocate` of a manager's call (no speculative decoding) with its checks and its per-request counts
    (`jaxkv.manager.KVCacheManager.allocate_slots_batch`): rows of slots, new tokens, hit tokens and
    whole-request flags, counts by slot. Returns (-1, 0, num_free) and changes nothing where a row is invalid
    (a slot twice, a count negative or past `max_model_len`, a hit not on a request's first call or not below
    its tokens, tokens past the request's); otherwise `allocate`'s, with the counts of the rows that succeed
    advanced."""
    num_rows = slots_of.shape[0]
    if _repeats(slots_of, req_computed.shape[0]):
        return -1, 0, num_free
    for i in range(num_rows):
        s, k, h = slots_of[i], new[i], hits[i]
        n, total = req_computed[s], req_computed[s] + hits[i] + new[i]
        bad_hit = h > 0 and (n > 0 or h >= req_tokens[s])
        if not (0 <= k <= max_model_len and 0 <= h <= max_model_len) or bad_hit or total > req_tokens[s]:
            return -1, 0, num_free
    full, shared = np.zeros(num_rows, np.int64), np.zeros(num_rows, np.int64)
    for i in range(num_rows):
        s = slots_of[i]
        full[i] = req_tokens[s] if must_fit[i] else 0
        shared[i] = req_shared[s] if req_computed[s] == 0 else 0
        req_written[s] = req_computed[s]  # the call says the rows' earlier steps ran
    num_ok, num_hit, num_free = allocate(
        slots_of, new, np.zeros(num_rows, np.int64), hits, full, shared, True, rules, windowed, unit, num_free,
        tables, first_live, num_computed, num_cached, shared_len, num_hashed, keys,
        pass_id, ways, slots, block_slot, group_of, cached_in_pass, ref, nxt, prv, quiet_start, quiet_done,
    )  # fmt: skip
    for i in range(num_ok):
        s = slots_of[i]
        req_computed[s] += new[i] + hits[i]
        req_written[s] += hits[i]  # claimed hits hold cached content
    return num_ok, num_hit, num_free


@_jit(
    "UniTuple(int64, 2)(int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64,"
    " int64[::1],"  # rows' wanted tokens; the manager's counts (computed, written, tokens, pending), max len; out
    " int64[:, ::1], boolean[::1], int64, int64,"
    " int32[:, :, ::1], int64[:, ::1], int64[::1], int64[:, ::1], int64[::1], int64[::1], uint32[:, :, ::1],"
    f" int32, int64, {_INDEX}, {_POOL}, int64[::1], int64[::1])"
)
def reserve_checked(
    slots_of, wanted, req_computed, req_written, req_tokens, req_pending, max_model_len, reserved,
    rules, windowed, unit, num_free,
    tables, first_live, num_computed, num_cached, shared_len, num_hashed, keys,
    pass_id, ways, slots, block_slot, group_of, cached_in_pass, ref, nxt, prv, quiet_start, quiet_done,
):  # fmt: skip
    """A device loop's reservation (`jaxkv.manager.KVCacheManager.hand_over`) of int64[R] rows of decoding
    requests (one token not computed) wanting `wanted` tokens, with the manager's per-request counts by slot:
    `reserved` gets each row's slots (its wanted tokens, at most the tokens it may still produce), taken as
    lookahead slots by one `allocate`; the rows that succeed count them as pending rollback. Returns (rows that
    succeed, num_free), or (-1, num_free) and changes nothing where a slot comes twice, a row is not decoding
    or a row still has a rollback pending (the general path rolls it back first). The counts were checked."""
    num_rows = slots_of.shape[0]
    if _repeats(slots_of, req_computed.shape[0]):
        return -1, num_free
    for i in range(num_rows):
        s = slots_of[i]
        if req_tokens[s] - req_computed[s] != 1 or req_pending[s] != 0:
            return -1, num_free
    for i in range(num_rows):
        s = slots_of[i]
        reserved[i] = min(wanted[i], max_model_len - req_computed[s] - 1)
        req_written[s] = req_computed[s]  # the rows' last steps ran: they sampled the tokens not computed
    zeros = np.zeros(num_rows, np.int64)
    num_ok, _, num_free = allocate(
        slots_of, reserved, reserved, zeros, zeros, zeros, False, rules, windowed, unit, num_free,
        tables, first_live, num_computed, num_cached, shared_len, num_hashed, keys,
        pass_id, ways, slots, block_slot, group_of, cached_in_pass, ref, nxt, prv, quiet_start, quiet_done,
    )  # fmt: skip
    for i in range(num_ok):
        req_pending[slots_of[i]] += reserved[i]
    return num_ok, num_free


@_jit(
    "int64(int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64[:, ::1], int64[::1],"
    f" int64[:, ::1], int64[::1], int64[::1], int64[::1], int32[:, :, ::1], {_INDEX}, int32[:], int32[:], int32[:])"
)
def free_checked(
    rows, req_computed, req_written, req_tokens, block_size, kind, first_live, num_computed, num_cached, shared_len,
    num_hashed, prompt_len, tables, slots, block_slot, group_of, ref, nxt, prv,
):  # fmt: skip
    """A manager's free call (no speculative decoding; `jaxkv.manager.KVCacheManager.free_batch`) of int64[R]
    slots, with its per-request counts by slot (computed, written, tokens; zeroed). A slot whose last step is
    not known to have run (written below computed) first takes the blocks from its written tokens on out of the
    index (`uncache_unwritten`); then `free_slots`. Returns the blocks that became free, or -1 and changes nothing
    where a slot comes twice."""
    if _repeats(rows, req_computed.shape[0]):
        return -1
    written = np.empty(rows.shape[0], np.int64)
    for i in range(rows.shape[0]):
        written[i] = min(req_written[rows[i]], req_computed[rows[i]])
    uncache_unwritten(rows, written, num_computed, block_size, kind, tables, slots, block_slot, group_of)
    freed = free_slots(rows, num_computed, first_live, block_size, tables, nxt, prv, ref, group_of)
    for s in rows:
        num_hashed[s] = shared_len[s] = prompt_len[s] = req_computed[s] = req_tokens[s] = 0
        num_cached[s] = 0
    return freed


@_jit("int64(int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64[::1], int64, int64, int64[::1])")
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


@_jit("boolean(int64[::1], int64[::1], uint32[:, ::1], uint32[:, :, ::1], int64[::1], int64[::1])")
def append_keys(rows, counts, new_keys, keys, num_hashed, quiet_done):
    """Slot rows[i]'s next counts[i] unit keys, the next rows of `new_keys` (uint32[K, 4]), after its
    `num_hashed`; their quiet bounds are cleared. False, and nothing changed, where a slot has no room."""
    for i in range(rows.shape[0]):
        if num_hashed[rows[i]] + counts[i] > keys.shape[1]:
            return False
    k = 0
    for i in range(rows.shape[0]):
        s = rows[i]
        for u in range(num_hashed[s], num_hashed[s] + counts[i]):
            keys[s, u] = new_keys[k]
            k += 1
        num_hashed[s] += counts[i]
        quiet_done[s] = -1
    return True
