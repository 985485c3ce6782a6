"""Prefix caching inside ManagerState: the issue's vectors, and random sequences against the model
with a fake KV store (every hit must read back the values its prefix computed), jitted and eager.

Dimensions: R rows per call (padded to S), G groups, S slots, X uploaded keys per call.
"""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_reference import ModelState, assert_state_matches
from tiny_configs import chunked, full, make_cfg, mamba, sliding

from jaxkv.core import state as ms
from jaxkv.core.invariants import check_invariants
from jaxkv.core.pool import free_order, mark_cached
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.hashing import prompt_unit_hashes
from jaxkv.prefix.index import index_entries, insert, probe
from jaxkv.prefix.state import UPLOAD_WORDS, PrefixCacheConfig

NUM_SLOTS = 4
UPLOADS = 64  # X


def _pad(values, fill, width=NUM_SLOTS):
    out = np.full(width, fill, np.int32)
    out[: len(values)] = values
    return out


def _uploads(keys_by_slot: dict[int, np.ndarray]) -> np.ndarray:
    """uint32[X, 6]: every key of every listed slot (padding: slot S)."""
    out = np.zeros((UPLOADS, UPLOAD_WORDS), np.uint32)
    out[:, 0] = NUM_SLOTS
    row = 0
    for slot, keys in keys_by_slot.items():
        out[row : row + len(keys), 0] = slot
        out[row : row + len(keys), 1] = np.arange(len(keys))
        out[row : row + len(keys), 2:] = keys
        row += len(keys)
    return out


def _lookup(state, cfg, prefix, keys, num_tokens) -> int:
    return _lookup_shared(state, cfg, prefix, keys, num_tokens)[0]


def _lookup_shared(state, cfg, prefix, keys, num_tokens, drop_last_block=False) -> tuple[int, int]:
    """(hit, shared length) of one request (keys padded to a power of two: few compiled lookups)."""
    width = max(8, 1 << (len(keys) - 1).bit_length())
    padded = np.zeros((8, width, 4), np.uint32)
    padded[0, : len(keys)] = keys
    hits, shared, _ = ms.lookup(
        state,
        padded,
        _pad([len(keys)], 0, 8),
        _pad([num_tokens], 0, 8),
        cfg=cfg,
        prefix=prefix,
        drop_last_block=drop_last_block,
    )
    return int(hits[0]), int(shared[0])


def _allocate(state, cfg, prefix, rows, uploads=None):
    """rows: (slot, new tokens, hit tokens). Returns (state, ok list)."""
    slots, new, hits = zip(*rows)
    state, result = ms.allocate(
        state, _pad(slots, NUM_SLOTS), _pad(new, 0), None, None, _pad(hits, 0), uploads, cfg=cfg, prefix=prefix
    )
    check_invariants(cfg, state, prefix)
    return state, np.asarray(result.ok).tolist()[: len(rows)]


# ---- the acceptance vectors ----------------------------------------------------------


def test_vllm_hybrid_vector():
    # Groups full + SW(32) + SW(32), block 16. A 55-token prompt is computed; a 53-token prompt sharing
    # its first 48 tokens hits 48: the first three full blocks, and in each sliding-window group
    # [null, x, y] with x, y the first request's blocks 1 and 2 (the window of position 48 starts at 17).
    cfg = make_cfg(40, full(16), sliding(16, 32), sliding(16, 32), max_model_len=128, max_num_batched_tokens=64)
    prefix = PrefixCacheConfig.for_config(cfg)
    state = ms.init_state(cfg, NUM_SLOTS, prefix)
    a = list(range(55))
    b = a[:48] + [900, 901, 902, 903, 904]
    state, ok = _allocate(state, cfg, prefix, [(0, 55, 0)], _uploads({0: prompt_unit_hashes(a, 16)}))
    assert ok == [True]
    keys_b = prompt_unit_hashes(b, 16)
    assert _lookup(state, cfg, prefix, keys_b, 53) == 48
    free_before = int(state.pool.num_free_blocks)
    state, ok = _allocate(state, cfg, prefix, [(1, 5, 48)], _uploads({1: keys_b}))
    assert ok == [True]
    tables = np.asarray(state.block_tables)
    assert tables[0, 1, :3].tolist() == tables[0, 0, :3].tolist()
    for g in (1, 2):
        assert tables[g, 1, :3].tolist() == [NULL_BLOCK, tables[g, 0, 1], tables[g, 0, 2]]
    assert tables[:, 1, 3].tolist() != tables[:, 0, 3].tolist()  # block 3 is new in every group
    assert int(state.pool.num_free_blocks) == free_before - 3  # only block 3 of each group is new
    assert int(state.num_computed[1]) == 53


