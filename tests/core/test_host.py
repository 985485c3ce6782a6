"""The host backend (`jaxkv.core.host.HostState`) against the plain-Python model, in lock step: random
operation sequences (hits inside blocks, copies, windows, state groups, drafts and rollbacks), every
structure compared after every operation. The model is compared with the jitted state by the
other suites, so equal here means equal to the jitted transitions too."""

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_reference import ModelState
from tiny_configs import chunked, full, make_cfg, mamba, sliding

from jaxkv.core import host_types
from jaxkv.core.host import HostState, ints_to_keys
from jaxkv.manager.device_loop import reservation
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.hashing import prompt_unit_hashes
from jaxkv.prefix.index import IndexState, check_index
from jaxkv.prefix.state import PrefixCacheConfig

NUM_SLOTS = 4
CASES = {
    "full_sw": (make_cfg(18, full(2), sliding(2, 4)), None),
    # Hits at block boundaries, no state group: `host_step`'s compiled allocation, with chunks and mixed blocks.
    "windows_chunks": (make_cfg(24, full(2), sliding(2, 4), chunked(2, 4)), None),
    "mixed_windows": (make_cfg(30, full(2), sliding(4, 6), chunked(4, 8)), None),
    "wide_blocks": (make_cfg(30, full(4), sliding(4, 8), chunked(4, 8)), None),  # decode rows within a block
    "all_kinds": (make_cfg(30, full(2), sliding(2, 4), chunked(2, 4), mamba(2)), None),
    "mixed_block_sizes": (make_cfg(40, full(2), sliding(4, 6), mamba(4)), None),
    "unit_below_block": (make_cfg(24, full(4), sliding(4, 6)), 2),
    "hybrid_state_unit": (make_cfg(30, mamba(4), mamba(4), full(4)), 2),
    "full_unit": (make_cfg(16, full(4)), 2),
}
SPECULATIVE = ("full_sw", "unit_below_block", "full_unit")
PREFIXES = ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), (1, 2, 3, 4, 5, 6, 40, 41, 42, 43), (60, 61, 62, 63))


def assert_host_matches(host: HostState, model: ModelState) -> None:
    np.testing.assert_array_equal(host.tables, np.asarray(model.tables), err_msg="block tables")
    assert host.num_computed.tolist() == model.num_computed, "num_computed"
    assert host.first_live.T.tolist() == model.first_live, "first_live"
    assert host.ref.tolist() == model.ref_cnt, "ref_cnt"
    order = host.free_order()
    assert order == model.order, "free order"
    assert host.prv[order].tolist() == [NULL_BLOCK, *order][:-1], "backward links"
    assert host.prv[NULL_BLOCK] == [NULL_BLOCK, *order][-1], "the last free block"
    assert host.num_free == model.num_free_blocks
    assert {b: g for b, g in enumerate(host.group_of.tolist()) if g >= 0} == model.cached_group, "cached groups"
    if model.prefix is None:
        return
    entries = {
        (tuple(ints_to_keys([key])[0].tolist()), g): block
        for key, fields in host.index.items()
        for g, block in enumerate(fields)
        if block
    }
    assert entries == model.index.entries(), "index"
    # Entries in their keys' buckets, counts, `block_slot` at each field and nowhere else (the device's checks).
    indexed = check_index(IndexState(host.slots.reshape(host.num_buckets, host.ways, -1), host.block_slot))
    assert {block: g for block, (_, g) in indexed.items()} == model.cached_group, "cached blocks' fields"
    assert host.num_cached.T.tolist() == model.num_cached, "num_cached"
    assert host.prompt_len.tolist() == model.prompt_len and host.shared_len.tolist() == model.shared_len
    assert host.copies == model.copies, "pending copies"
    assert [host.unit_keys(s).tolist() for s in range(NUM_SLOTS)] == [[list(k) for k in h] for h in model.hashes]


