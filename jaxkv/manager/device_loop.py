"""What a device loop of decode steps gets from a `KVCacheManager` (`hand_over`) and gives back (`hand_back`).

Dimensions: R requests the loop serves, P rows of the loop (R plus padding), G groups, W table entries handed
over (a power of two: few loop shapes).

The host reserves each request's slots for the loop's steps in one allocation, as vLLM's multi-step scheduler
reserved lookahead slots, and hands over only the requests' block tables and counts (`LoopRows`): the loop
allocates nothing, so it needs neither the pool nor the prefix index. After the loop, the host counts the tokens it
computed; the rest of the reservation goes back and the blocks the loop filled are indexed in one allocation,
the next call's (within the next loop's reservation when loops follow each other).
A request's slots are reserved by position: a rejected draft's slot takes the next token, as on the host.

`HandOver` holds `KVCacheManager`'s calls that hand its state, or a loop's rows, to a jitted program and take
them back: `take_state` / `adopt_state` (the whole state, for a loop that allocates inside jit) and `hand_over`
/ `hand_back`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from jaxkv import validation
from jaxkv.core import state as st
from jaxkv.planner.specs import cdiv


class LoopRows(NamedTuple):
    """The requests `KVCacheManager.hand_over` reserved slots for, in its order, padded to P rows: numpy arrays,
    which the loop's jitted call moves to its device with its other arguments (cheaper than a `device_put`
    of each).

    state:        a `ManagerState` holding only block_tables int32[G, P, W] and num_computed int32[P] (the rows'
                  computed tokens; padding rows 0): give `jaxkv.step_metadata` this state with num_computed
                  replaced by each row's count after the step's tokens, and `req_slots`
    req_slots:    int32[P]: row i's slot in `state`, i; padding rows P
    num_reserved: int32[P]: tokens each row may compute in the loop, from its computed count on (its next
                  token, the tokens it samples and drafts); padding rows 0
    """

    state: st.ManagerState
    req_slots: np.ndarray
    num_reserved: np.ndarray


def reservation(max_model_len: int, state_block_sizes, num_computed: np.ndarray, num_wanted: np.ndarray) -> np.ndarray:
    """int64[R]: the slots to reserve for decoding rows of `num_computed` int64[R] tokens (and one more not
    computed) asking for `num_wanted` int64[R]: at most the tokens each may still produce (each computed
    token gives one, up to `max_model_len`), and with state groups (`state_block_sizes`, their distinct block
    sizes) up to the end of the row's state block, so that the loop never passes a block end (the state saved
    there stays findable, and a state group holds two blocks at most: the one read and the one written)."""
    reserved = np.minimum(num_wanted, max_model_len - num_computed - 1)
    for block_size in state_block_sizes:
        reserved = np.minimum(reserved, block_size - num_computed % block_size)
    return reserved


def loop_rows(tables: np.ndarray, num_computed: np.ndarray, reserved: np.ndarray, num_rows: int) -> LoopRows:
    """The `LoopRows` of R requests: `tables` int32[G, R, W] their block tables, `num_computed` and
    `reserved` int64[R], padded to `num_rows` P rows."""
    num_groups, num_requests, width = tables.shape
    padded = tables
    if num_rows > num_requests:
        padded = np.zeros((num_groups, num_rows, width), np.int32)
        padded[:, :num_requests] = tables
    counts = np.zeros((2, num_rows), np.int32)
    counts[0, :num_requests], counts[1, :num_requests] = num_computed, reserved
    req_slots = np.full(num_rows, num_rows, np.int32)
    req_slots[:num_requests] = np.arange(num_requests)
    state = st.ManagerState(pool=None, block_tables=padded, first_live_idx=None, num_computed=counts[0])
    return LoopRows(state, req_slots, counts[1])


def table_width(end: int, block_size: int, max_width: int) -> int:
    """W: table entries that hold the tokens before `end` in every group (`block_size`: the smallest), rounded
    up to a power of two (a few loop shapes), at most the tables' own width `max_width`."""
    return min(1 << max(cdiv(end, block_size) - 1, 0).bit_length(), max_width)


