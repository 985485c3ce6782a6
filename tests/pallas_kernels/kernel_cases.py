"""Builders of paged caches and ragged batches for the kernel tests.

Every slot a kernel must not read is NaN: the null block, every block no table
holds, the other layers, slots past a request's length, and blocks a window
or chunk has released (their table entries hold the null block). A stray read
then poisons the output.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxkv.planner.specs import NULL_BLOCK


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionCase:
    block_size: int = 8
    num_kv_heads: int = 2
    group_size: int = 2
    head_size: int = 16
    head_size_v: int = 16
    q_lens: tuple[int, ...] = (5, 1, 0, 1)
    seq_lens: tuple[int, ...] = (20, 9, 7, 1)
    num_padding_tokens: int = 3
    max_blocks: int = 4
    num_layers: int = 2
    layer_idx: int = 1
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    logits_soft_cap: float | None = None
    sinks: bool = False  # one sink logit per query head (gpt-oss), see build_sinks
    layout: str = "BLHNC"
    dtype: str = "float32"


def first_needed_block(case: AttentionCase, first_query_pos: int) -> int:
    """The first table index a request still holds (the manager's release rule)."""
    if case.sliding_window is not None:
        return max(0, first_query_pos - case.sliding_window + 1) // case.block_size
    if case.attention_chunk_size is not None:
        chunk = case.attention_chunk_size
        return first_query_pos // chunk * chunk // case.block_size
    return 0


def to_layout(canonical: np.ndarray, layout: str) -> np.ndarray:
    """[B, L, H, N, C] -> the axis order `layout`."""
    return np.ascontiguousarray(canonical.transpose(["BLHNC".index(a) for a in layout]))


def build_attention_inputs(case: AttentionCase, rng: np.random.Generator):
    """Returns (q, cache, query_start_loc, seq_lens, block_tables) as numpy arrays."""
    n = case.block_size
    num_requests = len(case.q_lens)
    row_width = case.head_size + case.head_size_v
    num_blocks = num_requests * case.max_blocks + 3  # Spare blocks stay NaN.
    canonical = np.full((num_blocks, case.num_layers, case.num_kv_heads, n, row_width), np.nan, np.float32)
    tables = np.full((num_requests, case.max_blocks), NULL_BLOCK, np.int32)
    free_ids = iter(rng.permutation(np.arange(1, num_blocks)))
    for r, (q_len, seq_len) in enumerate(zip(case.q_lens, case.seq_lens)):
        assert q_len <= seq_len <= case.max_blocks * n, (q_len, seq_len)
        first = first_needed_block(case, seq_len - q_len) if q_len else 0
        for i in range(first, -(-seq_len // n)):
            block_id = next(free_ids)
            tables[r, i] = block_id
            filled = min(n, seq_len - i * n)  # Slots past the length stay NaN.
            canonical[block_id, case.layer_idx, :, :filled] = rng.normal(size=(case.num_kv_heads, filled, row_width))
    num_tokens = sum(case.q_lens) + case.num_padding_tokens
    q = rng.normal(size=(num_tokens, case.num_kv_heads * case.group_size, case.head_size))
    query_start_loc = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
    return (
        q.astype(case.dtype),
        to_layout(canonical, case.layout).astype(case.dtype),
        query_start_loc,
        np.asarray(case.seq_lens, np.int32),
        tables,
    )


def build_sinks(case: AttentionCase, rng: np.random.Generator) -> np.ndarray | None:
    """float32 [QH] sink logits if `case.sinks`, else None.

    Spread like the logits (sd 2 around 0), so a sink takes a visible share of a
    short window's softmax and a small one of a long context's.
    """
    if not case.sinks:
        return None
    return (2.0 * rng.normal(size=case.num_kv_heads * case.group_size)).astype(np.float32)


WINDOW_KINDS = ("none", "short", "long", "chunk")


def sample_attention_case(rng: np.random.Generator, window_kind: str, **overrides) -> AttentionCase:
    """A random ragged batch: prefill chunks, decodes, idle requests, padding.

    window_kind: "none" (full attention), "short"/"long" (a sliding window
    shorter/longer than the table's capacity) or "chunk" (chunked local).
    `overrides` replace sampled fields or set others, e.g. `sinks=True`.
    """
    block_size = int(rng.choice([4, 8, 16, 32]))
    max_blocks = int(rng.integers(2, 6))
    num_requests = int(rng.integers(1, 5))
    capacity = max_blocks * block_size
    q_lens, seq_lens = [], []
    for _ in range(num_requests):
        seq_len = int(rng.integers(0, capacity + 1))
        kind = rng.choice(["decode", "prefill", "chunk", "idle"])
        q_len = {
            "decode": min(1, seq_len),
            "prefill": seq_len,
            "chunk": int(rng.integers(0, seq_len + 1)),
            "idle": 0,
        }[kind]
        q_lens.append(min(q_len, 24))  # Keep the reference's T x keys small.
        seq_lens.append(seq_len)
    fields = dict(
        block_size=block_size,
        max_blocks=max_blocks,
        num_kv_heads=int(rng.choice([1, 2])),
        group_size=int(rng.choice([1, 2, 3, 4, 8])),
        q_lens=tuple(q_lens),
        seq_lens=tuple(seq_lens),
        num_padding_tokens=int(rng.integers(0 if sum(q_lens) else 1, 3)),
        # Windows shorter and longer than the context, rarely a block multiple.
        sliding_window={"short": int(rng.integers(1, capacity // 2 + 2)), "long": capacity + 5}.get(window_kind),
        attention_chunk_size=int(rng.integers(2, capacity)) if window_kind == "chunk" else None,
        logits_soft_cap=float(rng.choice([0, 5.0])) or None,
        layout=str(rng.choice(["BLHNC", "BLHNC", "LBHNC", "BLNHC"])),
        dtype=str(rng.choice(["float32", "float32", "float32", "bfloat16"])),
    )
    fields.update(overrides)
    return AttentionCase(**fields)
