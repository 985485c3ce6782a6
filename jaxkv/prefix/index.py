"""The prefix-cache index: (128-bit block hash, KV cache group) -> block id, held as arrays.

Dimensions: B buckets, W ways per bucket, G groups, N blocks, E entries
inserted in one call, P keys probed in one call.

A bucketized hash table keyed by the 128-bit hash alone. The entry of a key
holds one block field per KV cache group (a key names a token prefix; each
group may cache its own block for it), so one probe answers for every group:

    word    0 1 2 3          4                  5 ... 5 + G − 1
            key (128 bits)   blocks it holds    block of group 0 ... G − 1 (NULL_BLOCK: none)
                             (0: empty way)

(key, g) -> block is exactly the entry's field g. An entry lives in bucket
`key[0] mod B` (keys are SHA-256 prefixes: uniform) and is found by comparing
all four key words: a hit is exact, never a 32-bit match. `block_slot[b]` is
`slot × G + g` for block b in field g of flat slot `bucket × W + way`, −1
when b is not indexed, so evicting a block clears its field without a probe;
an entry whose last field is cleared frees its way.

Inserting (`insert`) has the outcome of inserting the entries one after
another in batch order: where the key is indexed, each given block fills its
group's field if that is empty (else the indexed block wins and the new block
simply stays uncached: always safe, a later request hits the indexed block);
otherwise a new entry takes the first empty way of the bucket, or, when the
bucket is full, nothing is indexed (the index is lossy: the blocks stay
uncached). It runs in vectorised rounds, no loop over entries (see `insert`).

    bucket 5, W = 3:  [ A: (7, 0) | . | B: (9, 4) ]      G = 2 groups
    insert A (0, 8), C (3, 5), C (6, 0), D (2, 2):
      A: group 1's field was empty -> A: (7, 8); group 0 given nothing
      C: new entry -> way 1: (3, 5);  C again: both fields taken, nothing placed
      D: no empty way left: dropped

`insert` returns which (entry, group) blocks were placed; the caller marks
exactly those blocks cached (`pool.mark_cached`), so a block is cached iff it
is indexed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.core.pool import HASH_WORDS, count_prefix
from jaxkv.planner.specs import NULL_BLOCK

COUNT_WORD = HASH_WORDS  # blocks the entry holds; 0: the way is empty
FIELDS = HASH_WORDS + 1  # first block field
NOT_INDEXED = -1  # block_slot of a block without an entry
DEFAULT_WAYS = 8
_RETRY_WIDTH = 64  # entries per later insertion round


@dataclasses.dataclass(frozen=True)
class IndexState:
    """The table and each block's field (see the module docstring).

    slots:      uint32[B, W, 5 + G] key words, blocks held, block id per group
    block_slot: int32[N]            `flat slot × G + group` of each block's field; −1: not indexed
    """

    slots: jax.Array
    block_slot: jax.Array

    @property
    def num_buckets(self) -> int:
        return self.slots.shape[0]

    @property
    def num_ways(self) -> int:
        return self.slots.shape[1]

    @property
    def num_groups(self) -> int:
        return self.slots.shape[2] - FIELDS


jax.tree_util.register_dataclass(IndexState, data_fields=["slots", "block_slot"], meta_fields=[])


def num_buckets_for(num_entries: int, ways: int = DEFAULT_WAYS) -> int:
    """B: a power of two with at least 4 ways per expected entry.

    At a quarter full, a bucket of 8 ways overflows with probability ~2e-4.
    """
    return 1 << max(0, (-(-4 * num_entries // ways) - 1).bit_length())


def init_index(
    num_blocks: int, num_groups: int, num_entries: int | None = None, ways: int = DEFAULT_WAYS
) -> IndexState:
    """An empty index for `num_groups` groups, sized for `num_entries` entries (default: one per block)."""
    if ways <= 0 or num_groups <= 0:
        raise ValueError(f"{ways=} and {num_groups=} must be positive")
    num_buckets = num_buckets_for(num_blocks if num_entries is None else num_entries, ways)
    return IndexState(
        slots=jnp.zeros((num_buckets, ways, FIELDS + num_groups), jnp.uint32),
        block_slot=jnp.full(num_blocks, NOT_INDEXED, jnp.int32),
    )


def bucket_of(keys, num_buckets: int):
    """int32[P]: the bucket of each key uint32[P, 4]."""
    return (keys[:, 0].astype(jnp.uint32) & np.uint32(num_buckets - 1)).astype(jnp.int32)


def _match(rows, keys):
    """bool[P, W]: which ways of `rows` uint32[P, W, 5 + G] hold the key of `keys` uint32[P, 4]."""
    same = rows[:, :, :HASH_WORDS] == keys[:, None, :].astype(jnp.uint32)
    return jnp.all(same, axis=2) & (rows[:, :, COUNT_WORD] != 0)


def probe(index: IndexState, keys, valid):
    """int32[P, G]: the block indexed under each (key uint32[P, 4], group); NULL_BLOCK: none.

    Rows with `valid` bool[P] False give NULL_BLOCK.
    """
    rows = index.slots[bucket_of(keys, index.num_buckets)]  # [P, W, 5 + G]
    hit = _match(rows, keys) & valid[:, None]
    # At most one way matches: keys are unique in the index.
    fields = jnp.sum(jnp.where(hit[:, :, None], rows[:, :, FIELDS:], 0), axis=1, dtype=jnp.uint32)
    return fields.astype(jnp.int32)


def _insert_round(index: IndexState, bucket, keys, blocks, claim, pending):
    """One insertion round for entries [E] (see `insert`).

    Returns (index, placed bool[E, G], still pending bool[E]). One gather of the buckets,
    one scatter-max of the claims, one gather to read them back, then writes that depend
    on what was read (so XLA updates the table in place instead of copying it).
    """
    num_ways, num_groups = index.num_ways, index.num_groups
    num_slots, num_blocks = index.num_buckets * num_ways, index.block_slot.shape[0]
    flat = index.slots.reshape(num_slots, FIELDS + num_groups)
    rows = index.slots[bucket]  # [E, W, 5 + G]
    given = blocks != NULL_BLOCK  # [E, G]
    match = _match(rows, keys)
    present = pending & jnp.any(match, axis=1)
    empty = rows[:, :, COUNT_WORD] == 0
    # A present key fills its empty fields; the earliest entry filling a field takes it. An absent
    # key makes an entry in the bucket's first empty way; the earliest entry aiming at a way takes
    # it (its count word is 0 there; claims exceed any count).
    found_slot = bucket * num_ways + jnp.argmax(match, axis=1).astype(jnp.int32)
    found_fields = jnp.sum(jnp.where(match[:, :, None], rows[:, :, FIELDS:], 0), axis=1)  # [E, G]
    filling = present[:, None] & given & (found_fields == NULL_BLOCK)
    creating = pending & ~present & jnp.any(empty, axis=1) & jnp.any(given, axis=1)
    new_slot = bucket * num_ways + jnp.argmax(empty, axis=1).astype(jnp.int32)
    target_row = jnp.concatenate(
        [jnp.where(filling, found_slot[:, None], num_slots), jnp.where(creating, new_slot, num_slots)[:, None]], axis=1
    )  # [E, G + 1]
    target_col = jnp.concatenate(
        [
            jnp.broadcast_to(FIELDS + jnp.arange(num_groups, dtype=jnp.int32), given.shape),
            jnp.full((given.shape[0], 1), COUNT_WORD, jnp.int32),
        ],
        axis=1,
    )
    flat = flat.at[target_row, target_col].max(claim[:, None], mode="drop")
    won = (target_row < num_slots) & (flat.at[target_row, target_col].get(mode="fill", fill_value=0) == claim[:, None])
    filled, created = won[:, :num_groups], won[:, num_groups]
    # Winners write: the filled fields and their counts, the created entries whole.
    fill_row = jnp.where(filled, found_slot[:, None], num_slots)
    flat = flat.at[fill_row, target_col[:, :num_groups]].set(blocks.astype(jnp.uint32), mode="drop")
    num_filled = jnp.sum(filled, axis=1, dtype=jnp.uint32)
    flat = flat.at[jnp.where(jnp.any(filled, axis=1), found_slot, num_slots), COUNT_WORD].add(num_filled, mode="drop")
    entry = jnp.concatenate(
        [keys.astype(jnp.uint32), jnp.sum(given, axis=1, dtype=jnp.uint32)[:, None], blocks.astype(jnp.uint32)], axis=1
    )
    flat = flat.at[jnp.where(created, new_slot, num_slots)].set(entry, mode="drop")
    placed = filled | (created[:, None] & given)
    slot = jnp.where(created, new_slot, found_slot)
    field_id = slot[:, None] * num_groups + jnp.arange(num_groups, dtype=jnp.int32)[None, :]
    block_slot = index.block_slot.at[jnp.where(placed, blocks, num_blocks)].set(field_id, mode="drop")
    still = creating & ~created
    return IndexState(slots=flat.reshape(index.slots.shape), block_slot=block_slot), placed, still


def insert(index: IndexState, keys, blocks, valid) -> tuple[IndexState, jax.Array]:
    """Indexes `blocks` int32[E, G] (NULL_BLOCK: none for that group) under keys uint32[E, 4].

    Rows with `valid` bool[E] False are ignored. Returns the index and placed bool[E, G]:
    the blocks now indexed. The outcome is that of inserting the entries one after
    another in batch order (see the module docstring). The blocks must not be indexed.

    Rounds, each for pending entries at once. An entry whose key is indexed fills the
    key's empty fields (the earliest entry filling a field wins; a later one would find
    it taken: done in one round). Otherwise it aims at its bucket's first empty way, and
    the earliest entry aiming at a way takes it (a scatter-max of a claim code, larger
    for earlier entries, into the way's count word picks it); the rest stay pending and
    retry: a retry may find the key that an earlier entry just created. The first
    round takes every entry; the few that lost a way go on in rounds of the first 64
    pending (in batch order, so an entry never overtakes an earlier one of its bucket)
    until none is pending: at most W + 1 rounds per bucket.
    """
    keys, blocks, valid = jnp.asarray(keys), jnp.asarray(blocks), jnp.asarray(valid)
    num_entries = keys.shape[0]
    bucket = bucket_of(keys, index.num_buckets)
    # Claim codes exceed any count (≤ G) and sort earlier entries higher.
    claim = (index.num_groups + num_entries - jnp.arange(num_entries, dtype=jnp.int32)).astype(jnp.uint32)
    index, placed, pending = _insert_round(index, bucket, keys, blocks, claim, valid)
    width = min(num_entries, _RETRY_WIDTH)

    def retry(carry):
        index, pending, placed = carry
        rank = count_prefix(pending) - 1
        chosen = pending & (rank < width)
        pick = (
            jnp.zeros(width, jnp.int32)
            .at[jnp.where(chosen, rank, width)]
            .set(jnp.arange(num_entries, dtype=jnp.int32), mode="drop")
        )
        in_pick = jnp.arange(width) < jnp.sum(chosen)
        index, won, still = _insert_round(index, bucket[pick], keys[pick], blocks[pick], claim[pick], in_pick)
        back = jnp.where(in_pick, pick, num_entries)
        return index, pending.at[back].set(still, mode="drop"), placed.at[back].set(won, mode="drop")

    index, _, placed = lax.while_loop(lambda carry: jnp.any(carry[1]), retry, (index, pending, placed))
    return index, placed


def remove(index: IndexState, blocks, valid) -> IndexState:
    """Removes the entries of distinct `blocks` int32[F] where `valid` bool[F] (blocks not indexed: no-op).

    A key's entry frees its way when its last block goes.
    """
    num_groups, num_blocks = index.num_groups, index.block_slot.shape[0]
    num_slots = index.num_buckets * index.num_ways
    safe_blocks = jnp.where(valid, blocks, NULL_BLOCK)
    read = index.block_slot[safe_blocks]
    indexed = valid & (read != NOT_INDEXED)
    slot = jnp.where(indexed, read // num_groups, num_slots)
    flat = index.slots.reshape(num_slots, FIELDS + num_groups)
    flat = flat.at[slot, FIELDS + read % num_groups].set(NULL_BLOCK, mode="drop")
    flat = flat.at[slot, COUNT_WORD].add(np.uint32(0xFFFFFFFF), mode="drop")  # − 1 per removed block
    # The written value depends on the read (fields are ≥ −1): XLA orders the read first and
    # writes in place instead of copying block_slot.
    not_indexed = jnp.where(read < NOT_INDEXED, read, NOT_INDEXED)
    return IndexState(
        slots=flat.reshape(index.slots.shape),
        block_slot=index.block_slot.at[jnp.where(valid, blocks, num_blocks)].set(not_indexed, mode="drop"),
    )


def index_entries(index: IndexState) -> dict[tuple[tuple[int, ...], int], tuple[int, int]]:
    """Host helper: {(key words, group): (block, flat slot)} of every indexed block."""
    slots = np.asarray(jax.device_get(index.slots))
    slots = slots.reshape(-1, slots.shape[-1])
    out = {}
    for slot in np.flatnonzero(slots[:, COUNT_WORD]).tolist():
        key = tuple(int(w) for w in slots[slot, :HASH_WORDS])
        for g, block in enumerate(slots[slot, FIELDS:].tolist()):
            if block != NULL_BLOCK:
                out[(key, g)] = (int(block), slot)
    return out


def check_index(index: IndexState) -> dict[int, tuple[tuple[int, ...], int]]:
    """Host check of the table alone; returns {block: (key words, group)} of the indexed blocks.

    Each entry sits in its key's bucket, keys are unique, an entry's count is its number
    of blocks, a block is in at most one field, `block_slot` points at each field and is
    −1 for every block without one. Raises AssertionError.
    """
    index = jax.device_get(index)
    num_buckets, num_ways, width = index.slots.shape
    num_groups = width - FIELDS
    slots = np.asarray(index.slots).reshape(-1, width)
    block_slot = np.asarray(index.block_slot)
    by_block: dict[int, tuple[tuple[int, ...], int]] = {}
    seen_keys = set()
    for slot in np.flatnonzero(slots[:, COUNT_WORD]).tolist():
        key = tuple(int(w) for w in slots[slot, :HASH_WORDS])
        fields = slots[slot, FIELDS:]
        assert slot // num_ways == key[0] & (num_buckets - 1), f"key {key} sits in bucket {slot // num_ways}"
        assert key not in seen_keys, f"key {key} has two entries"
        seen_keys.add(key)
        assert slots[slot, COUNT_WORD] == np.count_nonzero(fields), (
            f"entry of key {key} counts {slots[slot, COUNT_WORD]} blocks, holds {np.count_nonzero(fields)}"
        )
        for g in np.flatnonzero(fields).tolist():
            block = int(fields[g])
            assert 0 < block < block_slot.shape[0], f"index slot {slot} holds block {block}, outside the pool"
            assert block not in by_block, f"block {block} has two index fields"
            by_block[block] = (key, g)
            assert block_slot[block] == slot * num_groups + g, (
                f"block_slot[{block}] is {block_slot[block]}, its field is {slot * num_groups + g}"
            )
    stray = sorted(set(np.flatnonzero(block_slot != NOT_INDEXED).tolist()) - set(by_block))
    assert not stray, f"blocks {stray[:8]} have a block_slot but no index field"
    return by_block
