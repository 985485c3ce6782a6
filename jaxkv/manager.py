"""KVCacheManager: vLLM's manager vocabulary over the jitted pure transitions of `jaxkv.core.state`.

Dimensions: R requests in one call, G groups, M max blocks per request, T tokens.

The manager owns a `ManagerState` on the device (or, with `backend="host"`, a
`jaxkv.core.host.HostState` updated in place on the host) and, on the host, the map
from request id to slot plus each request's tokens and counts, so bad input is
caught before anything is dispatched. Every `*_batch` call is one jitted
dispatch for many requests; the per-request calls are batches of one.

Fast path:
* each allocation sends only the rows with block work (a block to take, release,
  claim or index, or a whole-request gate); the others only advance their count,
  which the host keeps (the device's is written at the next dispatch or read), and a
  step without block work makes no dispatch;
* the program is compiled for the step's work signature (`jaxkv.core.step.StepWork`,
  from the host's mirror of the counts): walks the step does not have are absent,
  small ones straight-line code; batches are padded to 8 rows or to `max_num_seqs`,
  with or without pending frees;
* `free` only records the slots; the next allocation frees them first, in the
  same dispatch (anything that reads the device state flushes them first), so a
  serving step is at most one dispatch and one small transfer back (ok flags, free
  count, the rows' mirrored counts);
* `append_token_ids_batch` takes a step's sampled tokens in one call; only requests
  that complete a hash unit are hashed.

Prefix caching (on by default): `add_request` and `append_token_ids` hash the
request's full units on the host (`jaxkv.UnitHasher`: chained SHA-256,
the cache salt in the first unit); the keys ride to the device with the next
allocation (`jaxkv.prefix.state.store_hashes`), which caches every block whose tokens
it schedules. `get_computed_tokens` sends the request's keys with the lookup
(one dispatch, nothing changes on the device).

Hits inside a block (a `prefix_match_unit` finer than a full-attention or state group's
block, `jaxkv.prefix.tails`): an allocation may make block copies. Take them with
`take_block_copies()` and apply them (`jaxkv.copy_blocks`) before the forward pass
that computes the allocated tokens; both blocks of a copy stay referenced until the next
allocation after it was taken. Reading block tables or slot mappings with copies not taken
raises.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import validation
from jaxkv.core import state as st
from jaxkv.core.host_convert import load_state, to_state
from jaxkv.core.invariants import check_invariants
from jaxkv.core.step import StepBatch, StepWork, allocate_step, rollback_ranges, walk_units
from jaxkv.metadata import StepMetadata, step_metadata
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK, cdiv
from jaxkv.prefix.hashing import HashMode, UnitHasher, digests_to_keys
from jaxkv.prefix.state import UPLOAD_WORDS, PrefixCacheConfig, partial_groups, store_hashes

PREFIX_STATS = ("lookups", "lookup_tokens", "hit_tokens", "reconciliation_miss_tokens", "claimed_hit_tokens")
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


_step_metadata = jax.jit(step_metadata, static_argnames=("cfg", "num_tokens"))


def _store_hashes(state, uploads):
    return dataclasses.replace(state, prefix=store_hashes(state.prefix, uploads))


@functools.cache
def _jitted(cfg: KVCacheConfig, prefix: PrefixCacheConfig | None, use_eagle: bool):
    """The transitions with `cfg` bound (not hashed per call), shared by managers of one config, and the
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


