"""Ragged lists of table ranges, walked in chunks of static size inside jit.

Dimensions: Q ranges, K entries per chunk, R rows, G groups.

A transition that touches a variable number of table entries (blocks to
release, to fill, to claim, to cache) describes them as Q ranges (a count per
range, range-major order), lays them out once (`range_layout`), then walks the
entries `K` at a time (`range_chunk`) in a loop whose step size is the
smallest static size that covers the total (`in_chunks`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxkv.core.pool import count_prefix, cumsum
from jaxkv.planner.specs import cdiv


def range_layout(count, max_entries: int):
    """Layout of the ragged list of entries of the ranges with `count` int32[Q] (range-major).

    `max_entries` (static) bounds the total.

    Returns (range_starts [Q], nonempty bool[Q], nonempty_ids [Q]: the non-empty ranges in
    order, total []).
    """
    num_ranges = count.shape[0]
    nonempty = count > 0
    scans = cumsum(jnp.stack([count, nonempty.astype(jnp.int32)]), bound=max_entries)  # one scan for both
    ends, nonempty_rank = scans[0], scans[1] - 1
    nonempty_ids = (
        jnp.zeros(num_ranges, jnp.int32)
        .at[jnp.where(nonempty, nonempty_rank, num_ranges)]
        .set(jnp.arange(num_ranges, dtype=jnp.int32), mode="drop")
    )
    return ends - count, nonempty, nonempty_ids, ends[-1]


def range_chunk(layout, chunk_idx, size: int):
    """Entries `chunk_idx × size + [0, size)` of the ragged list (`layout` from `range_layout`).

    Returns (in_range bool[K], range id [K], offset within the range [K]). An entry's range
    is the last non-empty one starting at or before it: a prefix count of range starts,
    no search per entry.
    """
    range_starts, nonempty, nonempty_ids, total = layout
    base = chunk_idx * size
    rel = range_starts - base
    starts_here = jnp.zeros(size, jnp.int32).at[jnp.where(nonempty & (rel >= 0), rel, size)].add(1, mode="drop")
    started_before = jnp.sum(nonempty & (rel < 0), dtype=jnp.int32)
    rank = jnp.clip(started_before + count_prefix(starts_here) - 1, 0, nonempty_ids.shape[0] - 1)
    range_id = nonempty_ids[rank]
    entry = base + jnp.arange(size, dtype=jnp.int32)
    return entry < total, range_id, entry - range_starts[range_id]


def in_chunks(total, chunk_sizes: tuple[int, ...] | int, body_for_size, state):
    """Runs `body_for_size(size)(chunk_idx, state)` over all `total` entries, `size` per step.

    `chunk_sizes` a tuple: takes the smallest size that covers the total (else the largest, in
    several steps). One loop per size, all but the chosen one run zero steps: unlike
    `lax.switch`, loops carry the state in place (a conditional over the state would copy it).

    `chunk_sizes` an int K (a step's work signature, `jaxkv.core.step.StepWork`): the caller knows
    there are at most K entries, so they run as straight-line code, with no loop and nothing
    hoisted out of one (K = 0: the walk is absent). Entries past K are not walked: the caller
    counts them (`jaxkv.core.step` reports them as unplanned, and the manager raises).
    """
    if isinstance(chunk_sizes, int):
        return state if chunk_sizes == 0 else body_for_size(chunk_sizes)(0, state)
    choice = sum((total > size).astype(jnp.int32) for size in chunk_sizes[:-1])
    for i, size in enumerate(chunk_sizes):
        num_steps = jnp.where(choice == i, cdiv(total, size), 0)
        state = lax.fori_loop(0, num_steps, body_for_size(size), state)
    return state


def table_ranges(shape, slots, start, count, stride=None):
    """Flattens per-row, per-group table ranges to per-range arrays [Q = R × G].

    Returns (count [Q], first flat table index [Q], flat index step [Q]): entry i of range q
    is table entry `first[q] + i × step[q]` of block_tables [G, S, M] flattened.
    """
    num_groups, num_slots, max_blocks = shape
    g = jnp.arange(num_groups, dtype=jnp.int32)[None, :]
    first = (g * num_slots + slots[:, None]) * max_blocks + start
    step = jnp.ones_like(start) if stride is None else stride
    return count.reshape(-1), first.reshape(-1), step.reshape(-1)


def run_if(flag, body, carry):
    """`body(carry)` if `flag` (bool[]) else `carry`, as a loop of 0 or 1 steps.

    The loop carries the state in place. XLA hoists the body's loop-invariant part
    (range layouts, row gathers) out of the loop, so that part runs even when the
    body is skipped; `lax.cond` avoids that, but measured on the serving workload
    the two differ by less than the noise.
    """
    return lax.fori_loop(0, flag.astype(jnp.int32), lambda _, c: body(c), carry)
