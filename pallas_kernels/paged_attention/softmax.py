"""Masking and online-softmax math shared by every backend's kernel body.

Dimension legend (inside one kernel program):
  R  rows of the query tile: `block_q` queries x `group_pad` query heads of one KV head
  N  keys of one block (the block size)
  D  head size of K (and Q); Dv head size of V

Positions are token positions within a request, 0-based. The key at position
k is visible to the query at q iff k <= q and
  sliding window W:     q - W < k
  chunked local, C:     k // C == q // C

Attention sinks (gpt-oss): query head h has a learned logit sigma_h that joins
every row's softmax denominator and nothing else (no value, no mask):
  o = sum_j e^(s_j - m) v_j / (e^(sigma_h - m) + sum_j e^(s_j - m))
The online softmax starts such a row at running max sigma_h and running sum 1
(its own term, e^(sigma_h - sigma_h)), so the loop and `finalize` are unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Finite, so that a row whose keys are all masked never computes inf - inf.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AttentionConfig:
    """The static configuration one kernel program needs."""

    block_size: int  # N
    head_size: int  # D
    head_size_v: int  # Dv
    group_size: int  # G, query heads per KV head
    group_pad: int  # G rounded up to a power of 2; rows are (query, head) pairs
    block_q: int  # queries per tile
    sm_scale: float
    sliding_window: int | None
    attention_chunk_size: int | None
    logits_soft_cap: float | None
    use_dot: bool  # matrix units for the two products; elementwise otherwise
    sinks: bool  # each row starts with its query head's sink logit (an extra input)

    @property
    def rows(self) -> int:
        return self.block_q * self.group_pad


def _div(x, d: int):
    """x // d for non-negative int32 x (positions), without floor-division fixups."""
    return lax.div(x, jnp.int32(d))


def first_visible_key(first_query_pos, cfg: AttentionConfig):
    """The lowest key position that any query at or after `first_query_pos` sees."""
    if cfg.sliding_window is not None:
        return jnp.maximum(first_query_pos - (cfg.sliding_window - 1), 0)
    if cfg.attention_chunk_size is not None:
        return _div(first_query_pos, cfg.attention_chunk_size) * cfg.attention_chunk_size
    return jnp.zeros_like(first_query_pos)


def safe_block_id(block_id, num_blocks: int):
    """A table entry outside [0, B) reads the null block (0) instead of memory past the cache.

    The manager never writes such entries; this keeps a corrupt table from turning
    into an out-of-bounds load (GPU) or DMA (TPU).
    """
    return lax.select((block_id >= 0) & (block_id < num_blocks), block_id, jnp.zeros_like(block_id))


def block_range(first_query_pos, num_queries, cfg: AttentionConfig, max_blocks: int):
    """The blocks one query tile reads: [first_block, end_block), and the first live key.

    The range starts at the block of the first key any query of the tile can
    see (so blocks behind a window are never read) and ends with the block of
    its last query; a tile without queries reads nothing. Both ends stay inside
    the table even for inconsistent lengths, so no load leaves it.
    """
    live_begin = first_visible_key(first_query_pos, cfg)
    n = cfg.block_size
    first_block = jnp.clip(lax.div(live_begin, n), 0, max_blocks)
    end_block = jnp.clip(lax.div(first_query_pos + num_queries + (n - 1), n), 0, max_blocks)
    end_block = lax.select(num_queries > 0, jnp.maximum(end_block, first_block), first_block)
    return live_begin, first_block, end_block


def visible(query_pos, key_pos, cfg: AttentionConfig):
    """Causal mask with the group's window; broadcasts its int32 arguments."""
    mask = key_pos <= query_pos
    if cfg.sliding_window is not None:
        mask = mask & (key_pos > query_pos - cfg.sliding_window)
    if cfg.attention_chunk_size is not None:
        chunk = cfg.attention_chunk_size
        mask = mask & (_div(key_pos, chunk) == _div(query_pos, chunk))
    return mask


