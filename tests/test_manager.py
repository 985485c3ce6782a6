"""KVCacheManager: the public API of DESIGN.md, its errors, and random use against the model.

Dimensions: R requests per call, G groups, M max blocks per request.
"""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_reference import ModelState, assert_state_matches
from tiny_configs import full, make_cfg, mamba, sliding

from jaxkv import KVCacheManager, UnitHasher
from jaxkv.core import state as ms
from jaxkv.core.invariants import check_invariants
from jaxkv.core.pool import free_order
from jaxkv.manager.device_loop import reservation
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.hashing import prompt_unit_hashes
from jaxkv.prefix.index import index_entries

# Full + sliding window 4 + state group, block 2, 15 usable blocks, 3 requests at most.
CFG = make_cfg(16, full(2), sliding(2, 4), mamba(2), max_model_len=16, max_num_batched_tokens=8)
# The same without the state group.
ATTENTION_CFG = make_cfg(16, full(2), sliding(2, 4), max_model_len=16, max_num_batched_tokens=8)
BACKENDS = [("jax", CFG), ("host", CFG), ("host", ATTENTION_CFG)]
BACKEND_NAMES = ["host", "jax"]


def manager(cfg=CFG, **kw):
    mgr = KVCacheManager(cfg, max_num_seqs=3, **kw)
    # The host engine's allocations and frees are one compiled call each, checks included, without speculation.
    assert mgr._engine.checks_counts == (mgr.backend == "host" and not mgr.num_speculative_tokens)
    return mgr


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_request_lifecycle(backend):
    mgr = manager(debug_checks=True, backend=backend)
    mgr.add_request("a", [1, 2, 3, 4, 5])
    assert mgr.get_computed_tokens("a") == 0
    assert mgr.allocate_slots("a", 5, num_new_computed_tokens=0)
    full_ids, sw_ids, state_ids = mgr.get_block_ids("a")
    assert len(full_ids) == len(sw_ids) == 3 and NULL_BLOCK not in full_ids + sw_ids
    assert state_ids == (NULL_BLOCK, NULL_BLOCK, state_ids[2]) and state_ids[2] != NULL_BLOCK
    assert mgr.num_free_blocks == 15 - 7
    # Decode 3 tokens: each is appended first, then scheduled.
    for token in (6, 7, 8):
        mgr.append_token_ids("a", [token])
        assert mgr.allocate_slots("a", 1)
    full_ids, sw_ids, state_ids = mgr.get_block_ids("a")
    assert len(full_ids) == 4 and NULL_BLOCK not in full_ids
    assert sw_ids[0] == NULL_BLOCK  # 7 computed before the last call: positions > 3 kept
    assert mgr.num_computed_tokens("a") == 8 and mgr.num_tokens("a") == 8
    mgr.free("a")
    assert mgr.num_free_blocks == 15
    mgr.add_request("a", [1, 2])  # the id may come back
    assert mgr.num_requests == 1


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_batch_stops_at_the_first_request_that_does_not_fit(backend):
    mgr = manager(debug_checks=True, backend=backend)
    for rid, n in (("a", 6), ("b", 16), ("c", 2)):
        mgr.add_request(rid, list(range(n)))
    # a: 3 + 3 + 1 blocks; b would need 8 + 8 + 1 > 8 left; c fits but comes after b.
    ok = mgr.allocate_slots_batch(["a", "b", "c"], [6, 16, 2])
    assert ok.tolist() == [True, False, False]
    assert mgr.get_block_ids("b") == ((), (), ())
    assert mgr.allocate_slots_batch(["c", "b"], [2, 2]).tolist() == [True, True]


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_full_sequence_must_fit_per_request(backend):
    # Caps per request: full 8 blocks, sliding cdiv(4 - 1 + 8, 2) + 1 = 7, state 1.
    def admit(must_fit):
        mgr = manager(debug_checks=True, backend=backend)
        mgr.add_request("long", list(range(12)))  # whole: 6 + 6 + 1 = 13 blocks; a 4-token chunk: 2 + 2 + 1
        mgr.add_request("short", list(range(10)))  # whole: 5 + 5 + 1 = 11 blocks
        return mgr.allocate_slots_batch(["long", "short"], [4, 4], full_sequence_must_fit=must_fit).tolist()

    assert admit(False) == [True, True]
    assert admit(True) == [True, False]  # 5 taken by "long" + 11 > 15
    assert admit([True, False]) == [True, True]


