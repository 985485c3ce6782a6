"""The block pool's free order (ring buffer with lazy deletion) against the plain-Python model.

Dimensions: N blocks, F blocks per call (padded), K blocks popped per call.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_reference import ModelState, assert_pool_matches

from jaxkv import FullAttentionSpec, KVCacheConfig, KVCacheGroup
from jaxkv.core.invariants import check_pool
from jaxkv.core.pool import HASH_WORDS, count_prefix, cumsum, init_pool, mark_cached, pop, release, touch

NUM_BLOCKS = 10  # 9 usable blocks, ring capacity 20: stale entries force compaction often
WIDTH = 8  # F: calls are padded to this many entries
WINDOW = 3  # K for pops: small, so popping past stale entries takes several windows

_pop = jax.jit(pop, static_argnums=2)
_release = jax.jit(release)
_touch = jax.jit(touch)
_mark_cached = jax.jit(mark_cached)


def _cfg(num_blocks=NUM_BLOCKS):
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=4)
    return KVCacheConfig(
        num_blocks=num_blocks,
        groups=(KVCacheGroup(layer_names=("l",), spec=spec),),
        tensors=(),
        max_model_len=8,
        max_num_batched_tokens=8,
    )


def _padded(blocks):
    """(int32[F] blocks, bool[F] valid) from a list of at most F block ids."""
    out = np.zeros(WIDTH, np.int32)
    out[: len(blocks)] = blocks
    return jnp.asarray(out), jnp.asarray(np.arange(WIDTH) < len(blocks))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_pool_operations_match_model(data):
    pool = init_pool(NUM_BLOCKS)
    model = ModelState(_cfg(), max_num_seqs=1)
    held: list[int] = []  # one entry per reference the test holds (a block may appear twice)
    for _ in range(data.draw(st.integers(1, 40), label="num_ops")):
        op = data.draw(st.sampled_from(["pop", "release", "touch", "mark_cached"]), label="op")
        if op == "pop":
            # Take up to min(K, free) blocks from the head.
            num = data.draw(st.integers(0, min(WINDOW, model.num_free_blocks)), label="num_pop")
            pool, blocks = _pop(pool, jnp.int32(num), WINDOW)
            expected = [model.pop() for _ in range(num)]
            assert np.asarray(blocks).tolist() == expected + [0] * (WINDOW - num)
            held += expected
        elif op == "release" and held:
            # Drop some held references, in a drawn order (duplicates of a shared block allowed).
            picks = data.draw(st.lists(st.integers(0, len(held) - 1), unique=True, max_size=WIDTH), label="release")
            blocks = [held[i] for i in picks]
            for i in sorted(picks, reverse=True):
                held.pop(i)
            pool = _release(pool, *_padded(blocks))
            model.release(blocks)
        elif op == "touch":
            # Claim free cached blocks (out of the middle of the order) or share held ones.
            candidates = sorted(set(held) | set(model.cached_group) - {0})
            if candidates:
                blocks = data.draw(st.lists(st.sampled_from(candidates), max_size=WIDTH), label="touch")
                pool = _touch(pool, *_padded(blocks))
                model.touch(blocks)
                held += blocks
        elif op == "mark_cached" and held:
            blocks = data.draw(st.lists(st.sampled_from(sorted(set(held))), max_size=WIDTH, unique=True), label="cache")
            hashes = jnp.ones((WIDTH, HASH_WORDS), jnp.uint32)
            pool = _mark_cached(pool, *_padded(blocks)[:1], hashes, jnp.zeros(WIDTH, jnp.int32), _padded(blocks)[1])
            model.mark_cached(blocks, 0)
        check_pool(pool)
        assert_pool_matches(pool, model)


def test_stale_entries_are_compacted_in_order():
    # N = 8: 7 usable blocks, ring capacity 16. Freeing cached blocks appends them at the tail;
    # touching them leaves stale entries; a third round of frees would overflow the ring.
    pool = init_pool(8)
    model = ModelState(_cfg(8), max_num_seqs=1)
    pool, blocks = _pop(pool, jnp.int32(7), 7)
    taken = [model.pop() for _ in range(7)]
    assert np.asarray(blocks).tolist() == taken
    pool = _mark_cached(
        pool,
        *_padded(taken)[:1],
        jnp.ones((WIDTH, HASH_WORDS), jnp.uint32),
        jnp.full(WIDTH, 0, jnp.int32),
        _padded(taken)[1],
    )
    model.mark_cached(taken, 0)
    counts = []
    for round_idx in range(3):
        order = taken[round_idx:] + taken[:round_idx]  # free in a different order each round
        pool = _release(pool, *_padded(order))
        model.release(order)
        counts.append(int(pool.ring_count))
        check_pool(pool)
        assert_pool_matches(pool, model)
        pool = _touch(pool, *_padded(taken))
        model.touch(taken)
    assert counts == [7, 14, 7], "the third release compacts 14 stale entries away first"


def test_pop_skips_windows_of_stale_entries():
    # Free 6 cached blocks (tail), touch the first 5 of them: a pop of 1 with a window of 2
    # must skip two full windows of stale entries.
    pool = init_pool(8)
    model = ModelState(_cfg(8), max_num_seqs=1)
    pool, _ = _pop(pool, jnp.int32(7), 7)
    taken = [model.pop() for _ in range(7)]
    pool = _mark_cached(
        pool,
        *_padded(taken)[:1],
        jnp.ones((WIDTH, HASH_WORDS), jnp.uint32),
        jnp.zeros(WIDTH, jnp.int32),
        _padded(taken)[1],
    )
    model.mark_cached(taken, 0)
    pool = _release(pool, *_padded(taken[:6]))
    model.release(taken[:6])
    pool = _touch(pool, *_padded(taken[:5]))
    model.touch(taken[:5])
    pool, blocks = _pop(pool, jnp.int32(1), 2)
    assert np.asarray(blocks).tolist() == [model.pop(), 0] == [taken[5], 0]
    assert int(pool.block_group[taken[5]]) == -1, "popping a cached block evicts it"
    check_pool(pool)
    assert_pool_matches(pool, model)


@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000, 5000])
def test_matmul_prefix_sums_are_exact(n):
    rng = np.random.default_rng(n)
    counts = rng.integers(0, 4096, (2, n)).astype(np.int32)  # int32 path (no bound)
    np.testing.assert_array_equal(np.asarray(cumsum(jnp.asarray(counts))), np.cumsum(counts, axis=-1))
    np.testing.assert_array_equal(np.asarray(cumsum(jnp.asarray(counts), bound=4096 * n)), np.cumsum(counts, axis=-1))
    flags = rng.random((3, n)) < 0.5
    np.testing.assert_array_equal(np.asarray(count_prefix(jnp.asarray(flags))), np.cumsum(flags, axis=-1))
