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


def _sinks(case: AttentionCase, seed: int):
    """The case's sink logits (or None), from a stream of their own: the other inputs stay as they were."""
    return kernel_cases.build_sinks(case, np.random.default_rng((seed, 1)))


def _options(case: AttentionCase, seed: int = 0) -> dict:
    return dict(
        sliding_window=case.sliding_window,
        attention_chunk_size=case.attention_chunk_size,
        logits_soft_cap=case.logits_soft_cap,
        sinks=_sinks(case, seed),
        layout=case.layout,
    )


def _check(case: AttentionCase, seed: int = 0, **kernel_options):
    args = _inputs(case, seed)
    out = paged_attention(*args, **_options(case, seed), **kernel_options)
    ref = paged_attention_reference(*args, **_options(case, seed))
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


@pytest.mark.parametrize("seed", range(8))
def test_sampled_shapes_with_sinks_match_reference(seed):
    # The same sampled batches with one sink logit per query head; every window kind on both
    # bodies (Triton for seeds 0-3, Mosaic in the TPU interpreter for 4-7).
    window_kind = kernel_cases.WINDOW_KINDS[seed % len(kernel_cases.WINDOW_KINDS)]
    case = kernel_cases.sample_attention_case(np.random.default_rng(2000 + seed), window_kind, sinks=True)
    _check(case, seed, backend=("triton", "mosaic")[seed // 4], interpret=True)


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_decode_batch_window_not_a_block_multiple(sinks):
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
        sinks=sinks,
    )
    _check(case)


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_chunked_prefill_across_a_chunk_boundary(sinks):
    # Queries at positions 10..29 with chunks of 12: rows on both sides of 24.
    case = AttentionCase(
        block_size=8,
        q_lens=(20, 1),
        seq_lens=(30, 13),
        max_blocks=4,
        attention_chunk_size=12,
        sinks=sinks,
    )
    _check(case)


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_bfloat16_with_soft_cap_and_gqa(sinks):
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
        sinks=sinks,
    )
    _check(case)


@pytest.mark.parametrize(
    "window",
    [{}, {"sliding_window": 6}, {"attention_chunk_size": 8}],
    ids=["full", "window-6", "chunk-8"],
)
def test_speculative_verification_batches(window):
    # Speculative decoding's verification pass: each row computes its last token and k = 4 draft tokens, 5
    # queries (issue 15). Blocks of 4: each row's queries start at a block start (rows 0, 2) or inside a block
    # (rows 1, 3) and run past a block boundary; the window of 6 is shorter than a row's queries plus a block, and
    # the chunk boundaries at 8 and 24 fall among the queries of rows 1 and 3.
    case = AttentionCase(
        block_size=4,
        group_size=4,
        num_kv_heads=2,
        q_lens=(5, 5, 5, 5),
        seq_lens=(5, 10, 13, 26),
        max_blocks=7,
        num_padding_tokens=2,
        **window,
    )
    _check(case)


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_padding_tokens_are_zero(sinks):
    case = AttentionCase(q_lens=(3, 0), seq_lens=(5, 4), num_padding_tokens=4, sinks=sinks)
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
        AttentionCase(
            block_size=8,
            group_size=3,
            q_lens=(7, 1, 1),
            seq_lens=(30, 9, 26),
            sliding_window=6,
            logits_soft_cap=5.0,
            sinks=True,
        ),
    ],
    ids=["full", "window", "window-gqa3-sinks"],
)
def test_mosaic_body_in_tpu_interpreter(case):
    # The TPU kernel (DMA double buffer) runs under the TPU interpreter on CPU.
    _check(case, backend="mosaic", interpret=True)


def _decodes_at(contexts, *, block_size, window, sinks=False):
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
        sinks=sinks,
    )


