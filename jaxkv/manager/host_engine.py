"""The host engine behind `KVCacheManager` (the default): the state in host memory, updated in place by
`jaxkv.core.host.HostState`, every call compiled (numba); the manager's common calls one compiled call each,
their checks and counts included.

Dimensions: R rows of one call, S slots, G groups, M max blocks per request.
"""

from __future__ import annotations

from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np

from jaxkv.core import host_types
from jaxkv.core import state as st
from jaxkv.core.host import HostState, sorted_copies
from jaxkv.core.host_convert import load_state, to_state
from jaxkv.core.invariants import check_invariants
from jaxkv.core.step import StepWork
from jaxkv.manager.engine import RequestCounts
from jaxkv.planner.config import KVCacheConfig
from jaxkv.prefix.state import PrefixCacheConfig, partial_groups


class HostEngine:
    """The `jaxkv.manager.engine.Engine` over a `HostState`: every call applies at once (nothing is deferred)
    and nothing is compiled per shape. Its state converts to a `ManagerState` (`to_state`) for a jitted loop.
    `specialize_steps` and `device` do not apply (they are the jitted engine's)."""

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
        device,
        debug_checks: bool,
    ):
        self.cfg, self.prefix, self.counts = cfg, prefix, counts
        self.debug_checks, self.use_eagle = debug_checks, use_eagle
        self._host = HostState(cfg, max_num_seqs, prefix)
        self._tails = prefix is not None and bool(partial_groups(cfg, prefix))
        # Allocations, reservations and frees as one compiled call each, their checks and the counts included
        # (speculative decoding's allocations take `allocate`: its drafts' counts are the manager's).
        self.checks_counts = not speculating
        c = counts
        self._req_counts = host_types.counts(
            c.num_computed, c.num_written, c.num_tokens, c.shared_len, c.pending_reject, c.num_prompt
        )
        self.step_variants: dict[StepWork, int] = {}  # nothing is compiled per signature
        self.last_work: StepWork | None = None

    def set_keys(self, slot: int, keys: np.ndarray) -> None:
        self._host.set_keys(slot, keys)

    def append_keys(self, slots: np.ndarray, counts: np.ndarray, keys: np.ndarray) -> None:
        self._host.append_keys(slots, counts, keys)

    def lookup(self, slots: np.ndarray, drop_last_block: bool) -> tuple[np.ndarray, tuple[int, int, int, int]]:
        hits = np.empty(len(slots), np.int64)
        stats = self._host.lookup_rows(
            slots.astype(np.int64), self.counts.num_tokens, drop_last_block, hits, self.counts.shared_len
        )
        return hits, tuple(stats)

    def allocate_fast(self, slots, num_new, hits, must_fit, release: list[int]) -> tuple[int, int, np.ndarray] | None:
        if not self.checks_counts:
            return None
        num_ok, num_hit, copies = self._host.allocate_checked(
            slots, num_new, hits, must_fit, self._req_counts, self.cfg.max_model_len, release
        )
        if num_ok < 0:
            return None
        self.check()
        return num_ok, num_hit, copies

    def allocate(self, slots, num_new, hits, full, lookahead, release: list[int]) -> tuple[np.ndarray, int, np.ndarray]:
        host, counts = self._host, self.counts
        pending = counts.pending_reject[slots]
        if pending.any():  # rejected drafts and the last call's lookahead slots
            host.roll_back(slots, pending)
            counts.pending_reject[slots] = 0
        if release:
            host.release_copies(release)
            release.clear()
        caching = self.prefix is not None
        first = counts.num_computed[slots] == 0  # a first call records the last lookup's shared length
        ok, num_hit, copies = host.allocate(
            slots,
            num_new,
            full if full.any() else None,
            hits if caching else None,
            counts.num_prompt[slots] if self._tails else None,
            np.where(first, counts.shared_len[slots], 0) if caching and first.any() else None,
            lookahead if lookahead.any() else None,
        )
        self.check()
        return ok, num_hit, sorted_copies(np.array([(*key, *copy) for key, copy in copies.items()], np.int64))

    def reserve_fast(self, slots, wanted, release: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if not self.checks_counts:
            return None
        num_ok, reserved, copies = self._host.reserve_checked(
            slots, wanted, self._req_counts, self.cfg.max_model_len, release
        )
        if num_ok < 0:
            return None
        self.check()
        return np.arange(len(slots)) < num_ok, reserved, copies

    def free_fast(self, slots: np.ndarray) -> bool:
        if not self.checks_counts or not self._host.free_checked(slots, self._req_counts):
            return False
        self.check()
        return True

    def free(self, slots: np.ndarray, counts: np.ndarray, written: np.ndarray) -> None:
        self._host.free(slots, written)
        self.check()

    def block_table(self, slot: int) -> np.ndarray:
        return self._host.tables[:, slot, :]

    def rows_tables(self, slots: np.ndarray, width: int) -> np.ndarray:
        return self._host.tables[:, slots, :width]

    def tables_state(self) -> st.ManagerState:
        return st.ManagerState(
            pool=None,
            block_tables=jnp.asarray(self._host.tables),
            first_live_idx=None,
            num_computed=jnp.asarray(self._host.num_computed, jnp.int32),
            prefix=None,
        )

    @property
    def num_free_blocks(self) -> int:
        return self._host.num_free

    def to_state(self) -> st.ManagerState:
        return to_state(self._host)

    def take(self) -> None:
        pass  # the host state stays; the loop's result replaces it (`adopt`)

    def adopt(self, state: st.ManagerState, slots: np.ndarray, keys: dict[int, np.ndarray]) -> None:
        load_state(self._host, state)
        for slot, slot_keys in keys.items():
            self._host.set_keys(slot, slot_keys)

    def warm_up(self, variants: Iterable[StepWork] = ()) -> None:
        pass  # the loops are compiled ahead of time (numba, cached on disk)

    def check(self) -> None:
        if self.debug_checks:
            check_invariants(self.cfg, to_state(self._host), self.prefix)
