"""The host engine's allocation as one compiled (numba) call, for every config: `jaxkv.core.step`'s outcome,
block id for block id, without a numpy call per phase or a Python loop per block.

Dimensions: R rows, G groups, S slots, M table entries per request, N blocks.

The phases, in the order of `jaxkv.core.step` (each over all rows before the next):
    start          with a prefix cache: prompt lengths recorded, the states the rows' computed tokens end on
                   indexed, their prompt-tail blocks indexed (a state block's owner moves to a fresh block,
                   with a copy; `jaxkv.core.host_tails`)
    plan claims    rows with a hit probe the index for its blocks (a claim missing a block is refused); a hit
                   ending inside a block takes that block's source: shared, or copied into a fresh block where
                   the row writes it
    gate           vLLM's sequential outcome: each row sees the blocks the rows before it take and free;
                   the first row that does not fit, fails its whole-request gate or its claim stops the batch
    claim hits     the rows that succeed take their hit's blocks
    release        rows before the stop (and a failed one whose gate passed) release entries behind their
                   windows (a state group: its old block); a windowed group's blocks from the shared length on
                   go to the front
    take blocks    the rows that succeed pop new blocks (popped cached blocks leave the index); a state group
                   takes only the block of the last new token
    index          one caching pass over the rows that succeed (attention groups; states are indexed at the
                   next call's start)

Where a config has neither state groups nor hits inside blocks, a row within its quiet bounds (`_set_quiet`,
found after each allocation that runs its phases) takes, releases and indexes nothing: it skips every phase and
only advances its count.

The state comes as `jaxkv.core.host_types`' structures; a function comes before those that call it (numba
compiles each function when it is defined). The manager's calls around it are in `jaxkv.core.host_calls`.
"""

from __future__ import annotations

import numpy as np
from numba import boolean, int32, int64, types

from jaxkv.core.host_index import _unindex, find, index_row
from jaxkv.core.host_pool import _jit, release_range, unlink
from jaxkv.core.host_tails import cache_state_blocks, register_tails, uncache_filled_tails
from jaxkv.core.host_types import INDEX, POOL, REQUESTS, ROWS, RULES
from jaxkv.core.state import FULL, MAMBA
from jaxkv.prefix.index import FIELDS

_KEEP = types.UniTuple(int64[::1], 4)  # the rules' keep_offset, keep_unit, keep_scale and keep_div


@_jit(_KEEP(RULES))
def _keep_rule(r):
    return r.keep_offset, r.keep_unit, r.keep_scale, r.keep_div


@_jit(int64(int64, int64, _KEEP))
def _keep_from(n, g, keep):
    """`jaxkv.core.state.keep_from_idx` of group g (`keep`: `_keep_rule`'s, a local of the caller's loops)."""
    offset, unit, scale, div = keep
    return max(n + offset[g], 0) // unit[g] * scale[g] // div[g]


