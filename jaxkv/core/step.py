"""One engine step of the manager: a pipeline of small pure phases over one batch pytree.

Dimensions: R rows of the step, G groups, S request slots, M max blocks per request, F freed
requests, X uploaded unit keys, C released copies.

    sync counts ─ free ─ store keys ─ roll back rejected drafts ─ claim hits ─ gate rows
                ─ release behind windows ─ take blocks ─ place tails ─ index filled blocks

`StepBatch` holds the step's arrays; a part the step does not have is None, and its phase is
absent from the compiled program. `StepWork`, static, is the step's work signature: for each walk
over table entries, how many entries the host expects (its mirror of the counts tells it), so
that a walk the step does not need is absent and a small one is straight-line code instead of a
loop (`jaxkv.core.ranges.in_chunks`). Any signature gives the same state; `StepWork()` (every walk
sized at run time) is the full program. Entries a signature did not plan for (a walk left out, or
more than its bound) are not walked; they are reported in `StepResult.num_unplanned`, which must be 0
(a caller whose mirror of the counts is wrong has a bug; the manager raises).

Speculative decoding: a row's `num_new_tokens` may end with draft tokens that the step's forward pass
verifies, and `num_lookahead_tokens` slots may follow them for a proposer (taken, counted, never
indexed). The row's next step reports the rejected ones and the lookahead slots (`num_rejected_tokens`):
its count drops by them before anything else, and its attention groups release the table entries past
the verified tokens (they hold no verified token, so no other request holds them and none is indexed).
Everything else then follows the verified count: window releases, new blocks, indexing. Only verified
tokens have keys (a host hashes the tokens the model produced), so a block holding a draft is never
indexed. On a state (Mamba) group only slots that never ran roll back (a device loop's unused reservation):
the state of a rejected draft overwrote the verified one, so a manager with state groups refuses speculative
decoding.

With a prefix cache (`state.prefix`) the rows are vLLM's row-by-row outcome with hits claimed first:

0. `released_copies` drop their pins; the freed requests release their blocks (`state._free`
   semantics); uploaded keys and prompt lengths are stored; state blocks the rows' last step
   ended on become findable, and so do the rows' prompt-tail blocks (`jaxkv.prefix.tails.register_tails`).
1. Claims: each row with h = num_hit_tokens > 0 (a request's first call) takes, per group, the
   blocks its rule needs at h (`jaxkv.prefix.state.claim_hits`), tentatively, in row order, before any
   row takes a new block. The claim is valid only if every block is still cached under the
   request's keys, h is a multiple of every group's block size (or of the unit, in a group where
   hits may end inside a block) and its keys are uploaded; otherwise the row fails. A hit ending
   inside block j of a partial group claims its source (`claim_tails`) and takes a fresh block at
   j (copy-on-write).
2. Gate: row i, if `num_full_tokens` asks, must fit whole in the blocks free before its release;
   it releases what its groups no longer need by the tokens computed before the call; it takes
   the blocks its new tokens need (plus its claimed blocks that were free), all groups at once,
   if they fit. The first row that does not fit, and every row after it, takes nothing and keeps
   its table (ok False); rows after it release nothing; claims of failed rows are given back.
   Counts and outcomes are the sequential ones, computed in one pass.
3. Releases (window retention: sliding-window and chunked blocks past the request's shared point
   go to the head of the free order), new blocks (a popped cached block is evicted from the index
   in the same step), tails placed, then every attention block whose tokens are now all scheduled
   and whose key is known is indexed; admitted rows record their shared point.

Without a prefix cache the frees join the window releases in one walk and a row's release frees
exactly what it holds (no block is shared).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core.pool import cumsum
from jaxkv.core.ranges import run_if, table_ranges
from jaxkv.core.state import (
    CHUNKED_LOCAL,
    FULL,
    MAMBA,
    SLIDING_WINDOW,
    GroupRules,
    ManagerState,
    _fill_ranges,
    _forget_rows,
    _free_cached,
    _partial_groups,
    _release_ranges,
    _rows,
    allocation_ranges,
    default_chunk_sizes,
    group_rules,
    keep_from_idx,
)
from jaxkv.core.step_batch import _PREFIX_PARTS, FULL_PROGRAM, StepBatch, StepResult, StepWork
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix import state as ps
from jaxkv.prefix import tails as pt


@dataclasses.dataclass(frozen=True)
class _Context:
    """What every phase of one step reads: static rules, prefix config, walk sizes."""

    rules: GroupRules
    prefix: ps.PrefixCacheConfig | None
    sizes: tuple[int, ...]
    work: StepWork

    def walk(self, name: str):
        return self.work.sizes(name, self.sizes)

    def partial_groups(self):
        """(bool[G] mask, full-attention groups, state groups) where hits may end inside a block."""
        if self.prefix is None:
            return np.zeros(self.rules.num_groups, bool), (), ()
        return _partial_groups(self.rules, self.prefix)

    def tail_args(self):
        _, full_groups, state_groups = self.partial_groups()
        return dict(
            block_size=self.rules.block_size, unit=self.prefix.unit, full_groups=full_groups, state_groups=state_groups
        )


@dataclasses.dataclass(frozen=True)
class _Rows:
    """The rows' view of a step, as the phases derive it (traced arrays; [R, 1] or [R, G]).

    row, slots, scatter_slots: from `state._rows`; n, k: tokens computed before, new (lookahead slots
    included); lookahead: those slots (never indexed); first_call;
    hit (asked), hit_ok (claimed), hit_len, claim_start, claim_count; partial, cow, tail_src
    (hits inside a block); first_live, keep, num_released, first_new, need: `allocation_ranges`;
    num_taken_free: claimed blocks that were free; ok, releasing: the gate's outcome.
    """

    row: jax.Array
    slots: jax.Array
    scatter_slots: jax.Array
    n: jax.Array
    k: jax.Array
    first_call: jax.Array
    lookahead: jax.Array | int = 0
    hit: jax.Array = None
    hit_ok: jax.Array = None
    hit_len: jax.Array = None
    claim_start: jax.Array = None
    claim_count: jax.Array = None
    partial: jax.Array = None
    cow: jax.Array = None
    tail_src: jax.Array = None
    num_taken_free: jax.Array = None
    first_live: jax.Array = None
    keep: jax.Array = None
    num_released: jax.Array = None
    first_new: jax.Array = None
    need: jax.Array = None
    ok: jax.Array = None
    releasing: jax.Array = None


def _unplanned(walk, total):
    """int32[]: entries of a walk of `total` int32[] entries past its signature's bound (an int walk)."""
    return jnp.int32(0) if isinstance(walk, tuple) else jnp.maximum(total - walk, 0).astype(jnp.int32)


