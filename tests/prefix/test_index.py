"""The prefix-cache index (jaxkv.prefix.index) against a plain-Python model, jitted and eager.

Dimensions: E entries per call, P probes per call, G groups, W ways, B buckets.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_reference import IndexModel

from jaxkv.core.pool import claim, init_pool, unclaim
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.index import check_index, index_entries, init_index, insert, num_buckets_for, probe, remove

NUM_BLOCKS = 12
NUM_GROUPS = 2
WAYS = 2  # tiny buckets: collisions and full buckets happen often
WIDTH = 6  # E and P: calls are padded to this many entries

_insert, _probe, _remove = jax.jit(insert), jax.jit(probe), jax.jit(remove)


def _key(word0, word3=0):
    return (word0, 7, 11, word3)


def _entries(entries, width=WIDTH):
    """(keys uint32[E, 4], blocks int32[E, G], valid bool[E]) from (key, blocks per group) tuples."""
    keys = np.zeros((width, 4), np.uint32)
    blocks = np.zeros((width, NUM_GROUPS), np.int32)
    for i, (key, row) in enumerate(entries):
        keys[i], blocks[i] = key, row
    return keys, blocks, np.arange(width) < len(entries)


def _probe_keys(keys, width=WIDTH):
    out = np.zeros((width, 4), np.uint32)
    for i, key in enumerate(keys):
        out[i] = key
    return out, np.arange(width) < len(keys)


def _blocks(blocks, width=WIDTH):
    out = np.zeros(width, np.int32)
    out[: len(blocks)] = blocks
    return out, np.arange(width) < len(blocks)


def test_num_buckets_gives_four_ways_per_entry():
    assert num_buckets_for(131072, 8) == 65536
    assert num_buckets_for(10, 8) == 8  # 40 ways needed: 5 buckets, rounded up to a power of two
    assert num_buckets_for(1, 8) == 1


def test_insert_probe_remove_by_hand():
    index = init_index(NUM_BLOCKS, NUM_GROUPS, ways=WAYS)
    num_buckets = index.num_buckets
    # Keys whose word 0 is a multiple of num_buckets land in bucket 0.
    a, b, c = _key(0), _key(num_buckets), _key(2 * num_buckets)
    # A: group 0's block 1. A again with blocks 3 (group 0, taken: the first wins) and 5 (group 1,
    # empty: filled). B fills bucket 0; C finds no empty way: dropped.
    index, placed = _insert(index, *_entries([(a, (1, 0)), (a, (3, 5)), (b, (2, 0)), (c, (4, 6))]))
    assert np.asarray(placed).tolist()[:4] == [[True, False], [False, True], [True, False], [False, False]]
    keys, valid = _probe_keys([a, b, c])
    assert np.asarray(_probe(index, keys, valid)).tolist()[:3] == [[1, 5], [2, NULL_BLOCK], [NULL_BLOCK] * 2]
    # An indexed block wins over a new block for the same key and group.
    index, placed = _insert(index, *_entries([(b, (7, 8))]))
    assert np.asarray(placed).tolist()[0] == [False, True]
    # Removing A's blocks (and block 9, not indexed: a no-op) frees its way: C now fits.
    index = _remove(index, *_blocks([1, 5, 9]))
    index, placed = _insert(index, *_entries([(c, (4, 6))]))
    assert np.asarray(placed).tolist()[0] == [True, True]
    assert np.asarray(_probe(index, keys, valid)).tolist()[:3] == [[NULL_BLOCK] * 2, [2, 8], [4, 6]]
    assert check_index(index) == {2: (b, 0), 8: (b, 1), 4: (c, 0), 6: (c, 1)}


@st.composite
def operations(draw):
    """Random insert / remove / probe calls over a small key space (many collisions)."""
    ops = []
    for _ in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["insert", "insert", "remove", "probe"]))
        n = draw(st.integers(0, WIDTH))
        keys = [_key(draw(st.integers(0, 40)), draw(st.integers(0, 1))) for _ in range(n)]
        blocks = [
            tuple(draw(st.sampled_from([0] * 2 + list(range(1, NUM_BLOCKS)))) for _ in range(NUM_GROUPS))
            for _ in range(n)
        ]
        ops.append((kind, list(zip(keys, blocks))))
    return ops


def run_operations(ops):
    index = init_index(NUM_BLOCKS, NUM_GROUPS, ways=WAYS)
    model = IndexModel(NUM_BLOCKS, NUM_GROUPS, ways=WAYS)
    for kind, entries in ops:
        if kind == "insert":
            # A block is inserted only while it is not indexed (the manager's rule), once per call.
            seen = set(model.block_key) | {NULL_BLOCK}
            fresh = []
            for key, blocks in entries:
                row = []
                for b in blocks:
                    row.append(NULL_BLOCK if b in seen else b)
                    seen.add(b)
                fresh.append((key, tuple(row)))
            index, placed = _insert(index, *map(jnp.asarray, _entries(fresh)))
            expected = model.insert(fresh)
            assert np.asarray(placed).tolist()[: len(fresh)] == expected
        elif kind == "remove":
            blocks = list(dict.fromkeys(b for _, row in entries for b in row if b != NULL_BLOCK))[:WIDTH]
            index = _remove(index, *map(jnp.asarray, _blocks(blocks)))
            model.remove(blocks)
        else:
            keys, valid = _probe_keys([key for key, _ in entries])
            found = np.asarray(_probe(index, jnp.asarray(keys), jnp.asarray(valid))).tolist()
            assert found[: len(entries)] == [[model.probe(key, g) for g in range(NUM_GROUPS)] for key, _ in entries]
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


@pytest.mark.parametrize("width", [1, 100])
def test_many_entries_in_one_call(width):
    # One entry, and more entries than the retry rounds take at once, in a few buckets.
    index = init_index(256, 1, num_entries=width, ways=8)
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**32, (width, 4), dtype=np.uint32)
    blocks = np.arange(1, width + 1, dtype=np.int32)[:, None]
    index, placed = _insert(index, keys, blocks, np.ones(width, bool))
    model = IndexModel(256, 1, ways=8, num_entries=width)
    assert np.asarray(placed).tolist() == model.insert(list(zip(keys, blocks)))
    np.testing.assert_array_equal(
        np.asarray(_probe(index, keys, np.ones(width, bool)))[:, 0],
        np.where(np.asarray(placed)[:, 0], blocks[:, 0], NULL_BLOCK),
    )


@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.data())
def test_claim_then_unclaim_restores_the_pool(data):
    # pool.claim counts each free block once, at its first entry; unclaim restores the free order.
    pool = init_pool(10)
    blocks = data.draw(st.lists(st.integers(1, 9), max_size=8), label="claimed")
    padded, valid = _blocks(blocks, 8)
    claimed, was_free = jax.jit(claim)(pool, padded, valid)
    expected = [b not in blocks[:i] for i, b in enumerate(blocks)]
    assert np.asarray(was_free).tolist()[: len(blocks)] == expected
    assert int(claimed.num_free_blocks) == 9 - len(set(blocks))
    restored = jax.jit(unclaim)(claimed, padded, valid)
    for name in ("ref_cnt", "free_ring", "queue_pos", "ring_head", "ring_count", "num_free_blocks"):
        np.testing.assert_array_equal(getattr(restored, name), getattr(pool, name), err_msg=name)