def test_identical_prompt_hits_all_but_last_block():
    # An identical 48-token prompt (block 16) hits 32, not 48: the last token is always recomputed.
    cfg = make_cfg(16, full(16), max_model_len=64, max_num_batched_tokens=64)
    prefix = PrefixCacheConfig.for_config(cfg)
    state = ms.init_state(cfg, NUM_SLOTS, prefix)
    keys = prompt_unit_hashes(list(range(48)), 16)
    state, _ = _allocate(state, cfg, prefix, [(0, 48, 0)], _uploads({0: keys}))
    assert _lookup(state, cfg, prefix, keys, 48) == 32


def _state_with_cached(cfg, prefix, keys, cached_by_group):
    """A state whose index holds, for group g, a block under keys of the units in cached_by_group[g]."""
    state = ms.init_state(cfg, NUM_SLOTS, prefix)
    units = sorted({unit for units in cached_by_group for unit in units})
    fields = np.zeros((len(units), len(cfg.groups)), np.int32)  # one entry per unit, a block per group
    next_block = 1
    for g, group_units in enumerate(cached_by_group):
        for unit in group_units:
            fields[units.index(unit), g] = next_block
            next_block += 1
    entry_keys = np.asarray([keys[unit] for unit in units], np.uint32).reshape(-1, 4)
    index, placed = insert(state.prefix.index, entry_keys, fields, np.ones(len(units), bool))
    assert (np.asarray(placed) == (fields != NULL_BLOCK)).all()
    valid = fields.reshape(-1) != NULL_BLOCK
    groups = np.tile(np.arange(len(cfg.groups), dtype=np.int32), len(units))
    pool = mark_cached(state.pool, fields.reshape(-1), np.repeat(entry_keys, len(cfg.groups), axis=0), groups, valid)
    state = ms.ManagerState(
        pool=pool,
        block_tables=state.block_tables,
        first_live_idx=state.first_live_idx,
        num_computed=state.num_computed,
        prefix=dataclasses.replace(state.prefix, index=index),
    )
    check_invariants(cfg, state, prefix)
    return state


T, F = True, False


@pytest.mark.parametrize(
    "pattern, expected_blocks",
    [
        ([T, T, F, T, F, F, T, T, F, T, T, T], 12),
        ([T, T, F, T, F, F, T, T, F, F, F], 8),
        ([T], 1),
        ([T, T, F], 2),
        ([T, T, T, F], 3),
        ([F] * 10, 0),
    ],
)
def test_sliding_window_patterns(pattern, expected_blocks):
    # Sliding window 4, block 2: a hit needs cdiv(3, 2) = 2 cached blocks before it, or a run from
    # block 0. The request has 2 × len + 1 tokens (the last is never covered).
    cfg = make_cfg(32, sliding(2, 4), max_model_len=32)
    prefix = PrefixCacheConfig.for_config(cfg)
    tokens = list(range(100, 100 + 2 * len(pattern) + 1))
    keys = prompt_unit_hashes(tokens, 2)
    state = _state_with_cached(cfg, prefix, keys, [[j for j, c in enumerate(pattern) if c]])
    assert _lookup(state, cfg, prefix, keys, len(tokens)) == 2 * expected_blocks


def test_fixed_point_vector():
    # Groups full, SW(32), SW(64), block 16, 8 candidate blocks (a 129-token request): cached full
    # 0-7, SW32 {2, 3, 6, 7}, SW64 {0-5}. SW64 shrinks 128 to 96, SW32 to 64, stable: 64.
    cfg = make_cfg(64, full(16), sliding(16, 32), sliding(16, 64), max_model_len=256, max_num_batched_tokens=64)
    prefix = PrefixCacheConfig.for_config(cfg)
    tokens = list(range(129))
    keys = prompt_unit_hashes(tokens, 16)
    state = _state_with_cached(cfg, prefix, keys, [range(8), [2, 3, 6, 7], range(6)])
    assert _lookup(state, cfg, prefix, keys, 129) == 64


def test_stale_hit_is_refused_and_changes_nothing():
    # A hit looked up, then evicted by another request's allocation, is refused: ok False, nothing taken.
    cfg = make_cfg(9, full(2), max_model_len=16, max_num_batched_tokens=16)
    prefix = PrefixCacheConfig.for_config(cfg)
    state = ms.init_state(cfg, NUM_SLOTS, prefix)
    a, c = list(range(9)), list(range(50, 66))
    state, _ = _allocate(state, cfg, prefix, [(0, 9, 0)], _uploads({0: prompt_unit_hashes(a, 2)}))
    state = ms.free(state, _pad([0], NUM_SLOTS), cfg=cfg, prefix=prefix)
    keys_b = prompt_unit_hashes(a[:8] + [77], 2)
    assert _lookup(state, cfg, prefix, keys_b, 9) == 8
    state, ok = _allocate(state, cfg, prefix, [(2, 16, 0)], _uploads({2: prompt_unit_hashes(c, 2)}))
    assert ok == [True]  # 8 blocks: every free block, the cached ones evicted
    before = jax.device_get(state)
    state, ok = _allocate(state, cfg, prefix, [(1, 1, 8)], _uploads({1: keys_b}))
    assert ok == [False]
    after = jax.device_get(state)
    np.testing.assert_array_equal(after.block_tables, before.block_tables)
    np.testing.assert_array_equal(after.pool.ref_cnt, before.pool.ref_cnt)
    assert int(after.pool.num_free_blocks) == int(before.pool.num_free_blocks)