class KVCacheManager:
    """Host facade: request ids in, block ids and ok flags out (see DESIGN.md "Public API").

    `debug_checks=True` runs `jaxkv.check_invariants` after every
    transition (slow; for tests and debugging). `prefix_match_unit`: tokens per
    hash unit (default: the gcd of the groups' block sizes; it must divide each
    of them). `hash_mode="vllm"` hashes units exactly as vLLM does.

    `specialize_steps` (default True): each allocation dispatches a program compiled for the
    work its step has (`jaxkv.core.step.StepWork`), with only the rows that have block work; rows
    that only advance their count are counted on the host, and a step without block work makes
    no dispatch. False: every step runs the full program with every row (same outcome; for
    tests and comparisons). `step_variants` counts the steps of each signature; at most
    MAX_PROGRAMS specialised programs are compiled per config (later steps run the full program).

    `device`: where the state lives (default: JAX's default device). On a GPU/TPU host the
    state can live on the host's CPU backend (`jax.devices("cpu")[0]`): each step's bookkeeping
    then runs on the CPU without a device round trip per dispatch, and block tables and slot
    mappings travel to the model's device as arrays, one transfer each
    (`jax.device_put(tables, model_device)`). Keep it on the accelerator when allocation
    runs inside an on-device loop (`state.decode_steps`).

    `backend="host"`: the state is held on the host as Python and numpy objects and updated in place
    (`jaxkv.core.host.HostState`): the same transitions with the same outcome, block ids included, at a
    cost that follows the step's work (its rows and the blocks it moves) rather than compiled shapes; no
    compilation at all, and every call applies at once (frees and keys are not deferred). `state` and
    `take_state` convert it to a `ManagerState` for jitted loops and `adopt_state` takes one back
    (O(blocks), meant for handing over a device loop, not per step). `device` does not apply.

    Speculative decoding (`num_speculative_tokens` > 0: at most that many draft tokens per call):
    `allocate_slots` may schedule draft tokens past the request's known tokens, and reserve
    `num_lookahead_tokens` more slots for a proposer; `reject_tokens` reports the drafts that
    verification rejected. Only tokens given with `append_token_ids` are hashed, so a block holding a
    draft is never findable; the rejected tokens' slots are reused by the next tokens, the blocks past
    the verified ones go back to the pool at the request's next allocation, and windows release
    blocks by the verified count. Configs with state groups refuse it (a rejected draft's state
    overwrote the verified one). `use_eagle`: vLLM's rule for EAGLE-style drafters, under which a
    prefix hit drops its last block in every group (`jaxkv.prefix.state.lookup`'s `drop_last_block`).
    """

    def __init__(
        self,
        cfg: KVCacheConfig,
        max_num_seqs: int = 256,
        enable_prefix_caching: bool = True,
        *,
        debug_checks: bool = False,
        prefix_match_unit: int | None = None,
        hash_mode: HashMode = "jaxkv",
        specialize_steps: bool = True,
        device: jax.Device | None = None,
        num_speculative_tokens: int = 0,
        use_eagle: bool = False,
        backend: str = "jax",
    ):
        if not isinstance(cfg, KVCacheConfig):
            raise TypeError(f"cfg must be a KVCacheConfig (from jaxkv.plan), got {type(cfg).__name__}")
        max_num_seqs = validation.count(max_num_seqs, "max_num_seqs", minimum=1)
        num_speculative_tokens = validation.count(num_speculative_tokens, "num_speculative_tokens")
        state_groups = [g.layer_names[0] for g in cfg.groups if g.kind == "mamba"]
        if state_groups and (num_speculative_tokens or use_eagle):
            raise ValueError(
                f"speculative decoding ({num_speculative_tokens=}, {use_eagle=}) on a config with state "
                f"(Mamba / linear-attention) groups ({', '.join(state_groups[:3])}, ...): a rejected draft's "
                "state overwrites the verified one and jaxkv keeps one state per request (vLLM keeps one per "
                "draft position); serve this model without speculative decoding"
            )
        self.num_speculative_tokens = num_speculative_tokens
        self.use_eagle = bool(use_eagle)
        self.cfg = cfg
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = bool(enable_prefix_caching)
        if prefix_match_unit is not None and not self.enable_prefix_caching:
            raise ValueError(f"{prefix_match_unit=} given, but prefix caching is off")
        self.debug_checks = debug_checks
        self.specialize_steps = bool(specialize_steps)
        self.device = device
        self.prefix_config = (
            PrefixCacheConfig.for_config(cfg, prefix_match_unit) if self.enable_prefix_caching else None
        )
        self.hash_mode = hash_mode
        if backend not in ("jax", "host"):
            raise ValueError(f"{backend=} must be 'jax' (jitted transitions) or 'host' (in place, on the host)")
        if backend == "host" and device is not None:
            raise ValueError(f"{device=} given with backend='host', whose state is host memory; drop one")
        self.backend = backend
        self._host = None
        if backend == "host":
            # Imported here: the host backend's loops, compiled with numba, load (or compile, once) on first use.
            from jaxkv.core.host import HostState
            from jaxkv.core.host_step import append_checked

            self._host = HostState(cfg, self.max_num_seqs, self.prefix_config)
            self._append_checked = append_checked
        # An allocation as one compiled call, its checks and these counts included (no speculative decoding).
        self._compiled_host = self._host is not None and self._host.compiled and not num_speculative_tokens
        self._taken = False  # the state was handed over (take_state)
        self._state = None
        if self._host is None:
            self._state = st.init_state(cfg, self.max_num_seqs, prefix=self.prefix_config)
            if device is not None:
                self._state = jax.device_put(self._state, device)
        (self._allocate_fn, self._free_fn, self._lookup_fn, self._store_fn, self._set_counts_fn, self._programs) = (
            _jitted(cfg, self.prefix_config, self.use_eagle)
        )
        self._tails = self.prefix_config is not None and bool(partial_groups(cfg, self.prefix_config))
        self._num_prompt = np.zeros(self.max_num_seqs, np.int64)
        self._copies: list[np.ndarray] = []  # block copies not taken yet: int32[., 3]
        self._release: list[int] = []  # destinations of copies taken, their pins not released yet
        self._hashers: list[UnitHasher | None] = [None] * self.max_num_seqs
        self._keys: list[np.ndarray | None] = [None] * self.max_num_seqs  # uint32[units, 4] per slot
        self._uploads: dict[int, int] = {}  # slot -> its first unit whose key is not on the device yet
        self._num_uploaded = np.zeros(self.max_num_seqs, np.int64)  # units of each slot on the device
        self._num_uploads = 0
        self._shared_len = np.zeros(self.max_num_seqs, np.int64)  # each slot's last lookup's shared length
        self.prefix_stats = dict.fromkeys(PREFIX_STATS, 0)
        self._has_state_groups = any(g.kind == "mamba" for g in cfg.groups)
        self._block_sizes = tuple(g.block_size for g in cfg.groups)
        self._slot_of: dict[Hashable, int] = {}
        self._free_slots = list(range(self.max_num_seqs - 1, -1, -1))  # pop() gives the lowest slot
        # Prefix caching: each slot's tokens appended since its hasher last took tokens (a hasher hashes only
        # completed units, so the manager keeps no request's whole token list).
        self._unhashed: list[list[int] | None] = [None] * self.max_num_seqs
        self._num_tokens = np.zeros(self.max_num_seqs, np.int64)
        self._num_computed = np.zeros(self.max_num_seqs, np.int64)  # host mirror of the device's counts
        self._num_scheduled = np.zeros(self.max_num_seqs, np.int64)  # tokens the last allocation scheduled
        # Tokens a forward pass is known to have written: up to the last `mark_computed`, or to the start of
        # the request's last allocation (a later call says the earlier ones' steps ran).
        self._num_written = np.zeros(self.max_num_seqs, np.int64)
        self._host_counts = (self._num_computed, self._num_written, self._num_tokens, self._shared_len)
        self._num_free_blocks: int | None = cfg.num_blocks - 1  # None: read from the device state
        self._pending_free: list[int] = []  # slots freed on the host, not yet on the device
        self._pending_written: list[int] = []  # their tokens written (`_num_written`)
        # Host mirror of the device state, for the steps' work signatures (`_plan_step`):
        self._rules = st.group_rules(cfg)
        self._first_live = np.zeros((self.max_num_seqs, len(cfg.groups)), np.int64)
        self._num_cached = np.zeros((self.max_num_seqs, len(cfg.groups)), np.int64)
        self._num_keys = np.zeros(self.max_num_seqs, np.int64)  # unit keys of each slot (prefix caching, jax)
        self._num_hashed_tokens = np.zeros(self.max_num_seqs, np.int64)  # tokens its UnitHasher has taken
        self._freed_counts: dict[int, int] = {}  # pending frees: the count the device still holds
        self._pending_free_entries = 0  # table entries the pending frees release
        self._counts_stale = False  # rows advanced on the host only since the last dispatch
        # Speculative decoding: tokens past each slot's host count that the device still counts (rejected
        # drafts, lookahead slots), rolled back at its next allocation; the last allocation's draft tokens
        # not rejected yet; its lookahead slots.
        self._pending_reject = np.zeros(self.max_num_seqs, np.int64)
        self._num_drafts = np.zeros(self.max_num_seqs, np.int64)
        self._lookahead = np.zeros(self.max_num_seqs, np.int64)
        self.step_variants: dict[StepWork, int] = {}  # work signatures compiled, and how many steps ran each
        self.last_work: StepWork | None = None  # the last allocation's signature (None: no dispatch)

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: Hashable,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        *,
        unit_hasher: UnitHasher | None = None,
    ):
        """Registers a request and its prompt; takes a slot, no blocks.

        With prefix caching the prompt's full units are hashed here, unless `unit_hasher`
        (a `jaxkv.UnitHasher` of this manager's unit that has taken these tokens or
        the first of them, its salt included) brings them: hashing at request arrival, as vLLM
        does; the manager hashes the rest. It extends the hasher with the tokens
        `append_token_ids` records, as their units complete, so that a preempted request's
        hasher may be passed again with its grown prompt.
        """
        if validation.hashable_id(request_id) in self._slot_of:
            raise ValueError(f"request {request_id!r} was already added; free it first or use a new id")
        prompt_name = f"prompt_token_ids of request {request_id!r}"
        validation.sequence(prompt_token_ids, prompt_name)
        if (cache_salt is not None or unit_hasher is not None) and not self.enable_prefix_caching:
            what = f"{cache_salt=}" if cache_salt is not None else "unit_hasher"
            raise ValueError(
                f"{what} given, but prefix caching is off; "
                "drop it or create the manager with enable_prefix_caching=True"
            )
        if unit_hasher is not None:
            if not isinstance(unit_hasher, UnitHasher):
                raise TypeError(f"unit_hasher must be a jaxkv.UnitHasher, got {type(unit_hasher).__name__}")
            if cache_salt is not None:
                raise ValueError(f"{cache_salt=} and unit_hasher given: the hasher carries the salt")
            if unit_hasher.unit != self.prefix_config.unit or unit_hasher.mode != self.hash_mode:
                raise ValueError(
                    f"unit_hasher hashes units of {unit_hasher.unit} tokens in mode "
                    f"{unit_hasher.mode!r}; this manager uses {self.prefix_config.unit}, "
                    f"{self.hash_mode!r}"
                )
            if unit_hasher.num_tokens > len(prompt_token_ids):
                raise ValueError(
                    f"unit_hasher has taken {unit_hasher.num_tokens} tokens, the prompt of request "
                    f"{request_id!r} has {len(prompt_token_ids)}"
                )
        if not self._free_slots:
            raise ValueError(
                f"the manager already holds max_num_seqs={self.max_num_seqs} requests; "
                f"free one before adding {request_id!r}, or raise max_num_seqs"
            )
        num_tokens = len(prompt_token_ids)
        if not num_tokens:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if num_tokens > self.cfg.max_model_len:
            raise ValueError(
                f"request {request_id!r} has {num_tokens} prompt tokens, more than "
                f"max_model_len={self.cfg.max_model_len}"
            )
        if self.prefix_config is None:
            validation.token_ids(prompt_token_ids, prompt_name)
        else:  # the hasher checks the tokens it takes (a given one has checked those it took)
            if unit_hasher is None:
                unit_hasher = UnitHasher(self.prefix_config.unit, cache_salt=cache_salt, mode=self.hash_mode)
            if unit_hasher.num_tokens < num_tokens:  # a given one may lack the last tokens
                rest = prompt_token_ids[unit_hasher.num_tokens :]
                try:
                    unit_hasher.extend(rest)
                except ValueError:  # nothing taken: name the token
                    validation.token_ids(rest, prompt_name)
                    raise
        slot = self._free_slots.pop()
        self._slot_of[request_id] = slot
        self._num_tokens[slot] = num_tokens
        self._num_prompt[slot] = num_tokens
        self._num_computed[slot] = self._num_scheduled[slot] = 0
        self._num_written[slot] = 0
        self._shared_len[slot] = 0
        if self.prefix_config is not None:
            self._unhashed[slot] = []
            self._hashers[slot] = unit_hasher
            self._num_hashed_tokens[slot] = num_tokens
            if self._host is not None:  # the keys go to the host state now
                self._host.set_keys(slot, unit_hasher.keys)
            else:
                self._num_keys[slot] = unit_hasher.num_units
                self._keys[slot] = unit_hasher.keys.copy()
                self._queue_upload(slot, 0, unit_hasher.num_units)

    def get_computed_tokens(self, request_id: Hashable) -> int:
        """Tokens of the request found in the prefix cache, valid for every group; changes nothing.

        At most `num_tokens − 1` (the last token is always recomputed); 0 without prefix caching.
        """
        return int(self.get_computed_tokens_batch([request_id])[0])

    def get_computed_tokens_batch(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """`get_computed_tokens` for many requests, in one dispatch: int64[R]."""
        self._check_held()
        slots = self._slots(request_ids)
        if self.prefix_config is None or not len(slots):
            return np.zeros(len(slots), np.int64)
        if self._host is not None:
            return self._lookup_host(slots)
        if self._has_state_groups or not self._pending_ran():
            # A freed request's last state block becomes findable as it is freed; the blocks of a step not
            # known to have run leave the index.
            self._flush_frees()
        num_units = [len(self._keys[s]) for s in slots.tolist()]
        width = _MIN_KEY_WIDTH
        while width < max(num_units):
            width *= 4
        width = min(width, self.prefix_config.num_units(self.cfg))
        num_rows = 1 if len(slots) == 1 else self._num_rows(len(slots))
        keys = np.zeros((num_rows, width, 4), np.uint32)
        rows = np.zeros((2, num_rows), np.int32)
        for i, s in enumerate(slots.tolist()):
            keys[i, : num_units[i]] = self._keys[s]
        rows[0, : len(slots)] = num_units
        rows[1, : len(slots)] = self._num_tokens[slots]
        packed = np.asarray(self._lookup_fn(self._state, keys, rows))
        for name, value in zip(PREFIX_STATS[:4], packed[2 * num_rows :].tolist()):
            self.prefix_stats[name] += value
        self._shared_len[slots] = packed[num_rows : num_rows + len(slots)]
        return packed[: len(slots)].astype(np.int64)

    def _check_held(self) -> None:
        """Raises if the state was handed over (`take_state`): every call that reads or changes it waits."""
        if self._taken:
            raise ValueError("the state was handed over (take_state); give it back with adopt_state first")

    def _lookup_host(self, slots: np.ndarray) -> np.ndarray:
        hits = np.empty(len(slots), np.int64)
        stats = self._host.lookup_rows(slots.astype(np.int64), self._num_tokens, self.use_eagle, hits, self._shared_len)
        for name, value in zip(PREFIX_STATS[:4], stats):
            self.prefix_stats[name] += value
        return hits

    def append_token_ids(self, request_id: Hashable, new_token_ids: Sequence[int]) -> None:
        """Records tokens the model produced for the request: the step that produced them ran, so
        what it wrote counts as written (as after `mark_computed`)."""
        self.append_token_ids_batch([request_id], [new_token_ids])

    def append_token_ids_batch(self, request_ids: Sequence[Hashable], new_token_ids: Sequence[Sequence[int]]) -> None:
        """`append_token_ids` for many requests (a step's sampled tokens). With prefix caching, per request one
        list extend, and only the requests that complete a hash unit are hashed; without, only counts change."""
        self._check_held()
        slots = self._known_slots(request_ids)
        lengths = validation.token_lists(request_ids, new_token_ids, "new_token_ids")
        if self._host is not None and slots is not None and self._append_host(slots, lengths, new_token_ids):
            return
        slots = self._checked_slots(request_ids, slots)
        num_tokens = self._num_tokens[slots] + lengths
        over = num_tokens > self.cfg.max_model_len
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise ValueError(
                f"request {request_ids[i]!r} would have {num_tokens[i]} tokens, more than "
                f"max_model_len={self.cfg.max_model_len}"
            )
        self._num_tokens[slots] = num_tokens
        self._num_written[slots] = self._num_computed[slots]
        if self.prefix_config is not None:
            unhashed = self._unhashed
            for slot, ids in zip(slots.tolist(), new_token_ids):
                unhashed[slot].extend(ids)
            unit = self.prefix_config.unit
            for slot in slots[num_tokens // unit > self._num_hashed_tokens[slots] // unit].tolist():
                self._hash_new_units(slot)

    def _append_host(self, slots, lengths, new_token_ids) -> bool:
        """`append_token_ids_batch` on the host backend, its tokens checked: one compiled call for the counts and
        checks, one for the new unit keys; False (nothing changed) where the call is not valid (the general path
        names what is wrong)."""
        to_hash = np.empty(len(slots), np.int64)
        unit = self.prefix_config.unit if self.prefix_config is not None else self.cfg.max_model_len + 1
        num_to_hash = self._append_checked(
            slots, lengths, self._num_tokens, self._num_written, self._num_computed, self._num_hashed_tokens,
            unit, self.cfg.max_model_len, to_hash,
        )  # fmt: skip
        if num_to_hash < 0:
            return False
        if self.prefix_config is None:
            return True
        unhashed = self._unhashed
        for slot, ids in zip(slots.tolist(), new_token_ids):
            unhashed[slot].extend(ids)
        if num_to_hash:  # the units the new tokens complete, hashed, their keys given to the host state at once
            rows, counts, digests = to_hash[:num_to_hash], [], []
            for slot in rows.tolist():
                tokens, unhashed[slot] = unhashed[slot], []
                new = self._hashers[slot].extend_digests(tokens)
                counts.append(len(new))
                digests += new
            self._num_hashed_tokens[rows] = self._num_tokens[rows]
            self._host.append_keys(rows, np.array(counts, np.int64), digests_to_keys(digests))
        return True

    def _hash_new_units(self, slot: int) -> None:
        """Hashes the slot's tokens not hashed yet; the units they complete get keys, queued for upload."""
        hasher, tokens = self._hashers[slot], self._unhashed[slot]
        self._unhashed[slot] = []
        self._num_hashed_tokens[slot] = self._num_tokens[slot]
        new_keys = hasher.extend(tokens)
        first = len(self._keys[slot])
        self._keys[slot] = np.concatenate([self._keys[slot], new_keys])
        self._num_keys[slot] = len(self._keys[slot])
        self._queue_upload(slot, first, len(new_keys))

    def num_tokens(self, request_id: Hashable) -> int:
        """Prompt plus appended tokens of the request."""
        return int(self._num_tokens[self._slot(request_id)])

    def num_computed_tokens(self, request_id: Hashable) -> int:
        """Tokens given slots so far (they count as computed once their step ran)."""
        return int(self._num_computed[self._slot(request_id)])

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self,
        request_id: Hashable,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Makes room for `num_new_tokens` more tokens; False (nothing changed) if they do not fit.

        Claims the `num_new_computed_tokens` prefix-cache hit tokens first (the value
        `get_computed_tokens` just returned, on the request's first call; False if the
        hit is no longer in the cache). Releases blocks that sliding-window, chunked and
        state groups no longer need, even when it fails.

        Speculative decoding (`num_speculative_tokens` > 0): `num_new_tokens` may end with up to that
        many draft tokens past the request's known tokens, and `num_lookahead_tokens` more slots are
        reserved after them for a proposer's own KV; both count as unverified (`reject_tokens`; the
        lookahead slots are given back at the next call).
        """
        return bool(
            self.allocate_slots_batch(
                [request_id], [num_new_tokens], [num_new_computed_tokens], num_lookahead_tokens=[num_lookahead_tokens]
            )[0]
        )

    def allocate_slots_batch(
        self,
        request_ids: Sequence[Hashable],
        num_new_tokens: Sequence[int],
        num_new_computed_tokens: Sequence[int] | None = None,
        *,
        full_sequence_must_fit: bool | Sequence[bool] = False,
        num_lookahead_tokens: Sequence[int] | None = None,
    ) -> np.ndarray:
        """`allocate_slots` for many requests in priority order, in one dispatch.

        Returns ok bool[R]. The first request that does not fit, and every one
        after it, gets False and keeps its blocks (the scheduler preempts and
        retries from there). A request with `full_sequence_must_fit` (one flag,
        or one per request) is taken only if blocks for all its tokens (prompt
        and appended, per group capped at what one request can hold) fit: vLLM's
        admission gate.
        """
        self._check_held()
        slots = self._known_slots(request_ids)
        compiled = self._compiled_host and slots is not None  # its compiled call checks the counts' range
        num_new = validation.counts(request_ids, num_new_tokens, "num_new_tokens", check_range=not compiled)
        hits = lookahead = np.zeros(len(request_ids), np.int64)  # read only
        if num_new_computed_tokens is not None:
            hits = validation.counts(
                request_ids, num_new_computed_tokens, "num_new_computed_tokens", check_range=not compiled
            )
        must_fit = validation.flags(request_ids, full_sequence_must_fit, "full_sequence_must_fit")
        if num_lookahead_tokens is not None:
            lookahead = validation.counts(request_ids, num_lookahead_tokens, "num_lookahead_tokens")
        ok = None
        if compiled and (num_lookahead_tokens is None or not lookahead.any()):
            ok = self._allocate_compiled(slots, num_new, hits, must_fit)
        if ok is None:  # the general path; its errors name what is wrong
            slots = self._checked_slots(request_ids, slots)
            if compiled:
                num_new = validation.counts(request_ids, num_new_tokens, "num_new_tokens")
                if num_new_computed_tokens is not None:
                    hits = validation.counts(request_ids, num_new_computed_tokens, "num_new_computed_tokens")
            ok = self._allocate_checked(request_ids, slots, num_new, hits, must_fit, lookahead)
        self._num_scheduled[slots] = num_new * ok
        return ok

    def _allocate_checked(self, request_ids, slots, num_new, hits, must_fit, lookahead) -> np.ndarray:
        """`allocate_slots_batch` with its arguments' types checked: the rules on the counts, then the
        allocation on either backend."""
        num_computed = self._num_computed[slots]
        num_tokens = self._num_tokens[slots]
        if hits.any():
            bad = (hits > 0) & ((num_computed > 0) | (hits >= num_tokens) | (self.prefix_config is None))
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise ValueError(
                    f"num_new_computed_tokens={hits[i]} for request {request_ids[i]!r}: it must be 0 "
                    "or the value get_computed_tokens just returned, on the request's first call"
                )
        over = num_computed + hits + num_new > num_tokens + self.num_speculative_tokens
        if over.any():
            i = int(np.flatnonzero(over)[0])
            drafts = f" (and at most num_speculative_tokens={self.num_speculative_tokens} drafts)"
            raise ValueError(
                f"request {request_ids[i]!r} has {num_tokens[i]} tokens, "
                f"{num_computed[i] + hits[i]} computed: it cannot schedule {num_new[i]} more"
                f"{drafts if self.num_speculative_tokens else ''}; append the tokens first (append_token_ids)"
            )
        if lookahead.any() and not self.num_speculative_tokens:
            raise ValueError(
                "num_lookahead_tokens given on a manager without speculative decoding; create it with "
                "num_speculative_tokens > 0"
            )
        past = num_computed + hits + num_new + lookahead > self.cfg.max_model_len
        if past.any():
            i = int(np.flatnonzero(past)[0])
            raise ValueError(
                f"request {request_ids[i]!r}: {num_computed[i] + hits[i]} computed tokens, {num_new[i]} new "
                f"and {lookahead[i]} lookahead slots exceed max_model_len={self.cfg.max_model_len}; "
                "schedule fewer drafts near the end"
            )
        full = np.where(must_fit, num_tokens, 0)
        if self._host is not None:
            return self._allocate_host(slots, num_new, hits, full, lookahead, num_computed, num_tokens)
        if len(self._pending_free) > FREE_ROWS:
            self._flush_frees()
        if self.prefix_config is not None and self._num_uploads > UPLOAD_ROWS:
            self._flush_uploads()
        self._num_written[slots] = num_computed  # this call says the rows' earlier steps ran
        rejected = self._take_rejections(slots)
        work, work_rows = self._plan_step(slots, num_computed, num_new, hits, full, rejected, lookahead)
        drafts = np.maximum(num_computed + hits + num_new - num_tokens, 0)
        if not len(work_rows) and not self._tails:
            # No row takes, releases, claims or indexes a block: the counts advance on the host only.
            # Pending frees and keys wait for the next dispatch (or a read of the state).
            self._num_computed[slots] += num_new
            self._record_unverified(slots, drafts, lookahead)
            self._counts_stale = True
            self.last_work = None
            return np.ones(len(slots), bool)
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
        rows[4, :m] = np.where(num_computed[work_rows] == 0, self._shared_len[sel_slots], 0)
        free_rows = None  # a shape without the free pass (compiled apart) when nothing is pending
        if self._pending_free:
            free_rows = np.zeros((2, FREE_ROWS), np.int32)
            free_rows[0] = self.max_num_seqs
            free_rows[:, : len(self._pending_free)] = self._pending_free, self._pending_written
            if self._pending_ran():
                free_rows = free_rows[0]  # the usual program: nothing to take out of the index
        uploads = None if self.prefix_config is None else self._take_uploads(UPLOAD_ROWS)
        released = None
        if self._tails:
            rows[5, :m] = self._num_prompt[sel_slots]
            released = np.zeros(RELEASE_ROWS, np.int32)
            released[: len(self._release[:RELEASE_ROWS])] = self._release[:RELEASE_ROWS]
        spec = None  # a shape without rollbacks and lookahead slots (compiled apart) when no row has them
        if rejected is not None or lookahead.any():
            spec = np.zeros((2, num_rows), np.int32)
            spec[0, :m] = 0 if rejected is None else rejected[work_rows]
            spec[1, :m] = lookahead[work_rows]
        self._state, packed = self._allocate_fn(
            self._state, rows, self._device_counts(), free_rows, uploads, released, spec, work=work
        )
        if rejected is not None:
            self._pending_reject[slots] = 0
        self._pending_free.clear()
        self._pending_written.clear()
        self._freed_counts.clear()
        self._pending_free_entries = 0
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
        if self._tails:
            del self._release[:RELEASE_ROWS]
            copies = mirrored[2 * num_rows * num_groups :].reshape(-1, 3)
            copies = copies[copies[:, 1] != 0]
            if len(copies):
                self._copies.append(copies)
        # Rows left out of the batch always fit: every row before the first failed one is ok.
        failed = np.flatnonzero(packed[:m] == 0)
        num_ok = int(work_rows[failed[0]]) if len(failed) else len(slots)
        ok = np.arange(len(slots)) < num_ok
        self._counts_stale = self._counts_stale or m < num_ok
        self._num_free_blocks = num_free
        self.prefix_stats["claimed_hit_tokens"] += num_hit
        self._num_computed[slots[ok]] += (num_new + hits)[ok]
        self._num_written[slots[ok]] += hits[ok]  # claimed hits hold cached content
        self._record_unverified(slots, np.where(ok, drafts, 0), np.where(ok, lookahead, 0))
        self._check()
        return ok

    def _allocate_compiled(self, slots, new, hits, must_fit):
        """`allocate_slots_batch` as one compiled call (`HostState.allocate_checked`) on checked counts, or None
        where the call breaks a rule (the general path names it)."""
        num_ok, num_hit = self._host.allocate_checked(
            slots, new, hits, must_fit, self._host_counts, self.cfg.max_model_len
        )
        if num_ok < 0:
            return None
        self.prefix_stats["claimed_hit_tokens"] += num_hit
        self.last_work = None
        self._check()
        return np.arange(len(slots)) < num_ok

    def _allocate_host(self, slots, num_new, hits, full, lookahead, num_computed, num_tokens) -> np.ndarray:
        """`allocate_slots_batch` on the host state, in place."""
        host, caching, speculating = self._host, self.prefix_config is not None, self.num_speculative_tokens
        self._num_written[slots] = num_computed  # this call says the rows' earlier steps ran
        pending = self._pending_reject[slots] if speculating else None
        if speculating and pending.any():  # rejected drafts and the last call's lookahead slots
            host.roll_back(slots.tolist(), pending.tolist())
            self._pending_reject[slots] = 0
        if self._release:
            host.release_copies(self._release)
            self._release.clear()
        ok, num_hit, copies = host.allocate(
            slots,
            num_new,
            full if full.any() else None,
            hits if caching else None,
            self._num_prompt[slots] if self._tails else None,
            np.where(num_computed == 0, self._shared_len[slots], 0) if caching else None,
            lookahead if lookahead.any() else None,
        )
        if copies:
            self._copies.append(np.array([copies[key] for key in sorted(copies)], np.int32))
        self.prefix_stats["claimed_hit_tokens"] += num_hit
        num_ok = int(np.count_nonzero(ok))  # the rows before the first that failed
        self._num_computed[slots[:num_ok]] += num_new[:num_ok] + hits[:num_ok]
        self._num_written[slots[:num_ok]] += hits[:num_ok]  # claimed hits hold cached content
        if speculating:  # without, no row has drafts or lookahead slots
            drafts = np.maximum(num_computed + hits + num_new - num_tokens, 0)
            self._record_unverified(slots, np.where(ok, drafts, 0), np.where(ok, lookahead, 0))
        self.last_work = None
        self._check()
        return ok

    def _take_rejections(self, slots) -> np.ndarray | None:
        """The rows' pending rollbacks (rejected drafts, the last call's lookahead slots) that release a table
        entry, int64[R] (None: none); the others only lower the count, which the host carries: cleared now."""
        pending = self._pending_reject[slots]
        if not pending.any():
            return None
        num_computed = self._num_computed[slots][:, None]
        _, count = rollback_ranges(
            num_computed + pending[:, None], pending[:, None], self._first_live[slots], self._rules, xp=np
        )
        releases = count.sum(axis=1) > 0
        self._pending_reject[slots[~releases]] = 0
        self._counts_stale = self._counts_stale or bool((~releases & (pending > 0)).any())
        return np.where(releases, pending, 0) if releases.any() else None

    def _record_unverified(self, slots, drafts, lookahead) -> None:
        """After an allocation: the rows' draft tokens (`reject_tokens` may reject them) and lookahead slots
        (counted on the device, rolled back at the next call)."""
        self._num_drafts[slots] = drafts
        self._lookahead[slots] = lookahead
        self._pending_reject[slots] += lookahead

    def reject_tokens(self, request_id: Hashable, num_rejected_tokens: int) -> None:
        """Speculative decoding: the last `num_rejected_tokens` draft tokens of the request's last allocation
        failed verification. Its computed count drops by them (their slots take the next tokens); the
        blocks past the verified tokens go back to the pool at its next allocation (or free). Host only."""
        self.reject_tokens_batch([request_id], [num_rejected_tokens])

    def reject_tokens_batch(self, request_ids: Sequence[Hashable], num_rejected_tokens: Sequence[int]) -> None:
        """`reject_tokens` for many requests (a step's verification outcome)."""
        self._check_held()
        slots = self._slots(request_ids)
        rejected = validation.counts(request_ids, num_rejected_tokens, "num_rejected_tokens")
        over = rejected > self._num_drafts[slots]
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise ValueError(
                f"num_rejected_tokens={rejected[i]} for request {request_ids[i]!r}: its last allocation has "
                f"{self._num_drafts[slots][i]} draft tokens not rejected yet; only drafts (scheduled past the "
                "request's known tokens) can be rejected"
            )
        self._num_computed[slots] -= rejected
        self._num_drafts[slots] -= rejected
        self._num_scheduled[slots] -= rejected  # the step's metadata has the verified tokens only
        self._pending_reject[slots] += rejected
        self._num_written[slots] = np.minimum(self._num_written[slots], self._num_computed[slots])

    def _plan_step(self, slots, num_computed, num_new, hits, full, rejected=None, lookahead=0):
        """The step's work signature (`step.StepWork`) and the rows with block work int[W], from the host's
        mirror of the counts.

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
        if self.prefix_config is not None:
            unit = self.prefix_config.unit
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
        counts = (self._num_computed + self._pending_reject).astype(np.int32)
        for slot, count in self._freed_counts.items():
            counts[slot] = count
        return counts

    def _sync_counts(self) -> None:
        """Writes the host's counts to the device state if rows advanced on the host only (one dispatch)."""
        if self._counts_stale:
            self._state = self._set_counts_fn(self._state, self._device_counts())
            self._counts_stale = False

    def take_block_copies(self) -> np.ndarray:
        """int32[C, 3]: the block copies allocations made since the last call (source, destination,
        valid tokens of the block), in order; they are handed over.

        Apply them (`jaxkv.copy_blocks(cache, copies, cfg=cfg)`) before the forward pass
        that computes the allocated tokens. Both blocks of each copy stay referenced until the
        next allocation, which releases them. Empty unless hits can end inside a block.
        """
        copies = np.concatenate(self._copies) if self._copies else np.zeros((0, 3), np.int32)
        self._copies.clear()
        self._release.extend(copies[:, 1].tolist())
        return copies

    def _check_copies_taken(self) -> None:
        if self._copies:
            num = sum(len(c) for c in self._copies)
            raise ValueError(
                f"{num} block copies of earlier allocations were not taken; call "
                "take_block_copies() and apply them (jaxkv.copy_blocks) before the forward pass"
            )

    def mark_computed(self, request_ids: Sequence[Hashable] | None = None) -> None:
        """Says that the forward pass computing the requests' allocated tokens ran (None: every request's):
        what it wrote (K/V, states) is valid, and `free` may leave it findable by later requests.

        A request's next allocation says the same of its earlier steps (its computed tokens are
        computed), so only a request freed right after a step needs this: call it once the step's
        forward pass was dispatched, before freeing or preempting its requests (vLLM's scheduler does
        the same when a step's output comes back). A request freed without it makes nothing of its last
        step findable: the states that step would have saved are not indexed, and the attention blocks
        its allocation indexed (vLLM's rule: findable once scheduled) leave the index. Host only.
        """
        self._check_held()
        if request_ids is None:
            self._num_written[:] = self._num_computed
            return
        slots = self._slots(request_ids)
        self._num_written[slots] = self._num_computed[slots]

    # ---- freeing ---------------------------------------------------------------------------
    def free(self, request_id: Hashable) -> None:
        """Releases every block of the request and forgets it (its id may be added again).

        With prefix caching, its cached blocks stay findable until reused, and the state its last step
        ended on becomes findable, as far as the forward passes are known to have run (`mark_computed`)."""
        self.free_batch([request_id])

    def free_batch(self, request_ids: Sequence[Hashable]) -> None:
        """`free` for many requests; blocks go back in request order.

        The device work rides on the next allocation's dispatch (or the next read).
        """
        self._check_held()
        if self._compiled_host:  # one compiled call, its check included; the general path names an error
            slots = self._known_slots(request_ids)
            if slots is not None and self._host.free_checked(slots, self._host_counts[:3]):
                for request_id, slot in zip(request_ids, slots.tolist()):
                    del self._slot_of[request_id]
                    self._hashers[slot] = self._unhashed[slot] = None
                    self._free_slots.append(slot)
                self._check()
                return
        slots = self._slots(request_ids)
        num_computed = self._num_computed[slots]
        counts = num_computed + self._pending_reject[slots]  # rejected drafts still held
        if self._host is not None:
            written = self._num_written[slots]
            self._host.free(slots.tolist(), np.where(written >= num_computed, counts, written).tolist())
            holding = slots[:0]
        else:  # requests with nothing computed hold no block; their keys on the device must go too
            holding = slots[(counts > 0) | (self._num_uploaded[slots] > 0)]
        if holding.size:
            counts = self._num_computed[holding] + self._pending_reject[holding]
            written = self._num_written[holding]
            self._pending_free.extend(holding.tolist())
            # A rollback not applied yet does not make the verified step unknown.
            self._pending_written.extend(np.where(written >= self._num_computed[holding], counts, written).tolist())
            self._freed_counts.update(zip(holding.tolist(), counts.tolist()))
            _, count, _ = st.held_ranges(counts[:, None], self._first_live[holding], self._rules, xp=np)
            self._pending_free_entries += int(count.sum())
            self._num_free_blocks = None  # known again after the next dispatch (or a read)
        for request_id, slot in zip(request_ids, slots.tolist()):
            del self._slot_of[request_id]
            self._hashers[slot] = self._keys[slot] = self._unhashed[slot] = None
        if self._uploads:  # keys not on the device yet of a freed request: never needed
            freed = set(slots.tolist())
            self._uploads = {s: first for s, first in self._uploads.items() if s not in freed}
            self._num_uploads = sum(len(self._keys[s]) - first for s, first in self._uploads.items())
        self._num_tokens[slots] = self._num_computed[slots] = self._pending_reject[slots] = 0
        self._num_drafts[slots] = self._lookahead[slots] = self._num_keys[slots] = 0
        if self._host is None:  # the host state holds these itself
            self._num_uploaded[slots] = self._first_live[slots] = self._num_cached[slots] = 0
        self._free_slots.extend(slots.tolist())
        if self.debug_checks:
            self._flush_frees() if self._host is None else self._check()

    def _pending_ran(self) -> bool:
        """Whether every pending free's last step is known to have run (the free program without uncaching)."""
        return all(w >= self._freed_counts[s] for s, w in zip(self._pending_free, self._pending_written))

    def _flush_frees(self) -> None:
        """Applies the recorded frees on the device now (one dispatch)."""
        if not self._pending_free:
            return
        self._counts_stale = True  # the freed slots' counts (rows advanced on the host may be among them)
        self._sync_counts()
        slots = np.asarray(self._pending_free, np.int32)
        num_rows = FREE_ROWS if len(slots) <= FREE_ROWS else self.max_num_seqs
        written = None
        if self.prefix_config is not None and not self._pending_ran():
            written = self._pad(np.asarray(self._pending_written, np.int32), num_rows, 0)
        self._state = self._free_fn(self._state, self._pad(slots, num_rows, self.max_num_seqs), written)
        self._pending_free.clear()
        self._pending_written.clear()
        self._freed_counts.clear()
        self._pending_free_entries = 0
        self._num_free_blocks = None  # read on demand: a later dispatch may donate this state
        self._check()

    # ---- reading ---------------------------------------------------------------------------
    def get_block_ids(self, request_id: Hashable) -> tuple[tuple[int, ...], ...]:
        """Per group, the block ids the request was given, NULL_BLOCK where the group no longer needs one."""
        self._check_held()
        slot = self._slot(request_id)
        n = int(self._num_computed[slot])
        tables = self.state.block_tables if self._host is None else self._host.tables
        rows = np.asarray(jax.device_get(tables[:, slot, :]))
        return tuple(tuple(rows[g, : cdiv(n, bs)].tolist()) for g, bs in enumerate(self._block_sizes))

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus evictable cached ones, the null block excluded."""
        self._check_held()
        if self._host is not None:
            return self._host.num_free
        if self._num_free_blocks is None:
            self._flush_frees()
            self._num_free_blocks = int(self._state.pool.num_free_blocks)
        return self._num_free_blocks

    @property
    def num_requests(self) -> int:
        return len(self._slot_of)

    @property
    def state(self) -> st.ManagerState:
        """The device state (for composing the pure functions of `jaxkv.core.state` in a jitted step).

        Counts advanced on the host only, pending frees and unit keys are applied first. Pass
        `prefix=mgr.prefix_config` to the transitions.
        """
        self._check_held()
        if self._host is not None:
            return to_state(self._host)
        self._sync_counts()
        self._flush_frees()
        self._flush_uploads()
        return self._state

    # ---- prefix-cache keys -----------------------------------------------------------------
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
        self._check()

    def take_state(self) -> st.ManagerState:
        """Hands the device state to a jitted loop that donates it (e.g. on-device decode steps).

        The manager holds no state until `adopt_state` gives the loop's result back: until then every
        call that reads or changes the state or its requests' counts raises and changes nothing (only
        `add_request` and reads of the host's counts go on). Rejected drafts are rolled back first (an
        allocation of no tokens for their requests), so every count in the state is verified.
        """
        pending = [rid for rid, slot in self._slot_of.items() if self._pending_reject[slot]]
        if pending:
            self.allocate_slots_batch(pending, [0] * len(pending))
        state = self.state
        self._state = None
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
        slots = self._slots(request_ids)
        rejected = np.zeros(len(slots), np.int64)
        if num_rejected_tokens is not None:
            rejected = validation.counts(request_ids, num_rejected_tokens, "num_rejected_tokens")
        pinned = np.asarray(pinned_copies).reshape(-1)
        if pinned.size and (pinned.dtype.kind not in "iu" or pinned.min() < 0 or pinned.max() >= self.cfg.num_blocks):
            raise ValueError(
                f"pinned_copies={validation.short(pinned_copies)} must be block ids in [0, {self.cfg.num_blocks})"
            )
        num_computed, first_live, num_free = jax.device_get(
            (state.num_computed[slots], state.first_live_idx[:, slots].T, state.pool.num_free_blocks)
        )
        if (rejected > num_computed).any():
            i = int(np.flatnonzero(rejected > num_computed)[0])
            raise ValueError(
                f"num_rejected_tokens={rejected[i]} for request {request_ids[i]!r}: the loop computed "
                f"{num_computed[i]} tokens of it"
            )
        self._taken = False
        if self._host is None:
            self._state = state
        else:
            load_state(self._host, state)
            for slot in self._slot_of.values():  # the hashers' keys
                if self._hashers[slot] is not None:
                    self._host.set_keys(slot, self._hashers[slot].keys)
        self._num_computed[slots] = num_computed - rejected
        self._num_written[slots] = num_computed - rejected  # the loop ran each step it allocated
        self._pending_reject[slots] = rejected
        self._num_drafts[slots] = self._lookahead[slots] = self._num_scheduled[slots] = 0
        self._first_live[slots] = first_live
        if state.prefix is not None:
            self._num_cached[slots] = jax.device_get(state.prefix.num_cached_blocks[:, slots].T)
        self._num_free_blocks = int(num_free)
        self._release.extend(int(d) for d in pinned if d != NULL_BLOCK)
        self._check()

    def slots_of(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """int32[R]: the state slot of each request."""
        return self._slots(request_ids)

    def block_tables(self, request_ids: Sequence[Hashable]) -> jax.Array:
        """int32[G, R, M] on device: the requests' block tables as the attention kernels take them.

        Raises if block copies were not taken (`take_block_copies`)."""
        self._check_held()
        self._check_copies_taken()
        return st.block_tables(self._tables_state(), self._slots(request_ids))

    def slot_mappings(
        self, request_ids: Sequence[Hashable], num_new_tokens: Sequence[int], num_tokens: int
    ) -> jax.Array:
        """int32[G, T] on device: slots of the tokens just allocated (T = `num_tokens`, padded with −1);
        lookahead slots, which follow them, are left out. Call it before `reject_tokens`.

        Raises if block copies were not taken (`take_block_copies`)."""
        slots, num_new = self._step_rows(request_ids, num_new_tokens, num_tokens)
        return st.slot_mappings(
            self._tables_state(), slots, num_new, self._lookahead_of(slots), cfg=self.cfg, num_tokens=num_tokens
        )

    def _step_rows(self, request_ids, num_new_tokens, num_tokens) -> tuple[np.ndarray, np.ndarray]:
        """The slots and the checked new-token counts of a step's metadata: each count at most what the
        request's last allocation scheduled (its verified drafts included), all of them within `num_tokens`."""
        self._check_held()
        self._check_copies_taken()
        slots = self._slots(request_ids)
        num_new = validation.counts(request_ids, num_new_tokens, "num_new_tokens")
        validation.count(num_tokens, "num_tokens")
        over = num_new > self._num_scheduled[slots]
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise ValueError(
                f"num_new_tokens={num_new[i]} for request {request_ids[i]!r}: its last allocation scheduled "
                f"{self._num_scheduled[slots[i]]} tokens; give the counts of the step's allocation"
            )
        if num_new.sum() > num_tokens:
            raise ValueError(f"{num_tokens=} cannot hold the {num_new.sum()} scheduled tokens")
        return slots, num_new

    def _lookahead_of(self, slots, num_rows: int | None = None) -> np.ndarray | None:
        """int32[R] the rows' lookahead slots (padded to `num_rows`), None if no row has one."""
        lookahead = self._lookahead[slots]
        return None if not lookahead.any() else self._pad(lookahead, num_rows or len(slots), 0)

    def step_metadata(
        self,
        request_ids: Sequence[Hashable],
        num_new_tokens: Sequence[int],
        *,
        num_tokens: int,
        num_rows: int | None = None,
    ) -> StepMetadata:
        """What the model needs for the step that just allocated `num_new_tokens` for `request_ids`
        (`jaxkv.metadata.StepMetadata`, on device): block tables, slot mappings, `seq_lens`,
        `query_start_loc` and positions, the tokens packed in request order into T = `num_tokens`
        entries, the rows padded to `num_rows` (default `max_num_seqs`: one shape for every step).
        Lookahead slots are left out. Call it before `reject_tokens`. Each count is at most what the
        request's last allocation scheduled (ValueError otherwise: a larger one would give positions and
        slots of tokens that step did not allocate).

        Raises if block copies were not taken (`take_block_copies`)."""
        slots, num_new = self._step_rows(request_ids, num_new_tokens, num_tokens)
        num_rows = self.max_num_seqs if num_rows is None else validation.count(num_rows, "num_rows", minimum=1)
        if len(request_ids) > num_rows:
            raise ValueError(f"{num_rows=} cannot hold the {len(request_ids)} requests")
        return _step_metadata(
            self._tables_state(),
            self._pad(slots, num_rows, self.max_num_seqs),
            self._pad(num_new, num_rows, 0),
            self._lookahead_of(slots, num_rows),
            cfg=self.cfg,
            num_tokens=num_tokens,
        )

    def _tables_state(self) -> st.ManagerState:
        """The state the model-facing reads take (block tables and counts; the host backend's as arrays)."""
        if self._host is None:
            return self.state
        return st.ManagerState(
            pool=None,
            block_tables=jnp.asarray(self._host.tables),
            first_live_idx=None,
            num_computed=jnp.asarray(self._host.num_computed, jnp.int32),
            prefix=None,
        )

    # ---- helpers ---------------------------------------------------------------------------
    def _slot(self, request_id: Hashable) -> int:
        try:
            return self._slot_of[validation.hashable_id(request_id)]
        except KeyError:
            raise KeyError(f"unknown request id {request_id!r}; add it with add_request first") from None

    def _known_slots(self, request_ids: Sequence[Hashable]) -> np.ndarray | None:
        """int64[R]: the requests' slots, unchecked for repeats (the compiled calls check); None where one is
        unknown (`_slots` names it). Raises if `request_ids` is not a sequence of hashable ids."""
        validation.sequence(request_ids, "request_ids")
        try:
            return np.fromiter(map(self._slot_of.__getitem__, request_ids), np.int64, len(request_ids))
        except KeyError:
            return None
        except TypeError:
            for request_id in request_ids:
                validation.hashable_id(request_id)
            raise

    def _slots(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """int32[R]: the requests' slots; raises naming an unknown or repeated id."""
        return self._checked_slots(request_ids, self._known_slots(request_ids))

    def _checked_slots(self, request_ids: Sequence[Hashable], slots: np.ndarray | None) -> np.ndarray:
        """`_slots` from the `_known_slots` already looked up."""
        if slots is None:
            self._slot(next(r for r in request_ids if r not in self._slot_of))
        slots = slots.astype(np.int32)
        if len(slots) > 1 and np.bincount(slots).max() > 1:
            seen = set()
            duplicate = next(r for r in request_ids if r in seen or seen.add(r))
            raise ValueError(f"request {duplicate!r} appears twice in one batch")
        return slots

    @staticmethod
    def _pad(values: np.ndarray, num_rows: int, fill: int) -> np.ndarray:
        padded = np.full(num_rows, fill, np.int32)
        padded[: len(values)] = values
        return padded

    def _num_rows(self, num_requests: int) -> int:
        return min(SMALL_ROWS, self.max_num_seqs) if num_requests <= SMALL_ROWS else self.max_num_seqs

    def warm_up(self, variants: Iterable[StepWork] = ()) -> None:
        """Compiles the shapes the manager dispatches (calls that change nothing), so that no step of a
        serving loop waits for a compilation: the full program (`StepWork()`, which serves any step) and
        the work signatures `variants` (e.g. a previous run's `step_variants`), for every row count and
        with and without pending frees, as far as MAX_PROGRAMS allows. Other signatures compile on first
        use (set JAX's persistent compilation cache to keep them across runs). Lookups compile per key
        width on first use."""
        self._check_held()
        if self._host is not None:  # nothing to compile
            return
        uploads = None
        if self.prefix_config is not None:
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

    def _check(self) -> None:
        if self.debug_checks:
            state = self._state if self._host is None else to_state(self._host)
            check_invariants(self.cfg, state, self.prefix_config)
