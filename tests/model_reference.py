"""Plain-Python model of jaxkv's block pool and block tables, one block at a time.

It states the semantics of `jaxkv.core.state` and `jaxkv.core.pool` the slow, obvious
way (lists, sequential loops); the tests compare every array of the jitted
state with it after every step.

* Free order: a list, head first. A freed uncached block is inserted at the
  head, a freed cached block appended at the tail; allocation pops the head.
* allocate: vLLM's sequential outcome (row by row: full-sequence gate, release
  what its groups no longer need by the tokens computed before the call, take
  if it fits; the first row that fails and all later ones take nothing, later
  ones release nothing), with all releases done before the takes.
* free: per request, group by group, each group's blocks tail first.

With a prefix cache (`prefix`: a PrefixCacheConfig), as `jaxkv.core.step.allocate_step` does:
* a dict index (`IndexModel`); popping a cached block evicts it;
* allocate: state blocks the rows' last step ended on are cached; hits are
  claimed tentatively in row order (a claimed block that was free, and not
  claimed by an earlier row, costs one free block); rows in order as above, a
  release counting the entries whose block has count 1 after the claims; the
  claims of rows that fail are given back; then releases, new blocks, and the
  attention blocks whose tokens are all scheduled are cached, row by row,
  group by group;
* window retention: rows record the shared length they are admitted with; their
  sliding-window and chunked blocks past it are released to the head;
* caching a full block whose key and group hold another block, indexed before this
  call's caching pass: that old copy leaves the index, uncached (a free one to the
  head, a held one stays with its holders), and the new block is indexed;
* free: state blocks the last step ended on are cached first.

With a unit finer than a full-attention or state group's block (`jaxkv.prefix.tails`):
* the rows' prompt lengths are recorded; prompt-tail blocks are indexed at the start of a call
  (a state block's owner then moves to a fresh block, with a pinned copy) and at free;
* a hit inside a block claims its source; the request takes a fresh block there (the first of
  its new blocks) with a pinned copy, or, for a state group writing a later block, holds it;
* a partially indexed tail block that the scheduled tokens fill is taken out of the index
  before the caching pass; released copies drop their pins first (source, then destination).
"""

from __future__ import annotations

from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK, cdiv
from jaxkv.prefix.rules import HitRule, hit_blocks_reference, hybrid_hit_len_reference


