"""Paged attention body for TPUs (Mosaic).

The cache stays in HBM; each live block's [N, D + Dv] slice for the program's
KV head is copied into a VMEM double buffer, the next block's DMA in flight
while the current one is computed on.

Dimension legend: NT query tiles; R tile rows (block_q x group_pad); D, Dv head
sizes; N block size; M table width; Rq requests.
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import cache_index
from pallas_kernels.paged_attention import softmax
from pallas_kernels.paged_attention.softmax import AttentionConfig


def mosaic_kernel(
    # Prefetch (SMEM)
    layer_ref,  # [1] int32
    tile_req_ref,  # [NT] int32, the request of each tile
    tile_pos_ref,  # [NT] int32, position of each tile's first query
    tile_len_ref,  # [NT] int32, real queries in each tile (0 for padding tiles)
    seq_lens_ref,  # [Rq] int32
    block_tables_ref,  # [Rq * M] int32, flattened
    # Inputs
    q_ref,  # [R, D] (VMEM), this tile's queries for this KV head
    cache_hbm_ref,  # [B, L, H, N, D + Dv] in `layout` order (HBM)
    *refs,  # if cfg.sinks: sinks_ref [R, 1] float32 (VMEM), each row's sink logit; then the rest
    # Outputs: o_ref [R, Dv] (VMEM)
    # Scratch: kv_bufs [2, N, D + Dv] (VMEM), double buffer; sems, DMA semaphores [2]
    cfg: AttentionConfig,
    layout: str,
    max_blocks: int,
):
    sinks_ref, (o_ref, kv_bufs, sems) = (refs[0], refs[1:]) if cfg.sinks else (None, refs)
    tile, kv_head = pl.program_id(0), pl.program_id(1)
    req = tile_req_ref[tile]
    first_query_pos = tile_pos_ref[tile]
    num_queries = tile_len_ref[tile]
    seq_len = seq_lens_ref[req]
    layer = layer_ref[0]
    n = cfg.block_size

    # Blocks behind the window are never read (see softmax.block_range).
    live_begin, first_block, end_block = softmax.block_range(first_query_pos, num_queries, cfg, max_blocks)

    def fetch(j, buf):
        block_id = softmax.safe_block_id(block_tables_ref[req * max_blocks + j], cache_hbm_ref.shape[layout.index("B")])
        src = cache_hbm_ref.at[cache_index(layout, b=block_id, layer=layer, h=kv_head, n=slice(None), c=slice(None))]
        return pltpu.make_async_copy(src, kv_bufs.at[buf], sems.at[buf])

    @pl.when(first_block < end_block)
    def _prime():
        fetch(first_block, 0).start()

    q = q_ref[...]
    query_pos, row_real = softmax.row_positions(first_query_pos, num_queries, cfg)

    def body(j, state):
        buf = lax.rem(j - first_block, 2)

        @pl.when(j + 1 < end_block)
        def _prefetch_next():
            fetch(j + 1, 1 - buf).start()

        fetch(j, buf).wait()
        kv = kv_bufs[buf]  # [N, D + Dv]
        return softmax.attend_block(
            state,
            q,
            kv[:, : cfg.head_size],
            kv[:, cfg.head_size :],
            block_start_pos=j * n,
            query_pos=query_pos,
            row_real=row_real,
            live_keys_begin=live_begin,
            seq_len=seq_len,
            cfg=cfg,
        )

    state = softmax.init_state(cfg, None if sinks_ref is None else sinks_ref[...])
    state = lax.fori_loop(first_block, end_block, body, state)
    o_ref[...] = softmax.finalize(state).astype(o_ref.dtype)
