"""The prefix-cache index: (128-bit block hash, KV cache group) -> block id, held as arrays.

Dimensions: B buckets, W ways per bucket, N blocks, F entries inserted in one
call, P keys probed in one call.

A bucketized hash table. Each slot (bucket, way) holds one entry of six uint32
words:

    word    0 1 2 3          4          5
            key (128 bits)   group id   block id (NULL_BLOCK: empty slot)

The entry of (key, group) lives in bucket `(key[0] ^ group × 0x9E3779B9) mod B`
(a key is a prefix of a SHA-256 digest: its words are uniform). A probe reads
the W slots of one bucket, one gather of W × 6 words, and compares all words:
a hit is exact, never a 32-bit match. `block_slot[b]` is the flat slot
(`bucket × W + way`) of block b's entry, −1 when b is not indexed, so removing
a block (eviction) clears its slot without a probe.

Inserting a batch (`insert`) has the outcome of inserting its entries one
after another in batch order: an entry whose (key, group) is already indexed
is skipped (the present block wins, the new block simply stays uncached: always
safe, a later request hits the present block), otherwise it takes the first
empty way of its bucket, or is dropped when the bucket is full (the index is
lossy: such a block stays uncached). It runs in vectorised rounds, no loop
over entries (see `insert`).

    bucket 5, W = 4:  [ A | . | B | . ]     batch: A', C, D, D', E (all in bucket 5)
    A' equals A (present): skipped; C -> way 1; D -> way 3; D' equals D: skipped;
    E: no empty way left, dropped

`insert` returns which entries were placed; the caller marks exactly those
blocks cached (`pool.mark_cached`), so a block is cached iff it is indexed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.pool import HASH_WORDS
from jaxkv.specs import NULL_BLOCK

SLOT_WORDS = HASH_WORDS + 2  # key words, group, block
GROUP_WORD, BLOCK_WORD = HASH_WORDS, HASH_WORDS + 1
NOT_INDEXED = -1  # block_slot of a block without an entry
DEFAULT_WAYS = 8
_GROUP_MIX = np.uint32(0x9E3779B9)  # spreads one key's groups over different buckets


@dataclasses.dataclass(frozen=True)
class IndexState:
    """The table and each block's slot (see the module docstring).

    slots:      uint32[B, W, 6] key words, group id, block id (NULL_BLOCK: empty)
    block_slot: int32[N]        flat slot of each block's entry; −1: not indexed
    """

    slots: jax.Array
    block_slot: jax.Array

    @property
    def num_buckets(self) -> int:
        return self.slots.shape[0]

    @property
    def num_ways(self) -> int:
        return self.slots.shape[1]


jax.tree_util.register_dataclass(IndexState, data_fields=["slots", "block_slot"], meta_fields=[])


def num_buckets_for(num_blocks: int, ways: int = DEFAULT_WAYS) -> int:
    """B: a power of two with at least 4 slots per block (every block indexed fills a quarter).

    At that load a bucket of 8 ways overflows with probability ~2e-4.
    """
    return 1 << max(0, (-(-4 * num_blocks // ways) - 1).bit_length())


def init_index(num_blocks: int, ways: int = DEFAULT_WAYS) -> IndexState:
    """An empty index for a pool of `num_blocks` blocks."""
    if ways <= 0:
        raise ValueError(f"{ways=} must be positive")
    return IndexState(
        slots=jnp.zeros((num_buckets_for(num_blocks, ways), ways, SLOT_WORDS), jnp.uint32),
        block_slot=jnp.full(num_blocks, NOT_INDEXED, jnp.int32),
    )


def bucket_of(keys, groups, num_buckets: int):
    """int32[P]: the bucket of each (key uint32[P, 4], group int32[P])."""
    mixed = keys[:, 0].astype(jnp.uint32) ^ (groups.astype(jnp.uint32) * _GROUP_MIX)
    return (mixed & np.uint32(num_buckets - 1)).astype(jnp.int32)


def _entry_words(keys, groups, blocks):
    """uint32[P, 6]: the slot words of each entry."""
    return jnp.concatenate(
        [keys.astype(jnp.uint32), groups.astype(jnp.uint32)[:, None], blocks.astype(jnp.uint32)[:, None]], axis=1)


def _match(rows, words):
    """bool[P, W]: which slots of `rows` uint32[P, W, 6] hold the key and group of `words` uint32[P, 6]."""
    same = rows[:, :, :BLOCK_WORD] == words[:, None, :BLOCK_WORD]
    return jnp.all(same, axis=2) & (rows[:, :, BLOCK_WORD] != NULL_BLOCK)


def probe(index: IndexState, keys, groups, valid):
    """int32[P]: the block indexed under each (key uint32[P, 4], group int32[P]); NULL_BLOCK: none.

    Entries with `valid` bool[P] False give NULL_BLOCK.
    """
    words = _entry_words(keys, groups, jnp.zeros_like(groups))
    rows = index.slots[bucket_of(keys, groups, index.num_buckets)]  # [P, W, 6]
    hit = _match(rows, words) & valid[:, None]
    # At most one slot matches: keys are unique in the index.
    return jnp.max(jnp.where(hit, rows[:, :, BLOCK_WORD], NULL_BLOCK), axis=1).astype(jnp.int32)


def insert(index: IndexState, blocks, keys, groups, valid) -> tuple[IndexState, jax.Array]:
    """Indexes `blocks` int32[F] under (key uint32[F, 4], group int32[F]) where `valid` bool[F].

    Returns the index and placed bool[F]: the entries now indexed. The outcome is that
    of inserting the entries one after another in batch order (see the module
    docstring). The blocks must not be indexed already.

    Rounds, each for all pending entries at once: an entry whose key is indexed, or
    whose bucket has no empty way, is dropped; the others aim at their bucket's first
    empty way, and the earliest entry aiming at a slot takes it (a scatter-max of
    `F − entry` into the slot's block word picks it); the rest stay pending. Each
    round fills a way in every bucket with pending entries, so there are at most
    W + 1 rounds; usually one (a batch rarely puts two entries in one bucket).
    """
    num_entries = blocks.shape[0]
    num_buckets, num_ways = index.num_buckets, index.num_ways
    num_slots, num_blocks = num_buckets * num_ways, index.block_slot.shape[0]
    words = _entry_words(keys, groups, blocks)
    bucket = bucket_of(keys, groups, num_buckets)
    claim = (num_entries - jnp.arange(num_entries, dtype=jnp.int32)).astype(jnp.uint32)  # earlier: larger

    def round_(carry):
        index, pending, placed = carry
        rows = index.slots[bucket]  # [F, W, 6]
        empty = rows[:, :, BLOCK_WORD] == NULL_BLOCK
        way = jnp.argmax(empty, axis=1).astype(jnp.int32)
        aiming = pending & ~jnp.any(_match(rows, words), axis=1) & jnp.any(empty, axis=1)
        slot = jnp.where(aiming, bucket * num_ways + way, num_slots)
        flat = index.slots.reshape(num_slots, SLOT_WORDS)
        flat = flat.at[slot, BLOCK_WORD].max(claim, mode="drop")
        won = aiming & (flat.at[slot, BLOCK_WORD].get(mode="fill", fill_value=0) == claim)
        won_slot = jnp.where(won, slot, num_slots)
        flat = flat.at[won_slot].set(words, mode="drop")
        block_slot = index.block_slot.at[jnp.where(won, blocks, num_blocks)].set(won_slot, mode="drop")
        index = IndexState(slots=flat.reshape(index.slots.shape), block_slot=block_slot)
        return index, aiming & ~won, placed | won

    index, _, placed = lax.while_loop(lambda carry: jnp.any(carry[1]), round_,
                                      (index, valid, jnp.zeros(num_entries, bool)))
    return index, placed


def remove(index: IndexState, blocks, valid) -> IndexState:
    """Removes the entries of `blocks` int32[F] where `valid` bool[F] (blocks not indexed: no-op)."""
    num_blocks = index.block_slot.shape[0]
    num_slots = index.num_buckets * index.num_ways
    safe_blocks = jnp.where(valid, blocks, NULL_BLOCK)
    read = index.block_slot[safe_blocks]
    slot = jnp.where(valid & (read != NOT_INDEXED), read, num_slots)
    flat = index.slots.reshape(num_slots, SLOT_WORDS).at[slot, BLOCK_WORD].set(NULL_BLOCK, mode="drop")
    # The written value depends on the read (slots are ≥ −1): XLA orders the read first and
    # writes in place instead of copying block_slot.
    not_indexed = jnp.where(read < NOT_INDEXED, read, NOT_INDEXED)
    return IndexState(
        slots=flat.reshape(index.slots.shape),
        block_slot=index.block_slot.at[jnp.where(valid, blocks, num_blocks)].set(not_indexed, mode="drop"),
    )


def index_entries(index: IndexState) -> dict[tuple[tuple[int, ...], int], tuple[int, int]]:
    """Host helper: {(key words, group): (block, flat slot)} of every entry."""
    slots = np.asarray(jax.device_get(index.slots)).reshape(-1, SLOT_WORDS)
    out = {}
    for slot in np.flatnonzero(slots[:, BLOCK_WORD] != NULL_BLOCK).tolist():
        words = slots[slot]
        out[(tuple(int(w) for w in words[:HASH_WORDS]), int(words[GROUP_WORD]))] = (int(words[BLOCK_WORD]), slot)
    return out


def check_index(index: IndexState) -> dict[int, tuple[tuple[int, ...], int]]:
    """Host check of the table alone; returns {block: (key words, group)} of the indexed blocks.

    Each entry sits in its key's bucket, keys are unique, `block_slot` points at
    each entry and is −1 for every block without one. Raises AssertionError.
    """
    index = jax.device_get(index)
    num_buckets, num_ways = index.slots.shape[:2]
    slots = np.asarray(index.slots).reshape(-1, SLOT_WORDS)
    block_slot = np.asarray(index.block_slot)
    used = np.flatnonzero(slots[:, BLOCK_WORD] != NULL_BLOCK)
    by_block: dict[int, tuple[tuple[int, ...], int]] = {}
    seen_keys = set()
    for slot in used.tolist():
        words = slots[slot]
        key, group, block = tuple(int(w) for w in words[:HASH_WORDS]), int(words[GROUP_WORD]), int(words[BLOCK_WORD])
        assert 0 < block < block_slot.shape[0], f"index slot {slot} holds block {block}, outside the pool"
        expected_bucket = (key[0] ^ (group * int(_GROUP_MIX))) & 0xFFFFFFFF & (num_buckets - 1)
        assert slot // num_ways == expected_bucket, f"block {block} sits in bucket {slot // num_ways}, " \
                                                    f"its key's bucket is {expected_bucket}"
        assert (key, group) not in seen_keys, f"key {key} of group {group} is indexed twice"
        seen_keys.add((key, group))
        assert block not in by_block, f"block {block} has two index entries"
        by_block[block] = (key, group)
        assert block_slot[block] == slot, f"block_slot[{block}] is {block_slot[block]}, its entry is at {slot}"
    stray = np.flatnonzero(block_slot != NOT_INDEXED)
    missing = sorted(set(stray.tolist()) - set(by_block))
    assert not missing, f"blocks {missing[:8]} have a block_slot but no index entry"
    return by_block
