"""Conversion between the jitted `ManagerState` and a host object holding the same state in plain Python.

Dimensions: G groups, S slots (`max_num_seqs`), M max blocks per request, N blocks, C ring capacity (2 × N),
B index buckets, W ways per bucket, U hash units per request.

The host object (duck-typed; `jaxkv.core.host.HostState`) holds the same arrays, or faster structures:

    attribute     host                                  ManagerState
    ref           int32[N]                              pool.ref_cnt
    free_order()  list[int], first popped first         `pool.free_order` (set by `set_free_order`)
    num_free      int                                   pool.num_free_blocks
    group_of      int32[N] (−1: not cached)             pool.block_group
    tables        int32[G, S, M]                        block_tables
    first_live    int64[S, G]                           first_live_idx [G, S]
    num_computed  int64[S]                              num_computed
  with a prefix cache (`prefix` not None):
    slots         uint32[B × W, FIELDS + G]             prefix.index.slots; the cached blocks' pool.block_hash
    block_slot    int32[N]                              prefix.index.block_slot
    num_buckets, ways                                   prefix.index.slots shape [B, W, ...]
    keys          uint32[S, U, 4]                       prefix.req_hashes
    num_hashed    int64[S]                              prefix.num_hashed_units
    num_cached    int64[S, G]                           prefix.num_cached_blocks [G, S]
    shared_len, prompt_len  int64[S]                    prefix.shared_len, prefix.prompt_len
    copies        dict destination -> source            prefix.copy_src

Host objects also carry `cfg`, `prefix` (a PrefixCacheConfig or None) and `max_num_seqs`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core.pool import HASH_WORDS, NOT_CACHED, PoolState, free_order
from jaxkv.core.state import ManagerState, max_blocks_per_request
from jaxkv.prefix.index import IndexState
from jaxkv.prefix.state import PrefixState


def _shape(cfg, max_num_seqs: int) -> tuple[int, int, int]:
    return len(cfg.groups), max_num_seqs, max_blocks_per_request(cfg)


def to_state(host) -> ManagerState:
    """The ManagerState of a host object, as the jitted transitions would hold it between calls.

    Free order at ring positions 0.. with ring_head 0 and no stale entries; `queue_pos` is each free block's
    position and −1 for the others (as `init_pool` gives the null block: it matches no ring position). No
    block counts as indexed by the current caching pass (`num_cache_passes` 0, `cached_in_pass` 0: the next
    pass is 1). Raises ValueError where the host's shapes disagree with its config.
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
        block_hash[cached] = host.slots[host.block_slot[cached] // num_groups, :HASH_WORDS]
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
    num_groups, num_slots, _ = shape
    num_blocks = host.cfg.num_blocks
    copy_src = np.zeros(num_blocks, np.int32)
    for dst, src in host.copies.items():
        copy_src[dst] = src
    return PrefixState(
        index=IndexState(
            slots=host.slots.reshape(host.num_buckets, host.ways, -1).copy(), block_slot=host.block_slot.copy()
        ),
        req_hashes=host.keys.copy(),
        num_hashed_units=np.asarray(host.num_hashed, np.int32),
        num_cached_blocks=np.asarray(host.num_cached, np.int32).reshape(num_slots, num_groups).T,
        shared_len=np.asarray(host.shared_len, np.int32),
        prompt_len=np.asarray(host.prompt_len, np.int32),
        copy_src=copy_src,
        num_cache_passes=np.int32(0),
        cached_in_pass=np.zeros(num_blocks, np.int32),
    )


def load_state(host, state: ManagerState) -> None:
    """Fills the host object's state arrays in place from `state` (device or host arrays); one transfer.

    `host.cfg`, `host.prefix` and `host.max_num_seqs` must describe `state` (ValueError otherwise). The free
    order is linked as the ring holds it.
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
    host.ref[:] = pool.ref_cnt
    host.group_of[:] = block_group
    host.set_free_order(free_order(pool))
    host.tables[:] = state.block_tables
    host.first_live[:] = np.asarray(state.first_live_idx).T
    host.num_computed[:] = state.num_computed
    if state.prefix is None:
        return
    prefix = state.prefix
    host.quiet_done[:] = -1  # found again by each slot's next allocation
    slots = np.asarray(prefix.index.slots)
    if slots.shape[:2] != (host.num_buckets, host.ways):
        raise ValueError(
            f"the state's index has {slots.shape[0]} buckets of {slots.shape[1]} ways; the host's has "
            f"{host.num_buckets} of {host.ways}"
        )
    host.slots[:] = slots.reshape(-1, slots.shape[-1])
    host.block_slot[:] = prefix.index.block_slot
    host.keys[:] = prefix.req_hashes
    host.num_hashed[:] = prefix.num_hashed_units
    host.num_cached[:] = np.asarray(prefix.num_cached_blocks).T
    host.shared_len[:] = prefix.shared_len
    host.prompt_len[:] = prefix.prompt_len
    copy_src = np.asarray(prefix.copy_src)
    host.copies = {dst: int(copy_src[dst]) for dst in np.flatnonzero(copy_src).tolist()}
