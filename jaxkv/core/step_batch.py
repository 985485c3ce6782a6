"""The arrays of one engine step (`jaxkv.core.step`): its batch, its static work signature and its result.

Dimensions: R rows of the step, G groups, S request slots, F freed requests, X uploaded unit keys, C released
copies.
"""

from __future__ import annotations

import dataclasses

import jax

from jaxkv.core.state import AllocateResult


@dataclasses.dataclass(frozen=True)
class StepBatch:
    """One step's manager work, a pytree of arrays; absent parts are None.

    req_slots:         int32[R] distinct slots, in priority order; S (= max_num_seqs) marks padding
    num_new_tokens:    int32[R] tokens to schedule (≥ 0)
    num_full_tokens:   int32[R]; where > 0, admit only if blocks for that many tokens (capped per
                       group at its admission cap) fit: vLLM's `full_sequence_must_fit`
    num_hit_tokens:    int32[R] (prefix caching) hit tokens to claim, on a request's first call
    num_shared_tokens: int32[R] (prefix caching) on a first call, the tokens the request's
                       full-attention groups found cached (`lookup`'s shared_len): window
                       retention evicts its window blocks past that point first
    num_prompt_tokens: int32[R] (prefix caching) prompt lengths (0: unknown); with a unit finer than
                       a block, the prompt tail's final unit boundary gets a partial entry
    free_slots:        int32[F] requests to free first (as `free`); S marks padding
    free_num_written:  int32[F] (prefix caching) their tokens a forward pass is known to have written
                       (as `free`'s num_written); None: all they computed
    hash_uploads:      uint32[X, 6] (prefix caching) unit keys to store (`jaxkv.prefix.state.store_hashes`)
    released_copies:   int32[C] (prefix caching) destinations of applied copies: their pins drop
    slot_counts:       int32[S] every slot's computed tokens as the host counts them; they replace
                       the state's first (a host may leave out rows whose only work is to advance
                       their count, and carry the count itself)
    num_rejected_tokens: int32[R] (speculative decoding) tokens at the end of each row's count that
                       its verification rejected (drafts and lookahead slots of its last allocation):
                       rolled back first
    num_lookahead_tokens: int32[R] (speculative decoding) slots reserved after each row's new tokens
                       for a proposer's own KV: taken and counted with them, never indexed (roll them
                       back with the row's next step)
    """

    req_slots: jax.Array
    num_new_tokens: jax.Array
    num_full_tokens: jax.Array | None = None
    num_hit_tokens: jax.Array | None = None
    num_shared_tokens: jax.Array | None = None
    num_prompt_tokens: jax.Array | None = None
    free_slots: jax.Array | None = None
    free_num_written: jax.Array | None = None
    hash_uploads: jax.Array | None = None
    released_copies: jax.Array | None = None
    slot_counts: jax.Array | None = None
    num_rejected_tokens: jax.Array | None = None
    num_lookahead_tokens: jax.Array | None = None


jax.tree_util.register_dataclass(StepBatch, data_fields=[f.name for f in dataclasses.fields(StepBatch)], meta_fields=[])

_PREFIX_PARTS = (
    "num_hit_tokens",
    "num_shared_tokens",
    "num_prompt_tokens",
    "free_num_written",
    "hash_uploads",
    "released_copies",
)


@dataclasses.dataclass(frozen=True)
class StepWork:
    """The static work signature of a step: per walk, None (sized at run time, in loops), K > 0 (at
    most K entries expected: straight-line code) or 0 (none expected: absent).

    free:    table entries the freed requests release (prefix caching; without it they join `release`)
    release: table entries released behind windows
    take:    table entries given new blocks
    claim:   block-end units the hit claims walk
    index:   block-end units the caching of filled blocks walks
    rollback: table entries past the verified tokens that rejected drafts release
    """

    free: int | None = None
    release: int | None = None
    take: int | None = None
    claim: int | None = None
    index: int | None = None
    rollback: int | None = None

    def sizes(self, name: str, chunk_sizes: tuple[int, ...]):
        bound = getattr(self, name)
        return chunk_sizes if bound is None else bound


FULL_PROGRAM = StepWork()  # every walk sized at run time


@dataclasses.dataclass(frozen=True)
class StepResult(AllocateResult):
    """`AllocateResult` plus, per row, what the host mirrors: first_live int32[R, G] and
    num_cached int32[R, G] (0 without a prefix cache) after the step; num_unplanned int32[]:
    entries of walks the work signature left out (must be 0)."""

    first_live: jax.Array = None
    num_cached: jax.Array = None
    num_unplanned: jax.Array = None


jax.tree_util.register_dataclass(
    StepResult,
    data_fields=["ok", "num_free_blocks", "num_hit_tokens", "copies", "first_live", "num_cached", "num_unplanned"],
    meta_fields=[],
)