def test_deferred_frees_ride_on_the_next_allocation():
    mgr = manager(debug_checks=False, backend="jax")
    mgr.add_request("a", list(range(8)))  # 4 + 4 + 1 blocks
    mgr.add_request("b", list(range(4)))  # 2 + 2 + 1 blocks
    assert mgr.allocate_slots_batch(["a", "b"], [8, 4]).tolist() == [True, True]
    slot_a = int(mgr.slots_of(["a"])[0])
    mgr.free("a")
    mgr.add_request("c", list(range(6)))  # takes a's slot before the device has freed it
    assert int(mgr.slots_of(["c"])[0]) == slot_a
    assert mgr.allocate_slots("c", 6)
    check_invariants(CFG, mgr.state)
    assert mgr.num_free_blocks == 15 - 5 - 7
    assert len(mgr.get_block_ids("c")[0]) == 3
    mgr.free_batch(["b", "c"])
    assert mgr.num_free_blocks == 15  # reading flushes the pending frees
    check_invariants(CFG, mgr.state)


def test_free_count_survives_a_key_upload():
    # Reading the state applies pending frees, then stores pending keys: a dispatch that donates the
    # state. The free count read after it comes from the new state.
    mgr = manager(backend="jax")
    mgr.add_request("a", list(range(8)))
    assert mgr.allocate_slots("a", 8)
    mgr.free("a")
    mgr.add_request("b", list(range(6)))  # keys waiting for the next dispatch
    check_invariants(CFG, mgr.state)
    assert mgr.num_free_blocks == 15


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_kernel_views(backend):
    mgr = manager(backend=backend)
    mgr.add_request("a", list(range(5)))
    mgr.add_request("b", list(range(3)))
    mgr.allocate_slots_batch(["a", "b"], [5, 3])
    tables = np.asarray(mgr.block_tables(["b", "a"]))
    assert tables.shape == (3, 2, 8)
    assert tuple(tables[0, 1, :3].tolist()) == mgr.get_block_ids("a")[0]
    mapping = np.asarray(mgr.slot_mappings(["a", "b"], [5, 3], num_tokens=10))
    a_full = mgr.get_block_ids("a")[0]
    assert mapping[0, :5].tolist() == [a_full[p // 2] * 2 + p % 2 for p in range(5)]
    assert mapping[0, 8:].tolist() == [-1, -1]
    with pytest.raises(ValueError, match="num_tokens=4"):
        mgr.slot_mappings(["a", "b"], [5, 3], num_tokens=4)


def test_warm_up_changes_nothing():
    mgr = manager(backend="jax")
    mgr.warm_up()
    assert mgr.num_free_blocks == 15
    check_invariants(CFG, mgr.state)


@pytest.mark.parametrize("backend, cfg", BACKENDS)
def test_errors_name_the_offending_value(backend, cfg):
    mgr = manager(cfg, backend=backend)
    mgr.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="'a' was already added"):
        mgr.add_request("a", [1])
    with pytest.raises(KeyError, match="unknown request id 'zz'"):
        mgr.allocate_slots("zz", 1)
    with pytest.raises(KeyError, match="unknown request id 'zz'"):
        mgr.free("zz")
    with pytest.raises(ValueError, match="17 prompt tokens, more than max_model_len=16"):
        mgr.add_request("long", list(range(17)))
    with pytest.raises(ValueError, match="empty prompt"):
        mgr.add_request("empty", [])
    with pytest.raises(ValueError, match="num_new_tokens=-1 for request 'a' is negative"):
        mgr.allocate_slots("a", -1)
    with pytest.raises(ValueError, match="'a' has 3 tokens, 0 computed: it cannot schedule 4 more"):
        mgr.allocate_slots("a", 4)
    with pytest.raises(ValueError, match="num_new_computed_tokens=3 for request 'a'"):
        mgr.allocate_slots("a", 0, num_new_computed_tokens=3)  # a hit never covers the last token
    assert not mgr.allocate_slots("a", 1, num_new_computed_tokens=2)  # not in the cache: refused
    with pytest.raises(ValueError, match="request 'a' appears twice"):
        mgr.allocate_slots_batch(["a", "a"], [1, 1])
    with pytest.raises(ValueError, match="num_new_tokens has 2 entries"):
        mgr.allocate_slots_batch(["a"], [1, 1])
    with pytest.raises(ValueError, match="full_sequence_must_fit has 2 entries"):
        mgr.allocate_slots_batch(["a"], [1], full_sequence_must_fit=[True, False])
    mgr.add_request("b", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="full_sequence_must_fit has 1 entries"):
        mgr.allocate_slots_batch(["a", "b"], [1, 1], full_sequence_must_fit=[True])
    with pytest.raises(ValueError, match="num_new_computed_tokens=-2 for request 'b' is negative"):
        mgr.allocate_slots_batch(["a", "b"], [1, 1], [0, -2])
    assert mgr.allocate_slots("b", 2)
    free = mgr.num_free_blocks
    with pytest.raises(ValueError, match="num_new_computed_tokens=2 for request 'b'"):
        mgr.allocate_slots_batch(["a", "b"], [1, 1], [0, 2])  # not the request's first call
    with pytest.raises(ValueError, match="'b' has 4 tokens, 2 computed: it cannot schedule 3 more"):
        mgr.allocate_slots_batch(["a", "b"], [1, 3])
    # The refused calls changed nothing.
    assert (mgr.num_computed_tokens("a"), mgr.num_computed_tokens("b"), mgr.num_free_blocks) == (0, 2, free)
    mgr.free("b")
    with pytest.raises(ValueError, match="would have 17 tokens"):
        mgr.append_token_ids("a", list(range(14)))
    mgr.add_request("b", [1])
    mgr.add_request("c", [1])
    with pytest.raises(ValueError, match="max_num_seqs=3"):
        mgr.add_request("d", [1])
    with pytest.raises(ValueError, match="prefix caching is off"):
        KVCacheManager(CFG, max_num_seqs=3, enable_prefix_caching=False).add_request("a", [1], cache_salt="s1")
    with pytest.raises(TypeError, match="KVCacheConfig"):
        KVCacheManager({"num_blocks": 16})
    assert mgr.num_free_blocks == 15  # nothing above changed the pool
    check_invariants(cfg, mgr.state)


@pytest.mark.parametrize("backend, cfg", BACKENDS)
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_random_use_matches_model(backend, cfg, data):
    """add / lookup / batched allocate (hits claimed, prefill chunks, decodes) / mark computed / free / preempt /
    device loops through the facade; the device state (block ids, prefix-cache index included) equals the model
    after every allocation. A request freed without `mark_computed` since its last allocation caches nothing
    of that step. A device loop (`hand_over`, `hand_back`) is, in the model, an allocation of lookahead slots
    (after a rollback of the request's unused slots of an earlier loop, where its next call settles it)."""
    mgr = manager(cfg, debug_checks=data.draw(st.booleans(), label="debug_checks"), backend=backend)
    model = ModelState(cfg, 3, mgr.prefix_config)
    running: list[str] = []  # admission order
    tokens: dict[str, list[int]] = {}
    shared: dict[str, int] = {}  # the shared length of each request's last lookup (0: none since it was added)
    written: dict[str, int] = {}  # tokens whose step is known to have run (mark_computed, or a later call)
    unused: dict[str, int] = {}  # the requests of the last device loop and their slots it did not use
    state_blocks = {g.block_size for g in cfg.groups if g.kind == "mamba"}
    next_id = 0

    def settle(rids):  # the manager's allocation of no tokens after a loop: the unused slots go back
        slots = mgr.slots_of(rids).tolist()
        for rid in rids:
            model.set_hashes(int(mgr.slots_of([rid])[0]), prompt_unit_hashes(tokens[rid], 2))
        model.roll_back(slots, [unused.pop(rid) for rid in rids])
        assert all(model.allocate(slots, [0] * len(slots), None, [0] * len(slots)))

    for _ in range(data.draw(st.integers(1, 20), label="num_ops")):
        ops = ["add", "allocate", "allocate", "append", "mark", "free", "preempt", "loop", "loop"]
        op = data.draw(st.sampled_from(ops), label="op")
        if unused and op not in ("add", "loop"):  # any call that reads or changes the state settles them first
            settle(list(unused))
        if op == "add" and mgr.num_requests < 3:
            rid = f"r{next_id}"
            next_id += 1
            tokens[rid] = list(range(data.draw(st.integers(1, 16), label="prompt_len")))
            mgr.add_request(rid, tokens[rid])
            shared[rid] = 0
            running.append(rid)
        elif op == "allocate" and running:
            rids = data.draw(st.permutations(running), label="order")
            rids = rids[: data.draw(st.integers(1, len(rids)), label="batch_size")]
            new_tokens, must_fit, hits = [], [], []
            for rid in rids:
                remaining = mgr.num_tokens(rid) - mgr.num_computed_tokens(rid)
                if remaining == 0 and mgr.num_tokens(rid) < 16:
                    mgr.append_token_ids(rid, [7])
                    tokens[rid].append(7)
                    remaining = 1
                hit = 0
                if mgr.num_computed_tokens(rid) == 0 and data.draw(st.booleans(), label="look_up"):
                    hit = mgr.get_computed_tokens(rid)
                    model_hit, shared[rid] = model.lookup(prompt_unit_hashes(tokens[rid], 2), len(tokens[rid]))
                    assert hit == model_hit
                hits.append(hit)
                new_tokens.append(data.draw(st.integers(0, min(remaining - hit, 8)), label="num_new_tokens"))
                must_fit.append(mgr.num_computed_tokens(rid) == 0 and data.draw(st.booleans(), label="must_fit"))
            slots = mgr.slots_of(rids).tolist()
            for rid in rids:  # the call says their earlier steps ran
                written[rid] = mgr.num_computed_tokens(rid)
            full = [mgr.num_tokens(rid) if fit else 0 for rid, fit in zip(rids, must_fit)]
            shared_tokens = [shared[rid] if mgr.num_computed_tokens(rid) == 0 else 0 for rid in rids]
            ok = mgr.allocate_slots_batch(rids, new_tokens, hits, full_sequence_must_fit=must_fit)
            for rid in running:  # every request's keys ride with the allocation
                model.set_hashes(int(mgr.slots_of([rid])[0]), prompt_unit_hashes(tokens[rid], 2))
            assert ok.tolist() == model.allocate(slots, new_tokens, full, hits, num_shared_tokens=shared_tokens)
            for rid, hit, fits in zip(rids, hits, ok):
                written[rid] += hit if fits else 0  # claimed hits hold cached content
            assert mgr.num_free_blocks == model.num_free_blocks
            assert_state_matches(mgr._engine._state if backend == "jax" else mgr.state, model)  # jax: no read, no flush
            for rid, slot in zip(rids, slots):
                for g, ids in enumerate(mgr.get_block_ids(rid)):
                    assert list(ids) == model.tables[g][slot][: len(ids)]
        elif op == "loop" and running:
            if not unused:  # requests whose tokens are all computed decode: their sampled token first
                for rid in running:
                    if 0 < mgr.num_computed_tokens(rid) == mgr.num_tokens(rid) < 16:
                        mgr.append_token_ids(rid, [7])
                        tokens[rid].append(7)
                        written[rid] = mgr.num_computed_tokens(rid)
            rids = [rid for rid in running if 0 < mgr.num_computed_tokens(rid) == mgr.num_tokens(rid) - 1]
            if unused and set(unused) - set(rids):  # a loop over other requests settles them first
                settle([rid for rid in unused if rid not in rids])
            wanted = [data.draw(st.integers(0, 6), label="wanted") for _ in rids]
            slots = mgr.slots_of(rids).tolist()
            n = np.array([mgr.num_computed_tokens(rid) for rid in rids], np.int64)
            reserved = reservation(16, state_blocks, n, np.array(wanted, np.int64)).tolist()
            loop = mgr.hand_over(rids, wanted)
            copies = mgr.take_block_copies()
            assert not len(copies)  # hits end at block ends: no copies
            for rid in rids:
                model.set_hashes(int(mgr.slots_of([rid])[0]), prompt_unit_hashes(tokens[rid], 2))
                written[rid] = mgr.num_computed_tokens(rid)
            model.roll_back(slots, [unused.pop(rid, 0) for rid in rids])
            zeros = [0] * len(rids)
            ok = model.allocate(slots, zeros, None, zeros, num_lookahead_tokens=reserved)
            assert (loop is not None) == all(ok)
            if loop is None:  # the rows that fit give their slots back at once
                model.roll_back(slots, [r if fits else 0 for r, fits in zip(reserved, ok)])
                assert all(model.allocate(slots, zeros, None, zeros))
            else:
                assert np.asarray(loop.num_reserved).tolist() == reserved
                produced = [[5] * data.draw(st.integers(0, r), label="computed_in_loop") for r in reserved]
                mgr.hand_back(rids, produced)
                for rid, r, new in zip(rids, reserved, produced):
                    tokens[rid] += new
                    written[rid] += len(new)
                    unused[rid] = r - len(new)
        elif op == "append" and running:  # sampled tokens, or a prompt that grows: the last step ran
            rid = data.draw(st.sampled_from(running), label="append_to")
            room = 16 - mgr.num_tokens(rid)
            new = data.draw(st.lists(st.integers(0, 9), max_size=min(room, 5)), label="appended")
            mgr.append_token_ids(rid, new)
            tokens[rid] += new
            written[rid] = mgr.num_computed_tokens(rid)
        elif op == "mark" and running:  # the step of these requests' allocations ran
            rids = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True), label="mark")
            mgr.mark_computed(rids)
            written.update((rid, mgr.num_computed_tokens(rid)) for rid in rids)
        elif op in ("free", "preempt") and running:
            rids = (
                [running[-1]]
                if op == "preempt"
                else data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True), label="free")
            )
            model.free(mgr.slots_of(rids).tolist(), [written.get(rid, 0) for rid in rids])
            mgr.free_batch(rids)
            for rid in rids:
                running.remove(rid)
                written[rid] = 0
                if op == "preempt":  # back to waiting, computed tokens forgotten: re-added later
                    mgr.add_request(rid, tokens[rid])
                    shared[rid] = 0
                    running.append(rid)
    if unused:
        settle(list(unused))
    check_invariants(cfg, mgr.state)  # reading the state stores the pending keys
    for rid in running:
        model.set_hashes(int(mgr.slots_of([rid])[0]), prompt_unit_hashes(tokens[rid], 2))
    assert_state_matches(mgr.state, model)


