"""The manager state held on the host and updated in place: the host backend of `KVCacheManager`.

The same transitions as `jaxkv.core.step.allocate_step` and `jaxkv.core.state._free`, with the
same outcome bit for bit (block ids, free order, index entries), written for the work a call
has: a step costs its rows and the blocks it takes, releases and indexes, not the padded shapes
of a compiled program (rows without block work only advance their counts; see `allocate`).
`jaxkv.core.host_convert.to_state` gives the equal `ManagerState` (for jitted loops),
`load_state` takes one back.

Structures (N blocks, S slots, G groups, M table entries per request, U unit keys per slot): numpy
arrays, updated in place; the loops over a call's blocks are compiled with numba:
* the pool (`jaxkv.core.host_pool`): `ref`, `group_of` (cached group, -1) and the free order (`nxt`,
  `prv`: a linked list);
* block tables: int32[G, S, M] (`tables`), written by slices;
* the index (`jaxkv.core.host_index`): the device index's `slots` and `block_slot`, so that it holds
  exactly what the device's does, and each slot's unit keys (`keys`, uint32[S, U, 4]; `num_hashed`);
* `index` shows the entries with keys as 128-bit ints, `w0 | w1 << 32 | w2 << 64 | w3 << 96` of the
  uint32 words.
"""

from __future__ import annotations

import numpy as np

from jaxkv.core import host_index as index
from jaxkv.core import host_pool as pool
from jaxkv.core import host_step
from jaxkv.core.pool import HASH_WORDS
from jaxkv.core.state import (
    CHUNKED_LOCAL,
    MAMBA,
    SLIDING_WINDOW,
    allocation_ranges,
    group_rules,
    keep_from_idx,
    max_blocks_per_request,
)
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.index import COUNT_WORD, FIELDS, NOT_INDEXED, num_buckets_for
from jaxkv.prefix.rules import HitRule, hit_blocks_reference
from jaxkv.prefix.state import PrefixCacheConfig, num_index_entries, partial_groups

_FULL, _SLIDING, _CHUNKED, _MAMBA = index.FULL, index.SLIDING, index.CHUNKED, index.STATE
_KINDS = {"full": _FULL, "sliding_window": _SLIDING, "chunked_local": _CHUNKED, "mamba": _MAMBA}


def keys_to_ints(keys: np.ndarray) -> list[int]:
    """uint32[U, 4] key words as U 128-bit ints."""
    keys = np.asarray(keys, np.uint64)
    lo = (keys[:, 0] | keys[:, 1] << np.uint64(32)).tolist()
    hi = (keys[:, 2] | keys[:, 3] << np.uint64(32)).tolist()
    return [low | high << 64 for low, high in zip(lo, hi)]


def ints_to_keys(keys: list[int]) -> np.ndarray:
    """The inverse of `keys_to_ints`: uint32[U, 4]."""
    mask = (1 << 32) - 1
    return np.array([[k & mask, k >> 32 & mask, k >> 64 & mask, k >> 96 & mask] for k in keys], np.uint32).reshape(
        -1, 4
    )


def _gate(num_free: int, cost, taken, freed, full_need, claim_ok) -> tuple[int, int]:
    """vLLM's sequential outcome, vectorised: each row sees the blocks the rows before it take (`cost`: new
    blocks and free ones its claim takes) and free; the first row that does not fit, fails its whole-request
    gate (`full_need`, -1: none) or its claim stops the batch. Returns (rows ok, rows that release: the ok ones
    and a failed one whose whole-request gate passed)."""
    take_before = np.cumsum(cost) - cost
    free_before = num_free + np.cumsum(freed) - freed
    gate = (
        np.ones(len(cost), bool)
        if full_need is None
        else (full_need < 0) | (take_before + full_need + taken <= free_before)
    )
    fits = (take_before + cost <= free_before + freed) & claim_ok
    failed = np.flatnonzero(~(fits & gate))
    num_ok = int(failed[0]) if len(failed) else len(cost)
    return num_ok, num_ok + 1 if num_ok < len(cost) and gate[num_ok] else num_ok