def row_positions(first_query_pos, num_queries, cfg: AttentionConfig):
    """Per tile row: its query's position [R, 1] and whether the row is real [R, 1].

    Row r holds query r // group_pad of the tile and query head r % group_pad of
    the KV head's group; heads past group_size are padding.
    """
    row = lax.broadcasted_iota(jnp.int32, (cfg.rows, 1), 0)
    # group_pad is a power of 2: shift and mask, no vector division.
    query_in_tile = lax.shift_right_logical(row, jnp.int32(cfg.group_pad.bit_length() - 1))
    head_in_group = lax.bitwise_and(row, jnp.int32(cfg.group_pad - 1))
    real = (query_in_tile < num_queries) & (head_in_group < cfg.group_size)
    return first_query_pos + query_in_tile, real


def init_state(cfg: AttentionConfig, sinks=None):
    """(running max [R, 1], running sum [R, 1], unnormalised output [R, Dv]), float32.

    sinks: float32 [R, 1], each row's sink logit, or None. A row with a sink
    starts as if it had seen one key of logit sigma and value 0: max sigma, sum
    e^(sigma - sigma) = 1, output 0. A row that then sees no key comes out 0.
    """
    acc = jnp.zeros((cfg.rows, cfg.head_size_v), jnp.float32)
    if sinks is None:
        return jnp.full((cfg.rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((cfg.rows, 1), jnp.float32), acc
    return sinks.astype(jnp.float32), jnp.ones((cfg.rows, 1), jnp.float32), acc


def _scores(q, k, cfg: AttentionConfig):
    """q [R, D], k [N, D] -> float32 [R, N], scaled and soft-capped."""
    if cfg.use_dot:
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    else:
        s = jnp.sum(q.astype(jnp.float32)[:, None, :] * k.astype(jnp.float32)[None, :, :], axis=2)
    s = s * cfg.sm_scale
    if cfg.logits_soft_cap is not None:
        s = jnp.tanh(s / cfg.logits_soft_cap) * cfg.logits_soft_cap
    return s


def _weighted_values(p, v, cfg: AttentionConfig):
    """p float32 [R, N], v [N, Dv] -> float32 [R, Dv]."""
    if cfg.use_dot:
        return lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.sum(p[:, :, None] * v.astype(jnp.float32)[None, :, :], axis=1)


def attend_block(
    state,
    q: jax.Array,  # [R, D]
    k: jax.Array,  # [N, D], one block's keys
    v: jax.Array,  # [N, Dv], one block's values
    *,
    block_start_pos,  # position of the block's first key
    query_pos,  # [R, 1] int32
    row_real,  # [R, 1] bool
    live_keys_begin,  # keys before this position are not needed by the tile
    seq_len,  # keys at or after this position are not written yet
    cfg: AttentionConfig,
):
    """One online-softmax step over one block of keys."""
    m_prev, l_prev, acc_prev = state
    n = cfg.block_size
    key_pos = block_start_pos + lax.broadcasted_iota(jnp.int32, (1, n), 1)  # [1, N]
    mask = row_real & visible(query_pos, key_pos, cfg)  # [R, N]

    # Slots outside [live_keys_begin, seq_len) may hold anything, NaN included:
    # masking their logits is not enough, since their V rows are multiplied by
    # a zero weight and NaN * 0 = NaN.
    key_pos_col = block_start_pos + lax.broadcasted_iota(jnp.int32, (n, 1), 0)  # [N, 1]
    key_live = (key_pos_col >= live_keys_begin) & (key_pos_col < seq_len)
    v = jnp.where(key_live, v, jnp.zeros_like(v))

    s = jnp.where(mask, _scores(q, k, cfg), MASK_VALUE)  # [R, N]
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [R, 1]
    correction = jnp.exp(m_prev - m_next)  # [R, 1]
    p = jnp.where(mask, jnp.exp(s - m_next), 0.0)  # [R, N]
    l_next = correction * l_prev + jnp.sum(p, axis=1, keepdims=True)
    acc_next = correction * acc_prev + _weighted_values(p, v, cfg)
    return m_next, l_next, acc_next


def finalize(state):
    """The normalised output [R, Dv] in float32; rows that saw no key are 0."""
    _, row_sum, acc = state
    return acc / jnp.where(row_sum > 0.0, row_sum, 1.0)
