"""The prefix-cache lookup of the jitted engine: each request's longest hit valid for every group, as a pure
function of the index (`jaxkv.prefix.state` holds the rest of the prefix state's transitions).

Dimensions: R requests, X unit keys per request, G groups, W candidate blocks per group.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core.ranges import in_chunks, range_chunk, range_layout
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.index import IndexState, probe
from jaxkv.prefix.rules import valid_hit_blocks_of_groups
from jaxkv.prefix.state import PrefixCacheConfig, PrefixStats, hit_rules, partial_groups


def lookup(
    index: IndexState,
    keys,
    num_keys,
    num_tokens,
    *,
    cfg: KVCacheConfig,
    prefix: PrefixCacheConfig,
    chunk_sizes,
    drop_last_block: bool = False,
) -> tuple[jax.Array, PrefixStats]:
    """The longest prefix-cache hit of each request, valid for every group; changes nothing.

    keys:       uint32[R, X, 4] the requests' unit keys (from the host)
    num_keys:   int32[R] keys given per request (0: padding row)
    num_tokens: int32[R] the requests' tokens (the hit stays below the last one)
    Returns (hit_len int32[R], shared_len int32[R], stats); shared_len is the longest hit of
    the full-attention groups alone (≥ hit_len; hit_len without such groups): where the
    request's prefix is known to be shared. Every group's candidate blocks up to the bound
    (at most X units) are probed, in chunks; then each group's valid hit lengths
    (`jaxkv.prefix.rules.valid_hit_blocks_of_groups`) are intersected on a grid of gcd(block sizes)
    tokens, as `jaxkv.prefix.rules.prefix_hit_len` does. With partial groups (`partial_groups`)
    every unit is probed and the grid is the unit: a length h inside a block is valid for a
    full-attention group when its full blocks before h are cached and (key(h), g) is
    indexed (a partial entry), for a state group when (key(h), g) is; other groups need h
    on their block boundaries.

    `drop_last_block` (static; an EAGLE-style drafter, vLLM's `use_eagle`): every group drops the
    last block of the hit, whose last position's drafter input the cache does not hold: the hit is
    the longest length valid for every group at least the largest block size below the usual one
    (with one group: one block less, as vLLM).
    """
    rules = hit_rules(cfg)
    partial = partial_groups(cfg, prefix)
    keys, num_keys, num_tokens = jnp.asarray(keys), jnp.asarray(num_keys), jnp.asarray(num_tokens)
    num_rows, num_keys_max = keys.shape[:2]
    num_groups = len(rules)
    block_sizes = np.asarray([r.block_size for r in rules], np.int32)
    units_per_block = (block_sizes // prefix.unit).astype(np.int32)
    widths = (num_keys_max // units_per_block).tolist()  # candidate blocks per group
    max_width = max(widths)
    valid_tokens = jnp.where(num_keys > 0, num_tokens, 0)
    bound = jnp.minimum(jnp.maximum(valid_tokens - 1, 0), num_keys * prefix.unit)  # [R]
    # Block-end units up to the bound, one probe each for all groups (grid step s = gcd(units per block));
    # every unit with partial groups.
    unit_step = 1 if partial else math.gcd(*units_per_block.tolist())
    num_k = bound // (unit_step * prefix.unit)  # [R]
    layout = range_layout(num_k, max_entries=num_rows * num_keys_max)

    def probe_body(size):
        def probe_chunk(chunk_idx, carry):
            cached, at_unit = carry
            in_range, row, k = range_chunk(layout, chunk_idx, size)
            unit = (k + 1) * unit_step - 1
            unit_keys = keys.at[row, jnp.clip(unit, 0, num_keys_max - 1)].get(mode="fill", fill_value=0)
            found = probe(index, unit_keys, in_range) != NULL_BLOCK  # [K, G]
            ends = (unit[:, None] + 1) % units_per_block[None, :] == 0
            block_idx = (unit[:, None] + 1) // units_per_block[None, :] - 1
            flat = (row[:, None] * num_groups + np.arange(num_groups)[None, :]) * max_width + block_idx
            flat = jnp.where(found & ends, flat, cached.size)
            cached = cached.reshape(-1).at[flat].set(True, mode="drop").reshape(cached.shape)
            if partial:
                flat = (row[:, None] * num_groups + np.arange(num_groups)[None, :]) * num_keys_max + unit[:, None]
                at_unit = (
                    at_unit.reshape(-1)
                    .at[jnp.where(found, flat, at_unit.size)]
                    .set(True, mode="drop")
                    .reshape(at_unit.shape)
                )
            return cached, at_unit

        return probe_chunk

    at_unit = jnp.zeros((num_rows, num_groups, num_keys_max if partial else 0), bool)
    cached, at_unit = in_chunks(
        layout[-1], chunk_sizes, probe_body, (jnp.zeros((num_rows, num_groups, max_width), bool), at_unit)
    )
    step = prefix.unit if partial else math.gcd(*block_sizes.tolist())
    hit_lens = np.arange(0, num_keys_max * prefix.unit + 1, step, dtype=np.int32)  # the grid
    below = hit_lens[None, :] <= bound[:, None]  # [R, grid]
    # Every group at once on [R, G, grid]: a group's candidates beyond its width count as its last.
    valid = valid_hit_blocks_of_groups(rules, cached)  # [R, G, W + 1]
    grid_blocks = np.minimum(hit_lens[None, :] // block_sizes[:, None], np.asarray(widths)[:, None])  # [G, grid]
    on_block = hit_lens[None, :] % block_sizes[:, None] == 0
    group_ok = jnp.take_along_axis(valid, grid_blocks[None], axis=2) & on_block[None]
    for g in partial:
        # key(h) indexed for group g: at_unit[unit h / u − 1] (h = 0: nothing needed).
        keyed = jnp.concatenate([jnp.ones((num_rows, 1), bool), at_unit[:, g, hit_lens[1:] // prefix.unit - 1]], axis=1)
        if rules[g].kind == "full":
            keyed = valid[:, g, grid_blocks[g]] & (on_block[g] | keyed)
        group_ok = group_ok.at[:, g].set(keyed)
    valid_len = jnp.all(group_ok, axis=1) & below
    hit_len = jnp.max(jnp.where(valid_len, hit_lens, 0), axis=1)
    if drop_last_block:
        dropped = hit_lens[None, :] <= hit_len[:, None] - int(block_sizes.max())
        hit_len = jnp.max(jnp.where(valid_len & dropped, hit_lens, 0), axis=1)
    full = [g for g, r in enumerate(rules) if r.kind == "full"]
    full_len = jnp.max(jnp.where(group_ok[:, full] & below[:, None], hit_lens, 0), axis=(1, 2)) if full else hit_len
    stats = PrefixStats(
        num_lookups=jnp.sum(num_keys > 0, dtype=jnp.int32),
        num_lookup_tokens=jnp.sum(valid_tokens, dtype=jnp.int32),
        num_hit_tokens=jnp.sum(hit_len, dtype=jnp.int32),
        num_reconciliation_miss_tokens=jnp.sum(full_len - hit_len, dtype=jnp.int32),
    )
    return hit_len, full_len, stats