def _window_release(shared_len):
    """Full + SW(4), block 2. A computes 12 tokens (and releases its window blocks 0-3 on its next call);
    B shares its first 8, claims the 8-token hit with
    `shared_len` and computes to 16, then releases its window blocks 2-5 (its window at 16 starts at
    block 6). Returns (state, B's sliding-window blocks 2-5). Every call passes the same arguments (keys,
    hits, shared lengths; empty or zero where a call has none): one compiled program."""
    cfg = make_cfg(40, full(2), sliding(2, 4), max_model_len=32, max_num_batched_tokens=16)
    prefix = PrefixCacheConfig.for_config(cfg)

    def allocate(state, slot, new, hit=0, shared=0, keys=None):
        state, result = ms.allocate(
            state,
            _pad([slot], NUM_SLOTS),
            _pad([new], 0),
            None,
            None,
            _pad([hit], 0),
            _uploads({} if keys is None else {slot: keys}),
            num_shared_tokens=_pad([shared], 0),
            cfg=cfg,
            prefix=prefix,
        )
        check_invariants(cfg, state, prefix)
        assert np.asarray(result.ok)[0]
        return state

    state = ms.init_state(cfg, NUM_SLOTS, prefix)
    a = list(range(12))
    b = a[:8] + list(range(90, 98))
    state = allocate(state, 0, 12, keys=prompt_unit_hashes(a, 2))
    state = allocate(state, 0, 0)
    keys_b = prompt_unit_hashes(b, 2)
    assert _lookup_shared(state, cfg, prefix, keys_b, 16) == (8, 8)
    state = allocate(state, 1, 8, hit=8, shared=shared_len, keys=keys_b)
    window_blocks = np.asarray(state.block_tables)[1, 1, 2:6].tolist()
    state = allocate(state, 1, 0)
    assert (np.asarray(state.block_tables)[1, 1, :6] == NULL_BLOCK).all()
    return state, window_blocks


def test_window_blocks_past_the_shared_point_are_evicted_first():
    # B's window blocks 2 and 3 (the run a sibling resuming at the shared point 8 needs) age at the tail;
    # blocks 4 and 5 (B's own suffix) go to the head, still indexed, and are reused first.
    state, (x2, x3, b4, b5) = _window_release(shared_len=8)
    order = free_order(state.pool).tolist()
    assert order[:2] == [b4, b5] and order[-2:] == [x3, x2]
    assert {b4, b5} <= {block for block, _ in index_entries(state.prefix.index).values()}
    # Without a shared point all four age at the tail, tail first.
    state, (x2, x3, b4, b5) = _window_release(shared_len=0)
    assert free_order(state.pool).tolist()[-4:] == [b5, b4, x3, x2]


def _seven_token_prompt():
    """(cfg, prefix config, unit keys): full attention, block 2, and a 7-token prompt (3 full blocks)."""
    cfg = make_cfg(20, full(2), max_model_len=16, max_num_batched_tokens=16)
    return cfg, PrefixCacheConfig.for_config(cfg), prompt_unit_hashes(list(range(7)), 2)


def _indexed_full_blocks(state, keys) -> list[int]:
    """The block indexed under each of `keys` for group 0."""
    return np.asarray(probe(state.prefix.index, np.asarray(keys, np.uint32), np.ones(len(keys), bool)))[:, 0].tolist()


def test_recomputed_block_replaces_a_free_indexed_copy():
    # A's freed blocks stay indexed; B computes the same 6 tokens without claiming them: B's (live)
    # blocks take their index entries, A's old copies are uncached and reused first.
    cfg, prefix, keys = _seven_token_prompt()
    state = ms.init_state(cfg, NUM_SLOTS, prefix)
    state, ok = _allocate(state, cfg, prefix, [(0, 7, 0)], _uploads({0: keys}))
    old = np.asarray(state.block_tables)[0, 0, :3].tolist()
    state = ms.free(state, _pad([0], NUM_SLOTS), cfg=cfg, prefix=prefix)
    state, ok = _allocate(state, cfg, prefix, [(1, 7, 0)], _uploads({1: keys}))
    assert ok == [True]
    new = np.asarray(state.block_tables)[0, 1, :3].tolist()
    assert not set(new) & set(old)
    assert _indexed_full_blocks(state, keys) == new
    assert free_order(state.pool).tolist()[:3] == old[::-1]  # last uncached, first reused
    assert (np.asarray(state.pool.block_group)[old] == -1).all()


