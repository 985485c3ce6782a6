"""The manager's input checks at the host boundary, shared by both backends.

Each public `KVCacheManager` call checks its arguments here before anything moves, so a refused call
leaves the manager exactly as it was. The checks refuse what Python or numpy would otherwise coerce:
a count is an integer (Python `int` or a numpy integer; not bool, float or str) in [0, 2**31 − 1], a
token id an integer in [0, 2**32 − 1], whether or not prefix caching is on; a sequence of ids, counts
or tokens is a real sequence (not a bare string, whose characters would pass for ids, nor an iterator).
Errors are `TypeError` for a wrong type and `ValueError` for a value out of range; each names the
parameter and the value, and the request where there is one.

Dimensions: R requests in one call.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Hashable, Sequence

import numpy as np

from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.hashing import UnitHasher

MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as uint32 (`jaxkv.prefix.hashing`)
MAX_COUNT = 2**31 - 1  # counts are int32 on the device
_SEQUENCES = (list, tuple, np.ndarray)  # the usual types, passed without an abstract-class check


def short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def sequence(values, name: str) -> Sequence:
    """`values` itself if it is a sequence (list, tuple, numpy or jax array, ...), not a str, bytes, iterator or
    scalar."""
    if type(values) in _SEQUENCES or getattr(values, "ndim", 0) >= 1:  # jax and other arrays too
        return values
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(
            f"{name} must be a list, tuple or array, not {type(values).__name__} {short(values)}"
            + (" (its characters would be taken one by one)" if isinstance(values, (str, bytes)) else "")
        )
    return values


def hashable_id(request_id, name: str = "request_id") -> Hashable:
    try:
        hash(request_id)
    except TypeError:
        raise TypeError(f"{name}={short(request_id)} is not hashable; use a str or int id") from None
    return request_id


def _own(values: np.ndarray) -> np.ndarray:
    """`values`, or a copy where it is read-only or strided (a jax array's view; the compiled calls take neither)."""
    return values if values.flags.c_contiguous and values.flags.writeable else values.copy()


def _as_array(values) -> np.ndarray | None:
    """`values` as a numpy array, None where numpy cannot make one (ragged lists)."""
    try:
        return values if isinstance(values, np.ndarray) else np.asarray(values)
    except ValueError:
        return None


def counts(request_ids: Sequence[Hashable], values, name: str, *, check_range: bool = True) -> np.ndarray:
    """int64[R]: one count per request, each an integer in [0, MAX_COUNT] (`check_range=False`: the caller
    checks the range itself, as the host backend's compiled allocation does; values past int64 wrap).

    One numpy conversion where the counts are fine; a list that mixes Python bools among ints passes as 0
    and 1 (numpy's conversion cannot tell them apart, and a scan per element would cost more than the call)."""
    arr = _as_array(values)
    if (
        arr is None
        or arr.ndim != 1
        or arr.dtype.kind not in "iu"
        or len(arr) != len(request_ids)
        or isinstance(values, (str, bytes))
    ):
        return _checked_counts(request_ids, values, name)
    if check_range and len(arr) and (arr.min() < 0 or arr.max() > MAX_COUNT):
        return _checked_counts(request_ids, values, name)
    return _own(arr.astype(np.int64, copy=False))


def _checked_counts(request_ids, values, name: str) -> np.ndarray:
    """Raises the error that names what is wrong with `values`, or gives them as int64[R] where numpy's
    conversion was only too strict (an empty list, numpy integers of mixed kinds)."""
    sequence(values, name)
    if len(values) != len(request_ids):
        raise ValueError(f"{name} has {len(values)} entries; expected one per request ({len(request_ids)})")
    if isinstance(values, np.ndarray) and (values.ndim != 1 or values.dtype.kind not in "iu"):
        raise TypeError(f"{name} must hold integers, got an array of {values.dtype}{list(values.shape)}")
    for i, value in enumerate(values):
        if not _is_int(value):
            raise TypeError(
                f"{name}={short(value)} for request {request_ids[i]!r} must be an int, not {type(value).__name__}"
            )
        if not 0 <= value <= MAX_COUNT:
            what = "is negative" if value < 0 else f"is beyond {MAX_COUNT}"
            raise ValueError(f"{name}={value} for request {request_ids[i]!r} {what}")
    return np.asarray(values, np.int64).reshape(len(values))  # fine after all (an empty list, mixed int types)


def count(value, name: str, *, minimum: int = 0) -> int:
    """One integer argument in [minimum, MAX_COUNT]."""
    if not _is_int(value):
        raise TypeError(f"{name}={short(value)} must be an int, not {type(value).__name__}")
    if not minimum <= value <= MAX_COUNT:
        raise ValueError(f"{name}={value} must lie in [{minimum}, {MAX_COUNT}]")
    return int(value)


def flags(request_ids: Sequence[Hashable], values, name: str) -> np.ndarray:
    """bool[R]: one bool for every request, or one per request."""
    if isinstance(values, (bool, np.bool_)):
        return np.full(len(request_ids), bool(values))
    arr = _as_array(values)
    if arr is not None and arr.shape == (len(request_ids),) and arr.dtype == bool:
        return _own(arr)
    sequence(values, name)
    if len(values) != len(request_ids):
        raise ValueError(
            f"{name} has {len(values)} entries; expected one flag per request ({len(request_ids)}) or a single bool"
        )
    i = next(i for i, v in enumerate(values) if not isinstance(v, (bool, np.bool_)))
    raise TypeError(f"{name}={short(values[i])} for request {request_ids[i]!r} must be a bool")


def token_ids(values, what: str) -> None:
    """Checks one request's token ids: a sequence of ints in [0, MAX_TOKEN_ID] (Python bools pass as 0 and 1),
    or a 1-D integer array. One C conversion where they are fine."""
    sequence(values, what)
    if hasattr(values, "__array__"):
        values = np.asarray(values)
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise TypeError(f"{what} must be a 1-D array of integer token ids, got {values.dtype}{list(values.shape)}")
        if values.size and (values.min() < 0 or values.max() > MAX_TOKEN_ID):
            raise ValueError(f"{what}: token ids must lie in [0, {MAX_TOKEN_ID}], got {values.min()}..{values.max()}")
        return
    try:
        array.array("I", values)
    except (TypeError, OverflowError):
        for token in values:
            if not isinstance(token, (int, np.integer)):
                raise TypeError(f"{what}: token id {short(token)} must be an int, not {type(token).__name__}") from None
            if not 0 <= token <= MAX_TOKEN_ID:
                raise ValueError(f"{what}: token id {token} lies outside [0, {MAX_TOKEN_ID}]") from None
        raise


def token_lists(request_ids: Sequence[Hashable], lists, name: str) -> np.ndarray:
    """int64[R]: the lengths of one token list per request, every token checked as by `token_ids` (one C
    pass over all of them where they are fine)."""
    sequence(lists, name)
    if len(lists) != len(request_ids):
        raise ValueError(f"{name} has {len(lists)} token lists for {len(request_ids)} requests; give one per request")
    try:  # a str's characters are no ints; a bytes object's are, and pass as tokens
        lengths = np.fromiter(map(len, lists), np.int64, len(lists))
        array.array("I", itertools.chain.from_iterable(lists))
        return lengths
    except (TypeError, OverflowError):
        pass
    for rid, ids in zip(request_ids, lists):  # one list at a time: name the one that fails
        token_ids(ids, f"{name} of request {rid!r}")
    return np.fromiter(map(len, lists), np.int64, len(lists))


def unit_hasher(hasher, cache_salt, unit: int, mode: str, request_id, prompt_token_ids: Sequence[int]) -> None:
    """Checks a `jaxkv.UnitHasher` given to `add_request`: this manager's unit and mode, no salt beside it (the
    hasher carries one), and no more tokens taken than the prompt has."""
    if not isinstance(hasher, UnitHasher):
        raise TypeError(f"unit_hasher must be a jaxkv.UnitHasher, got {type(hasher).__name__}")
    if cache_salt is not None:
        raise ValueError(f"{cache_salt=} and unit_hasher given: the hasher carries the salt")
    if hasher.unit != unit or hasher.mode != mode:
        raise ValueError(
            f"unit_hasher hashes units of {hasher.unit} tokens in mode {hasher.mode!r}; this manager uses "
            f"{unit}, {mode!r}"
        )
    if hasher.num_tokens > len(prompt_token_ids):
        raise ValueError(
            f"unit_hasher has taken {hasher.num_tokens} tokens, the prompt of request {request_id!r} has "
            f"{len(prompt_token_ids)}"
        )


def allocation(
    request_ids, num_computed, num_tokens, num_new, hits, lookahead, *, caching, num_speculative_tokens, max_model_len
) -> None:
    """Checks the counts of an allocation call (int64[R] each: the requests' computed and total tokens, then
    the call's new, hit and lookahead tokens) against vLLM's rules: a hit only on a request's first call and
    below its tokens, no tokens the request does not have yet (beyond `num_speculative_tokens` drafts),
    lookahead slots only with speculative decoding, nothing past `max_model_len`."""
    if hits.any():
        bad = (hits > 0) & ((num_computed > 0) | (hits >= num_tokens) | (not caching))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"num_new_computed_tokens={hits[i]} for request {request_ids[i]!r}: it must be 0 "
                "or the value get_computed_tokens just returned, on the request's first call"
            )
    over = num_computed + hits + num_new > num_tokens + num_speculative_tokens
    if over.any():
        i = int(np.flatnonzero(over)[0])
        drafts = f" (and at most {num_speculative_tokens=} drafts)" if num_speculative_tokens else ""
        raise ValueError(
            f"request {request_ids[i]!r} has {num_tokens[i]} tokens, {num_computed[i] + hits[i]} computed: it "
            f"cannot schedule {num_new[i]} more{drafts}; append the tokens first (append_token_ids)"
        )
    if lookahead.any() and not num_speculative_tokens:
        raise ValueError(
            "num_lookahead_tokens given on a manager without speculative decoding; create it with "
            "num_speculative_tokens > 0"
        )
    past = num_computed + hits + num_new + lookahead > max_model_len
    if past.any():
        i = int(np.flatnonzero(past)[0])
        raise ValueError(
            f"request {request_ids[i]!r}: {num_computed[i] + hits[i]} computed tokens, {num_new[i]} new "
            f"and {lookahead[i]} lookahead slots exceed {max_model_len=}; schedule fewer drafts near the end"
        )


