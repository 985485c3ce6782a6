"""The host engine's arrays as the few named structures its compiled (numba) loops take: the group rules, the
pool, the requests and the manager's counts (numba structs: a call passes each as one pointer, however many
arrays it holds), plus a call's rows (a named tuple). Each field is one of `jaxkv.core.host.HostState`'s arrays
(the same memory: the loops update the state in place), so a struct is built once per state, by its compiled
constructor (`rules`, `pool`, `requests`, `counts`), which takes the fields in the order listed.

Dimensions: G groups, N blocks, S slots, M table entries per request, U unit keys per slot, R rows of one call.
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
from numba.core import types
from numba.experimental import structref

from jaxkv.core.host_pool import _jit

_I64, _BOOL = types.Array(types.int64, 1, "C"), types.Array(types.boolean, 1, "C")
_COLUMN = types.Array(types.int32, 1, "A")  # a column of the pool's int32[N, 8] array


# One struct type class (each struct's fields make it a type of its own) and one Python proxy, both defined at
# module level: numba's on-disk cache pickles a signature's types and the boxing constructor by import path, so a
# class built at run time would miss the cache in every new process.
@structref.register
class StructType(types.StructRef):
    pass


class Struct(structref.StructRefProxy):
    """One of the engine's structs (built by `rules`, `pool`, `requests` or `counts`), opaque in Python."""


structref.define_boxing(StructType, Struct)


# Per group int64[G] (`jaxkv.core.state.GroupRules`' constants, and the hash units per block), and the prefix
# cache's scalars.
_RULES_FIELDS = [
    ("block_size", _I64),
    ("max_blocks", _I64),
    ("keep_offset", _I64),  # keep_from(n) = max(n + offset, 0) // unit * scale // div
    ("keep_unit", _I64),
    ("keep_scale", _I64),
    ("keep_div", _I64),
    ("step", _I64),  # hash units per block
    ("kind", _I64),  # `jaxkv.core.state`'s codes: FULL, SLIDING_WINDOW, CHUNKED_LOCAL, MAMBA
    ("window", _I64),  # a sliding window's tokens, a chunk's, else 0
    ("windowed", _BOOL),  # sliding or chunked
    ("partial", _BOOL),  # hits may end inside its blocks (`jaxkv.prefix.state.partial_groups`)
    ("unit", types.int64),  # tokens per hash unit (1 without a prefix cache)
    ("ways", types.int64),  # index entries per bucket
    ("caching", types.boolean),  # a prefix cache
    ("has_state", types.boolean),  # a state group
    ("has_partial", types.boolean),  # a partial group
    ("quiet", types.boolean),  # rows within their quiet bounds skip an allocation's phases (`host_step._set_quiet`)
]
# Per block int32[N] (columns of one int32[N, 8] array, `jaxkv.core.host_pool.new_pool`), and the counters.
_POOL_FIELDS = [
    ("ref", _COLUMN),
    ("group_of", _COLUMN),  # the group it is cached for; -1: not cached
    ("nxt", _COLUMN),  # the free order (`jaxkv.core.host_pool`)
    ("prv", _COLUMN),
    ("block_slot", _COLUMN),  # its index field (e × G + g); -1: not indexed
    ("cached_in_pass", _COLUMN),  # the caching pass that indexed it
    ("copy_src", _COLUMN),  # a pending copy's source, at its destination; 0: none
    ("counts", _I64),  # int64[2]: free blocks, caching passes so far
]
# Per slot: its block tables, counts and unit keys.
_REQUESTS_FIELDS = [
    ("tables", types.Array(types.int32, 3, "C")),  # int32[G, S, M]
    ("first_live", types.Array(types.int64, 2, "C")),  # int64[S, G]
    ("num_computed", _I64),
    ("num_cached", types.Array(types.int64, 2, "C")),  # int64[S, G]: blocks the index holds
    ("shared_len", _I64),
    ("prompt_len", _I64),
    ("num_hashed", _I64),  # unit keys
    ("keys", types.Array(types.uint32, 3, "C")),  # uint32[S, U, 4]
    ("quiet_start", _I64),  # `host_step._set_quiet`; -1: unknown
    ("quiet_done", _I64),
]
# The manager's int64[S] counts by slot (`jaxkv.manager.engine.RequestCounts`) that its checked calls read and
# advance.
_COUNTS_FIELDS = [
    ("computed", _I64),
    ("written", _I64),
    ("tokens", _I64),
    ("shared", _I64),  # the last lookup's shared length
    ("pending", _I64),  # tokens past `computed` still held: rejected drafts, lookahead slots
    ("prompt", _I64),  # prompt tokens
]
RULES = StructType(_RULES_FIELDS)
POOL = StructType(_POOL_FIELDS)
REQUESTS = StructType(_REQUESTS_FIELDS)
COUNTS = StructType(_COUNTS_FIELDS)
INDEX = types.Array(types.uint32, 2, "C")  # the index entries (`jaxkv.core.host_index`'s slots)