# ---- phases --------------------------------------------------------------------------------------


def sync_counts(state: ManagerState, batch: StepBatch) -> ManagerState:
    """The host's counts of every slot replace the state's (rows it left out advanced there)."""
    if batch.slot_counts is None:
        return state
    return dataclasses.replace(state, num_computed=jnp.asarray(batch.slot_counts, jnp.int32))


def free_requests(state: ManagerState, batch: StepBatch, ctx: _Context):
    """Frees `batch.free_slots`. Returns (state, ranges still to release, blocks they free, unplanned).

    With a prefix cache the requests are freed now (`state._free_cached`, their own walk);
    without one, their ranges join the step's release walk, and the blocks they hold count
    as free for the gate.
    """
    if batch.free_slots is None:
        return state, None, 0, jnp.int32(0)
    if state.prefix is None:
        state, ranges, num_blocks = _forget_rows(state, batch.free_slots, ctx.rules)
        return state, ranges, num_blocks, jnp.int32(0)
    _, (count, _, _), _ = _forget_rows(state, batch.free_slots, ctx.rules)  # the entries only, for the check
    unplanned = _unplanned(ctx.walk("free"), jnp.sum(count))
    state = _free_cached(state, batch.free_slots, ctx.rules, ctx.prefix, ctx.walk("free"), batch.free_num_written)
    return state, None, 0, unplanned


def store_keys(state: ManagerState, batch: StepBatch, ctx: _Context) -> ManagerState:
    """Uploaded keys and prompt lengths are stored (prefix caching)."""
    if state.prefix is None:
        return state
    prefix = state.prefix
    if batch.hash_uploads is not None:
        prefix = ps.store_hashes(prefix, batch.hash_uploads)
    if batch.num_prompt_tokens is not None:
        row, _, scatter_slots = _rows(state, batch.req_slots)
        prefix = pt.set_prompt_len(prefix, scatter_slots, jnp.where(row, batch.num_prompt_tokens, 0))
    return dataclasses.replace(state, prefix=prefix)


