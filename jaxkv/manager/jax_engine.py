"""The jitted engine behind `KVCacheManager(backend="jax")`: the state as a `ManagerState` on a device, advanced
by the pure transitions of `jaxkv.core.state` and `jaxkv.core.step`, jitted and donated.

Dimensions: R rows of one call, S slots, G groups, M max blocks per request, U unit keys.

Fast path:
* each allocation sends only the rows with block work (a block to take, release, claim or index, or a
  whole-request gate); the others only advance their count, which the manager keeps (the device's is written
  at the next dispatch or read), and a step without block work makes no dispatch;
* the program is compiled for the step's work signature (`jaxkv.core.step.StepWork`, from this engine's mirror
  of the device's first live entries and cached blocks): walks the step does not have are absent, small ones
  straight-line code; batches are padded to 8 rows or to `max_num_seqs`, with or without pending frees;
* a free only records the slots; the next allocation frees them first, in the same dispatch (anything that
  reads the device state flushes them first), so a serving step is at most one dispatch and one small
  transfer back (ok flags, free count, the rows' mirrored entries);
* unit keys ride to the device with the next allocation (`jaxkv.prefix.state.store_hashes`); a lookup sends
  the request's keys with it (one dispatch, nothing changes on the device).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core import state as st
from jaxkv.core.invariants import check_invariants
from jaxkv.core.step import StepBatch, StepWork, allocate_step, rollback_ranges, walk_units
from jaxkv.manager.engine import RequestCounts
from jaxkv.planner.config import KVCacheConfig
from jaxkv.prefix.state import UPLOAD_WORDS, PrefixCacheConfig, partial_groups, store_hashes

FREE_ROWS = 8  # pending frees carried by one allocation; more are flushed in their own dispatch
SMALL_ROWS = 8  # batches are padded to this many rows, or to max_num_seqs
UPLOAD_ROWS = 1024  # unit keys carried by one allocation; more are stored in their own dispatch
RELEASE_ROWS = 64  # taken block copies released by one allocation; more wait for the next
_MIN_KEY_WIDTH = 64  # lookups pass keys padded to 64, 256, 1024, ... units
_WALK_SIZES = (512,)  # a step's walks are compiled for at most this many entries, or sized at run time
# Specialised allocation programs (work signature × row count × frees or not) compiled per config and
# process; later signatures run the full program. XLA:CPU maps each compiled kernel into memory apart: one
# specialised program of a 7-group config takes about 1,000 of the 65,530 memory maps Linux gives a
# process by default (vm.max_map_count), the full program about 3,000, and a process past the limit crashes.
MAX_PROGRAMS = 24


def _walk_size(num_entries: int) -> int | None:
    """The walk size a step with `num_entries` expected entries is compiled for (0: absent; None: at run time)."""
    if num_entries == 0:
        return 0
    return next((size for size in _WALK_SIZES if num_entries <= size), None)


def _allocate_packed(state, rows, slot_counts, free_rows, uploads, released=None, spec=None, *, cfg, prefix, work):
    """`step.allocate_step` with the row arrays packed as int32[5, R] (slots, new tokens, full tokens, hit
    tokens, shared tokens; with `released` copies, a sixth row: prompt tokens), the requests to free as
    int32[F] slots (their steps ran) or int32[2, F] (slots, tokens written) or None, the rows' rejected
    tokens and lookahead slots int32[2, R] or None, and the result packed as
    int32[R + 3 + 2 R G] (ok flags, num_free_blocks, hit tokens claimed, unplanned entries, the rows' first
    live indices and cached blocks [R, G]; with `released`, then the copies int32[R × G × 3]): one argument
    and one transfer instead of several."""
    caching = prefix is not None
    batch = StepBatch(
        req_slots=rows[0],
        num_new_tokens=rows[1],
        num_full_tokens=rows[2],
        num_hit_tokens=rows[3] if caching else None,
        num_shared_tokens=rows[4] if caching else None,
        num_prompt_tokens=None if released is None else rows[5],
        free_slots=free_rows if free_rows is None or free_rows.ndim == 1 else free_rows[0],
        free_num_written=free_rows[1] if caching and free_rows is not None and free_rows.ndim == 2 else None,
        hash_uploads=uploads,
        released_copies=released,
        slot_counts=slot_counts,
        num_rejected_tokens=None if spec is None else spec[0],
        num_lookahead_tokens=None if spec is None else spec[1],
    )
    state, result = allocate_step(state, batch, cfg=cfg, prefix=prefix, work=work)
    out = [
        result.ok.astype(jnp.int32),
        jnp.stack([result.num_free_blocks, result.num_hit_tokens, result.num_unplanned]),
        result.first_live.reshape(-1),
        result.num_cached.reshape(-1),
    ]
    if released is not None:
        out.append(result.copies.reshape(-1))
    return state, jnp.concatenate(out)


def _set_counts(state, slot_counts):
    return dataclasses.replace(state, num_computed=jnp.asarray(slot_counts, jnp.int32))


def _lookup_packed(state, keys, rows, *, cfg, prefix, drop_last_block):
    """`st._lookup` with rows packed as int32[2, R] (keys given, tokens); result int32[2R + 4] (hits, shared
    lengths, then the stats: lookups, tokens, hit tokens, reconciliation misses)."""
    hits, shared, stats = st._lookup(
        state, keys, rows[0], rows[1], cfg=cfg, prefix=prefix, drop_last_block=drop_last_block
    )
    return jnp.concatenate(
        [
            hits,
            shared,
            jnp.stack(
                [stats.num_lookups, stats.num_lookup_tokens, stats.num_hit_tokens, stats.num_reconciliation_miss_tokens]
            ),
        ]
    )


def _store_hashes(state, uploads):
    return dataclasses.replace(state, prefix=store_hashes(state.prefix, uploads))


@functools.cache
def _jitted(cfg: KVCacheConfig, prefix: PrefixCacheConfig | None, use_eagle: bool):
    """The transitions with `cfg` bound (not hashed per call), shared by engines of one config, and the
    set of specialised allocation programs compiled. The allocation is compiled once per work signature
    (`step.StepWork`, static) and shape; at most MAX_PROGRAMS specialised ones."""
    allocate = jax.jit(
        functools.partial(_allocate_packed, cfg=cfg, prefix=prefix),
        static_argnames=("work",),
        donate_argnames=("state",),
    )
    free = jax.jit(functools.partial(st._free, cfg=cfg, prefix=prefix), donate_argnames=("state",))
    lookup = jax.jit(functools.partial(_lookup_packed, cfg=cfg, prefix=prefix, drop_last_block=use_eagle))
    store = jax.jit(_store_hashes, donate_argnames=("state",))
    set_counts = jax.jit(_set_counts, donate_argnames=("state",))
    return allocate, free, lookup, store, set_counts, set()


def _pad(values: np.ndarray, num_rows: int, fill: int) -> np.ndarray:
    padded = np.full(num_rows, fill, np.int32)
    padded[: len(values)] = values
    return padded


class JaxEngine:
    """The `jaxkv.manager.engine.Engine` over a device `ManagerState` (see the module docstring).

    `specialize_steps` False: every step runs the full program with every row (same outcome; for tests and
    comparisons). `device`: where the state lives (default: JAX's default device). `speculating` does not
    apply: rollbacks and lookahead slots ride with any allocation."""

    checks_counts = False

    def __init__(
        self,
        cfg: KVCacheConfig,
        prefix: PrefixCacheConfig | None,
        counts: RequestCounts,
        *,
        max_num_seqs: int,
        use_eagle: bool,
        speculating: bool,
        specialize_steps: bool,
        device: jax.Device | None,
        debug_checks: bool,
    ):
        self.cfg, self.prefix, self.counts, self.max_num_seqs = cfg, prefix, counts, max_num_seqs
        self.specialize_steps, self.debug_checks = specialize_steps, debug_checks
        self._state = st.init_state(cfg, max_num_seqs, prefix=prefix)
        if device is not None:
            self._state = jax.device_put(self._state, device)
        (self._allocate_fn, self._free_fn, self._lookup_fn, self._store_fn, self._set_counts_fn, self._programs) = (
            _jitted(cfg, prefix, use_eagle)
        )
        self._tails = prefix is not None and bool(partial_groups(cfg, prefix))
        self._has_state_groups = any(g.kind == "mamba" for g in cfg.groups)
        self._keys: list[np.ndarray | None] = [None] * max_num_seqs  # uint32[units, 4] per slot
        self._uploads: dict[int, int] = {}  # slot -> its first unit whose key is not on the device yet
        self._num_uploaded = np.zeros(max_num_seqs, np.int64)  # units of each slot on the device
        self._num_uploads = 0
        self._num_keys = np.zeros(max_num_seqs, np.int64)  # unit keys of each slot
        self._num_free_blocks: int | None = cfg.num_blocks - 1  # None: read from the device state
        self._pending_free: list[int] = []  # slots freed on the host, not yet on the device
        self._pending_written: list[int] = []  # their tokens written
        self._freed_counts: dict[int, int] = {}  # pending frees: the count the device still holds
        self._pending_free_entries = 0  # table entries the pending frees release
        self._counts_stale = False  # rows advanced on the host only since the last dispatch
        # Mirror of the device state, for the steps' work signatures (`_plan_step`):
        self._rules = st.group_rules(cfg)
        self._first_live = np.zeros((max_num_seqs, len(cfg.groups)), np.int64)
        self._num_cached = np.zeros((max_num_seqs, len(cfg.groups)), np.int64)
        self.step_variants: dict[StepWork, int] = {}
        self.last_work: StepWork | None = None

    # ---- keys and lookups ------------------------------------------------------------------
    def set_keys(self, slot: int, keys: np.ndarray) -> None:
        self._num_keys[slot] = len(keys)
        self._keys[slot] = keys.copy()
        self._queue_upload(slot, 0, len(keys))

    def append_keys(self, slots: np.ndarray, counts: np.ndarray, keys: np.ndarray) -> None:
        ends = np.cumsum(counts)
        for slot, end, count in zip(slots.tolist(), ends.tolist(), counts.tolist()):
            first = len(self._keys[slot])
            self._keys[slot] = np.concatenate([self._keys[slot], keys[end - count : end]])
            self._num_keys[slot] = len(self._keys[slot])
            self._queue_upload(slot, first, count)

    def lookup(self, slots: np.ndarray, drop_last_block: bool) -> tuple[np.ndarray, tuple[int, int, int, int]]:
        if self._has_state_groups or not self._pending_ran():
            # A freed request's last state block becomes findable as it is freed; the blocks of a step not
            # known to have run leave the index.
            self._flush_frees()
        num_units = [len(self._keys[s]) for s in slots.tolist()]
        width = _MIN_KEY_WIDTH
        while width < max(num_units):
            width *= 4
        width = min(width, self.prefix.num_units(self.cfg))
        num_rows = 1 if len(slots) == 1 else self._num_rows(len(slots))
        keys = np.zeros((num_rows, width, 4), np.uint32)
        rows = np.zeros((2, num_rows), np.int32)
        for i, s in enumerate(slots.tolist()):
            keys[i, : num_units[i]] = self._keys[s]
        rows[0, : len(slots)] = num_units
        rows[1, : len(slots)] = self.counts.num_tokens[slots]
        packed = np.asarray(self._lookup_fn(self._state, keys, rows))
        self.counts.shared_len[slots] = packed[num_rows : num_rows + len(slots)]
        return packed[: len(slots)].astype(np.int64), tuple(packed[2 * num_rows :].tolist())

    def _queue_upload(self, slot: int, first: int, num: int) -> None:
        if num:
            self._uploads.setdefault(slot, first)  # a slot's keys go from its earliest pending unit on
            self._num_uploads += num

    def _take_uploads(self, num_rows: int) -> np.ndarray:
        """uint32[num_rows, 6]: the pending keys (at most num_rows), padded with slot S; clears them."""
        out = np.zeros((num_rows, UPLOAD_WORDS), np.uint32)
        out[:, 0] = self.max_num_seqs
        if self._uploads:
            slots, firsts = np.fromiter(self._uploads, np.int64), np.fromiter(self._uploads.values(), np.int64)
            keys = [self._keys[slot][first:] for slot, first in self._uploads.items()]
            counts = np.fromiter(map(len, keys), np.int64, len(keys))
            num = int(counts.sum())
            # Rows [end − count, end) of slot i hold its units first_i, first_i + 1, ...
            out[:num, 0] = np.repeat(slots, counts)
            out[:num, 1] = np.arange(num) - np.repeat(np.cumsum(counts) - counts - firsts, counts)
            out[:num, 2:] = np.concatenate(keys)
            self._num_uploaded[slots] = firsts + counts
            self._uploads.clear()
            self._num_uploads = 0
        return out

    def _flush_uploads(self) -> None:
        """Stores the pending keys on the device now (one dispatch; pending frees go first: a freed
        slot may hold a new request)."""
        if not self._uploads:
            return
        self._flush_frees()
        width = _MIN_KEY_WIDTH
        while width < self._num_uploads:
            width *= 4
        self._state = self._store_fn(self._state, self._take_uploads(width))
        self.check()

    # ---- allocation ------------------------------------------------------------------------
    def allocate_fast(self, slots, num_new, hits, must_fit, release: list[int]) -> None:
        return None

    def reserve_fast(self, slots, wanted, release: list[int]) -> None:
        return None

    def allocate(self, slots, num_new, hits, full, lookahead, release: list[int]) -> tuple[np.ndarray, int, np.ndarray]:
        counts = self.counts
        no_copies = np.zeros((0, 3), np.int32)
        if len(self._pending_free) > FREE_ROWS:
            self._flush_frees()
        if self.prefix is not None and self._num_uploads > UPLOAD_ROWS:
            self._flush_uploads()
        num_computed = counts.num_computed[slots]
        rejected = self._take_rejections(slots)
        work, work_rows = self._plan_step(slots, num_computed, num_new, hits, full, rejected, lookahead)
        if not len(work_rows) and not self._tails:
            # No row takes, releases, claims or indexes a block: the counts advance on the host only.
            # Pending frees and keys wait for the next dispatch (or a read of the state).
            self._counts_stale = True
            self.last_work = None
            return np.ones(len(slots), bool), 0, no_copies
        sel_slots = slots[work_rows]
        num_rows = self._num_rows(len(sel_slots))
        work = self._program_work(work, num_rows, bool(self._pending_free))
        self.step_variants[work] = self.step_variants.get(work, 0) + 1
        self.last_work = work
        # slots, new tokens, full tokens, hit tokens, shared tokens (padding: slot S, 0, 0, 0, 0); prompt tokens
        # (hits inside blocks)
        rows = np.zeros((6 if self._tails else 5, num_rows), np.int32)
        rows[0] = self.max_num_seqs
        m = len(sel_slots)
        rows[0, :m] = sel_slots
        rows[1, :m] = num_new[work_rows]
        rows[2, :m] = full[work_rows]
        rows[3, :m] = hits[work_rows]
        rows[4, :m] = np.where(num_computed[work_rows] == 0, counts.shared_len[sel_slots], 0)
        free_rows = None  # a shape without the free pass (compiled apart) when nothing is pending
        if self._pending_free:
            free_rows = np.zeros((2, FREE_ROWS), np.int32)
            free_rows[0] = self.max_num_seqs
            free_rows[:, : len(self._pending_free)] = self._pending_free, self._pending_written
            if self._pending_ran():
                free_rows = free_rows[0]  # the usual program: nothing to take out of the index
        uploads = None if self.prefix is None else self._take_uploads(UPLOAD_ROWS)
        released = None
        if self._tails:
            rows[5, :m] = counts.num_prompt[sel_slots]
            released = np.zeros(RELEASE_ROWS, np.int32)
            released[: len(release[:RELEASE_ROWS])] = release[:RELEASE_ROWS]
        spec = None  # a shape without rollbacks and lookahead slots (compiled apart) when no row has them
        if rejected is not None or lookahead.any():
            spec = np.zeros((2, num_rows), np.int32)
            spec[0, :m] = 0 if rejected is None else rejected[work_rows]
            spec[1, :m] = lookahead[work_rows]
        self._state, packed = self._allocate_fn(
            self._state, rows, self._device_counts(), free_rows, uploads, released, spec, work=work
        )
        if rejected is not None:
            counts.pending_reject[slots] = 0
        self._clear_pending_frees()
        packed = np.asarray(packed)
        num_free, num_hit, num_unplanned = packed[num_rows : num_rows + 3].tolist()
        if num_unplanned:
            raise RuntimeError(
                f"the step's work signature {work} left out {num_unplanned} table entries it had: "
                "the manager's mirror of the device state is wrong (a bug; please report it)"
            )
        mirrored = packed[num_rows + 3 :].reshape(-1)
        num_groups = len(self.cfg.groups)
        self._first_live[sel_slots] = mirrored[: num_rows * num_groups].reshape(num_rows, num_groups)[:m]
        self._num_cached[sel_slots] = mirrored[num_rows * num_groups : 2 * num_rows * num_groups].reshape(
            num_rows, num_groups
        )[:m]
        copies = no_copies
        if self._tails:
            del release[:RELEASE_ROWS]
            copies = mirrored[2 * num_rows * num_groups :].reshape(-1, 3)
            copies = copies[copies[:, 1] != 0]
        # Rows left out of the batch always fit: every row before the first failed one is ok.
        failed = np.flatnonzero(packed[:m] == 0)
        num_ok = int(work_rows[failed[0]]) if len(failed) else len(slots)
        self._counts_stale = self._counts_stale or m < num_ok
        self._num_free_blocks = num_free
        self.check()
        return np.arange(len(slots)) < num_ok, num_hit, copies

    def _take_rejections(self, slots) -> np.ndarray | None:
        """The rows' pending rollbacks (rejected drafts, the last call's lookahead slots) that release a table
        entry, int64[R] (None: none); the others only lower the count, which the host carries: cleared now."""
        pending = self.counts.pending_reject[slots]
        if not pending.any():
            return None
        num_computed = self.counts.num_computed[slots][:, None]
        _, count = rollback_ranges(
            num_computed + pending[:, None], pending[:, None], self._first_live[slots], self._rules, xp=np
        )
        releases = count.sum(axis=1) > 0
        self.counts.pending_reject[slots[~releases]] = 0
        self._counts_stale = self._counts_stale or bool((~releases & (pending > 0)).any())
        return np.where(releases, pending, 0) if releases.any() else None

    def _plan_step(self, slots, num_computed, num_new, hits, full, rejected=None, lookahead=0):
        """The step's work signature (`step.StepWork`) and the rows with block work int[W], from the
        engine's mirror of the device state.

        A row has block work if it takes, releases, claims or indexes a block, or asks to fit whole; the
        others only advance their count, on the host (configs with state groups send every row: a state
        block may become findable at any call). Each walk's expected entries are rounded up to a size
        of `_WALK_SIZES` (0: absent; above the largest: sized at run time). Hits inside blocks (copies)
        take the full program.
        """
        all_rows = np.arange(len(slots))
        if self._tails or not self.specialize_steps:
            return StepWork(), all_rows
        rules = self._rules
        hit = hits > 0
        any_hit = bool(hit.any())
        n, first_live = num_computed[:, None], self._first_live[slots]
        if any_hit:  # a hit row starts from its claim
            claim_start = st.keep_from_idx(hits[:, None], rules, xp=np)
            n, first_live = np.where(hit, hits, num_computed)[:, None], np.where(hit[:, None], claim_start, first_live)
        _, num_released, _, need = st.allocation_ranges(n, (num_new + lookahead)[:, None], first_live, rules, xp=np)
        need_rows, released_rows = need.sum(axis=1), num_released.sum(axis=1)
        work = dict(take=need_rows.sum(), release=released_rows.sum(), rollback=0)
        has_work = (need_rows > 0) | (released_rows > 0) | hit | (full > 0)
        if rejected is not None:  # rows whose rollback releases entries (`_take_rejections`)
            _, rollback = rollback_ranges(
                (num_computed + rejected)[:, None], rejected[:, None], self._first_live[slots], rules, xp=np
            )
            work["rollback"] = rollback.sum()
            has_work |= rejected > 0
        if self.prefix is not None:
            unit = self.prefix.unit
            units_per_block = rules.block_size // unit
            cache_from = self._num_cached[slots]
            work.update(free=self._pending_free_entries, claim=0)
            if any_hit:
                claim_count = np.where(hit[:, None], hits[:, None] // rules.block_size - claim_start, 0)
                cache_from = np.where(hit[:, None], hits[:, None] // rules.block_size, cache_from)
                work["claim"] = walk_units(claim_start, claim_count, units_per_block)
            hashed_len = self._num_keys[slots][:, None] * unit  # every key is on the device after the step
            full_blocks = np.minimum(n + num_new[:, None], hashed_len) // rules.block_size
            cache_count = np.where(rules.kind != st.MAMBA, np.maximum(full_blocks - cache_from, 0), 0)
            cache_rows = cache_count.sum(axis=1)
            has_work |= cache_rows > 0
            # A first call records its lookup's shared length, with block work or without.
            has_work |= (num_computed == 0) & (self.counts.shared_len[slots] > 0)
            work["index"] = walk_units(cache_from[cache_rows > 0], cache_count[cache_rows > 0], units_per_block)
        else:
            work["release"] += self._pending_free_entries
        work = StepWork(**{name: _walk_size(int(total)) for name, total in work.items()})
        return work, all_rows if self._has_state_groups else np.flatnonzero(has_work)

    def _program_work(self, work: StepWork, num_rows: int, frees: bool) -> StepWork:
        """`work`, or the full program `StepWork()` if its program is new and MAX_PROGRAMS are compiled."""
        program = (work, num_rows, frees)
        if work == StepWork() or program in self._programs:
            return work
        if len(self._programs) >= MAX_PROGRAMS:
            return StepWork()  # every walk sized at run time
        self._programs.add(program)
        return work

    def _device_counts(self) -> np.ndarray:
        """int32[S]: every slot's count as the device should hold it (pending rollbacks included; pending frees:
        the freed count)."""
        counts = (self.counts.num_computed + self.counts.pending_reject).astype(np.int32)
        for slot, count in self._freed_counts.items():
            counts[slot] = count
        return counts

    def _sync_counts(self) -> None:
        """Writes the host's counts to the device state if rows advanced on the host only (one dispatch)."""
        if self._counts_stale:
            self._state = self._set_counts_fn(self._state, self._device_counts())
            self._counts_stale = False

    # ---- freeing ---------------------------------------------------------------------------
    def free_fast(self, slots: np.ndarray) -> bool:
        return False

    def free(self, slots: np.ndarray, counts: np.ndarray, written: np.ndarray) -> None:
        # Requests with nothing computed hold no block; their keys on the device must go too.
        holding = (counts > 0) | (self._num_uploaded[slots] > 0)
        if holding.any():
            held = slots[holding]
            self._pending_free.extend(held.tolist())
            self._pending_written.extend(written[holding].tolist())
            self._freed_counts.update(zip(held.tolist(), counts[holding].tolist()))
            _, count, _ = st.held_ranges(counts[holding][:, None], self._first_live[held], self._rules, xp=np)
            self._pending_free_entries += int(count.sum())
            self._num_free_blocks = None  # known again after the next dispatch (or a read)
        for slot in slots.tolist():
            self._keys[slot] = None
        if self._uploads:  # keys not on the device yet of a freed request: never needed
            freed = set(slots.tolist())
            self._uploads = {s: first for s, first in self._uploads.items() if s not in freed}
            self._num_uploads = sum(len(self._keys[s]) - first for s, first in self._uploads.items())
        self._num_keys[slots] = self._num_uploaded[slots] = self._first_live[slots] = self._num_cached[slots] = 0
        if self.debug_checks:
            self._flush_frees()

    def _pending_ran(self) -> bool:
        """Whether every pending free's last step is known to have run (the free program without uncaching)."""
        return all(w >= self._freed_counts[s] for s, w in zip(self._pending_free, self._pending_written))

    def _clear_pending_frees(self) -> None:
        self._pending_free.clear()
        self._pending_written.clear()
        self._freed_counts.clear()
        self._pending_free_entries = 0

    def _flush_frees(self) -> None:
        """Applies the recorded frees on the device now (one dispatch)."""
        if not self._pending_free:
            return
        self._counts_stale = True  # the freed slots' counts (rows advanced on the host may be among them)
        self._sync_counts()
        slots = np.asarray(self._pending_free, np.int32)
        num_rows = FREE_ROWS if len(slots) <= FREE_ROWS else self.max_num_seqs
        written = None
        if self.prefix is not None and not self._pending_ran():
            written = _pad(np.asarray(self._pending_written, np.int32), num_rows, 0)
        self._state = self._free_fn(self._state, _pad(slots, num_rows, self.max_num_seqs), written)
        self._clear_pending_frees()
        self._num_free_blocks = None  # read on demand: a later dispatch may donate this state
        self.check()

    # ---- reading and handing over -----------------------------------------------------------
    def block_table(self, slot: int) -> np.ndarray:
        return np.asarray(jax.device_get(self.to_state().block_tables[:, slot, :]))

    def rows_tables(self, slots: np.ndarray, width: int) -> np.ndarray:
        return np.asarray(jax.device_get(st.block_tables(self.to_state(), slots)))[:, :, :width]

    def tables_state(self) -> st.ManagerState:
        return self.to_state()

    @property
    def num_free_blocks(self) -> int:
        if self._num_free_blocks is None:
            self._flush_frees()
            self._num_free_blocks = int(self._state.pool.num_free_blocks)
        return self._num_free_blocks

    def to_state(self) -> st.ManagerState:
        self._sync_counts()
        self._flush_frees()
        self._flush_uploads()
        return self._state

    def take(self) -> None:
        self._state = None

    def adopt(self, state: st.ManagerState, slots: np.ndarray, keys: dict[int, np.ndarray]) -> None:
        first_live, num_free = jax.device_get((state.first_live_idx[:, slots].T, state.pool.num_free_blocks))
        self._state = state
        self._first_live[slots] = first_live
        if state.prefix is not None:
            self._num_cached[slots] = jax.device_get(state.prefix.num_cached_blocks[:, slots].T)
        self._num_free_blocks = int(num_free)

    def _num_rows(self, num_requests: int) -> int:
        return min(SMALL_ROWS, self.max_num_seqs) if num_requests <= SMALL_ROWS else self.max_num_seqs

    def warm_up(self, variants: Iterable[StepWork] = ()) -> None:
        """Compiles the full program (`StepWork()`, which serves any step) and the work signatures `variants`,
        for every row count and with and without pending frees, as far as MAX_PROGRAMS allows, with calls that
        change nothing."""
        uploads = None
        if self.prefix is not None:
            uploads = np.zeros((UPLOAD_ROWS, UPLOAD_WORDS), np.uint32)
            uploads[:, 0] = self.max_num_seqs  # padding only
        released = np.zeros(RELEASE_ROWS, np.int32) if self._tails else None
        for work in dict.fromkeys([StepWork(), *variants]):
            for num_rows in sorted({self._num_rows(1), self.max_num_seqs}):
                rows = np.zeros((6 if self._tails else 5, num_rows), np.int32)
                rows[0] = self.max_num_seqs  # padding rows only
                for free_rows in (None, np.full(FREE_ROWS, self.max_num_seqs, np.int32)):
                    if self._program_work(work, num_rows, free_rows is not None) != work:
                        continue
                    self._state, _ = self._allocate_fn(
                        self._state, rows, self._device_counts(), free_rows, uploads, released, work=work
                    )
        for num_rows in sorted({FREE_ROWS, self.max_num_seqs}):
            self._state = self._free_fn(self._state, np.full(num_rows, self.max_num_seqs, np.int32), None)

    def check(self) -> None:
        if self.debug_checks:
            check_invariants(self.cfg, self._state, self.prefix)
