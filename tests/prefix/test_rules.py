"""Prefix-cache hit rules: the issue's vectors, a position-level definition, and jnp == reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxkv
from jaxkv.prefix.rules import (
    HitRule,
    group_hit_lens,
    hit_blocks_reference,
    hybrid_hit_len_reference,
    prefix_hit_len,
    valid_hit_blocks,
)

T, F = True, False


def full(block_size):
    return HitRule(kind="full", block_size=block_size)


def sw(window, block_size):
    return HitRule(kind="sliding_window", block_size=block_size, window=window)


def chunked(chunk, block_size):
    return HitRule(kind="chunked_local", block_size=block_size, window=chunk)


def mamba(block_size):
    return HitRule(kind="mamba", block_size=block_size)


def jnp_hit_len(rules, cached, num_tokens):
    """prefix_hit_len for one request, jitted and eager (they must agree)."""
    args = (tuple(jnp.asarray([c], bool) for c in cached), jnp.asarray([num_tokens], jnp.int32))
    jitted = int(prefix_hit_len(tuple(rules), *args)[0])
    with jax.disable_jit():
        assert int(prefix_hit_len(tuple(rules), *args)[0]) == jitted
    return jitted


# The sliding-window vectors: W = 4, block 2, so a hit needs cdiv(3, 2) = 2
# contiguous cached blocks before its end, or a run from block 0. The bound is the
# whole pattern: num_tokens = 2 × len + 1 (the last token is never covered).
SW_VECTORS = [
    ([T, T, F, T, F, F, T, T, F, T, T, T], 12),  # blocks 10, 11 cached: everything
    ([T, T, F, T, F, F, T, T, F, F, F], 8),  # rightmost pair of hits is 6, 7
    ([T], 1),  # a run from block 0 shorter than 2 is still valid
    ([T, T, F], 2),
    ([T, T, T, F], 3),
    ([F] * 10, 0),
]


@pytest.mark.parametrize("pattern, expected_blocks", SW_VECTORS)
def test_sliding_window_vectors(pattern, expected_blocks):
    rule = sw(4, 2)
    assert hit_blocks_reference(rule, pattern, len(pattern)) == expected_blocks
    num_tokens = 2 * len(pattern) + 1
    assert hybrid_hit_len_reference([rule], [pattern], num_tokens) == 2 * expected_blocks
    assert jnp_hit_len([rule], [pattern], num_tokens) == 2 * expected_blocks


def test_fixed_point_vector():
    # Groups full, SW(32), SW(64), block 16, 8 candidate blocks (a 129-token request: bound 128).
    rules = [full(16), sw(32, 16), sw(64, 16)]
    cached = [
        [T] * 8,  # full: blocks 0-7
        [F, F, T, T, F, F, T, T],  # SW32 needs 2 blocks: {2, 3, 6, 7}
        [T] * 6 + [F, F],  # SW64 needs 4 blocks: {0-5}
    ]
    # full accepts 128; SW32 accepts 128 (6, 7); SW64 shrinks to 96 (2-5); SW32 to 64 (2, 3);
    # SW64 accepts 64 (0-3); stable.
    assert hybrid_hit_len_reference(rules, cached, 129) == 64
    assert jnp_hit_len(rules, cached, 129) == 64
    lens = group_hit_lens(tuple(rules), tuple(jnp.asarray([c]) for c in cached), jnp.asarray([129]))
    assert lens.tolist() == [[128, 128, 96]]  # each group alone


def test_identical_prompt_hits_all_but_last_block():
    # An identical 48-token prompt (block 16): all 3 blocks cached, but the last
    # token must be recomputed, so the hit is 32, not 48.
    assert hybrid_hit_len_reference([full(16)], [[T, T, T]], 48) == 32
    assert jnp_hit_len([full(16)], [[T, T, T]], 48) == 32


def test_vllm_hybrid_vector():
    # full + SW(32) + SW(32), block 16: a 53-token prompt sharing 48 tokens with a
    # cached 55-token one. The SW groups need only blocks 1, 2 (block 0 may be gone).
    rules = [full(16), sw(32, 16), sw(32, 16)]
    cached = [[T, T, T], [F, T, T], [F, T, T]]
    assert hybrid_hit_len_reference(rules, cached, 53) == 48
    assert jnp_hit_len(rules, cached, 53) == 48


def test_chunked_local_vectors():
    # Chunk 8, block 4 (vLLM's examples). Bound 15: block 3 (tokens 8-11) would need
    # the chunk's blocks from block 2; blocks 0, 1 are behind the chunk.
    assert hit_blocks_reference(chunked(8, 4), [F, F, T, F], 15 // 4) == 3
    assert hit_blocks_reference(chunked(8, 4), [F, F, F, F], 15 // 4) == 2
    # Bound 16: position 16 starts a chunk, so nothing is needed.
    assert hit_blocks_reference(chunked(8, 4), [F, F, F, F], 16 // 4) == 4
    assert jnp_hit_len([chunked(8, 4)], [[F, F, F, F]], 17) == 16


def test_mamba_takes_latest_saved_state():
    assert hit_blocks_reference(mamba(4), [T, F, T, F], 4) == 3
    assert hit_blocks_reference(mamba(4), [T, F, T, F], 2) == 1  # at or before the bound
    # Full attention hashed at a finer unit (4) beside a mamba group saving states every 8:
    # full reaches 20 tokens, the latest state at or before is at 16.
    rules = [full(4), mamba(8)]
    cached = [[T, T, T, T, T, F], [T, T, F]]
    assert hybrid_hit_len_reference(rules, cached, 25) == 16
    assert jnp_hit_len(rules, cached, 25) == 16


def test_for_spec_and_validation():
    kw = dict(block_size=16, num_kv_heads=1, head_size=8)
    assert HitRule.for_spec(jaxkv.SlidingWindowSpec(**kw, sliding_window=32)) == sw(32, 16)
    assert HitRule.for_spec(jaxkv.ChunkedLocalAttentionSpec(**kw, attention_chunk_size=64)) == chunked(64, 16)
    # A windowed layer planned as full attention keeps every token: the full rule.
    assert HitRule.for_spec(jaxkv.FullAttentionSpec(**kw, sliding_window=32)) == full(16)
    mamba_spec = jaxkv.MambaSpec(block_size=512, shapes=((4,),), dtypes=("float32",))
    assert HitRule.for_spec(mamba_spec, block_size=16) == mamba(16)
    with pytest.raises(ValueError, match="multiple of block_size"):
        chunked(10, 4)
    with pytest.raises(ValueError, match="needs window"):
        HitRule(kind="sliding_window", block_size=4)
    with pytest.raises(ValueError, match="kind='local'"):
        HitRule(kind="local", block_size=4)


def valid_by_positions(rule: HitRule, cached, num_blocks: int) -> bool:
    """A hit of `num_blocks` blocks, checked token by token: every key the token at
    p = num_blocks × b still attends to (or the state it resumes from) is cached."""
    b, p = rule.block_size, num_blocks * rule.block_size
    if rule.kind == "mamba":
        return num_blocks == 0 or cached[num_blocks - 1]
    if rule.kind == "full":
        first = 0
    elif rule.kind == "sliding_window":
        first = max(0, p - rule.window + 1)
    else:
        first = p // rule.window * rule.window  # chunked local: the chunk's first position
    return all(cached[pos // b] for pos in range(first, p))


rule_strategy = st.one_of(
    st.builds(full, st.sampled_from([1, 2, 4])),
    st.builds(sw, st.integers(1, 12), st.sampled_from([1, 2, 4])),
    st.sampled_from([1, 2, 4]).flatmap(lambda b: st.builds(lambda k: chunked(k * b, b), st.integers(1, 4))),
    st.builds(mamba, st.sampled_from([1, 2, 4])),
)
SPAN = 16  # tokens every group's candidates cover


def blocks(rule: HitRule):
    return st.lists(st.booleans(), min_size=SPAN // rule.block_size, max_size=SPAN // rule.block_size)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(rule=rule_strategy, data=st.data())
def test_reference_matches_position_definition(rule, data):
    cached = data.draw(blocks(rule))
    max_blocks = data.draw(st.integers(0, len(cached)))
    expected = max(n for n in range(max_blocks + 1) if valid_by_positions(rule, cached, n))
    assert hit_blocks_reference(rule, cached, max_blocks) == expected
    valid = np.asarray(valid_hit_blocks(rule, jnp.asarray([cached])))[0]
    assert valid.tolist() == [valid_by_positions(rule, cached, n) for n in range(len(cached) + 1)]


@settings(max_examples=25, deadline=None, derandomize=True)
@given(rules=st.lists(rule_strategy, min_size=1, max_size=3), data=st.data())
def test_jnp_matches_reference(rules, data):
    num_requests = 6
    cached = [data.draw(st.lists(blocks(r), min_size=num_requests, max_size=num_requests)) for r in rules]
    num_tokens = data.draw(st.lists(st.integers(0, SPAN + 4), min_size=num_requests, max_size=num_requests))
    args = (tuple(rules), tuple(jnp.asarray(c, bool) for c in cached), jnp.asarray(num_tokens, jnp.int32))
    hybrid = prefix_hit_len(*args)
    per_group = group_hit_lens(*args)
    with jax.disable_jit():
        np.testing.assert_array_equal(prefix_hit_len(*args), hybrid)
        np.testing.assert_array_equal(group_hit_lens(*args), per_group)
    for i in range(num_requests):
        request_cached = [c[i] for c in cached]
        assert int(hybrid[i]) == hybrid_hit_len_reference(rules, request_cached, num_tokens[i])
        for g, rule in enumerate(rules):
            bound = max(num_tokens[i] - 1, 0) // rule.block_size
            assert int(per_group[i, g]) == hit_blocks_reference(rule, request_cached[g], bound) * rule.block_size
