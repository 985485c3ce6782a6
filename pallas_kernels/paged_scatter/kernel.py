"""Paged scatter: writes new tokens' rows at their slots of a paged cache, in place.

Dimension legend:
  T  new tokens in this step (prefill chunks and decodes together, padding included)
  B  blocks, L layers, H KV heads, N block size, C row channels (see `_common`)

A token's slot is `block_id * N + position_in_block`; slot -1 marks padding and
writes nothing. Slots must be unique within one call (two writes to one slot
race on a device).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _common
from pallas_kernels._common import cache_index


def _geometry(dims: dict[str, int], layout: str) -> dict:
    """The static cache geometry every body takes."""
    return dict(layout=layout, block_size=dims["N"], num_slots=dims["B"] * dims["N"], num_layers=dims["L"])


def _in_range(slot, layer, num_slots: int, num_layers: int):
    """Whether a token's write lands in the cache: slot −1 (padding), a slot past the
    pool or a layer outside the buffer write nothing, as in the reference."""
    return (slot >= 0) & (slot < num_slots) & (layer >= 0) & (layer < num_layers)


def _triton_kernel(
    # Inputs (whole arrays)
    layer_ref,  # [1] int32
    slot_ref,  # [T] int32
    rows_ref,  # [T, H, C]
    cache_in_ref,  # the cache, aliased with cache_ref
    # Outputs
    cache_ref,  # [B, L, H, N, C] in `layout` order
    *,
    layout: str,
    block_size: int,
    num_slots: int,
    num_layers: int,
    num_heads: int,
    pieces: tuple[tuple[int, int], ...],
):
    """One program per token: stores its H rows, each in power-of-2 pieces."""
    del cache_in_ref  # Same buffer as cache_ref.
    t = pl.program_id(0)
    slot = slot_ref[t]
    layer = layer_ref[0]

    @pl.when(_in_range(slot, layer, num_slots, num_layers))
    def _write():
        block_id = slot // block_size
        offset = slot % block_size
        for h in range(num_heads):
            for start, size in pieces:
                channels = pl.ds(start, size)
                cache_ref[cache_index(layout, b=block_id, layer=layer, h=h, n=offset, c=channels)] = rows_ref[
                    t, h, channels
                ]


def _mosaic_kernel(
    # Prefetch
    layer_ref,  # [1] int32, SMEM
    slot_ref,  # [T] int32, SMEM
    # Inputs
    rows_hbm_ref,  # [T, H, C], HBM
    cache_in_ref,  # the cache, aliased with cache_hbm_ref
    # Outputs
    cache_hbm_ref,  # [B, L, H, N, C] in `layout` order, HBM
    # Scratch
    sems,  # DMA semaphore [1]
    *,
    layout: str,
    block_size: int,
    num_slots: int,
    num_layers: int,
    num_tokens: int,
):
    """One program: a DMA per real token from its [H, C] rows to its slot,
    all started before any is awaited."""
    del cache_in_ref  # Same buffer as cache_hbm_ref.
    layer = layer_ref[0]

    def copy(t):
        slot = slot_ref[t]
        dst = cache_hbm_ref.at[
            cache_index(
                layout,
                b=slot // block_size,
                layer=layer,
                h=slice(None),
                n=slot % block_size,
                c=slice(None),
            )
        ]
        return pltpu.make_async_copy(rows_hbm_ref.at[t], dst, sems.at[0])

    def start(t, carry):
        @pl.when(_in_range(slot_ref[t], layer, num_slots, num_layers))
        def _():
            copy(t).start()

        return carry

    def wait(t, carry):
        @pl.when(_in_range(slot_ref[t], layer, num_slots, num_layers))
        def _():
            copy(t).wait()

        return carry

    lax.fori_loop(0, num_tokens, start, 0)
    lax.fori_loop(0, num_tokens, wait, 0)


# Mosaic GPU: tokens per program (a power of 2, at least 4 so that a tile's int32 metadata row is a whole number
# of 16-byte units), at most _MGPU_MAX_TILE (a TMA box holds at most 256 elements per dimension: the metadata row
# has 4 more), the tile's rows within _MGPU_SMEM_BYTES of shared memory.
_MGPU_MIN_TILE, _MGPU_MAX_TILE = 4, 128
_MGPU_SMEM_BYTES = 160 * 1024
_MGPU_META = 4  # leading int32 words of a tile's metadata row: the layer, then padding


def _mosaic_gpu_body(
    # Inputs
    meta_ref,  # [NT, 4 + tile] int32, GMEM: per tile, the layer then its tokens' slots (-1: padding)
    rows_ref,  # [NT * tile, H, C], GMEM
    # In place
    cache_ref,  # [B, L, H, N, C] in `layout` order, GMEM, a mutable ref
    # Scratch
    meta_smem,  # [4 + tile] int32
    rows_smem,  # per channel piece p: [tile, H, size_p]
    barriers,  # one per copy into shared memory
    *,
    layout: str,
    block_size: int,
    num_slots: int,
    num_layers: int,
    tile: int,
    pieces: tuple[tuple[int, int], ...],
):
    """One program per tile of tokens: TMA-loads the tile's metadata and rows into shared memory, then issues one
    TMA store per real token and channel piece, from its rows to its slot, and waits for them all."""
    i = lax.axis_index("tile")
    plmgpu.copy_gmem_to_smem(meta_ref.at[i], meta_smem, barriers.at[0])
    for p, (start, size) in enumerate(pieces):
        src = rows_ref.at[pl.ds(i * tile, tile), :, pl.ds(start, size)]
        plmgpu.copy_gmem_to_smem(src, rows_smem[p], barriers.at[1 + p])
    for k in range(1 + len(pieces)):
        plmgpu.barrier_wait(barriers.at[k])
    layer = meta_smem[0]

    def store(t, carry):
        slot = meta_smem[_MGPU_META + t]

        @pl.when(_in_range(slot, layer, num_slots, num_layers))
        def _():
            for p, (start, size) in enumerate(pieces):
                dst = cache_index(
                    layout, b=slot // block_size, layer=layer, h=slice(None), n=slot % block_size, c=pl.ds(start, size)
                )
                plmgpu.copy_smem_to_gmem(rows_smem[p].at[t], cache_ref.at[dst])

        return carry

    lax.fori_loop(0, tile, store, 0)
    plmgpu.wait_smem_to_gmem(0)


def _mosaic_gpu_tile(num_tokens: int, token_bytes: int) -> int:
    """Tokens per Mosaic GPU program (see `_MGPU_MAX_TILE`)."""
    tile = _MGPU_MIN_TILE
    while tile < min(_MGPU_MAX_TILE, num_tokens) and 2 * tile * token_bytes <= _MGPU_SMEM_BYTES:
        tile *= 2
    if tile * token_bytes > _MGPU_SMEM_BYTES:
        raise ValueError(
            f"backend='mosaic_gpu': one token's rows take {token_bytes} bytes, more than {_MGPU_SMEM_BYTES // 4} "
            "(4 tokens per program in shared memory); shard the heads (shard_map) or use backend='triton'"
        )
    return tile


def _mosaic_gpu_call(cache, new_rows, slot_mapping, layer, *, layout, interpret):
    """Pads the tokens to whole tiles, packs each tile's metadata, and runs the Mosaic GPU body on the cache
    as a mutable ref (written in place)."""
    dims = _common.cache_dims(cache.shape, layout)
    num_tokens, num_heads, row_width = new_rows.shape
    itemsize = jnp.dtype(cache.dtype).itemsize
    if row_width * itemsize % 16:
        raise ValueError(
            f"backend='mosaic_gpu' copies rows with the TMA, whose strides must be multiples of 16 bytes: a row of "
            f"C={row_width} {cache.dtype} channels is {row_width * itemsize} bytes; pad C or use backend='triton'"
        )
    tile = _mosaic_gpu_tile(num_tokens, num_heads * row_width * itemsize)
    num_tiles = -(-num_tokens // tile)
    padding = num_tiles * tile - num_tokens
    slots = jnp.pad(slot_mapping, (0, padding), constant_values=-1).reshape(num_tiles, tile)
    head = jnp.zeros((num_tiles, _MGPU_META), jnp.int32).at[:, 0].set(layer[0])
    meta = jnp.concatenate([head, slots], axis=1)
    rows = jnp.pad(new_rows, ((0, padding), (0, 0), (0, 0)))
    pieces = tuple((start, min(256, row_width - start)) for start in range(0, row_width, 256))
    body = functools.partial(
        _mosaic_gpu_body,
        **_geometry(dims, layout),
        tile=tile,
        pieces=pieces,
    )
    cache_ref = jax.new_ref(cache)
    plmgpu.kernel(
        body,
        out_type=(),
        grid=(num_tiles,),
        grid_names=("tile",),
        scratch_types=[
            plmgpu.SMEM((_MGPU_META + tile,), jnp.int32),
            [plmgpu.SMEM((tile, num_heads, size), cache.dtype) for _, size in pieces],
            plmgpu.Barrier(num_arrivals=1, num_barriers=1 + len(pieces)),
        ],
        interpret=_common.interpret_arg("mosaic_gpu", interpret),
    )(meta, rows, cache_ref)
    return cache_ref[...]


def _paged_scatter_call(cache, new_rows, slot_mapping, layer, *, layout, backend, interpret):
    """Builds the grid and specs for one backend and calls the kernel."""
    if backend == "mosaic_gpu":
        return _mosaic_gpu_call(cache, new_rows, slot_mapping, layer, layout=layout, interpret=interpret)
    dims = _common.cache_dims(cache.shape, layout)
    num_tokens, num_heads, row_width = new_rows.shape
    interpret_param = _common.interpret_arg(backend, interpret)
    if backend == "triton":
        kernel = functools.partial(
            _triton_kernel,
            **_geometry(dims, layout),
            num_heads=num_heads,
            pieces=_common.power_of_2_pieces(row_width),
        )
        return pl.pallas_call(
            kernel,
            grid=(num_tokens,),  # One program per new token.
            in_specs=[
                pl.BlockSpec(),  # layer: whole array
                pl.BlockSpec(),  # slot_mapping: whole array
                pl.BlockSpec(),  # new_rows: whole array, indexed by token
                pl.BlockSpec(),  # cache (aliased input)
            ],
            out_specs=pl.BlockSpec(),  # cache: whole array, written at slots only
            out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
            input_output_aliases={3: 0},
            compiler_params=_common.triton_params(num_warps=1, num_stages=1),
            interpret=interpret_param,
            name="paged_scatter",
        )(layer, slot_mapping, new_rows, cache)

    kernel = functools.partial(
        _mosaic_kernel,
        **_geometry(dims, layout),
        num_tokens=num_tokens,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,  # layer, slot_mapping
            grid=(1,),  # One program issues every token's DMA.
            in_specs=[
                pl.BlockSpec(memory_space=pl.ANY),  # new_rows stay in HBM
                pl.BlockSpec(memory_space=pl.ANY),  # cache (aliased input)
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),  # cache, written by DMA
            scratch_shapes=[pltpu.SemaphoreType.DMA((1,))],
        ),
        out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
        input_output_aliases={3: 0},  # Operand 3 counts the two prefetch scalars.
        compiler_params=_common.mosaic_params(("arbitrary",)),
        interpret=interpret_param,
        name="paged_scatter",
    )(layer, slot_mapping, new_rows, cache)


@functools.partial(
    jax.jit,
    static_argnames=("layout", "backend", "interpret"),
    donate_argnames=("cache",),
)
def paged_scatter(
    cache: jax.Array,  # [B, L, H, N, C] in `layout` order
    new_rows: jax.Array,  # [T, H, C]
    slot_mapping: jax.Array,  # [T] int32, -1 for padding
    layer_idx: int | jax.Array = 0,  # scalar in [0, L)
    *,
    layout: str = _common.DEFAULT_LAYOUT,
    backend: str | None = None,
    interpret: bool | None = None,
) -> jax.Array:  # [B, L, H, N, C], the same buffer as `cache`
    """Writes each new token's rows at its slot of layer `layer_idx`, in place.

    Dimensions: T new tokens; B blocks; L layers sharing the buffer; H KV heads
    (the per-shard slice under `shard_map`); N block size; C row channels (for
    attention K and V concatenated: `K = row[:head_size]`, `V = row[head_size:]`;
    for MLA the latent; any dtype, uint8 included).

    Token t goes to block `slot_mapping[t] // N`, position `slot_mapping[t] % N`;
    slot -1 writes nothing, and neither does a slot past the pool (`>= B * N`) or a
    layer outside the buffer: out-of-range writes are dropped, as in the reference,
    never clamped onto another block. Slots must be unique within a call. Prefill chunks and
    decode tokens mix freely.

    `cache` is donated and aliased to the output (`input_output_aliases`), so no
    copy is made when this is the outermost jit; a caller that wraps it in its
    own jit must donate the cache there for the same effect. Do not use `cache`
    after the call.

    Args:
      cache: the shared buffer; `layout` names its axis order ("BLHNC" block-outer,
        the default; also "BLNHC", "LBHNC", "LBNHC").
      new_rows: the rows to write, dtype equal to the cache's.
      slot_mapping: per token, its slot or -1.
      layer_idx: which layer of the buffer to write; a Python int or a traced
        scalar (e.g. inside a scan over layers), traced either way so that layers
        share one compilation. Outside [0, L) nothing is written.
      backend: "triton" (GPU; also the kernel interpreted on CPU), "mosaic"
        (TPU) or "mosaic_gpu" (Hopper and newer GPUs, jax >= 0.11; rows of a
        multiple of 16 bytes; interpreted on CPU with its race detector on);
        None picks "mosaic" on TPU and "triton" elsewhere.
      interpret: run the kernel in the Pallas interpreter; None means yes unless a
        GPU or TPU is the default backend.

    Multi-device: under `shard_map` with the cache and `new_rows` split over H
    (and `slot_mapping` replicated), each shard writes its own head slice.
    """
    backend, interpret = _common.resolve_backend(backend, interpret)
    dims = _common.cache_dims(cache.shape, layout)
    if new_rows.ndim != 3:
        raise ValueError(f"new_rows must be [T, H, C], got shape {new_rows.shape}.")
    num_tokens, num_heads, row_width = new_rows.shape
    if (num_heads, row_width) != (dims["H"], dims["C"]):
        raise ValueError(
            f"new_rows [T, H, C]={new_rows.shape} must match the cache's "
            f"H={dims['H']} and C={dims['C']} (cache {cache.shape}, {layout=})."
        )
    if new_rows.dtype != cache.dtype:
        raise ValueError(f"{new_rows.dtype=} must equal {cache.dtype=}; cast the rows with .astype first.")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"{slot_mapping.shape=} must be ({num_tokens},), one slot per token.")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"{slot_mapping.dtype=} must be an integer dtype (int32).")
    if num_tokens == 0:
        return cache
    layer = jnp.asarray(layer_idx, jnp.int32).reshape(1)
    return _paged_scatter_call(
        cache,
        new_rows,
        slot_mapping.astype(jnp.int32),
        layer,
        layout=layout,
        backend=backend,
        interpret=interpret,
    )
