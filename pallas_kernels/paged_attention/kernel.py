"""Ragged paged attention over a block-outer KV cache that reads only live blocks.

Dimension legend:
  T   query tokens of the step (prefill chunks and decodes together, padding last)
  QH  query heads; H KV heads; G = QH // H query heads per KV head
  D   head size of Q and K; Dv head size of V (C = D + Dv cache row channels)
  Rq  requests (rows of the block table); M blocks per table row
  B   blocks; L layers sharing the cache buffer; N block size
  NT  query tiles: each holds up to `block_q` consecutive queries of one request
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _common
from pallas_kernels.paged_attention import tuning
from pallas_kernels.paged_attention.mosaic_kernel import mosaic_kernel
from pallas_kernels.paged_attention.softmax import AttentionConfig
from pallas_kernels.paged_attention.triton_kernel import triton_kernel

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _tiles(query_start_loc, seq_lens, *, num_tiles: int, block_q: int):
    """Splits each request's queries into tiles of `block_q`.

    Returns, per tile [NT], its request, first token index, first query position
    and number of real queries (0 for the padding tiles at the end); and per
    request [Rq], the index of its first tile (to map tokens back).
    """
    num_requests = seq_lens.shape[0]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [Rq]
    tiles_per_req = (q_lens + block_q - 1) // block_q
    tile_end = jnp.cumsum(tiles_per_req)  # [Rq]
    tile_begin = tile_end - tiles_per_req
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    req = jnp.searchsorted(tile_end, tile, side="right").astype(jnp.int32)
    real = req < num_requests
    req = jnp.minimum(req, num_requests - 1)
    first_in_req = (tile - tile_begin[req]) * block_q
    tile_len = jnp.where(real, jnp.clip(q_lens[req] - first_in_req, 0, block_q), 0)
    tile_token = query_start_loc[req] + first_in_req
    tile_pos = seq_lens[req] - q_lens[req] + first_in_req
    return req, tile_token, tile_pos, tile_len.astype(jnp.int32), tile_begin


def _paged_attention_call(
    q_tiles,  # [NT, H, R, D]
    cache,
    scalars,  # (layer, tile_req, tile_pos, tile_len, seq_lens, block_tables)
    row_sinks,  # [H, R, 1] float32, each tile row's sink logit, or None
    *,
    cfg: AttentionConfig,
    layout: str,
    backend: str,
    interpret: bool,
    count_blocks: bool,
):
    """Builds the grid and BlockSpecs for one backend and calls the kernel."""
    num_tiles, num_kv_heads, rows, _ = q_tiles.shape
    grid = (num_tiles, num_kv_heads)  # One program per (query tile, KV head).
    o_shape = jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, cfg.head_size_v), q_tiles.dtype)
    interpret_param = _common.interpret_arg(backend, interpret)
    # With sinks, one more input after the cache: this KV head's [R, 1] row sinks.
    sink_args = () if row_sinks is None else (row_sinks,)

    if backend == "triton":
        out_specs = [pl.BlockSpec((None, None, rows, cfg.head_size_v), lambda i, h: (i, h, 0, 0))]
        out_shape = [o_shape]
        if count_blocks:
            out_specs.append(pl.BlockSpec((None, None, 1), lambda i, h: (i, h, 0)))
            out_shape.append(jax.ShapeDtypeStruct((num_tiles, num_kv_heads, 1), jnp.int32))
        num_warps, num_stages = tuning.triton_launch(cfg.head_size)
        return pl.pallas_call(
            functools.partial(triton_kernel, cfg=cfg, layout=layout),
            grid=grid,
            in_specs=[pl.BlockSpec()] * len(scalars)  # Scalars: whole arrays.
            + [
                # The tile's rows for this KV head.
                pl.BlockSpec((None, None, rows, cfg.head_size), lambda i, h: (i, h, 0, 0)),
                # The cache: whole array, the kernel loads the blocks it needs.
                pl.BlockSpec(),
            ]
            + [pl.BlockSpec((None, rows, 1), lambda i, h: (h, 0, 0))] * len(sink_args),
            out_specs=out_specs,
            out_shape=out_shape,
            compiler_params=_common.triton_params(num_warps, num_stages),
            interpret=interpret_param,
            name="paged_attention",
        )(*scalars, q_tiles, cache, *sink_args)

    layer, tile_req, tile_pos, tile_len, seq_lens, block_tables = scalars
    max_blocks = block_tables.shape[1]

    def index(i, h, *prefetch):
        return (i, h, 0, 0)

    def sinks_index(i, h, *prefetch):
        return (h, 0, 0)

    (o_tiles,) = pl.pallas_call(
        functools.partial(mosaic_kernel, cfg=cfg, layout=layout, max_blocks=max_blocks),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalars),
            grid=grid,
            in_specs=[
                pl.BlockSpec((None, None, rows, cfg.head_size), index),  # q tile
                pl.BlockSpec(memory_space=pl.ANY),  # cache stays in HBM
            ]
            + [pl.BlockSpec((None, rows, 1), sinks_index)] * len(sink_args),  # row sinks (VMEM)
            out_specs=[pl.BlockSpec((None, None, rows, cfg.head_size_v), index)],
            scratch_shapes=[
                pltpu.VMEM((2, cfg.block_size, cfg.head_size + cfg.head_size_v), cache.dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        out_shape=[o_shape],
        compiler_params=_common.mosaic_params(("parallel", "parallel")),
        interpret=interpret_param,
        name="paged_attention",
    )(layer, tile_req, tile_pos, tile_len, seq_lens, block_tables.reshape(-1), q_tiles, cache, *sink_args)
    return [o_tiles]


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "attention_chunk_size",
        "logits_soft_cap",
        "layout",
        "block_q",
        "backend",
        "interpret",
        "return_blocks_read",
    ),
)
def paged_attention(
    q: jax.Array,  # [T, QH, D]
    cache: jax.Array,  # [B, L, H, N, D + Dv] in `layout` order
    query_start_loc: jax.Array,  # [Rq + 1] int32
    seq_lens: jax.Array,  # [Rq] int32
    block_tables: jax.Array,  # [Rq, M] int32
    layer_idx: int | jax.Array = 0,  # scalar in [0, L)
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [QH] float32
    layout: str = _common.DEFAULT_LAYOUT,
    block_q: int | None = None,
    backend: str | None = None,
    interpret: bool | None = None,
    return_blocks_read: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [T, QH, Dv] (, [Rq, H] int32)
    """Causal attention of a ragged batch of queries over a paged KV cache.

    Dimensions: T query tokens; QH query heads; H KV heads (QH % H == 0, query
    head j reads KV head j // (QH // H)); D = q.shape[-1]; the cache rows hold K
    in channels [0, D) and V in [D, C); Rq requests; M table width; B blocks; L
    layers; N block size.

    Request r owns tokens `query_start_loc[r] : query_start_loc[r + 1]` of `q`;
    after this step it has `seq_lens[r]` tokens in the cache (this step's K/V
    already written, e.g. by `paged_scatter`), so its queries sit at positions
    `seq_lens[r] - q_len .. seq_lens[r] - 1`. Prefill chunks, decodes (q_len 1)
    and idle requests (q_len 0) mix freely; tokens past `query_start_loc[Rq]` are
    padding and come out as zeros. `block_tables[r, i]` is the physical block of
    positions `[i * N, (i + 1) * N)`; entries a request no longer needs may hold
    the null block 0.

    The key at position k is visible to the query at q iff `k <= q`, and also
    `q - sliding_window < k` with a window, or `k // C == q // C` with chunked
    local attention of chunk C. With either, each query tile's loop over blocks
    starts at the first block any of its queries can see: blocks behind the
    window are never read, and a decode reads at most
    `cdiv(sliding_window - 1, N) + 1` blocks at any context length.

    Attention sinks (gpt-oss): `sinks[h]` is one more logit in every softmax row
    of query head h, in the denominator only (no value), never masked by the
    causal rule, window or chunk:
    `o = sum_k e^(s_k - m) v_k / (e^(sinks[h] - m) + sum_k e^(s_k - m))`. A
    query that sees no key gives 0. The blocks read are the same as without.

    Jitted; everything after `layer_idx` but `sinks` is static. `layer_idx` is
    traced (one compilation serves every layer) and not range-checked; `sinks`
    is traced (None and an array compile apart).

    Args:
      sm_scale: logit scale, default `D ** -0.5`.
      logits_soft_cap: if set, logits become `cap * tanh(logits / cap)` (after
        scaling).
      sinks: float [QH] sink logits, one per query head (traced, computed on in
        float32), or None: no sink term, and no sink work in the kernel.
      layout: the cache's axis order, "BLHNC" (block-outer, default), "BLNHC",
        "LBHNC" or "LBNHC".
      block_q: queries per tile (power of 2 on GPU); default fills 16 rows of
        (query, head-in-group) pairs.
      backend: "triton" (GPU, and the kernel interpreted on CPU) or "mosaic"
        (TPU); None picks by `jax.default_backend()`. ("mosaic_gpu": no body yet,
        refused.)
      interpret: run in the Pallas interpreter; None means yes unless a GPU or
        TPU is the default backend.
      return_blocks_read: also return, per request and KV head, how many cache
        blocks the kernel's loops loaded (Triton backend only).

    Multi-device: the kernel only sees local shapes, so under `shard_map` with q
    split over QH, the cache over H (same number of shards), `sinks` over QH as q
    and the metadata replicated, each shard computes its own heads.
    """
    backend, interpret = _common.resolve_backend(backend, interpret)
    if backend == "mosaic_gpu":
        raise ValueError("paged_attention has no Mosaic GPU body yet: use backend='triton' on GPU")
    dims = _common.cache_dims(cache.shape, layout)
    if q.ndim != 3:
        raise ValueError(f"q must be [T, QH, D], got shape {q.shape}.")
    num_tokens, num_q_heads, head_size = q.shape
    num_kv_heads, block_size, row_width = dims["H"], dims["N"], dims["C"]
    head_size_v = row_width - head_size
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be divisible by {num_kv_heads=}.")
    if head_size_v <= 0:
        raise ValueError(
            f"cache rows have C={row_width} channels, K alone takes {head_size=} (q.shape[-1]); "
            "rows must hold K then V."
        )
    if q.dtype != cache.dtype or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{q.dtype=} and {cache.dtype=} must be equal and one of float32, bfloat16, float16.")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [Rq, M], got shape {block_tables.shape}.")
    num_requests, max_blocks = block_tables.shape
    if num_requests < 1 or num_tokens < 1:
        raise ValueError(f"need at least one request and one token, got {num_requests=}, {num_tokens=}.")
    if seq_lens.shape != (num_requests,) or query_start_loc.shape != (num_requests + 1,):
        raise ValueError(
            f"{seq_lens.shape=} must be ({num_requests},) and {query_start_loc.shape=} must be "
            f"({num_requests + 1},), one per block-table row."
        )
    for name, arr in (
        ("query_start_loc", query_start_loc),
        ("seq_lens", seq_lens),
        ("block_tables", block_tables),
    ):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name}.dtype={arr.dtype} must be an integer dtype (int32).")
    if sliding_window is not None and attention_chunk_size is not None:
        raise ValueError(f"{sliding_window=} and {attention_chunk_size=}: a group has one or the other, not both.")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{sliding_window=} must be at least 1.")
    if attention_chunk_size is not None and attention_chunk_size < 1:
        raise ValueError(f"{attention_chunk_size=} must be at least 1.")
    if logits_soft_cap is not None and logits_soft_cap <= 0:
        raise ValueError(f"{logits_soft_cap=} must be positive.")
    if sinks is not None:
        if sinks.shape != (num_q_heads,):
            raise ValueError(f"sinks must be [QH] = ({num_q_heads},), one logit per query head, got {sinks.shape=}.")
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(f"{sinks.dtype=} must be a float dtype (float32).")
    if return_blocks_read and backend != "triton":
        raise ValueError(f"return_blocks_read=True needs backend='triton', got {backend=}.")

    group_size = num_q_heads // num_kv_heads
    group_pad = _common.next_power_of_2(group_size)
    if block_q is None:
        block_q = tuning.default_block_q(group_pad)
    if block_q < 1:
        raise ValueError(f"{block_q=} must be at least 1.")
    rows = block_q * group_pad
    if backend == "triton":
        use_dot = min(rows, block_size, head_size, head_size_v) >= 16
        if not interpret:
            for name, value in (
                ("head_size", head_size),
                ("head_size_v", head_size_v),
                ("block_size", block_size),
                ("block_q", block_q),
            ):
                if not _common.is_power_of_2(value):
                    raise ValueError(f"{name}={value} must be a power of 2 for the Triton backend.")
    else:
        use_dot = True
    cfg = AttentionConfig(
        block_size=block_size,
        head_size=head_size,
        head_size_v=head_size_v,
        group_size=group_size,
        group_pad=group_pad,
        block_q=block_q,
        sm_scale=float(head_size**-0.5 if sm_scale is None else sm_scale),
        sliding_window=sliding_window,
        attention_chunk_size=attention_chunk_size,
        logits_soft_cap=logits_soft_cap,
        use_dot=use_dot,
        sinks=sinks is not None,
    )

    query_start_loc = query_start_loc.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    # A request with q_len queries takes cdiv(q_len, block_q) tiles.
    num_tiles = num_tokens // block_q + min(num_requests, num_tokens)
    tile_req, tile_token, tile_pos, tile_len, tile_begin = _tiles(
        query_start_loc, seq_lens, num_tiles=num_tiles, block_q=block_q
    )

    # q tiles: [NT, H, block_q * group_pad, D], row = query * group_pad + head.
    token = jnp.clip(tile_token[:, None] + jnp.arange(block_q), 0, num_tokens - 1)
    q_tiles = q[token].reshape(num_tiles, block_q, num_kv_heads, group_size, head_size)
    q_tiles = jnp.pad(q_tiles, ((0, 0), (0, 0), (0, 0), (0, group_pad - group_size), (0, 0)))
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, head_size)

    layer = jnp.asarray(layer_idx, jnp.int32).reshape(1)
    row_sinks = None
    if sinks is not None:
        # [H, R, 1]: row query * group_pad + head holds query head kv_head * G + head's
        # sink; padding heads get 0 (their rows see no key and come out 0).
        row_sinks = jnp.pad(
            sinks.astype(jnp.float32).reshape(num_kv_heads, group_size), ((0, 0), (0, group_pad - group_size))
        )
        row_sinks = jnp.broadcast_to(row_sinks[:, None], (num_kv_heads, block_q, group_pad)).reshape(
            num_kv_heads, rows, 1
        )
    outs = _paged_attention_call(
        q_tiles,
        cache,
        (layer, tile_req, tile_pos, tile_len, seq_lens, block_tables),
        row_sinks,
        cfg=cfg,
        layout=layout,
        backend=backend,
        interpret=interpret,
        count_blocks=return_blocks_read,
    )

    # Back to tokens: token t of request r is row (t - start) % block_q of tile
    # tile_begin[r] + (t - start) // block_q.
    o_tiles = outs[0].reshape(num_tiles, num_kv_heads, block_q, group_pad, head_size_v)
    o_tiles = o_tiles[:, :, :, :group_size].transpose(0, 2, 1, 3, 4)
    o_tiles = o_tiles.reshape(num_tiles * block_q, num_q_heads, head_size_v)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.searchsorted(query_start_loc[1:], t, side="right")
    real = t < query_start_loc[num_requests]
    req = jnp.minimum(req, num_requests - 1)
    local = t - query_start_loc[req]
    flat_row = (tile_begin[req] + local // block_q) * block_q + local % block_q
    out = jnp.where(real[:, None, None], o_tiles[jnp.where(real, flat_row, 0)], 0)
    if not return_blocks_read:
        return out
    # Padding tiles loop over nothing, so summing every tile adds only real reads.
    blocks_read = jax.ops.segment_sum(outs[1][:, :, 0], tile_req, num_segments=num_requests)
    return out, blocks_read
