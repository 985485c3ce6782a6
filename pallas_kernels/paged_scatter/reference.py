"""A deliberately naive plain-JAX paged scatter, to test the kernel against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _common


def paged_scatter_reference(
    cache: jax.Array,  # [B, L, H, N, C] in `layout` order
    new_rows: jax.Array,  # [T, H, C]
    slot_mapping: jax.Array,  # [T] int32, -1 for padding
    layer_idx: int | jax.Array = 0,
    *,
    layout: str = _common.DEFAULT_LAYOUT,
) -> jax.Array:
    """Same contract as `paged_scatter`, without aliasing."""
    canonical = _common.to_blhnc(cache, layout)  # [B, L, H, N, C]
    num_blocks, num_layers, _, block_size, _ = canonical.shape
    slot_mapping = jnp.asarray(slot_mapping, jnp.int32)
    # Padding goes to block id B and a layer outside [0, L) to layer L: out of range
    # and dropped; a negative index would wrap around instead.
    block_ids = jnp.where(slot_mapping >= 0, slot_mapping // block_size, num_blocks)
    layer_idx = jnp.where((layer_idx >= 0) & (layer_idx < num_layers), layer_idx, num_layers)
    offsets = jnp.where(slot_mapping >= 0, slot_mapping % block_size, 0)
    # Advanced indices on axes 0 and 3 with slices between them: the indexed
    # result is [T, H, C], exactly new_rows.
    canonical = canonical.at[block_ids, layer_idx, :, offsets, :].set(new_rows, mode="drop")
    return _common.from_blhnc(canonical, layout)