def test_hits_inside_a_block_hand_out_copies():
    # State + full attention, block 4, unit 2 (a Qwen3-Next-like hybrid with a finer prefix_match_unit).
    cfg = make_cfg(20, mamba(4), full(4), max_model_len=24, max_num_batched_tokens=16)
    mgr = KVCacheManager(cfg, max_num_seqs=3, prefix_match_unit=2, debug_checks=True)
    a = list(range(100, 111))  # prompt tail p* = 10, inside block 2
    mgr.add_request("a", a)
    assert mgr.allocate_slots("a", 10)  # the scheduler ends a chunk at p* (vLLM's align mode)
    assert len(mgr.take_block_copies()) == 0
    assert mgr.allocate_slots("a", 1)  # the state after 10 tokens is saved: A moves to a copy
    ((src, dst, valid),) = mgr.take_block_copies().tolist()
    assert valid == 2 and mgr.get_block_ids("a")[0][2] == dst
    mgr.add_request("b", a[:10] + [7, 8, 9])
    assert mgr.get_computed_tokens("b") == 10
    assert mgr.allocate_slots("b", 2, num_new_computed_tokens=10)  # writes block 2 in both groups: two copies
    with pytest.raises(ValueError, match="take_block_copies"):
        mgr.block_tables(["b"])
    copies = mgr.take_block_copies()
    assert sorted(copies[:, 1].tolist()) == sorted([mgr.get_block_ids("b")[0][2], mgr.get_block_ids("b")[1][2]])
    assert mgr.get_block_ids("b")[1][:2] == mgr.get_block_ids("a")[1][:2]  # full blocks shared
    mgr.free("b")
    mgr.free("a")
    assert mgr.num_free_blocks < 19  # the copies' blocks stay pinned until the next allocation
    mgr.add_request("c", [1, 2, 3])
    assert mgr.allocate_slots("c", 3)
    mgr.free("c")
    assert mgr.num_free_blocks == 19
    # Without the finer unit the same schedule hits only what block ends saved.
    coarse = KVCacheManager(cfg, max_num_seqs=3, debug_checks=True)
    coarse.add_request("a", a)
    assert coarse.allocate_slots("a", 10) and coarse.allocate_slots("a", 1)
    coarse.add_request("b", a[:10] + [7, 8, 9])
    assert coarse.get_computed_tokens("b") == 0  # no step ended at 4 or 8


