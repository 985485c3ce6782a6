"""The manager state held on the host and updated in place: the host engine behind `KVCacheManager`.

The same transitions as `jaxkv.core.step.allocate_step` and `jaxkv.core.state._free`, with the same outcome
bit for bit (block ids, free order, index entries, copies), every call one compiled (numba) call
(`jaxkv.core.host_step`, `host_calls`, `host_tails`): a step costs its rows and the blocks it takes, releases
and indexes, not the padded shapes of a compiled program. `jaxkv.core.host_convert.to_state` gives the equal
`ManagerState` (for jitted loops), `load_state` takes one back.

Structures (N blocks, S slots, G groups, M table entries per request, U unit keys per slot): numpy arrays,
updated in place, handed to the compiled calls as `jaxkv.core.host_types`' structures (built once: an array is
never replaced):
* the pool (`jaxkv.core.host_pool`): `ref`, `group_of` (cached group, -1), the free order (`nxt`, `prv`: a
  linked list), and the pending copies' sources (`copies`);
* block tables: int32[G, S, M] (`tables`);
* the index (`jaxkv.core.host_index`): the device index's `slots` and `block_slot`, so that it holds
  exactly what the device's does, and each slot's unit keys (`keys`, uint32[S, U, 4]; `num_hashed`);
* `index` shows the entries with keys as 128-bit ints, `w0 | w1 << 32 | w2 << 64 | w3 << 96` of the
  uint32 words.
Without a prefix cache the index and keys are empty and never read.
"""

from __future__ import annotations

import numpy as np

from jaxkv.core import host_calls as calls
from jaxkv.core import host_index as index
from jaxkv.core import host_pool as pool
from jaxkv.core import host_step, host_types
from jaxkv.core.host_types import Rows
from jaxkv.core.pool import HASH_WORDS
from jaxkv.core.state import CHUNKED_LOCAL, MAMBA, SLIDING_WINDOW, group_rules, max_blocks_per_request
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.index import COUNT_WORD, FIELDS, NOT_INDEXED, num_buckets_for
from jaxkv.prefix.state import PrefixCacheConfig, num_index_entries, partial_groups


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


def _rows(num_rows: int, **given) -> Rows:
    """A call's `Rows`: the given int[R] fields, zeros for the others."""
    buf = np.zeros((len(Rows._fields), num_rows), np.int64)
    for name, values in given.items():
        if values is not None:
            buf[Rows._fields.index(name)] = values
    return Rows(*buf)


def _copies_dict(copies: np.ndarray) -> dict:
    """{(row, group): (source, destination, valid tokens)} of int64[C, 5] copies."""
    return {(row, g): (src, dst, valid) for row, g, src, dst, valid in copies.tolist()}


_NO_COPIES = np.zeros((0, 3), np.int32)
_NO_COPIES.flags.writeable = False


def sorted_copies(copies: np.ndarray) -> np.ndarray:
    """int32[C, 3] (source, destination, valid tokens) of int64[C, 5] copies, by row, then group."""
    if not len(copies):
        return _NO_COPIES
    copies = copies.reshape(-1, 5)
    return copies[np.lexsort((copies[:, 1], copies[:, 0])), 2:].astype(np.int32)


