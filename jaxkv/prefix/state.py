"""Prefix caching inside the manager state: unit hashes per request, hits claimed and full blocks cached
inside the jitted transitions of `jaxkv.core.state`.

Dimensions: R rows of a call, G groups, S slots, U hash units per request (`max_model_len // unit`),
M max blocks per request, K entries per loop step, P probes, X uploaded keys.

Units and keys. The host cuts a request's tokens into units of `unit` tokens
(`PrefixCacheConfig.unit`: the gcd of the groups' block sizes, or a finer
`prefix_match_unit`), hashes every full unit chained over the prefix (and the
cache salt, in the first unit: `jaxkv.prefix.hashing`) and uploads the 128-bit keys
into `req_hashes[slot]`. Block j of a group with block size b (a multiple of
the unit) holds tokens [j·b, (j + 1)·b); its key is the unit key at its end:

    unit           |u0 |u1 |u2 |u3 |u4 |u5 |u6 |u7 |        unit = 4 tokens
    group b = 8    |  block 0  |  block 1  |  block 2  ...   key of block 1 = req_hashes[slot, 3]
    group b = 16   |        block 0        |  block 1  ...   key of block 0 = req_hashes[slot, 3]

A key names the whole prefix up to the block's end, so a block cached under
(key, group) holds that group's cache of exactly that prefix.

Caching (`cache_full_blocks`): an attention block is indexed, in every
attention group (sliding-window blocks too: dense), in the transition that
schedules its last token, provided its key is known; a state (Mamba) block
is indexed once a step ended exactly at its end (`cache_state_blocks`): it
then holds the state after its last token. `num_cached_blocks[g, slot]`
remembers how far a request's attention blocks were handled.

Claims (`claim_hits`): a hit of h tokens makes each group hold, per its rule,
the table entries [keep_from(h), h / b) (full: all; sliding window: the last
cdiv(W − 1, b); chunked: the current chunk; state: the block at h), found by
probing the index with the request's own keys. A claim is valid only if every
one of them is found.

Hits that end inside a block (a unit finer than a full-attention or state group's
block: the prompt tail's partial entry, copy-on-write claims, pinned copies) are in
`jaxkv.prefix.tails`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core.pool import HASH_WORDS, NOT_CACHED, claim, first_entries, mark_cached, release, unclaim
from jaxkv.core.ranges import in_chunks, range_chunk, range_layout, run_if
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.index import DEFAULT_WAYS, IndexState, init_index, insert, probe, remove
from jaxkv.prefix.rules import HitRule

UPLOAD_WORDS = 2 + HASH_WORDS  # an uploaded key: slot, unit index, key words


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PrefixCacheConfig:
    """Static prefix-cache settings (hashable: passed to jit as static).

    unit: tokens per hash unit; divides every group's block size.
    ways: slots per index bucket.
    """

    unit: int
    ways: int = DEFAULT_WAYS

    def __post_init__(self):
        if not isinstance(self.unit, int) or self.unit <= 0:
            raise ValueError(f"unit={self.unit!r} must be a positive int (tokens per hash unit)")
        if not isinstance(self.ways, int) or self.ways <= 0:
            raise ValueError(f"ways={self.ways!r} must be a positive int")

    @classmethod
    def for_config(
        cls, cfg: KVCacheConfig, prefix_match_unit: int | None = None, ways: int = DEFAULT_WAYS
    ) -> PrefixCacheConfig:
        """The unit is `prefix_match_unit`, or the gcd of the groups' block sizes."""
        block_sizes = sorted({g.block_size for g in cfg.groups})
        unit = math.gcd(*block_sizes) if prefix_match_unit is None else prefix_match_unit
        if not isinstance(unit, int) or unit <= 0:
            raise ValueError(f"prefix_match_unit={prefix_match_unit!r} must be a positive int")
        bad = [b for b in block_sizes if b % unit]
        if bad:
            raise ValueError(
                f"prefix_match_unit={unit} must divide every group's block size; it does not divide "
                f"{bad}. Use a divisor of {math.gcd(*block_sizes)}"
            )
        return cls(unit=unit, ways=ways)

    def num_units(self, cfg: KVCacheConfig) -> int:
        """U: full units of a max_model_len-token request; at least 1 (a column no request fills, when
        max_model_len is shorter than a unit: an enlarged block can be longer than any request)."""
        return max(1, cfg.max_model_len // self.unit)


@dataclasses.dataclass(frozen=True)
class PrefixState:
    """The prefix cache's part of `ManagerState`; a pytree of arrays.

    index:             IndexState       (hash, group) -> block
    req_hashes:        uint32[S, U, 4]  each request's unit keys
    num_hashed_units:  int32[S]         units of each request whose keys are uploaded
    num_cached_blocks: int32[G, S]      attention blocks [0, this) of the request were handled
                                        (indexed, or found indexed, or gone before they could be)
    shared_len:        int32[S]         tokens of the request's prompt its full-attention groups
                                        found cached on admission: where its prefix is known to
                                        be shared (its window blocks past it are evicted first)
    prompt_len:        int32[S]         each request's prompt tokens (0: not given; `jaxkv.prefix.tails`)
    copy_src:          int32[N]         source block of the pending copy into each block (NULL_BLOCK:
                                        none); both blocks hold a reference until it is released
    num_cache_passes:  int32[]          `cache_full_blocks` calls that had blocks to index (wraps around)
    cached_in_pass:    int32[N]         the pass that indexed each block (meaningful for blocks it indexed)
    """

    index: IndexState
    req_hashes: jax.Array
    num_hashed_units: jax.Array
    num_cached_blocks: jax.Array
    shared_len: jax.Array
    prompt_len: jax.Array
    copy_src: jax.Array
    num_cache_passes: jax.Array
    cached_in_pass: jax.Array


jax.tree_util.register_dataclass(
    PrefixState, data_fields=[f.name for f in dataclasses.fields(PrefixState)], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class PrefixStats:
    """Counters of one call (int32[] each).

    num_lookups:          requests looked up
    num_lookup_tokens:    their tokens
    num_hit_tokens:       tokens of the hits found (valid for every group)
    num_reconciliation_miss_tokens: tokens the full-attention groups alone could have reused
                          beyond the hit (another group could not)
    """

    num_lookups: jax.Array
    num_lookup_tokens: jax.Array
    num_hit_tokens: jax.Array
    num_reconciliation_miss_tokens: jax.Array


jax.tree_util.register_dataclass(
    PrefixStats, data_fields=[f.name for f in dataclasses.fields(PrefixStats)], meta_fields=[]
)


def init_prefix_state(cfg: KVCacheConfig, prefix: PrefixCacheConfig, max_num_seqs: int) -> PrefixState:
    """An empty index; no request hashed."""
    num_units = prefix.num_units(cfg)
    return PrefixState(
        index=init_index(cfg.num_blocks, len(cfg.groups), num_index_entries(cfg), prefix.ways),
        req_hashes=jnp.zeros((max_num_seqs, num_units, HASH_WORDS), jnp.uint32),
        num_hashed_units=jnp.zeros(max_num_seqs, jnp.int32),
        num_cached_blocks=jnp.zeros((len(cfg.groups), max_num_seqs), jnp.int32),
        shared_len=jnp.zeros(max_num_seqs, jnp.int32),
        prompt_len=jnp.zeros(max_num_seqs, jnp.int32),
        copy_src=jnp.zeros(cfg.num_blocks, jnp.int32),
        num_cache_passes=jnp.int32(0),
        cached_in_pass=jnp.zeros(cfg.num_blocks, jnp.int32),
    )


def num_index_entries(cfg: KVCacheConfig) -> int:
    """Index entries a full pool needs: one per block-end unit, each holding the blocks that end there.

    Per token, the finest group has 1 / min(b) block ends and all groups Σ 1 / b blocks.
    """
    sizes = [g.block_size for g in cfg.groups]
    return max(1, int(cfg.num_blocks / min(sizes) / sum(1 / b for b in sizes)))


def check_prefix_config(cfg: KVCacheConfig, prefix_state: PrefixState, prefix: PrefixCacheConfig | None):
    """Trace-time check that the static config fits the state; returns the config to use."""
    prefix = prefix or PrefixCacheConfig.for_config(cfg)
    if prefix_state.req_hashes.shape[1] != prefix.num_units(cfg):
        raise ValueError(
            f"the state holds {prefix_state.req_hashes.shape[1]} units per request but {prefix} "
            f"gives {prefix.num_units(cfg)}: pass the PrefixCacheConfig the state was made with"
        )
    return prefix


def store_hashes(prefix_state: PrefixState, uploads) -> PrefixState:
    """Writes uploaded keys: `uploads` uint32[X, 6] rows (slot, unit index, key words).

    A row whose slot is out of range (padding: S) writes nothing. Keys of a request are
    uploaded in unit order: `num_hashed_units` becomes the highest unit index + 1.
    """
    num_slots, num_units = prefix_state.req_hashes.shape[:2]
    slot = uploads[:, 0].astype(jnp.int32)
    unit = uploads[:, 1].astype(jnp.int32)
    valid = (slot >= 0) & (slot < num_slots) & (unit >= 0) & (unit < num_units)
    slot = jnp.where(valid, slot, num_slots)
    return dataclasses.replace(
        prefix_state,
        req_hashes=prefix_state.req_hashes.at[slot, unit].set(uploads[:, 2:], mode="drop"),
        num_hashed_units=prefix_state.num_hashed_units.at[slot].max(unit + 1, mode="drop"),
    )


def forget_slots(prefix_state: PrefixState, scatter_slots) -> PrefixState:
    """Empties the hashes, prompt length and cache progress of `scatter_slots` int32[F] (S: padding)."""
    return dataclasses.replace(
        prefix_state,
        num_hashed_units=prefix_state.num_hashed_units.at[scatter_slots].set(0, mode="drop"),
        num_cached_blocks=prefix_state.num_cached_blocks.at[:, scatter_slots].set(0, mode="drop"),
        shared_len=prefix_state.shared_len.at[scatter_slots].set(0, mode="drop"),
        prompt_len=prefix_state.prompt_len.at[scatter_slots].set(0, mode="drop"),
    )


def _units_per_block(rules, prefix: PrefixCacheConfig) -> np.ndarray:
    """int32[G]: hash units per block of each group."""
    return (rules.block_size // prefix.unit).astype(np.int32)


def _end_units(block_start, block_count, units_per_block: np.ndarray):
    """The block-end units of blocks [start, start + count) int32[R, G], on a grid of s = gcd(units per block).

    Returns (first grid step int32[R], steps int32[R]): grid step k is unit (k + 1)·s − 1.
    Rows without blocks get 0 steps.
    """
    step = math.gcd(*units_per_block.tolist())
    has = block_count > 0
    first = jnp.where(has, (block_start + 1) * units_per_block // step - 1, np.iinfo(np.int32).max)
    last = jnp.where(has, (block_start + block_count) * units_per_block // step, 0)
    first_k = jnp.min(first, axis=1)
    return jnp.where(jnp.any(has, axis=1), first_k, 0), jnp.maximum(jnp.max(last, axis=1) - first_k, 0)


def walk_length(block_start, block_count, rules, prefix: PrefixCacheConfig):
    """int32[]: the block-end units a walk over ranges [start, start + count) int32[R, G] visits."""
    return jnp.sum(_end_units(block_start, block_count, _units_per_block(rules, prefix))[1])


def _unit_blocks(k, units_per_block: np.ndarray, block_start, block_count):
    """At grid steps k int32[K] of rows with block ranges [start, start + count) int32[K, G]:

    (unit int32[K], block_idx int32[K, G], wanted bool[K, G]: the unit ends block block_idx
    of the group, inside the range).
    """
    step = math.gcd(*units_per_block.tolist())
    unit = (k + 1) * step - 1
    ends = (unit[:, None] + 1) % units_per_block[None, :] == 0
    block_idx = (unit[:, None] + 1) // units_per_block[None, :] - 1
    wanted = ends & (block_idx >= block_start) & (block_idx < block_start + block_count)
    return unit, block_idx, wanted


def _walk_units(state, slots, block_start, block_count, rules, prefix, chunk_sizes, body, carry):
    """Runs `body(carry, in_range [K], row [K], slot [K], unit [K], block_idx [K, G], wanted [K, G], keys [K, 4])`
    over the block-end units of every row's block ranges [start, start + count) int32[R, G], in chunks."""
    units_per_block = _units_per_block(rules, prefix)
    first_k, num_k = _end_units(block_start, block_count, units_per_block)
    req_hashes = state.prefix.req_hashes  # unchanged by the walk
    num_units = req_hashes.shape[1]
    layout = range_layout(num_k, max_entries=num_k.shape[0] * num_units)

    def walk_body(size):
        def walk_chunk(chunk_idx, carry):
            in_range, row, offset = range_chunk(layout, chunk_idx, size)
            unit, block_idx, wanted = _unit_blocks(
                first_k[row] + offset, units_per_block, block_start[row], block_count[row]
            )
            slot = slots[row]
            keys = req_hashes.at[slot, jnp.clip(unit, 0, num_units - 1)].get(mode="fill", fill_value=0)
            return body(carry, in_range, row, slot, unit, block_idx, wanted & in_range[:, None], keys)

        return walk_chunk

    return in_chunks(layout[-1], chunk_sizes, walk_body, carry)


def _table_index(shape, group, slot, block_idx):
    """int32[K, G]: flat index into block_tables [G, S, M] of (group [G], slot [K], block_idx [K, G])."""
    num_groups, num_slots, max_blocks = shape
    return (group[None, :] * num_slots + slot[:, None]) * max_blocks + block_idx


def claim_hits(state, slots, start, count, *, rules, prefix: PrefixCacheConfig, chunk_sizes):
    """Claims table entries [start, start + count) int32[R, G] of rows `slots` int32[R] from the index.

    Each block-end unit of the ranges probes the index once with the request's key
    there (all groups at once); every wanted block found goes into the table and gets
    a reference (`pool.claim`). Returns (state, num_found int32[R], num_taken_free
    int32[R]: claimed blocks that were free, each counted once, at the first row that
    claims it). Rows must have empty tables.
    """
    shape = state.block_tables.shape
    num_groups, num_rows = shape[0], slots.shape[0]
    groups = np.arange(num_groups, dtype=np.int32)
    tables_size = math.prod(shape)

    def body(carry, in_range, row, slot, unit, block_idx, wanted, keys):
        state, num_found, num_taken = carry
        block = jnp.where(wanted, probe(state.prefix.index, keys, in_range), NULL_BLOCK)  # [K, G]
        found = block != NULL_BLOCK
        pool, was_free = claim(state.pool, block.reshape(-1), found.reshape(-1))
        flat = jnp.where(found, _table_index(shape, groups, slot, block_idx), tables_size)
        tables = state.block_tables.reshape(-1).at[flat.reshape(-1)].set(block.reshape(-1), mode="drop")
        row = jnp.where(in_range, row, num_rows)
        num_found = num_found.at[row].add(jnp.sum(found, axis=1, dtype=jnp.int32), mode="drop")
        num_taken = num_taken.at[row].add(jnp.sum(was_free.reshape(found.shape), axis=1, dtype=jnp.int32), mode="drop")
        return dataclasses.replace(state, pool=pool, block_tables=tables.reshape(shape)), num_found, num_taken

    zeros = jnp.zeros(num_rows, jnp.int32)
    return _walk_units(state, slots, start, count, rules, prefix, chunk_sizes, body, (state, zeros, zeros))


def _flat_first(shape, slots, start):
    """int32[Q]: the flat table index of each (row, group) range starting at `start` int32[R, G]."""
    num_groups, num_slots, max_blocks = shape
    g = jnp.arange(num_groups, dtype=jnp.int32)[None, :]
    return ((g * num_slots + slots[:, None]) * max_blocks + start).reshape(-1)


def _table_entries(layout, chunk_idx, size, first, num_groups):
    """Decodes a chunk of table ranges laid out from `first` int32[Q] (Q = R × G, row-major).

    Returns (in_range [K], row [K], flat table index [K]).
    """
    in_range, range_id, offset = range_chunk(layout, chunk_idx, size)
    return in_range, range_id // num_groups, first[range_id] + offset


def unclaim_hits(state, slots, start, count, *, chunk_sizes):
    """Undoes `claim_hits` of the ranges [start, start + count) int32[R, G] in the same transition.

    Entries holding a block drop it (`pool.unclaim`) and become NULL_BLOCK.
    """
    shape = state.block_tables.shape
    first = _flat_first(shape, slots, start)
    layout = range_layout(count.reshape(-1), max_entries=count.size * shape[2])
    tables_size = math.prod(shape)

    def unclaim_body(size):
        def unclaim_chunk(chunk_idx, state):
            in_range, _, flat = _table_entries(layout, chunk_idx, size, first, shape[0])
            idx = jnp.where(in_range, flat, tables_size)
            tables = state.block_tables.reshape(-1)
            block = tables.at[idx].get(mode="fill", fill_value=NULL_BLOCK)
            null = jnp.where(block < 0, block, NULL_BLOCK)  # depends on the read: in-place write
            return dataclasses.replace(
                state,
                pool=unclaim(state.pool, block, block != NULL_BLOCK),
                block_tables=tables.at[idx].set(null, mode="drop").reshape(shape),
            )

        return unclaim_chunk

    return in_chunks(layout[-1], chunk_sizes, unclaim_body, state)


def count_sole_holders(state, slots, start, count, *, chunk_sizes):
    """int32[R]: entries of the ranges [start, start + count) int32[R, G] holding a block with count 1.

    Read-only. Releasing such an entry surely frees its block: a lower bound of what
    the rows' releases free (exact unless two rows release one shared block).
    """
    shape = state.block_tables.shape
    num_rows = slots.shape[0]
    first = _flat_first(shape, slots, start)
    layout = range_layout(count.reshape(-1), max_entries=count.size * shape[2])
    tables_size = math.prod(shape)

    def count_body(size):
        def count_chunk(chunk_idx, num_sole):
            in_range, row, flat = _table_entries(layout, chunk_idx, size, first, shape[0])
            block = (
                state.block_tables.reshape(-1)
                .at[jnp.where(in_range, flat, tables_size)]
                .get(mode="fill", fill_value=NULL_BLOCK)
            )
            sole = (block != NULL_BLOCK) & (state.pool.ref_cnt[block] == 1)
            return num_sole.at[jnp.where(in_range, row, num_rows)].add(sole.astype(jnp.int32), mode="drop")

        return count_chunk

    return in_chunks(layout[-1], chunk_sizes, count_body, jnp.zeros(num_rows, jnp.int32))


def index_blocks(state, keys, blocks, valid):
    """Indexes `blocks` int32[K, G] under keys uint32[K, 4] where valid bool[K]; marks the placed ones cached.

    Returns (state, placed bool[K, G]).
    """
    index, placed = insert(state.prefix.index, keys, blocks, valid)
    num_groups = blocks.shape[1]
    group = jnp.broadcast_to(jnp.arange(num_groups, dtype=jnp.int32)[None, :], blocks.shape).reshape(-1)
    all_keys = jnp.broadcast_to(keys[:, None, :], blocks.shape + keys.shape[1:]).reshape(-1, HASH_WORDS)
    pool = mark_cached(state.pool, blocks.reshape(-1), all_keys, group, placed.reshape(-1))
    return dataclasses.replace(state, pool=pool, prefix=dataclasses.replace(state.prefix, index=index)), placed


def _index_blocks(state, keys, blocks, valid):
    return index_blocks(state, keys, blocks, valid)[0]


def uncache_blocks(state, blocks, valid):
    """Takes the cached `blocks` int32[F] (valid bool[F]; repeats allowed) out of the index, uncached:
    held ones stay with their holders (once released they go to the head of the free order), free
    ones go to the head now (reused first).

    One entry per block: `pool.first_entries`.
    """
    block_group, first = first_entries(state.pool.block_group, blocks, valid, NOT_CACHED)
    free = first & (state.pool.ref_cnt[jnp.where(valid, blocks, NULL_BLOCK)] == 0)
    pool, _ = claim(dataclasses.replace(state.pool, block_group=block_group), blocks, free)  # out of the order
    return dataclasses.replace(
        state,
        pool=release(pool, blocks, free),  # uncached now: pushed at the head
        prefix=dataclasses.replace(state.prefix, index=remove(state.prefix.index, blocks, first)),
    )


def cache_full_blocks(state, slots, start, count, *, rules, prefix: PrefixCacheConfig, chunk_sizes):
    """Indexes the attention blocks at table entries [start, start + count) int32[R, G] of `slots` [R].

    One index entry per block-end unit, holding every group's block that ends there.
    NULL entries (released before they could be cached) are skipped. Where the key and
    group are indexed already under another block, the newer copy (the request's block,
    just computed) takes the entry, unless this pass indexed the old one (within a pass
    the first row wins): a free old copy goes to the head of the free order uncached, a
    held one stays with its holders, uncached (to the head once released).

    Why the newer copy: requests that recompute a cached block (their hit stopped before
    it) hold copies of it. The index can name one; if it names the old one, its holders
    release it first, it is evicted, and the hit is gone while an identical copy is still
    held (under memory pressure: a window group's run at a shared prefix, every sibling
    after missing it). The newest copy is held longest.
    """
    shape = state.block_tables.shape
    groups = np.arange(shape[0], dtype=np.int32)
    tables_size = math.prod(shape)
    num_blocks = state.pool.ref_cnt.shape[0]
    this_pass = state.prefix.num_cache_passes + jnp.any(count > 0)  # a pass that indexes nothing is not counted
    state = dataclasses.replace(state, prefix=dataclasses.replace(state.prefix, num_cache_passes=this_pass))

    def body(state, in_range, row, slot, unit, block_idx, wanted, keys):
        flat = jnp.where(wanted, _table_index(shape, groups, slot, block_idx), tables_size)
        blocks = state.block_tables.reshape(-1).at[flat].get(mode="fill", fill_value=NULL_BLOCK)  # [K, G]
        indexed = probe(state.prefix.index, keys, in_range)
        old = ((blocks != NULL_BLOCK) & (indexed != NULL_BLOCK) & (indexed != blocks)).reshape(-1)
        indexed = indexed.reshape(-1)
        old = old & (state.prefix.cached_in_pass[indexed] != this_pass)  # (blocks this pass indexed are held)
        state = run_if(jnp.any(old), lambda state: uncache_blocks(state, indexed, old), state)
        state, placed = index_blocks(state, keys, blocks, in_range)
        stamped = jnp.where(placed, blocks, num_blocks).reshape(-1)
        return dataclasses.replace(
            state,
            prefix=dataclasses.replace(
                state.prefix, cached_in_pass=(state.prefix.cached_in_pass.at[stamped].set(this_pass, mode="drop"))
            ),
        )

    return _walk_units(state, slots, start, count, rules, prefix, chunk_sizes, body, state)


def cache_state_blocks(state, slots, num_computed, *, state_groups: tuple[int, ...], rules, prefix: PrefixCacheConfig):
    """Indexes the blocks of the state groups `state_groups` (static) whose rows' last step ended at a block end.

    slots: int32[R] (S: padding); num_computed: int32[R] tokens the rows' finished steps
    computed. A state group's block at index n / b − 1 then holds the state after n
    tokens (n a multiple of b): the step wrote it, so a later call may hand it out.
    """
    if not state_groups:
        return state
    num_groups, num_slots, max_blocks = state.block_tables.shape
    is_state = np.isin(np.arange(num_groups), state_groups)
    n = num_computed[:, None]
    block_idx = n // rules.block_size[None, :] - 1  # [R, G]
    in_slot = (slots >= 0) & (slots < num_slots)
    safe_slot = jnp.where(in_slot, slots, 0)
    block = state.block_tables[
        np.arange(num_groups)[None, :], safe_slot[:, None], jnp.clip(block_idx, 0, max_blocks - 1)
    ]
    hashed = state.prefix.num_hashed_units[safe_slot] * prefix.unit >= n[:, 0]
    wanted = is_state[None, :] & (n > 0) & (n % rules.block_size[None, :] == 0) & (block != NULL_BLOCK)
    wanted &= state.pool.block_group[block] == NOT_CACHED
    num_units = state.prefix.req_hashes.shape[1]
    keys = state.prefix.req_hashes[safe_slot, jnp.clip(n[:, 0] // prefix.unit - 1, 0, num_units - 1)]
    return _index_blocks(state, keys, jnp.where(wanted, block, NULL_BLOCK), in_slot & hashed & (n[:, 0] > 0))


def hit_rules(cfg: KVCacheConfig) -> tuple[HitRule, ...]:
    """Each group's hit rule, at its own block size."""
    return tuple(HitRule.for_spec(g.spec) for g in cfg.groups)


def partial_groups(cfg: KVCacheConfig, prefix: PrefixCacheConfig) -> tuple[int, ...]:
    """The groups where a hit may end inside a block (static): full-attention and state groups whose
    block is larger than the unit (see `jaxkv.prefix.tails`)."""
    return tuple(
        g for g, group in enumerate(cfg.groups) if group.kind in ("full", "mamba") and group.block_size > prefix.unit
    )
