"""Prefix-cache hit rules: how long a hit each KV cache group can resume from.

A group's lookup gives a boolean `cached` per candidate block (block `i` holds
tokens `[i·b, (i + 1)·b)` of the request, `b` the group's `block_size`: its
block size, or a finer prefix-match unit where its blocks are hashed finer). A
hit of `L` blocks lets the request resume computing at position `p = L·b`; it
is valid when the blocks that the token at `p` still needs are all cached:

    full attention     every block before p                 blocks [0, L)
    sliding window W   keys at positions > p − W            the last cdiv(W − 1, b) blocks before p
    chunked local C    keys of p's own chunk                blocks [⌊p / C⌋·C / b, L)
    mamba (state)      the state saved at p                 block L − 1

    sliding window W = 4, b = 2: a hit of L = 5 blocks (p = 10) needs the keys at 7, 8, 9
    position  0 1 | 2 3 | 4 5 | 6 7 | 8 9 | 10
    block       0     1     2     3     4   ^ p
    needed                         [ 3 ][ 4 ]   = cdiv(4 − 1, 2) = 2 blocks

Each rule asks for a run of cached blocks ending at block L − 1, of a length
`need(L)` (L, min(L, cdiv(W − 1, b)), L − chunk start, min(L, 1)); a run that
reaches block 0 is always enough. L = 0 is always valid. For the sliding
window this is vLLM's right-to-left search: the first position (from the right)
preceded by cdiv(W − 1, b) contiguous hits, else the run from block 0.

A hybrid hit must be valid for every group at once, in tokens (a length valid
for a group is a multiple of its `b`). vLLM finds it as a fixed point: start at
the bound, let each group shrink it to its own longest valid hit at or below it,
repeat until no group shrinks it. Since each group's "longest valid hit ≤ x" is
monotone in x and at most x, the fixed point is exactly the largest length
valid for every group: `hybrid_hit_len_reference` iterates, `prefix_hit_len`
(jittable, batched) intersects the groups' valid lengths directly.

The last token of a request is never covered (it is always recomputed to get
its logits): the bound is `num_tokens − 1`, rounded down to what the rules allow.

Dimensions: `R` requests, `N` candidate blocks of a group, `G` groups.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core.pool import count_prefix
from jaxkv.planner.specs import ChunkedLocalAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec, cdiv

HitKind = Literal["full", "sliding_window", "chunked_local", "mamba"]
_KINDS = ("full", "sliding_window", "chunked_local", "mamba")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HitRule:
    """How one KV cache group turns cached blocks into a hit (static under jit).

    `kind` uses `KVCacheGroup.kind`'s names; `block_size` is the tokens per
    entry of the group's `cached` array; `window` is W for "sliding_window" and
    C for "chunked_local" (a multiple of `block_size`), else None.
    """

    kind: HitKind
    block_size: int
    window: int | None = None

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"kind={self.kind!r} must be one of {_KINDS}")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size={self.block_size!r} must be a positive int")
        windowed = self.kind in ("sliding_window", "chunked_local")
        if windowed != (self.window is not None):
            raise ValueError(f"window={self.window!r}: a {self.kind} rule {'needs' if windowed else 'takes no'} window")
        if windowed and (not isinstance(self.window, int) or self.window <= 0):
            raise ValueError(f"window={self.window!r} must be a positive int")
        if self.kind == "chunked_local" and self.window % self.block_size:
            raise ValueError(f"attention chunk {self.window} must be a multiple of block_size={self.block_size}")

    @classmethod
    def for_spec(cls, spec: KVCacheSpec, *, block_size: int | None = None) -> HitRule:
        """The rule of a group with `spec`; `block_size` overrides the spec's (a finer hash unit)."""
        block_size = block_size or spec.block_size
        if isinstance(spec, SlidingWindowSpec):
            return cls(kind="sliding_window", block_size=block_size, window=spec.sliding_window)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return cls(kind="chunked_local", block_size=block_size, window=spec.attention_chunk_size)
        if isinstance(spec, MambaSpec):
            return cls(kind="mamba", block_size=block_size)
        return cls(kind="full", block_size=block_size)

    def need(self, num_blocks: np.ndarray) -> np.ndarray:
        """Length of the run of cached blocks ending at block L − 1 that a hit of L blocks needs."""
        if self.kind == "full":
            return num_blocks
        if self.kind == "sliding_window":
            return np.minimum(num_blocks, cdiv(self.window - 1, self.block_size))
        if self.kind == "chunked_local":
            chunk_blocks = self.window // self.block_size
            return num_blocks - num_blocks // chunk_blocks * chunk_blocks
        return np.minimum(num_blocks, 1)


# Plain-Python reference: one request, one rule at a time, written as vLLM's searches.