def step_counts(request_ids, num_new_tokens, num_scheduled, num_tokens) -> np.ndarray:
    """int64[R]: a step's new-token counts for its metadata, each at most what the request's last allocation
    scheduled (`num_scheduled` int64[R]), all of them within `num_tokens` entries."""
    num_new = counts(request_ids, num_new_tokens, "num_new_tokens")
    count(num_tokens, "num_tokens")
    over = num_new > num_scheduled
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise ValueError(
            f"num_new_tokens={num_new[i]} for request {request_ids[i]!r}: its last allocation scheduled "
            f"{num_scheduled[i]} tokens; give the counts of the step's allocation"
        )
    if num_new.sum() > num_tokens:
        raise ValueError(f"{num_tokens=} cannot hold the {num_new.sum()} scheduled tokens")
    return num_new


def hand_back(request_ids, num_computed, num_rejected_tokens, pinned_copies, num_blocks) -> tuple[np.ndarray, list]:
    """Checks what `adopt_state` takes back for the requests whose counts in the loop's state are
    `num_computed` (int64[R]): rejected drafts int64[R] (None: none) within them, and block ids of pinned
    copies in [0, num_blocks). Returns the rejected counts and the pinned ids (NULL_BLOCK entries dropped)."""
    rejected = np.zeros(len(request_ids), np.int64)
    if num_rejected_tokens is not None:
        rejected = counts(request_ids, num_rejected_tokens, "num_rejected_tokens")
    pinned = np.asarray(pinned_copies).reshape(-1)
    if pinned.size and (pinned.dtype.kind not in "iu" or pinned.min() < 0 or pinned.max() >= num_blocks):
        raise ValueError(f"pinned_copies={short(pinned_copies)} must be block ids in [0, {num_blocks})")
    if (rejected > num_computed).any():
        i = int(np.flatnonzero(rejected > num_computed)[0])
        raise ValueError(
            f"num_rejected_tokens={rejected[i]} for request {request_ids[i]!r}: the loop computed "
            f"{num_computed[i]} tokens of it"
        )
    return rejected, [int(d) for d in pinned if d != NULL_BLOCK]


