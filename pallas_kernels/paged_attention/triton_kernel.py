"""Paged attention body for GPUs (Pallas Triton), also the one interpreted on CPU.

Blocks are fetched by indexing the whole cache ref at the block id the table
gives: Triton turns that into pointer arithmetic, so only the live blocks'
bytes are ever loaded.

Dimension legend: NT query tiles; R tile rows (block_q x group_pad); D, Dv head
sizes; N block size; M table width; Rq requests.
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import cache_index
from pallas_kernels.paged_attention import softmax
from pallas_kernels.paged_attention.softmax import AttentionConfig


def triton_kernel(
    # Inputs: scalars (whole arrays)
    layer_ref,  # [1] int32
    tile_req_ref,  # [NT] int32, the request of each tile
    tile_pos_ref,  # [NT] int32, position of each tile's first query
    tile_len_ref,  # [NT] int32, real queries in each tile (0 for padding tiles)
    seq_lens_ref,  # [Rq] int32
    block_tables_ref,  # [Rq, M] int32
    # Inputs: blocks
    q_ref,  # [R, D], this tile's queries for this KV head
    cache_ref,  # [B, L, H, N, D + Dv] in `layout` order, whole array
    *refs,  # if cfg.sinks: sinks_ref [R, 1] float32, each row's sink logit; then the outputs
    # Outputs: o_ref [R, Dv]; if counting, blocks_read_ref [1] int32, blocks this program loaded
    cfg: AttentionConfig,
    layout: str,
):
    sinks_ref, (o_ref, *blocks_read_refs) = (refs[0], refs[1:]) if cfg.sinks else (None, refs)
    tile, kv_head = pl.program_id(0), pl.program_id(1)
    req = tile_req_ref[tile]
    first_query_pos = tile_pos_ref[tile]
    num_queries = tile_len_ref[tile]
    seq_len = seq_lens_ref[req]
    layer = layer_ref[0]
    n = cfg.block_size

    # Blocks behind the window are never read (see softmax.block_range).
    live_begin, first_block, end_block = softmax.block_range(
        first_query_pos, num_queries, cfg, block_tables_ref.shape[1]
    )

    q = q_ref[...]
    query_pos, row_real = softmax.row_positions(first_query_pos, num_queries, cfg)

    def body(j, carry):
        state, blocks_read = carry
        block_id = softmax.safe_block_id(block_tables_ref[req, j], cache_ref.shape[layout.index("B")])

        def at(channels):
            return cache_index(layout, b=block_id, layer=layer, h=kv_head, n=slice(None), c=channels)

        k = cache_ref[at(pl.ds(0, cfg.head_size))]  # [N, D]
        v = cache_ref[at(pl.ds(cfg.head_size, cfg.head_size_v))]  # [N, Dv]
        state = softmax.attend_block(
            state,
            q,
            k,
            v,
            block_start_pos=j * n,
            query_pos=query_pos,
            row_real=row_real,
            live_keys_begin=live_begin,
            seq_len=seq_len,
            cfg=cfg,
        )
        return state, blocks_read + 1

    state = softmax.init_state(cfg, None if sinks_ref is None else sinks_ref[...])
    state, blocks_read = lax.fori_loop(first_block, end_block, body, (state, 0))
    o_ref[...] = softmax.finalize(state).astype(o_ref.dtype)
    if blocks_read_refs:
        (blocks_read_ref,) = blocks_read_refs
        blocks_read_ref[0] = blocks_read
