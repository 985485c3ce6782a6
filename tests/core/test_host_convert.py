"""`jaxkv.core.host_convert`: a ManagerState made by real traffic goes to a host object and back unchanged in
meaning, and the jitted transitions carry on from the converted state exactly as from the original."""

import chex
import jax
import numpy as np
import pytest
from model_reference import ModelState, assert_state_matches
from numba.experimental.structref import StructRefProxy
from tiny_configs import full, make_cfg, mamba, sliding

import jaxkv
from jaxkv import KVCacheManager
from jaxkv.core.host import HostState
from jaxkv.core.host_convert import load_state, to_state
from jaxkv.core.pool import NOT_CACHED, free_order
from jaxkv.core.state import init_state
from jaxkv.prefix.index import index_entries
from jaxkv.prefix.state import PrefixCacheConfig

# (config, manager options): small pools, so that cached blocks are evicted and reused.
CASES = {
    "no_prefix": (make_cfg(20, full(2), sliding(2, 4), max_num_batched_tokens=16), dict(enable_prefix_caching=False)),
    # A state group and full attention of block 4 and a sliding window of block 2, unit 2: hits inside blocks of
    # the first two, pinned copies, prompt lengths, window retention.
    "prefix": (
        make_cfg(38, mamba(4), full(4), sliding(2, 4), max_model_len=24, max_num_batched_tokens=16),
        dict(prefix_match_unit=2),
    ),
}
PROMPT = list(range(100, 111))  # 11 tokens: prompt tail p* = 10 with unit 2, inside block 2 of block size 4


def empty_host(mgr):
    """A stand-in for the host object: only what `load_state` needs before it fills the rest."""
    return HostState(mgr.cfg, mgr.max_num_seqs, mgr.prefix_config)


def key_words(key: int) -> tuple[int, ...]:
    return tuple((key >> (32 * i)) & 0xFFFFFFFF for i in range(4))


def model_of(host) -> ModelState:
    """The host's attributes written into the reference model, so `assert_state_matches` compares a state with them."""
    model = ModelState(host.cfg, host.max_num_seqs, host.prefix)
    model.ref_cnt = host.ref.tolist()
    model.order = host.free_order()
    model.cached_group = {b: g for b, g in enumerate(host.group_of.tolist()) if g != NOT_CACHED}
    model.tables = np.asarray(host.tables)
    model.first_live = np.asarray(host.first_live).T.tolist()
    model.num_computed = list(host.num_computed)
    if host.prefix is not None:
        model.index.fields = {
            key_words(key): {g: b for g, b in enumerate(fields) if b} for key, fields in host.index.items()
        }
        model.hashes = [[tuple(w) for w in host.unit_keys(s).tolist()] for s in range(host.max_num_seqs)]
        model.num_cached = np.asarray(host.num_cached).T.tolist()
        model.shared_len = list(host.shared_len)
        model.prompt_len = list(host.prompt_len)
        model.copies = dict(host.copies)
    return model


def assert_host_matches(host, state):
    """The host attributes `assert_state_matches` leaves out: types, the free count, keys word for word."""
    state = jax.device_get(state)
    assert host.ref.dtype == host.group_of.dtype == np.int32
    assert host.num_free == len(host.free_order()) == int(state.pool.num_free_blocks)
    assert isinstance(host.tables, np.ndarray) and host.tables.dtype == np.int32
    assert len(host.first_live) == host.max_num_seqs and len(host.ref) == len(host.group_of) == host.cfg.num_blocks
    if host.prefix is None:
        return
    cached = np.flatnonzero(state.pool.block_group != NOT_CACHED)
    entry = host.block_slot[cached] // len(host.cfg.groups)
    np.testing.assert_array_equal(host.slots[entry, :4], state.pool.block_hash[cached], err_msg="cached blocks' keys")
    assert (host.num_buckets, host.ways) == state.prefix.index.slots.shape[:2]
    np.testing.assert_array_equal(host.keys, state.prefix.req_hashes)
    np.testing.assert_array_equal(host.num_hashed, state.prefix.num_hashed_units)