class HandOver:
    """`KVCacheManager`'s hand-overs to jitted programs (a base of it: these methods use its requests, counts,
    engine and checks)."""

    def take_state(self) -> st.ManagerState:
        """Hands the state to a jitted loop that donates it (e.g. on-device decode steps).

        The manager holds no state until `adopt_state` gives the loop's result back: until then every
        call that reads or changes the state or its requests' counts raises and changes nothing (only
        `add_request` and reads of the host's counts go on). Rejected drafts are rolled back first (an
        allocation of no tokens for their requests), so every count in the state is verified.
        """
        pending = [rid for rid, slot in self._requests.slot_of.items() if self._counts.pending_reject[slot]]
        if pending:
            self.allocate_slots_batch(pending, [0] * len(pending))
        state = self.state
        self._engine.take()
        self._taken = True
        return state

    def adopt_state(
        self,
        state: st.ManagerState,
        request_ids: Sequence[Hashable],
        pinned_copies: Sequence[int] = (),
        num_rejected_tokens: Sequence[int] | None = None,
    ) -> None:
        """Takes back a state that a jitted loop advanced for `request_ids` (see `take_state`).

        `pinned_copies`: destinations of block copies the loop's last allocation made and the loop
        applied (`AllocateResult.copies`); the manager's next allocation releases their pins (NULL_BLOCK
        entries are ignored). `num_rejected_tokens` (speculative decoding): per request, the tokens at
        the end of its count in `state` that the loop's last verification rejected; the request's next
        allocation rolls them back.

        The loop may only have allocated tokens for these requests, and ran the forward pass of
        each step it allocated (what the steps wrote counts as written); the host's count of
        their computed tokens is read back from the device (one transfer). Append the
        tokens they produced with `append_token_ids` before scheduling them again.
        """
        if not self._taken:
            raise ValueError("adopt_state without take_state: the manager still holds its state")
        if not isinstance(state, st.ManagerState):
            raise TypeError(f"state must be the ManagerState that take_state gave, got {type(state).__name__}")
        slots = self._requests.slots(request_ids)
        num_computed = np.asarray(jax.device_get(state.num_computed[slots]), np.int64)
        rejected, pinned = validation.hand_back(
            request_ids, num_computed, num_rejected_tokens, pinned_copies, self.cfg.num_blocks
        )
        self._taken = False
        self._engine.adopt(state, slots, self._requests.hasher_keys())
        c = self._counts
        c.num_computed[slots] = c.num_written[slots] = num_computed - rejected  # the loop ran each step
        c.pending_reject[slots] = rejected
        c.num_drafts[slots] = c.lookahead[slots] = c.num_scheduled[slots] = 0
        self._release.extend(pinned)
        self._engine.check()

    def hand_over(
        self, request_ids: Sequence[Hashable], num_tokens: Sequence[int], *, num_rows: int | None = None
    ) -> LoopRows | None:
        """Reserves slots for a device loop of decode steps and hands over what it reads: for each decoding
        request (one token not computed yet), slots for its next `num_tokens[i]` tokens (the one it computes
        next, then those the loop samples or drafts; fewer where it would produce more than `max_model_len`
        tokens, and with state groups past the end of its state block), in one allocation, as vLLM's
        multi-step scheduler reserved lookahead slots.

        Returns the requests' tables and counts (`jaxkv.manager.device_loop.LoopRows`, rows in this order,
        padded to `num_rows`, default R; numpy arrays, which the loop's call moves to its device), or None,
        with nothing reserved, if not all of them fit (blocks behind windows may have been released, as by
        any allocation). Apply the block copies it made (`take_block_copies`) before the loop. Until
        `hand_back`, every call that reads or changes the state raises (only `add_request` and reads of the
        host's counts go on). The loop allocates nothing; it computes at most `num_reserved[i]` tokens of row
        i, at positions from its computed count on."""
        self._check_held()
        slots = self._requests.known_slots(request_ids)
        wanted = validation.counts(request_ids, num_tokens, "num_tokens")
        num_rows = len(request_ids) if num_rows is None else validation.count(num_rows, "num_rows", minimum=1)
        if len(request_ids) > num_rows:
            raise ValueError(f"{num_rows=} cannot hold the {len(request_ids)} requests")
        checked = self._requests.checked_slots(request_ids, slots)  # names an unknown or repeated id
        c = self._counts
        num_computed = c.num_computed[slots]
        waiting = c.num_tokens[slots] - num_computed != 1
        if waiting.any():
            i = int(np.flatnonzero(waiting)[0])
            raise ValueError(
                f"request {request_ids[i]!r} has {c.num_tokens[slots][i]} tokens, {num_computed[i]} computed: "
                "a device loop takes decoding requests (one token not computed yet); schedule the rest on the host"
            )
        # Every refusal is above: a loop that ended settles only once the call is known to reserve (its own rows
        # settle in the reservation's allocation, which rolls back and indexes first).
        self._settle_others(slots)
        result = self._engine.reserve_fast(slots, wanted, self._release)
        if result is not None:
            ok, reserved, copies = result
        else:
            reserved = reservation(self.cfg.max_model_len, self._state_block_sizes, num_computed, wanted)
            zeros = np.zeros(len(slots), np.int64)
            c.num_written[slots] = num_computed  # their last steps ran: they sampled the tokens not computed
            ok, _, copies = self._engine.allocate(checked, zeros, zeros, zeros, reserved, self._release)
            c.pending_reject[slots[ok]] += reserved[ok]  # the engine counts them; `hand_back` gives the rest back
        if len(copies):
            self._copies.append(copies)
        c.num_scheduled[slots] = 0
        if not ok.all():
            self._settle(request_ids, slots)
            return None
        end = int((num_computed + reserved).max(initial=1))
        width = table_width(end, min(self._block_sizes), st.max_blocks_per_request(self.cfg))
        rows = loop_rows(self._engine.rows_tables(slots, width), num_computed, reserved, num_rows)
        self._loop = (list(request_ids), slots, reserved)
        return rows

    def hand_back(self, request_ids: Sequence[Hashable], new_token_ids: Sequence[Sequence[int]]) -> None:
        """Ends the device loop `hand_over` reserved slots for: `new_token_ids[i]`, the tokens request i
        produced in it (each computed position gave the next token, so its computed tokens grow by as many).
        Appends them (as `append_token_ids_batch`) and counts them computed and written. The rest of the
        reservation goes back and the blocks the loop filled become findable in one allocation of no tokens,
        made by the next call that reads or changes the state, or within the next `hand_over`'s allocation
        (back-to-back loops over the same requests make one allocation each)."""
        if self._loop is None:
            raise ValueError("hand_back without hand_over: no device loop holds requests")
        ids, slots, reserved = self._loop
        if list(request_ids) != ids:
            raise ValueError(
                f"hand_back takes the requests of the hand_over, in its order: {validation.short(ids)}, "
                f"not {validation.short(request_ids)}"
            )
        num_new = validation.token_lists(request_ids, new_token_ids, "new_token_ids")
        over = num_new > reserved
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise ValueError(
                f"{num_new[i]} new tokens for request {request_ids[i]!r}: the loop had {reserved[i]} slots for it "
                "(each token it produced is one it computed)"
            )
        c = self._counts
        self._loop = None
        self._append(request_ids, new_token_ids, num_new)
        c.num_computed[slots] += num_new
        c.num_written[slots] = c.num_computed[slots]  # the loop ran each step
        c.pending_reject[slots] -= num_new
        self._unsettled = (ids, slots)

    def _settle_others(self, slots) -> None:
        """Settles the rows of a device loop that ended (`hand_back`), except `slots` (int[R]): a reservation for
        them settles them in its own allocation."""
        if self._unsettled is None:
            return
        ended, ended_slots = self._unsettled
        self._unsettled = None
        if len(ended_slots) == len(slots) and (ended_slots == slots).all():
            return
        others = ~np.isin(ended_slots, slots)
        if others.any():
            self._settle([rid for rid, other in zip(ended, others) if other], ended_slots[others])

    def _settle(self, request_ids, slots) -> None:
        """An allocation of no tokens for the rows: rolls back their unused reservations (and releases blocks
        behind windows), indexes the blocks their computed tokens filled."""
        zeros = np.zeros(len(slots), np.int64)
        self._allocate_checked(request_ids, slots, zeros, zeros, np.zeros(len(slots), bool), zeros)
        self._counts.num_scheduled[slots] = 0