def manager_options(cfg, max_num_seqs, num_speculative_tokens, use_eagle, backend, device) -> tuple[int, int]:
    """Checks `KVCacheManager`'s options; returns max_num_seqs and num_speculative_tokens as ints."""
    if not isinstance(cfg, KVCacheConfig):
        raise TypeError(f"cfg must be a KVCacheConfig (from jaxkv.plan), got {type(cfg).__name__}")
    max_num_seqs = count(max_num_seqs, "max_num_seqs", minimum=1)
    num_speculative_tokens = count(num_speculative_tokens, "num_speculative_tokens")
    state_groups = [g.layer_names[0] for g in cfg.groups if g.kind == "mamba"]
    if state_groups and (num_speculative_tokens or use_eagle):
        raise ValueError(
            f"speculative decoding ({num_speculative_tokens=}, {use_eagle=}) on a config with state "
            f"(Mamba / linear-attention) groups ({', '.join(state_groups[:3])}, ...): a rejected draft's "
            "state overwrites the verified one and jaxkv keeps one state per request (vLLM keeps one per "
            "draft position); serve this model without speculative decoding"
        )
    if backend not in ("host", "jax"):
        raise ValueError(f"{backend=} must be 'host' (in place, on the host) or 'jax' (jitted transitions)")
    if backend == "host" and device is not None:
        raise ValueError(
            f"{device=} given with backend='host', whose state is host memory; drop it, or ask for "
            "backend='jax' to keep the state on that device"
        )
    return max_num_seqs, num_speculative_tokens