def test_recomputed_block_takes_the_index_from_a_held_copy():
    # A holds its blocks; B computes the same 6 tokens without claiming them: B's blocks (the newer
    # copies) take the index entries, A keeps its copies uncached, and freeing A sends them to the head.
    cfg, prefix, keys = _seven_token_prompt()
    state = ms.init_state(cfg, NUM_SLOTS, prefix)
    state, ok = _allocate(state, cfg, prefix, [(0, 7, 0)], _uploads({0: keys}))
    old = np.asarray(state.block_tables)[0, 0, :3].tolist()
    state, ok = _allocate(state, cfg, prefix, [(1, 7, 0)], _uploads({1: keys}))
    assert ok == [True]
    check_invariants(cfg, state, prefix)
    new = np.asarray(state.block_tables)[0, 1, :3].tolist()
    assert _indexed_full_blocks(state, keys) == new
    assert np.asarray(state.block_tables)[0, 0, :3].tolist() == old
    assert (np.asarray(state.pool.block_group)[old] == -1).all()
    state = ms.free(state, _pad([0], NUM_SLOTS), cfg=cfg, prefix=prefix)
    check_invariants(cfg, state, prefix)
    assert free_order(state.pool).tolist()[:3] == old  # released tail first, each pushed at the head


def test_within_one_allocation_the_first_row_keeps_the_index():
    # Two rows of one call compute the same 6 tokens: the first row's blocks are indexed, the second's
    # stay uncached (within a caching pass the first row wins), whatever the chunk size.
    cfg, prefix, keys = _seven_token_prompt()
    for chunk_sizes in ((1,), (2,), (8,)):
        state = ms.init_state(cfg, NUM_SLOTS, prefix)
        state, result = ms.allocate(
            state,
            _pad([0, 1], NUM_SLOTS),
            _pad([7, 7], 0),
            None,
            None,
            None,
            _uploads({0: keys, 1: keys}),
            cfg=cfg,
            prefix=prefix,
            chunk_sizes=chunk_sizes,
        )
        assert np.asarray(result.ok)[:2].all()
        check_invariants(cfg, state, prefix)
        first, second = np.asarray(state.block_tables)[0, :2, :3].tolist()
        assert _indexed_full_blocks(state, keys) == first, chunk_sizes
        assert (np.asarray(state.pool.block_group)[second] == -1).all()


# ---- random sequences against the model, with a fake KV store ---------------------------------

# (config, prefix_match_unit, chunk sizes): tiny pools so that eviction and preemption happen.
CASES = {
    "full_sw": (make_cfg(18, full(2), sliding(2, 4)), None, (3,)),
    "all_kinds": (make_cfg(30, full(2), sliding(2, 4), chunked(2, 4), mamba(2)), None, (3,)),
    "mixed_block_sizes": (make_cfg(40, full(2), sliding(4, 6), mamba(4)), None, (2, 5)),
    "unit_below_block": (make_cfg(24, full(4), sliding(4, 6)), 2, None),
    # Qwen3-Next-like: state groups and full attention with one enlarged block size, a finer unit.
    "hybrid_state_unit": (make_cfg(30, mamba(4), mamba(4), full(4)), 2, (3,)),
    "full_unit": (make_cfg(16, full(4)), 2, (3,)),
}
PREFIXES = ((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12), (1, 2, 3, 4, 5, 6, 40, 41, 42, 43), (60, 61, 62, 63))


