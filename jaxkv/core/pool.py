"""The block pool: reference counts and an LRU free order, held as arrays.

Dimensions: N blocks (the null block included), C ring capacity (2 × N),
F blocks passed to one call, K blocks popped in one call.

Free order. The free blocks sit in a ring buffer `free_ring` read from
`ring_head`; `ring_count` entries follow it, some of them stale:

    free_ring:  ... | h1 h2 ... | x  a  x  b  c ... | t1 t2 ... | ...
                      ^ uncached blocks pushed here   ^ cached blocks appended here
                    ring_head                      ring_head + ring_count

* A freed block that is not cached is pushed at the head, so it is reused first
  (pushes are LIFO: the last block pushed is at the head).
* A freed cached block is appended at the tail: among cached blocks the least
  recently freed is evicted first.
* Allocation pops valid entries from the head.
* An entry at ring position p is valid iff `queue_pos[free_ring[p]] == p` and
  `ref_cnt[free_ring[p]] == 0`. Taking a free block out of the middle (a
  prefix-cache hit, `touch`) only raises its reference count: its entry turns
  stale in place (lazy deletion). Popping skips stale entries; when stale
  entries would overflow the ring, `_compact` moves the valid ones, in order,
  to the start of the ring (O(C), under `lax.cond`).

Every free non-null block has exactly one valid entry, in-use blocks have none.
Block 0 (`NULL_BLOCK`) is never in the ring and its count stays 0.

Caching. `block_group[b] >= 0` marks block b as cached for that KV cache
group under `block_hash[b]` (128 bits). Popping a cached block evicts it in
the same transition (`block_group` back to -1: the hook where the prefix-cache
index entry is removed too).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.planner.specs import NULL_BLOCK

HASH_WORDS = 4  # uint32 words per block hash: 128 bits
NOT_CACHED = -1  # block_group of a block that is not cached


@dataclasses.dataclass(frozen=True)
class PoolState:
    """Reference counts and free order of the N blocks (see the module docstring).

    ref_cnt:         int32[N]     table entries holding each block; 0 = free
    free_ring:       int32[C]     block ids; entries from ring_head, stale ones included
    queue_pos:       int32[N]     ring position of each block's current entry
    ring_head:       int32[]      ring position of the first entry
    ring_count:      int32[]      entries (valid and stale) from ring_head on
    num_free_blocks: int32[]      free blocks (cached or not), null block excluded
    block_hash:      uint32[N, 4] hash of a cached block (meaningless where not cached)
    block_group:     int32[N]     KV cache group a block is cached for; -1: not cached
    """

    ref_cnt: jax.Array
    free_ring: jax.Array
    queue_pos: jax.Array
    ring_head: jax.Array
    ring_count: jax.Array
    num_free_blocks: jax.Array
    block_hash: jax.Array
    block_group: jax.Array


jax.tree_util.register_dataclass(PoolState, data_fields=[f.name for f in dataclasses.fields(PoolState)], meta_fields=[])


def init_pool(num_blocks: int) -> PoolState:
    """A pool with every block but the null block free, in id order."""
    if num_blocks < 2:
        raise ValueError(f"{num_blocks=} must be at least 2 (the null block and one usable block)")
    capacity = 2 * num_blocks
    blocks = np.arange(1, num_blocks, dtype=np.int32)
    ring = np.zeros(capacity, np.int32)
    ring[: num_blocks - 1] = blocks
    queue_pos = np.full(num_blocks, -1, np.int32)
    queue_pos[1:] = blocks - 1
    return PoolState(
        ref_cnt=jnp.zeros(num_blocks, jnp.int32),
        free_ring=jnp.asarray(ring),
        queue_pos=jnp.asarray(queue_pos),
        ring_head=jnp.int32(0),
        ring_count=jnp.int32(num_blocks - 1),
        num_free_blocks=jnp.int32(num_blocks - 1),
        block_hash=jnp.zeros((num_blocks, HASH_WORDS), jnp.uint32),
        block_group=jnp.full(num_blocks, NOT_CACHED, jnp.int32),
    )


_SCAN_WIDTH = 32


def _prefix_matmul(x):
    """x [..., n] @ upper-triangular ones [n, n]: prefix sums within the last axis.

    HIGHEST precision: GPUs (TF32) and TPUs (bfloat16 passes) would round float32 sums.
    """
    n = x.shape[-1]
    triangular = np.triu(np.ones((n, n), x.dtype))  # a compile-time constant
    return jnp.matmul(x, triangular, precision=lax.Precision.HIGHEST)


def cumsum(x, bound: int | None = None):
    """Inclusive cumulative sum of int32 `x` along the last axis.

    Blocks of 32 are summed by a matmul with a triangular matrix, the block
    totals recursively: a handful of ops, where XLA:CPU's own cumsum and
    `lax.associative_scan` cost many (each op has a fixed cost on CPU). With a
    static `bound` on the absolute sum below 2^24 the matmuls run in float32
    (faster, and exact for such integers).
    """
    if bound is not None and bound < 2**24:
        return _cumsum(x.astype(jnp.float32)).astype(x.dtype)
    return _cumsum(x)


def _cumsum(x):
    n = x.shape[-1]
    if n <= _SCAN_WIDTH:
        return _prefix_matmul(x)
    num_rows = -(-n // _SCAN_WIDTH)
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, num_rows * _SCAN_WIDTH - n)])
    rows = padded.reshape(*x.shape[:-1], num_rows, _SCAN_WIDTH)
    within = _prefix_matmul(rows)
    totals = within[..., -1]
    offsets = _cumsum(totals) - totals
    return (within + offsets[..., None]).reshape(*x.shape[:-1], -1)[..., :n]


def count_prefix(flags):
    """int32 inclusive prefix counts of 0/1 `flags` along the last axis."""
    return cumsum(flags.astype(jnp.int32), bound=flags.shape[-1])


def pop(pool: PoolState, num_blocks, size: int) -> tuple[PoolState, jax.Array]:
    """Takes the first `num_blocks` (≤ size, ≤ num_free_blocks) valid entries from the head.

    Returns the pool and int32[size] block ids in free order, NULL_BLOCK past
    `num_blocks`. The taken blocks get reference count 1; cached ones are evicted.
    Without stale entries (ring_count == num_free_blocks) the entries are read
    directly; otherwise a bounded loop reads `size` entries at a time, skipping
    stale ones.
    """
    window = jnp.arange(size, dtype=jnp.int32)
    capacity = pool.free_ring.shape[0]

    def contiguous(pool):
        blocks = pool.free_ring[jnp.mod(pool.ring_head + window, capacity)]
        return (
            pool.ring_head + num_blocks,
            pool.ring_count - num_blocks,
            num_blocks,
            jnp.where(window < num_blocks, blocks, NULL_BLOCK),
        )

    def skipping(pool):
        def not_done(carry):
            _, count, num_taken, _ = carry
            return (num_taken < num_blocks) & (count > 0)

        def take_window(carry):
            head, count, num_taken, out = carry
            pos = jnp.mod(head + window, capacity)
            block = pool.free_ring[pos]
            valid = (window < count) & (pool.queue_pos[block] == pos) & (pool.ref_cnt[block] == 0)
            rank = num_taken + count_prefix(valid) - 1
            take = valid & (rank < num_blocks)
            out = out.at[jnp.where(take, rank, size)].set(block, mode="drop")
            num_taken_now = num_taken + jnp.sum(take, dtype=jnp.int32)
            last_taken = jnp.max(jnp.where(take, window, -1))
            advance = jnp.where(num_taken_now == num_blocks, last_taken + 1, jnp.minimum(size, count))
            return head + advance, count - advance, num_taken_now, out

        init = (pool.ring_head, pool.ring_count, jnp.int32(0), jnp.full(size, NULL_BLOCK, jnp.int32))
        return lax.while_loop(not_done, take_window, init)

    head, count, num_taken, blocks = lax.cond(pool.ring_count == pool.num_free_blocks, contiguous, skipping, pool)
    idx = jnp.where(window < num_taken, blocks, pool.ref_cnt.shape[0])
    pool = dataclasses.replace(
        pool,
        ref_cnt=pool.ref_cnt.at[idx].set(1, mode="drop"),
        ring_head=jnp.mod(head, capacity),
        ring_count=count,
        num_free_blocks=pool.num_free_blocks - num_taken,
        block_group=pool.block_group.at[idx].set(NOT_CACHED, mode="drop"),
    )
    return pool, blocks


def _compact(free_ring, queue_pos, ring_head, ring_count, ref_cnt):
    """Moves the valid ring entries, in order, to positions 0, 1, ...; drops stale ones.

    Returns (free_ring, queue_pos, ring_head, ring_count).
    """
    capacity = free_ring.shape[0]
    num_pool_blocks = ref_cnt.shape[0]
    offsets = jnp.arange(capacity, dtype=jnp.int32)
    pos = jnp.mod(ring_head + offsets, capacity)
    block = free_ring[pos]
    valid = (offsets < ring_count) & (queue_pos[block] == pos) & (ref_cnt[block] == 0)
    new_pos = count_prefix(valid) - 1
    return (
        jnp.zeros_like(free_ring).at[jnp.where(valid, new_pos, capacity)].set(block, mode="drop"),
        queue_pos.at[jnp.where(valid, block, num_pool_blocks)].set(new_pos, mode="drop"),
        jnp.int32(0),
        jnp.sum(valid, dtype=jnp.int32),
    )


def release(pool: PoolState, blocks, valid, evict_first=None) -> PoolState:
    """Drops one reference per valid entry of `blocks` int32[F]; frees blocks reaching 0.

    Entries are in free order. Each freed block is pushed as its count reaches 0:
    uncached ones at the head (the last pushed is reused first), cached ones at
    the tail (in entry order), except cached ones whose entry has `evict_first`
    bool[F] (a retention policy's verdict: unlikely to serve a hit), which go to
    the head too. The caller masks null entries out with `valid` bool[F].
    """
    capacity = pool.free_ring.shape[0]
    num_pool_blocks = pool.ref_cnt.shape[0]
    num_entries = blocks.shape[0]
    # Compact first if the pushes could overflow the ring (stale entries of blocks
    # freed now are still invalid: their counts are not lowered yet).
    ring_fields = (pool.free_ring, pool.queue_pos, pool.ring_head, pool.ring_count)
    ring_fields = lax.cond(
        pool.ring_count + jnp.sum(valid, dtype=jnp.int32) > capacity,
        _compact,
        lambda *fields: fields[:4],
        *ring_fields,
        pool.ref_cnt,
    )
    free_ring, queue_pos, head, count = ring_fields
    # The decrement depends on the compaction's result (count is ≥ 0), so XLA orders
    # the compaction's read of ref_cnt first and updates it in place.
    decrement = jnp.where(count < 0, 0, -1)
    idx = jnp.where(valid, blocks, num_pool_blocks)
    ref_cnt = pool.ref_cnt.at[idx].add(decrement, mode="drop")
    safe_blocks = jnp.where(valid, blocks, NULL_BLOCK)
    reaches_zero = valid & (ref_cnt[safe_blocks] == 0)
    # A block listed twice is freed at its last entry. queue_pos of a block in use
    # is meaningless, so it serves as scratch: the largest entry index per block.
    entry = jnp.arange(num_entries, dtype=jnp.int32)
    zero_idx = jnp.where(reaches_zero, blocks, num_pool_blocks)
    queue_pos = queue_pos.at[zero_idx].set(-1, mode="drop").at[zero_idx].max(entry, mode="drop")
    freed = reaches_zero & (queue_pos[safe_blocks] == entry)
    cached = pool.block_group[safe_blocks] != NOT_CACHED
    if evict_first is not None:
        cached = cached & ~evict_first
    to_head, to_tail = freed & ~cached, freed & cached
    num_head = jnp.sum(to_head, dtype=jnp.int32)
    num_tail = jnp.sum(to_tail, dtype=jnp.int32)
    rank = count_prefix(jnp.stack([to_head, to_tail]))
    head_pos = head - rank[0]
    tail_pos = head + count + rank[1] - 1
    pos = jnp.mod(jnp.where(to_head, head_pos, tail_pos), capacity)
    return dataclasses.replace(
        pool,
        ref_cnt=ref_cnt,
        free_ring=free_ring.at[jnp.where(freed, pos, capacity)].set(blocks, mode="drop"),
        queue_pos=queue_pos.at[jnp.where(freed, blocks, num_pool_blocks)].set(pos, mode="drop"),
        ring_head=jnp.mod(head - num_head, capacity),
        ring_count=count + num_head + num_tail,
        num_free_blocks=pool.num_free_blocks + num_head + num_tail,
    )


def touch(pool: PoolState, blocks, valid) -> PoolState:
    """Adds one reference per valid entry of `blocks` int32[F] (claiming prefix-cache hits).

    A free block taken this way leaves the free order lazily: its ring entry
    turns stale. Cached blocks stay cached.
    """
    num_pool_blocks = pool.ref_cnt.shape[0]
    entry = jnp.arange(blocks.shape[0], dtype=jnp.int32)
    idx = jnp.where(valid, blocks, num_pool_blocks)
    first = jnp.full(num_pool_blocks, blocks.shape[0], jnp.int32).at[idx].min(entry, mode="drop")
    safe_blocks = jnp.where(valid, blocks, NULL_BLOCK)
    was_free = valid & (first[safe_blocks] == entry) & (pool.ref_cnt[safe_blocks] == 0)
    return dataclasses.replace(
        pool,
        ref_cnt=pool.ref_cnt.at[idx].add(1, mode="drop"),
        num_free_blocks=pool.num_free_blocks - jnp.sum(was_free, dtype=jnp.int32),
    )


def first_entries(values, blocks, valid, reset):
    """Picks each block's earliest valid entry, without O(N) scratch; sets the blocks' `values` to `reset`.

    values: int32[N], ≥ −1 at the blocks of the valid entries of `blocks` int32[F] (`valid` bool[F]).
    The entries write `entry − F − 1` (below −1, smallest for the earliest) into `values` with a
    scatter-min and read it back. Returns (values, first bool[F]).
    """
    num_pool_blocks, num_entries = values.shape[0], blocks.shape[0]
    code = jnp.arange(num_entries, dtype=jnp.int32) - num_entries - 1
    idx = jnp.where(valid, blocks, num_pool_blocks)
    values = values.at[idx].min(code, mode="drop")
    read = values[jnp.where(valid, blocks, NULL_BLOCK)]
    # The written value depends on the read one (values stay far below 2^30), so XLA orders the read
    # first and writes in place instead of copying `values`.
    values = values.at[idx].set(jnp.where(read > 2**30, read, reset), mode="drop")
    return values, valid & (read == code)


def claim(pool: PoolState, blocks, valid) -> tuple[PoolState, jax.Array]:
    """`touch` that also says which entries took a free block: (pool, was_free bool[F]).

    An entry takes a free block when the block's count was 0 and no earlier entry of
    `blocks` int32[F] (`valid` bool[F]) took it (`first_entries`).
    """
    num_pool_blocks = pool.ref_cnt.shape[0]
    safe_blocks = jnp.where(valid, blocks, NULL_BLOCK)
    finds_free = valid & (pool.ref_cnt[safe_blocks] == 0) & (safe_blocks != NULL_BLOCK)
    ref_cnt, was_free = first_entries(pool.ref_cnt, blocks, finds_free, 0)
    ref_cnt = ref_cnt.at[jnp.where(valid, blocks, num_pool_blocks)].add(1, mode="drop")
    pool = dataclasses.replace(
        pool, ref_cnt=ref_cnt, num_free_blocks=pool.num_free_blocks - jnp.sum(was_free, dtype=jnp.int32)
    )
    return pool, was_free


def unclaim(pool: PoolState, blocks, valid) -> PoolState:
    """Undoes `claim` of the valid entries of `blocks` int32[F] in the same transition.

    Drops one reference per entry; a block back at count 0 is free again at its old
    place in the free order: `claim` left its ring entry in place (stale), and
    nothing may have changed the ring since (no release, pop or compaction between
    the two calls).
    """
    num_pool_blocks = pool.ref_cnt.shape[0]
    safe_blocks = jnp.where(valid, blocks, NULL_BLOCK)
    ref_cnt = pool.ref_cnt.at[jnp.where(valid, blocks, num_pool_blocks)].add(-1, mode="drop")
    ref_cnt, first = first_entries(ref_cnt, blocks, valid & (ref_cnt[safe_blocks] == 0), 0)
    return dataclasses.replace(
        pool, ref_cnt=ref_cnt, num_free_blocks=pool.num_free_blocks + jnp.sum(first, dtype=jnp.int32)
    )


def mark_cached(pool: PoolState, blocks, block_hash, group_idx, valid) -> PoolState:
    """Marks the valid `blocks` int32[F] as cached under `block_hash` uint32[F, 4] for `group_idx` int32[F]."""
    idx = jnp.where(valid, blocks, pool.ref_cnt.shape[0])
    return dataclasses.replace(
        pool,
        block_hash=pool.block_hash.at[idx].set(block_hash.astype(jnp.uint32), mode="drop"),
        block_group=pool.block_group.at[idx].set(group_idx, mode="drop"),
    )


def free_order(pool: PoolState) -> np.ndarray:
    """Host helper: the free blocks from head (reused first) to tail, valid entries only."""
    pool = jax.device_get(pool)
    capacity = pool.free_ring.shape[0]
    pos = (int(pool.ring_head) + np.arange(int(pool.ring_count))) % capacity
    block = pool.free_ring[pos]
    valid = (pool.queue_pos[block] == pos) & (pool.ref_cnt[block] == 0)
    return block[valid]
