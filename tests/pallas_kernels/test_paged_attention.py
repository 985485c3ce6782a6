"""paged_attention against its reference, interpreted on CPU, NaN-poisoned caches."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import kernel_cases
import numpy as np
import pytest
from kernel_cases import AttentionCase

from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}


def _inputs(case: AttentionCase, seed: int):
    q, cache, qsl, seq_lens, tables = kernel_cases.build_attention_inputs(case, np.random.default_rng(seed))
    return (jnp.asarray(q), jnp.asarray(cache), qsl, seq_lens, tables, case.layer_idx)


def _options(case: AttentionCase) -> dict:
    return dict(
        sliding_window=case.sliding_window,
        attention_chunk_size=case.attention_chunk_size,
        logits_soft_cap=case.logits_soft_cap,
        layout=case.layout,
    )


def _check(case: AttentionCase, seed: int = 0, **kernel_options):
    args = _inputs(case, seed)
    out = paged_attention(*args, **_options(case), **kernel_options)
    ref = paged_attention_reference(*args, **_options(case))
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == (args[0].shape[0], args[0].shape[1], case.head_size_v)
    assert np.isfinite(ref).all(), "the reference read a poisoned slot"
    assert np.isfinite(out).all(), "the kernel read a poisoned slot"
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_sampled_shapes_match_reference(seed):
    # Block sizes 4-32, GQA 1-8, windows shorter and longer than the context,
    # chunks, soft-cap, layouts, ragged lengths with 0 and 1, padding tokens.
    window_kind = kernel_cases.WINDOW_KINDS[seed % len(kernel_cases.WINDOW_KINDS)]
    case = kernel_cases.sample_attention_case(np.random.default_rng(1000 + seed), window_kind)
    _check(case, seed)


def test_decode_batch_window_not_a_block_multiple():
    # Decodes at contexts inside, at, and well beyond a window of 7 over blocks of 4.
    case = AttentionCase(
        block_size=4,
        group_size=8,
        num_kv_heads=1,
        q_lens=(1, 1, 1, 1, 1),
        seq_lens=(1, 7, 8, 23, 40),
        max_blocks=10,
        sliding_window=7,
        num_padding_tokens=0,
    )
    _check(case)


def test_chunked_prefill_across_a_chunk_boundary():
    # Queries at positions 10..29 with chunks of 12: rows on both sides of 24.
    case = AttentionCase(
        block_size=8,
        q_lens=(20, 1),
        seq_lens=(30, 13),
        max_blocks=4,
        attention_chunk_size=12,
    )
    _check(case)


def test_bfloat16_with_soft_cap_and_gqa():
    case = AttentionCase(
        block_size=16,
        group_size=4,
        head_size=32,
        head_size_v=32,
        q_lens=(17, 1, 3),
        seq_lens=(40, 33, 3),
        max_blocks=3,
        sliding_window=20,
        logits_soft_cap=10.0,
        dtype="bfloat16",
    )
    _check(case)


def test_padding_tokens_are_zero():
    case = AttentionCase(q_lens=(3, 0), seq_lens=(5, 4), num_padding_tokens=4)
    out = _check(case)
    np.testing.assert_array_equal(out[3:], 0.0)


def test_traced_layer_index():
    case = AttentionCase()
    q, cache, qsl, seq_lens, tables, layer = _inputs(case, 0)
    out = jax.jit(paged_attention)(q, cache, qsl, seq_lens, tables, jnp.int32(layer))
    ref = paged_attention_reference(q, cache, qsl, seq_lens, tables, layer)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "case",
    [
        AttentionCase(block_size=8, q_lens=(9, 1, 0), seq_lens=(20, 9, 3), max_blocks=3),
        AttentionCase(
            block_size=16,
            head_size=32,
            head_size_v=32,
            q_lens=(1, 4),
            seq_lens=(45, 20),
            sliding_window=11,
            layout="LBHNC",
        ),
    ],
    ids=["full", "window"],
)
def test_mosaic_body_in_tpu_interpreter(case):
    # The TPU kernel (DMA double buffer) runs under the TPU interpreter on CPU.
    _check(case, backend="mosaic", interpret=True)


def _decodes_at(contexts, *, block_size, window):
    """One decode per context, each request holding only the blocks it needs."""
    max_blocks = -(-max(contexts) // block_size)
    return AttentionCase(
        block_size=block_size,
        num_kv_heads=1,
        group_size=1,
        head_size=8,
        head_size_v=8,
        q_lens=(1,) * len(contexts),
        seq_lens=tuple(contexts),
        max_blocks=max_blocks,
        num_layers=1,
        layer_idx=0,
        num_padding_tokens=0,
        sliding_window=window,
    )


@pytest.mark.parametrize(
    "block_size,window,contexts",
    [
        (4, 7, (1, 2, 6, 7, 8, 9, 13, 50, 101)),
        (16, 1024, (1024, 4096, 16384, 65536)),
    ],
)
def test_sliding_window_decode_reads_a_bounded_number_of_blocks(block_size, window, contexts):
    # The counts are the kernel's own loop iterations, not a formula.
    bound = -(-(window - 1) // block_size) + 1
    windowed = _decodes_at(contexts, block_size=block_size, window=window)
    args = _inputs(windowed, 0)
    out, blocks_read = paged_attention(*args, sliding_window=window, return_blocks_read=True)
    blocks_read = np.asarray(blocks_read)[:, 0]
    assert np.isfinite(np.asarray(out)).all()
    assert (blocks_read <= bound).all(), (blocks_read, bound)
    assert (blocks_read >= 1).all()
    # Beyond the window the cost is flat in context length.
    beyond = [n for c, n in zip(contexts, blocks_read) if c >= window + block_size]
    assert len(set(beyond)) == 1 and beyond[0] >= bound - 1

    full = dataclasses.replace(windowed, sliding_window=None)
    _, full_read = paged_attention(*_inputs(full, 0), return_blocks_read=True)
    expected = [-(-c // block_size) for c in contexts]
    np.testing.assert_array_equal(np.asarray(full_read)[:, 0], expected)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_q_heads=3), "num_q_heads=3 must be divisible by num_kv_heads=2"),
        (dict(sliding_window=4, attention_chunk_size=8), "not both"),
        (dict(sliding_window=0), "sliding_window=0 must be at least 1"),
        (dict(layout="HNC"), "layout='HNC' is not one of"),
        (dict(backend="cuda"), "backend='cuda' is not one of"),
        (dict(backend="mosaic", return_blocks_read=True), "needs backend='triton'"),
    ],
)
def test_trace_time_errors_name_the_value(kwargs, message):
    num_q_heads = kwargs.pop("num_q_heads", 4)
    q = jnp.zeros((3, num_q_heads, 8), jnp.float32)
    cache = jnp.zeros((5, 1, 2, 4, 16), jnp.float32)
    qsl = jnp.array([0, 3], jnp.int32)
    with pytest.raises(ValueError, match=message):
        paged_attention(q, cache, qsl, jnp.array([3], jnp.int32), jnp.ones((1, 2), jnp.int32), **kwargs)


def _attention_by_loops(case: AttentionCase, q, cache, qsl, seq_lens, tables):
    """Token by token, head by head, key by key, in float64."""
    axes = [case.layout.index(axis) for axis in "BLHNC"]
    canonical = cache.transpose(axes)[:, case.layer_idx].astype(np.float64)  # [B, H, N, C]
    n, d = case.block_size, case.head_size
    out = np.zeros((q.shape[0], q.shape[1], case.head_size_v))
    for r in range(len(case.q_lens)):
        for t in range(qsl[r], qsl[r + 1]):
            query_pos = seq_lens[r] - (qsl[r + 1] - qsl[r]) + (t - qsl[r])
            keys = [
                k
                for k in range(query_pos + 1)
                if (case.sliding_window is None or k > query_pos - case.sliding_window)
                and (
                    case.attention_chunk_size is None
                    or k // case.attention_chunk_size == query_pos // case.attention_chunk_size
                )
            ]
            for head in range(q.shape[1]):
                rows = np.stack([canonical[tables[r, k // n], head // case.group_size, k % n] for k in keys])
                logits = rows[:, :d] @ q[t, head].astype(np.float64) * d**-0.5
                if case.logits_soft_cap is not None:
                    logits = np.tanh(logits / case.logits_soft_cap) * case.logits_soft_cap
                weights = np.exp(logits - logits.max())
                out[t, head] = weights @ rows[:, d:] / weights.sum()
    return out


def test_reference_matches_a_plain_loop():
    case = AttentionCase(
        block_size=4,
        group_size=2,
        q_lens=(3, 1, 0),
        seq_lens=(9, 6, 2),
        logits_soft_cap=4.0,
        sliding_window=5,
        layout="LBHNC",
    )
    q, cache, qsl, seq_lens, tables = kernel_cases.build_attention_inputs(case, np.random.default_rng(7))
    ref = paged_attention_reference(q, cache, qsl, seq_lens, tables, case.layer_idx, **_options(case))
    expected = _attention_by_loops(case, q, cache, qsl, seq_lens, tables)
    np.testing.assert_allclose(np.asarray(ref), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad_id", [10**6, -5])
def test_table_entries_outside_the_pool_read_the_null_block(bad_id):
    # A corrupt table must not turn into a load past the cache: such an entry reads
    # the null block, exactly as a NULL_BLOCK entry would.
    case = AttentionCase()
    q, cache, qsl, seq_lens, tables = kernel_cases.build_attention_inputs(case, np.random.default_rng(3))
    cache[0] = 0.5  # a finite null block, so the two outputs can be compared
    bad, null = tables.copy(), tables.copy()
    bad[0, 1], null[0, 1] = bad_id, 0

    def run(t):
        return np.asarray(paged_attention(jnp.asarray(q), jnp.asarray(cache), qsl, seq_lens, t, case.layer_idx))

    np.testing.assert_array_equal(run(bad), run(null))
    assert np.isfinite(run(null)[: case.q_lens[0]]).all()