def _signature(struct, fields):
    return struct(*(t for _, t in fields))


@_jit(_signature(RULES, _RULES_FIELDS))
def rules(block_size, max_blocks, keep_offset, keep_unit, keep_scale, keep_div, step, kind, window, windowed,
          partial, unit, ways, caching, has_state, has_partial, quiet):  # fmt: skip
    r = structref.new(RULES)
    r.block_size, r.max_blocks, r.keep_offset, r.keep_unit = block_size, max_blocks, keep_offset, keep_unit
    r.keep_scale, r.keep_div, r.step, r.kind, r.window = keep_scale, keep_div, step, kind, window
    r.windowed, r.partial, r.unit, r.ways = windowed, partial, unit, ways
    r.caching, r.has_state, r.has_partial, r.quiet = caching, has_state, has_partial, quiet
    return r


@_jit(_signature(POOL, _POOL_FIELDS))
def pool(ref, group_of, nxt, prv, block_slot, cached_in_pass, copy_src, counts):
    p = structref.new(POOL)
    p.ref, p.group_of, p.nxt, p.prv = ref, group_of, nxt, prv
    p.block_slot, p.cached_in_pass, p.copy_src, p.counts = block_slot, cached_in_pass, copy_src, counts
    return p


@_jit(_signature(REQUESTS, _REQUESTS_FIELDS))
def requests(tables, first_live, num_computed, num_cached, shared_len, prompt_len, num_hashed, keys, quiet_start,
             quiet_done):  # fmt: skip
    q = structref.new(REQUESTS)
    q.tables, q.first_live, q.num_computed, q.num_cached = tables, first_live, num_computed, num_cached
    q.shared_len, q.prompt_len, q.num_hashed, q.keys = shared_len, prompt_len, num_hashed, keys
    q.quiet_start, q.quiet_done = quiet_start, quiet_done
    return q


@_jit(_signature(COUNTS, _COUNTS_FIELDS))
def counts(computed, written, tokens, shared, pending, prompt):
    c = structref.new(COUNTS)
    c.computed, c.written, c.tokens, c.shared, c.pending, c.prompt = computed, written, tokens, shared, pending, prompt
    return c


class Rows(NamedTuple):
    """One allocation's int64[R] rows."""

    slot: np.ndarray
    new: np.ndarray  # new tokens, lookahead included
    lookahead: np.ndarray  # lookahead slots (a device loop's reservation, drafts' room)
    hit: np.ndarray  # hit tokens claimed; 0: none
    full: np.ndarray  # whole-request tokens of vLLM's admission gate; 0: no gate
    shared: np.ndarray  # the lookup's shared length, recorded on a request's first allocation
    prompt: np.ndarray  # the prompt's tokens; 0: not given


ROWS = numba.typeof(Rows(*np.zeros((7, 1), np.int64)))
