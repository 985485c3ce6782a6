"""Conversion between the jitted `ManagerState` and a host object holding the same state in plain Python.

Dimensions: G groups, S slots (`max_num_seqs`), M max blocks per request, N blocks, C ring capacity (2 × N),
B index buckets, W ways per bucket, U hash units per request.

The host object (duck-typed; `jaxkv.core.host.HostState`) is `tests/model_reference.py`'s `ModelState` with
faster structures:

    attribute     host                                  ManagerState
    ref           int32[N]                              pool.ref_cnt
    free_order()  list[int], first popped first         `pool.free_order` (set by `set_free_order`)
    num_free      int                                   pool.num_free_blocks
    group_of      int32[N] (−1: not cached)             pool.block_group
    tables        int32[G, S, M]                        block_tables
    first_live    int64[S, G]                           first_live_idx [G, S]
    num_computed  int64[S]                              num_computed
  with a prefix cache (`prefix` not None):
    key_of        list[int] N, 128-bit keys             pool.block_hash rows (where cached)
    index         dict key -> G block ids (0: none)     prefix.index entries
    num_buckets, ways                                   prefix.index.slots shape [B, W, ...]
    hashes        S lists of keys                       prefix.req_hashes[s, :num_hashed_units[s]]
    num_cached    int64[S, G]                           prefix.num_cached_blocks [G, S]
    shared_len, prompt_len  int64[S]                    prefix.shared_len, prefix.prompt_len
    copies        dict destination -> source            prefix.copy_src

A key is the int `w0 | w1 << 32 | w2 << 64 | w3 << 96` of its four uint32 words; its bucket is `key & (B − 1)`.
Host objects also carry `cfg`, `prefix` (a PrefixCacheConfig or None) and `max_num_seqs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core.host import ints_to_keys, keys_to_ints
from jaxkv.core.pool import HASH_WORDS, NOT_CACHED, PoolState, free_order
from jaxkv.core.state import ManagerState, max_blocks_per_request
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.index import COUNT_WORD, FIELDS, NOT_INDEXED, IndexState
from jaxkv.prefix.state import PrefixState


def _shape(cfg, max_num_seqs: int) -> tuple[int, int, int]:
    return len(cfg.groups), max_num_seqs, max_blocks_per_request(cfg)


def to_state(host) -> ManagerState:
    """The ManagerState of a host object, as the jitted transitions would hold it between calls.

    Free order at ring positions 0.. with ring_head 0 and no stale entries; `queue_pos` is each free block's
    position and −1 for the others (as `init_pool` gives the null block: it matches no ring position). Index
    entries take the first ways of their buckets, in the host dict's order. No block counts as indexed by
    the current caching pass (`num_cache_passes` 0, `cached_in_pass` 0: the next pass is 1). Raises
    ValueError where the host's shapes disagree with its config or a bucket holds more than W entries.
    """
    cfg, prefix = host.cfg, host.prefix
    num_blocks = cfg.num_blocks
    shape = _shape(cfg, host.max_num_seqs)
    num_groups, num_slots, _ = shape
    tables = np.asarray(host.tables, np.int32)
    if tables.shape != shape:
        raise ValueError(f"host tables have shape {tables.shape}; the config and max_num_seqs give {shape}")
    order = np.asarray(host.free_order(), np.int32)
    num_free = len(order)
    ring = np.zeros(2 * num_blocks, np.int32)
    ring[:num_free] = order
    queue_pos = np.full(num_blocks, -1, np.int32)
    queue_pos[order] = np.arange(num_free, dtype=np.int32)
    block_group = np.asarray(host.group_of, np.int32)
    block_hash = np.zeros((num_blocks, HASH_WORDS), np.uint32)
    if prefix is not None:
        cached = np.flatnonzero(block_group != NOT_CACHED)
        block_hash[cached] = ints_to_keys(host.key_of[b] for b in cached.tolist())
    pool = PoolState(
        ref_cnt=np.asarray(host.ref, np.int32),
        free_ring=ring,
        queue_pos=queue_pos,
        ring_head=np.int32(0),
        ring_count=np.int32(num_free),
        num_free_blocks=np.int32(num_free),
        block_hash=block_hash,
        block_group=block_group,
    )
    state = ManagerState(
        pool=pool,
        block_tables=tables,
        first_live_idx=np.asarray(host.first_live, np.int32).reshape(num_slots, num_groups).T,
        num_computed=np.asarray(host.num_computed, np.int32),
        prefix=None if prefix is None else _prefix_state(host, shape),
    )
    return jax.tree_util.tree_map(jnp.asarray, state)


def _prefix_state(host, shape) -> PrefixState:
    cfg, prefix = host.cfg, host.prefix
    num_groups, num_slots, _ = shape
    num_blocks = cfg.num_blocks
    num_units = prefix.num_units(cfg)
    req_hashes = np.zeros((num_slots, num_units, HASH_WORDS), np.uint32)
    num_hashed = np.zeros(num_slots, np.int32)
    for slot, keys in enumerate(host.hashes):
        if len(keys) > num_units:
            raise ValueError(f"slot {slot} has {len(keys)} unit keys; the state holds {num_units} per slot")
        req_hashes[slot, : len(keys)] = ints_to_keys(keys)
        num_hashed[slot] = len(keys)
    copy_src = np.zeros(num_blocks, np.int32)
    for dst, src in host.copies.items():
        copy_src[dst] = src
    return PrefixState(
        index=_index_state(host.index, host.num_buckets, host.ways, num_groups, num_blocks),
        req_hashes=req_hashes,
        num_hashed_units=num_hashed,
        num_cached_blocks=np.asarray(host.num_cached, np.int32).reshape(num_slots, num_groups).T,
        shared_len=np.asarray(host.shared_len, np.int32),
        prompt_len=np.asarray(host.prompt_len, np.int32),
        copy_src=copy_src,
        num_cache_passes=np.int32(0),
        cached_in_pass=np.zeros(num_blocks, np.int32),
    )


def _index_state(index: dict, num_buckets: int, ways: int, num_groups: int, num_blocks: int) -> IndexState:
    """The IndexState of {key: G block ids}: entry i of a bucket in way i, `block_slot` at each field."""
    slots = np.zeros((num_buckets, ways, FIELDS + num_groups), np.uint32)
    block_slot = np.full(num_blocks, NOT_INDEXED, np.int32)
    entries = [(key, fields) for key, fields in index.items() if any(fields)]  # an empty entry is no entry
    if entries:
        words = ints_to_keys(key for key, _ in entries)
        fields = np.asarray([f for _, f in entries], np.int64).reshape(len(entries), num_groups)
        bucket = (words[:, 0] & np.uint32(num_buckets - 1)).astype(np.int64)
        by_bucket = np.argsort(bucket, kind="stable")
        way = np.empty(len(entries), np.int64)
        sorted_bucket = bucket[by_bucket]
        way[by_bucket] = np.arange(len(entries)) - np.searchsorted(sorted_bucket, sorted_bucket, side="left")
        if way.max() >= ways:
            full = int(bucket[np.argmax(way)])
            raise ValueError(f"index bucket {full} holds {int(way.max()) + 1} entries, more than {ways=}")
        slots[bucket, way, :HASH_WORDS] = words
        slots[bucket, way, COUNT_WORD] = np.count_nonzero(fields, axis=1)
        slots[bucket, way, FIELDS:] = fields
        field_id = (bucket * ways + way)[:, None] * num_groups + np.arange(num_groups)[None, :]
        held = fields != NULL_BLOCK
        block_slot[fields[held]] = field_id[held]
    return IndexState(slots=slots, block_slot=block_slot)


def load_state(host, state: ManagerState) -> None:
    """Fills the host object's state attributes from `state` (device or host arrays); one transfer.

    `host.cfg`, `host.prefix` and `host.max_num_seqs` must describe `state` (ValueError otherwise). The free
    order is linked as the ring holds it. `key_of` is 0 where a block is not cached.
    """
    cfg = host.cfg
    shape = _shape(cfg, host.max_num_seqs)
    if tuple(state.block_tables.shape) != shape:
        raise ValueError(
            f"the state's block tables have shape {tuple(state.block_tables.shape)}; the host's config and "
            f"max_num_seqs={host.max_num_seqs} give {shape}"
        )
    if (state.prefix is None) != (host.prefix is None):
        raise ValueError(
            f"the state {'has no' if state.prefix is None else 'has a'} prefix cache, host.prefix is {host.prefix}"
        )
    state = jax.device_get(state)
    pool = state.pool
    block_group = np.asarray(pool.block_group)
    host.ref = np.array(pool.ref_cnt, np.int32)
    host.group_of = np.array(block_group, np.int32)
    host.set_free_order(free_order(pool))
    host.tables = np.array(state.block_tables, np.int32)
    host.first_live = np.asarray(state.first_live_idx, np.int64).T.copy()
    host.num_computed = np.asarray(state.num_computed, np.int64).copy()
    if state.prefix is None:
        return
    prefix = state.prefix
    key_of = [0] * cfg.num_blocks
    cached = np.flatnonzero(block_group != NOT_CACHED)
    for block, key in zip(cached.tolist(), keys_to_ints(np.asarray(pool.block_hash)[cached])):
        key_of[block] = key
    host.key_of = key_of
    slots = np.asarray(prefix.index.slots)
    host.num_buckets, host.ways = slots.shape[:2]
    rows = slots.reshape(-1, slots.shape[-1])
    rows = rows[rows[:, COUNT_WORD] != 0]
    host.index = dict(zip(keys_to_ints(rows[:, :HASH_WORDS]), rows[:, FIELDS:].astype(np.int64).tolist()))
    req_hashes = np.asarray(prefix.req_hashes)
    num_hashed = np.asarray(prefix.num_hashed_units).tolist()
    host.hashes = [keys_to_ints(req_hashes[slot, :n]) for slot, n in enumerate(num_hashed)]
    host.num_cached = np.asarray(prefix.num_cached_blocks, np.int64).T.copy()
    host.shared_len = np.asarray(prefix.shared_len, np.int64).copy()
    host.prompt_len = np.asarray(prefix.prompt_len, np.int64).copy()
    copy_src = np.asarray(prefix.copy_src)
    host.copies = {dst: int(copy_src[dst]) for dst in np.flatnonzero(copy_src).tolist()}