class HostState:
    """The state of one manager, in place (see the module docstring)."""

    def __init__(self, cfg: KVCacheConfig, max_num_seqs: int, prefix: PrefixCacheConfig | None = None):
        self.cfg, self.prefix, self.max_num_seqs = cfg, prefix, max_num_seqs
        groups = cfg.groups
        self.num_groups = num_groups = len(groups)
        self.block_size = [g.block_size for g in groups]
        self.kind = [_KINDS[g.kind] for g in groups]
        self.window = [
            g.spec.sliding_window
            if g.kind == "sliding_window"
            else g.spec.attention_chunk_size
            if g.kind == "chunked_local"
            else 0
            for g in groups
        ]
        self.group_rules = group_rules(cfg)
        self._block_size = self.group_rules.block_size.astype(np.int64)
        self.windowed = np.isin(self.group_rules.kind, (SLIDING_WINDOW, CHUNKED_LOCAL))
        n = cfg.num_blocks
        # Per block: ref, group_of, nxt, prv, block_slot and cached_in_pass, views of one array's columns.
        self._block_fields = pool.new_pool(n)
        self.ref, self.group_of, self.nxt, self.prv = (self._block_fields[:, i] for i in range(4))
        self.num_free = n - 1
        self.tables = np.zeros((num_groups, max_num_seqs, max_blocks_per_request(cfg)), np.int32)
        self.first_live = np.zeros((max_num_seqs, num_groups), np.int64)
        self.num_computed = np.zeros(max_num_seqs, np.int64)
        if prefix is not None:
            self.unit = prefix.unit
            self.ways = prefix.ways
            self.num_buckets = num_buckets_for(num_index_entries(cfg), prefix.ways)
            self.slots = np.zeros((self.num_buckets * self.ways, FIELDS + num_groups), np.uint32)
            self.block_slot, self.cached_in_pass = self._block_fields[:, 4], self._block_fields[:, 5]
            self.block_slot[:] = NOT_INDEXED
            self.num_passes = 0  # caching passes so far: the current one's id
            self.keys = np.zeros((max_num_seqs, prefix.num_units(cfg), HASH_WORDS), np.uint32)
            self.num_hashed = np.zeros(max_num_seqs, np.int64)
            self.num_cached = np.zeros((max_num_seqs, num_groups), np.int64)
            self.shared_len = np.zeros(max_num_seqs, np.int64)
            self.prompt_len = np.zeros(max_num_seqs, np.int64)
            # Per slot, bounds within which an allocation of it only advances its count (`host_step._set_quiet`;
            # -1: unknown, the next allocation finds them).
            self.quiet_start = np.full(max_num_seqs, -1, np.int64)
            self.quiet_done = np.full(max_num_seqs, -1, np.int64)
            self.copies: dict[int, int] = {}  # pending copies: destination -> source (both pinned)
            self.partial = list(partial_groups(cfg, prefix))
            self.rules = [HitRule.for_spec(g.spec) for g in groups]
            self.step = self._block_size // self.unit  # units per block
            rules = self.group_rules
            self._rules = np.stack(
                [rules.block_size, rules.max_blocks, rules.keep_offset, rules.keep_unit, rules.keep_scale,
                 rules.keep_div, self.step]
            ).astype(np.int64)  # fmt: skip
            self._kind_arrays = tuple(
                np.asarray(x, np.int64) for x in (self.kind, self.block_size, self.window, self.step)
            )

    # ---- pool ----------------------------------------------------------------------------------
    def free_order(self) -> list[int]:
        """The free blocks, first popped first."""
        return pool.free_order(self.nxt, self.num_free).tolist()

    def set_free_order(self, order) -> None:
        """Makes `order` (first popped first) the free blocks; their counts must be 0."""
        pool.set_order(self.nxt, self.prv, order)
        self.num_free = len(order)

    def _pop_many(self, k: int) -> np.ndarray:
        """The first k free blocks, taken (count 1, evicted from the index if cached)."""
        blocks = pool.pop(k, self.nxt, self.prv, self.ref, self.group_of)
        self.num_free -= k
        if self.prefix is not None:
            index.evict(blocks, self.slots, self.block_slot)
        return blocks

    def _touch(self, block: int) -> None:
        self.num_free -= pool.claim(np.array([block], np.int32), self.nxt, self.prv, self.ref)

    def _release_ranges(self, ranges) -> None:
        """Releases table entries: (group, slot, lo, hi, evict_from) rows, see `host_pool.release_ranges`."""
        if len(ranges):
            ranges = np.asarray(ranges, np.int64).reshape(-1, 5)
            self.num_free += pool.release_ranges(self.tables, ranges, self.nxt, self.prv, self.ref, self.group_of)

    def _release_blocks(self, blocks, evict_first: bool = False) -> None:
        """Releases blocks in order (NULL_BLOCK entries skipped); a cached one goes to the back, unless
        `evict_first`."""
        blocks = np.asarray(blocks, np.int32)
        self.num_free += pool.release(blocks, evict_first, self.nxt, self.prv, self.ref, self.group_of)

    # ---- rules ---------------------------------------------------------------------------------
    def _keep_from(self, g: int, n: int) -> int:
        kind = self.kind[g]
        if kind == _FULL:
            return 0
        bs = self.block_size[g]
        if kind == _SLIDING:
            return max(0, n - self.window[g] + 1) // bs
        if kind == _CHUNKED:
            return n // self.window[g] * self.window[g] // bs
        return max(0, n - 1) // bs

    # ---- transitions ---------------------------------------------------------------------------
    def allocate(
        self,
        slots,
        num_new_tokens,
        num_full_tokens=None,
        num_hit_tokens=None,
        num_prompt_tokens=None,
        num_shared_tokens=None,
        num_lookahead_tokens=None,
    ) -> tuple[np.ndarray, int, dict]:
        """vLLM's sequential outcome (`jaxkv.core.step`), for int[R] rows: returns the ok flags bool[R], the
        hit tokens claimed and the copies {(row, group): (source, destination, valid tokens)}.

        With a prefix cache whose hits end at block boundaries and no state groups, one compiled loop
        (`jaxkv.core.host_step`). Otherwise rows that take, release, claim or index no block and ask for no
        whole-request gate only advance their counts; the others go through `_allocate_rows`, vectorised
        over [rows, G] with Python loops over the blocks they move (configs with state groups or hits
        inside blocks send every row)."""
        slots = np.asarray(slots, np.int64)
        k = np.asarray(num_new_tokens, np.int64)
        if num_lookahead_tokens is not None:
            k = k + np.asarray(num_lookahead_tokens, np.int64)
        parts = [num_full_tokens, num_hit_tokens, num_prompt_tokens, num_shared_tokens, num_lookahead_tokens]
        if self.prefix is not None and (self.partial or _MAMBA in self.kind):
            return self._allocate_rows(slots, num_new_tokens, parts)
        if self.prefix is not None:
            return self._allocate_compiled(slots, k, parts)
        rules, n = self.group_rules, self.num_computed[slots]
        table_len = -(-n[:, None] // rules.block_size)
        work = (-(-(n + k)[:, None] // rules.block_size) > table_len).any(axis=1)
        live = self.first_live[slots]
        work |= (np.minimum(keep_from_idx(n[:, None], rules, xp=np), table_len) > live).any(axis=1)
        if num_full_tokens is not None:
            work |= np.asarray(num_full_tokens) > 0
        if num_hit_tokens is not None:
            work |= np.asarray(num_hit_tokens) > 0
        if self.prefix is not None:
            end = np.minimum(
                self.num_hashed[slots] * self.unit, n + k - (0 if num_lookahead_tokens is None else parts[4])
            )
            work |= ((end[:, None] // rules.block_size > self.num_cached[slots]) & (rules.kind != MAMBA)).any(axis=1)
        rows = np.flatnonzero(work)
        ok_rows, num_hit, copies = np.ones(0, bool), 0, {}
        if len(rows):
            given = [None if x is None else np.asarray(x)[rows] for x in parts]
            ok_rows, num_hit, copies = self._allocate_rows(slots[rows], np.asarray(num_new_tokens)[rows], given)
            copies = {(int(rows[i]), g): c for (i, g), c in copies.items()}
        failed = np.flatnonzero(~ok_rows)
        ok = np.arange(len(slots)) < (rows[failed[0]] if len(failed) else len(slots))
        trivial = ok & ~work  # rows before the first failed one that only advance
        self.num_computed[slots[trivial]] += k[trivial]
        if self.prefix is not None:  # what every row records (the rows sent record it too)
            if num_prompt_tokens is not None:
                prompt = np.asarray(num_prompt_tokens, np.int64)
                self.prompt_len[slots[prompt > 0]] = prompt[prompt > 0]
            if num_shared_tokens is not None:
                first = trivial & (n == 0)
                self.shared_len[slots[first]] = np.maximum(np.asarray(num_shared_tokens)[first], 0)
        return ok, num_hit, copies

    def _allocate_compiled(self, slots, k, parts) -> tuple[np.ndarray, int, dict]:
        """`allocate` as `host_step.allocate` (k: new tokens, lookahead included)."""
        num_full_tokens, num_hit_tokens, num_prompt_tokens, num_shared_tokens, num_lookahead_tokens = parts

        def rows(x):
            return np.zeros(len(slots), np.int64) if x is None else np.ascontiguousarray(x, np.int64)

        if num_prompt_tokens is not None:
            prompt = np.asarray(num_prompt_tokens, np.int64)
            self.prompt_len[slots[prompt > 0]] = prompt[prompt > 0]
        self.num_passes += 1
        num_ok, num_hit, self.num_free = host_step.allocate(
            slots, k, rows(num_lookahead_tokens), rows(num_hit_tokens), rows(num_full_tokens),
            rows(num_shared_tokens), num_shared_tokens is not None, self._rules, self.windowed, self.unit,
            self.num_free, self.tables, self.first_live, self.num_computed, self.num_cached, self.shared_len,
            self.num_hashed, self.keys, self.num_passes, self.ways, self.slots, self.block_slot, self.group_of,
            self.cached_in_pass, self.ref, self.nxt, self.prv, self.quiet_start, self.quiet_done,
        )  # fmt: skip
        return np.arange(len(slots)) < num_ok, num_hit, {}

    @property
    def compiled(self) -> bool:
        """Whether an allocation is one compiled loop (`allocate_checked` applies): a prefix cache whose hits end
        at block boundaries, no state groups."""
        return self.prefix is not None and not self.partial and _MAMBA not in self.kind

    def allocate_checked(self, slots, new, hits, must_fit, req_counts, max_model_len) -> tuple[int, int]:
        """A manager's allocation call where `compiled` (`host_step.allocate_checked`): int64[R] slots, new
        tokens and hit tokens, bool[R] whole-request flags; `req_counts`: the manager's int64[S] computed,
        written and total tokens and shared lengths, advanced in place. Returns (rows that succeed, hit
        tokens claimed), or (-1, 0) with nothing changed where a row is invalid."""
        num_ok, num_hit, self.num_free = host_step.allocate_checked(
            slots, new, hits, must_fit, *req_counts, max_model_len, self._rules, self.windowed, self.unit,
            self.num_free, self.tables, self.first_live, self.num_computed, self.num_cached, self.shared_len,
            self.num_hashed, self.keys, self.num_passes + 1, self.ways, self.slots, self.block_slot, self.group_of,
            self.cached_in_pass, self.ref, self.nxt, self.prv, self.quiet_start, self.quiet_done,
        )  # fmt: skip
        if num_ok >= 0:  # the pass ran
            self.num_passes += 1
        return num_ok, num_hit

    def reserve_checked(self, slots, wanted, req_counts, max_model_len) -> tuple[int, np.ndarray]:
        """A device loop's reservation where `compiled` (`host_step.reserve_checked`): int64[R] slots and wanted
        tokens; `req_counts`: the manager's int64[S] computed, written, total and pending tokens. Returns (rows
        that succeed, int64[R] the slots reserved for each), or (-1, ...) with nothing changed where a row is
        invalid or has a rollback pending."""
        reserved = np.zeros(len(slots), np.int64)
        num_ok, self.num_free = host_step.reserve_checked(
            slots, wanted, *req_counts, max_model_len, reserved, self._rules, self.windowed, self.unit,
            self.num_free, self.tables, self.first_live, self.num_computed, self.num_cached, self.shared_len,
            self.num_hashed, self.keys, self.num_passes + 1, self.ways, self.slots, self.block_slot, self.group_of,
            self.cached_in_pass, self.ref, self.nxt, self.prv, self.quiet_start, self.quiet_done,
        )  # fmt: skip
        if num_ok >= 0:  # the pass ran
            self.num_passes += 1
        return num_ok, reserved

    def _allocate_rows(self, slots, num_new_tokens, parts) -> tuple[np.ndarray, int, dict]:
        """`allocate` of every given row; `parts`: its optional arguments after `num_new_tokens`, in order."""
        num_full_tokens, num_hit_tokens, num_prompt_tokens, num_shared_tokens, num_lookahead_tokens = parts
        slots = np.asarray(slots, np.int64)
        num_rows, rules = len(slots), self.group_rules
        k = np.asarray(num_new_tokens, np.int64)
        lookahead = np.zeros(num_rows, np.int64) if num_lookahead_tokens is None else np.asarray(num_lookahead_tokens)
        k = k + lookahead
        caching = self.prefix is not None
        hits = np.zeros(num_rows, np.int64) if num_hit_tokens is None else np.asarray(num_hit_tokens, np.int64)
        n = self.num_computed[slots]
        first_call = n == 0
        start_copies = {}
        if caching:
            if num_prompt_tokens is not None:
                prompt = np.asarray(num_prompt_tokens, np.int64)
                self.prompt_len[slots[prompt > 0]] = prompt[prompt > 0]
            if _MAMBA in self.kind:
                for s in slots.tolist():
                    self._cache_state_blocks(s)
            start_copies = self._register_tails(slots.tolist(), move=True)
        num_free = self.num_free
        hit_ok, claims, tails, taken_free, claimed = self._plan_claims(slots, hits)
        n_eff = np.where(hit_ok, hits, n)
        cow = {}  # row -> groups whose hit ends inside a block and take a fresh block there
        for i, tail_src in tails.items():
            h, bs_of = int(n_eff[i]), self.block_size
            groups = [g for g in tail_src if self.kind[g] == _FULL or h + k[i] <= (h // bs_of[g] + 1) * bs_of[g]]
            if hit_ok[i] and groups:
                cow[i] = groups
        live = self.first_live[slots]
        keep, _, first_new, need = allocation_ranges(n_eff[:, None], k[:, None], live, rules, xp=np)
        need_rows = need.sum(axis=1)
        for i, groups in cow.items():
            need_rows[i] += len(groups)
        hit = hits > 0
        at = np.argwhere((keep > live) & ~hit[:, None])  # [row, group] of each range a row may release
        rows_at, groups_at = at[:, 0], at[:, 1]
        ranges = np.stack([groups_at, slots[rows_at], live[rows_at, groups_at], keep[rows_at, groups_at]], axis=1)
        claimed_mask = np.zeros(len(self.ref), bool)
        claimed_mask[list(claimed)] = True
        sole = pool.count_sole(self.tables, ranges, self.ref, claimed_mask)
        freed = np.bincount(rows_at, sole, minlength=num_rows).astype(np.int64)
        full_need = None
        if num_full_tokens is not None and np.any(num_full_tokens):
            full = np.asarray(num_full_tokens, np.int64)[:, None]
            bs = rules.block_size
            full_need = np.maximum(0, np.minimum(-(-full // bs), rules.max_blocks) - -(-n_eff[:, None] // bs))
            full_need = np.where(full[:, 0] > 0, full_need.sum(axis=1), -1)
        num_ok, gated = _gate(num_free, need_rows + taken_free, taken_free, freed, full_need, hit_ok | ~hit)
        ok = np.arange(num_rows) < num_ok
        # Claims of the rows that succeed, in row order; then releases, new blocks, caching.
        num_hit = int(n_eff[ok & hit_ok].sum())
        for i in np.flatnonzero(ok & hit_ok).tolist():
            self._apply_claim(int(slots[i]), int(n_eff[i]), claims[i], tails[i], cow.get(i, ()))
        releasing = (np.arange(num_rows) < gated) & ~hit
        # A windowed group's blocks from the shared length on leave the index as they are released.
        shared_len = self.shared_len[slots][rows_at] if caching else np.zeros(len(at), np.int64)
        windowed = self.windowed[groups_at]
        evict_from = np.where(windowed & (shared_len > 0), shared_len // rules.block_size[groups_at], -1)
        self._release_ranges(np.concatenate([ranges, evict_from[:, None]], axis=1)[releasing[rows_at]])
        self.first_live[slots[releasing]] = keep[releasing]
        copies = {(slots.tolist().index(s), g): c for (s, g), c in start_copies.items()}
        cow = {i: groups for i, groups in cow.items() if ok[i]}
        for i, groups in cow.items():  # a fresh block where the hit ends, then the new ones
            for g in groups:
                j = int(n_eff[i]) // self.block_size[g]
                need[i, g] += first_new[i, g] - j
                first_new[i, g] = j
        self._take_blocks(slots, ok, need, first_new)
        for i, groups in cow.items():
            for g in groups:
                j = int(n_eff[i]) // self.block_size[g]
                dst = int(self.tables[g, slots[i], j])
                self.ref[dst] += 1
                self.copies[dst] = tails[i][g]
                copies[(i, g)] = (tails[i][g], dst, int(n_eff[i]) - j * self.block_size[g])
        self.num_computed[slots[ok]] = (n_eff + k)[ok]
        if caching:
            if self.partial:
                self._uncache_filled_tails(slots, ok, hit_ok, n_eff, lookahead)
            self._index_filled_rows(slots[ok], np.where(hit_ok, n_eff, -1)[ok], lookahead[ok])
            if num_shared_tokens is not None:
                first = ok & first_call
                self.shared_len[slots[first]] = np.maximum(np.asarray(num_shared_tokens)[first], 0)
        return ok, num_hit, copies

    def _plan_claims(self, slots, hits):
        """The rows' tentative claims, in row order: hit_ok bool[R], {row: runs}, {row: tail sources},
        taken_free int[R] and the blocks claimed (`_plan_claim`)."""
        hit_ok, taken_free = np.zeros(len(slots), bool), np.zeros(len(slots), np.int64)
        claims, tails, claimed = {}, {}, set()
        for i in np.flatnonzero(hits).tolist():
            hit_ok[i], claims[i], tails[i], taken_free[i] = self._plan_claim(int(slots[i]), int(hits[i]), claimed)
        return hit_ok, claims, tails, taken_free, claimed

    def _take_blocks(self, slots, ok, need, first_new) -> None:
        """Pops blocks for entries [first_new, first_new + need) of the ok rows, row by row, group by group."""
        take = np.argwhere((need > 0) & ok[:, None])
        if len(take):
            counts = need[take[:, 0], take[:, 1]]
            blocks = self._pop_many(int(counts.sum()))
            rows = np.repeat(take, counts, axis=0)
            offsets = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
            self.tables[rows[:, 1], slots[rows[:, 0]], first_new[rows[:, 0], rows[:, 1]] + offsets] = blocks

    def _plan_claim(self, s: int, h: int, claimed: set):
        """A row's tentative claim of an h-token hit: (valid, [(group, first index, blocks)], {group: source of
        a hit inside a block}, free blocks it takes); `claimed`: the blocks this call's claims name so far."""
        u, bs_of, runs, tail_src = self.unit, self.block_size, [], {}
        ok_h = (
            self.num_computed[s] == 0
            and h % u == 0
            and h <= self.num_hashed[s] * u
            and all(h % bs_of[g] == 0 or g in self.partial for g in range(self.num_groups))
        )
        if not ok_h:
            return False, runs, tail_src, 0
        indexed = index.probe(self.slots, self.ways, self.keys[s, : h // u])  # [unit, group]
        found = []
        for g in range(self.num_groups):
            step, first, last = bs_of[g] // u, self._keep_from(g, h), h // bs_of[g]
            if last > first:
                blocks = indexed[(first + 1) * step - 1 : last * step : step, g]
                runs.append((g, first, blocks))
                found.append(blocks)
        for g in self.partial:
            if h % bs_of[g]:
                tail_src[g] = int(indexed[h // u - 1, g])
                found.append(indexed[h // u - 1 : h // u, g])
        found = np.concatenate(found) if found else np.zeros(0, np.int32)
        valid = bool(found.all())
        # A claim that misses a block is refused, but its blocks still count as claimed in this call.
        found = found[found != NULL_BLOCK]
        free = found[self.ref[found] == 0].tolist()
        taken = len(free) - sum(map(claimed.__contains__, free)) if claimed else len(free)
        claimed.update(found.tolist())
        tail_src = {g: block for g, block in tail_src.items() if block != NULL_BLOCK}
        return valid, runs, tail_src, taken

    def _apply_claim(self, s: int, h: int, runs, tail_src, cow) -> None:
        for g, first, blocks in runs:
            self.num_free -= pool.claim(np.ascontiguousarray(blocks, np.int32), self.nxt, self.prv, self.ref)
            self.tables[g, s, first : first + len(blocks)] = blocks
        for g, block in tail_src.items():
            self._touch(block)  # a copy's source pin, or the table entry holding it
            if g not in cow:
                self.tables[g, s, h // self.block_size[g]] = block
        self.first_live[s] = keep_from_idx(np.int64(h), self.group_rules, xp=np)
        self.num_computed[s] = h

    def free(self, slots: list[int], num_written: list[int] | None = None) -> None:
        """Releases the slots' blocks, each group tail first. `num_written`: per slot, the tokens a forward
        pass is known to have written (None: all computed); a slot with fewer caches nothing of its last
        step, and its attention blocks from index num_written // block_size on leave the index first."""
        written = [self.num_computed[s] for s in slots] if num_written is None else num_written
        ran = [s for s, w in zip(slots, written) if w >= self.num_computed[s]]
        if self.prefix is not None:
            if _MAMBA in self.kind:
                for s in ran:
                    self._cache_state_blocks(s)
            self._register_tails(ran, move=False)
        rows = np.asarray(slots, np.int64)
        if self.prefix is not None:
            host_step.uncache_unwritten(
                rows, np.asarray(written, np.int64), self.num_computed, self._block_size, self._kind_arrays[0],
                self.tables, self.slots, self.block_slot, self.group_of,
            )  # fmt: skip
        self.num_free += pool.free_slots(
            rows, self.num_computed, self.first_live, self._block_size, self.tables, self.nxt, self.prv, self.ref,
            self.group_of,
        )  # fmt: skip
        if self.prefix is not None:
            self.num_hashed[rows] = 0
            self.shared_len[rows] = self.prompt_len[rows] = self.num_cached[rows] = 0

    def free_checked(self, slots, req_counts) -> bool:
        """A manager's free call where `compiled` (`host_step.free_checked`): int64[R] slots; `req_counts`: the
        manager's int64[S] computed, written and total tokens (zeroed). False, with nothing changed, where a slot
        comes twice."""
        freed = host_step.free_checked(
            slots, *req_counts, self._block_size, self._kind_arrays[0], self.first_live, self.num_computed,
            self.num_cached, self.shared_len, self.num_hashed, self.prompt_len, self.tables, self.slots,
            self.block_slot, self.group_of, self.ref, self.nxt, self.prv,
        )  # fmt: skip
        self.num_free += max(freed, 0)
        return freed >= 0

    def roll_back(self, slots: list[int], num_rejected: list[int]) -> None:
        """Speculative decoding: drops each slot's last `num_rejected` tokens and releases the entries past
        the verified ones, tail first."""
        ranges = []
        for s, r in zip(slots, num_rejected):
            if r == 0:
                continue
            n, end = self.num_computed[s] - r, self.num_computed[s]
            for g in range(self.num_groups):
                bs = self.block_size[g]
                ranges.append((g, s, max(self.first_live[s][g], -(-n // bs)), -(-end // bs), -1))
            self.num_computed[s] = n
            if self.prefix is not None:
                self.quiet_done[s] = -1
        self._release_ranges(ranges)

    # ---- prefix cache --------------------------------------------------------------------------
    def _uncache(self, block: int) -> None:
        """Takes a cached block out of the index."""
        index.uncache(block, self.slots, self.block_slot, self.group_of)

    def set_keys(self, slot: int, keys: np.ndarray, first: int = 0) -> None:
        """The slot's unit keys from unit `first` on: uint32[U, 4] (`UnitHasher.extend`'s)."""
        end = first + len(keys)
        if end > self.keys.shape[1]:
            raise ValueError(f"slot {slot} would have {end} unit keys; the state holds {self.keys.shape[1]} per slot")
        self.keys[slot, first:end] = keys
        self.num_hashed[slot] = end
        self.quiet_done[slot] = -1  # blocks of these keys may wait to be indexed

    def append_keys(self, slots: np.ndarray, counts: np.ndarray, keys: np.ndarray) -> None:
        """`set_keys` after each slot's keys for many: slot `slots[i]` gets the next `counts[i]` of `keys`
        (uint32[K, 4]), in order; int64[R] slots and counts."""
        if not host_step.append_keys(slots, counts, keys, self.keys, self.num_hashed, self.quiet_done):
            raise ValueError(f"a slot of {slots.tolist()} would have more unit keys than the state holds")

    def unit_keys(self, slot: int) -> np.ndarray:
        """uint32[U, 4]: the slot's unit keys."""
        return self.keys[slot, : self.num_hashed[slot]]

    @property
    def index(self) -> dict[int, list[int]]:
        """The index entries: key (a 128-bit int) -> one block per group (NULL_BLOCK: none)."""
        held = self.slots[self.slots[:, COUNT_WORD] != 0]
        return dict(zip(keys_to_ints(held[:, :HASH_WORDS]), held[:, FIELDS:].astype(np.int64).tolist()))

    @index.setter
    def index(self, entries: dict[int, list[int]]) -> None:
        """Replaces the index: each entry takes the first free way of its key's bucket, and its blocks count as
        cached. Raises ValueError where a bucket would hold more than `ways` entries."""
        self.slots[:] = 0
        self.block_slot[:] = NOT_INDEXED
        self.group_of[:] = -1
        for key, blocks in entries.items():
            fields = {g: block for g, block in enumerate(blocks) if block != NULL_BLOCK}
            word = ints_to_keys([key])[0]
            self._cache(word, fields)
            if fields and index.find(self.slots, self.ways, word) < 0:
                bucket = int(word[0]) & (self.num_buckets - 1)
                raise ValueError(f"index bucket {bucket} is full: it holds ways={self.ways} entries")

    def _cache(self, key: np.ndarray, fields: dict[int, int]) -> None:
        """Indexes the blocks `fields` {group: block} under `key` (uint32[4]) where its entry and bucket have room."""
        groups = np.fromiter(fields, np.int64, len(fields))
        blocks = np.fromiter(fields.values(), np.int32, len(fields))
        index.cache(key, groups, blocks, False, 0, self.ways, self.slots, self.block_slot, self.group_of,
                    self.cached_in_pass, self.ref, self.nxt, self.prv)  # fmt: skip

    def release_copies(self, dsts) -> None:
        """The copies into `dsts` were applied: source, then destination, drop their pins."""
        for d in dict.fromkeys(dsts):
            if d in self.copies:
                self._release_blocks([self.copies.pop(d), d])

    def _tail_of(self, s: int) -> int:
        """p*: the prompt tail's final unit boundary of slot s (0: no prompt length)."""
        u, prompt_len = self.unit, self.prompt_len[s]
        return min((prompt_len - 1) // u, self.num_hashed[s]) * u if prompt_len > 0 else 0

    def _register_tails(self, slots, move: bool) -> dict:
        """Indexes the slots' prompt-tail blocks; at a call's start a state block's owner moves to a fresh
        block with a pinned copy. Returns {(slot, group): (source, destination, valid tokens)}."""
        if not self.partial:
            return {}
        num_free, num_moving, moves = self.num_free, 0, []
        for s in slots:
            n, tail = self.num_computed[s], self._tail_of(s)
            if tail == 0:
                continue
            fields = {}
            for g in self.partial:
                bs = self.block_size[g]
                j = tail // bs
                block = int(self.tables[g, s, j])
                if tail % bs == 0 or block == NULL_BLOCK or self.group_of[block] >= 0:
                    continue
                if self.kind[g] == _FULL and n >= tail and (j + 1) * bs > n:
                    fields[g] = block
                elif self.kind[g] == _MAMBA and n == tail:
                    if move:
                        num_moving += 1
                        if num_moving > num_free:
                            continue
                    fields[g] = block
            if fields:
                self._cache(self.keys[s, tail // self.unit - 1], fields)
                moves += [
                    (s, g)
                    for g, block in fields.items()
                    if move and self.kind[g] == _MAMBA and self.group_of[block] == g
                ]
        copies = {}
        for s, g in moves:
            tail, bs = self._tail_of(s), self.block_size[g]
            src, dst = int(self.tables[g, s, tail // bs]), int(self._pop_many(1)[0])
            self.tables[g, s, tail // bs] = dst
            self.ref[dst] += 1
            self.copies[dst] = src
            copies[(s, g)] = (src, dst, tail - tail // bs * bs)
        return copies

    def _cache_state_blocks(self, s: int) -> None:
        n = self.num_computed[s]
        if n == 0 or n % self.unit or n // self.unit > self.num_hashed[s]:
            return
        fields = {}
        for g in range(self.num_groups):
            bs = self.block_size[g]
            if self.kind[g] == _MAMBA and n % bs == 0:
                block = int(self.tables[g, s, n // bs - 1])
                if block != NULL_BLOCK and self.group_of[block] < 0:
                    fields[g] = block
        if fields:
            self._cache(self.keys[s, n // self.unit - 1], fields)

    def lookup(self, keys: np.ndarray, num_tokens: int, drop_last_block: bool = False) -> tuple[int, int]:
        """The hit for a request with unit keys `keys` (uint32[U, 4]) and `num_tokens` tokens (vLLM's fixed
        point) and its shared length (the full-attention groups' own longest hit); `drop_last_block`: vLLM's
        EAGLE rule (`jaxkv.prefix.state.lookup`)."""
        keys = np.require(keys, np.uint32, ["C", "W"])  # a copy only where read-only or strided
        hit, shared = self._lookup(keys, num_tokens, None)
        if drop_last_block and hit:
            hit = self._lookup(keys, num_tokens, hit - max(self.block_size))[0]
        return hit, shared

    def lookup_rows(self, slots: np.ndarray, num_tokens: np.ndarray, drop_last_block: bool, hits: np.ndarray,
                    shared_len: np.ndarray) -> tuple[int, int, int, int]:  # fmt: skip
        """`lookup` of each slot's own unit keys (`set_keys`) and its tokens `num_tokens[slot]` (int64[S]): row
        i's hit into `hits[i]`, its shared length into `shared_len[slot]` (int64 arrays). Returns the rows with
        a unit key, their tokens, hit tokens and shared tokens past the hit. One compiled call where hits end at
        block boundaries."""
        if not self.partial:
            return index.lookup_rows(
                slots, num_tokens, self.keys, self.num_hashed, self.unit, max(self.block_size), drop_last_block,
                self.slots, self.ways, *self._kind_arrays, hits, shared_len,
            )  # fmt: skip
        stats = np.zeros(4, np.int64)
        for i, s in enumerate(slots.tolist()):
            hits[i], shared_len[s] = self.lookup(self.unit_keys(s), int(num_tokens[s]), drop_last_block)
            if self.num_hashed[s]:
                stats += 1, num_tokens[s], hits[i], shared_len[s] - hits[i]
        return tuple(stats.tolist())

    def _lookup(self, keys: np.ndarray, num_tokens: int, max_hit: int | None) -> tuple[int, int]:
        u = self.unit
        bound = min(max(num_tokens - 1, 0), len(keys) * u)
        if max_hit is not None:
            if max_hit <= 0:
                return 0, 0
            num_tokens, bound = max_hit + 1, min(bound, max_hit)
        if not self.partial:  # vLLM's fixed point
            return index.lookup(self.slots, self.ways, keys, num_tokens, bound, *self._kind_arrays)
        indexed = index.probe(self.slots, self.ways, keys[: bound // u])  # [unit, group]
        # Per group, whether each block (ending at unit (j + 1) · step − 1) is indexed.
        cached = [(indexed[step - 1 :: step, g] != NULL_BLOCK).tolist() for g, step in enumerate(self.step.tolist())]
        full = [g for g in range(self.num_groups) if self.kind[g] == _FULL]
        rules = self.rules

        def valid(g: int, h: int) -> bool:
            bs = self.block_size[g]
            keyed = indexed[h // u - 1, g] != NULL_BLOCK
            if g in self.partial and self.kind[g] == _MAMBA:
                return keyed
            if g in self.partial:
                return all(cached[g][: h // bs]) and (h % bs == 0 or keyed)
            return h % bs == 0 and hit_blocks_reference(rules[g], cached[g], h // bs) == h // bs

        grid = range(bound // u * u, 0, -u)
        hit = next((h for h in grid if all(valid(g, h) for g in range(self.num_groups))), 0)
        own = [next((h for h in grid if valid(g, h)), 0) for g in full]
        return hit, max(own, default=hit)

    def _uncache_filled_tails(self, slots, ok, hit_ok, n_eff, lookahead) -> None:
        """A partially indexed tail block that the scheduled tokens fill leaves the index."""
        for i, s in enumerate(slots):
            if not ok[i]:
                continue
            tail = self._tail_of(s)
            hashed_len = min(self.num_hashed[s] * self.unit, self.num_computed[s] - lookahead[i])
            for g in self.partial:
                bs = self.block_size[g]
                j = tail // bs
                start = n_eff[i] // bs if hit_ok[i] else self.num_cached[s][g]
                block = int(self.tables[g, s, j])
                if (
                    self.kind[g] == _FULL
                    and tail % bs
                    and block != NULL_BLOCK
                    and j >= start
                    and (j + 1) * bs <= min(self.num_computed[s], hashed_len)
                    and self.group_of[block] >= 0
                ):
                    self._uncache(block)

    def _index_filled_rows(self, slots, hit_start, lookahead) -> None:
        """Indexes the rows' blocks whose tokens are all scheduled, row by row: one entry per block-end unit,
        in unit order, holding the groups' blocks that end there (`hit_start`: a claimed hit's length, or
        -1). The rows' cached counts follow. One caching pass (`host_index.index_rows`)."""
        if not len(slots):
            return
        u, bs = self.unit, self.group_rules.block_size
        n = self.num_computed[slots]
        end = np.minimum(np.minimum(self.num_hashed[slots] * u, n - lookahead), n)[:, None] // bs
        start = np.where(hit_start[:, None] >= 0, hit_start[:, None] // bs, self.num_cached[slots])
        attention = self.group_rules.kind != MAMBA
        end = np.where(attention, end, 0).astype(np.int64)
        self.num_passes += 1
        index.index_rows(np.asarray(slots, np.int64), start, end, self.step, self.tables, self.keys,
                         self.num_passes, self.ways, self.slots, self.block_slot, self.group_of, self.cached_in_pass,
                         self.ref, self.nxt, self.prv)  # fmt: skip
        self.num_cached[slots] = np.where(attention, np.maximum(start, end), self.num_cached[slots])