def hit_blocks_reference(rule: HitRule, cached: Sequence[bool], max_blocks: int) -> int:
    """The longest valid hit of one group, in blocks, at most `max_blocks`.

    Blocks past the end of `cached` count as not cached.
    """
    max_blocks = min(max_blocks, len(cached))
    if rule.kind == "full":
        num_blocks = 0
        while num_blocks < max_blocks and cached[num_blocks]:
            num_blocks += 1
        return num_blocks
    if rule.kind == "sliding_window":
        # Right to left: the first run of cdiv(W − 1, b) hits ends the search;
        # otherwise the run that reaches block 0 (possibly empty) is the hit.
        num_needed = cdiv(rule.window - 1, rule.block_size)
        if num_needed == 0:  # W = 1: a token attends only to itself
            return max_blocks
        run = 0
        for block_idx in range(max_blocks - 1, -1, -1):
            run = run + 1 if cached[block_idx] else 0
            if run >= num_needed:
                return block_idx + run
        return run
    if rule.kind == "chunked_local":
        # Blocks before the bound's chunk are not needed; then hits from the chunk start.
        chunk_blocks = rule.window // rule.block_size
        num_blocks = max_blocks // chunk_blocks * chunk_blocks
        while num_blocks < max_blocks and cached[num_blocks]:
            num_blocks += 1
        return num_blocks
    for block_idx in range(max_blocks - 1, -1, -1):  # mamba: the latest saved state
        if cached[block_idx]:
            return block_idx + 1
    return 0


def hybrid_hit_len_reference(rules: Sequence[HitRule], cached: Sequence[Sequence[bool]], num_tokens: int) -> int:
    """The hit valid for every group, in tokens, by vLLM's fixed point; never covers the last token."""
    hit_len = max(num_tokens - 1, 0)
    while True:
        new_hit_len = hit_len
        for rule, group_cached in zip(rules, cached, strict=True):
            new_hit_len = hit_blocks_reference(rule, group_cached, new_hit_len // rule.block_size) * rule.block_size
        if new_hit_len == hit_len:
            return hit_len
        hit_len = new_hit_len


# Vectorised: batched over requests, usable inside jit.


def valid_hit_blocks(rule: HitRule, cached: jax.Array) -> jax.Array:
    """bool[R, N + 1]: entry L says a hit of L blocks is valid for this group.

    Args:
      rule: the group's rule (static).
      cached: bool[R, N], whether each candidate block is cached.
    """
    return valid_hit_blocks_of_groups((rule,), cached[:, None, :])[:, 0]


def valid_hit_blocks_of_groups(rules: tuple[HitRule, ...], cached: jax.Array) -> jax.Array:
    """bool[R, G, N + 1]: `valid_hit_blocks` of every group at once (a few ops in all, not per group).

    Args:
      rules: one rule per group (static).
      cached: bool[R, G, N], whether each candidate block of each group is cached.
    """
    num_requests, num_groups, num_blocks = cached.shape
    # misses[..., L]: the blocks among the first L that are not cached (a prefix count: linear, where
    # XLA:CPU's cumulative max, a reduce-window, costs N² per row). A hit of L blocks needs no miss in
    # the last need(L) of them.
    misses = jnp.concatenate([jnp.zeros((num_requests, num_groups, 1), jnp.int32), count_prefix(~cached)], axis=2)
    num_hit_blocks = np.arange(num_blocks + 1, dtype=np.int32)
    run_start = np.stack([num_hit_blocks - rule.need(num_hit_blocks) for rule in rules])  # [G, N + 1]
    return misses == jnp.take_along_axis(misses, run_start[None], axis=2)


@functools.partial(jax.jit, static_argnames=("rules",))
def group_hit_lens(rules: tuple[HitRule, ...], cached: tuple[jax.Array, ...], num_tokens: jax.Array) -> jax.Array:
    """int32[R, G]: each group's own longest valid hit in tokens, ignoring the others. Jitted, `rules` static.

    Args:
      rules: one rule per group (static).
      cached: per group, bool[R, N_g].
      num_tokens: int32[R], the requests' token counts (the hit stays below the last).
    """
    max_hit_len = jnp.maximum(num_tokens - 1, 0)[:, None]
    lens = []
    for rule, group_cached in zip(rules, cached, strict=True):
        hit_lens = jnp.arange(group_cached.shape[1] + 1, dtype=jnp.int32) * rule.block_size
        ok = valid_hit_blocks(rule, group_cached) & (hit_lens <= max_hit_len)
        lens.append(jnp.max(jnp.where(ok, hit_lens, 0), axis=1))
    return jnp.stack(lens, axis=1)


@functools.partial(jax.jit, static_argnames=("rules",))
def prefix_hit_len(rules: tuple[HitRule, ...], cached: tuple[jax.Array, ...], num_tokens: jax.Array) -> jax.Array:
    """int32[R]: the longest hit valid for every group, in tokens, below each request's last token.

    Jitted with `rules` static. Lengths are checked on a grid of gcd(block
    sizes) tokens up to the shortest span any group's candidates cover; a
    length is valid for a group when it is a multiple of the group's block size
    and `valid_hit_blocks` accepts it.

    Args:
      rules: one rule per group (static).
      cached: per group, bool[R, N_g].
      num_tokens: int32[R].
    """
    if len(rules) != len(cached) or not rules:
        raise ValueError(f"need one cached array per rule and at least one: {len(rules)=}, {len(cached)=}")
    step = math.gcd(*(rule.block_size for rule in rules))
    span = min(rule.block_size * c.shape[1] for rule, c in zip(rules, cached))
    hit_lens = np.arange(0, span + 1, step, dtype=np.int32)
    ok = jnp.broadcast_to(hit_lens <= jnp.maximum(num_tokens - 1, 0)[:, None], (num_tokens.shape[0], len(hit_lens)))
    for rule, group_cached in zip(rules, cached):
        on_boundary = hit_lens % rule.block_size == 0
        valid = valid_hit_blocks(rule, group_cached)[:, hit_lens // rule.block_size]
        ok = ok & on_boundary & valid
    return jnp.max(jnp.where(ok, hit_lens, 0), axis=1)
