"""The prefix-cache index (jaxkv.prefix_cache) against a plain-Python model, jitted and eager.

Dimensions: F entries per call, P probes per call, W ways, B buckets.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.prefix_cache import (
    bucket_of,
    check_index,
    index_entries,
    init_index,
    insert,
    num_buckets_for,
    probe,
    remove,
)
from jaxkv.specs import NULL_BLOCK
from model_reference import IndexModel

NUM_BLOCKS = 12
WAYS = 2  # tiny buckets: collisions and full buckets happen often
WIDTH = 6  # F and P: calls are padded to this many entries

_insert, _probe, _remove = jax.jit(insert), jax.jit(probe), jax.jit(remove)


def _key(word0, word3=0):
    return (word0, 7, 11, word3)


def _padded(entries, width=WIDTH):
    """(blocks int32[F], keys uint32[F, 4], groups int32[F], valid bool[F]) from (block, key, group) tuples."""
    blocks = np.zeros(width, np.int32)
    keys = np.zeros((width, 4), np.uint32)
    groups = np.zeros(width, np.int32)
    for i, (block, key, group) in enumerate(entries):
        blocks[i], keys[i], groups[i] = block, key, group
    return blocks, keys, groups, np.arange(width) < len(entries)


def test_num_buckets_gives_four_slots_per_block():
    assert num_buckets_for(131072, 8) == 65536
    assert num_buckets_for(10, 8) == 8  # 40 slots needed: 5 buckets, rounded up to a power of two
    assert num_buckets_for(1, 8) == 1


def test_insert_probe_remove_by_hand():
    index = init_index(NUM_BLOCKS, ways=WAYS)
    num_buckets = index.num_buckets  # 32 slots / 2 ways = ... a power of two
    # Keys whose word 0 is a multiple of num_buckets land in bucket 0 for group 0.
    a, b, c = _key(0), _key(num_buckets), _key(2 * num_buckets)
    # A and B fill bucket 0; A again (block 3) is a duplicate within the batch: the first wins;
    # C finds no empty way: dropped.
    index, placed = _insert(index, *_padded([(1, a, 0), (3, a, 0), (2, b, 0), (4, c, 0)]))
    assert np.asarray(placed).tolist() == [True, False, True, False, False, False]
    blocks, keys, groups, valid = _padded([(0, a, 0), (0, b, 0), (0, c, 0), (0, a, 1)])
    assert np.asarray(_probe(index, keys, groups, valid)).tolist() == [1, 2, NULL_BLOCK, NULL_BLOCK, 0, 0]
    # A present key wins over a new block with the same key.
    index, placed = _insert(index, *_padded([(5, a, 0)]))
    assert not np.asarray(placed).any()
    # Removing block 1 frees its way: C now fits; the same key in another group is another entry.
    index = _remove(index, *_padded([(1, a, 0), (9, a, 0)])[::3])  # block 9 is not indexed: a no-op
    index, placed = _insert(index, *_padded([(4, c, 0), (6, a, 1)]))
    assert np.asarray(placed).tolist()[:2] == [True, True]
    assert np.asarray(_probe(index, keys, groups, valid)).tolist()[:4] == [NULL_BLOCK, 2, 4, 6]
    assert check_index(index) == {2: (b, 0), 4: (c, 0), 6: (a, 1)}


def test_bucket_mixes_the_group():
    keys = jnp.asarray([_key(5)] * 4, jnp.uint32)
    buckets = np.asarray(bucket_of(keys, jnp.arange(4, dtype=jnp.int32), 1024))
    assert buckets[0] == 5 and len(set(buckets.tolist())) == 4


@st.composite
def operations(draw):
    """Random insert / remove / probe calls over a small key space (many collisions)."""
    ops = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["insert", "insert", "remove", "probe"]))
        n = draw(st.integers(0, WIDTH))
        entries = [(draw(st.integers(1, NUM_BLOCKS - 1)),
                    _key(draw(st.integers(0, 40)), draw(st.integers(0, 1))),
                    draw(st.integers(0, 2))) for _ in range(n)]
        ops.append((kind, entries))
    return ops


def run_operations(ops):
    index = init_index(NUM_BLOCKS, ways=WAYS)
    model = IndexModel(NUM_BLOCKS, ways=WAYS)
    for kind, entries in ops:
        if kind == "insert":
            # A block is inserted only while it is not indexed (the manager's rule): skip others,
            # and blocks listed twice in one call.
            fresh, seen = [], set()
            for block, key, group in entries:
                if block not in model.block_key and block not in seen:
                    fresh.append((block, key, group))
                    seen.add(block)
            index, placed = insert(index, *map(jnp.asarray, _padded(fresh)))
            expected = model.insert(fresh)
            assert np.asarray(placed).tolist() == expected + [False] * (WIDTH - len(fresh))
        elif kind == "remove":
            blocks = [block for block, _, _ in entries]
            index = remove(index, *map(jnp.asarray, _padded(entries)[::3]))
            model.remove(blocks)
        else:
            found = probe(index, *map(jnp.asarray, _padded(entries)[1:]))
            assert np.asarray(found).tolist()[: len(entries)] == [model.probe(k, g) for _, k, g in entries]
        assert check_index(index) == model.block_key
        assert {k: b for k, (b, _) in index_entries(index).items()} == model.entries()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(operations())
def test_random_operations_match_model(ops):
    run_operations(ops)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(operations())
def test_random_operations_match_model_eager(ops):
    with jax.disable_jit():
        run_operations(ops)


@pytest.mark.parametrize("width", [1, 64])
def test_insert_shapes(width):
    # One entry, and more entries than ways per bucket in one call.
    index = init_index(256, ways=8)
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**32, (width, 4), dtype=np.uint32)
    blocks = np.arange(1, width + 1, dtype=np.int32)
    index, placed = _insert(index, blocks, keys, np.zeros(width, np.int32), np.ones(width, bool))
    assert np.asarray(placed).all()
    np.testing.assert_array_equal(_probe(index, keys, np.zeros(width, np.int32), np.ones(width, bool)), blocks)
