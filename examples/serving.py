"""A continuous-batching serving loop: jaxkv manages the cache, the example model computes.

Dimensions: R request rows (`max_num_seqs`), T tokens per step
(`max_num_batched_tokens`), G KV cache groups, M max blocks per request,
V vocabulary, N decode steps in one device loop.

One engine step, on the host (the scheduler of ../shared/workloads/serving-workload.md):
  1. running requests, in admission order, get their next prefill chunk or
     decode token; if the pool runs dry, the most recently admitted request is
     preempted (freed; it resumes later by recomputing, helped by the prefix cache);
  2. if nothing was preempted, waiting requests are admitted with their
     prefix-cache hit claimed;
  3. the block copies the allocations made (hits inside a block) are applied
     (`jaxkv.copy_blocks`); one jitted model step takes the step's `jaxkv.StepMetadata`
     (`mgr.step_metadata`): each layer's `jaxkv.attend` writes the new K/V and attends
     through its group's block table, and the requests whose tokens are all computed
     sample their next token (greedy); the manager is told the step ran
     (`mgr.mark_computed`), so that the states it wrote may be cached.
With state (Mamba / linear-attention) groups, prefill chunks end at block ends
and at the prompt tail's final hash-unit boundary (vLLM's "align" mode), where the
manager saves a state that later requests can resume from.
When every running request is decoding and nobody waits, `decode_steps`
decode steps run in one jitted `lax.scan`: the manager reserves the steps'
slots first and hands over only the rows' block tables and counts
(`mgr.hand_over`, as vLLM's multi-step scheduler reserved lookahead slots),
`jaxkv.step_metadata` gives each step's metadata from them, and
`mgr.hand_back` takes the tokens produced, gives the unused slots back and
makes the filled blocks findable.

Speculative decoding (`proposer`: `ngram_proposer(K)`, prompt lookup, or a `DraftModel`, the target's first
layers): a decoding request schedules its next token and up to K draft tokens (a draft model proposes them
after the allocation, one pass per draft, through the target's cache); the step verifies them greedily
(a draft is accepted while it equals the target's argmax before it), the accepted drafts and the target's
next token are emitted, and the manager rolls the rejected drafts back (`reject_tokens`). Greedy
speculative decoding emits exactly the tokens of greedy decoding. The on-device loop proposes
(`_propose_ngram`, `_draft_passes`) and verifies the same way inside its `lax.scan`; a rejected draft's slot
takes the next token.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from sharding import cache_sharding, out_shardings

import jaxkv
from jaxkv.manager import KVCacheManager


@dataclasses.dataclass
class Request:
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()  # the request ends after producing one of these
    output: list[int] = dataclasses.field(default_factory=list)
    drafts: list[int] = dataclasses.field(default_factory=list)  # draft tokens scheduled this step
    num_computed: int = 0  # tokens whose K/V is in the cache (0 while waiting)
    num_added: int = 0  # tokens given to the manager at admission (its prompt: the tail's state is saved)
    num_preemptions: int = 0
    logits: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # position -> logits [V]

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens or bool(self.output and self.output[-1] in self.eos_token_ids)


@dataclasses.dataclass
class Stats:
    steps: int = 0
    device_loops: int = 0
    tokens_computed: int = 0
    tokens_generated: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    block_copies: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    peak_blocks_per_group: list[int] = dataclasses.field(default_factory=list)
    seconds: float = 0.0


def ngram_proposer(num_drafts: int, max_ngram: int = 3):
    """Prompt-lookup decoding: proposes the `num_drafts` tokens that followed the latest earlier occurrence
    of the request's last n tokens (the longest n ≤ `max_ngram` that occurred); none if no suffix did."""

    def propose(tokens: list[int]) -> list[int]:
        for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start : start + n] == suffix:
                    return tokens[start + n : start + n + num_drafts]
        return []

    propose.num_drafts = num_drafts
    return propose


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A draft model for speculative decoding: the target's first `num_layers` layers and its head (same
    tokenizer and weights). Its layers' K/V are the target's own at every verified position, so it reads
    and writes the target's cache: each of its `num_drafts` passes writes one position that the
    verification pass then rewrites."""

    num_drafts: int
    num_layers: int


def _model_step(graphdef, mesh, params, cache, tokens, meta: jaxkv.StepMetadata, num_layers=None):
    model = nnx.merge(graphdef, params)
    if num_layers is None:  # the whole model (Qwen3-Next's takes no num_layers: no draft model for it)
        return model.forward_paged(tokens, cache, meta, mesh)
    return model.forward_paged(tokens, cache, meta, mesh, num_layers=num_layers)


def _propose_ngram(history, length, num_drafts: int, max_ngram: int = 3):
    """`ngram_proposer` on device: history int32[R, L] each row's tokens, length int32[R] how many.
    Returns (drafts int32[R, K], count int32[R])."""
    num_rows, max_len = history.shape
    pos = jnp.arange(max_len, dtype=jnp.int32)
    rows = jnp.arange(num_rows)
    found, follows = jnp.zeros(num_rows, bool), jnp.zeros(num_rows, jnp.int32)
    for n in range(max_ngram, 0, -1):  # the longest suffix that occurred earlier wins
        # An occurrence at [s, s + n) with s + n < length (not the suffix itself).
        match = (pos[None, :] <= length[:, None] - n - 1) & (length[:, None] > n)
        for i in range(n):
            suffix_token = history[rows, jnp.maximum(length - n + i, 0)]
            match &= history[:, jnp.minimum(pos + i, max_len - 1)] == suffix_token[:, None]
        last = jnp.max(jnp.where(match, pos[None, :], -1), axis=1)
        hit = (last >= 0) & ~found
        follows = jnp.where(hit, last + n, follows)
        found |= hit
    drafts = jnp.take_along_axis(history, jnp.minimum(follows[:, None] + jnp.arange(num_drafts), max_len - 1), axis=1)
    return drafts, jnp.where(found, jnp.clip(length - follows, 0, num_drafts), 0)


def _draft_passes(graphdef, mesh, kv_cfg, num_layers, max_drafts, params, cache, state, req_slots, token, num_drafts):
    """A `DraftModel`'s drafts, after the allocation that gave them slots. Pass j computes each row's position
    n + j (n: its verified tokens; the input is its next token, then its drafts) through the first
    `num_layers` layers, writing their K/V, and proposes the token after it. token int32[R]; num_drafts
    int32[R] ≤ `max_drafts` K (static; 0: no pass). Returns (cache, drafts int32[R, K])."""
    drafts = []
    for j in range(max_drafts):
        active = num_drafts > j
        # The row's count ends after its drafts: its position n + j is num_drafts − j before the end.
        meta = jaxkv.step_metadata(
            state, req_slots, active.astype(jnp.int32), num_drafts - j, cfg=kv_cfg, num_tokens=req_slots.shape[0]
        )
        packed = token[jnp.argsort(~active, stable=True)]  # the active rows' tokens, in row order
        logits, cache = _model_step(graphdef, mesh, params, cache, packed, meta, num_layers=num_layers)
        proposed = jnp.argmax(logits[meta.query_start_loc[:-1]], axis=-1).astype(jnp.int32)
        drafts.append(proposed)
        token = jnp.where(active, proposed, token)
    return cache, jnp.stack(drafts, axis=1)


def _decode_loop(
    graphdef,
    mesh,
    kv_cfg,
    num_drafts,
    draft_layers,
    num_steps,
    params,
    cache,
    rows_state,
    req_slots,
    num_reserved,
    history,
    length,
    remaining,
    eos,
):
    """N decode steps on device through the slots `KVCacheManager.hand_over` reserved: write and attend,
    sample (and verify drafts); repeat. Nothing is allocated here.

    rows_state, req_slots, num_reserved: the hand-over's `LoopRows` (the rows' block tables, and the tokens
    each may compute, from its computed count on); history int32[R, L] each row's tokens, length int32[R] how
    many (the last is the token the row computes next); remaining int32[R] tokens each row may still produce;
    eos int32[R, E] each row's EOS ids (-1 padding: a row stops after producing one). With `num_drafts` K > 0
    (static), each row also schedules up to K drafts, verified greedily (a rejected draft's slot takes the
    next token): prompt lookup (`_propose_ngram`), or with `draft_layers` (static) K passes of the target's
    first layers (`DraftModel`).

    Returns the cache, per step (leading axis N) and row: produced bool, emitted int32 (tokens produced: the
    accepted drafts and the next token, cut at EOS and `remaining`), tokens int32[.., 1 + K] and logits
    float32[.., 1 + K, V] (the first `emitted` are the produced tokens and their positions' logits); then the
    drafts proposed and accepted.
    """
    num_rows = req_slots.shape[0]
    row = req_slots < num_rows
    width = 1 + num_drafts  # tokens per row and step
    offsets = jnp.arange(width, dtype=jnp.int32)
    start = length  # the row's tokens when the loop starts: it computes from position start − 1 on

    def step(carry, _):
        cache, history, length, left, stopped, counts = carry
        room = jnp.minimum(left, num_reserved - (length - start))  # tokens the row may compute in this step
        produced = row & (room > 0) & ~stopped
        token = history[jnp.arange(num_rows), length - 1]
        drafts, num_new_drafts = jnp.zeros((num_rows, 0), jnp.int32), jnp.zeros(num_rows, jnp.int32)
        if num_drafts:
            if draft_layers is None:
                drafts, num_new_drafts = _propose_ngram(history, length, num_drafts)
            else:
                num_new_drafts = jnp.full(num_rows, num_drafts, jnp.int32)
            num_new_drafts = jnp.clip(jnp.minimum(num_new_drafts, room - 1), 0, num_drafts)
        num_new = jnp.where(produced, 1 + num_new_drafts, 0)
        # The rows' counts after this step's tokens, as an allocation would leave them.
        state = dataclasses.replace(rows_state, num_computed=jnp.where(produced, length - 1 + num_new, 0))
        if draft_layers is not None:
            cache, drafts = _draft_passes(
                graphdef,
                mesh,
                kv_cfg,
                draft_layers,
                num_drafts,
                params,
                cache,
                state,
                req_slots,
                token,
                jnp.where(produced, num_new_drafts, 0),
            )
        meta = jaxkv.step_metadata(state, req_slots, num_new, cfg=kv_cfg, num_tokens=num_rows * width)
        # The rows' tokens packed in row order as `meta` packs them; row r's logits sit at its first token on.
        start_loc = meta.query_start_loc[:-1]
        flat = jnp.minimum(start_loc[:, None] + offsets, num_rows * width - 1)  # [R, 1 + K]
        packed = (
            jnp.zeros(num_rows * width, jnp.int32)
            .at[jnp.where(offsets < num_new[:, None], flat, num_rows * width)]
            .set(jnp.concatenate([token[:, None], drafts], axis=1), mode="drop")
        )
        logits, cache = _model_step(graphdef, mesh, params, cache, packed, meta)
        logits = logits[flat]  # [R, 1 + K, V]
        targets = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        accepted = jnp.zeros(num_rows, jnp.int32)
        if num_drafts:  # a draft counts while it and those before it equal the target's tokens
            agree = (drafts == targets[:, :-1]) & (offsets[:-1] < num_new_drafts[:, None])
            accepted = jnp.sum(jnp.cumprod(agree, axis=1), axis=1, dtype=jnp.int32)
        emitted = jnp.where(produced, jnp.minimum(accepted + 1, left), 0)
        is_eos = (targets[..., None] == eos[:, None, :]).any(axis=2) & (offsets < emitted[:, None])
        ends = jnp.any(is_eos, axis=1)
        emitted = jnp.where(ends, jnp.argmax(is_eos, axis=1) + 1, emitted)
        history = history.at[
            jnp.arange(num_rows)[:, None],
            jnp.where(offsets < emitted[:, None], length[:, None] + offsets, history.shape[1]),
        ].set(targets, mode="drop")
        counts = counts + jnp.stack(
            [jnp.sum(jnp.where(produced, num_new_drafts, 0)), jnp.sum(jnp.where(produced, accepted, 0))]
        )
        carry = (cache, history, length + emitted, left - emitted, stopped | ends, counts)
        return carry, (produced, emitted, targets, logits)

    carry = (cache, history, length, remaining, jnp.zeros_like(row), jnp.zeros(2, jnp.int32))
    carry, (produced, emitted, tokens, logits) = jax.lax.scan(step, carry, None, length=num_steps)
    cache, counts = carry[0], carry[-1]
    return cache, produced, emitted, tokens, logits, counts


class ServingLoop:
    """Serves a decoder (model.py's toy, or a checkpoint's from hf_model.py or qwen3_next.py) over a jaxkv plan:
    continuous batching, chunked prefill, prefix reuse (at `prefix_match_unit`, default the block size),
    preemption and resumption, and on-device multi-step decode. A model that reads a plan held as bytes (not
    typed: state layers beside attention) says so with `typed_cache = False`."""

    def __init__(
        self,
        model: nnx.Module,
        kv_cfg: jaxkv.KVCacheConfig,
        *,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        decode_steps: int = 8,
        record_logits: bool = False,
        mesh: jax.sharding.Mesh | None = None,
        prefix_match_unit: int | None = None,
        proposer=None,
    ):
        self.kv_cfg = kv_cfg
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_steps = decode_steps
        self.record_logits = record_logits
        if not jaxkv.is_typed(kv_cfg) and getattr(model, "typed_cache", True):
            raise ValueError("the example model needs a typed cache (every layer the same page shape)")
        # tokens -> draft tokens (at most proposer.num_drafts), or a DraftModel; None: no speculation
        self.proposer = proposer
        self.mgr = KVCacheManager(
            kv_cfg,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=True,
            prefix_match_unit=prefix_match_unit,
            num_speculative_tokens=0 if proposer is None else proposer.num_drafts,
        )
        # Align chunks to the state groups' blocks (all groups of such a plan have one block size).
        state_groups = [g for g in kv_cfg.groups if isinstance(g.spec, jaxkv.MambaSpec)]
        self.align = state_groups[0].block_size if state_groups else None
        spec = jaxkv.buffer_spec(kv_cfg)
        self.cache = jnp.zeros(spec.shape, spec.dtype, device=cache_sharding(mesh))
        graphdef, self.params = nnx.split(model)
        self._model_step = jax.jit(  # -> logits, cache
            functools.partial(_model_step, graphdef, mesh),
            donate_argnums=(1,),
            **out_shardings(mesh, "replicated", "cache"),
        )
        num_drafts = 0 if proposer is None else proposer.num_drafts
        draft_layers = proposer.num_layers if isinstance(proposer, DraftModel) else None
        if draft_layers is not None:
            self._draft_passes = jax.jit(  # -> cache, drafts
                functools.partial(_draft_passes, graphdef, mesh, kv_cfg, draft_layers, num_drafts),
                donate_argnums=(1,),
                **out_shardings(mesh, "cache", "replicated"),
            )
        self._decode_loop = jax.jit(  # see _decode_loop for what it returns
            functools.partial(_decode_loop, graphdef, mesh, kv_cfg, num_drafts, draft_layers, decode_steps),
            donate_argnums=(1,),
            **out_shardings(mesh, "cache", *["replicated"] * 5),
        )
        self.stats = Stats(peak_blocks_per_group=[0] * len(kv_cfg.groups))

    # ---- the loop ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        eos_token_ids: tuple[int, ...] = (),
        progress: bool = False,
        follow_up=None,
    ):
        """Serves every prompt to completion (`max_new_tokens`, or a token of `eos_token_ids`);
        returns the finished `Request`s in prompt order. `follow_up(request)`, called as a request
        finishes, may return (prompt, max_new_tokens) of a request that arrives then (a conversation's
        next turn); those follow in the returned list, in arrival order."""
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(prompts)
        requests = [
            Request(i, list(p), n, tuple(eos_token_ids)) for i, (p, n) in enumerate(zip(prompts, max_new_tokens))
        ]
        self._requests, self._follow_up = requests, follow_up
        self.waiting = list(requests)
        self.running: list[Request] = []
        self._stalled = False  # a device loop ran out of blocks: the next step preempts on the host
        start = time.perf_counter()
        while self.waiting or self.running:
            if self._all_decoding() and self.decode_steps > 1 and not self._stalled:
                self._stalled = self._device_decode()
            else:
                self._engine_step()
                self._stalled = False
            self._track_blocks()
            if progress:
                done = sum(r.done for r in requests)
                bar = "#" * (30 * done // len(requests))
                print(
                    f"\r[{bar:<30}] {done}/{len(requests)} requests, {self.stats.tokens_generated} tokens",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
        jax.block_until_ready(self.cache)
        self.stats.seconds += time.perf_counter() - start
        if progress:
            print(file=sys.stderr)
        return requests

    def _all_decoding(self) -> bool:
        return (
            not self.waiting and bool(self.running) and all(len(r.tokens) - r.num_computed == 1 for r in self.running)
        )

    def _engine_step(self):
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        # 1. Running requests, in admission order; preempt the newest when the pool runs dry.
        rows = list(self.running)
        while rows and budget > 0:
            asks, left = [], budget
            for req in rows:
                req.drafts = []
                asks.append(self._chunk(req, req.num_computed, left))
                if asks[-1] == 1 and len(req.tokens) - req.num_computed == 1 and self.proposer is not None:
                    room = min(left, req.max_new_tokens - len(req.output), self.kv_cfg.max_model_len - len(req.tokens))
                    if isinstance(self.proposer, DraftModel):  # proposed after the allocation (_run_model)
                        req.drafts = [-1] * min(self.proposer.num_drafts, room - 1)
                    else:
                        req.drafts = self.proposer(req.tokens)[: room - 1]
                    asks[-1] += len(req.drafts)
                left -= asks[-1]
            ok = self.mgr.allocate_slots_batch([r.request_id for r in rows], asks)
            num_ok = len(ok) if ok.all() else int(np.argmin(ok))
            for req, k in zip(rows[:num_ok], asks[:num_ok]):
                scheduled.append((req, k))
                budget -= k
            if num_ok == len(rows):
                break
            victim = self.running[-1]
            self._preempt(victim)
            preempted = True
            if victim is rows[num_ok]:
                break
            rows = [r for r in rows[num_ok:] if r is not victim]
        # 2. Admit waiting requests while nothing was preempted.
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.waiting[0]
            self.mgr.add_request(req.request_id, req.tokens)
            hit = self.mgr.get_computed_tokens(req.request_id)
            req.num_added = len(req.tokens)
            k = self._chunk(req, hit, budget)
            if not self.mgr.allocate_slots_batch([req.request_id], [k], [hit], full_sequence_must_fit=True)[0]:
                self.mgr.free(req.request_id)
                break
            self.waiting.pop(0)
            self.running.append(req)
            req.num_computed = hit
            self.stats.prompt_tokens += len(req.tokens)
            self.stats.prefix_hit_tokens += hit
            scheduled.append((req, k))
            budget -= k
        if scheduled:
            self._run_model(scheduled)

    def _chunk(self, req: Request, num_computed: int, budget: int) -> int:
        """Tokens of `req` to compute next, from `num_computed`, within `budget`: with state groups, a prefill
        chunk ends at the next block end, or earlier at the prompt tail's final unit boundary (where the
        manager saves the state: `jaxkv.prefix.tails`)."""
        end = min(len(req.tokens), num_computed + budget)
        if self.align is not None and end - num_computed > 1:
            end = min(end, (num_computed // self.align + 1) * self.align)
            unit = self.mgr.prefix_config.unit
            tail = (req.num_added - 1) // unit * unit
            if num_computed < tail < end:
                end = tail
        return end - num_computed

    def _preempt(self, req: Request):
        req.drafts = []
        self.mgr.free(req.request_id)
        self.running.remove(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)
        self.stats.preemptions += 1

    def _run_model(self, scheduled: list[tuple[Request, int]]):
        copies = self.mgr.take_block_copies()
        if len(copies):  # padded to a multiple of 8 rows (NULL_BLOCK copies nothing): few compilations
            copies = np.pad(copies, ((0, -len(copies) % 8), (0, 0)))
            self.cache = jaxkv.copy_blocks(self.cache, copies, cfg=self.kv_cfg)
            self.stats.block_copies += int((copies[:, 1] != jaxkv.NULL_BLOCK).sum())
        if isinstance(self.proposer, DraftModel) and any(req.drafts for req, _ in scheduled):
            self._propose_drafts([req for req, _ in scheduled])
        tokens = np.zeros(self.max_num_batched_tokens, np.int32)
        t = 0
        for req, k in scheduled:
            tokens[t : t + k] = (req.tokens + req.drafts)[req.num_computed : req.num_computed + k]
            t += k
        rids = [req.request_id for req, _ in scheduled]
        meta = self.mgr.step_metadata(rids, [k for _, k in scheduled], num_tokens=self.max_num_batched_tokens)
        logits, self.cache = self._model_step(self.params, self.cache, tokens, meta)
        self.mgr.mark_computed()
        logits = np.asarray(logits)
        self.stats.steps += 1
        self.stats.tokens_computed += t
        t = 0
        for req, k in scheduled:
            row_logits = logits[t : t + k]
            t += k
            if req.drafts:  # greedy verification: drafts count while they equal the target's tokens
                targets = np.argmax(row_logits, axis=-1).tolist()
                accepted = next((i for i, d in enumerate(req.drafts) if d != targets[i]), len(req.drafts))
                self.mgr.reject_tokens(req.request_id, len(req.drafts) - accepted)
                self.stats.drafts_proposed += len(req.drafts)
                self.stats.drafts_accepted += accepted
                req.drafts, row_logits = [], row_logits[: 1 + accepted]
            if self.record_logits:
                for j, row_logit in enumerate(row_logits):
                    req.logits[req.num_computed + j] = row_logit
            req.num_computed += len(row_logits)
            if req.num_computed >= len(req.tokens):  # the next token, after the accepted drafts
                sampled = row_logits[len(req.tokens) - req.num_computed - 1 :]
                self._emit(req, np.argmax(sampled, axis=-1).tolist())

    def _propose_drafts(self, reqs: list[Request]):
        """The draft model's passes for the requests' draft slots, which their allocation gave them, through the
        requests' block tables and counts (not the manager's whole state)."""
        num_rows = self.max_num_seqs
        ids = [r.request_id for r in reqs]
        req_slots = np.full(num_rows, num_rows, np.int32)
        req_slots[: len(reqs)] = np.arange(len(reqs))
        token, num_drafts = np.zeros(num_rows, np.int32), np.zeros(num_rows, np.int32)
        num_computed = np.zeros(num_rows, np.int32)
        for i, req in enumerate(reqs):
            token[i], num_drafts[i] = req.tokens[-1], len(req.drafts)
            num_computed[i] = self.mgr.num_computed_tokens(req.request_id)  # its drafts included
        tables = self.mgr.block_tables(ids)  # [G, R, M]
        tables = jnp.zeros((tables.shape[0], num_rows, tables.shape[2]), jnp.int32).at[:, : len(reqs)].set(tables)
        rows = jaxkv.ManagerState(pool=None, block_tables=tables, first_live_idx=None, num_computed=num_computed)
        self.cache, drafts = self._draft_passes(self.params, self.cache, rows, req_slots, token, num_drafts)
        drafts = np.asarray(drafts)
        for i, req in enumerate(reqs):
            req.drafts = drafts[i, : len(req.drafts)].tolist()

    def _device_decode(self) -> bool:
        """Runs `decode_steps` decode steps on device, through slots the manager reserved for them
        (`hand_over`); True, with nothing run, if they did not fit (the next host step preempts)."""
        num_rows = self.max_num_seqs
        ids = [r.request_id for r in self.running]
        width = 1 + (0 if self.proposer is None else self.proposer.num_drafts)
        wanted = [min(self.decode_steps * width, r.max_new_tokens - len(r.output)) for r in self.running]
        rows = self.mgr.hand_over(ids, wanted, num_rows=num_rows)
        copies = self.mgr.take_block_copies()  # a request at its prompt tail moves to a copy of its state
        if len(copies):
            self.cache = jaxkv.copy_blocks(self.cache, copies, cfg=self.kv_cfg)
            self.stats.block_copies += int((copies[:, 1] != jaxkv.NULL_BLOCK).sum())
        if rows is None:
            return True
        history = np.zeros((num_rows, self.kv_cfg.max_model_len), np.int32)
        length = np.ones(num_rows, np.int32)
        remaining = np.zeros(num_rows, np.int32)
        for i, r in enumerate(self.running):
            history[i, : len(r.tokens)] = r.tokens
            length[i] = len(r.tokens)
        remaining[: len(ids)] = [r.max_new_tokens - len(r.output) for r in self.running]
        eos = np.full((num_rows, max(1, *(len(r.eos_token_ids) for r in self.running))), -1, np.int32)
        for i, r in enumerate(self.running):
            eos[i, : len(r.eos_token_ids)] = r.eos_token_ids
        self.cache, produced, emitted, tokens, logits, counts = self._decode_loop(
            self.params, self.cache, *rows, history, length, remaining, eos
        )
        produced, emitted, tokens = np.asarray(produced), np.asarray(emitted), np.asarray(tokens)
        logits = np.asarray(logits) if self.record_logits else None
        num_proposed, num_accepted = np.asarray(counts).tolist()
        new_tokens = [
            [t for s in np.flatnonzero(produced[:, i]) for t in tokens[s, i, : emitted[s, i]].tolist()]
            for i in range(len(ids))
        ]
        self.mgr.hand_back(ids, new_tokens)  # appends them; the unused slots go back
        self.stats.drafts_proposed += num_proposed
        self.stats.drafts_accepted += num_accepted
        self.stats.tokens_computed += int(produced.sum()) + num_proposed
        self.stats.device_loops += 1
        self.stats.steps += self.decode_steps
        for i, req in enumerate(list(self.running)):
            for s in np.flatnonzero(produced[:, i]):
                for j in range(emitted[s, i]):
                    if self.record_logits:
                        req.logits[req.num_computed] = logits[s, i, j]
                    req.num_computed += 1
            self._emit(req, new_tokens[i], appended=True)
        return False

    def _emit(self, req: Request, new_tokens: list[int], appended: bool = False):
        """Appends sampled tokens (up to the first EOS; `appended`: the manager has them); frees the request
        once it is done."""
        new_tokens = new_tokens[: req.max_new_tokens - len(req.output)]
        ends = [i for i, token in enumerate(new_tokens) if token in req.eos_token_ids]
        new_tokens = new_tokens[: ends[0] + 1] if ends else new_tokens
        req.output.extend(new_tokens)
        self.stats.tokens_generated += len(new_tokens)
        if req.done:
            self.mgr.free(req.request_id)
            self.running.remove(req)
            arrival = self._follow_up(req) if self._follow_up is not None else None
            if arrival is not None:
                prompt, max_new_tokens = arrival
                self._requests.append(Request(len(self._requests), list(prompt), max_new_tokens, req.eos_token_ids))
                self.waiting.append(self._requests[-1])
        elif new_tokens and not appended:
            self.mgr.append_token_ids(req.request_id, new_tokens)

    def _track_blocks(self):
        for g, n in enumerate(self.blocks_in_use()):
            self.stats.peak_blocks_per_group[g] = max(self.stats.peak_blocks_per_group[g], n)

    def blocks_in_use(self) -> list[int]:
        """Distinct non-null blocks held per group by the running requests (one transfer)."""
        if not self.running:
            return [0] * len(self.kv_cfg.groups)
        slots = self.mgr.slots_of([r.request_id for r in self.running])
        tables = np.asarray(self.mgr.state.block_tables[:, slots, :])  # [G, R, M]
        return [len(np.setdiff1d(np.unique(t), [jaxkv.NULL_BLOCK])) for t in tables]