def test_keys_appended_before_the_upload_go_once():
    # 60 prompt keys and 4 appended ones wait together: the upload holds each key once (64 rows: the
    # smallest upload width), and the device has all 64.
    cfg = make_cfg(200, full(2), max_model_len=256, max_num_batched_tokens=16)
    mgr = KVCacheManager(cfg, max_num_seqs=2, backend="jax")
    mgr.add_request("a", list(range(121)))
    mgr.append_token_ids("a", list(range(200, 208)))
    state = mgr.state
    keys = prompt_unit_hashes(list(range(121)) + list(range(200, 208)), 2)
    assert int(state.prefix.num_hashed_units[0]) == 64
    np.testing.assert_array_equal(np.asarray(state.prefix.req_hashes)[0, :64], keys)


def test_state_lives_on_the_given_device():
    device = jax.devices("cpu")[0]
    mgr = KVCacheManager(CFG, max_num_seqs=3, device=device, backend="jax")
    mgr.add_request("a", list(range(9)))
    assert mgr.allocate_slots("a", 9)
    assert {leaf.devices().pop() for leaf in jax.tree_util.tree_leaves(mgr.state)} == {device}
    assert mgr.block_tables(["a"]).devices() == {device}
    check_invariants(CFG, mgr.state)


def test_host_backend_hands_its_state_to_a_jitted_loop_and_back():
    """A host manager and a jitted one serve the same calls; a jitted loop step runs on each one's state
    (`take_state` / `adopt_state`) and both go on equal, the tables the model reads included."""
    cfg = make_cfg(40, full(2), sliding(2, 4), mamba(2), max_model_len=16, max_num_batched_tokens=8)
    managers = [
        KVCacheManager(cfg, max_num_seqs=3, backend=b, debug_checks=True, specialize_steps=False)  # one program
        for b in ("jax", "host")
    ]
    for mgr in managers:
        mgr.add_request("a", list(range(5)))
        mgr.add_request("b", list(range(5)) + [5, 6])
        hit = mgr.get_computed_tokens("b")
        assert mgr.allocate_slots_batch(["a", "b"], [4, 0]).all()
        assert mgr.allocate_slots_batch(["a"], [1]).all()  # a state saved at 4 tokens is indexed
        mgr.mark_computed()
        assert mgr.get_computed_tokens("b") == 4 and hit == 0
        assert mgr.allocate_slots_batch(["b"], [3], [4]).all()
        state = mgr.take_state()
        slots = mgr.slots_of(["a", "b"])
        state, result = ms.allocate(state, slots, np.asarray([1, 1], np.int32), cfg=cfg, prefix=mgr.prefix_config)
        assert np.asarray(result.ok).all()
        mgr.adopt_state(state, ["a", "b"])
        mgr.append_token_ids_batch(["a", "b"], [[1, 2], [3, 4]])  # the loop's token and the one it sampled
        assert mgr.allocate_slots_batch(["a", "b"], [1, 1]).all()
    jax_mgr, host_mgr = managers
    assert_same_state(jax_mgr.state, host_mgr.state)
    np.testing.assert_array_equal(jax_mgr.block_tables(["a", "b"]), host_mgr.block_tables(["a", "b"]))
    meta = [m.step_metadata(["a", "b"], [1, 1], num_tokens=8) for m in managers]
    jax.tree_util.tree_map(np.testing.assert_array_equal, meta[0], meta[1])
    state = host_mgr.take_state()
    with pytest.raises(ValueError, match="handed over"):
        host_mgr.free("a")
    host_mgr.adopt_state(state, [])
    with pytest.raises(ValueError, match="backend='gpu'"):
        KVCacheManager(CFG, backend="gpu")
    with pytest.raises(ValueError, match="backend='host'"):
        KVCacheManager(CFG, backend="host", device=jax.devices("cpu")[0])