def assert_same_state(a, b):
    """Every array of two states equal in meaning: stale ring entries, index ways and cache-pass stamps may differ."""
    a, b = jax.device_get(a), jax.device_get(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        assert (np.shape(x), np.asarray(x).dtype) == (np.shape(y), np.asarray(y).dtype)
    for name in ("block_tables", "first_live_idx", "num_computed"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for name in ("ref_cnt", "num_free_blocks", "block_group"):
        np.testing.assert_array_equal(getattr(a.pool, name), getattr(b.pool, name), err_msg=name)
    assert free_order(a.pool).tolist() == free_order(b.pool).tolist(), "free order"
    cached = a.pool.block_group != NOT_CACHED
    np.testing.assert_array_equal(a.pool.block_hash[cached], b.pool.block_hash[cached], err_msg="block_hash")
    if a.prefix is None:
        assert b.prefix is None
        return
    blocks = [{k: block for k, (block, _) in index_entries(s.prefix.index).items()} for s in (a, b)]
    assert blocks[0] == blocks[1], "index entries"
    for name in ("num_hashed_units", "num_cached_blocks", "shared_len", "prompt_len", "copy_src"):
        np.testing.assert_array_equal(getattr(a.prefix, name), getattr(b.prefix, name), err_msg=name)
    for s, n in enumerate(a.prefix.num_hashed_units.tolist()):
        np.testing.assert_array_equal(a.prefix.req_hashes[s, :n], b.prefix.req_hashes[s, :n], err_msg="req_hashes")


def admit(mgr, rid, tokens):
    """Adds a request and allocates its prompt, claiming the hit the lookup finds. Returns (hit, ok, copies)."""
    mgr.add_request(rid, tokens)
    hit = mgr.get_computed_tokens(rid)
    ok = mgr.allocate_slots(rid, len(tokens) - hit, hit)
    return hit, ok, mgr.take_block_copies().tolist()


def traffic_before(mgr):
    """Hits, freed requests' cached blocks claimed back from the free order, pending copies (unit 2)."""
    out = []
    mgr.add_request("a", PROMPT)
    for k in (4, 4, 2, 1):  # chunks end at block ends and at p* = 10: the states there become findable
        out.append((mgr.allocate_slots("a", k), mgr.take_block_copies().tolist()))
    out.append(admit(mgr, "b", PROMPT[:10] + [7, 8, 9]))  # unit 2: a hit of 10 tokens, inside a block
    out.append(admit(mgr, "c", [1, 2, 3, 4, 5]))
    mgr.mark_computed(["a", "c"])
    mgr.free_batch(["a", "c"])  # their last steps ran: their blocks stay findable, at the tail of the free order
    out.append(admit(mgr, "e", [1, 2, 3, 4, 5, 6, 7]))  # shares c's first tokens (no state saved there: no hit)
    out.append(admit(mgr, "d", PROMPT))  # claims a's; copies pending until the next call
    return out


def traffic_after(mgr):
    """Decodes, hits, frees and a long prompt that evicts cached blocks; yields each call's result."""
    # First caching pass after the conversion: no hit claimed, so k's blocks, recomputed, replace the indexed ones.
    mgr.add_request("k", PROMPT)
    yield mgr.allocate_slots("k", len(PROMPT))
    mgr.append_token_ids_batch(["b", "d", "e"], [[1], [2], [3]])
    yield mgr.allocate_slots_batch(["b", "d", "e"], [1, 1, 1]).tolist()
    yield admit(mgr, "f", PROMPT[:6] + [9, 9, 9, 9])
    mgr.mark_computed()  # before each free: every step ran (one free program)
    mgr.free_batch(["b", "e"])
    yield admit(mgr, "g", PROMPT[:10] + [7, 8, 9])
    mgr.mark_computed()
    mgr.free_batch(["d", "f", "g"])
    yield admit(mgr, "h", list(range(200, 222)))  # 22 new tokens: evicts cached blocks
    yield admit(mgr, "i", PROMPT)
    mgr.mark_computed()
    mgr.free_batch(["h", "i", "k"])
    yield admit(mgr, "j", PROMPT[:10] + [7, 8, 9])
    yield mgr.num_free_blocks


@pytest.mark.parametrize("case", list(CASES))
def test_converted_state_carries_on_like_the_original(case):
    cfg, options = CASES[case]
    # Twin managers under the same calls: one keeps its state, the other continues from the converted one.
    twins = [
        KVCacheManager(cfg, max_num_seqs=6, debug_checks=True, specialize_steps=False, backend="jax", **options)
        for _ in "ab"
    ]
    results = [traffic_before(mgr) for mgr in twins]
    assert results[0] == results[1]
    ids = ["b", "d", "e"]
    original = twins[0].take_state()
    twin_state = twins[1].take_state()
    assert_same_state(original, twin_state)
    if case == "prefix":  # the traffic made hits, cached blocks and pending copies
        assert (np.asarray(original.pool.block_group) != NOT_CACHED).any()
        assert int(original.pool.ring_count) > int(original.pool.num_free_blocks)  # stale entries: claimed hits
        assert np.asarray(original.prefix.copy_src).any() and np.asarray(original.prefix.prompt_len).any()
        assert np.asarray(original.prefix.shared_len).any()

    host = empty_host(twins[1])
    load_state(host, twin_state)
    assert_host_matches(host, original)
    model = model_of(host)
    assert_state_matches(original, model)
    converted = to_state(host)
    assert_same_state(original, converted)
    assert_state_matches(converted, model)
    jaxkv.check_invariants(cfg, converted, twins[1].prefix_config)
    again = empty_host(twins[1])
    load_state(again, converted)
    assert vars(again).keys() == vars(host).keys()
    for name, value in vars(host).items():
        if not isinstance(value, StructRefProxy):  # the compiled calls' structs hold the arrays compared here
            np.testing.assert_equal(getattr(again, name), value, err_msg=name)

    twins[0].adopt_state(original, ids)
    twins[1].adopt_state(converted, ids)
    for step, (expected, got) in enumerate(zip(*(traffic_after(mgr) for mgr in twins))):
        assert expected == got, f"call {step}"
        assert_same_state(twins[0].state, twins[1].state)


def test_an_empty_state_converts_to_init_state_exactly():
    # Every leaf, including the ring, queue positions and the index table, and its shape and dtype.
    cfg, _ = CASES["prefix"]
    prefix = PrefixCacheConfig.for_config(cfg, 2)
    state = init_state(cfg, 3, prefix)
    host = HostState(cfg, 3, prefix)
    load_state(host, state)
    chex.assert_trees_all_equal(to_state(host), state)
    chex.assert_trees_all_equal_dtypes(to_state(host), state)


def test_free_order_is_the_linked_order():
    cfg, _ = CASES["prefix"]
    prefix = PrefixCacheConfig.for_config(cfg)
    host = HostState(cfg, 2, prefix)
    load_state(host, init_state(cfg, 2, prefix))
    host.set_free_order([5, 3, *(b for b in range(1, cfg.num_blocks) if b not in (3, 5))])
    state = to_state(host)
    assert free_order(state.pool).tolist()[:3] == [5, 3, 1]
    assert host.free_order()[:3] == [5, 3, 1] and host.num_free == cfg.num_blocks - 1
    jaxkv.check_invariants(cfg, state, prefix)


def test_index_entries_fill_their_buckets_and_no_more():
    cfg, _ = CASES["prefix"]  # three groups
    prefix = PrefixCacheConfig.for_config(cfg, ways=2)
    host = HostState(cfg, 2, prefix)
    load_state(host, init_state(cfg, 2, prefix))
    b = host.num_buckets
    # Keys 7, 7 + b + 9·2^96 and 7 + 2b share bucket 7; the second has only group 1's block.
    host.index = {7: [4, 5, 0], 7 + b + (9 << 96): [0, 6, 0]}
    index = to_state(host).prefix.index
    assert index_entries(index) == {
        (key_words(7), 0): (4, 7 * 2),
        (key_words(7), 1): (5, 7 * 2),
        (key_words(7 + b + (9 << 96)), 1): (6, 7 * 2 + 1),
    }
    jaxkv.check_invariants(cfg, to_state(host), prefix)
    with pytest.raises(ValueError, match="bucket 7 is full"):
        host.index = {**host.index, 7 + 2 * b: [8, 0, 0]}


def test_load_state_refuses_a_host_of_another_shape():
    cfg, _ = CASES["prefix"]
    host = HostState(cfg, 3)
    with pytest.raises(ValueError, match="max_num_seqs=3"):
        load_state(host, init_state(cfg, 2))
    with pytest.raises(ValueError, match="has a prefix cache"):
        load_state(host, init_state(cfg, 3, PrefixCacheConfig.for_config(cfg)))
