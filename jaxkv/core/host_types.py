"""The host engine's arrays as the few named structures its compiled (numba) loops take: the group rules, the
pool, the index and the requests, plus a call's rows and the manager's counts. Each field is one of
`jaxkv.core.host.HostState`'s arrays (the same object: the loops update the state in place), so a structure is
built once per state.

Dimensions: G groups, N blocks, E index entries (buckets × ways), S slots, M table entries per request, U unit
keys per slot, R rows of one call.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np


class Rules(NamedTuple):
    """Per group int64[G] (`jaxkv.core.state.GroupRules`' constants, and the hash units per block), and the
    prefix cache's scalars."""

    block_size: np.ndarray
    max_blocks: np.ndarray
    keep_offset: np.ndarray  # keep_from(n) = max(n + offset, 0) // unit * scale // div
    keep_unit: np.ndarray
    keep_scale: np.ndarray
    keep_div: np.ndarray
    step: np.ndarray  # hash units per block
    kind: np.ndarray  # `jaxkv.core.state`'s codes: FULL, SLIDING_WINDOW, CHUNKED_LOCAL, MAMBA
    window: np.ndarray  # a sliding window's tokens, a chunk's, else 0
    windowed: np.ndarray  # bool[G]: sliding or chunked
    partial: np.ndarray  # bool[G]: hits may end inside its blocks (`jaxkv.prefix.state.partial_groups`)
    unit: int  # tokens per hash unit (the smallest block size without a prefix cache)
    ways: int  # index entries per bucket
    caching: bool  # a prefix cache
    has_state: bool  # a state group
    has_partial: bool  # a partial group
    quiet: bool  # rows within their quiet bounds skip an allocation's phases (`host_step._set_quiet`)


class Pool(NamedTuple):
    """Per block int32[N] (columns of one int32[N, 8] array, `jaxkv.core.host_pool.new_pool`) and the counters."""

    ref: np.ndarray
    group_of: np.ndarray  # the group it is cached for; -1: not cached
    nxt: np.ndarray  # the free order (`jaxkv.core.host_pool`)
    prv: np.ndarray
    block_slot: np.ndarray  # its index field (e × G + g); -1: not indexed
    cached_in_pass: np.ndarray  # the caching pass that indexed it
    copy_src: np.ndarray  # a pending copy's source, at its destination; 0: none
    counts: np.ndarray  # int64[2]: free blocks, caching passes so far


class Requests(NamedTuple):
    """Per slot: its block tables, counts and unit keys."""

    tables: np.ndarray  # int32[G, S, M]
    first_live: np.ndarray  # int64[S, G]
    num_computed: np.ndarray  # int64[S]
    num_cached: np.ndarray  # int64[S, G]: blocks the index holds
    shared_len: np.ndarray  # int64[S]
    prompt_len: np.ndarray  # int64[S]
    num_hashed: np.ndarray  # int64[S]: unit keys
    keys: np.ndarray  # uint32[S, U, 4]
    quiet_start: np.ndarray  # int64[S] (`host_step._set_quiet`; -1: unknown)
    quiet_done: np.ndarray  # int64[S]


class Rows(NamedTuple):
    """One allocation's int64[R] rows."""

    slot: np.ndarray
    new: np.ndarray  # new tokens, lookahead included
    lookahead: np.ndarray  # lookahead slots (a device loop's reservation, drafts' room)
    hit: np.ndarray  # hit tokens claimed; 0: none
    full: np.ndarray  # whole-request tokens of vLLM's admission gate; 0: no gate
    shared: np.ndarray  # the lookup's shared length, recorded on a request's first allocation
    prompt: np.ndarray  # the prompt's tokens; 0: not given


class Counts(NamedTuple):
    """The manager's int64[S] counts by slot (`jaxkv.manager.engine.RequestCounts`) that its checked calls read
    and advance."""

    computed: np.ndarray
    written: np.ndarray
    tokens: np.ndarray
    shared: np.ndarray  # the last lookup's shared length
    pending: np.ndarray  # tokens past `computed` still held: rejected drafts, lookahead slots
    prompt: np.ndarray  # prompt tokens


def _int64(*shape):
    return np.zeros(shape, np.int64)


RULES = numba.typeof(
    Rules(*[_int64(1)] * 9, np.zeros(1, np.bool_), np.zeros(1, np.bool_), 1, 1, True, True, True, True)
)
POOL = numba.typeof(Pool(*[np.zeros((2, 8), np.int32)[:, 0]] * 7, _int64(2)))
REQUESTS = numba.typeof(
    Requests(
        np.zeros((1, 1, 1), np.int32),
        _int64(1, 1),
        _int64(1),
        _int64(1, 1),
        _int64(1),
        _int64(1),
        _int64(1),
        np.zeros((1, 1, 4), np.uint32),
        _int64(1),
        _int64(1),
    )  # fmt: skip
)
ROWS = numba.typeof(Rows(*[_int64(1)] * 7))
COUNTS = numba.typeof(Counts(*[_int64(1)] * 6))
INDEX = numba.typeof(np.zeros((1, 1), np.uint32))  # the entries (`jaxkv.core.host_index`'s slots)
