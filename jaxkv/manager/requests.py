"""The manager's requests: request id -> state slot, each slot's counts, and with prefix caching its unit hasher.

Dimensions: S state slots (`max_num_seqs`), R requests in one call.

A slot's unit keys are made here, on the host (`jaxkv.UnitHasher`: chained SHA-256, the cache salt in the
first unit), and handed to the engine by the manager. A hasher hashes only completed units, so each slot
keeps just the tokens appended since its hasher last took tokens, never a request's whole token list.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from jaxkv import validation
from jaxkv.manager.engine import RequestCounts
from jaxkv.prefix.hashing import HashMode, UnitHasher, digests_to_keys
from jaxkv.prefix.state import PrefixCacheConfig


class Requests:
    """Ids, slots, counts (`counts`, a `RequestCounts`) and hashers of a manager's live requests; every lookup
    raises naming an unknown or repeated id."""

    def __init__(self, max_num_seqs: int, max_model_len: int, prefix: PrefixCacheConfig | None, hash_mode: HashMode):
        # A step's token appends as one compiled call, its checks included; imported here: numba's loops load
        # (or compile, once) on first use.
        from jaxkv.core.host_calls import append_checked

        self._append_checked = append_checked
        self.max_num_seqs, self.max_model_len, self.prefix, self.hash_mode = (
            max_num_seqs,
            max_model_len,
            prefix,
            hash_mode,
        )
        self.counts = RequestCounts.zeros(max_num_seqs)
        self.slot_of: dict[Hashable, int] = {}
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() gives the lowest slot
        self.hashers: list[UnitHasher | None] = [None] * max_num_seqs
        self._unhashed: list[list[int] | None] = [None] * max_num_seqs  # tokens appended, not hashed yet

    def add(
        self, request_id: Hashable, prompt_token_ids: Sequence[int], cache_salt: str | None, hasher: UnitHasher | None
    ) -> tuple[int, np.ndarray | None]:
        """Checks and registers a request (see `KVCacheManager.add_request`): its slot, and with prefix caching
        the keys of its prompt's full units, uint32[U, 4]."""
        if validation.hashable_id(request_id) in self.slot_of:
            raise ValueError(f"request {request_id!r} was already added; free it first or use a new id")
        prompt_name = f"prompt_token_ids of request {request_id!r}"
        validation.sequence(prompt_token_ids, prompt_name)
        if (cache_salt is not None or hasher is not None) and self.prefix is None:
            what = f"{cache_salt=}" if cache_salt is not None else "unit_hasher"
            raise ValueError(
                f"{what} given, but prefix caching is off; "
                "drop it or create the manager with enable_prefix_caching=True"
            )
        if hasher is not None:
            validation.unit_hasher(hasher, cache_salt, self.prefix.unit, self.hash_mode, request_id, prompt_token_ids)
        if not self._free_slots:
            raise ValueError(
                f"the manager already holds max_num_seqs={self.max_num_seqs} requests; "
                f"free one before adding {request_id!r}, or raise max_num_seqs"
            )
        num_tokens = len(prompt_token_ids)
        if not num_tokens:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request_id!r} has {num_tokens} prompt tokens, more than max_model_len={self.max_model_len}"
            )
        if self.prefix is None:
            validation.token_ids(prompt_token_ids, prompt_name)
        else:  # the hasher checks the tokens it takes (a given one has checked those it took)
            if hasher is None:
                hasher = UnitHasher(self.prefix.unit, cache_salt=cache_salt, mode=self.hash_mode)
            if hasher.num_tokens < num_tokens:  # a given one may lack the last tokens
                rest = prompt_token_ids[hasher.num_tokens :]
                try:
                    hasher.extend(rest)
                except ValueError:  # nothing taken: name the token
                    validation.token_ids(rest, prompt_name)
                    raise
        slot = self._free_slots.pop()
        self.slot_of[request_id] = slot
        c = self.counts
        c.num_tokens[slot] = c.num_prompt[slot] = num_tokens
        c.num_computed[slot] = c.num_scheduled[slot] = c.num_written[slot] = c.shared_len[slot] = 0
        if self.prefix is None:
            return slot, None
        self._unhashed[slot] = []
        self.hashers[slot] = hasher
        c.num_hashed_tokens[slot] = num_tokens
        return slot, hasher.keys

    def append(
        self, request_ids: Sequence[Hashable], new_token_ids: Sequence[Sequence[int]], lengths: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Checks and records tokens the model produced (see `KVCacheManager.append_token_ids_batch`): what was
        computed counts as written, and the units they complete are hashed. Returns the slots with new unit
        keys int64[K], how many each has int64[K], and the keys uint32[sum, 4] in slot order. `lengths`:
        int64[R] the lists' lengths where `validation.token_lists` already checked them."""
        slots = self.known_slots(request_ids)
        if lengths is None:
            lengths = validation.token_lists(request_ids, new_token_ids, "new_token_ids")
        c = self.counts
        unit = self.prefix.unit if self.prefix is not None else self.max_model_len + 1
        to_hash = None
        if slots is not None:  # one compiled call for the counts and checks; refused (-1) where the call is not valid
            rows = np.empty(len(slots), np.int64)
            num_to_hash = self._append_checked(
                slots, lengths, c.num_tokens, c.num_written, c.num_computed, c.num_hashed_tokens, unit,
                self.max_model_len, rows,
            )  # fmt: skip
            to_hash = rows[:num_to_hash] if num_to_hash >= 0 else None
        if to_hash is None:  # the general path; its errors name what is wrong
            slots = self.checked_slots(request_ids, slots)
            num_tokens = c.num_tokens[slots] + lengths
            over = num_tokens > self.max_model_len
            if over.any():
                i = int(np.flatnonzero(over)[0])
                raise ValueError(
                    f"request {request_ids[i]!r} would have {num_tokens[i]} tokens, more than "
                    f"max_model_len={self.max_model_len}"
                )
            c.num_tokens[slots] = num_tokens
            c.num_written[slots] = c.num_computed[slots]
            to_hash = slots[num_tokens // unit > c.num_hashed_tokens[slots] // unit].astype(np.int64)
        counts, digests = [], []
        if self.prefix is not None:
            unhashed = self._unhashed
            for slot, ids in zip(slots.tolist(), new_token_ids):
                unhashed[slot].extend(ids)
            for slot in to_hash.tolist():  # the units the new tokens complete
                tokens, unhashed[slot] = unhashed[slot], []
                new = self.hashers[slot].extend_digests(tokens)
                counts.append(len(new))
                digests += new
            c.num_hashed_tokens[to_hash] = c.num_tokens[to_hash]
        return to_hash, np.array(counts, np.int64), digests_to_keys(digests)

    def forget(self, request_ids: Sequence[Hashable], slots: np.ndarray) -> None:
        """The requests are gone (freed); their slots go back."""
        for request_id, slot in zip(request_ids, slots.tolist()):
            del self.slot_of[request_id]
            self.hashers[slot] = self._unhashed[slot] = None
        self._free_slots.extend(slots.tolist())

    def hasher_keys(self) -> dict[int, np.ndarray]:
        """Every live slot's unit keys (with prefix caching)."""
        return {slot: self.hashers[slot].keys for slot in self.slot_of.values() if self.hashers[slot] is not None}

    def slot(self, request_id: Hashable) -> int:
        try:
            return self.slot_of[validation.hashable_id(request_id)]
        except KeyError:
            raise KeyError(f"unknown request id {request_id!r}; add it with add_request first") from None

    def known_slots(self, request_ids: Sequence[Hashable]) -> np.ndarray | None:
        """int64[R]: the requests' slots, unchecked for repeats (the compiled calls check); None where one is
        unknown (`slots` names it). Raises if `request_ids` is not a sequence of hashable ids."""
        validation.sequence(request_ids, "request_ids")
        try:
            return np.fromiter(map(self.slot_of.__getitem__, request_ids), np.int64, len(request_ids))
        except KeyError:
            return None
        except TypeError:
            for request_id in request_ids:
                validation.hashable_id(request_id)
            raise

    def slots(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """int32[R]: the requests' slots; raises naming an unknown or repeated id."""
        return self.checked_slots(request_ids, self.known_slots(request_ids))

    def checked_slots(self, request_ids: Sequence[Hashable], slots: np.ndarray | None) -> np.ndarray:
        """`slots` from the `known_slots` already looked up."""
        if slots is None:
            self.slot(next(r for r in request_ids if r not in self.slot_of))
        slots = slots.astype(np.int32)
        if len(slots) > 1 and np.bincount(slots).max() > 1:
            seen = set()
            duplicate = next(r for r in request_ids if r in seen or seen.add(r))
            raise ValueError(f"request {duplicate!r} appears twice in one batch")
        return slots
