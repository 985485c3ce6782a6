"""Debug invariant checker for ManagerState (DESIGN.md invariants 1 and 2, the table shape rules, and
the prefix-cache index).

Runs on the host (numpy) after any transition; tests call it after every step,
and `KVCacheManager(..., debug_checks=True)` after every call. Invariant 5
(a failed allocation changes nothing) is a property of two states and is
checked by the tests against the reference model.

Dimensions: G groups, S slots, M max blocks per request, N blocks, C ring capacity.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxkv.core.pool import NOT_CACHED, PoolState
from jaxkv.core.state import MAMBA, ManagerState, group_rules
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK, cdiv
from jaxkv.prefix.index import check_index
from jaxkv.prefix.state import PrefixCacheConfig, check_prefix_config


class InvariantError(AssertionError):
    """A ManagerState broke an invariant: a bug in a transition, never bad user input."""


def _require(condition: bool, message: str | Callable[[], str]) -> None:
    """`message`: the text, or a function giving it (messages that print arrays are built only on failure)."""
    if not condition:
        raise InvariantError(message() if callable(message) else message)


def check_pool(pool: PoolState) -> np.ndarray:
    """Checks the free order alone: each free block has exactly one valid entry, nothing else has one.

    Returns the free blocks in id order.
    """
    pool = jax.device_get(pool)
    ref_cnt = np.asarray(pool.ref_cnt)
    num_blocks = ref_cnt.shape[0]
    _require(ref_cnt[NULL_BLOCK] == 0, f"the null block has reference count {ref_cnt[NULL_BLOCK]}")
    _require((ref_cnt >= 0).all(), lambda: f"negative reference counts at blocks {np.flatnonzero(ref_cnt < 0)[:8]}")
    capacity = pool.free_ring.shape[0]
    head, count = int(pool.ring_head), int(pool.ring_count)
    _require(0 <= head < capacity and 0 <= count <= capacity, f"ring head {head} / count {count} out of range")
    pos = (head + np.arange(count)) % capacity
    block = pool.free_ring[pos]
    _require(((block > NULL_BLOCK) & (block < num_blocks)).all(), "a ring entry is not a usable block id")
    valid = (pool.queue_pos[block] == pos) & (ref_cnt[block] == 0)
    in_order = block[valid]
    free = np.flatnonzero(ref_cnt == 0)
    free = free[free != NULL_BLOCK]
    _require(len(in_order) == len(set(in_order.tolist())), "a block has two valid entries in the free order")
    _require(
        set(in_order.tolist()) == set(free.tolist()),
        lambda: f"free blocks missing from the free order: {sorted(set(free.tolist()) - set(in_order.tolist()))[:8]}",
    )
    _require(
        int(pool.num_free_blocks) == len(free),
        f"num_free_blocks is {int(pool.num_free_blocks)} but {len(free)} blocks have reference count 0",
    )
    group = np.asarray(pool.block_group)
    _require(((group == NOT_CACHED) | (group >= 0)).all(), "block_group below -1")
    return free


def check_invariants(cfg: KVCacheConfig, state: ManagerState, prefix: PrefixCacheConfig | None = None) -> None:
    """Raises InvariantError naming the first broken invariant (`prefix`: the state's prefix-cache
    config, default `PrefixCacheConfig.for_config(cfg)`)."""
    state = jax.device_get(state)
    pool = state.pool
    rules = group_rules(cfg)
    tables = np.asarray(state.block_tables)  # [G, S, M]
    num_groups, num_slots, max_blocks = tables.shape
    num_blocks = cfg.num_blocks
    ref_cnt = np.asarray(pool.ref_cnt)
    _require(ref_cnt.shape == (num_blocks,), f"ref_cnt has shape {ref_cnt.shape}, expected ({num_blocks},)")
    _require(((tables >= 0) & (tables < num_blocks)).all(), "a table entry is outside [0, num_blocks)")

    # Table shape per slot and group: NULL below first_live_idx and from the table length on.
    num_computed = np.asarray(state.num_computed)
    first_live = np.asarray(state.first_live_idx)
    _require(
        (num_computed >= 0).all() and (num_computed <= cfg.max_model_len).all(),
        lambda: f"num_computed out of [0, max_model_len]: {num_computed}",
    )
    idx = np.arange(max_blocks)
    for g in range(num_groups):
        bs = int(rules.block_size[g])
        for s in range(num_slots):
            n, row, live = int(num_computed[s]), tables[g, s], int(first_live[g, s])
            table_len = cdiv(n, bs)
            if n == 0:
                if row.any() or live != 0:
                    raise InvariantError(f"empty slot {s} holds blocks in group {g}: {row[row != 0]}")
                continue
            _require(
                (row[idx >= table_len] == NULL_BLOCK).all(),
                f"slot {s} group {g}: blocks past the table length {table_len}",
            )
            _require((row[:live] == NULL_BLOCK).all(), f"slot {s} group {g}: blocks below first_live_idx {live}")
            if rules.kind[g] == MAMBA:
                held = set(np.flatnonzero(row).tolist())
                _require(
                    table_len - 1 in held and held <= {live, table_len - 1},
                    f"slot {s} state group {g}: holds indices {sorted(held)}, "
                    f"expected the last ({table_len - 1}) and at most first_live_idx ({live})",
                )
            else:
                _require(
                    (row[live:table_len] != NULL_BLOCK).all(),
                    f"slot {s} group {g}: a NULL_BLOCK inside the live range [{live}, {table_len})",
                )

    # Invariant 1: reference counts equal the live table entries holding each block, plus one per
    # pending copy naming it (source or destination: `jaxkv.prefix.tails`).
    counts = np.bincount(tables.reshape(-1), minlength=num_blocks)
    if state.prefix is not None:
        copy_src = np.asarray(state.prefix.copy_src)
        dst = np.flatnonzero(copy_src)
        _require(((copy_src >= 0) & (copy_src < num_blocks)).all(), "a copy source is outside the pool")
        counts += np.bincount(np.concatenate([dst, copy_src[dst]]), minlength=num_blocks)
    counts[NULL_BLOCK] = 0
    bad = np.flatnonzero(counts != ref_cnt)
    _require(
        bad.size == 0,
        lambda: (
            f"blocks {bad[:8]} have ref_cnt {ref_cnt[bad[:8]]} but {counts[bad[:8]]} table entries and pending copies"
        ),
    )

    free = check_pool(pool)

    # Invariant 2: num_free_blocks + distinct blocks in live tables (or pinned by a copy) == num_blocks − 1.
    num_free = int(pool.num_free_blocks)
    num_used = int((counts > 0).sum())
    _require(
        num_free + num_used == num_blocks - 1,
        f"num_free_blocks {num_free}, free blocks {len(free)}, blocks in tables or pinned {num_used}, "
        f"num_blocks − 1 = {num_blocks - 1}",
    )

    _require((np.asarray(pool.block_group) < num_groups).all(), "block_group names a group that does not exist")
    if state.prefix is not None:
        _check_prefix(state, rules, check_prefix_config(cfg, state.prefix, prefix).unit)


def _check_prefix(state: ManagerState, rules, unit: int) -> None:
    """The index against the pool and the tables.

    Every entry points to a block cached (pool.block_group / block_hash) under that key and
    group, and every cached block has an entry; a cached block in a live table sits where
    the request's own key names it (no block in use is findable under a different hash): at
    its block end, with all its tokens scheduled, or (a partial entry, `jaxkv.prefix.tails`)
    at a unit boundary inside it that the request has scheduled; cache progress stays within
    the scheduled blocks.
    """
    prefix, pool = state.prefix, state.pool
    try:
        by_block = check_index(prefix.index)
    except AssertionError as e:
        raise InvariantError(f"prefix-cache index: {e}") from None
    group = np.asarray(pool.block_group)
    block_hash = np.asarray(pool.block_hash)
    cached = set(np.flatnonzero(group != NOT_CACHED).tolist())
    _require(
        cached == set(by_block),
        lambda: (
            f"cached blocks without an index entry: {sorted(cached - set(by_block))[:8]}, "
            f"indexed blocks not marked cached: {sorted(set(by_block) - cached)[:8]}"
        ),
    )
    for block, (key, g) in by_block.items():
        if group[block] != g or tuple(block_hash[block].tolist()) != key:
            raise InvariantError(
                f"block {block} is indexed under group {g} key {key}, the pool says group {group[block]} "
                f"key {tuple(block_hash[block].tolist())}"
            )
    tables = np.asarray(state.block_tables)
    num_computed = np.asarray(state.num_computed)
    req_hashes = np.asarray(prefix.req_hashes)
    num_hashed = np.asarray(prefix.num_hashed_units)
    num_cached = np.asarray(prefix.num_cached_blocks)
    for g in range(tables.shape[0]):
        bs = int(rules.block_size[g])
        for s in np.flatnonzero(num_computed).tolist():
            n = int(num_computed[s])
            _require(
                num_cached[g, s] <= n // bs,
                f"slot {s} group {g}: cache progress {num_cached[g, s]} past its {n // bs} full blocks",
            )
            for j in np.flatnonzero(tables[g, s]).tolist():
                block = int(tables[g, s, j])
                if group[block] == NOT_CACHED:
                    continue
                _require(group[block] == g, f"slot {s} group {g} holds block {block}, cached for group {group[block]}")
                key_units = range(j * bs // unit, min((j + 1) * bs // unit, n // unit, int(num_hashed[s])))
                keys = [tuple(req_hashes[s, k].tolist()) for k in key_units]
                if (j + 1) * bs <= n and (j + 1) * bs // unit - 1 >= num_hashed[s]:
                    continue  # the block-end key is not uploaded: nothing to compare with
                _require(
                    by_block[block][0] in keys,
                    f"slot {s} group {g} holds block {block} at index {j}, cached under a key that is not "
                    f"one of its scheduled unit boundaries",
                )
