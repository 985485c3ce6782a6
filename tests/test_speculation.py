"""Speculative decoding through KVCacheManager: draft tokens, lookahead slots, rejections, the EAGLE
hit rule; random use against the model (tests/model_reference.py), and the errors.

(The pure transitions' random sequences with a fake KV store are in tests/prefix/test_state.py; the
specialised programs' equality with the full one in tests/core/test_step.py.)
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_reference import ModelState, assert_state_matches
from tiny_configs import chunked, full, make_cfg, mamba, sliding

from jaxkv import KVCacheManager
from jaxkv.core import state as ms
from jaxkv.core.invariants import check_invariants
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.hashing import prompt_unit_hashes

# Full, sliding window 4 and chunk 4, block 2: 23 usable blocks, 3 requests at most.
CFG = make_cfg(24, full(2), sliding(2, 4), chunked(2, 4), max_model_len=20, max_num_batched_tokens=8)


def test_vllm_eagle_vector():
    # vLLM's test_eagle_enabled_removes_last_block: an identical 48-token resend, block 16.
    cfg = make_cfg(10, full(16), max_model_len=128)
    for use_eagle, expected in ((False, 32), (True, 16)):
        mgr = KVCacheManager(cfg, max_num_seqs=2, use_eagle=use_eagle)
        mgr.add_request("a", [0] * 48)
        assert mgr.allocate_slots("a", 48)
        mgr.mark_computed()  # its forward pass ran
        mgr.free("a")
        mgr.add_request("b", [0] * 48)
        assert mgr.get_computed_tokens("b") == expected
        assert mgr.allocate_slots("b", 48 - expected, num_new_computed_tokens=expected)


def test_eagle_drops_a_block_in_every_group_then_the_groups_agree():
    # Full attention block 2, sliding window 4 block 4: a 13-token resend hits 12 without the rule.
    # With it: at most 12 − 4 = 8, which both groups accept.
    cfg = make_cfg(24, full(2), sliding(4, 4), max_model_len=32)
    hits = []
    for use_eagle in (False, True):
        mgr = KVCacheManager(cfg, max_num_seqs=2, use_eagle=use_eagle)
        mgr.add_request("a", list(range(13)))
        assert mgr.allocate_slots("a", 13)
        mgr.mark_computed()
        mgr.free("a")
        mgr.add_request("b", list(range(13)))
        hits.append(mgr.get_computed_tokens("b"))
        model = ModelState(cfg, 2, mgr.prefix_config)
        model.set_hashes(0, prompt_unit_hashes(list(range(13)), 2))
        model.allocate([0], [13])
        model.free([0])
        assert model.lookup(prompt_unit_hashes(list(range(13)), 2), 13, use_eagle)[0] == hits[-1]
    assert hits == [12, 8]


def test_drafts_rejections_and_lookahead():
    mgr = KVCacheManager(CFG, max_num_seqs=3, num_speculative_tokens=4, debug_checks=True)
    mgr.add_request("a", list(range(7)))
    assert mgr.allocate_slots("a", 7)
    mgr.append_token_ids("a", [50])
    # The sampled token and 4 drafts (positions 7..11), 2 lookahead slots (12, 13).
    assert mgr.allocate_slots("a", 5, num_lookahead_tokens=2)
    assert mgr.num_computed_tokens("a") == 12
    meta = mgr.step_metadata(["a"], [5], num_tokens=8, num_rows=2)
    assert np.asarray(meta.positions)[:5].tolist() == [7, 8, 9, 10, 11]
    assert int(meta.seq_lens[0]) == 12
    tables = np.asarray(mgr.block_tables(["a"]))[0, 0]
    expected = [int(tables[p // 2]) * 2 + p % 2 for p in range(7, 12)]
    assert np.asarray(mgr.slot_mappings(["a"], [5], 8))[0, :5].tolist() == expected
    assert tables[6] != NULL_BLOCK  # the lookahead slots' block (positions 12, 13)
    mgr.reject_tokens("a", 3)  # one draft accepted: 9 verified
    assert mgr.num_computed_tokens("a") == 9
    with pytest.raises(ValueError, match="1 draft tokens not rejected yet"):
        mgr.reject_tokens("a", 2)
    mgr.append_token_ids("a", [51, 52])  # the accepted draft and the bonus token
    assert mgr.allocate_slots("a", 1)  # rolls back 5 (3 drafts, 2 lookahead) first
    assert mgr.num_computed_tokens("a") == 10
    assert int(mgr.state.num_computed[mgr.slots_of(["a"])[0]]) == 10
    full_ids, sw_ids, chunk_ids = mgr.get_block_ids("a")
    assert len(full_ids) == 5 and NULL_BLOCK not in full_ids
    assert np.asarray(mgr.block_tables(["a"]))[0, 0, 5:].tolist() == [NULL_BLOCK] * (tables.shape[0] - 5)
    # 10 tokens, released by the 9 verified before the call: full 5 blocks, window 4 blocks 3-4, chunk 4 block 4.
    assert mgr.num_free_blocks == 23 - (5 + 2 + 1)
    mgr.free("a")
    assert mgr.num_free_blocks == 23


def test_windows_release_by_the_verified_count():
    # Sliding window 4, block 2: with 8 verified tokens positions > 4 are kept (blocks 2, 3). Drafts up
    # to 13 must not move that point: the draft step releases by the 8 tokens computed before it.
    cfg = make_cfg(24, sliding(2, 4), max_model_len=20)
    mgr = KVCacheManager(cfg, max_num_seqs=2, num_speculative_tokens=5, debug_checks=True)
    mgr.add_request("a", list(range(7)))
    assert mgr.allocate_slots("a", 7)
    mgr.append_token_ids("a", [7])
    assert mgr.allocate_slots("a", 1)
    mgr.append_token_ids("a", [8])
    assert mgr.allocate_slots("a", 6)  # 1 + 5 drafts: positions 8..13
    drafted = mgr.get_block_ids("a")[0]
    assert drafted[:2] == (NULL_BLOCK, NULL_BLOCK) and NULL_BLOCK not in drafted[2:]  # not by 14 tokens
    mgr.reject_tokens("a", 5)  # all rejected: 9 verified; the token at 9 needs positions 6..9
    mgr.append_token_ids("a", [9])
    assert mgr.allocate_slots("a", 1)
    ids = mgr.get_block_ids("a")[0]
    assert ids[:3] == (NULL_BLOCK,) * 3 and ids[3:] == drafted[3:5]  # the verified positions' blocks kept
    check_invariants(cfg, mgr.state, mgr.prefix_config)


@pytest.mark.parametrize("backend", ["jax", "host"])
def test_a_loop_takes_verified_counts_and_hands_back_rejections(backend):
    mgr = KVCacheManager(CFG, max_num_seqs=3, num_speculative_tokens=3, debug_checks=True, backend=backend)
    mgr.add_request("a", list(range(5)))
    assert mgr.allocate_slots("a", 5)
    mgr.append_token_ids("a", [9])
    assert mgr.allocate_slots("a", 4)  # positions 5..8, 3 drafts
    mgr.reject_tokens("a", 3)
    slot = int(mgr.slots_of(["a"])[0])
    state = mgr.take_state()  # rolls the drafts back first
    assert int(state.num_computed[slot]) == 6 and np.asarray(state.block_tables)[0, slot, 3] == NULL_BLOCK
    # A loop's step: one token and 2 drafts, of which it rejects 1.
    state, result = ms.allocate(
        state, np.asarray([slot], np.int32), np.asarray([3], np.int32), cfg=CFG, prefix=mgr.prefix_config
    )
    assert bool(result.ok[0])
    mgr.adopt_state(state, ["a"], num_rejected_tokens=[1])
    assert mgr.num_computed_tokens("a") == 8
    mgr.append_token_ids("a", [10, 11])
    assert mgr.allocate_slots("a", 1)
    assert int(mgr.state.num_computed[slot]) == 9
    mgr.free("a")
    assert mgr.num_free_blocks == 23


def test_errors_name_the_offending_value():
    with pytest.raises(ValueError, match="state .*groups.*without speculative decoding"):
        KVCacheManager(make_cfg(16, full(2), mamba(2)), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="use_eagle=True"):
        KVCacheManager(make_cfg(16, full(2), mamba(2)), use_eagle=True)
    with pytest.raises(ValueError, match="num_speculative_tokens=-1"):
        KVCacheManager(CFG, num_speculative_tokens=-1)
    plain = KVCacheManager(CFG, max_num_seqs=2)
    plain.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="append the tokens first"):
        plain.allocate_slots("a", 4)
    with pytest.raises(ValueError, match="num_lookahead_tokens given.*num_speculative_tokens > 0"):
        plain.allocate_slots("a", 3, num_lookahead_tokens=1)
    mgr = KVCacheManager(CFG, max_num_seqs=2, num_speculative_tokens=2)
    mgr.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="at most num_speculative_tokens=2 drafts"):
        mgr.allocate_slots("a", 6)
    with pytest.raises(ValueError, match="exceed max_model_len=20"):
        mgr.allocate_slots("a", 5, num_lookahead_tokens=16)
    assert mgr.allocate_slots("a", 3)  # the prompt: no drafts
    with pytest.raises(ValueError, match="num_rejected_tokens=1 for request 'a'.*0 draft tokens"):
        mgr.reject_tokens("a", 1)


def test_the_pure_step_rolls_back_a_state_groups_tokens_that_never_ran():
    # A device loop's unused reservation on a state config: the state block past the verified tokens goes back,
    # as the attention blocks do (the manager refuses drafts there: a draft that ran overwrote the state).
    cfg = make_cfg(16, full(2), mamba(2))
    row = np.asarray([0], np.int32)
    state, _ = ms.allocate(ms.init_state(cfg, 2), row, np.asarray([3], np.int32), cfg=cfg)  # 3 tokens
    tables, num_free = np.asarray(state.block_tables), int(state.pool.num_free_blocks)  # full 0-1, the state at 1
    state, _ = ms.allocate(state, row, np.asarray([2], np.int32), cfg=cfg)  # 5: full 2 and a state block at 2
    assert int(state.pool.num_free_blocks) == num_free - 2
    state, result = ms.allocate(
        state, row, np.asarray([0], np.int32), num_rejected_tokens=np.asarray([2], np.int32), cfg=cfg
    )
    assert bool(result.ok[0]) and int(state.num_computed[0]) == 3
    np.testing.assert_array_equal(np.asarray(state.block_tables), tables)
    assert int(state.pool.num_free_blocks) == num_free
    check_invariants(cfg, state)


@settings(max_examples=12, deadline=None)
@given(st.data())
def test_random_speculation_matches_model(data):
    """add / lookup / batched allocate (prefill chunks, decodes with drafts and lookahead slots), each
    followed by its verification (some drafts accepted, the rest rejected) / free / preempt through the
    facade; after every allocation the device state equals the model's, and no slot has a block past its
    verified tokens indexed."""
    use_eagle = data.draw(st.booleans(), label="use_eagle")
    specialize = data.draw(st.booleans(), label="specialize_steps")
    backend = data.draw(st.sampled_from(["jax", "host"]), label="backend")
    mgr = KVCacheManager(
        CFG,
        max_num_seqs=3,
        num_speculative_tokens=3,
        use_eagle=use_eagle,
        specialize_steps=specialize,
        backend=backend,
    )
    model = ModelState(CFG, 3, mgr.prefix_config)
    running: list[str] = []
    tokens: dict[str, list[int]] = {}
    pending: dict[int, int] = {}  # slot -> tokens the model rolls back at its next allocation
    shared: dict[str, int] = {}  # the shared length of each request's last lookup
    next_id = 0
    for _ in range(data.draw(st.integers(1, 30), label="num_ops")):
        op = data.draw(st.sampled_from(["add", "allocate", "allocate", "allocate", "free", "preempt"]))
        if op == "add" and mgr.num_requests < 3:
            rid, next_id = f"r{next_id}", next_id + 1
            tokens[rid] = [next_id % 2] * data.draw(st.integers(1, 12), label="prompt_len")  # repeats: hits
            mgr.add_request(rid, tokens[rid])
            shared[rid] = 0
            running.append(rid)
        elif op == "allocate" and running:
            rids = data.draw(st.permutations(running), label="order")
            rids = rids[: data.draw(st.integers(1, len(rids)), label="batch_size")]
            new_tokens, hits, lookahead = [], [], []
            for rid in rids:
                n, num_tokens = mgr.num_computed_tokens(rid), mgr.num_tokens(rid)
                if n == num_tokens and num_tokens < 20:
                    mgr.append_token_ids(rid, [7])
                    tokens[rid].append(7)
                    num_tokens += 1
                hit = 0
                if n == 0 and data.draw(st.booleans(), label="look_up"):
                    hit = mgr.get_computed_tokens(rid)
                    model_hit, shared[rid] = model.lookup(prompt_unit_hashes(tokens[rid], 2), num_tokens, use_eagle)
                    assert hit == model_hit
                hits.append(hit)
                room = 20 - n - hit
                k = data.draw(st.integers(0, min(num_tokens - n - hit, 6)), label="num_new_tokens")
                if n + hit + k == num_tokens:  # the known tokens all scheduled: drafts may follow
                    k += data.draw(st.integers(0, min(3, room - k)), label="drafts")
                new_tokens.append(k)
                lookahead.append(data.draw(st.integers(0, min(2, room - k)), label="lookahead"))
            slots = mgr.slots_of(rids).tolist()
            shared_tokens = [shared[rid] if mgr.num_computed_tokens(rid) == 0 else 0 for rid in rids]
            ok = mgr.allocate_slots_batch(rids, new_tokens, hits, num_lookahead_tokens=lookahead)
            for rid in running:
                model.set_hashes(int(mgr.slots_of([rid])[0]), prompt_unit_hashes(tokens[rid], 2))
            model.roll_back(slots, [pending.pop(s, 0) for s in slots])
            expected = model.allocate(
                slots, new_tokens, None, hits, num_shared_tokens=shared_tokens, num_lookahead_tokens=lookahead
            )
            assert ok.tolist() == expected
            assert mgr.num_free_blocks == model.num_free_blocks
            state = mgr.state
            check_invariants(CFG, state, mgr.prefix_config)
            assert_state_matches(state, model)
            for rid in running:  # nothing past the verified tokens is indexed
                slot = int(mgr.slots_of([rid])[0])
                blocks = np.asarray(state.prefix.num_cached_blocks)[:, slot]
                assert (blocks * 2 <= mgr.num_computed_tokens(rid)).all()
            # Verification: the ok rows' drafts are accepted in part (they join the tokens), the rest rejected.
            rejected = []
            for rid, slot, d, fits in zip(rids, slots, lookahead, ok):
                num_drafts = max(mgr.num_computed_tokens(rid) - mgr.num_tokens(rid), 0) if fits else 0
                rejected.append(data.draw(st.integers(0, num_drafts), label="rejected"))
                accepted = num_drafts - rejected[-1]
                mgr.append_token_ids(rid, [8] * accepted)
                tokens[rid] += [8] * accepted
                pending[slot] = (d if fits else 0) + rejected[-1]
            mgr.reject_tokens_batch(rids, rejected)
        elif op in ("free", "preempt") and running:
            rids = (
                [running[-1]]
                if op == "preempt"
                else data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True))
            )
            slots = mgr.slots_of(rids).tolist()
            mgr.free_batch(rids)
            model.free(slots)
            for rid, slot in zip(rids, slots):
                pending.pop(slot, None)
                running.remove(rid)
                shared[rid] = 0
                if op == "preempt":
                    mgr.add_request(rid, tokens[rid])
                    running.append(rid)
    for rid in running:
        model.set_hashes(int(mgr.slots_of([rid])[0]), prompt_unit_hashes(tokens[rid], 2))
    check_invariants(CFG, mgr.state, mgr.prefix_config)
    assert_state_matches(mgr.state, model)
