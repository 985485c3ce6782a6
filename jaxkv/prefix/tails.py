"""Prefix-cache hits that end inside a block: partial entries at the prompt tail, copy-on-write
claims, and copies pinned until the caller has applied them.

Dimensions: R rows of a call, G groups, S slots, M max blocks per request, N blocks, C copies released.

When the hash unit u is finer than the block size b of a full-attention or state (Mamba) group
(a "partial group", `jaxkv.prefix.state.partial_groups`: a `prefix_match_unit` below the block size, as
page-size unification makes hybrid blocks hundreds of tokens long), a hit may end on any unit
boundary, inside a block:

    u = 4, b = 16, a 42-token prompt: p* = ⌊41 / 4⌋·4 = 40
    tokens   | 0 ......... 15 | 16 ........ 31 | 32 .. 39 | 40 41 ..
    block    |       0        |        1       |        2            (j = ⌊p* / b⌋ = 2)
    indexed  | key(16)        | key(32)        | key(40): block 2, valid for tokens [32, 40)

Partial entries. A request's prompt tail p* = min(⌊(P − 1) / u⌋, hashed units)·u (P prompt
tokens: the longest hit a resent prompt can use; vLLM registers the same boundary) is indexed
when it lies inside a block j = ⌊p* / b⌋: (key(p*), g) -> the block holding the group's cache of
tokens [j·b, p*). `register_tails` does it once the step that computed p* ran, at the start of
the request's next call or at its free (as `cache_state_blocks` does for block-end states), so a
copy from it never reads a block a pending forward pass has yet to write:

* full attention, once the request computed p* tokens: its own block j, into which it keeps
  writing past p* (positions below p* never change). When its tokens fill the block, the block
  is indexed under its block-end key instead (`unindex_filled_tails`, then `cache_full_blocks`).
* state, when a step ended exactly at p* (the scheduler ends a chunk there, as vLLM's "align"
  mode ends chunks at block ends): block j then holds the state after p* tokens. At free it is
  indexed as it is; at the next call it is indexed and the request moves to a fresh block at j
  with a copy of it (its next step would overwrite the state in place), if a block is free.

A block holds one key: the first registration stays until the block is full or evicted.

Claims (`claim_tails`). A hit h inside block j of a partial group claims the block X indexed
under (key(h), g). The request gets a fresh block D at j and a copy X -> D (copy-on-write: it
writes positions ≥ h of block j, or the state there, and X is shared); a state group whose
step writes a later block holds X itself at j, read-only, with no copy.

Copies and pins. Each copy is returned by the call as (source, destination, tokens of the block
that are valid) and recorded as `copy_src[D] = X`; both blocks keep one reference for it (a pin:
DESIGN.md invariant 1 counts it) until a later call releases the copy (`released_copies`). The
protocol: apply the copies a call returns (`jaxkv.copy_blocks`, whole blocks) before the
forward pass that computes the call's tokens, then release them in any later call. Until then
no free, preemption or eviction can hand either block to another request, so the copy can run
late (after several calls of one scheduling step) and still read and write what it should.
Within a call's copies every destination is a fresh block and no source is a destination.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxkv.core.pool import NOT_CACHED, claim, count_prefix, pop, release, unclaim
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.index import probe, remove
from jaxkv.prefix.state import index_blocks


def tail_len(prefix_state, slots, unit: int):
    """int32[R]: p*, the prompt tail's final unit boundary of `slots` int32[R] (0: no prompt given)."""
    prompt_len = prefix_state.prompt_len[slots]
    units = jnp.minimum(jnp.maximum(prompt_len - 1, 0) // unit, prefix_state.num_hashed_units[slots])
    return jnp.where(prompt_len > 0, units * unit, 0)


def set_prompt_len(prefix_state, scatter_slots, num_prompt_tokens):
    """Records the rows' prompt lengths int32[R] (0: unknown, nothing recorded) at `scatter_slots` (S: padding)."""
    slots = jnp.where(num_prompt_tokens > 0, scatter_slots, prefix_state.prompt_len.shape[0])
    return dataclasses.replace(
        prefix_state, prompt_len=prefix_state.prompt_len.at[slots].set(num_prompt_tokens, mode="drop")
    )


def release_copies(state, dst_blocks):
    """Releases the pending copies into `dst_blocks` int32[C] (NULL_BLOCK or a block without one: skipped).

    For each, in order, the source and then the destination drop their pin (`pool.release`).
    """
    copy_src = state.prefix.copy_src
    num_blocks, num_entries = copy_src.shape[0], dst_blocks.shape[0]
    entry = jnp.arange(num_entries, dtype=jnp.int32)
    valid = (dst_blocks > NULL_BLOCK) & (dst_blocks < num_blocks)
    safe = jnp.where(valid, dst_blocks, NULL_BLOCK)
    first = jnp.full(num_blocks, num_entries, jnp.int32).at[jnp.where(valid, safe, num_blocks)].min(entry, mode="drop")
    valid &= (copy_src[safe] != NULL_BLOCK) & (first[safe] == entry)
    src = copy_src[safe]
    pairs = jnp.stack([src, safe], axis=1).reshape(-1)
    pool = release(state.pool, pairs, jnp.repeat(valid, 2))
    copy_src = copy_src.at[jnp.where(valid, safe, num_blocks)].set(NULL_BLOCK, mode="drop")
    return dataclasses.replace(state, pool=pool, prefix=dataclasses.replace(state.prefix, copy_src=copy_src))


def _pin(state, src, dst, valid):
    """Records copies src -> dst int32[F] where valid bool[F]: dst gains a reference (its pin);
    src's pin is the reference the caller already holds for it."""
    num_blocks = state.pool.ref_cnt.shape[0]
    idx = jnp.where(valid, dst, num_blocks)
    pool = dataclasses.replace(state.pool, ref_cnt=state.pool.ref_cnt.at[idx].add(1, mode="drop"))
    copy_src = state.prefix.copy_src.at[idx].set(src, mode="drop")
    return dataclasses.replace(state, pool=pool, prefix=dataclasses.replace(state.prefix, copy_src=copy_src))


def _pop_into(state, flat_idx, want):
    """Gives the table entries `flat_idx` int32[F] (of block_tables flattened) where `want` bool[F]
    fresh blocks, in entry order. Returns (state, blocks int32[F]: NULL_BLOCK where not wanted).

    The caller makes sure enough blocks are free. A popped cached block is evicted.
    """
    shape = state.block_tables.shape
    size = flat_idx.shape[0]
    pool, popped = pop(state.pool, jnp.sum(want, dtype=jnp.int32), size)
    rank = count_prefix(want) - 1
    blocks = jnp.where(want, popped[jnp.clip(rank, 0, size - 1)], NULL_BLOCK)
    tables = (
        state.block_tables.reshape(-1)
        .at[jnp.where(want, flat_idx, tables_size(shape))]
        .set(blocks, mode="drop")
        .reshape(shape)
    )
    index = remove(state.prefix.index, popped, popped != NULL_BLOCK)
    return dataclasses.replace(
        state, pool=pool, block_tables=tables, prefix=dataclasses.replace(state.prefix, index=index)
    ), blocks


def tables_size(shape) -> int:
    return shape[0] * shape[1] * shape[2]


def register_tails(
    state,
    slots,
    num_computed,
    *,
    block_size: np.ndarray,
    unit: int,
    full_groups: tuple[int, ...],
    state_groups: tuple[int, ...],
    move: bool,
):
    """Indexes the rows' prompt-tail blocks (see the module docstring), one entry per row under key(p*).

    slots: int32[R] (S: padding); num_computed: int32[R] tokens the rows' finished steps
    computed; block_size: int32[G] (static); full_groups / state_groups: the partial groups
    of each kind (static); move: True at a call's start (a state block indexed there is
    handed over: the row moves to a fresh block with a pinned copy), False at free.
    Returns (state, copies int32[R, G, 3]: source, destination, valid tokens; zeros: none).
    """
    num_groups, num_slots, max_blocks = state.block_tables.shape
    num_rows = slots.shape[0]
    in_slot = (slots >= 0) & (slots < num_slots)
    safe_slot = jnp.where(in_slot, slots, 0)
    n = jnp.where(in_slot, num_computed, 0)[:, None]  # [R, 1]
    tail = jnp.where(in_slot, tail_len(state.prefix, safe_slot, unit), 0)[:, None]
    bs = block_size[None, :]
    block_idx = tail // bs  # [R, G]
    group = np.arange(num_groups)
    block = state.block_tables[group[None, :], safe_slot[:, None], jnp.clip(block_idx, 0, max_blocks - 1)]
    inside = (tail > 0) & (tail % bs != 0) & (block != NULL_BLOCK)
    inside &= state.pool.block_group[block] == NOT_CACHED
    is_full = np.isin(group, full_groups)[None, :]
    is_state = np.isin(group, state_groups)[None, :]
    want = inside & ((is_full & (n >= tail) & ((block_idx + 1) * bs > n)) | (is_state & (n == tail)))
    moving = want & is_state if move else jnp.zeros_like(want)
    if move:  # a state block is indexed only if the row can move to a fresh block
        rank = count_prefix(moving.reshape(-1)).reshape(moving.shape)
        want &= ~moving | (rank <= state.pool.num_free_blocks)
    num_units = state.prefix.req_hashes.shape[1]
    keys = state.prefix.req_hashes[safe_slot, jnp.clip(tail[:, 0] // unit - 1, 0, num_units - 1)]
    state, placed = index_blocks(state, keys, jnp.where(want, block, NULL_BLOCK), jnp.any(want, axis=1))
    copies = jnp.zeros((num_rows, num_groups, 3), jnp.int32)
    if not move:
        return state, copies
    moved = (placed & moving).reshape(-1)
    flat = ((group[None, :] * num_slots + safe_slot[:, None]) * max_blocks + block_idx).reshape(-1)
    state, dst = _pop_into(state, flat, moved)
    src = block.reshape(-1)
    # The row's table reference to the source becomes the copy's pin: its count stays.
    state = _pin(state, src, dst, moved)
    valid_tokens = (tail - block_idx * bs).reshape(-1)
    copies = jnp.where(moved[:, None], jnp.stack([src, dst, valid_tokens], axis=1), 0)
    return state, copies.reshape(num_rows, num_groups, 3)


def claim_tails(state, slots, hit_len, partial, *, unit: int):
    """Claims the source blocks of hits that end inside a block.

    slots: int32[R]; hit_len: int32[R] (a unit multiple, keys uploaded); partial: bool[R, G]
    the (row, group) pairs whose hit ends inside a block. One probe per row under key(h).
    Returns (state, src int32[R, G] (NULL_BLOCK where not found or not partial), found bool[R]:
    every partial group found its block, num_taken_free int32[R]: claimed blocks that were free).
    """
    num_units = state.prefix.req_hashes.shape[1]
    keys = state.prefix.req_hashes[slots, jnp.clip(hit_len // unit - 1, 0, num_units - 1)]
    src = jnp.where(partial, probe(state.prefix.index, keys, jnp.any(partial, axis=1)), NULL_BLOCK)
    found = jnp.all(~partial | (src != NULL_BLOCK), axis=1)
    pool, was_free = claim(state.pool, src.reshape(-1), (src != NULL_BLOCK).reshape(-1))
    num_taken = jnp.sum(was_free.reshape(src.shape), axis=1, dtype=jnp.int32)
    return dataclasses.replace(state, pool=pool), src, found, num_taken


def unclaim_tails(state, src, keep):
    """Gives back the claims `src` int32[R, G] of rows not kept (`keep` bool[R]), as `pool.unclaim`."""
    drop = (src != NULL_BLOCK) & ~keep[:, None]
    return dataclasses.replace(state, pool=unclaim(state.pool, src.reshape(-1), drop.reshape(-1)))


def place_tails(state, slots, hit_len, src, cow, *, block_size: np.ndarray):
    """After the fills: for the claimed sources `src` int32[R, G] of kept rows, a copy-on-write pair
    (`cow` bool[R, G]: the fill gave table entry ⌊h / b⌋ a fresh block) is pinned; otherwise the
    source goes into the table at ⌊h / b⌋ (a state group reading it only). Returns (state, copies
    int32[R, G, 3])."""
    shape = state.block_tables.shape
    num_groups, num_slots, max_blocks = shape
    group = np.arange(num_groups)
    bs = block_size[None, :]
    block_idx = hit_len[:, None] // bs
    flat = (group[None, :] * num_slots + slots[:, None]) * max_blocks + block_idx  # [R, G]
    have = src != NULL_BLOCK
    hold = have & ~cow
    tables = state.block_tables.reshape(-1).at[jnp.where(hold, flat, tables_size(shape))].set(src, mode="drop")
    state = dataclasses.replace(state, block_tables=tables.reshape(shape))
    pinned = have & cow
    dst = jnp.where(pinned, state.block_tables.reshape(-1)[jnp.where(pinned, flat, 0)], NULL_BLOCK)
    state = _pin(state, src.reshape(-1), dst.reshape(-1), pinned.reshape(-1))
    copies = jnp.stack([src, dst, hit_len[:, None] - block_idx * bs], axis=2)
    return state, jnp.where(pinned[:, :, None], copies, 0)


def unindex_filled_tails(
    state, slots, num_tokens, filled_from, *, block_size: np.ndarray, unit: int, full_groups: tuple[int, ...]
):
    """Takes out of the index the rows' partially indexed tail blocks that their scheduled tokens
    now fill, so that `cache_full_blocks` indexes them under their block-end key.

    slots: int32[R] (S: padding); num_tokens: int32[R] tokens scheduled, this call's included (0:
    the row took nothing); filled_from: int32[R, G] the first block the caching walk handles.
    """
    num_groups, num_slots, max_blocks = state.block_tables.shape
    in_slot = (slots >= 0) & (slots < num_slots)
    safe_slot = jnp.where(in_slot, slots, 0)
    n = jnp.where(in_slot, num_tokens, 0)[:, None]
    tail = tail_len(state.prefix, safe_slot, unit)[:, None]
    hashed = state.prefix.num_hashed_units[safe_slot][:, None] * unit
    bs = block_size[None, :]
    block_idx = tail // bs
    group = np.arange(num_groups)
    block = state.block_tables[group[None, :], safe_slot[:, None], jnp.clip(block_idx, 0, max_blocks - 1)]
    end = (block_idx + 1) * bs
    filled = np.isin(group, full_groups)[None, :] & (tail % bs != 0) & (block != NULL_BLOCK)
    filled &= (end <= jnp.minimum(n, hashed)) & (block_idx >= filled_from)
    filled &= state.pool.block_group[block] != NOT_CACHED
    filled = filled.reshape(-1)
    block = block.reshape(-1)
    index = remove(state.prefix.index, block, filled)
    block_group = state.pool.block_group.at[jnp.where(filled, block, state.pool.ref_cnt.shape[0])].set(
        NOT_CACHED, mode="drop"
    )
    return dataclasses.replace(
        state,
        pool=dataclasses.replace(state.pool, block_group=block_group),
        prefix=dataclasses.replace(state.prefix, index=index),
    )
