"""What the manager and its engines share: the requests' counts, and the interface each engine implements.

Dimensions: S state slots (`max_num_seqs`), R rows of one call, G groups, M table entries per request,
U unit keys, C block copies.

`KVCacheManager` keeps the requests (ids, slots, counts, hashers), validates every call and raises the errors;
its engine keeps the block state (pool, tables, prefix index) and applies the transitions. The manager calls
an engine only with checked arguments and never asks which engine it holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from jaxkv.core.state import ManagerState
from jaxkv.core.step import StepWork


@dataclasses.dataclass(eq=False)
class RequestCounts:
    """Per state slot, int64[S] each, owned by the manager; an engine reads them, and writes where its call
    says so (`Engine.allocate_fast` and `Engine.free_fast` advance or zero them in place).

    num_tokens: prompt plus appended tokens; num_prompt: prompt tokens; num_computed: tokens given slots
    (verified ones: rejected drafts are in `pending_reject`); num_scheduled: tokens the last allocation
    scheduled; num_written: tokens a forward pass is known to have written (up to the last `mark_computed`, or
    the start of the last allocation); shared_len: the last lookup's shared length; num_hashed_tokens: tokens
    the slot's hasher has taken; pending_reject: tokens past `num_computed` that the engine still counts
    (rejected drafts, the last call's lookahead slots), rolled back at the slot's next allocation; num_drafts:
    the last allocation's draft tokens not rejected yet; lookahead: its lookahead slots.
    """

    num_tokens: np.ndarray
    num_prompt: np.ndarray
    num_computed: np.ndarray
    num_scheduled: np.ndarray
    num_written: np.ndarray
    shared_len: np.ndarray
    num_hashed_tokens: np.ndarray
    pending_reject: np.ndarray
    num_drafts: np.ndarray
    lookahead: np.ndarray

    @classmethod
    def zeros(cls, num_slots: int) -> RequestCounts:
        return cls(*(np.zeros(num_slots, np.int64) for _ in dataclasses.fields(cls)))


class Engine(Protocol):
    """The block state behind a `KVCacheManager`: `HostEngine` (in place, the default) or `JaxEngine` (jitted).

    Made as `Engine(cfg, prefix, counts, *, max_num_seqs, use_eagle, speculating, specialize_steps, device,
    debug_checks)`, each engine taking what applies to it. Slots are int64[R] or int32[R] arrays of distinct
    live slots unless a method says otherwise; every count was checked by the manager.
    """

    checks_counts: bool  # whether `allocate_fast` checks the counts' ranges itself (the manager skips that)
    last_work: StepWork | None  # the last allocation's compiled work signature (None: no dispatch)
    step_variants: dict[StepWork, int]  # work signatures dispatched, and how many steps ran each

    def set_keys(self, slot: int, keys: np.ndarray) -> None:
        """A new request's unit keys, uint32[U, 4]."""

    def append_keys(self, slots: np.ndarray, counts: np.ndarray, keys: np.ndarray) -> None:
        """Slot `slots[i]` gets its next `counts[i]` unit keys, the next rows of `keys` (uint32[K, 4])."""

    def lookup(self, slots: np.ndarray, drop_last_block: bool) -> tuple[np.ndarray, tuple[int, int, int, int]]:
        """The rows' prefix hits int64[R] (changes nothing but `RequestCounts.shared_len`), and the stats:
        lookups, tokens looked up, hit tokens, reconciliation misses."""

    def allocate_fast(self, slots, num_new, hits, must_fit, release: list[int]) -> tuple[int, int, np.ndarray] | None:
        """A whole allocation call in one compiled call, its checks and the counts' updates included, after the
        pins of taken copies in `release` (emptied) drop: (rows that succeed, hit tokens claimed, the copies made
        int32[C, 3]); None, with nothing changed, where the engine has no such call for it or a row is invalid
        or has a rollback pending (the manager's general path then rolls back, or names what is wrong)."""

    def allocate(self, slots, num_new, hits, full, lookahead, release: list[int]) -> tuple[np.ndarray, int, np.ndarray]:
        """vLLM's sequential allocation of checked rows: ok bool[R], hit tokens claimed, the copies made
        int32[C, 3]. Rolls back the rows' `pending_reject` first and releases pins of taken copies from the front
        of `release` (deleting those it released). The manager advances the counts after it."""

    def reserve_fast(self, slots, wanted, release: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """A device loop's reservation (`KVCacheManager.hand_over`) in one compiled call, its checks and the
        counts' updates included, `release` as for `allocate_fast`: (ok bool[R], the slots reserved int64[R], the
        copies made int32[C, 3]); None, with nothing changed, where
        the engine has no such call for it or a row is invalid or has a rollback pending (the manager's general
        path then rolls back, or names what is wrong)."""

    def free_fast(self, slots: np.ndarray) -> bool:
        """A whole free call in one compiled call, its counts zeroed; False, with nothing changed, where the
        engine has no such call for it or a slot comes twice."""

    def free(self, slots: np.ndarray, counts: np.ndarray, written: np.ndarray) -> None:
        """Releases the slots' blocks: int64[R] tokens each holds (verified plus pending rollbacks) and tokens
        known to be written (a slot with fewer leaves nothing of its last step findable)."""

    def block_table(self, slot: int) -> np.ndarray:
        """int32[G, M]: the slot's block tables."""

    def rows_tables(self, slots: np.ndarray, width: int):
        """int32[G, R, width]: the slots' block tables, their first `width` entries."""

    def tables_state(self) -> ManagerState:
        """A ManagerState holding at least the block tables and counts (what the model-facing reads take)."""

    @property
    def num_free_blocks(self) -> int: ...

    def to_state(self) -> ManagerState:
        """The whole state as the jitted transitions take it (pending work applied first)."""

    def take(self) -> None:
        """The state was handed to a jitted loop (after `to_state`): drop what the loop will donate."""

    def adopt(self, state: ManagerState, slots: np.ndarray, keys: dict[int, np.ndarray]) -> None:
        """Takes back a state a loop advanced for `slots`; `keys`: every live slot's unit keys."""

    def warm_up(self, variants: Iterable[StepWork]) -> None:
        """Compiles what the engine's calls need (nothing, where they are compiled ahead of time)."""

    def check(self) -> None:
        """Checks DESIGN.md's invariants if the engine was made with debug checks."""