def assert_same_state(a, b):
    a, b = jax.device_get((a, b))
    for name in ("block_tables", "num_computed", "first_live_idx"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    for name in ("ref_cnt", "block_group", "num_free_blocks"):
        np.testing.assert_array_equal(getattr(a.pool, name), getattr(b.pool, name), err_msg=name)
    assert free_order(a.pool).tolist() == free_order(b.pool).tolist()
    assert index_entries(a.prefix.index).keys() == index_entries(b.prefix.index).keys()
    for name in ("num_cached_blocks", "shared_len", "copy_src", "num_hashed_units"):
        np.testing.assert_array_equal(getattr(a.prefix, name), getattr(b.prefix, name), err_msg=name)


def engine_keys(mgr, request_id) -> np.ndarray:
    """The unit keys the manager's engine holds for the request (its state, pending keys stored first)."""
    state, slot = mgr.state, mgr.slots_of([request_id])[0]
    return np.asarray(state.prefix.req_hashes[slot, : int(state.prefix.num_hashed_units[slot])])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_batched_appends_hash_only_completed_units(backend):
    mgr = manager(backend=backend)
    mgr.add_request("a", [1, 2, 3])  # unit 2: one unit hashed, one token pending
    mgr.add_request("b", [4, 5])
    mgr.append_token_ids_batch(["a", "b"], [[4], [6]])  # a completes unit 1; b has one token pending
    assert mgr.num_tokens("a") == 4 and mgr.num_tokens("b") == 3
    np.testing.assert_array_equal(engine_keys(mgr, "a"), prompt_unit_hashes([1, 2, 3, 4], 2))
    np.testing.assert_array_equal(engine_keys(mgr, "b"), prompt_unit_hashes([4, 5], 2))
    mgr.append_token_ids_batch(["b"], [[7, 8, 9]])
    np.testing.assert_array_equal(engine_keys(mgr, "b"), prompt_unit_hashes([4, 5, 6, 7, 8, 9], 2))
    with pytest.raises(ValueError, match="more than max_model_len"):
        mgr.append_token_ids_batch(["a"], [list(range(13))])
    assert mgr.num_tokens("a") == 4  # nothing recorded


def test_a_preempted_requests_hasher_comes_back_with_its_grown_prompt():
    # The serving loop hashes at arrival and passes its hasher; the manager extends it only by completed
    # units (unit 2), so after an odd number of appends it holds one token less than the grown prompt.
    mgr = manager()
    hasher = UnitHasher(mgr.prefix_config.unit)
    hasher.extend([1, 2, 3, 4])
    mgr.add_request("a", [1, 2, 3, 4], unit_hasher=hasher)
    assert mgr.allocate_slots("a", 4)
    mgr.append_token_ids("a", [5])
    assert hasher.num_tokens == 4
    mgr.free("a")  # preempted: comes back with its 5 tokens as the prompt
    mgr.add_request("a", [1, 2, 3, 4, 5], unit_hasher=hasher)
    np.testing.assert_array_equal(engine_keys(mgr, "a"), prompt_unit_hashes([1, 2, 3, 4, 5], 2))
    assert hasher.num_tokens == 5
    assert mgr.get_computed_tokens("a") == 4
    with pytest.raises(ValueError, match="unit_hasher has taken 5 tokens, the prompt of request 'b' has 4"):
        mgr.add_request("b", [1, 2, 3, 4], unit_hasher=hasher)


@pytest.mark.parametrize("ran", [False, True])
def test_a_step_not_known_to_have_run_leaves_nothing_findable(ran):
    # State + full attention, block 4. Request "a" computes its 10-token prompt in chunks of 4, 4 and 2. Each
    # allocation indexes the full-attention blocks it fills; the state after 8 tokens is saved at the next call or
    # at free. Whether "a"'s last step ran is known only if the caller says so (mark_computed).
    cfg = make_cfg(20, mamba(4), full(4), max_model_len=24, max_num_batched_tokens=16)
    prompt = list(range(100, 110))
    mgr = KVCacheManager(cfg, max_num_seqs=2, debug_checks=True)
    mgr.add_request("a", prompt)
    assert mgr.allocate_slots("a", 4)
    assert mgr.allocate_slots("a", 4)  # this call says the first step ran: the state after 4 tokens is saved
    if ran:
        mgr.mark_computed(["a"])
    mgr.free("a")  # an abort (ran=False): the second step's forward pass may never have run
    mgr.add_request("b", prompt)
    # Not known to have run: only the first step's state (4) and attention block are findable; block 1, which
    # the second allocation indexed before its step, left the index.
    assert mgr.get_computed_tokens("b") == (8 if ran else 4)
    check_invariants(cfg, mgr.state, mgr.prefix_config)


@pytest.mark.parametrize("backend", ["jax", "host"])
def test_sampled_tokens_say_the_step_ran(backend):
    # Full attention only, block 2: the tokens the model produced (append_token_ids) are the step's output, so
    # the blocks its allocation indexed stay findable after a free.
    cfg = make_cfg(16, full(2), max_model_len=16, max_num_batched_tokens=8)
    mgr = KVCacheManager(cfg, max_num_seqs=2, debug_checks=True, backend=backend)
    mgr.add_request("a", [1, 2, 3, 4, 5])
    assert mgr.allocate_slots("a", 5)
    mgr.append_token_ids("a", [6])
    mgr.free("a")
    mgr.add_request("b", [1, 2, 3, 4, 5, 6, 7])
    assert mgr.get_computed_tokens("b") == 4
    mgr.free("b")
    mgr.add_request("c", [1, 2, 3, 4, 5])
    assert mgr.allocate_slots("c", 5)
    mgr.free("c")  # no token, no mark: its allocation's blocks (which replaced a's in the index) leave it
    mgr.add_request("d", [1, 2, 3, 4, 5, 6, 7])
    assert mgr.get_computed_tokens("d") == 0


def test_requests_shorter_than_one_unit_never_hit():
    # A state group's page enlarges the block past max_model_len (block 8, requests of at most 6 tokens): no
    # request fills a hash unit, so nothing is indexed and lookups find nothing, without failing.
    cfg = make_cfg(16, mamba(8), full(8), max_model_len=6, max_num_batched_tokens=8)
    mgr = KVCacheManager(cfg, max_num_seqs=2, debug_checks=True)
    mgr.add_request("a", [1, 2, 3, 4, 5])
    assert mgr.get_computed_tokens("a") == 0
    assert mgr.allocate_slots("a", 5)
    mgr.mark_computed()
    mgr.free("a")
    mgr.add_request("b", [1, 2, 3, 4, 5])
    assert mgr.get_computed_tokens("b") == 0
    assert mgr.allocate_slots("b", 5)
    check_invariants(cfg, mgr.state, mgr.prefix_config)


def test_a_device_loop_gets_its_rows_and_gives_back_what_it_computed():
    """`hand_over` reserves a decoding request's next tokens and hands over its tables and counts; `hand_back`
    counts what the loop computed, gives the rest back and indexes what it filled, as an allocation of no
    tokens. Both engines end equal, block for block; the host steps of the same tokens, then an allocation of
    none, hold as many blocks at the same entries and give the same hits (which blocks: the reservation took
    them in another order). The manager refuses other calls in between."""
    twins = [KVCacheManager(ATTENTION_CFG, max_num_seqs=3, backend=b, debug_checks=True) for b in ("jax", "host")]
    stepped = KVCacheManager(ATTENTION_CFG, max_num_seqs=3, debug_checks=True)  # one host step per token
    for mgr in (*twins, stepped):
        mgr.add_request("a", [1, 2, 3, 4, 5])
        assert mgr.allocate_slots("a", 5)  # blocks 0-2 of each group
        mgr.append_token_ids("a", [6])  # the token its prefill sampled: a decoding request
    for mgr in twins:
        rows = mgr.hand_over(["a"], [4], num_rows=3)
        # Positions 5-8 (blocks 2-4); the tables' 5 entries rounded up to 8 (a power of two, the whole width).
        assert np.asarray(rows.num_reserved).tolist() == [4, 0, 0]
        assert np.asarray(rows.req_slots).tolist() == [0, 3, 3]  # padding rows: 3
        assert np.asarray(rows.state.num_computed).tolist() == [5, 0, 0]
        tables = np.asarray(rows.state.block_tables)
        assert tables.shape == (2, 3, 8) and (tables[:, 1:] == NULL_BLOCK).all()
        assert (tables[0, 0, :5] != NULL_BLOCK).all() and (tables[0, 0, 5:] == NULL_BLOCK).all()
        with pytest.raises(ValueError, match="hand_over"):
            mgr.allocate_slots("a", 1)
        mgr.add_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # requests still arrive
        mgr.hand_back(["a"], [[7, 8]])  # it computed positions 5 and 6: the block of position 8 goes back
    for tokens in ([7], [8]):
        assert stepped.allocate_slots("a", 1)
        stepped.append_token_ids("a", tokens)
    assert stepped.allocate_slots("a", 0)  # releases the window's block 1 (7 computed tokens)
    stepped.add_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    for mgr in twins:
        assert (mgr.num_computed_tokens("a"), mgr.num_tokens("a")) == (7, 8)
        held = [[block != NULL_BLOCK for block in group] for group in mgr.get_block_ids("a")]
        assert held == [[block != NULL_BLOCK for block in group] for group in stepped.get_block_ids("a")]
        assert mgr.num_free_blocks == stepped.num_free_blocks
        assert mgr.get_computed_tokens("b") == stepped.get_computed_tokens("b") == 6  # blocks the loop filled
    assert_same_state(*(mgr.state for mgr in twins))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_a_device_loop_that_does_not_fit_reserves_nothing(backend):
    twins = [KVCacheManager(ATTENTION_CFG, max_num_seqs=3, backend=backend, debug_checks=True) for _ in "ab"]
    for mgr in twins:
        mgr.add_request("a", [1, 2, 3, 4, 5])
        mgr.add_request("b", [9, 8, 7, 6, 5])
        assert mgr.allocate_slots_batch(["a", "b"], [5, 5]).all()  # 12 of the 15 blocks
        mgr.append_token_ids_batch(["a", "b"], [[6], [6]])
    looped, stepped = twins
    assert looped.hand_over(["a", "b"], [10, 10]) is None  # 10 more tokens: 5 + 4 more blocks each
    # What any allocation does, even one that fails: the blocks behind the window go back.
    assert stepped.allocate_slots_batch(["a", "b"], [0, 0]).all()
    for mgr in twins:
        assert mgr.allocate_slots_batch(["a", "b"], [1, 1]).all()  # the host steps go on
    assert [looped.get_block_ids(rid) for rid in "ab"] == [stepped.get_block_ids(rid) for rid in "ab"]
    assert looped.num_free_blocks == stepped.num_free_blocks
    assert_same_state(looped.state, stepped.state)


def test_a_device_loop_takes_decoding_requests_and_stops_at_state_block_ends():
    mgr = KVCacheManager(CFG, max_num_seqs=3, debug_checks=True)  # block 2, a state group
    mgr.add_request("a", [1, 2, 3, 4, 5])
    assert mgr.allocate_slots("a", 3)
    with pytest.raises(ValueError, match="one token not computed"):
        mgr.hand_over(["a"], [3])  # two tokens of its prompt wait
    assert mgr.allocate_slots("a", 2)
    mgr.append_token_ids("a", [6])
    rows = mgr.hand_over(["a"], [3])
    assert np.asarray(rows.num_reserved).tolist() == [1]  # 5 computed: position 5 ends its state block
    with pytest.raises(ValueError, match="1 slots"):
        mgr.hand_back(["a"], [[7, 8]])
    mgr.hand_back(["a"], [[7]])
    assert np.asarray(mgr.hand_over(["a"], [3]).num_reserved).tolist() == [2]  # from 6: a whole block
    mgr.hand_back(["a"], [[]])  # nothing computed: both slots go back
    assert mgr.num_computed_tokens("a") == 6
    rows = mgr.hand_over(["a"], [16])
    assert np.asarray(rows.num_reserved).tolist() == [2]
    with pytest.raises(ValueError, match="hand_back takes the requests"):
        mgr.hand_back(["b"], [[1]])
    mgr.hand_back(["a"], [[1, 2]])
    with pytest.raises(ValueError, match="without hand_over"):
        mgr.hand_back(["a"], [[1]])
    mgr.free("a")
    mgr.add_request("long", list(range(1, 15)))
    assert mgr.allocate_slots("long", 14)  # 7 + 7 + 1 blocks: the whole pool
    mgr.append_token_ids("long", [15])  # 15 of max_model_len 16 tokens: it may produce one more
    assert np.asarray(mgr.hand_over(["long"], [4]).num_reserved).tolist() == [1]