class ModelState:
    def __init__(self, cfg: KVCacheConfig, max_num_seqs: int, prefix=None):
        self.cfg = cfg
        self.num_blocks = cfg.num_blocks
        self.groups = cfg.groups
        self.max_blocks = cdiv(cfg.max_model_len, min(g.block_size for g in cfg.groups))
        self.ref_cnt = [0] * self.num_blocks
        self.order = list(range(1, self.num_blocks))  # free blocks, head (reused first) to tail
        self.popped: list[int] = []  # every block popped from the free list (and so evicted), in order
        self.cached_group: dict[int, int] = {}  # block -> group it is cached for
        num_groups = len(cfg.groups)
        self.tables = [[[NULL_BLOCK] * self.max_blocks for _ in range(max_num_seqs)] for _ in range(num_groups)]
        self.first_live = [[0] * max_num_seqs for _ in range(num_groups)]
        self.num_computed = [0] * max_num_seqs
        self.prefix = prefix
        if prefix is not None:
            from jaxkv.prefix.state import num_index_entries

            self.index = IndexModel(cfg.num_blocks, num_groups, prefix.ways, num_index_entries(cfg))
            self.hashes: list[list[tuple[int, ...]]] = [[] for _ in range(max_num_seqs)]  # unit keys per slot
            self.num_cached = [[0] * max_num_seqs for _ in range(num_groups)]
            self.shared_len = [0] * max_num_seqs  # the shared length each request was admitted with
            self.prompt_len = [0] * max_num_seqs
            self.copies: dict[int, int] = {}  # pending copies: destination -> source (both pinned)
            self.partial = [
                g
                for g, group in enumerate(cfg.groups)
                if group.kind in ("full", "mamba") and group.block_size > prefix.unit
            ]

    @property
    def num_free_blocks(self) -> int:
        return len(self.order)

    # ---- pool ----------------------------------------------------------------------------
    def release(self, blocks, evict_first: bool = False) -> None:
        for b in blocks:
            assert self.ref_cnt[b] > 0, f"model: double free of block {b}"
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if b in self.cached_group and not evict_first:
                    self.order.append(b)
                else:
                    self.order.insert(0, b)

    def pop(self) -> int:
        b = self.order.pop(0)
        self.popped.append(b)
        self.ref_cnt[b] = 1
        self.cached_group.pop(b, None)
        if self.prefix is not None:
            self.index.remove([b])
        return b

    def touch(self, blocks) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                self.order.remove(b)
            self.ref_cnt[b] += 1

    def mark_cached(self, blocks, group_idx: int) -> None:
        for b in blocks:
            self.cached_group[b] = group_idx

    # ---- rules -----------------------------------------------------------------------------
    def keep_from(self, g: int, n: int) -> int:
        group = self.groups[g]
        bs = group.block_size
        if group.kind == "sliding_window":
            return max(0, n - group.spec.sliding_window + 1) // bs
        if group.kind == "chunked_local":
            chunk = group.spec.attention_chunk_size
            return (n // chunk) * chunk // bs
        if group.kind == "mamba":
            return max(0, n - 1) // bs
        return 0

    def new_range(self, g: int, n: int, k: int) -> range:
        """Logical indices that get new blocks when k tokens follow n computed ones."""
        bs = self.groups[g].block_size
        table_len, new_len = cdiv(n, bs), cdiv(n + k, bs)
        if self.groups[g].kind == "mamba":
            return range(max(table_len, new_len - 1), new_len)
        return range(table_len, new_len)

    def _release_range(self, g: int, s: int, lo: int, hi: int, evict_from: int | None = None) -> None:
        for j in reversed(range(lo, hi)):
            b = self.tables[g][s][j]
            if b != NULL_BLOCK:
                self.tables[g][s][j] = NULL_BLOCK
                self.release([b], evict_first=evict_from is not None and j >= evict_from)

    # ---- transitions ------------------------------------------------------------------------
    def allocate(
        self,
        slots,
        num_new_tokens,
        num_full_tokens=None,
        num_hit_tokens=None,
        num_prompt_tokens=None,
        num_shared_tokens=None,
        num_lookahead_tokens=None,
    ) -> list[bool]:
        """vLLM's sequential outcome: row by row, gate (before the row's release), release,
        take if it fits; stop at the first failure. The takes happen after all releases.

        With a prefix cache, `self.last_copies` holds the call's copies {(row, group): (src, dst, tokens)}.
        `num_lookahead_tokens`: slots taken after the new tokens, never cached."""
        lookahead = num_lookahead_tokens or [0] * len(slots)
        num_new_tokens = [k + d for k, d in zip(num_new_tokens, lookahead)]
        if self.prefix is not None:
            return self._allocate_cached(
                slots, num_new_tokens, num_full_tokens, num_hit_tokens, num_prompt_tokens, num_shared_tokens, lookahead
            )
        num_free, num_taken, ok, released = self.num_free_blocks, 0, [], []
        for i, (s, k) in enumerate(zip(slots, num_new_tokens)):
            n = self.num_computed[s]
            full = 0 if num_full_tokens is None else num_full_tokens[i]
            if full > 0:
                full_need = 0
                for group in self.groups:
                    cap = group.spec.blocks_per_request(self.cfg.max_model_len, self.cfg.max_num_batched_tokens)
                    full_need += max(0, min(cdiv(full, group.block_size), cap) - cdiv(n, group.block_size))
                if num_taken + full_need > num_free:
                    break
            released.append(s)
            num_free += sum(self._num_behind_window(g, s) for g in range(len(self.groups)))
            need = sum(len(self.new_range(g, n, k)) for g in range(len(self.groups)))
            if num_taken + need > num_free:
                break
            num_taken += need
            ok.append(True)
        ok += [False] * (len(slots) - len(ok))
        for s in released:
            n = self.num_computed[s]
            for g in range(len(self.groups)):
                live = self.first_live[g][s]
                keep = self._keep(g, s)
                self._release_range(g, s, live, keep)
                self.first_live[g][s] = keep
        for s, k, fits in zip(slots, num_new_tokens, ok):
            if not fits:
                continue
            n = self.num_computed[s]
            for g in range(len(self.groups)):
                for j in self.new_range(g, n, k):
                    self.tables[g][s][j] = self.pop()
            self.num_computed[s] = n + k
        return ok

    def _keep(self, g: int, s: int) -> int:
        n = self.num_computed[s]
        return max(self.first_live[g][s], min(self.keep_from(g, n), cdiv(n, self.groups[g].block_size)))

    def _num_behind_window(self, g: int, s: int) -> int:
        """Blocks the release of slot s in group g frees (none shared in these tests)."""
        table = self.tables[g][s]
        return sum(1 for j in range(self.first_live[g][s], self._keep(g, s)) if table[j] != NULL_BLOCK)

    def free(self, slots, num_written=None) -> None:
        """`num_written`: per slot, the tokens a forward pass is known to have written (None: all computed).
        A slot with fewer caches nothing of its last step, and its attention blocks from index
        num_written // block_size on leave the index first."""
        written = [self.num_computed[s] for s in slots] if num_written is None else num_written
        ran = [s for s, w in zip(slots, written) if w >= self.num_computed[s]]
        if self.prefix is not None:
            for s in ran:
                self._cache_state_blocks(s)
            self._register_tails(ran, move=False)
            for s, w in zip(slots, written):
                for g, group in enumerate(self.groups):
                    if s in ran or group.kind == "mamba":
                        continue
                    for b in self.tables[g][s][w // group.block_size :]:
                        if b != NULL_BLOCK and b in self.cached_group:
                            self.index.remove([b])
                            del self.cached_group[b]
        for s in slots:
            for g in range(len(self.groups)):
                self._release_range(g, s, 0, self.max_blocks)
                self.first_live[g][s] = 0
            self.num_computed[s] = 0
            if self.prefix is not None:
                self.hashes[s] = []
                self.shared_len[s] = 0
                self.prompt_len[s] = 0
                for g in range(len(self.groups)):
                    self.num_cached[g][s] = 0

    def roll_back(self, slots, num_rejected) -> None:
        """Speculative decoding: each slot's last `num_rejected` tokens were rejected drafts (or slots a
        device loop left unused); its count drops to the verified tokens and each group's entries past their
        blocks are released, tail first (done at the start of the slot's next allocation, after the frees).
        A state group's rolled back tokens never ran (the manager refuses drafts there): its block past the
        verified tokens, if any, was never written."""
        for s, r in zip(slots, num_rejected):
            if r == 0:
                continue
            n = self.num_computed[s] - r
            assert n >= 0, f"model: slot {s} rolls back {r} of {self.num_computed[s]} tokens"
            for g, group in enumerate(self.groups):
                bs = group.block_size
                self._release_range(g, s, max(self.first_live[g][s], cdiv(n, bs)), cdiv(self.num_computed[s], bs))
            self.num_computed[s] = n

    # ---- prefix cache ------------------------------------------------------------------------
    def set_hashes(self, slot: int, keys) -> None:
        """The request's unit keys known on the device (uint32[U, 4] rows)."""
        self.hashes[slot] = [tuple(int(w) for w in key) for key in keys]

    def _key_of_block(self, g: int, s: int, j: int):
        """The key of block j of group g of slot s, None if not hashed yet."""
        unit = (j + 1) * self.groups[g].block_size // self.prefix.unit - 1
        return self.hashes[s][unit] if unit < len(self.hashes[s]) else None

    def _cache(self, key, fields: dict[int, int], replace: bool = False) -> list[bool]:
        """Indexes one entry: the blocks `fields` {group: block} under `key`. Returns placed flags per group.
        With `replace` (an allocation's caching pass), a block indexed under (key, group) before this pass
        first leaves the index, uncached (a free one to the head)."""
        if replace:
            for g, block in fields.items():
                old = self.index.probe(key, g)
                if old in (NULL_BLOCK, block) or old in self.cached_this_pass:
                    continue
                self.index.remove([old])
                del self.cached_group[old]
                if self.ref_cnt[old] == 0:
                    self.order.remove(old)
                    self.order.insert(0, old)
        row = [fields.get(g, NULL_BLOCK) for g in range(len(self.groups))]
        placed = self.index.insert([(key, row)])[0]
        for g, ok in enumerate(placed):
            if ok:
                self.cached_group[row[g]] = g
                if replace:
                    self.cached_this_pass.add(row[g])
        return placed

    # ---- hits inside a block (jaxkv.prefix.tails) ---------------------------------------------
    def release_copies(self, dsts) -> None:
        """The copies into `dsts` were applied: source, then destination, drop their pins."""
        for d in dict.fromkeys(dsts):
            if d in self.copies:
                self.release([self.copies.pop(d), d])

    def tail(self, s: int) -> int:
        """p*: the prompt tail's final unit boundary of slot s (0: no prompt length)."""
        u, prompt_len = self.prefix.unit, self.prompt_len[s]
        return min((prompt_len - 1) // u, len(self.hashes[s])) * u if prompt_len > 0 else 0

    def _register_tails(self, slots, move: bool) -> dict:
        """Indexes the slots' prompt-tail blocks; at a call's start a state block's owner moves to a
        fresh block with a pinned copy. Returns {(slot, group): (source, destination, valid tokens)}."""
        if not self.partial:
            return {}
        num_free, num_moving, moves = self.num_free_blocks, 0, []
        for s in slots:
            n, tail = self.num_computed[s], self.tail(s)
            fields = {}
            for g in self.partial:
                group = self.groups[g]
                bs = group.block_size
                j = tail // bs
                block = self.tables[g][s][j]
                if tail == 0 or tail % bs == 0 or block == NULL_BLOCK or block in self.cached_group:
                    continue
                if group.kind == "full" and n >= tail and (j + 1) * bs > n:
                    fields[g] = block
                elif group.kind == "mamba" and n == tail:
                    if move:
                        num_moving += 1
                        if num_moving > num_free:
                            continue
                    fields[g] = block
            if fields:
                placed = self._cache(self.hashes[s][tail // self.prefix.unit - 1], fields)
                moves += [(s, g) for g in fields if placed[g] and move and self.groups[g].kind == "mamba"]
        copies = {}
        for s, g in moves:
            tail, bs = self.tail(s), self.groups[g].block_size
            src, dst = self.tables[g][s][tail // bs], self.pop()
            self.tables[g][s][tail // bs] = dst
            self.ref_cnt[dst] += 1
            self.copies[dst] = src
            copies[(s, g)] = (src, dst, tail - tail // bs * bs)
        return copies

    def _cache_state_blocks(self, s: int) -> None:
        n = self.num_computed[s]
        if n == 0 or n % self.prefix.unit or n // self.prefix.unit > len(self.hashes[s]):
            return
        fields = {}
        for g, group in enumerate(self.groups):
            bs = group.block_size
            if group.kind == "mamba" and n % bs == 0:
                block = self.tables[g][s][n // bs - 1]
                if block != NULL_BLOCK and block not in self.cached_group:
                    fields[g] = block
        if fields:
            self._cache(self.hashes[s][n // self.prefix.unit - 1], fields)

    def lookup(self, keys, num_tokens: int, drop_last_block: bool = False) -> tuple[int, int]:
        """The hit for a request with unit keys `keys` and `num_tokens` tokens (vLLM's fixed point),
        and its shared length (the full-attention groups' own longest hit; the hit without them).

        `drop_last_block` (EAGLE): every group drops the hit's last block, then the groups agree again:
        the longest hit valid for every group at most the usual one less the largest block size."""
        hit, shared = self._lookup(keys, num_tokens, None)
        if drop_last_block and hit:
            hit = self._lookup(keys, num_tokens, hit - max(g.block_size for g in self.groups))[0]
        return hit, shared

    def _lookup(self, keys, num_tokens: int, max_hit: int | None) -> tuple[int, int]:
        keys = [tuple(int(w) for w in key) for key in keys]
        bound = min(max(num_tokens - 1, 0), len(keys) * self.prefix.unit)
        if max_hit is not None:
            if max_hit <= 0:
                return 0, 0
            num_tokens, bound = max_hit + 1, min(bound, max_hit)
        cached = []
        for g, group in enumerate(self.groups):
            bs = group.block_size
            cached.append(
                [
                    self.index.probe(keys[(j + 1) * bs // self.prefix.unit - 1], g) != NULL_BLOCK
                    for j in range(bound // bs)
                ]
            )
        rules = [HitRule.for_spec(group.spec) for group in self.groups]
        full = [g for g, rule in enumerate(rules) if rule.kind == "full"]
        if not self.partial:
            hit = hybrid_hit_len_reference(rules, cached, num_tokens if keys else 0)
            own = [
                hit_blocks_reference(rules[g], cached[g], bound // rules[g].block_size) * rules[g].block_size
                for g in full
            ]
            return hit, max(own, default=hit)
        # On the unit grid: the longest h valid for every group (full: the full blocks before h
        # and, inside a block, key(h) indexed; state: key(h) indexed; others: their block boundaries).
        u = self.prefix.unit

        def valid(g: int, h: int) -> bool:
            group, rule = self.groups[g], rules[g]
            bs = group.block_size
            keyed = self.index.probe(keys[h // u - 1], g) != NULL_BLOCK
            if g in self.partial and group.kind == "mamba":
                return keyed
            if g in self.partial:
                return all(cached[g][: h // bs]) and (h % bs == 0 or keyed)
            return h % bs == 0 and hit_blocks_reference(rule, cached[g], h // bs) == h // bs

        grid = range(bound // u * u, 0, -u)
        hit = next((h for h in grid if all(valid(g, h) for g in range(len(rules)))), 0)
        own = [next((h for h in grid if valid(g, h)), 0) for g in full]
        return hit, max(own, default=hit)

    def _allocate_cached(
        self, slots, num_new_tokens, num_full_tokens, num_hit_tokens, num_prompt_tokens, num_shared_tokens, lookahead
    ) -> list[bool]:
        num_groups = len(self.groups)
        u = self.prefix.unit
        num_hit_tokens = num_hit_tokens or [0] * len(slots)
        first_call = [self.num_computed[s] == 0 for s in slots]
        for s, prompt_len in zip(slots, num_prompt_tokens or [0] * len(slots)):
            if prompt_len > 0:
                self.prompt_len[s] = prompt_len
        for s in slots:
            self._cache_state_blocks(s)
        start_copies = self._register_tails(slots, move=True)
        num_free = self.num_free_blocks
        # Tentative claims, row by row (full blocks, then the source of a hit inside a block).
        claims, tails, hit_ok, taken_free = [], [], [], []
        claimed = {}  # block -> tentative claims in this call
        for s, h in zip(slots, num_hit_tokens):
            entries, tail_src, ok_h, taken = [], {}, False, 0
            if h > 0:
                ok_h = (
                    self.num_computed[s] == 0
                    and h % u == 0
                    and h <= len(self.hashes[s]) * u
                    and all(h % g.block_size == 0 or i in self.partial for i, g in enumerate(self.groups))
                )
                if ok_h:
                    wanted = 0
                    for g, group in enumerate(self.groups):
                        for j in range(self.keep_from(g, h), h // group.block_size):
                            wanted += 1
                            block = self.index.probe(self._key_of_block(g, s, j), g)
                            if block != NULL_BLOCK:
                                entries.append((g, j, block))
                    for g in self.partial:
                        if h % self.groups[g].block_size:
                            wanted += 1
                            block = self.index.probe(self.hashes[s][h // u - 1], g)
                            if block != NULL_BLOCK:
                                tail_src[g] = block
                    ok_h = len(entries) + len(tail_src) == wanted
                    for block in [b for _, _, b in entries] + list(tail_src.values()):
                        taken += self.ref_cnt[block] == 0 and block not in claimed
                        claimed[block] = claimed.get(block, 0) + 1
            claims.append(entries)
            tails.append(tail_src)
            hit_ok.append(ok_h)
            taken_free.append(taken)
        # The rows in order.
        n_eff = [h if ok_h else self.num_computed[s] for s, h, ok_h in zip(slots, num_hit_tokens, hit_ok)]
        cow = []  # per row: groups whose hit ends inside a block and take a fresh block there
        for i, k in enumerate(num_new_tokens):
            h = n_eff[i]
            cow.append(
                {
                    g
                    for g in tails[i]
                    if hit_ok[i]
                    and (
                        self.groups[g].kind == "full"
                        or h + k <= (h // self.groups[g].block_size + 1) * self.groups[g].block_size
                    )
                }
            )
        take_before, freed_before, ok, releasing = 0, 0, [], []
        for i, (s, k) in enumerate(zip(slots, num_new_tokens)):
            hit = num_hit_tokens[i] > 0
            need = sum(len(self.new_range(g, n_eff[i], k)) for g in range(num_groups)) + len(cow[i])
            freed = 0
            if not hit:
                for g in range(num_groups):
                    for j in range(self.first_live[g][s], self._keep(g, s)):
                        block = self.tables[g][s][j]
                        freed += block != NULL_BLOCK and self.ref_cnt[block] + claimed.get(block, 0) == 1
            free_before = num_free + freed_before
            gate = True
            full = 0 if num_full_tokens is None else num_full_tokens[i]
            if full > 0:
                full_need = 0
                for group in self.groups:
                    cap = group.spec.blocks_per_request(self.cfg.max_model_len, self.cfg.max_num_batched_tokens)
                    bs = group.block_size
                    full_need += max(0, min(cdiv(full, bs), cap) - cdiv(n_eff[i], bs))
                gate = take_before + full_need + taken_free[i] <= free_before
            fits = take_before + need + taken_free[i] <= free_before + freed and (hit_ok[i] or not hit)
            if gate and not hit:
                releasing.append(s)
            if not (fits and gate):
                break
            take_before += need + taken_free[i]
            freed_before += freed
            ok.append(True)
        ok += [False] * (len(slots) - len(ok))
        # Claims of the rows that succeed, in row order; then releases, new blocks, caching.
        for i, s in enumerate(slots):
            if ok[i] and hit_ok[i]:
                for g, j, block in claims[i]:
                    self.touch([block])
                    self.tables[g][s][j] = block
                for g, block in tails[i].items():
                    self.touch([block])  # a copy's source pin, or the table entry holding it
                    if g not in cow[i]:
                        self.tables[g][s][n_eff[i] // self.groups[g].block_size] = block
                for g in range(num_groups):
                    self.first_live[g][s] = self.keep_from(g, n_eff[i])
                self.num_computed[s] = n_eff[i]
        for s in releasing:  # window retention: window blocks past the shared point go first
            for g in range(num_groups):
                keep, bs = self._keep(g, s), self.groups[g].block_size
                windowed = self.groups[g].kind in ("sliding_window", "chunked_local")
                evict_from = self.shared_len[s] // bs if windowed and self.shared_len[s] > 0 else None
                self._release_range(g, s, self.first_live[g][s], keep, evict_from)
                self.first_live[g][s] = keep
        self.last_copies = {(slots.index(s), g): c for (s, g), c in start_copies.items()}
        for i, (s, k) in enumerate(zip(slots, num_new_tokens)):
            if not ok[i]:
                continue
            n = self.num_computed[s]
            for g in range(num_groups):
                new = self.new_range(g, n, k)
                if g in cow[i]:
                    new = range(n // self.groups[g].block_size, new.stop)
                for j in new:
                    self.tables[g][s][j] = self.pop()
                if g in cow[i]:
                    j = n // self.groups[g].block_size
                    dst = self.tables[g][s][j]
                    self.ref_cnt[dst] += 1
                    self.copies[dst] = tails[i][g]
                    self.last_copies[(i, g)] = (tails[i][g], dst, n - j * self.groups[g].block_size)
            self.num_computed[s] = n + k
        for i, (s, _) in enumerate(zip(slots, num_new_tokens)):
            # A partially indexed tail block that the scheduled tokens fill leaves the index.
            if not ok[i]:
                continue
            tail, hashed_len = self.tail(s), min(len(self.hashes[s]) * u, self.num_computed[s] - lookahead[i])
            for g in self.partial:
                bs = self.groups[g].block_size
                j = tail // bs
                start = n_eff[i] // bs if hit_ok[i] else self.num_cached[g][s]
                block = self.tables[g][s][j]
                if (
                    self.groups[g].kind == "full"
                    and tail % bs
                    and block != NULL_BLOCK
                    and j >= start
                    and (j + 1) * bs <= min(self.num_computed[s], hashed_len)
                    and block in self.cached_group
                ):
                    self.index.remove([block])
                    del self.cached_group[block]
        self.cached_this_pass: set[int] = set()
        for i, (s, _) in enumerate(zip(slots, num_new_tokens)):
            if not ok[i]:
                continue
            # One entry per block-end unit, in unit order, holding the groups' blocks that end there.
            hashed_len = min(len(self.hashes[s]) * self.prefix.unit, self.num_computed[s] - lookahead[i])
            by_unit: dict[int, dict[int, int]] = {}
            for g, group in enumerate(self.groups):
                if group.kind == "mamba":
                    continue
                bs = group.block_size
                start = n_eff[i] // bs if hit_ok[i] else self.num_cached[g][s]
                end = min(self.num_computed[s], hashed_len) // bs
                for j in range(start, end):
                    if self.tables[g][s][j] != NULL_BLOCK:
                        by_unit.setdefault((j + 1) * bs // self.prefix.unit - 1, {})[g] = self.tables[g][s][j]
                self.num_cached[g][s] = max(start, end)
            for unit in sorted(by_unit):
                self._cache(self.hashes[s][unit], by_unit[unit], replace=True)
        if num_shared_tokens is not None:
            for i, s in enumerate(slots):
                if ok[i] and first_call[i]:
                    self.shared_len[s] = max(num_shared_tokens[i], 0)
        return ok


def assert_state_matches(state, model: ModelState) -> None:
    """Every array of a jaxkv ManagerState equals the model's (block ids included)."""
    import jax
    import numpy as np

    state = jax.device_get(state)
    np.testing.assert_array_equal(np.asarray(state.block_tables), np.asarray(model.tables), err_msg="block tables")
    np.testing.assert_array_equal(state.num_computed, model.num_computed, err_msg="num_computed")
    np.testing.assert_array_equal(state.first_live_idx, model.first_live, err_msg="first_live_idx")
    assert_pool_matches(state.pool, model)
    if model.prefix is not None:
        from jaxkv.prefix.index import index_entries

        assert {k: b for k, (b, _) in index_entries(state.prefix.index).items()} == model.index.entries(), "index"
        np.testing.assert_array_equal(state.prefix.num_cached_blocks, model.num_cached, err_msg="num_cached")
        np.testing.assert_array_equal(state.prefix.prompt_len, model.prompt_len, err_msg="prompt_len")
        copy_src = np.zeros(model.num_blocks, np.int32)
        for dst, src in model.copies.items():
            copy_src[dst] = src
        np.testing.assert_array_equal(state.prefix.copy_src, copy_src, err_msg="pending copies")
        assert np.asarray(state.prefix.num_hashed_units).tolist() == [len(h) for h in model.hashes], "hashed"
        assert np.asarray(state.prefix.shared_len).tolist() == model.shared_len, "shared_len"


def assert_pool_matches(pool, model: ModelState) -> None:
    """Reference counts, free order, free count and cached groups of a PoolState equal the model's."""
    import jax
    import numpy as np

    from jaxkv.core.pool import NOT_CACHED, free_order

    pool = jax.device_get(pool)
    np.testing.assert_array_equal(pool.ref_cnt, model.ref_cnt, err_msg="ref_cnt")
    assert free_order(pool).tolist() == model.order, "free order"
    assert int(pool.num_free_blocks) == model.num_free_blocks, "num_free_blocks"
    group = np.full(model.num_blocks, NOT_CACHED)
    for b, g in model.cached_group.items():
        group[b] = g
    np.testing.assert_array_equal(pool.block_group, group, err_msg="cached groups")


class IndexModel:
    """The prefix-cache index (`jaxkv.prefix.index`) as dicts, with its bucket capacity.

    One entry per key, one block field per group. An insert call inserts its entries one
    after another: where the key has an entry, each given block fills its group's field
    if empty; otherwise a new entry is made if the key's bucket has an empty way.
    """

    def __init__(self, num_blocks: int, num_groups: int, ways: int, num_entries: int | None = None):
        from jaxkv.prefix.index import num_buckets_for

        self.ways, self.num_groups = ways, num_groups
        self.num_buckets = num_buckets_for(num_blocks if num_entries is None else num_entries, ways)
        self.fields: dict[tuple[int, ...], dict[int, int]] = {}  # key -> {group: block}

    def bucket(self, key) -> int:
        return int(key[0]) & (self.num_buckets - 1)

    def entries(self) -> dict[tuple[tuple[int, ...], int], int]:
        return {(key, g): block for key, fields in self.fields.items() for g, block in fields.items()}

    @property
    def block_key(self) -> dict[int, tuple[tuple[int, ...], int]]:
        return {block: kg for kg, block in self.entries().items()}

    def probe(self, key, group: int) -> int:
        return self.fields.get(tuple(int(w) for w in key), {}).get(group, NULL_BLOCK)

    def insert(self, entries) -> list[list[bool]]:
        """entries: (key, blocks per group (NULL_BLOCK: none)) in batch order. Returns placed flags per group."""
        placed = []
        for key, blocks in entries:
            key = tuple(int(w) for w in key)
            given = {g: int(b) for g, b in enumerate(blocks) if b != NULL_BLOCK}
            if key not in self.fields:
                used = sum(self.bucket(other) == self.bucket(key) for other in self.fields)
                if not given or used >= self.ways:
                    placed.append([False] * len(blocks))
                    continue
                self.fields[key] = {}
            fields = self.fields[key]
            placed.append([g in given and g not in fields for g in range(len(blocks))])
            for g, block in given.items():
                fields.setdefault(g, block)
        return placed

    def remove(self, blocks) -> None:
        for block in blocks:
            for key, fields in list(self.fields.items()):
                for g, b in list(fields.items()):
                    if b == block:
                        del fields[g]
                if not fields:
                    del self.fields[key]
