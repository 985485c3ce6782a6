"""ManagerState transitions against the plain-Python model, jitted and eager, with invariants after every step.

Dimensions: R rows per call (padded to S), G groups, S slots, M max blocks per request.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_reference import ModelState, assert_state_matches
from tiny_configs import chunked, full, make_cfg, mamba, sliding

from jaxkv.core import state as ms
from jaxkv.core.invariants import InvariantError, check_invariants
from jaxkv.core.pool import HASH_WORDS, mark_cached
from jaxkv.planner.specs import NULL_BLOCK

NUM_SLOTS = 4


# (config, chunk sizes): tiny pools so that allocations fail often; chunk sizes of 2 or 3
# make the release/fill loops and the pop windows run several steps.
CASES = {
    "hybrid_all_kinds": (make_cfg(24, full(2), sliding(2, 4), chunked(2, 4), mamba(2)), (3,)),
    "sw_tight_pool": (make_cfg(10, full(4), sliding(4, 8)), None),
    "mixed_block_sizes": (make_cfg(40, full(2), sliding(4, 6), mamba(4)), (2, 5)),
    "vllm_like_groups": (make_cfg(64, sliding(3, 5), sliding(3, 7), full(3)), None),
}

_mark_cached = jax.jit(mark_cached)


def _pad(values, fill):
    out = np.full(NUM_SLOTS, fill, np.int32)
    out[: len(values)] = values
    return jnp.asarray(out)


def run_random_sequence(data, cfg, chunk_sizes):
    """Draws add / allocate / free / preempt / cache operations; compares with the model after each."""
    state = ms.init_state(cfg, NUM_SLOTS)
    model = ModelState(cfg, NUM_SLOTS)
    num_tokens = {}  # slot -> tokens the request has (prompt + appended); insertion order = admission order
    check_invariants(cfg, state)
    for _ in range(data.draw(st.integers(1, 25), label="num_ops")):
        op = data.draw(st.sampled_from(["add", "allocate", "allocate", "allocate", "free", "preempt", "cache"]))
        if op == "add" and len(num_tokens) < NUM_SLOTS:
            slot = min(set(range(NUM_SLOTS)) - set(num_tokens))
            num_tokens[slot] = data.draw(st.integers(1, cfg.max_model_len), label="prompt_len")
        elif op == "allocate" and num_tokens:
            # A batch in drawn priority order: prefill chunks, decodes (a token appended first), zeros.
            slots = data.draw(st.permutations(list(num_tokens)), label="order")
            slots = slots[: data.draw(st.integers(1, len(slots)), label="batch_size")]
            new_tokens, full_tokens = [], []
            for slot in slots:
                remaining = num_tokens[slot] - model.num_computed[slot]
                if remaining == 0 and num_tokens[slot] < cfg.max_model_len:
                    num_tokens[slot] += 1  # the model produced a token: decode it
                    remaining = 1
                new_tokens.append(data.draw(st.integers(0, min(remaining, 8)), label="num_new_tokens"))
                must_fit = model.num_computed[slot] == 0 and data.draw(st.booleans(), label="must_fit")
                full_tokens.append(num_tokens[slot] if must_fit else 0)
            # Requests not in the batch may be freed in the same call, first.
            others = sorted(set(num_tokens) - set(slots))
            freed = data.draw(st.lists(st.sampled_from(others), unique=True), label="freed") if others else []
            state, result = ms.allocate(
                state,
                _pad(slots, NUM_SLOTS),
                _pad(new_tokens, 0),
                _pad(full_tokens, 0),
                _pad(freed, NUM_SLOTS),
                cfg=cfg,
                chunk_sizes=chunk_sizes,
            )
            model.free(freed)
            for slot in freed:
                del num_tokens[slot]
            expected_ok = model.allocate(slots, new_tokens, full_tokens)
            assert np.asarray(result.ok).tolist() == expected_ok + [False] * (NUM_SLOTS - len(slots))
            assert int(result.num_free_blocks) == model.num_free_blocks
        elif op in ("free", "preempt") and num_tokens:
            # preempt: the most recently admitted request loses its blocks and starts over.
            slots = (
                [list(num_tokens)[-1]]
                if op == "preempt"
                else data.draw(st.lists(st.sampled_from(list(num_tokens)), min_size=1, unique=True), label="free")
            )
            state = ms.free(state, _pad(slots, NUM_SLOTS), cfg=cfg, chunk_sizes=chunk_sizes)
            model.free(slots)
            for slot in slots:
                tokens = num_tokens.pop(slot)
                if op == "preempt":
                    num_tokens[slot] = tokens
        elif op == "cache" and num_tokens:
            # Mark a request's blocks of one group cached: freeing them appends them at the tail.
            slot = data.draw(st.sampled_from(list(num_tokens)), label="cache_slot")
            g = data.draw(st.integers(0, len(cfg.groups) - 1), label="cache_group")
            blocks = [b for b in model.tables[g][slot] if b != NULL_BLOCK]
            padded = np.zeros(model.max_blocks, np.int32)
            padded[: len(blocks)] = blocks
            valid = jnp.asarray(np.arange(model.max_blocks) < len(blocks))
            hashes = jnp.ones((model.max_blocks, HASH_WORDS), jnp.uint32)
            pool = _mark_cached(
                state.pool, jnp.asarray(padded), hashes, jnp.full(model.max_blocks, g, jnp.int32), valid
            )
            state = ms.ManagerState(
                pool=pool,
                block_tables=state.block_tables,
                first_live_idx=state.first_live_idx,
                num_computed=state.num_computed,
            )
            model.mark_cached(blocks, g)
        check_invariants(cfg, state)
        assert_state_matches(state, model)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_random_sequences_jitted(case, data):
    run_random_sequence(data, *CASES[case])


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=2, deadline=None)
@given(data=st.data())
def test_random_sequences_eager(case, data):
    with jax.disable_jit():
        run_random_sequence(data, *CASES[case])


def _allocate(state, cfg, slots, new_tokens, full_tokens=None):
    slots, new_tokens = np.asarray(slots, np.int32), np.asarray(new_tokens, np.int32)
    full = None if full_tokens is None else np.asarray(full_tokens, np.int32)
    state, result = ms.allocate(state, slots, new_tokens, full, cfg=cfg)
    check_invariants(cfg, state)
    return state, np.asarray(result.ok).tolist()


@pytest.mark.parametrize("num_computed, released", [(4, []), (5, [0]), (6, [0]), (7, [0, 1]), (11, [0, 1, 2, 3])])
def test_sliding_window_release_vector(num_computed, released):
    # vLLM's vector: window 4, block 2. The release happens inside allocate, by the tokens
    # computed before the call.
    cfg = make_cfg(16, sliding(2, 4), max_model_len=16)
    state = ms.init_state(cfg, 1)
    state, _ = _allocate(state, cfg, [0], [num_computed])  # tokens 0..n-1 computed, nothing released
    assert (np.asarray(state.block_tables[0, 0, : -(-num_computed // 2)]) != NULL_BLOCK).all()
    state, ok = _allocate(state, cfg, [0], [1])
    assert ok == [True]
    row = np.asarray(state.block_tables[0, 0])
    assert np.flatnonzero(row[: -(-(num_computed + 1) // 2)] == NULL_BLOCK).tolist() == released


@pytest.mark.parametrize("num_computed, num_released", [(4, 2), (6, 2), (12, 6)])
def test_chunked_local_release_vector(num_computed, num_released):
    # Chunk 4, block 2: blocks before the current chunk are released.
    cfg = make_cfg(16, chunked(2, 4), max_model_len=16)
    state = ms.init_state(cfg, 1)
    state, _ = _allocate(state, cfg, [0], [num_computed])
    state, _ = _allocate(state, cfg, [0], [1])
    row = np.asarray(state.block_tables[0, 0, : -(-(num_computed + 1) // 2)])
    assert np.flatnonzero(row == NULL_BLOCK).tolist() == list(range(num_released))
    assert int(state.pool.num_free_blocks) == 15 - (len(row) - num_released)


def test_state_group_keeps_latest_block():
    # Mamba, block 2: the state after n tokens lives at index (n - 1) // 2; the previous one
    # is kept through the step that writes the next, and released at the following call.
    cfg = make_cfg(8, mamba(2), max_model_len=16)
    state = ms.init_state(cfg, 1)
    state, _ = _allocate(state, cfg, [0], [3])  # state block at index 1
    assert np.flatnonzero(np.asarray(state.block_tables[0, 0])).tolist() == [1]
    state, _ = _allocate(state, cfg, [0], [2])  # 5 tokens: new state at index 2, old one kept
    assert np.flatnonzero(np.asarray(state.block_tables[0, 0])).tolist() == [1, 2]
    state, _ = _allocate(state, cfg, [0], [1])  # 6 tokens: same block, the old one released
    assert np.flatnonzero(np.asarray(state.block_tables[0, 0])).tolist() == [2]
    assert int(state.pool.num_free_blocks) == 6


def test_out_of_blocks_takes_nothing_and_loses_nothing():
    # Full + sliding window 4, block 2, 9 usable blocks.
    cfg = make_cfg(10, full(2), sliding(2, 4), max_model_len=16)
    state = ms.init_state(cfg, 3)
    state, ok = _allocate(state, cfg, [0], [6])  # 3 + 3 blocks
    assert ok == [True]
    before = jax.device_get(state)
    # Request 0 wants 6 more tokens: 3 + 3 blocks, but only 3 are free plus 1 its window frees.
    state, ok = _allocate(state, cfg, [0], [6])
    assert ok == [False]
    after = jax.device_get(state)
    assert int(after.num_computed[0]) == 6
    np.testing.assert_array_equal(after.block_tables[0], before.block_tables[0])  # full group untouched
    expected_sw = before.block_tables[1, 0].copy()
    expected_sw[0] = NULL_BLOCK  # behind the window (6 computed: positions > 2 kept): released anyway
    np.testing.assert_array_equal(after.block_tables[1, 0], expected_sw)
    assert int(after.pool.num_free_blocks) == 4


def _broken(state, name, edit):
    """A copy of `state` whose array `name` ("pool.ref_cnt", "block_tables", ...) `edit` changed in place."""
    state = jax.tree_util.tree_map(np.array, jax.device_get(state))
    owner, _, field = name.rpartition(".")
    edit(getattr(state.pool if owner else state, field))
    return state


BROKEN = {  # what is broken: (the array, the edit, the checker's message)
    "a reference count": ("pool.ref_cnt", lambda a: a.__setitem__(1, 2), r"blocks \[1\] have ref_cnt \[2\] but \[1\]"),
    "the free order": ("pool.ring_count", lambda a: a.__isub__(1), r"missing from the free order: \[9\]"),
    "an empty slot": ("block_tables", lambda a: a.__setitem__((0, 1, 0), 9), r"empty slot 1 holds .* group 0: \[9\]"),
    "a released entry": ("first_live_idx", lambda a: a.__setitem__((1, 0), 1), "slot 0 group 1: blocks below"),
    "a count": ("num_computed", lambda a: a.__setitem__(0, 2), "slot 0 group 0: blocks past the table length 1"),
    "the free count": ("pool.num_free_blocks", lambda a: a.__iadd__(1), "num_free_blocks is 4 but 3 blocks have"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_the_invariant_checker_names_what_is_broken(broken):
    name, edit, message = BROKEN[broken]
    # The state of test_out_of_blocks_takes_nothing_and_loses_nothing after its first call (same program).
    cfg = make_cfg(10, full(2), sliding(2, 4), max_model_len=16)
    state, ok = _allocate(ms.init_state(cfg, 3), cfg, [0], [6])  # blocks 1-6, 3 free
    assert ok == [True] and np.asarray(state.block_tables)[:, 0, :3].tolist() == [[1, 2, 3], [4, 5, 6]]
    check_invariants(cfg, state)
    with pytest.raises(InvariantError, match=message):
        check_invariants(cfg, _broken(state, name, edit))


def test_rows_after_a_failure_fail_too():
    cfg = make_cfg(10, full(2), max_model_len=16)
    state = ms.init_state(cfg, 3)
    # 9 free: row 0 takes 4, row 1 would need 8 (fails), row 2 would fit 2 but comes after.
    state, ok = _allocate(state, cfg, [0, 1, 2], [8, 16, 4])
    assert ok == [True, False, False]
    assert int(state.pool.num_free_blocks) == 5


def test_rows_after_a_failure_release_nothing():
    # vLLM handles requests one by one: a request after the one that fails is not reached,
    # so its blocks behind the window stay (the scheduler retries it after preempting).
    cfg = make_cfg(16, full(2), sliding(2, 4), max_model_len=16)
    state = ms.init_state(cfg, 2)
    state, ok = _allocate(state, cfg, [0, 1], [5, 5])  # 3 + 3 blocks each, 3 left
    assert ok == [True, True]
    before = jax.device_get(state.block_tables)
    # Row 0 releases its SW index 0 (4 free), then needs 4 + 4 > 4: fails. Row 1 is not reached.
    state, ok = _allocate(state, cfg, [0, 1], [8, 1])
    assert ok == [False, False]
    after = jax.device_get(state.block_tables)
    assert after[1, 0, 0] == NULL_BLOCK and after[1, 1, 0] == before[1, 1, 0] != NULL_BLOCK
    assert int(state.pool.num_free_blocks) == 4
    state, ok = _allocate(state, cfg, [1], [1])  # retried: now it releases and fits
    assert ok == [True] and int(state.pool.num_free_blocks) == 5  # its SW index 0 back, nothing new needed


def test_full_sequence_must_fit_gate():
    cfg = make_cfg(10, full(2), sliding(2, 4), max_model_len=16, max_num_batched_tokens=4)
    state = ms.init_state(cfg, 2)
    # 9 free. A 12-token request needs 6 full + min(6, cap) sliding blocks to fit whole; cap is
    # cdiv(4 - 1 + 4, 2) + 1 = 5: 11 > 9, so the gate refuses even a 2-token first chunk.
    state, ok = _allocate(state, cfg, [0], [2], [12])
    assert ok == [False]
    state, ok = _allocate(state, cfg, [0], [2], [6])  # 3 + 3 blocks fit whole
    assert ok == [True]
    assert int(state.pool.num_free_blocks) == 7


def test_a_freed_state_group_counts_both_its_blocks_for_the_gate():
    # Found by the random sequences: a request freed in the call of a must-fit admission releases both
    # blocks its state group holds (the state at a block end and the current one), and the gate counts
    # both. Summed as bools they counted as one, and an admission that fits exactly was refused.
    cfg, chunk_sizes = CASES["hybrid_all_kinds"]
    state = ms.init_state(cfg, NUM_SLOTS)
    state, _ = ms.allocate(state, _pad([0], NUM_SLOTS), _pad([1], 0), cfg=cfg, chunk_sizes=chunk_sizes)
    state, _ = ms.allocate(state, _pad([0], NUM_SLOTS), _pad([2], 0), cfg=cfg, chunk_sizes=chunk_sizes)
    assert int(state.pool.num_free_blocks) == 15  # slot 0 holds 2 blocks in each of the 4 groups
    # 17 tokens need 9 + 7 + 6 + 1 = 23 blocks (each group's cap): all 23 once slot 0 is freed.
    state, result = ms.allocate(
        state, _pad([1], NUM_SLOTS), _pad([0], 0), _pad([17], 0), _pad([0], NUM_SLOTS), cfg=cfg, chunk_sizes=chunk_sizes
    )
    assert np.asarray(result.ok).tolist() == [True, False, False, False]
    check_invariants(cfg, state)


def test_padding_rows_change_nothing():
    cfg = make_cfg(10, full(2), sliding(2, 4))
    state = ms.init_state(cfg, 2)
    state, ok = _allocate(state, cfg, [0, 2, 2], [3, 5, 5])  # slot 2 = S marks padding
    assert ok == [True, False, False]
    assert np.asarray(state.num_computed).tolist() == [3, 0]


def test_no_retracing_across_steps():
    cfg, _ = CASES["hybrid_all_kinds"]
    traced = chex.assert_max_traces(ms._allocate, n=1)
    allocate = jax.jit(traced, static_argnames=("cfg", "chunk_sizes"), donate_argnames=("state",))
    state = ms.init_state(cfg, NUM_SLOTS)
    rng = np.random.default_rng(0)
    for _ in range(6):  # different rows, counts and failures each step, same shapes
        slots = rng.permutation(NUM_SLOTS).astype(np.int32)
        state, _ = allocate(
            state, slots, rng.integers(0, 3, NUM_SLOTS).astype(np.int32), np.zeros(NUM_SLOTS, np.int32), cfg=cfg
        )
    check_invariants(cfg, state)


def test_slot_mappings_follow_the_tables():
    cfg = make_cfg(32, full(2), sliding(4, 4), mamba(2))
    state = ms.init_state(cfg, 3)
    state, _ = _allocate(state, cfg, [1, 0], [5, 3])
    state, _ = _allocate(state, cfg, [1, 0, 2], [2, 1, 0])
    mapping = np.asarray(
        ms.slot_mappings(state, np.array([1, 0, 2], np.int32), np.array([2, 1, 0], np.int32), cfg=cfg, num_tokens=5)
    )
    tables = np.asarray(state.block_tables)
    expected = []
    for g, bs in enumerate([2, 4]):
        row = [tables[g, slot, pos // bs] * bs + pos % bs for slot, pos in [(1, 5), (1, 6), (0, 3)]]
        expected.append(row + [-1, -1])
    assert mapping[:2].tolist() == expected
    assert (mapping[2] == -1).all()  # state groups address their block through the table
    tables_for_kernels = np.asarray(ms.block_tables(state, np.array([0, 3], np.int32)))
    np.testing.assert_array_equal(tables_for_kernels[:, 0], tables[:, 0])
    assert (tables_for_kernels[:, 1] == NULL_BLOCK).all()


@pytest.mark.parametrize("case", ["hybrid_all_kinds", "sw_tight_pool"])
def test_multi_step_decode_equals_single_steps(case):
    cfg, chunk_sizes = CASES[case]
    slots = np.array([2, 0, 1, NUM_SLOTS], np.int32)
    prefill = np.array([5, 3, 7, 0], np.int32)

    def prefilled():
        state = ms.init_state(cfg, NUM_SLOTS)
        state, _ = ms.allocate(state, slots, prefill, cfg=cfg, chunk_sizes=chunk_sizes)
        return state

    num_steps = 9  # long enough to cross blocks, windows, and run out of blocks in the tight pool
    fused, fused_ok, fused_slots = ms.decode_steps(
        prefilled(), slots, cfg=cfg, num_steps=num_steps, chunk_sizes=chunk_sizes
    )
    state = prefilled()
    ones = (slots < NUM_SLOTS).astype(np.int32)
    for step in range(num_steps):
        state, result = ms.allocate(state, slots, ones, cfg=cfg, chunk_sizes=chunk_sizes)
        assert np.asarray(result.ok).tolist() == np.asarray(fused_ok[step]).tolist()
        mapping = np.asarray(
            ms.slot_mappings(state, slots, np.asarray(result.ok, np.int32), cfg=cfg, num_tokens=len(slots))
        )
        np.testing.assert_array_equal(np.asarray(fused_slots[step]), mapping)
    chex.assert_trees_all_equal(jax.device_get(fused), jax.device_get(state))
    check_invariants(cfg, fused)
    if case == "sw_tight_pool":
        assert not np.asarray(fused_ok).all(), "the tight pool must run out during the decode steps"
