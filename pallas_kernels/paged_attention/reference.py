"""A deliberately naive plain-JAX paged attention, to test the kernels against.

It gathers every block of every table, whatever the window, and computes in
float32 with an explicit mask; memory grows with T x keys, so keep it small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _common


def paged_attention_reference(
    q: jax.Array,  # [T, QH, D]
    cache: jax.Array,  # [B, L, H, N, D + Dv] in `layout` order
    query_start_loc: jax.Array,  # [R + 1] int32
    seq_lens: jax.Array,  # [R] int32
    block_tables: jax.Array,  # [R, M] int32
    layer_idx: int | jax.Array = 0,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [QH]
    layout: str = _common.DEFAULT_LAYOUT,
) -> jax.Array:  # [T, QH, Dv]
    """Same contract as `paged_attention`."""
    num_tokens, num_q_heads, head_size = q.shape
    layer_cache = _common.to_blhnc(cache, layout)[:, layer_idx]  # [B, H, N, C]
    _, num_kv_heads, block_size, row_width = layer_cache.shape
    num_requests, max_blocks = block_tables.shape
    group_size = num_q_heads // num_kv_heads
    num_keys = max_blocks * block_size
    if sm_scale is None:
        sm_scale = head_size**-0.5

    # Every request's keys in position order: [R, H, M * N, C].
    kv = layer_cache[block_tables].transpose(0, 2, 1, 3, 4)
    kv = kv.reshape(num_requests, num_kv_heads, num_keys, row_width).astype(jnp.float32)

    # Each token's request and position.
    token = jnp.arange(num_tokens)
    real = token < query_start_loc[num_requests]
    req = jnp.minimum(jnp.searchsorted(query_start_loc[1:], token, side="right"), num_requests - 1)
    q_len = query_start_loc[req + 1] - query_start_loc[req]
    query_pos = seq_lens[req] - q_len + (token - query_start_loc[req])  # [T]
    key_pos = jnp.arange(num_keys)  # [K]

    mask = (key_pos[None, :] <= query_pos[:, None]) & real[:, None]  # [T, K]
    if sliding_window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
    if attention_chunk_size is not None:
        mask &= key_pos[None, :] // attention_chunk_size == (query_pos[:, None] // attention_chunk_size)
    mask = mask[:, None, None, :]  # [T, H, G, K]

    k = kv[req, ..., :head_size]  # [T, H, K, D]
    v = kv[req, ..., head_size:]  # [T, H, K, Dv]
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group_size, head_size)
    s = jnp.einsum("THGD,THKD->THGK", qg, k) * sm_scale
    if logits_soft_cap is not None:
        s = jnp.tanh(s / logits_soft_cap) * logits_soft_cap
    s = jnp.where(mask, s, -jnp.inf)
    if sinks is not None:
        # As transformers' gpt-oss: the sink is one more logit column of every row, never masked;
        # softmax over the row, then the column is dropped (it only adds to the denominator).
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, num_kv_heads, group_size, 1), s.shape[:-1] + (1,))
        s = jnp.concatenate([s, sink], axis=-1)  # [T, H, G, K + 1]
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(s - m)  # masked logits are -inf: 0
    denom = jnp.sum(e, axis=-1, keepdims=True)
    w = (e / jnp.where(denom > 0, denom, 1.0))[..., :num_keys]  # [T, H, G, K]
    # where, not einsum: unread slots may hold NaN, and NaN * 0 = NaN.
    out = jnp.where(mask[..., None], w[..., None] * v[:, :, None], 0.0).sum(axis=3)
    return out.reshape(num_tokens, num_q_heads, -1).astype(q.dtype)
