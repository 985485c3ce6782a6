"""What a model step needs from the cache, as one pytree, and one call that writes and attends with it.

Dimensions: G groups, R request rows, M max blocks per request, T tokens of the step, QH query heads,
H KV heads, D head size (Dv of V).

After an allocation, `step_metadata` (pure, usable inside jit and `lax` loops) or
`KVCacheManager.step_metadata` (host) gives a `StepMetadata`: per group the block tables and the
slot mapping of the step's tokens, and the rows' `seq_lens`, `query_start_loc` and token positions.
The rows' tokens are packed in row order, as `paged_attention` takes them:

    rows r0 (3 new tokens), r1 (1), r2 (0), padding
    query_start_loc  0 3 4 4 4      tokens  r0 r0 r0 r1 . . .   (T entries, padding last)

The plan rides along (static), so a layer finds its group, its layer slot and its window by name:
`out, cache = attend(q, k, v, cache, meta, layer="layers.3.attn")` writes the layer's K/V at its
group's slots (`paged_scatter`) and attends through its group's block table (`paged_attention`),
with the window or chunk of its spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxkv.core.state import ManagerState, _block_tables, _slot_mappings
from jaxkv.memory.layout import find_layer
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import MambaSpec, MLAAttentionSpec


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """One step's paging inputs for the model (see the module docstring); a pytree, `cfg` static.

    slot_mapping:    int32[G, T] each token's slot per group; −1: padding token, or a state group
    block_tables:    int32[G, R, M] (padding rows: NULL_BLOCK)
    seq_lens:        int32[R] tokens of each row after this step (padding rows: 0)
    query_start_loc: int32[R + 1] row r's tokens are query_start_loc[r] : query_start_loc[r + 1]
    positions:       int32[T] each token's position in its request (padding tokens: 0)
    cfg:             the plan (static)
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    positions: jax.Array
    cfg: KVCacheConfig

    def layer(self, name: str) -> tuple[int, int]:
        """(group index, layer slot in the cache) of layer `name`; a KV-sharing layer gives its owner's."""
        tensor_idx, layer_idx = find_layer(self.cfg, name)
        return self.cfg.tensors[tensor_idx].group_idx, layer_idx


jax.tree_util.register_dataclass(
    StepMetadata,
    data_fields=["slot_mapping", "block_tables", "seq_lens", "query_start_loc", "positions"],
    meta_fields=["cfg"],
)


def step_metadata(
    state: ManagerState,
    req_slots,
    num_new_tokens,
    num_lookahead_tokens=None,
    *,
    cfg: KVCacheConfig,
    num_tokens: int,
) -> StepMetadata:
    """The metadata of the step that just allocated `num_new_tokens` int32[R] tokens for the rows
    `req_slots` int32[R] (S marks padding), packed into T = `num_tokens` entries. Pure; call it
    after the allocation, with the same rows (inside jit, `cfg` and `num_tokens` static).
    `num_lookahead_tokens` int32[R] or None: lookahead slots the allocation reserved after the
    scheduled tokens (not part of this step: `seq_lens` ends before them). The state's arrays may be numpy
    (`KVCacheManager.hand_over`'s rows)."""
    state = jax.tree_util.tree_map(jnp.asarray, state)
    num_slots = state.num_computed.shape[0]
    row = (req_slots >= 0) & (req_slots < num_slots)
    k = jnp.where(row, num_new_tokens, 0).astype(jnp.int32)
    lookahead = 0 if num_lookahead_tokens is None else num_lookahead_tokens
    seq_lens = jnp.where(row, state.num_computed[jnp.where(row, req_slots, 0)] - lookahead, 0)
    query_start_loc = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(k, dtype=jnp.int32)])
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    token_row = jnp.minimum(jnp.searchsorted(query_start_loc[1:], token, side="right"), k.shape[0] - 1)
    real = token < query_start_loc[-1]
    positions = jnp.where(real, seq_lens[token_row] - query_start_loc[token_row + 1] + token, 0)
    return StepMetadata(
        slot_mapping=_slot_mappings(state, req_slots, k, num_lookahead_tokens, cfg=cfg, num_tokens=num_tokens),
        block_tables=_block_tables(state, req_slots),
        seq_lens=seq_lens,
        query_start_loc=query_start_loc,
        positions=positions,
        cfg=cfg,
    )


def attend(
    q,
    k,
    v,
    cache,
    meta: StepMetadata,
    *,
    layer: str,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    kernels: tuple[Callable, Callable] | None = None,
):
    """Writes layer `layer`'s K/V of this step into the cache and attends over it.

    q: [T, QH, D]; k: [T, H, D]; v: [T, H, Dv]; cache: the plan's buffer (`allocate_cache`). The
    layer's group gives the slot mapping and block table, its spec the window (sliding) or chunk
    (chunked local). `sm_scale` (default D ** −0.5) and `logits_soft_cap` are the model's, and so is
    `sinks`, float32[QH]: gpt-oss's attention sinks, one logit per query head that joins every softmax
    denominator (see `paged_attention`); None: no sinks.
    `kernels`: (scatter, attention) with the signatures of `paged_scatter` and `paged_attention`
    (both get `layout=`), for example their `shard_map` over KV heads; default those kernels. Returns (out [T, QH, Dv],
    cache); the cache is donated to the scatter (do not use the one passed in).
    """
    group_idx, layer_idx = meta.layer(layer)
    spec = meta.cfg.groups[group_idx].spec
    if isinstance(spec, (MambaSpec, MLAAttentionSpec)):
        raise ValueError(
            f"layer {layer!r} has a {type(spec).__name__}: attend writes and reads K|V rows of "
            "attention layers; give state and MLA layers their own kernels"
        )
    if kernels is None:
        from pallas_kernels.paged_attention import paged_attention
        from pallas_kernels.paged_scatter import paged_scatter

        kernels = paged_scatter, paged_attention
    scatter, attention = kernels
    rows = jnp.concatenate([k, v], axis=-1).astype(cache.dtype)  # [T, H, D + Dv]
    cache = scatter(cache, rows, meta.slot_mapping[group_idx], layer_idx, layout=meta.cfg.layout)
    # A FullAttentionSpec of a plan made with hybrid=False still carries the layer's window or chunk.
    out = attention(
        q.astype(cache.dtype),
        cache,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables[group_idx],
        layer_idx,
        sliding_window=getattr(spec, "sliding_window", None),
        attention_chunk_size=getattr(spec, "attention_chunk_size", None),
        sm_scale=sm_scale,
        logits_soft_cap=logits_soft_cap,
        sinks=sinks,
        layout=meta.cfg.layout,
    )
    return out, cache