@_jit(types.void(int64, RULES, REQUESTS))
def _set_quiet(s, r, q):
    """Slot s's quiet bounds after an allocation that succeeded: while its computed tokens are at most
    `quiet_start[s]` when a call starts and at most `quiet_done[s]` after it, a call takes no block (its table
    covers them), releases none (no window's start passes a live block: `keep_from_idx` inverted) and
    indexes none (every block of its hashed tokens that they fill is indexed). Keys set later clear them."""
    start = done = 1 << 62
    hashed = q.num_hashed[s] * r.unit
    for g in range(r.block_size.shape[0]):
        bs, scale = r.block_size[g], r.keep_scale[g]
        done = min(done, -(-q.num_computed[s] // bs) * bs)
        if hashed // bs > q.num_cached[s, g]:
            done = min(done, (q.num_cached[s, g] + 1) * bs - 1)
        if scale > 0:  # keep_from(n) <= first_live while n is at most this
            first = ((q.first_live[s, g] + 1) * r.keep_div[g] - 1) // scale + 1
            start = min(start, first * r.keep_unit[g] - r.keep_offset[g] - 1)
    q.quiet_start[s], q.quiet_done[s] = start, done


@_jit(types.void(int64, int64, int64[::1], int32[::1], boolean[::1], RULES, POOL, INDEX, REQUESTS))
def _claim(s, h, entries, tail_src, cow, r, p, index, q):
    """Slot s takes its h-token hit (planned and valid): the blocks its groups keep, and where the hit ends inside
    a group's block its source `tail_src[g]` (a copy's pin where `cow[g]`, else the table entry). `entries`:
    scratch of U entries."""
    for u in range(h // r.unit):
        entries[u] = find(index, r.ways, q.keys[s, u])
    keep = _keep_rule(r)
    for g in range(r.block_size.shape[0]):
        first = _keep_from(h, g, keep)
        for j in range(first, h // r.block_size[g]):
            block = index[entries[(j + 1) * r.step[g] - 1], FIELDS + g]
            if p.ref[block] == 0:
                unlink(p.nxt, p.prv, block)
                p.counts[0] -= 1
            p.ref[block] += 1
            q.tables[g, s, j] = block
        block = tail_src[g]
        if block:
            if p.ref[block] == 0:
                unlink(p.nxt, p.prv, block)
                p.counts[0] -= 1
            p.ref[block] += 1
            if not cow[g]:
                q.tables[g, s, h // r.block_size[g]] = block
        q.first_live[s, g] = first
    q.num_computed[s] = h


@_jit(
    types.UniTuple(int64, 3)(
        int64, int64, ROWS, boolean, int64[::1], int64[::1], boolean[::1], int64[:, ::1], int64[:, ::1],
        int64[:, ::1], int32[:, ::1], boolean[:, ::1], boolean[::1], int64, RULES, POOL, INDEX, REQUESTS,
        int64[:, ::1],
    )
)  # fmt: skip
def _apply(
    num_ok, gated, rows, record_shared, n, n_eff, hit_ok, keep, need, first_new, tail_src, cow, quiet, num_copies,
    r, p, index, q, copies,
):  # fmt: skip
    """The phases after the gate: rows [0, num_ok) succeed, rows [0, gated) without a hit release; `quiet`
    rows only advance their counts. Where the config has quiet bounds (the rules' `quiet`), each row that
    succeeds and is not quiet gets its bounds again (a failed row's stay valid: its releases only raise its first
    live entries). Returns (rows that succeed, hit tokens claimed, copies in `copies`)."""
    num_groups = r.block_size.shape[0]
    slots_of, new, hits = rows.slot, rows.new, rows.hit
    # The fields the loops use, as locals: loaded once, not at each access.
    block_size, kind, tables, first_live = r.block_size, r.kind, q.tables, q.first_live
    ref, nxt, prv, group_of, block_slot = p.ref, p.nxt, p.prv, p.group_of, p.block_slot
    num_hit = 0
    entries = np.empty(q.keys.shape[1], np.int64)
    for i in range(num_ok):  # claim hits
        if hit_ok[i]:
            num_hit += n_eff[i]
            _claim(slots_of[i], n_eff[i], entries, tail_src[i], cow[i], r, p, index, q)
    for i in range(gated):  # release behind the windows
        if hits[i] or quiet[i]:
            continue
        s = slots_of[i]
        for g in range(num_groups):
            if keep[i, g] > first_live[s, g]:
                bs = block_size[g]
                evict_from = q.shared_len[s] // bs if r.windowed[g] and q.shared_len[s] > 0 else -1
                p.counts[0] += release_range(tables, g, s, first_live[s, g], keep[i, g], evict_from, nxt,
                                             prv, ref, group_of)  # fmt: skip
            first_live[s, g] = keep[i, g]
    num_free = p.counts[0]
    for i in range(num_ok):  # take blocks (a hit's copied tail block first)
        s = slots_of[i]
        if not quiet[i]:
            for g in range(num_groups):
                for j in range(first_new[i, g], first_new[i, g] + need[i, g]):
                    block = nxt[0]
                    unlink(nxt, prv, block)
                    ref[block] = 1
                    group_of[block] = -1
                    if block_slot[block] >= 0:  # a popped cached block leaves the index
                        _unindex(block, index, block_slot)
                    tables[g, s, j] = block
                    num_free -= 1
                if cow[i, g]:  # the copy's destination, pinned until the copy was applied
                    j = n_eff[i] // block_size[g]
                    dst = tables[g, s, j]
                    ref[dst] += 1
                    p.copy_src[dst] = tail_src[i, g]
                    copies[num_copies, 0], copies[num_copies, 1] = i, g
                    copies[num_copies, 2], copies[num_copies, 3] = tail_src[i, g], dst
                    copies[num_copies, 4] = n_eff[i] - j * block_size[g]
                    num_copies += 1
        q.num_computed[s] = n_eff[i] + new[i]
    p.counts[0] = num_free
    if num_ok and r.caching:  # index: one caching pass
        if r.has_partial:
            uncache_filled_tails(slots_of, num_ok, n_eff, hit_ok, rows.lookahead, r, p, index, q)
        p.counts[1] += 1
        start, end = np.empty(num_groups, np.int64), np.empty(num_groups, np.int64)
        groups, blocks = np.empty(num_groups, np.int64), np.empty(num_groups, np.int32)  # index_row's scratch
        for i in range(num_ok):
            s = slots_of[i]
            if quiet[i]:
                continue
            done = q.num_computed[s]
            for g in range(num_groups):
                start[g] = n_eff[i] // block_size[g] if hit_ok[i] else q.num_cached[s, g]
                end[g] = 0
                if kind[g] != MAMBA:
                    end[g] = min(min(q.num_hashed[s] * r.unit, done - rows.lookahead[i]), done) // block_size[g]
            index_row(s, start, end, r.step, tables, q.keys, p.counts[1], r.ways, index, block_slot, group_of,
                      p.cached_in_pass, ref, nxt, prv, groups, blocks)  # fmt: skip
            for g in range(num_groups):
                if kind[g] != MAMBA:
                    q.num_cached[s, g] = max(start[g], end[g])
            if record_shared and n[i] == 0:
                q.shared_len[s] = max(rows.shared[i], 0)
    if r.quiet:
        for i in range(num_ok):
            if not quiet[i]:
                _set_quiet(slots_of[i], r, q)
    return num_ok, num_hit, num_copies


@_jit(types.UniTuple(int64, 3)(ROWS, boolean, RULES, POOL, INDEX, REQUESTS, int64[:, ::1]))
def allocate(rows, record_shared, r, p, index, q, copies):
    """One allocation of `rows` (`jaxkv.core.host_types.Rows`); the shared lengths are recorded on a request's
    first allocation where `record_shared`. `copies`: int64[2 R G, 5] room for the block copies it makes, (row,
    group, source, destination, valid tokens), the destinations pinned (the pool's `copy_src`) until released. Returns
    (rows that succeed, hit tokens claimed, copies made)."""
    num_rows, num_groups = rows.slot.shape[0], r.block_size.shape[0]
    slots_of, new, hits, full = rows.slot, rows.new, rows.hit, rows.full
    # The fields the loops use, as locals: loaded once, not at each access.
    block_size, max_blocks, kind, partial, step = r.block_size, r.max_blocks, r.kind, r.partial, r.step
    keep_rule = _keep_rule(r)
    num_copies = 0
    if r.caching:
        for i in range(num_rows):
            if rows.prompt[i] > 0:
                q.prompt_len[slots_of[i]] = rows.prompt[i]
        if r.has_state:
            for i in range(num_rows):
                cache_state_blocks(slots_of[i], r, p, index, q)
        if r.has_partial:
            num_copies = register_tails(slots_of, True, r, p, index, q, copies)
    n = np.empty(num_rows, np.int64)
    n_eff = np.empty(num_rows, np.int64)
    hit_ok = np.zeros(num_rows, np.bool_)
    cost = np.zeros(num_rows, np.int64)  # blocks the row takes: new ones and free ones its claim takes
    taken_free = np.zeros(num_rows, np.int64)
    freed = np.zeros(num_rows, np.int64)
    keep = np.empty((num_rows, num_groups), np.int64)
    need = np.empty((num_rows, num_groups), np.int64)
    first_new = np.empty((num_rows, num_groups), np.int64)
    tail_src = np.zeros((num_rows, num_groups), np.int32)  # a hit's source block where it ends inside a block
    cow = np.zeros((num_rows, num_groups), np.bool_)  # ... copied into a fresh block: the row writes it
    quiet = np.zeros(num_rows, np.bool_)  # rows within their quiet bounds: they only advance
    claimed = np.zeros(p.ref.shape[0], np.bool_)  # blocks this call's claims name
    entries = np.empty(q.keys.shape[1], np.int64)
    for i in range(num_rows):
        s = slots_of[i]
        n[i] = n_eff[i] = q.num_computed[s]
        h = hits[i]
        if h == 0:
            continue
        # Plan the claim: valid where the request computed nothing, the hit is whole units and ends a block of
        # every group but a partial one, and each block the groups' rules need is indexed.
        valid = n[i] == 0 and h % r.unit == 0 and h <= q.num_hashed[s] * r.unit
        for g in range(num_groups):
            valid = valid and (h % block_size[g] == 0 or partial[g])
        if not valid:
            continue
        for u in range(h // r.unit):
            entries[u] = find(index, r.ways, q.keys[s, u])
        for g in range(num_groups):
            last = h // block_size[g]
            for j in range(_keep_from(h, g, keep_rule), last + (h % block_size[g] != 0)):
                e = entries[min((j + 1) * step[g], h // r.unit) - 1]
                block = index[e, FIELDS + g] if e >= 0 else 0
                if block == 0:
                    valid = False
                    continue
                if j == last:
                    tail_src[i, g] = block
                if p.ref[block] == 0 and not claimed[block]:
                    taken_free[i] += 1
                claimed[block] = True  # a refused claim's blocks count as claimed too
        hit_ok[i] = valid
        if valid:
            n_eff[i] = h
            for g in range(num_groups):
                end_of_block = (h // block_size[g] + 1) * block_size[g]
                cow[i, g] = tail_src[i, g] != 0 and (kind[g] == FULL or h + new[i] <= end_of_block)
    take_before, free_before = 0, p.counts[0]
    num_ok, gated = num_rows, num_rows
    tables, first_live, ref = q.tables, q.first_live, p.ref
    for i in range(num_rows):
        s = slots_of[i]
        cost[i] = taken_free[i]
        if (
            r.quiet
            and hits[i] == 0
            and full[i] <= 0
            and 0 < n[i] <= q.quiet_start[s]
            and n[i] + new[i] <= (q.quiet_done[s])
        ):
            quiet[i] = True  # takes and frees nothing: it fits
            continue
        full_need = 0
        for g in range(num_groups):
            bs = block_size[g]
            table_len = -(-n_eff[i] // bs)
            keep[i, g] = max(first_live[s, g], min(_keep_from(n_eff[i], g, keep_rule), table_len))
            new_len = -(-(n_eff[i] + new[i]) // bs)
            first_new[i, g] = max(table_len, new_len - 1) if kind[g] == MAMBA else table_len
            need[i, g] = new_len - first_new[i, g]
            if cow[i, g]:  # a fresh block where the hit ends, then the new ones
                j = n_eff[i] // bs
                need[i, g] += first_new[i, g] - j
                first_new[i, g] = j
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
        num_ok, gated, rows, record_shared, n, n_eff, hit_ok, keep, need, first_new, tail_src, cow, quiet, num_copies,
        r, p, index, q, copies,
    )  # fmt: skip