class FakeKV:
    """What the model would write: the token prefix ending at each computed position.

    kv[(block, offset)] for attention blocks, state[block] for state blocks.
    """

    def __init__(self):
        self.kv, self.state, self.prefix_of_key = {}, {}, {}

    def copy(self, copies):
        """Applies block copies (source, destination, valid tokens) as `jaxkv.memory.layout.copy_blocks` does:
        whole blocks, all gathered before any is written."""
        copies = [(int(src), int(dst)) for src, dst, _ in copies if dst]
        kv = {(dst, o): self.kv.get((src, o)) for src, dst in copies for o in range(64)}
        state = {dst: self.state.get(src) for src, dst in copies}
        self.kv.update(kv)
        self.state.update(state)

    def computed(self, cfg, state, slot, tokens, first, end, cached_before, popped):
        """Positions [first, end) of `tokens` were computed into the slot's blocks.

        A state layer reads the state after `first` tokens first. No block another request
        holds is written, and no block in use and cached before the call (`cached_before`: index
        entries) and still cached is written where its key says it is valid. A block the call popped
        from the free list (`popped`: its holders released it earlier in the call, and the pop evicted
        it) is a new block: its writes may give it its old key again.
        """
        tables = np.asarray(state.block_tables)
        still = index_entries(state.prefix.index)  # evicted blocks may be written
        cached = {
            block: self.prefix_of_key[key]
            for kg, (block, _) in cached_before.items()
            if still.get(kg, (None,))[0] == block and block not in popped
            for key in [kg[0]]
        }

        def check_private(g, block):
            others = [
                (h, s)
                for h in range(tables.shape[0])
                for s in range(tables.shape[1])
                if s != slot and block in tables[h, s]
            ]
            assert not others, f"slot {slot} group {g} writes block {block} that {others} hold"

        for g, group in enumerate(cfg.groups):
            bs = group.block_size
            if group.kind == "mamba":
                if end > first:
                    if first:
                        read = int(tables[g, slot, (first - 1) // bs])
                        assert self.state.get(read) == tuple(tokens[:first]), (slot, g, "state read", first)
                    block = int(tables[g, slot, (end - 1) // bs])
                    check_private(g, block)
                    assert block not in cached, f"slot {slot} group {g} overwrites cached state block {block}"
                    self.state[block] = tuple(tokens[:end])
                continue
            for p in range(first, end):
                block = int(tables[g, slot, p // bs])
                check_private(g, block)
                if block in cached:
                    assert p >= len(cached[block]), f"slot {slot} writes position {p} of cached block {block}"
                self.kv[(block, p % bs)] = tuple(tokens[: p + 1])

    def hashed(self, tokens, keys, unit):
        for i, key in enumerate(keys):
            self.prefix_of_key[tuple(int(w) for w in key)] = tuple(tokens[: (i + 1) * unit])

    def check(self, cfg, state, live: dict[int, list[int]], rejected: dict[int, int]):
        """Every position each group still needs holds its prefix's value; so does every cached block.
        `rejected`: per slot, drafts at the end of its count that its next allocation rolls back."""
        state = jax.device_get(state)
        tables = np.asarray(state.block_tables)
        for slot, tokens in live.items():
            n = int(state.num_computed[slot]) - rejected.get(slot, 0)
            for g, group in enumerate(cfg.groups):
                bs = group.block_size
                if group.kind == "mamba":
                    if n:
                        assert self.state[int(tables[g, slot, (n - 1) // bs])] == tuple(tokens[:n]), (slot, g)
                    continue
                first = 0
                if group.kind == "sliding_window":
                    first = max(0, n - group.spec.sliding_window + 1)
                elif group.kind == "chunked_local":
                    first = n // group.spec.attention_chunk_size * group.spec.attention_chunk_size
                for p in range(first, n):
                    block = int(tables[g, slot, p // bs])
                    assert block != NULL_BLOCK and self.kv[(block, p % bs)] == tuple(tokens[: p + 1]), (slot, g, p)
        for (key, g), (block, _) in index_entries(state.prefix.index).items():
            prefix, group = self.prefix_of_key[key], cfg.groups[g]
            if group.kind == "mamba":
                assert self.state[block] == prefix, (block, g)
                continue
            bs = group.block_size
            start = (len(prefix) - 1) // bs * bs  # a partial entry (jaxkv.prefix.tails) holds [start, len(prefix))
            for offset in range(len(prefix) - start):
                assert self.kv[(block, offset)] == prefix[: start + offset + 1], (block, g, offset)


def run_random_sequence(data, cfg, unit, chunk_sizes, reuse=False, speculate=False):
    """`reuse`: prompts resend or extend earlier ones and are looked up and claimed as they arrive
    (hits of every length, inside blocks too); otherwise any operation at any time.

    `speculate`: decode rows may schedule draft tokens (values 80-82, which the decoded tokens 70-72
    never equal), written into the fake store as the drafts' prefixes; after the step a random number
    of them is accepted (they join the tokens) and the rest is rejected, rolled back at the slot's next
    allocation; lookups may use the EAGLE rule. No cached block may then hold a rejected draft, and
    no slot indexes a block past its verified tokens."""
    prefix = PrefixCacheConfig.for_config(cfg, unit)
    state = ms.init_state(cfg, NUM_SLOTS, prefix)
    model = ModelState(cfg, NUM_SLOTS, prefix)
    fake = FakeKV()
    live: dict[int, list[int]] = {}  # slot -> tokens; insertion order = admission order
    prompt_len: dict[int, int] = {}  # slot -> prompt tokens
    pending: list[int] = []  # destinations of copies applied but not released yet
    seen: list[tuple[int, ...]] = []  # earlier prompts: a new prompt may resend or extend one
    looked_up: dict[int, tuple[int, int]] = {}  # slot -> its last lookup's (hit, shared length); may go stale
    rejected: dict[int, int] = {}  # slot -> drafts its next allocation rolls back
    eagle = speculate and data.draw(st.booleans(), label="eagle")
    max_len = cfg.max_model_len

    def keys_of(tokens):
        keys = prompt_unit_hashes(tokens, prefix.unit)
        fake.hashed(tokens, keys, prefix.unit)
        return keys

    for _ in range(data.draw(st.integers(1, 40 if speculate else 25), label="num_ops")):
        ops = (
            ["add", "allocate", "allocate", "allocate", "free"]
            if reuse
            else ["add", "lookup", "allocate", "allocate", "allocate", "free", "preempt"] + ["allocate"] * 4 * speculate
        )
        op = data.draw(st.sampled_from(ops))
        if op == "add" and len(live) < NUM_SLOTS:
            base = data.draw(st.sampled_from(tuple(seen) if reuse and seen else PREFIXES + tuple(seen)), label="prefix")
            tokens = list(base[: data.draw(st.integers(len(base) // 2 if reuse else 0, len(base)), label="shared")])
            tokens += data.draw(st.lists(st.integers(70, 72), max_size=max_len - len(tokens)), label="tail")
            if tokens:
                slot = min(set(range(NUM_SLOTS)) - set(live))
                live[slot], prompt_len[slot] = tokens, len(tokens)
                seen.append(tuple(tokens))
                if reuse or data.draw(st.booleans(), label="look_up_now"):
                    looked_up[slot] = _lookup_shared(state, cfg, prefix, keys_of(tokens), len(tokens), eagle)
                    assert looked_up[slot] == model.lookup(keys_of(tokens), len(tokens), eagle)
        elif op == "lookup" and live:
            slot = data.draw(st.sampled_from(sorted(live)), label="lookup_slot")
            if model.num_computed[slot] == 0:
                tokens = live[slot]
                looked_up[slot] = _lookup_shared(state, cfg, prefix, keys_of(tokens), len(tokens), eagle)
                assert looked_up[slot] == model.lookup(keys_of(tokens), len(tokens), eagle)
        elif op == "allocate" and live:
            slots = data.draw(st.permutations(sorted(live)), label="order")
            slots = slots[: data.draw(st.integers(1, len(slots)), label="batch_size")]
            new_tokens, full_tokens, hits, shared = [], [], [], []
            row_rejected = [rejected.pop(slot, 0) for slot in slots]
            drafts: dict[int, list[int]] = {}
            for slot, r in zip(slots, row_rejected):
                tokens, n = live[slot], model.num_computed[slot] - r
                if n == len(tokens) and len(tokens) < max_len:
                    tokens.append(data.draw(st.integers(70, 72), label="decoded"))  # decode it
                    if speculate:
                        num_drafts = data.draw(st.integers(0, min(3, max_len - len(tokens))), label="drafts")
                        drafts[slot] = data.draw(
                            st.lists(st.integers(80, 82), min_size=num_drafts, max_size=num_drafts)
                        )
                # A hit only on the first call: the last lookup's value, possibly stale by now.
                claim = n == 0 and (reuse or data.draw(st.booleans(), label="claim"))
                hit, shared_len = looked_up.pop(slot, (0, 0)) if claim else (0, 0)
                hits.append(hit)
                shared.append(shared_len)
                limit = min(len(tokens) - n - hit, 8)
                if slot in drafts:  # the decoded token and its drafts
                    new_tokens.append(1 + len(drafts[slot]))
                    full_tokens.append(0)
                    continue
                # The prompt tail's final unit boundary: a scheduler may end a chunk there (jaxkv.prefix.tails).
                to_tail = ((prompt_len[slot] - 1) // prefix.unit) * prefix.unit - n - hit
                if 0 < to_tail <= limit and (reuse or data.draw(st.booleans(), label="end_at_tail")):
                    new_tokens.append(to_tail)
                else:
                    new_tokens.append(data.draw(st.integers(0, limit), label="num_new_tokens"))
                must_fit = n == 0 and data.draw(st.booleans(), label="must_fit")
                full_tokens.append(len(tokens) if must_fit else 0)
            others = sorted(set(live) - set(slots))
            freed = data.draw(st.lists(st.sampled_from(others), unique=True), label="freed") if others else []
            for slot in freed:
                del live[slot]
                looked_up.pop(slot, None)
            uploads = {slot: keys_of(tokens) for slot, tokens in live.items()}
            released = data.draw(st.lists(st.sampled_from(pending), unique=True), label="released") if pending else []
            pending = [d for d in pending if d not in released]
            in_use = np.asarray(state.pool.ref_cnt) > 0  # a free cached block may be popped, evicted and reused
            cached_before = {kg: v for kg, v in index_entries(state.prefix.index).items() if in_use[v[0]]}
            state, result = ms.allocate(
                state,
                _pad(slots, NUM_SLOTS),
                _pad(new_tokens, 0),
                _pad(full_tokens, 0),
                _pad(freed, NUM_SLOTS),
                _pad(hits, 0),
                _uploads(uploads),
                _pad([prompt_len[s] for s in slots], 0),
                _pad(released, NULL_BLOCK, 8),
                _pad(shared, 0),
                num_rejected_tokens=_pad(row_rejected, 0) if speculate else None,
                cfg=cfg,
                chunk_sizes=chunk_sizes,
                prefix=prefix,
            )
            popped_from = len(model.popped)
            model.release_copies(released)
            model.free(freed)
            for slot in freed:
                del prompt_len[slot]
                rejected.pop(slot, None)
            for slot, keys in uploads.items():
                model.set_hashes(slot, keys)
            model.roll_back(slots, row_rejected)
            expected_ok = model.allocate(slots, new_tokens, full_tokens, hits, [prompt_len[s] for s in slots], shared)
            assert np.asarray(result.ok).tolist() == expected_ok + [False] * (NUM_SLOTS - len(slots))
            assert int(result.num_free_blocks) == model.num_free_blocks
            assert int(result.num_hit_tokens) == sum(h for h, ok in zip(hits, expected_ok) if ok)
            popped = set(model.popped[popped_from:])
            copies = np.asarray(result.copies)
            expected = np.zeros_like(copies)
            for (i, g), copy in model.last_copies.items():
                expected[i, g] = copy
            np.testing.assert_array_equal(copies, expected, err_msg="copies")
            copies = copies.reshape(-1, 3)
            fake.copy(copies)  # before the step's forward pass
            pending += [int(d) for d in copies[:, 1] if d]
            for slot, k, ok in zip(slots, new_tokens, expected_ok):
                if ok:  # the step runs: the scheduled tokens' K/V and states are written
                    end = model.num_computed[slot]
                    tokens = live[slot] + drafts.get(slot, [])
                    fake.computed(cfg, state, slot, tokens, end - k, end, cached_before, popped)
                    if slot in drafts:  # verification: the accepted drafts join the tokens
                        accepted = data.draw(st.integers(0, len(drafts[slot])), label="accepted")
                        live[slot] += drafts[slot][:accepted]
                        rejected[slot] = len(drafts[slot]) - accepted
        elif op in ("free", "preempt") and live:
            # preempt: the most recently admitted request loses its blocks and starts over.
            slots = (
                [list(live)[-1]]
                if op == "preempt"
                else data.draw(st.lists(st.sampled_from(sorted(live)), min_size=1, unique=True), label="free")
            )
            state = ms.free(state, _pad(slots, NUM_SLOTS), cfg=cfg, chunk_sizes=chunk_sizes, prefix=prefix)
            model.free(slots)
            for slot in slots:
                rejected.pop(slot, None)
                tokens = live.pop(slot)
                looked_up.pop(slot, None)
                if op == "preempt":  # it comes back with all its tokens as its prompt
                    live[slot], prompt_len[slot] = tokens, len(tokens)
                else:
                    del prompt_len[slot]
        check_invariants(cfg, state, prefix)
        assert_state_matches(state, model)
        fake.check(cfg, state, live, rejected)
        if speculate:  # nothing past the verified tokens is indexed (attention groups only here)
            num_cached = np.asarray(state.prefix.num_cached_blocks)
            for slot in live:
                verified = int(state.num_computed[slot]) - rejected.get(slot, 0)
                assert (num_cached[:, slot] * cfg_block_sizes(cfg) <= verified).all(), (slot, verified)


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_random_sequences_jitted(case, data):
    run_random_sequence(data, *CASES[case])


@pytest.mark.parametrize("case", ["full_unit", "hybrid_state_unit", "mixed_block_sizes"])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_reuse_sequences_jitted(case, data):
    # Units finer than a full-attention or state block: hits inside blocks, copies, moved states.
    run_random_sequence(data, *CASES[case], reuse=True)


# Speculative decoding (drafts, rejections, the EAGLE rule) on the configs without state groups.
SPECULATIVE_CASES = ["full_sw", "unit_below_block", "full_unit"]


@pytest.mark.parametrize("case", SPECULATIVE_CASES)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_speculative_sequences_jitted(case, data):
    run_random_sequence(data, *CASES[case], speculate=True)


@pytest.mark.parametrize("case", SPECULATIVE_CASES)
@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_speculative_sequences_eager(case, data):
    with jax.disable_jit():
        run_random_sequence(data, *CASES[case], speculate=True)


def cfg_block_sizes(cfg) -> np.ndarray:
    return np.asarray([g.block_size for g in cfg.groups])[:, None]


@pytest.mark.parametrize("case", sorted(CASES))
@settings(max_examples=1, deadline=None)
@given(data=st.data())
def test_random_sequences_eager(case, data):
    with jax.disable_jit():
        run_random_sequence(data, *CASES[case], reuse=case == "hybrid_state_unit")


# ---- hits inside a block (jaxkv.prefix.tails) --------------------------------------------------


def _allocate_tails(state, cfg, prefix, rows, uploads=None, released=()):
    """rows: (slot, new tokens, hit tokens, prompt tokens). Returns (state, ok list, copies [R, G, 3]). Calls
    without keys pass an empty upload: one compiled program per config."""
    slots, new, hits, prompts = zip(*rows)
    state, result = ms.allocate(
        state,
        _pad(slots, NUM_SLOTS),
        _pad(new, 0),
        None,
        None,
        _pad(hits, 0),
        _uploads({}) if uploads is None else uploads,
        _pad(prompts, 0),
        _pad(released, NULL_BLOCK, 8),
        cfg=cfg,
        prefix=prefix,
    )
    check_invariants(cfg, state, prefix)
    return state, np.asarray(result.ok).tolist()[: len(rows)], np.asarray(result.copies)[: len(rows)]


def test_full_attention_hit_inside_block_copies_on_write():
    # full(4), unit 2. A's 11-token prompt: its tail p* = 10 lies inside block 2 (tokens 8-11).
    cfg = make_cfg(16, full(4), max_model_len=24, max_num_batched_tokens=16)
    prefix = PrefixCacheConfig.for_config(cfg, prefix_match_unit=2)
    state = ms.init_state(cfg, NUM_SLOTS, prefix)
    a = list(range(100, 111))
    state, ok, _ = _allocate_tails(state, cfg, prefix, [(0, 11, 0, 11)], _uploads({0: prompt_unit_hashes(a, 2)}))
    assert ok == [True]
    b = a[:10] + [7, 8, 9]
    keys_b = prompt_unit_hashes(b, 2)
    assert _lookup(state, cfg, prefix, keys_b, 13) == 8  # not yet: the step computing p* has not run
    # A's next call (its step ran): block 2 is indexed under key(10); B hits 10 tokens.
    state, ok, copies = _allocate_tails(state, cfg, prefix, [(0, 0, 0, 11)])
    assert ok == [True] and not copies.any()
    assert _lookup(state, cfg, prefix, keys_b, 13) == 10
    tables = np.asarray(state.block_tables)
    a_block2 = int(tables[0, 0, 2])
    state, ok, copies = _allocate_tails(state, cfg, prefix, [(1, 3, 10, 13)], _uploads({1: keys_b}))
    assert ok == [True]
    tables = np.asarray(state.block_tables)
    assert tables[0, 1, :2].tolist() == tables[0, 0, :2].tolist()  # full blocks shared
    dst = int(tables[0, 1, 2])
    assert dst not in (NULL_BLOCK, a_block2)  # a private block for the tail
    assert copies[0, 0].tolist() == [a_block2, dst, 2]  # tokens 8, 9 of A's block 2
    ref_cnt = np.asarray(state.pool.ref_cnt)
    assert ref_cnt[a_block2] == 2 and ref_cnt[dst] == 2  # A's table + pin; B's table + pin
    # Freeing B before the copy is released keeps both blocks out of the free order.
    state = ms.free(state, _pad([1], NUM_SLOTS), cfg=cfg, prefix=prefix)
    check_invariants(cfg, state, prefix)
    assert np.asarray(state.pool.ref_cnt)[dst] == 1
    state, ok, _ = _allocate_tails(state, cfg, prefix, [(0, 0, 0, 11)], released=[dst])
    assert np.asarray(state.pool.ref_cnt)[dst] == 0 and np.asarray(state.pool.ref_cnt)[a_block2] == 1
    assert not np.asarray(state.prefix.copy_src).any()


def test_state_group_saves_the_prompt_tail_and_hybrid_hit_lands_on_it():
    # mamba(4) + full(4), unit 2 (Qwen3-Next-like: one enlarged block size). A's 11-token prompt is
    # scheduled in chunks ending at p* = 10 (as an aligning scheduler does), then 1 token.
    cfg = make_cfg(20, mamba(4), full(4), max_model_len=24, max_num_batched_tokens=16)
    prefix = PrefixCacheConfig.for_config(cfg, prefix_match_unit=2)
    state = ms.init_state(cfg, NUM_SLOTS, prefix)
    a = list(range(100, 111))
    b = a[:10] + [7, 8, 9]
    keys_b = prompt_unit_hashes(b, 2)
    state, ok, _ = _allocate_tails(state, cfg, prefix, [(0, 10, 0, 11)], _uploads({0: prompt_unit_hashes(a, 2)}))
    state_block = int(np.asarray(state.block_tables)[0, 0, 2])  # holds the state after 10 tokens
    # The next call indexes it and moves A to a fresh block with a copy of it.
    state, ok, copies = _allocate_tails(state, cfg, prefix, [(0, 1, 0, 11)])
    assert ok == [True]
    moved_to = int(np.asarray(state.block_tables)[0, 0, 2])
    assert moved_to != state_block and copies[0, 0].tolist() == [state_block, moved_to, 2]
    assert _lookup(state, cfg, prefix, keys_b, 13) == 10  # attention and state both at 10
    # B's step writes block 2 of the state group: copy-on-write there too.
    state, ok, copies = _allocate_tails(
        state, cfg, prefix, [(1, 2, 10, 13)], _uploads({1: keys_b}), released=[moved_to]
    )
    assert ok == [True]
    tables = np.asarray(state.block_tables)
    assert copies[0, 0].tolist() == [state_block, int(tables[0, 1, 2]), 2]
    assert copies[0, 1].tolist() == [int(tables[1, 0, 2]), int(tables[1, 1, 2]), 2]