@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize(
    "block_size,window,contexts",
    [
        (4, 7, (1, 2, 6, 7, 8, 9, 13, 50, 101)),
        (16, 1024, (1024, 4096, 16384, 65536)),
    ],
)
def test_sliding_window_decode_reads_a_bounded_number_of_blocks(block_size, window, contexts, sinks):
    # The counts are the kernel's own loop iterations, not a formula. Sinks change no read.
    bound = -(-(window - 1) // block_size) + 1
    windowed = _decodes_at(contexts, block_size=block_size, window=window, sinks=sinks)
    args = _inputs(windowed, 0)
    out, blocks_read = paged_attention(*args, **_options(windowed), return_blocks_read=True)
    blocks_read = np.asarray(blocks_read)[:, 0]
    assert np.isfinite(np.asarray(out)).all()
    assert (blocks_read <= bound).all(), (blocks_read, bound)
    assert (blocks_read >= 1).all()
    # Beyond the window the cost is flat in context length.
    beyond = [n for c, n in zip(contexts, blocks_read) if c >= window + block_size]
    assert len(set(beyond)) == 1 and beyond[0] >= bound - 1

    full = dataclasses.replace(windowed, sliding_window=None)
    _, full_read = paged_attention(*_inputs(full, 0), **_options(full), return_blocks_read=True)
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
        (dict(sinks=jnp.zeros((2,), jnp.float32)), r"sinks must be \[QH\] = \(4,\), one logit per query head"),
        (dict(sinks=jnp.zeros((4, 1), jnp.float32)), r"sinks must be \[QH\]"),
        (dict(sinks=jnp.zeros((4,), jnp.int32)), "sinks.dtype=dtype\\('int32'\\) must be a float dtype"),
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


def _transformers_sink_attention(case: AttentionCase, q, cache, qsl, seq_lens, tables, sinks, *, sink="column"):
    """gpt-oss attention as transformers' `eager_attention_forward` writes it, per request, in float64 numpy.

    The scaled (soft-capped) logits get an additive mask of float32's min, the sink joins every row
    as one more logit column, the row max is subtracted, softmax, the column is dropped, times V.
    sink="missing" leaves the column out and sink="masked_by_window" masks it in the rows whose
    window or chunk hides an earlier key: two wrong variants the tests must tell apart.
    """
    axes = [case.layout.index(axis) for axis in "BLHNC"]
    canonical = cache.transpose(axes)[:, case.layer_idx].astype(np.float64)  # [B, H, N, C]
    n, d, g = case.block_size, case.head_size, case.group_size
    mask_min = float(np.finfo(np.float32).min)
    out = np.zeros((q.shape[0], q.shape[1], case.head_size_v))
    for r in range(len(case.q_lens)):
        begin, end, seq_len = qsl[r], qsl[r + 1], seq_lens[r]
        if begin == end:
            continue
        key_pos = np.arange(seq_len)  # [K]
        query_pos = seq_len - (end - begin) + np.arange(end - begin)  # [S]
        causal = key_pos[None, :] <= query_pos[:, None]  # [S, K]
        visible = causal.copy()
        if case.sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - case.sliding_window
        if case.attention_chunk_size is not None:
            chunk = case.attention_chunk_size
            visible &= key_pos[None, :] // chunk == query_pos[:, None] // chunk
        kv = canonical[tables[r, key_pos // n], :, key_pos % n]  # [K, H, C]
        # Keys no query sees may sit in released (NaN) blocks; transformers never holds them.
        kv = np.where(visible.any(0)[:, None, None], kv, 0.0)
        k, v = np.repeat(kv[..., :d], g, axis=1), np.repeat(kv[..., d:], g, axis=1)  # [K, QH, D], [K, QH, Dv]
        logits = np.einsum("SHD,KHD->HSK", q[begin:end].astype(np.float64), k) * d**-0.5
        if case.logits_soft_cap is not None:
            logits = np.tanh(logits / case.logits_soft_cap) * case.logits_soft_cap
        logits = logits + np.where(visible, 0.0, mask_min)  # [QH, S, K]
        if sink != "missing":
            column = np.broadcast_to(sinks.astype(np.float64)[:, None, None], logits.shape[:2] + (1,))
            if sink == "masked_by_window":
                column = column + np.where((causal & ~visible).any(1), mask_min, 0.0)[None, :, None]
            logits = np.concatenate([logits, column], axis=-1)  # [QH, S, K + 1]
        logits = logits - logits.max(-1, keepdims=True)
        probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        out[begin:end] = np.einsum("HSK,KHD->SHD", probs[..., :seq_len], v)
    return out


def _sink_case(**fields) -> AttentionCase:
    # GQA 3, soft cap, a prefill chunk, decodes and an idle request; NaN everywhere unread.
    base = dict(
        block_size=4,
        group_size=3,
        q_lens=(6, 1, 1, 0),
        seq_lens=(14, 15, 3, 5),
        max_blocks=4,
        logits_soft_cap=4.0,
        sinks=True,
    )
    return AttentionCase(**{**base, **fields})


@pytest.mark.parametrize(
    "fields",
    [dict(), dict(sliding_window=3), dict(attention_chunk_size=5, layout="LBHNC")],
    ids=["full", "window", "chunk"],
)
def test_reference_sinks_match_the_transformers_formula(fields):
    case = _sink_case(**fields)
    q, cache, qsl, seq_lens, tables = kernel_cases.build_attention_inputs(case, np.random.default_rng(5))
    sinks = _sinks(case, 5)
    ref = paged_attention_reference(q, cache, qsl, seq_lens, tables, case.layer_idx, **_options(case, 5))
    expected = _transformers_sink_attention(case, q, cache, qsl, seq_lens, tables, sinks)
    np.testing.assert_allclose(np.asarray(ref), expected, atol=1e-5, rtol=1e-5)


def test_a_missing_or_window_masked_sink_would_be_caught():
    # A window of 3 hides earlier keys from every query past position 2: there a sink masked like a
    # key would vanish. Both wrong variants miss the formula by far more than the tolerance; the
    # kernel (and, above, the reference) match it.
    case = _sink_case(sliding_window=3)
    q, cache, qsl, seq_lens, tables = kernel_cases.build_attention_inputs(case, np.random.default_rng(5))
    sinks = _sinks(case, 5)
    out = np.asarray(paged_attention(*_inputs(case, 5), **_options(case, 5)))
    formula = _transformers_sink_attention(case, q, cache, qsl, seq_lens, tables, sinks)
    tol = TOLERANCE["float32"]
    np.testing.assert_allclose(out, formula, atol=tol, rtol=tol)
    for wrong in ("missing", "masked_by_window"):
        variant = _transformers_sink_attention(case, q, cache, qsl, seq_lens, tables, sinks, sink=wrong)
        assert np.abs(variant - formula).max() > 1000 * tol, wrong
