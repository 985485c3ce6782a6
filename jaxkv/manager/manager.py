"""KVCacheManager: vLLM's manager vocabulary over one engine, the host engine by default.

Dimensions: R requests in one call, G groups, M max blocks per request, T tokens.

The manager keeps, on the host, the map from request id to state slot and each request's tokens, counts and
unit hasher, so bad input is caught before anything moves; its engine keeps the block state and applies the
transitions (`jaxkv.manager.engine.Engine`): `HostEngine` in place on the host (the default), or `JaxEngine`
over the jitted pure transitions of `jaxkv.core.state` (`backend="jax"`). Every `*_batch` call is one engine
call for many requests; the per-request calls are batches of one.

Prefix caching (on by default): `add_request` and `append_token_ids` hash the request's full units on the
host (`jaxkv.UnitHasher`: chained SHA-256, the cache salt in the first unit) and give the keys to the engine;
an allocation caches every block whose tokens it schedules. `get_computed_tokens` looks the request's keys up
(nothing changes).

Hits inside a block (a `prefix_match_unit` finer than a full-attention or state group's block,
`jaxkv.prefix.tails`): an allocation may make block copies. Take them with `take_block_copies()` and apply
them (`jaxkv.copy_blocks`) before the forward pass that computes the allocated tokens; both blocks of a copy
stay referenced until the next allocation after it was taken. Reading block tables or slot mappings with
copies not taken raises.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

import jax
import numpy as np

from jaxkv import validation
from jaxkv.core import state as st
from jaxkv.core.step import StepWork
from jaxkv.manager.device_loop import HandOver
from jaxkv.manager.engine import Engine
from jaxkv.manager.requests import Requests
from jaxkv.metadata import StepMetadata, step_metadata
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import cdiv
from jaxkv.prefix.hashing import HashMode, UnitHasher
from jaxkv.prefix.state import PrefixCacheConfig

PREFIX_STATS = ("lookups", "lookup_tokens", "hit_tokens", "reconciliation_miss_tokens", "claimed_hit_tokens")

_step_metadata = jax.jit(step_metadata, static_argnames=("cfg", "num_tokens"))


def _engine_class(backend: str) -> type:
    """The engine of `backend`, imported on first use: what it runs (numba's loops, jax's programs) loads with it."""
    if backend == "host":
        from jaxkv.manager.host_engine import HostEngine

        return HostEngine
    from jaxkv.manager.jax_engine import JaxEngine

    return JaxEngine


def _pad(values: np.ndarray, num_rows: int, fill: int) -> np.ndarray:
    padded = np.full(num_rows, fill, np.int32)
    padded[: len(values)] = values
    return padded


class KVCacheManager(HandOver):
    """Host facade: request ids in, block ids and ok flags out (see DESIGN.md "Public API").

    `backend="host"` (default): the state in host memory, updated in place by compiled loops; a step's
    bookkeeping costs what it moves, with nothing compiled per shape. `backend="jax"`: the same transitions,
    with the same outcome block for block, as jitted pure functions over a `ManagerState` on `device`
    (default: JAX's default device); each allocation dispatches a program compiled for its work signature
    (`specialize_steps`; `step_variants` counts the steps of each). Either hands its state to a jitted loop
    (`take_state`) and takes it back (`adopt_state`).

    `debug_checks=True` runs `jaxkv.check_invariants` after every transition (slow; for tests and debugging).
    `prefix_match_unit`: tokens per hash unit (default: the gcd of the groups' block sizes; it must divide each
    of them). `hash_mode="vllm"` hashes units exactly as vLLM does.

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
        backend: str = "host",
    ):
        max_num_seqs, num_speculative_tokens = validation.manager_options(
            cfg, max_num_seqs, num_speculative_tokens, use_eagle, backend, device
        )
        self.num_speculative_tokens = num_speculative_tokens
        self.use_eagle = bool(use_eagle)
        self.cfg = cfg
        self.max_num_seqs = max_num_seqs
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.debug_checks = debug_checks
        self.device = device
        if prefix_match_unit is not None and not self.enable_prefix_caching:
            raise ValueError(f"{prefix_match_unit=} given, but prefix caching is off")
        self.prefix_config = (
            PrefixCacheConfig.for_config(cfg, prefix_match_unit) if self.enable_prefix_caching else None
        )
        self.hash_mode = hash_mode
        self.backend = backend
        self._requests = Requests(max_num_seqs, cfg.max_model_len, self.prefix_config, hash_mode)
        self._counts = counts = self._requests.counts
        self._engine: Engine = _engine_class(backend)(
            cfg, self.prefix_config, counts, max_num_seqs=max_num_seqs, use_eagle=self.use_eagle,
            speculating=bool(num_speculative_tokens), specialize_steps=bool(specialize_steps), device=device,
            debug_checks=debug_checks,
        )  # fmt: skip
        self._taken = False  # the state was handed over (take_state)
        self._loop: tuple[list, np.ndarray, np.ndarray] | None = None  # a device loop's ids, slots, reservations
        self._unsettled: tuple[list, np.ndarray] | None = None  # the ids and slots of a loop that ended (`_ready`)
        self._copies: list[np.ndarray] = []  # block copies not taken yet: int32[., 3]
        self._release: list[int] = []  # destinations of copies taken, their pins not released yet
        self.prefix_stats = dict.fromkeys(PREFIX_STATS, 0)
        self._block_sizes = tuple(g.block_size for g in cfg.groups)
        self._state_block_sizes = tuple({g.block_size for g in cfg.groups if g.kind == "mamba"})

    @property
    def step_variants(self) -> dict[StepWork, int]:
        """The jitted engine's work signatures, and how many steps ran each (the host engine's: empty)."""
        return self._engine.step_variants

    @property
    def last_work(self) -> StepWork | None:
        """The last allocation's work signature on the jitted engine (None: no dispatch, or the host engine)."""
        return self._engine.last_work

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
        slot, keys = self._requests.add(request_id, prompt_token_ids, cache_salt, unit_hasher)
        if keys is not None:
            self._engine.set_keys(slot, keys)

    def get_computed_tokens(self, request_id: Hashable) -> int:
        """Tokens of the request found in the prefix cache, valid for every group; changes nothing.

        At most `num_tokens − 1` (the last token is always recomputed); 0 without prefix caching.
        """
        return int(self.get_computed_tokens_batch([request_id])[0])

    def get_computed_tokens_batch(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """`get_computed_tokens` for many requests, in one engine call: int64[R]."""
        self._ready()
        slots = self._requests.slots(request_ids)
        if self.prefix_config is None or not len(slots):
            return np.zeros(len(slots), np.int64)
        hits, stats = self._engine.lookup(slots, self.use_eagle)
        for name, value in zip(PREFIX_STATS[:4], stats):
            self.prefix_stats[name] += value
        return hits

    def _ready(self) -> None:
        """`_check_held`, then the rows of a device loop that ended (`hand_back`) are settled: every call that
        reads or changes the state sees what an allocation after the loop would leave."""
        self._check_held()
        if self._unsettled is not None:
            request_ids, slots = self._unsettled
            self._unsettled = None
            self._settle(request_ids, slots)

    def _check_held(self) -> None:
        """Raises if the state was handed over (`take_state`): every call that reads or changes it waits."""
        if self._taken:
            raise ValueError("the state was handed over (take_state); give it back with adopt_state first")
        if self._loop is not None:
            raise ValueError(
                f"a device loop holds requests {validation.short(self._loop[0])} (hand_over); end it with "
                "hand_back first"
            )

    def append_token_ids(self, request_id: Hashable, new_token_ids: Sequence[int]) -> None:
        """Records tokens the model produced for the request: the step that produced them ran, so
        what it wrote counts as written (as after `mark_computed`)."""
        self.append_token_ids_batch([request_id], [new_token_ids])

    def append_token_ids_batch(self, request_ids: Sequence[Hashable], new_token_ids: Sequence[Sequence[int]]) -> None:
        """`append_token_ids` for many requests (a step's sampled tokens). With prefix caching, per request one
        list extend, and only the requests that complete a hash unit are hashed; without, only counts change."""
        self._ready()
        self._append(request_ids, new_token_ids)

    def _append(self, request_ids, new_token_ids, lengths=None) -> None:
        slots, counts, keys = self._requests.append(request_ids, new_token_ids, lengths)
        if len(slots):  # the units the new tokens complete: their keys go to the engine at once
            self._engine.append_keys(slots, counts, keys)

    def num_tokens(self, request_id: Hashable) -> int:
        """Prompt plus appended tokens of the request."""
        return int(self._counts.num_tokens[self._requests.slot(request_id)])

    def num_computed_tokens(self, request_id: Hashable) -> int:
        """Tokens given slots so far (they count as computed once their step ran)."""
        return int(self._counts.num_computed[self._requests.slot(request_id)])

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
        """`allocate_slots` for many requests in priority order, in one engine call.

        Returns ok bool[R]. The first request that does not fit, and every one
        after it, gets False and keeps its blocks (the scheduler preempts and
        retries from there). A request with `full_sequence_must_fit` (one flag,
        or one per request) is taken only if blocks for all its tokens (prompt
        and appended, per group capped at what one request can hold) fit: vLLM's
        admission gate.
        """
        self._ready()
        slots = self._requests.known_slots(request_ids)
        fast = self._engine.checks_counts and slots is not None  # its compiled call checks the counts' range
        num_new = validation.counts(request_ids, num_new_tokens, "num_new_tokens", check_range=not fast)
        hits = lookahead = np.zeros(len(request_ids), np.int64)  # read only
        if num_new_computed_tokens is not None:
            hits = validation.counts(
                request_ids, num_new_computed_tokens, "num_new_computed_tokens", check_range=not fast
            )
        must_fit = validation.flags(request_ids, full_sequence_must_fit, "full_sequence_must_fit")
        if num_lookahead_tokens is not None:
            lookahead = validation.counts(request_ids, num_lookahead_tokens, "num_lookahead_tokens")
        result = None
        if fast and (num_lookahead_tokens is None or not lookahead.any()):
            result = self._engine.allocate_fast(slots, num_new, hits, must_fit, self._release)
        if result is not None:
            num_ok, num_hit, copies = result
            if len(copies):
                self._copies.append(copies)
            self.prefix_stats["claimed_hit_tokens"] += num_hit
            ok = np.arange(len(slots)) < num_ok
        else:  # the general path; its errors name what is wrong
            slots = self._requests.checked_slots(request_ids, slots)
            if fast:
                num_new = validation.counts(request_ids, num_new_tokens, "num_new_tokens")
                if num_new_computed_tokens is not None:
                    hits = validation.counts(request_ids, num_new_computed_tokens, "num_new_computed_tokens")
            ok = self._allocate_checked(request_ids, slots, num_new, hits, must_fit, lookahead)
        self._counts.num_scheduled[slots] = num_new * ok
        return ok

    def _allocate_checked(self, request_ids, slots, num_new, hits, must_fit, lookahead) -> np.ndarray:
        """`allocate_slots_batch` with its arguments' types checked: the rules on the counts, then the engine's
        allocation, then the counts."""
        c = self._counts
        num_computed, num_tokens = c.num_computed[slots], c.num_tokens[slots]
        validation.allocation(
            request_ids, num_computed, num_tokens, num_new, hits, lookahead,
            caching=self.prefix_config is not None, num_speculative_tokens=self.num_speculative_tokens,
            max_model_len=self.cfg.max_model_len,
        )  # fmt: skip
        c.num_written[slots] = num_computed  # this call says the rows' earlier steps ran
        full = np.where(must_fit, num_tokens, 0)
        ok, num_hit, copies = self._engine.allocate(slots, num_new, hits, full, lookahead, self._release)
        if len(copies):
            self._copies.append(copies)
        self.prefix_stats["claimed_hit_tokens"] += num_hit
        c.num_computed[slots[ok]] += (num_new + hits)[ok]
        c.num_written[slots[ok]] += hits[ok]  # claimed hits hold cached content
        if self.num_speculative_tokens:  # without, no row has drafts or lookahead slots
            drafts = np.maximum(num_computed + hits + num_new - num_tokens, 0)
            c.num_drafts[slots] = np.where(ok, drafts, 0)
            c.lookahead[slots] = np.where(ok, lookahead, 0)
            c.pending_reject[slots] += c.lookahead[slots]  # counted by the engine, rolled back at the next call
        return ok

    def reject_tokens(self, request_id: Hashable, num_rejected_tokens: int) -> None:
        """Speculative decoding: the last `num_rejected_tokens` draft tokens of the request's last allocation
        failed verification. Its computed count drops by them (their slots take the next tokens); the
        blocks past the verified tokens go back to the pool at its next allocation (or free)."""
        self.reject_tokens_batch([request_id], [num_rejected_tokens])

    def reject_tokens_batch(self, request_ids: Sequence[Hashable], num_rejected_tokens: Sequence[int]) -> None:
        """`reject_tokens` for many requests (a step's verification outcome)."""
        self._ready()
        slots = self._requests.slots(request_ids)
        rejected = validation.counts(request_ids, num_rejected_tokens, "num_rejected_tokens")
        c = self._counts
        over = rejected > c.num_drafts[slots]
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise ValueError(
                f"num_rejected_tokens={rejected[i]} for request {request_ids[i]!r}: its last allocation has "
                f"{c.num_drafts[slots][i]} draft tokens not rejected yet; only drafts (scheduled past the "
                "request's known tokens) can be rejected"
            )
        c.num_computed[slots] -= rejected
        c.num_drafts[slots] -= rejected
        c.num_scheduled[slots] -= rejected  # the step's metadata has the verified tokens only
        c.pending_reject[slots] += rejected
        c.num_written[slots] = np.minimum(c.num_written[slots], c.num_computed[slots])

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
        its allocation indexed (vLLM's rule: findable once scheduled) leave the index.
        """
        self._ready()
        c = self._counts
        if request_ids is None:
            c.num_written[:] = c.num_computed
            return
        slots = self._requests.slots(request_ids)
        c.num_written[slots] = c.num_computed[slots]

    # ---- freeing ---------------------------------------------------------------------------
    def free(self, request_id: Hashable) -> None:
        """Releases every block of the request and forgets it (its id may be added again).

        With prefix caching, its cached blocks stay findable until reused, and the state its last step
        ended on becomes findable, as far as the forward passes are known to have run (`mark_computed`)."""
        self.free_batch([request_id])

    def free_batch(self, request_ids: Sequence[Hashable]) -> None:
        """`free` for many requests; blocks go back in request order."""
        self._ready()
        slots = self._requests.known_slots(request_ids)
        if slots is None or not self._engine.free_fast(slots):  # the general path names an error
            slots = self._requests.slots(request_ids)
            c = self._counts
            num_computed, written = c.num_computed[slots], c.num_written[slots]
            counts = num_computed + c.pending_reject[slots]  # rejected drafts still held
            # A rollback not applied yet does not make the verified step unknown.
            self._engine.free(slots, counts, np.where(written >= num_computed, counts, written))
            c.num_tokens[slots] = c.num_computed[slots] = c.pending_reject[slots] = 0
            c.num_drafts[slots] = c.lookahead[slots] = 0
        self._requests.forget(request_ids, slots)

    # ---- reading ---------------------------------------------------------------------------
    def get_block_ids(self, request_id: Hashable) -> tuple[tuple[int, ...], ...]:
        """Per group, the block ids the request was given, NULL_BLOCK where the group no longer needs one."""
        self._ready()
        slot = self._requests.slot(request_id)
        n = int(self._counts.num_computed[slot])
        rows = self._engine.block_table(slot)
        return tuple(tuple(rows[g, : cdiv(n, bs)].tolist()) for g, bs in enumerate(self._block_sizes))

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus evictable cached ones, the null block excluded."""
        self._ready()
        return self._engine.num_free_blocks

    @property
    def num_requests(self) -> int:
        return len(self._requests.slot_of)

    @property
    def state(self) -> st.ManagerState:
        """The state as a `ManagerState` (for composing the pure functions of `jaxkv.core.state` in a jitted
        step): the jitted engine's own, its deferred work applied first, or the host engine's converted.
        Pass `prefix=mgr.prefix_config` to the transitions.
        """
        self._ready()
        return self._engine.to_state()

    def slots_of(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """int32[R]: the state slot of each request."""
        return self._requests.slots(request_ids)

    def block_tables(self, request_ids: Sequence[Hashable]) -> jax.Array:
        """int32[G, R, M] on device: the requests' block tables as the attention kernels take them.

        Raises if block copies were not taken (`take_block_copies`)."""
        self._ready()
        self._check_copies_taken()
        return st.block_tables(self._engine.tables_state(), self._requests.slots(request_ids))

    def slot_mappings(
        self, request_ids: Sequence[Hashable], num_new_tokens: Sequence[int], num_tokens: int
    ) -> jax.Array:
        """int32[G, T] on device: slots of the tokens just allocated (T = `num_tokens`, padded with −1);
        lookahead slots, which follow them, are left out. Call it before `reject_tokens`.

        Raises if block copies were not taken (`take_block_copies`)."""
        slots, num_new = self._step_rows(request_ids, num_new_tokens, num_tokens)
        return st.slot_mappings(
            self._engine.tables_state(), slots, num_new, self._lookahead_of(slots), cfg=self.cfg, num_tokens=num_tokens
        )

    def _step_rows(self, request_ids, num_new_tokens, num_tokens) -> tuple[np.ndarray, np.ndarray]:
        """The slots and the checked new-token counts of a step's metadata: each count at most what the
        request's last allocation scheduled (its verified drafts included), all of them within `num_tokens`."""
        self._ready()
        self._check_copies_taken()
        slots = self._requests.slots(request_ids)
        return slots, validation.step_counts(request_ids, num_new_tokens, self._counts.num_scheduled[slots], num_tokens)

    def _lookahead_of(self, slots, num_rows: int | None = None) -> np.ndarray | None:
        """int32[R] the rows' lookahead slots (padded to `num_rows`), None if no row has one."""
        lookahead = self._counts.lookahead[slots]
        return None if not lookahead.any() else _pad(lookahead, num_rows or len(slots), 0)

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
            self._engine.tables_state(),
            _pad(slots, num_rows, self.max_num_seqs),
            _pad(num_new, num_rows, 0),
            self._lookahead_of(slots, num_rows),
            cfg=self.cfg,
            num_tokens=num_tokens,
        )

    def warm_up(self, variants: Iterable[StepWork] = ()) -> None:
        """Compiles what the engine dispatches (calls that change nothing), so that no step of a serving loop
        waits for a compilation. The host engine has nothing to compile. The jitted engine compiles the full
        program (`StepWork()`, which serves any step) and the work signatures `variants` (e.g. a previous
        run's `step_variants`), for every row count and with and without pending frees, as far as
        `jaxkv.manager.jax_engine.MAX_PROGRAMS` allows; other signatures compile on first use (set JAX's
        persistent compilation cache to keep them across runs), lookups per key width on first use."""
        self._ready()
        self._engine.warm_up(variants)
