"""The manager state held on the host and updated in place: the host backend of `KVCacheManager`.

The same transitions as `jaxkv.core.step.allocate_step` and `jaxkv.core.state._free`, with the
same outcome bit for bit (block ids, free order, index entries), written per request for the
work a call has: a step costs its rows and the blocks it takes, releases and indexes, not the
padded shapes of a compiled program. `to_state` gives the equal `ManagerState` (for jitted
loops), `load_state` takes one back (`jaxkv.core.host_convert`).

Structures (N blocks, S slots, G groups, M table entries per request):
* free order: `_head` (a stack of blocks pushed at the head, its last popped first) then
  `_tail` (appended cached blocks, oldest first; an insertion-ordered dict: O(1) pop,
  append and removal from the middle, a hit on a free cached block);
* `ref`, `group_of` (cached group, -1), `key_of` (the cached block's key): lists of N;
* block tables: int32[G, S, M] (`tables`), written by slices;
* the index: per group a dict from a key to its block (`fields`), and per key the groups that
  hold it (`entries`), with the index's bucket capacity (`ways` keys per bucket,
  `bucket_used`), so that it holds exactly what the device's does;
* keys are 128-bit ints, `w0 | w1 << 32 | w2 << 64 | w3 << 96` of the uint32 words.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from jaxkv.core.state import max_blocks_per_request
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.index import num_buckets_for
from jaxkv.prefix.rules import HitRule, hit_blocks_reference
from jaxkv.prefix.state import PrefixCacheConfig, num_index_entries, partial_groups

_FULL, _SLIDING, _CHUNKED, _MAMBA = range(4)
_KINDS = {"full": _FULL, "sliding_window": _SLIDING, "chunked_local": _CHUNKED, "mamba": _MAMBA}


def keys_to_ints(keys: np.ndarray) -> list[int]:
    """uint32[U, 4] key words as U 128-bit ints."""
    keys = np.asarray(keys, np.uint64)
    lo = (keys[:, 0] | keys[:, 1] << np.uint64(32)).tolist()
    hi = (keys[:, 2] | keys[:, 3] << np.uint64(32)).tolist()
    return [low | high << 64 for low, high in zip(lo, hi)]


def ints_to_keys(keys: list[int]) -> np.ndarray:
    """The inverse of `keys_to_ints`: uint32[U, 4]."""
    mask = (1 << 32) - 1
    return np.array([[k & mask, k >> 32 & mask, k >> 64 & mask, k >> 96 & mask] for k in keys], np.uint32).reshape(
        -1, 4
    )


class HostState:
    """The state of one manager, in place (see the module docstring)."""

    def __init__(self, cfg: KVCacheConfig, max_num_seqs: int, prefix: PrefixCacheConfig | None = None):
        self.cfg, self.prefix, self.max_num_seqs = cfg, prefix, max_num_seqs
        groups = cfg.groups
        self.num_groups = num_groups = len(groups)
        self.block_size = [g.block_size for g in groups]
        self.kind = [_KINDS[g.kind] for g in groups]
        self.window = [
            g.spec.sliding_window
            if g.kind == "sliding_window"
            else g.spec.attention_chunk_size
            if g.kind == "chunked_local"
            else 0
            for g in groups
        ]
        self.cap = [g.spec.blocks_per_request(cfg.max_model_len, cfg.max_num_batched_tokens) for g in groups]
        n = cfg.num_blocks
        self.ref = [0] * n
        self._head: list[int] = []
        self._tail: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, n))
        self.num_free = n - 1
        self.group_of = [-1] * n
        self.tables = np.zeros((num_groups, max_num_seqs, max_blocks_per_request(cfg)), np.int32)
        self.first_live = [[0] * num_groups for _ in range(max_num_seqs)]
        self.num_computed = [0] * max_num_seqs
        if prefix is not None:
            self.unit = prefix.unit
            self.ways = prefix.ways
            self.num_buckets = num_buckets_for(num_index_entries(cfg), prefix.ways)
            self.bucket_used = [0] * self.num_buckets
            self.key_of = [0] * n
            self.fields: list[dict[int, int]] = [{} for _ in groups]  # per group: key -> block
            self.entries: dict[int, int] = {}  # key -> groups holding it
            self.hashes: list[list[int]] = [[] for _ in range(max_num_seqs)]
            self.num_cached = [[0] * num_groups for _ in range(max_num_seqs)]
            self.shared_len = [0] * max_num_seqs
            self.prompt_len = [0] * max_num_seqs
            self.copies: dict[int, int] = {}  # pending copies: destination -> source (both pinned)
            self.partial = list(partial_groups(cfg, prefix))
            self.rules = [HitRule.for_spec(g.spec) for g in groups]
            self._cached_this_pass: set[int] = set()  # blocks indexed by the current caching pass

    # ---- pool ----------------------------------------------------------------------------------
    def _release(self, block: int, evict_first: bool = False) -> None:
        ref = self.ref[block] - 1
        self.ref[block] = ref
        if ref == 0:
            if self.group_of[block] >= 0 and not evict_first:
                self._tail[block] = None
            else:
                self._head.append(block)
            self.num_free += 1

    def _unqueue(self, block: int) -> None:
        if block in self._tail:
            del self._tail[block]
        else:
            self._head.remove(block)
        self.num_free -= 1

    def _pop(self) -> int:
        return self._pop_many(1)[0]

    def _pop_many(self, k: int) -> list[int]:
        """The first k free blocks, taken (count 1, evicted from the index if cached)."""
        head, ref, group_of = self._head, self.ref, self.group_of
        num_head = min(k, len(head))
        blocks = head[len(head) - num_head :][::-1]
        del head[len(head) - num_head :]
        if k > num_head:
            popitem = self._tail.popitem
            blocks += [popitem(last=False)[0] for _ in range(k - num_head)]
        self.num_free -= k
        for block in blocks:
            ref[block] = 1
            if group_of[block] >= 0:
                self._uncache(block)
        return blocks

    def _touch(self, block: int) -> None:
        if self.ref[block] == 0:
            self._unqueue(block)
        self.ref[block] += 1

    def _release_range(self, g: int, s: int, lo: int, hi: int, evict_from: int | None = None) -> None:
        if hi <= lo:
            return
        row = self.tables[g, s]
        blocks = row[lo:hi].tolist()
        row[lo:hi] = NULL_BLOCK
        if evict_from is not None and evict_from < hi:  # from evict_from on, cached blocks go to the head too
            for j in range(hi - 1, lo - 1, -1):
                if blocks[j - lo] != NULL_BLOCK:
                    self._release(blocks[j - lo], j >= evict_from)
            return
        self._release_blocks(reversed(blocks))

    def _release_blocks(self, blocks) -> None:
        """Releases blocks in order (NULL_BLOCK entries skipped)."""
        ref, group_of, head, tail = self.ref, self.group_of, self._head, self._tail
        freed = 0
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            count = ref[block] - 1
            ref[block] = count
            if count == 0:
                freed += 1
                if group_of[block] >= 0:
                    tail[block] = None
                else:
                    head.append(block)
        self.num_free += freed

    # ---- rules ---------------------------------------------------------------------------------
    def _keep_from(self, g: int, n: int) -> int:
        kind = self.kind[g]
        if kind == _FULL:
            return 0
        bs = self.block_size[g]
        if kind == _SLIDING:
            return max(0, n - self.window[g] + 1) // bs
        if kind == _CHUNKED:
            return n // self.window[g] * self.window[g] // bs
        return max(0, n - 1) // bs

    def _new_range(self, g: int, n: int, k: int) -> tuple[int, int]:
        bs = self.block_size[g]
        lo, hi = -(-n // bs), -(-(n + k) // bs)
        if self.kind[g] == _MAMBA:
            lo = max(lo, hi - 1)
        return lo, max(lo, hi)

    def _keep(self, g: int, s: int) -> int:
        n = self.num_computed[s]
        return max(self.first_live[s][g], min(self._keep_from(g, n), -(-n // self.block_size[g])))

    def _full_need(self, full: int, n: int) -> int:
        return sum(max(0, min(-(-full // bs), cap) - -(-n // bs)) for bs, cap in zip(self.block_size, self.cap))

    # ---- transitions ---------------------------------------------------------------------------
    def allocate(
        self,
        slots: list[int],
        num_new_tokens: list[int],
        num_full_tokens: list[int] | None = None,
        num_hit_tokens: list[int] | None = None,
        num_prompt_tokens: list[int] | None = None,
        num_shared_tokens: list[int] | None = None,
        num_lookahead_tokens: list[int] | None = None,
    ) -> tuple[list[bool], int, dict]:
        """vLLM's sequential outcome (`jaxkv.core.step`): returns the ok flags, the hit tokens claimed
        and the copies {(row, group): (source, destination, valid tokens)}."""
        if num_lookahead_tokens is not None:
            num_new_tokens = [k + d for k, d in zip(num_new_tokens, num_lookahead_tokens)]
        if self.prefix is not None:
            return self._allocate_cached(
                slots,
                num_new_tokens,
                num_full_tokens,
                num_hit_tokens,
                num_prompt_tokens,
                num_shared_tokens,
                num_lookahead_tokens,
            )
        num_groups, num_free, taken, released, ok = self.num_groups, self.num_free, 0, [], []
        for i, (s, k) in enumerate(zip(slots, num_new_tokens)):
            n = self.num_computed[s]
            if num_full_tokens is not None and num_full_tokens[i] > 0:
                if taken + self._full_need(num_full_tokens[i], n) > num_free:
                    break
            released.append(s)
            table = self.tables
            for g in range(num_groups):
                lo, hi = self.first_live[s][g], self._keep(g, s)
                if hi > lo:
                    num_free += int(np.count_nonzero(table[g, s, lo:hi]))
            need = 0
            for g in range(num_groups):
                lo, hi = self._new_range(g, n, k)
                need += hi - lo
            if taken + need > num_free:
                break
            taken += need
            ok.append(True)
        ok += [False] * (len(slots) - len(ok))
        for s in released:
            live = self.first_live[s]
            for g in range(num_groups):
                keep = self._keep(g, s)
                self._release_range(g, s, live[g], keep)
                live[g] = keep
        for s, k, fits in zip(slots, num_new_tokens, ok):
            if fits:
                self._take(s, self.num_computed[s], k, ())
                self.num_computed[s] += k
        return ok, 0, {}

    def _take(self, s: int, n: int, k: int, cow) -> None:
        """New blocks for k tokens after n of slot s (a copy-on-write group's from its hit's block)."""
        pop_many = self._pop_many
        for g in range(self.num_groups):
            lo, hi = self._new_range(g, n, k)
            if g in cow:
                lo = n // self.block_size[g]
            if hi > lo:
                self.tables[g, s, lo:hi] = pop_many(hi - lo)

    def free(self, slots: list[int], num_written: list[int] | None = None) -> None:
        """Releases the slots' blocks, each group tail first. `num_written`: per slot, the tokens a forward
        pass is known to have written (None: all computed); a slot with fewer caches nothing of its last
        step, and its attention blocks from index num_written // block_size on leave the index first."""
        written = [self.num_computed[s] for s in slots] if num_written is None else num_written
        ran = [s for s, w in zip(slots, written) if w >= self.num_computed[s]]
        if self.prefix is not None:
            for s in ran:
                self._cache_state_blocks(s)
            self._register_tails(ran, move=False)
            ran_set = set(ran)
            for s, w in zip(slots, written):
                if s in ran_set:
                    continue
                for g in range(self.num_groups):
                    if self.kind[g] == _MAMBA:
                        continue
                    for block in self.tables[g, s, w // self.block_size[g] :].tolist():
                        if block != NULL_BLOCK and self.group_of[block] >= 0:
                            self._uncache(block)
        for s in slots:
            for g in range(self.num_groups):
                row = self.tables[g, s]
                held = np.flatnonzero(row)
                self._release_blocks(reversed(row[held].tolist()))
                row[held] = NULL_BLOCK
                self.first_live[s][g] = 0
            self.num_computed[s] = 0
            if self.prefix is not None:
                self.hashes[s] = []
                self.shared_len[s] = 0
                self.prompt_len[s] = 0
                self.num_cached[s] = [0] * self.num_groups

    def roll_back(self, slots: list[int], num_rejected: list[int]) -> None:
        """Speculative decoding: drops each slot's last `num_rejected` tokens and releases the entries past
        the verified ones, tail first."""
        for s, r in zip(slots, num_rejected):
            if r == 0:
                continue
            n, end = self.num_computed[s] - r, self.num_computed[s]
            for g in range(self.num_groups):
                bs = self.block_size[g]
                self._release_range(g, s, max(self.first_live[s][g], -(-n // bs)), -(-end // bs))
            self.num_computed[s] = n

    # ---- prefix cache --------------------------------------------------------------------------
    def _uncache(self, block: int) -> None:
        """Takes a cached block out of the index."""
        g, key = self.group_of[block], self.key_of[block]
        self.group_of[block] = -1
        del self.fields[g][key]
        held = self.entries[key] - 1
        if held:
            self.entries[key] = held
        else:
            del self.entries[key]
            self.bucket_used[key & (self.num_buckets - 1)] -= 1

    def _probe(self, key: int, g: int) -> int:
        return self.fields[g].get(key, NULL_BLOCK)

    @property
    def index(self) -> dict[int, list[int]]:
        """The index entries: key -> one block per group (NULL_BLOCK: none)."""
        out: dict[int, list[int]] = {}
        for g, fields in enumerate(self.fields):
            for key, block in fields.items():
                out.setdefault(key, [NULL_BLOCK] * self.num_groups)[g] = block
        return out

    @index.setter
    def index(self, entries: dict[int, list[int]]) -> None:
        self.fields = [{} for _ in range(self.num_groups)]
        self.entries = {}
        self.bucket_used = [0] * self.num_buckets
        for key, blocks in entries.items():
            for g, block in enumerate(blocks):
                if block != NULL_BLOCK:
                    self.fields[g][key] = block
            self.entries[key] = sum(block != NULL_BLOCK for block in blocks)
            self.bucket_used[key & (self.num_buckets - 1)] += 1

    def _cache(self, key: int, fields: dict[int, int], replace: bool = False) -> None:
        """Indexes the blocks `fields` {group: block} under `key` where the key's entry and bucket have room.
        With `replace` (an allocation's caching pass), a block indexed under (key, group) before this pass
        first leaves the index (a free one moves to the head)."""
        entries, index = self.entries, self.fields
        if replace and key in entries:
            for g, block in fields.items():
                old = index[g].get(key, NULL_BLOCK)
                if old == NULL_BLOCK or old == block or old in self._cached_this_pass:
                    continue
                self._uncache(old)
                if self.ref[old] == 0:
                    self._unqueue(old)
                    self._head.append(old)
                    self.num_free += 1
        held = entries.get(key, 0)
        if not held:
            bucket = key & (self.num_buckets - 1)
            if not fields or self.bucket_used[bucket] >= self.ways:
                return
            self.bucket_used[bucket] += 1
        for g, block in fields.items():
            if key not in index[g]:
                index[g][key] = block
                held += 1
                self.group_of[block] = g
                self.key_of[block] = key
                if replace:
                    self._cached_this_pass.add(block)
        entries[key] = held

    def release_copies(self, dsts) -> None:
        """The copies into `dsts` were applied: source, then destination, drop their pins."""
        for d in dict.fromkeys(dsts):
            if d in self.copies:
                self._release(self.copies.pop(d))
                self._release(d)

    def _tail_of(self, s: int) -> int:
        """p*: the prompt tail's final unit boundary of slot s (0: no prompt length)."""
        u, prompt_len = self.unit, self.prompt_len[s]
        return min((prompt_len - 1) // u, len(self.hashes[s])) * u if prompt_len > 0 else 0

    def _register_tails(self, slots, move: bool) -> dict:
        """Indexes the slots' prompt-tail blocks; at a call's start a state block's owner moves to a fresh
        block with a pinned copy. Returns {(slot, group): (source, destination, valid tokens)}."""
        if not self.partial:
            return {}
        num_free, num_moving, moves = self.num_free, 0, []
        for s in slots:
            n, tail = self.num_computed[s], self._tail_of(s)
            if tail == 0:
                continue
            fields = {}
            for g in self.partial:
                bs = self.block_size[g]
                j = tail // bs
                block = int(self.tables[g, s, j])
                if tail % bs == 0 or block == NULL_BLOCK or self.group_of[block] >= 0:
                    continue
                if self.kind[g] == _FULL and n >= tail and (j + 1) * bs > n:
                    fields[g] = block
                elif self.kind[g] == _MAMBA and n == tail:
                    if move:
                        num_moving += 1
                        if num_moving > num_free:
                            continue
                    fields[g] = block
            if fields:
                self._cache(self.hashes[s][tail // self.unit - 1], fields)
                moves += [
                    (s, g)
                    for g, block in fields.items()
                    if move and self.kind[g] == _MAMBA and self.group_of[block] == g
                ]
        copies = {}
        for s, g in moves:
            tail, bs = self._tail_of(s), self.block_size[g]
            src, dst = int(self.tables[g, s, tail // bs]), self._pop()
            self.tables[g, s, tail // bs] = dst
            self.ref[dst] += 1
            self.copies[dst] = src
            copies[(s, g)] = (src, dst, tail - tail // bs * bs)
        return copies

    def _cache_state_blocks(self, s: int) -> None:
        n = self.num_computed[s]
        if n == 0 or n % self.unit or n // self.unit > len(self.hashes[s]):
            return
        fields = {}
        for g in range(self.num_groups):
            bs = self.block_size[g]
            if self.kind[g] == _MAMBA and n % bs == 0:
                block = int(self.tables[g, s, n // bs - 1])
                if block != NULL_BLOCK and self.group_of[block] < 0:
                    fields[g] = block
        if fields:
            self._cache(self.hashes[s][n // self.unit - 1], fields)

    def lookup(self, keys: list[int], num_tokens: int, drop_last_block: bool = False) -> tuple[int, int]:
        """The hit for a request with unit keys `keys` and `num_tokens` tokens (vLLM's fixed point) and its
        shared length (the full-attention groups' own longest hit); `drop_last_block`: vLLM's EAGLE rule
        (`jaxkv.prefix.state.lookup`)."""
        hit, shared = self._lookup(keys, num_tokens, None)
        if drop_last_block and hit:
            hit = self._lookup(keys, num_tokens, hit - max(self.block_size))[0]
        return hit, shared

    def _lookup(self, keys: list[int], num_tokens: int, max_hit: int | None) -> tuple[int, int]:
        u = self.unit
        bound = min(max(num_tokens - 1, 0), len(keys) * u)
        if max_hit is not None:
            if max_hit <= 0:
                return 0, 0
            num_tokens, bound = max_hit + 1, min(bound, max_hit)
        full = [g for g in range(self.num_groups) if self.kind[g] == _FULL]
        if not self.partial:
            # vLLM's fixed point, each group probing only the blocks its rule looks at.
            hit = max(num_tokens - 1, 0) if keys else 0
            while True:
                new_hit = hit
                for g in range(self.num_groups):
                    bs = self.block_size[g]
                    new_hit = self._hit_blocks(g, keys, min(new_hit, bound) // bs) * bs
                if new_hit == hit:
                    break
                hit = new_hit
            own = [self._hit_blocks(g, keys, bound // self.block_size[g]) * self.block_size[g] for g in full]
            return hit, max(own, default=hit)
        cached = []
        for g in range(self.num_groups):
            step, index = self.block_size[g] // u, self.fields[g]
            cached.append([key in index for key in keys[step - 1 : bound // u : step]])
        rules = self.rules

        def valid(g: int, h: int) -> bool:
            bs = self.block_size[g]
            keyed = keys[h // u - 1] in self.fields[g]
            if g in self.partial and self.kind[g] == _MAMBA:
                return keyed
            if g in self.partial:
                return all(cached[g][: h // bs]) and (h % bs == 0 or keyed)
            return h % bs == 0 and hit_blocks_reference(rules[g], cached[g], h // bs) == h // bs

        grid = range(bound // u * u, 0, -u)
        hit = next((h for h in grid if all(valid(g, h) for g in range(self.num_groups))), 0)
        own = [next((h for h in grid if valid(g, h)), 0) for g in full]
        return hit, max(own, default=hit)

    def _hit_blocks(self, g: int, keys: list[int], max_blocks: int) -> int:
        """The longest valid hit of group g in blocks, at most `max_blocks` (`rules.hit_blocks_reference`,
        probing only what the rule needs)."""
        index, step = self.fields[g], self.block_size[g] // self.unit
        kind = self.kind[g]
        if kind == _FULL or kind == _CHUNKED:
            j = 0
            if kind == _CHUNKED:
                chunk_blocks = self.window[g] // self.block_size[g]
                j = max_blocks // chunk_blocks * chunk_blocks
            while j < max_blocks and keys[(j + 1) * step - 1] in index:
                j += 1
            return j
        if kind == _SLIDING:
            num_needed = -(-(self.window[g] - 1) // self.block_size[g])
            if num_needed == 0:
                return max_blocks
            run = 0
            for j in range(max_blocks - 1, -1, -1):
                run = run + 1 if keys[(j + 1) * step - 1] in index else 0
                if run >= num_needed:
                    return j + run
            return run
        for j in range(max_blocks - 1, -1, -1):  # a state group: the latest saved state
            if keys[(j + 1) * step - 1] in index:
                return j + 1
        return 0

    def _allocate_cached(
        self, slots, num_new_tokens, num_full_tokens, num_hit_tokens, num_prompt_tokens, num_shared_tokens, lookahead
    ) -> tuple[list[bool], int, dict]:
        num_groups, u, bs_of, tables = self.num_groups, self.unit, self.block_size, self.tables
        num_rows = len(slots)
        num_hit_tokens = num_hit_tokens or [0] * num_rows
        lookahead = lookahead or [0] * num_rows
        first_call = [self.num_computed[s] == 0 for s in slots]
        if num_prompt_tokens is not None:
            for s, prompt_len in zip(slots, num_prompt_tokens):
                if prompt_len > 0:
                    self.prompt_len[s] = prompt_len
        if self.kind.count(_MAMBA):
            for s in slots:
                self._cache_state_blocks(s)
        start_copies = self._register_tails(slots, move=True)
        num_free = self.num_free
        # Tentative claims, row by row (full blocks, then the source of a hit inside a block).
        claims, tails, hit_ok, taken_free = [], [], [], []
        claimed: dict[int, int] = {}  # block -> tentative claims in this call
        for s, h in zip(slots, num_hit_tokens):
            entries, tail_src, ok_h, taken = [], {}, False, 0
            if h > 0:
                hashes = self.hashes[s]
                ok_h = (
                    self.num_computed[s] == 0
                    and h % u == 0
                    and h <= len(hashes) * u
                    and all(h % bs_of[g] == 0 or g in self.partial for g in range(num_groups))
                )
                if ok_h:
                    wanted = 0
                    for g in range(num_groups):
                        bs = bs_of[g]
                        step = bs // u
                        for j in range(self._keep_from(g, h), h // bs):
                            wanted += 1
                            block = self._probe(hashes[(j + 1) * step - 1], g)
                            if block != NULL_BLOCK:
                                entries.append((g, j, block))
                    for g in self.partial:
                        if h % bs_of[g]:
                            wanted += 1
                            block = self._probe(hashes[h // u - 1], g)
                            if block != NULL_BLOCK:
                                tail_src[g] = block
                    ok_h = len(entries) + len(tail_src) == wanted
                    ref = self.ref
                    for block in [b for _, _, b in entries] + list(tail_src.values()):
                        taken += ref[block] == 0 and block not in claimed
                        claimed[block] = claimed.get(block, 0) + 1
            claims.append(entries)
            tails.append(tail_src)
            hit_ok.append(ok_h)
            taken_free.append(taken)
        # The rows in order.
        n_eff = [h if ok_h else self.num_computed[s] for s, h, ok_h in zip(slots, num_hit_tokens, hit_ok)]
        cow = [
            {
                g
                for g in tails[i]
                if hit_ok[i] and (self.kind[g] == _FULL or n_eff[i] + k <= (n_eff[i] // bs_of[g] + 1) * bs_of[g])
            }
            for i, k in enumerate(num_new_tokens)
        ]
        take_before, freed_before, ok, releasing = 0, 0, [], []
        for i, (s, k) in enumerate(zip(slots, num_new_tokens)):
            hit = num_hit_tokens[i] > 0
            need = len(cow[i])
            for g in range(num_groups):
                lo, hi = self._new_range(g, n_eff[i], k)
                need += hi - lo
            freed = 0
            if not hit:
                ref = self.ref
                for g in range(num_groups):
                    lo, hi = self.first_live[s][g], self._keep(g, s)
                    if hi > lo:
                        for block in tables[g, s, lo:hi].tolist():
                            freed += block != NULL_BLOCK and ref[block] + claimed.get(block, 0) == 1
            free_before = num_free + freed_before
            gate = True
            if num_full_tokens is not None and num_full_tokens[i] > 0:
                gate = take_before + self._full_need(num_full_tokens[i], n_eff[i]) + taken_free[i] <= free_before
            fits = take_before + need + taken_free[i] <= free_before + freed and (hit_ok[i] or not hit)
            if gate and not hit:
                releasing.append(s)
            if not (fits and gate):
                break
            take_before += need + taken_free[i]
            freed_before += freed
            ok.append(True)
        ok += [False] * (num_rows - len(ok))
        # Claims of the rows that succeed, in row order; then releases, new blocks, caching.
        num_hit = 0
        for i, s in enumerate(slots):
            if ok[i] and hit_ok[i]:
                num_hit += n_eff[i]
                for g, j, block in claims[i]:
                    self._touch(block)
                    tables[g, s, j] = block
                for g, block in tails[i].items():
                    self._touch(block)  # a copy's source pin, or the table entry holding it
                    if g not in cow[i]:
                        tables[g, s, n_eff[i] // bs_of[g]] = block
                self.first_live[s] = [self._keep_from(g, n_eff[i]) for g in range(num_groups)]
                self.num_computed[s] = n_eff[i]
        for s in releasing:  # window retention: window blocks past the shared point go first
            live, shared = self.first_live[s], self.shared_len[s]
            for g in range(num_groups):
                keep = self._keep(g, s)
                windowed = self.kind[g] in (_SLIDING, _CHUNKED)
                evict_from = shared // bs_of[g] if windowed and shared > 0 else None
                self._release_range(g, s, live[g], keep, evict_from)
                live[g] = keep
        copies = {(slots.index(s), g): c for (s, g), c in start_copies.items()}
        for i, (s, k) in enumerate(zip(slots, num_new_tokens)):
            if not ok[i]:
                continue
            n = self.num_computed[s]
            self._take(s, n, k, cow[i])
            for g in cow[i]:
                j = n // bs_of[g]
                dst = int(tables[g, s, j])
                self.ref[dst] += 1
                self.copies[dst] = tails[i][g]
                copies[(i, g)] = (tails[i][g], dst, n - j * bs_of[g])
            self.num_computed[s] = n + k
        if self.partial:
            self._uncache_filled_tails(slots, ok, hit_ok, n_eff, lookahead)
        self._cached_this_pass = set()
        for i, s in enumerate(slots):
            if ok[i]:
                self._index_filled(s, n_eff[i] if hit_ok[i] else None, lookahead[i])
        if num_shared_tokens is not None:
            for i, s in enumerate(slots):
                if ok[i] and first_call[i]:
                    self.shared_len[s] = max(num_shared_tokens[i], 0)
        return ok, num_hit, copies

    def _uncache_filled_tails(self, slots, ok, hit_ok, n_eff, lookahead) -> None:
        """A partially indexed tail block that the scheduled tokens fill leaves the index."""
        for i, s in enumerate(slots):
            if not ok[i]:
                continue
            tail = self._tail_of(s)
            hashed_len = min(len(self.hashes[s]) * self.unit, self.num_computed[s] - lookahead[i])
            for g in self.partial:
                bs = self.block_size[g]
                j = tail // bs
                start = n_eff[i] // bs if hit_ok[i] else self.num_cached[s][g]
                block = int(self.tables[g, s, j])
                if (
                    self.kind[g] == _FULL
                    and tail % bs
                    and block != NULL_BLOCK
                    and j >= start
                    and (j + 1) * bs <= min(self.num_computed[s], hashed_len)
                    and self.group_of[block] >= 0
                ):
                    self._uncache(block)

    def _index_filled(self, s: int, hit_start: int | None, lookahead: int) -> None:
        """Indexes the slot's blocks whose tokens are all scheduled: one entry per block-end unit, in unit
        order, holding the groups' blocks that end there (`hit_start`: the claimed hit's length)."""
        u, hashes = self.unit, self.hashes[s]
        hashed_len = min(len(hashes) * u, self.num_computed[s] - lookahead)
        by_unit: dict[int, dict[int, int]] = {}
        num_cached = self.num_cached[s]
        for g in range(self.num_groups):
            if self.kind[g] == _MAMBA:
                continue
            bs = self.block_size[g]
            start = hit_start // bs if hit_start is not None else num_cached[g]
            end = min(self.num_computed[s], hashed_len) // bs
            if end > start:
                step = bs // u
                for j, block in enumerate(self.tables[g, s, start:end].tolist(), start):
                    if block != NULL_BLOCK:
                        unit = (j + 1) * step - 1
                        fields = by_unit.get(unit)
                        if fields is None:
                            by_unit[unit] = {g: block}
                        else:
                            fields[g] = block
            num_cached[g] = max(start, end)
        for unit in sorted(by_unit):
            self._cache(hashes[unit], by_unit[unit], replace=True)
