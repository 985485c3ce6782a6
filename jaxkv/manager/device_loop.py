"""What a device loop of decode steps gets from a `KVCacheManager` (`hand_over`) and gives back (`hand_back`).

Dimensions: R requests the loop serves, P rows of the loop (R plus padding), G groups, W table entries handed
over (a power of two: few loop shapes).

The host reserves each request's slots for the loop's steps in one allocation, as vLLM's multi-step scheduler
reserved lookahead slots, and hands over only the requests' block tables and counts (`LoopRows`): the loop
allocates nothing, so it needs neither the pool nor the prefix index. After the loop, the host counts the tokens it
computed, gives the rest of the reservation back and indexes the blocks the loop filled, in one allocation.
A request's slots are reserved by position: a rejected draft's slot takes the next token, as on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxkv.core.state import ManagerState
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

    state: ManagerState
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
    state = ManagerState(pool=None, block_tables=padded, first_live_idx=None, num_computed=counts[0])
    return LoopRows(state, req_slots, counts[1])


def table_width(end: int, block_size: int, max_width: int) -> int:
    """W: table entries that hold the tokens before `end` in every group (`block_size`: the smallest), rounded
    up to a power of two (a few loop shapes), at most the tables' own width `max_width`."""
    return min(1 << max(cdiv(end, block_size) - 1, 0).bit_length(), max_width)