def rollback_ranges(num_computed, num_rejected, first_live, rules: GroupRules, xp=jnp):
    """(start, count) int[R, G]: the table entries a rollback of `num_rejected` [R, 1] of
    `num_computed` [R, 1] tokens releases: past the verified tokens' blocks, from the first live one.
    `xp`: jax.numpy on device, numpy on the host's mirror."""
    start = xp.maximum(first_live, -(-(num_computed - num_rejected) // rules.block_size))
    return start, xp.maximum(-(-num_computed // rules.block_size) - start, 0)


def roll_back(state: ManagerState, batch: StepBatch, ctx: _Context):
    """Rows with rejected tokens drop them: the count falls to the verified tokens and the entries past
    them are released (tail first). Returns (state, unplanned). A state group's rolled back tokens must
    not have run (slots reserved for a device loop that it did not use): a token that ran overwrote the
    verified state, and a request keeps one state (so the manager refuses speculative decoding there)."""
    if batch.num_rejected_tokens is None:
        return state, jnp.int32(0)
    row, slots, scatter_slots = _rows(state, batch.req_slots)
    n = jnp.where(row, state.num_computed[slots], 0)[:, None]
    rejected = jnp.where(row, batch.num_rejected_tokens, 0)[:, None]
    start, count = rollback_ranges(n, rejected, state.first_live_idx[:, slots].T, ctx.rules)
    count = jnp.where(rejected > 0, count, 0)
    walk = ctx.walk("rollback")
    unplanned = _unplanned(walk, jnp.sum(count))
    if walk != 0:
        state = _release_ranges(state, table_ranges(state.block_tables.shape, slots, start, count), walk)
    num_computed = state.num_computed.at[scatter_slots].set((n - rejected)[:, 0], mode="drop")
    return dataclasses.replace(state, num_computed=num_computed), unplanned


def view_rows(state: ManagerState, batch: StepBatch) -> _Rows:
    row, slots, scatter_slots = _rows(state, batch.req_slots)
    n = jnp.where(row, state.num_computed[slots], 0)[:, None]
    return _Rows(
        row=row,
        slots=slots,
        scatter_slots=scatter_slots,
        n=n,
        k=jnp.where(
            row, batch.num_new_tokens + (0 if batch.num_lookahead_tokens is None else batch.num_lookahead_tokens), 0
        )[:, None],
        lookahead=0 if batch.num_lookahead_tokens is None else jnp.where(row, batch.num_lookahead_tokens, 0)[:, None],
        first_call=row & (n[:, 0] == 0),
    )


def register_finished_states(state: ManagerState, rows: _Rows, ctx: _Context):
    """State blocks and prompt-tail blocks that the rows' last step ended on become findable.
    Returns (state, copies int32[R, G, 3]: a state group's owner moved to a fresh block)."""
    copies = jnp.zeros((rows.row.shape[0], ctx.rules.num_groups, 3), jnp.int32)
    if state.prefix is None:
        return state, copies
    state_groups = tuple(int(g) for g in np.flatnonzero(ctx.rules.kind == MAMBA))
    state = ps.cache_state_blocks(
        state, rows.scatter_slots, rows.n[:, 0], state_groups=state_groups, rules=ctx.rules, prefix=ctx.prefix
    )
    if ctx.partial_groups()[0].any():
        state, copies = pt.register_tails(state, rows.scatter_slots, rows.n[:, 0], move=True, **ctx.tail_args())
    return state, copies


def claim_hits(state: ManagerState, batch: StepBatch, rows: _Rows, ctx: _Context):
    """Claims each hit row's cached blocks (tentatively: failed rows give them back at the gate).
    Returns (state, rows with the hit fields, unplanned)."""
    rules = ctx.rules
    partial_mask = ctx.partial_groups()[0]
    zeros = jnp.zeros_like(rows.row)
    if batch.num_hit_tokens is None:
        hit = hit_ok = zeros
        hit_len = jnp.zeros_like(rows.n)
    else:
        hashed_len = state.prefix.num_hashed_units[rows.slots] * ctx.prefix.unit
        hit = rows.row & (batch.num_hit_tokens > 0)
        h = jnp.where(hit, batch.num_hit_tokens, 0)[:, None]
        aligned = jnp.all((h % rules.block_size == 0) | partial_mask, axis=1) & (h[:, 0] % ctx.prefix.unit == 0)
        hit_ok = hit & rows.first_call & aligned & (h[:, 0] <= hashed_len)
        hit_len = jnp.where(hit_ok[:, None], h, 0)
    hit_blocks = hit_len // rules.block_size  # [R, G]
    claim_start = keep_from_idx(hit_len, rules)
    claim_count = jnp.where(hit_ok[:, None], hit_blocks - claim_start, 0)
    num_taken_free = jnp.zeros_like(rows.n[:, 0])
    partial = hit_ok[:, None] & partial_mask & (hit_len % rules.block_size != 0)  # [R, G]
    tail_src = jnp.zeros_like(partial, dtype=jnp.int32)
    unplanned = jnp.int32(0)
    if batch.num_hit_tokens is not None:
        walk = ctx.walk("claim")
        unplanned = _unplanned(walk, ps.walk_length(claim_start, claim_count, rules, ctx.prefix))
        if walk != 0:
            state, num_found, num_taken_free = run_if(
                jnp.any(hit_ok),
                lambda carry: ps.claim_hits(
                    carry[0], rows.slots, claim_start, claim_count, rules=rules, prefix=ctx.prefix, chunk_sizes=walk
                ),
                (state, num_taken_free, num_taken_free),
            )
            hit_ok = hit_ok & (num_found == jnp.sum(claim_count, axis=1))
        if partial_mask.any():
            state, tail_src, tails_found, tails_taken = pt.claim_tails(
                state, rows.slots, hit_len[:, 0], partial, unit=ctx.prefix.unit
            )
            hit_ok = hit_ok & tails_found
            num_taken_free = num_taken_free + tails_taken
    n = jnp.where(hit_ok[:, None], hit_len, rows.n)
    first_live = jnp.where(hit_ok[:, None], claim_start, state.first_live_idx[:, rows.slots].T)  # [R, G]
    keep, num_released, first_new, need = allocation_ranges(n, rows.k, first_live, rules)
    # Copy-on-write: a hit inside block j takes a fresh block at j (a state group only if its step writes j).
    cow = partial & hit_ok[:, None] & ((rules.kind == FULL) | (hit_len + rows.k <= (hit_blocks + 1) * rules.block_size))
    rows = dataclasses.replace(
        rows,
        n=n,
        hit=hit,
        hit_ok=hit_ok,
        hit_len=hit_len,
        claim_start=claim_start,
        claim_count=claim_count,
        partial=partial,
        cow=cow,
        tail_src=tail_src,
        num_taken_free=num_taken_free,
        first_live=first_live,
        keep=keep,
        num_released=jnp.where(rows.row[:, None], num_released, 0),
        first_new=jnp.where(cow, hit_blocks, first_new),
        need=need + cow,
    )
    return state, rows, unplanned


def _num_freed_by_releases(state: ManagerState, rows: _Rows, num_take, num_free, full_take, ctx: _Context):
    """int32[R]: blocks each row's release frees, as far as the gate needs to know.

    Without a prefix cache no block is shared: every released attention entry frees its block
    (a state group's old entry may be NULL). With one, a release frees the blocks the row holds
    alone (count 1 after the claims: a lower bound, exact unless two rows release one shared
    block); counted only if the rows do not all fit without.
    """
    rules = ctx.rules
    if state.prefix is None:
        shape = state.block_tables.shape
        old_state_block = state.block_tables[
            jnp.arange(shape[0])[None, :], rows.slots[:, None], jnp.minimum(rows.first_live, shape[2] - 1)
        ]
        num_freed = jnp.where((rules.kind == MAMBA) & (old_state_block == NULL_BLOCK), 0, rows.num_released)
        return jnp.sum(num_freed, axis=1)
    all_fit = jnp.sum(num_take) + jnp.max(jnp.maximum(full_take - num_take, 0)) <= num_free
    walk = ctx.walk("release")
    if walk == 0:
        return jnp.zeros_like(num_take)
    return run_if(
        ~all_fit,
        lambda _: ps.count_sole_holders(state, rows.slots, rows.first_live, rows.num_released, chunk_sizes=walk),
        jnp.zeros_like(num_take),
    )


def gate_rows(state: ManagerState, batch: StepBatch, rows: _Rows, num_free, ctx: _Context) -> _Rows:
    """Decides, in one pass, the rows' sequential outcome (ok) and which rows release (releasing).

    num_free: int32[] blocks free before the rows' releases.
    """
    rules, num_groups, max_blocks = ctx.rules, ctx.rules.num_groups, state.block_tables.shape[2]
    num_take = jnp.sum(rows.need, axis=1) + rows.num_taken_free
    full_take = 0
    if batch.num_full_tokens is not None:
        full = jnp.where(rows.row, batch.num_full_tokens, 0)[:, None]
        full_blocks = jnp.minimum(-(-full // rules.block_size), rules.max_blocks)
        full_take = jnp.sum(jnp.maximum(full_blocks - -(-rows.n // rules.block_size), 0), axis=1) + rows.num_taken_free
    num_freed = _num_freed_by_releases(state, rows, num_take, num_free, full_take, ctx)
    scans = cumsum(jnp.stack([num_take, num_freed]), bound=num_take.shape[0] * num_groups * max_blocks)
    take_before = scans[0] - num_take
    free_before = num_free + scans[1] - num_freed
    fits = (take_before + num_take <= free_before + num_freed) & (rows.hit_ok | ~rows.hit)
    gate = jnp.ones_like(fits)
    if batch.num_full_tokens is not None:
        gate = (full[:, 0] == 0) | (take_before + full_take <= free_before)
    row_idx = jnp.arange(fits.shape[0], dtype=jnp.int32)
    first_failed = jnp.min(jnp.where(fits & gate, fits.shape[0], row_idx))
    ok = rows.row & (row_idx < first_failed)
    releasing = rows.row & ~rows.hit & ((row_idx < first_failed) | ((row_idx == first_failed) & gate))
    return dataclasses.replace(rows, ok=ok, releasing=releasing)


def unclaim_failed(state: ManagerState, batch: StepBatch, rows: _Rows, ctx: _Context) -> ManagerState:
    """Failed rows give their claims back exactly."""
    if batch.num_hit_tokens is None or ctx.work.claim == 0:  # no claim was made
        return state
    # At most every claimed entry: K block-end units claim at most K entries per group.
    walk = ctx.sizes if ctx.work.claim is None else ctx.work.claim * ctx.rules.num_groups
    unclaim_count = jnp.where(rows.ok[:, None], 0, rows.claim_count)
    state = run_if(
        jnp.any(unclaim_count > 0),
        lambda state: ps.unclaim_hits(state, rows.slots, rows.claim_start, unclaim_count, chunk_sizes=walk),
        state,
    )
    if ctx.partial_groups()[0].any():
        state = pt.unclaim_tails(state, rows.tail_src, rows.ok)
    return state


def release_behind_windows(state: ManagerState, rows: _Rows, freed_ranges, ctx: _Context):
    """Releasing rows drop what their groups no longer need (with the frees' ranges, without a
    prefix cache). Window retention: window blocks past the request's shared point are evicted
    first. Returns (state, unplanned)."""
    rules, shape = ctx.rules, state.block_tables.shape
    ranges = table_ranges(shape, rows.slots, rows.first_live, jnp.where(rows.releasing[:, None], rows.num_released, 0))
    evict_from = None
    if state.prefix is not None:
        shared = state.prefix.shared_len[rows.slots][:, None]
        windowed = (rules.kind == SLIDING_WINDOW) | (rules.kind == CHUNKED_LOCAL)
        evict_from = jnp.where(windowed & (shared > 0), shared // rules.block_size, shape[2]).reshape(-1)
    if freed_ranges is not None:
        ranges = tuple(jnp.concatenate(parts) for parts in zip(freed_ranges, ranges))
    walk = ctx.walk("release")
    unplanned = _unplanned(walk, jnp.sum(ranges[0]))
    state = _release_ranges(state, ranges, walk, evict_from)
    # A failed hit row keeps its own (empty) table's first live index, not its claim's.
    new_first_live = jnp.where(
        (rows.releasing | (rows.ok & rows.hit_ok))[:, None], rows.keep, state.first_live_idx[:, rows.slots].T
    )
    first_live_idx = state.first_live_idx.at[:, rows.scatter_slots].set(new_first_live.T, mode="drop")
    return dataclasses.replace(state, first_live_idx=first_live_idx), unplanned


def take_blocks(state: ManagerState, rows: _Rows, ctx: _Context):
    """The ok rows' new table entries get blocks, in order; their counts advance. Returns (state, unplanned)."""
    count = jnp.where(rows.ok[:, None], rows.need, 0)
    walk = ctx.walk("take")
    unplanned = _unplanned(walk, jnp.sum(count))
    state = _fill_ranges(state, table_ranges(state.block_tables.shape, rows.slots, rows.first_new, count), walk)
    ok_slots = jnp.where(rows.ok, rows.slots, state.num_computed.shape[0])
    num_computed = state.num_computed.at[ok_slots].set((rows.n + rows.k)[:, 0], mode="drop")
    return dataclasses.replace(state, num_computed=num_computed), unplanned


def place_tails(state: ManagerState, rows: _Rows, ctx: _Context):
    """Copy-on-write hits inside a block: the fresh block gets a pinned copy of its source.
    Returns (state, copies int32[R, G, 3])."""
    copies = jnp.zeros((rows.row.shape[0], ctx.rules.num_groups, 3), jnp.int32)
    if not ctx.partial_groups()[0].any():
        return state, copies
    return pt.place_tails(
        state,
        rows.slots,
        rows.hit_len[:, 0],
        jnp.where(rows.ok[:, None], rows.tail_src, NULL_BLOCK),
        rows.cow,
        block_size=ctx.rules.block_size,
    )


def index_filled_blocks(state: ManagerState, batch: StepBatch, rows: _Rows, ctx: _Context):
    """Every attention block of the ok rows whose tokens are now all scheduled and whose key is
    known becomes findable; admitted rows record their shared point. Returns (state, unplanned)."""
    rules, prefix = ctx.rules, ctx.prefix
    num_slots = state.num_computed.shape[0]
    ok_slots = jnp.where(rows.ok, rows.slots, num_slots)
    hit_blocks = rows.hit_len // rules.block_size
    cache_from = jnp.where(
        (rows.ok & rows.hit_ok)[:, None], hit_blocks, state.prefix.num_cached_blocks[:, rows.slots].T
    )
    _, full_partial, _ = ctx.partial_groups()
    if full_partial:
        tail_args = ctx.tail_args()
        state = pt.unindex_filled_tails(
            state,
            ok_slots,
            (rows.n + rows.k - rows.lookahead)[:, 0],
            cache_from,
            **{key: tail_args[key] for key in ("block_size", "unit", "full_groups")},
        )
    hashed_len = state.prefix.num_hashed_units[rows.slots] * prefix.unit
    full_blocks = jnp.minimum(rows.n + rows.k - rows.lookahead, hashed_len[:, None]) // rules.block_size  # [R, G]
    attention = rows.ok[:, None] & (rules.kind != MAMBA)
    cache_count = jnp.where(attention, jnp.maximum(full_blocks - cache_from, 0), 0)
    walk = ctx.walk("index")
    unplanned = _unplanned(walk, ps.walk_length(cache_from, cache_count, rules, prefix))
    if walk != 0:
        state = ps.cache_full_blocks(
            state, rows.slots, cache_from, cache_count, rules=rules, prefix=prefix, chunk_sizes=walk
        )
    num_cached = jnp.where(attention, jnp.maximum(cache_from, full_blocks), 0)
    prefix_state = dataclasses.replace(
        state.prefix, num_cached_blocks=state.prefix.num_cached_blocks.at[:, ok_slots].set(num_cached.T, mode="drop")
    )
    if batch.num_shared_tokens is not None:  # on a request's first call
        admitted = jnp.where(rows.ok & rows.first_call, rows.slots, num_slots)
        prefix_state = dataclasses.replace(
            prefix_state,
            shared_len=prefix_state.shared_len.at[admitted].set(jnp.maximum(batch.num_shared_tokens, 0), mode="drop"),
        )
    return dataclasses.replace(state, prefix=prefix_state), unplanned


# ---- the step ------------------------------------------------------------------------------------


def allocate_step(
    state: ManagerState,
    batch: StepBatch,
    *,
    cfg: KVCacheConfig,
    prefix: ps.PrefixCacheConfig | None = None,
    work: StepWork = FULL_PROGRAM,
    chunk_sizes: tuple[int, ...] | None = None,
) -> tuple[ManagerState, StepResult]:
    """Runs one step's phases (see the module docstring). `cfg`, `prefix`, `work` and `chunk_sizes`
    are static; `chunk_sizes`: loop step sizes of walks sized at run time (default
    `state.default_chunk_sizes`). Returns the state and a StepResult. Jitted as `allocate`
    (state donated)."""
    rules = group_rules(cfg)
    if state.prefix is not None:
        prefix = ps.check_prefix_config(cfg, state.prefix, prefix)
    else:
        given = [name for name in _PREFIX_PARTS if getattr(batch, name) is not None]
        if given:
            raise ValueError(
                f"{' / '.join(given)} given, but the state has no prefix cache; make it with "
                "init_state(cfg, max_num_seqs, prefix=PrefixCacheConfig.for_config(cfg))"
            )
        prefix = None
    ctx = _Context(
        rules=rules, prefix=prefix, sizes=chunk_sizes or default_chunk_sizes(cfg, batch.req_slots.shape[0]), work=work
    )
    with jax.named_scope("sync_counts"):
        state = sync_counts(state, batch)
        state = state if batch.released_copies is None else pt.release_copies(state, batch.released_copies)
    with jax.named_scope("free_requests"):
        state, freed_ranges, num_freed_by_frees, unplanned_free = free_requests(state, batch, ctx)
    with jax.named_scope("store_keys"):
        state = store_keys(state, batch, ctx)
    with jax.named_scope("roll_back"):
        state, unplanned_rollback = roll_back(state, batch, ctx)
        rows = view_rows(state, batch)
    with jax.named_scope("register_finished_states"):
        state, copies = register_finished_states(state, rows, ctx)
    num_free = state.pool.num_free_blocks + num_freed_by_frees
    with jax.named_scope("claim_hits"):
        state, rows, unplanned_claim = claim_hits(state, batch, rows, ctx)
    with jax.named_scope("gate_rows"):
        rows = gate_rows(state, batch, rows, num_free, ctx)
    with jax.named_scope("unclaim_failed"):
        state = unclaim_failed(state, batch, rows, ctx)
    with jax.named_scope("release_behind_windows"):
        state, unplanned_release = release_behind_windows(state, rows, freed_ranges, ctx)
    with jax.named_scope("take_blocks"):
        state, unplanned_take = take_blocks(state, rows, ctx)
    num_cached = jnp.zeros_like(rows.first_live)
    num_hit = jnp.int32(0)
    unplanned_index = jnp.int32(0)
    if state.prefix is not None:
        with jax.named_scope("place_tails"):
            state, tail_copies = place_tails(state, rows, ctx)
        copies = copies + tail_copies
        with jax.named_scope("index_filled_blocks"):
            state, unplanned_index = index_filled_blocks(state, batch, rows, ctx)
        num_cached = state.prefix.num_cached_blocks[:, rows.slots].T
        num_hit = jnp.sum(jnp.where(rows.ok & rows.hit_ok, rows.hit_len[:, 0], 0))
    return state, StepResult(
        ok=rows.ok,
        num_free_blocks=state.pool.num_free_blocks,
        num_hit_tokens=num_hit,
        copies=copies,
        first_live=state.first_live_idx[:, rows.slots].T,
        num_cached=num_cached,
        num_unplanned=unplanned_free
        + unplanned_rollback
        + unplanned_claim
        + unplanned_release
        + unplanned_take
        + unplanned_index,
    )


allocate = jax.jit(allocate_step, static_argnames=("cfg", "prefix", "work", "chunk_sizes"), donate_argnames=("state",))


def walk_units(block_start, block_count, units_per_block: np.ndarray) -> int:
    """Host side of `jaxkv.prefix.state._end_units`: block-end grid steps of ranges [start, start + count)
    int[R, G] (numpy), summed over rows."""
    step = math.gcd(*units_per_block.tolist())
    has = block_count > 0
    first = np.where(has, (block_start + 1) * units_per_block // step - 1, np.iinfo(np.int32).max)
    last = np.where(has, (block_start + block_count) * units_per_block // step, 0)
    first_k = np.where(has.any(axis=1), first.min(axis=1), 0)
    return int(np.maximum(last.max(axis=1, initial=0) - first_k, 0).sum())