def run_lock_step(data, cfg, unit, caching=True, speculate=False, loops=False):
    prefix = PrefixCacheConfig.for_config(cfg, unit) if caching else None
    host, model = HostState(cfg, NUM_SLOTS, prefix), ModelState(cfg, NUM_SLOTS, prefix)
    live: dict[int, list[int]] = {}  # slot -> tokens, in admission order
    prompt_len: dict[int, int] = {}
    looked_up: dict[int, tuple[int, int]] = {}
    rejected: dict[int, int] = {}
    pending: list[int] = []  # copy destinations not released yet
    seen: list[tuple[int, ...]] = []  # prompts added so far
    eagle = speculate and data.draw(st.booleans(), label="eagle")
    max_len = cfg.max_model_len

    def keys_of(tokens):
        return prompt_unit_hashes(tokens, prefix.unit) if caching else None

    def lookup(slot):
        keys = keys_of(live[slot])
        looked_up[slot] = host.lookup(keys, len(live[slot]), eagle)
        assert looked_up[slot] == model.lookup(keys, len(live[slot]), eagle)

    for _ in range(data.draw(st.integers(1, 40), label="num_ops")):
        op = data.draw(
            st.sampled_from(["add", "allocate", "allocate", "allocate", "free", "preempt"] + ["loop"] * loops)
        )
        if op == "add" and len(live) < NUM_SLOTS:
            # A fixed prefix, or an earlier prompt: its hit may end inside a block (at its tail) and go on past it.
            base = data.draw(st.sampled_from(PREFIXES + tuple(seen)), label="prefix")
            tokens = list(base[: data.draw(st.integers(0, len(base)), label="shared")])
            tokens += data.draw(st.lists(st.integers(70, 72), max_size=max_len - len(tokens)), label="tail")
            if tokens:
                seen.append(tuple(tokens))
                slot = min(set(range(NUM_SLOTS)) - set(live))
                live[slot], prompt_len[slot] = tokens, len(tokens)
                if caching:
                    lookup(slot)
        elif op == "allocate" and live:
            slots = list(data.draw(st.permutations(sorted(live)), label="order"))
            slots = slots[: data.draw(st.integers(1, len(slots)), label="batch_size")]
            row_rejected = [rejected.pop(slot, 0) for slot in slots]
            new_tokens, full_tokens, hits, shared, drafts = [], [], [], [], {}
            for slot, r in zip(slots, row_rejected):
                tokens, n = live[slot], model.num_computed[slot] - r
                if n == len(tokens) and len(tokens) < max_len:
                    tokens.append(data.draw(st.integers(70, 72), label="decoded"))
                    if speculate:
                        drafts[slot] = data.draw(st.integers(0, min(3, max_len - len(tokens))), label="drafts")
                hit, shared_len = looked_up.pop(slot, (0, 0)) if n == 0 and caching else (0, 0)
                hits.append(hit)
                shared.append(shared_len)
                if slot in drafts:
                    new_tokens.append(1 + drafts[slot])
                    full_tokens.append(0)
                    continue
                limit = min(len(tokens) - n - hit, 8)
                to_tail = ((prompt_len[slot] - 1) // prefix.unit) * prefix.unit - n - hit if caching else 0
                if 0 < to_tail <= limit and data.draw(st.booleans(), label="end_at_tail"):
                    new_tokens.append(to_tail)
                else:
                    new_tokens.append(data.draw(st.integers(0, limit), label="num_new_tokens"))
                full_tokens.append(len(tokens) if n == 0 and data.draw(st.booleans(), label="must_fit") else 0)
            if caching:
                released = data.draw(st.lists(st.sampled_from(pending), unique=True), label="rel") if pending else []
                pending = [d for d in pending if d not in released]
                host.release_copies(released)
                model.release_copies(released)
                for slot, tokens in live.items():
                    keys = keys_of(tokens)
                    if len(keys) != host.num_hashed[slot]:  # as a manager gives them: once, as units complete
                        host.set_keys(slot, keys)
                    model.set_hashes(slot, keys)
            host.roll_back(slots, row_rejected)
            model.roll_back(slots, row_rejected)
            prompts = [prompt_len[s] for s in slots]
            ok, num_hit, copies = host.allocate(
                slots, new_tokens, full_tokens, hits if caching else None, prompts, shared if caching else None
            )
            expected = model.allocate(
                slots, new_tokens, full_tokens, hits if caching else None, prompts, shared if caching else None
            )
            assert ok.tolist() == expected
            assert num_hit == sum(h for h, fits in zip(hits, ok) if fits)
            if caching:
                assert copies == model.last_copies
                pending += [dst for _, dst, _ in copies.values()]
            for slot, fits in zip(slots, ok):
                if fits and slot in drafts:  # verification accepts some drafts
                    accepted = data.draw(st.integers(0, drafts[slot]), label="accepted")
                    live[slot] += [80] * accepted
                    rejected[slot] = drafts[slot] - accepted
        elif op == "loop" and live:
            # A device loop (`KVCacheManager.hand_over`): decoding rows reserve slots for the loop's tokens
            # (lookahead slots), which computes some of them; the rest roll back at the row's next allocation.
            slots = [s for s in live if s not in rejected and 0 < model.num_computed[s] >= len(live[s]) - 1]
            slots = [s for s in slots if len(live[s]) < max_len and data.draw(st.booleans(), label="in_loop")]
            for slot in slots:
                if model.num_computed[slot] == len(live[slot]):
                    live[slot].append(data.draw(st.integers(70, 72), label="decoded"))
            n = np.array([model.num_computed[s] for s in slots], np.int64)
            wanted = np.array([data.draw(st.integers(0, 6), label="wanted") for _ in slots], np.int64)
            state_blocks = {g.block_size for g in cfg.groups if g.kind == "mamba"}
            reserved = reservation(cfg.max_model_len, state_blocks, n, wanted).tolist()
            for slot in slots if caching else ():
                keys = keys_of(live[slot])
                if len(keys) != host.num_hashed[slot]:
                    host.set_keys(slot, keys)
                model.set_hashes(slot, keys)
            zeros = [0] * len(slots) if caching else None
            prompts = [prompt_len[s] for s in slots]
            given = (slots, [0] * len(slots), None, zeros, prompts, zeros, reserved)
            # The manager's compiled reservation, its checks and counts included.
            counts = np.zeros((6, NUM_SLOTS), np.int64)  # computed, written, tokens, shared, pending rollback, prompt
            counts[0] = host.num_computed
            counts[2, list(live)] = [len(tokens) for tokens in live.values()]
            counts[5, list(live)] = [prompt_len[s] for s in live]
            num_ok, got, copies = host.reserve_checked(
                np.array(slots, np.int64), wanted, host_types.counts(*counts), max_len, []
            )
            assert got.tolist() == reserved
            assert counts[4, slots].tolist() == [r if i < num_ok else 0 for i, r in enumerate(reserved)]
            ok = np.arange(len(slots)) < num_ok
            assert ok.tolist() == model.allocate(*given)
            if caching:
                made = model.last_copies
                assert copies.tolist() == [list(made[key]) for key in sorted(made)]
                pending += [dst for _, dst, _ in made.values()]
            for slot, r, fits in zip(slots, reserved, ok):
                if fits:  # the loop computes k of its r slots; each gives the next token
                    k = data.draw(st.integers(0, r), label="computed_in_loop")
                    live[slot] += [71] * k
                    rejected[slot] = r - k
        elif op in ("free", "preempt") and live:
            slots = (
                [list(live)[-1]]
                if op == "preempt"
                else data.draw(st.lists(st.sampled_from(sorted(live)), min_size=1, unique=True), label="free")
            )
            aborted = caching and data.draw(st.booleans(), label="aborted")
            written = [max(0, model.num_computed[s] - 3) for s in slots] if aborted else None
            host.free(slots, written)
            model.free(slots, written)
            for slot in slots:
                rejected.pop(slot, None)
                tokens = live.pop(slot)
                looked_up.pop(slot, None)
                if op == "preempt":
                    live[slot], prompt_len[slot] = tokens, len(tokens)
                else:
                    del prompt_len[slot]
        assert_host_matches(host, model)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_host_state_equals_the_model(case, data):
    run_lock_step(data, *CASES[case], loops=True)


@pytest.mark.parametrize("case", ["full_sw", "all_kinds"])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_host_state_without_prefix_caching_equals_the_model(case, data):
    run_lock_step(data, *CASES[case], caching=False, loops=True)


@pytest.mark.parametrize("case", SPECULATIVE)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_host_state_with_drafts_equals_the_model(case, data):
    run_lock_step(data, *CASES[case], speculate=True)


def test_a_new_process_loads_the_compiled_engine_from_numbas_cache():
    # This module's import compiled or loaded every host-engine function; a new process must load them all. A
    # struct type that numba's cache cannot pickle by import path made every process compile the engine again
    # (about 25 s an import, in every example run too).
    env = dict(os.environ, NUMBA_DEBUG_CACHE="1")
    child = [sys.executable, "-c", "import jaxkv.core.host"]
    out = subprocess.run(child, env=env, capture_output=True, text=True, check=True).stdout
    saved = [line for line in out.splitlines() if "data saved" in line]
    assert "data loaded" in out and not saved, saved[:5]