class HostState:
    """The state of one manager, in place (see the module docstring)."""

    def __init__(self, cfg: KVCacheConfig, max_num_seqs: int, prefix: PrefixCacheConfig | None = None):
        self.cfg, self.prefix, self.max_num_seqs = cfg, prefix, max_num_seqs
        self.num_groups = num_groups = len(cfg.groups)
        rules = group_rules(cfg)
        self.windowed = np.isin(rules.kind, (SLIDING_WINDOW, CHUNKED_LOCAL))
        self.partial = list(partial_groups(cfg, prefix)) if prefix is not None else []
        self.unit = prefix.unit if prefix is not None else 1
        self.ways = prefix.ways if prefix is not None else 1
        has_state = bool((rules.kind == MAMBA).any())

        def column(values, dtype=np.int64):
            return np.ascontiguousarray(values, dtype)

        kind = rules.kind
        window = np.where(kind == SLIDING_WINDOW, rules.window, np.where(kind == CHUNKED_LOCAL, rules.chunk, 0))
        self._rules = host_types.rules(
            *(column(x) for x in (rules.block_size, rules.max_blocks, rules.keep_offset, rules.keep_unit,
                                  rules.keep_scale, rules.keep_div, rules.block_size // self.unit)),
            column(rules.kind), column(window), column(self.windowed, np.bool_),
            column(np.isin(np.arange(num_groups), self.partial), np.bool_), self.unit, self.ways, prefix is not None,
            has_state, bool(self.partial), not (has_state or self.partial),
        )  # fmt: skip
        n = cfg.num_blocks
        # Per block: ref, group_of, nxt, prv, block_slot, cached_in_pass and copy_src, views of one array's columns.
        self._block_fields = pool.new_pool(n)
        self.ref, self.group_of, self.nxt, self.prv, self.block_slot, self.cached_in_pass, self._copy_src = (
            self._block_fields[:, i] for i in range(7)
        )
        self.block_slot[:] = NOT_INDEXED
        self._counts = np.array([n - 1, 0], np.int64)  # free blocks, caching passes so far
        self._pool = host_types.pool(self.ref, self.group_of, self.nxt, self.prv, self.block_slot, self.cached_in_pass,
                          self._copy_src, self._counts)  # fmt: skip
        self.num_buckets = num_buckets_for(num_index_entries(cfg), prefix.ways) if prefix is not None else 1
        self.slots = np.zeros((self.num_buckets * self.ways, FIELDS + num_groups), np.uint32)
        num_units = prefix.num_units(cfg) if prefix is not None else 0

        def per_slot(*shape):
            return np.zeros((max_num_seqs, *shape), np.int64)

        self.tables = np.zeros((num_groups, max_num_seqs, max_blocks_per_request(cfg)), np.int32)
        self.first_live, self.num_computed, self.num_cached = per_slot(num_groups), per_slot(), per_slot(num_groups)
        self.shared_len, self.prompt_len, self.num_hashed = per_slot(), per_slot(), per_slot()
        self.keys = np.zeros((max_num_seqs, num_units, HASH_WORDS), np.uint32)
        # Per slot, bounds within which an allocation of it only advances its count (`host_step._set_quiet`;
        # -1: unknown, the next allocation finds them).
        self.quiet_start, self.quiet_done = np.full(max_num_seqs, -1, np.int64), np.full(max_num_seqs, -1, np.int64)
        self._requests = host_types.requests(
            self.tables, self.first_live, self.num_computed, self.num_cached, self.shared_len, self.prompt_len,
            self.num_hashed, self.keys, self.quiet_start, self.quiet_done,
        )  # fmt: skip

    # ---- pool ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return int(self._counts[0])

    def free_order(self) -> list[int]:
        """The free blocks, first popped first."""
        return pool.free_order(self.nxt, self.num_free).tolist()

    def set_free_order(self, order) -> None:
        """Makes `order` (first popped first) the free blocks; their counts must be 0."""
        pool.set_order(self.nxt, self.prv, order)
        self._counts[0] = len(order)

    @property
    def copies(self) -> dict[int, int]:
        """The pending copies: destination -> source (both pinned until `release_copies`)."""
        dsts = np.flatnonzero(self._copy_src)
        return dict(zip(dsts.tolist(), self._copy_src[dsts].tolist()))

    @copies.setter
    def copies(self, copies: dict[int, int]) -> None:
        self._copy_src[:] = 0
        for dst, src in copies.items():
            self._copy_src[dst] = src

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
        """vLLM's sequential outcome (`jaxkv.core.step`), for int[R] rows (`host_step.allocate`): returns the ok
        flags bool[R], the hit tokens claimed and the copies {(row, group): (source, destination, valid
        tokens)}."""
        slots = np.ascontiguousarray(slots, np.int64)
        new = np.asarray(num_new_tokens, np.int64)
        if num_lookahead_tokens is not None:
            new = new + np.asarray(num_lookahead_tokens, np.int64)
        rows = _rows(len(slots), slot=slots, new=new, lookahead=num_lookahead_tokens, hit=num_hit_tokens,
                     full=num_full_tokens, shared=num_shared_tokens, prompt=num_prompt_tokens)  # fmt: skip
        copies = np.empty((2 * len(slots) * self.num_groups, 5), np.int64)
        num_ok, num_hit, num_copies = host_step.allocate(
            rows, num_shared_tokens is not None, self._rules, self._pool, self.slots, self._requests, copies
        )
        return np.arange(len(slots)) < num_ok, num_hit, _copies_dict(copies[:num_copies])

    def allocate_checked(self, slots, new, hits, must_fit, counts, max_model_len, release: list[int]):
        """A manager's allocation call (`host_calls.allocate_checked`): int64[R] slots, new tokens and hit
        tokens, bool[R] whole-request flags; `counts`: the manager's (`host_types.counts`), advanced in place; the
        copies into `release` were applied (emptied where the call runs). Returns (rows that succeed, hit tokens
        claimed, int32[C, 3] copies: `sorted_copies`), or (-1, 0, None) with nothing changed where a row is
        invalid."""
        copies = np.empty((2 * len(slots) * self.num_groups, 5), np.int64)
        num_ok, num_hit, num_copies = calls.allocate_checked(
            slots, new, hits, must_fit, counts, max_model_len, np.array(release, np.int64), self._rules, self._pool,
            self.slots, self._requests, copies,
        )  # fmt: skip
        if num_ok < 0:
            return num_ok, 0, None
        release.clear()
        return num_ok, num_hit, sorted_copies(copies[:num_copies])

    def reserve_checked(self, slots, wanted, counts, max_model_len, release: list[int]):
        """A device loop's reservation (`host_calls.reserve_checked`): int64[R] slots and wanted tokens;
        `counts` and `release` as for `allocate_checked`. Returns (rows that succeed, int64[R] the slots reserved
        for each, int32[C, 3] copies), or (-1, ...) with nothing changed where a row is invalid or has a rollback
        pending."""
        reserved = np.zeros(len(slots), np.int64)
        copies = np.empty((2 * len(slots) * self.num_groups, 5), np.int64)
        num_ok, num_copies = calls.reserve_checked(
            slots, wanted, counts, max_model_len, np.array(release, np.int64), reserved, self._rules, self._pool,
            self.slots, self._requests, copies,
        )  # fmt: skip
        if num_ok >= 0:
            release.clear()
        return num_ok, reserved, sorted_copies(copies[:num_copies])

    def free(self, slots, num_written=None) -> None:
        """Releases the slots' blocks, each group tail first. `num_written`: per slot, the tokens a forward
        pass is known to have written (None: all computed); a slot with fewer caches nothing of its last
        step, and its attention blocks from index num_written // block_size on leave the index first."""
        rows = np.ascontiguousarray(slots, np.int64)
        written = self.num_computed[rows] if num_written is None else np.ascontiguousarray(num_written, np.int64)
        calls.free(rows, written, self._rules, self._pool, self.slots, self._requests)

    def free_checked(self, slots, counts) -> bool:
        """A manager's free call (`host_calls.free_checked`): int64[R] slots; `counts`: the manager's (computed
        and tokens zeroed). False, with nothing changed, where a slot comes twice or has a rollback pending."""
        return calls.free_checked(slots, counts, self._rules, self._pool, self.slots, self._requests)

    def roll_back(self, slots, num_rejected) -> None:
        """Speculative decoding: drops each slot's last `num_rejected` tokens and releases the entries past
        the verified ones, tail first."""
        rows, rejected = np.ascontiguousarray(slots, np.int64), np.ascontiguousarray(num_rejected, np.int64)
        calls.roll_back(rows, rejected, self._rules, self._pool, self._requests)

    def release_copies(self, dsts) -> None:
        """The copies into `dsts` were applied: source, then destination, drop their pins."""
        calls.release_copies(np.ascontiguousarray(dsts, np.int64), self._pool)

    # ---- prefix cache --------------------------------------------------------------------------
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
        if not calls.append_keys(slots, counts, keys, self._requests):
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

    def lookup(self, keys: np.ndarray, num_tokens: int, drop_last_block: bool = False) -> tuple[int, int]:
        """The hit for a request with unit keys `keys` (uint32[U, 4]) and `num_tokens` tokens (vLLM's fixed
        point, or the longest valid unit where hits may end inside blocks) and its shared length (the
        full-attention groups' own longest hit); `drop_last_block`: vLLM's EAGLE rule
        (`jaxkv.prefix.state.lookup`)."""
        keys = np.require(keys, np.uint32, ["C", "W"]).reshape(-1, HASH_WORDS)  # a copy only where needed
        max_block_size = max(g.block_size for g in self.cfg.groups)
        hit, shared = calls.lookup_one(self.slots, keys, num_tokens, -1, self._rules)
        if drop_last_block and hit:
            hit = calls.lookup_one(self.slots, keys, num_tokens, max(hit - max_block_size, 0), self._rules)[0]
        return hit, shared

    def lookup_rows(self, slots: np.ndarray, num_tokens: np.ndarray, drop_last_block: bool, hits: np.ndarray,
                    shared_len: np.ndarray) -> tuple[int, int, int, int]:  # fmt: skip
        """`lookup` of each slot's own unit keys (`set_keys`) and its tokens `num_tokens[slot]` (int64[S]): row
        i's hit into `hits[i]`, its shared length into `shared_len[slot]` (int64 arrays). Returns the rows with
        a unit key, their tokens, hit tokens and shared tokens past the hit."""
        return calls.lookup_rows(slots, num_tokens, drop_last_block, self._rules, self.slots, self._requests, hits,
                                 shared_len)  # fmt: skip
