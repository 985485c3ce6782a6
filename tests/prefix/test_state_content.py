"""State (Mamba) groups through `KVCacheManager`, with the content of every block simulated on the host and
checked at every read: a shadow-content property test, jitted and eager.

Dimensions: G groups, R requests of a step, M max blocks per request.

The shadow holds, per block id, what a real model would have left there (`Shadow`): the state after an exact
token prefix, or per slot the K/V of a token, a function of the whole prefix up to it. A simulated forward pass
reads and writes as `examples/qwen3_next.py` does (`state_blocks`): a request with n computed tokens keeps its
state at table index (n − 1) // b; a step of k tokens reads it there (nothing when n = 0), attention reads every
position before n + k, and the step writes its K/V and, at (n + k − 1) // b, the state after its tokens. The block
copies of hits inside a block (`take_block_copies`) are applied to the shadow before the step. Every state a
request resumes from must be its own prefix's, after hits, preemptions, device loops (`hand_over`: decode steps
through the tables it hands over, up to each request's reservation), and steps of other requests that were
aborted (allocated, never run, freed without `mark_computed`).
"""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_configs import full, make_cfg, mamba

import jaxkv
from jaxkv import KVCacheManager
from jaxkv.planner.specs import NULL_BLOCK
from jaxkv.prefix.hashing import prompt_unit_hashes
from jaxkv.prefix.index import index_entries

# A state group and a full-attention group of block 4 (Qwen3-Next-like), 15 usable blocks: three requests of up
# to 24 tokens (6 + 1 blocks each, 8 while a state moves) do not fit together, so blocks are evicted and reused.
CFG = make_cfg(16, mamba(4), full(4), max_model_len=24, max_num_batched_tokens=16)
NUM_SEQS = 3
ALPHABET = (1, 2, 3)  # few tokens: prompts share prefixes, and hits end anywhere
MAX_PROMPT_LEN = 20  # leaves room for decodes


class Shadow:
    """What each block holds, simulated: content[block] is ("state", prefix), the state after the tokens
    `prefix`, or ("kv", slots), slots[offset] the prefix whose last token's K/V the slot holds (None: unwritten).

    One record per block: the groups' views share a block's bytes, so a write of one kind wipes the other.
    `apply_copies=False` leaves the block copies out (a caller that forgets them), to show the checks fire.
    """

    def __init__(self, cfg, apply_copies=True):
        self.cfg = cfg
        self.apply_copies = apply_copies
        self.content: dict[int, tuple] = {}
        kinds = {g.kind for g in cfg.groups}
        assert kinds <= {"mamba", "full"}, f"the shadow models state and full-attention groups only, not {kinds}"
        self.state_groups = [g for g, group in enumerate(cfg.groups) if group.kind == "mamba"]
        self.attention_groups = [g for g, group in enumerate(cfg.groups) if group.kind == "full"]

    def copy(self, copies):
        """Applies block copies int32[C, 3] (source, destination, valid tokens) as `jaxkv.copy_blocks` does:
        whole blocks, every source read before any destination is written."""
        if not self.apply_copies:
            return
        taken = [(int(dst), self.content.get(int(src))) for src, dst, _ in copies if src and dst]
        for dst, content in taken:
            self.content[dst] = content

    def _kv(self, block, offset):
        kind, slots = self.content.get(block, (None, None))
        return slots[offset] if kind == "kv" else None

    def guards(self, tables, computed, tokens, index, prefix_of_key):
        """What the blocks must keep holding for others: {block: ([(who, why no write may touch it)], {offset:
        [(the prefix its slot must hold, who needs it)]})}, from every live request's table (tables: rid ->
        int32[G, M], `computed`: rid -> its computed tokens, hits included) and the prefix-cache index."""
        guards: dict[int, tuple[list, dict]] = {}

        def need(block, offset, prefix, who):
            guards.setdefault(block, ([], {}))[1].setdefault(offset, []).append((prefix, who))

        def freeze(block, who, why):
            guards.setdefault(block, ([], {}))[0].append((who, why))

        for rid, table in tables.items():
            for g, group in enumerate(self.cfg.groups):
                bs = group.block_size
                for i, block in enumerate(table[g].tolist()):
                    if block == NULL_BLOCK:
                        continue
                    if group.kind == "mamba":
                        freeze(block, rid, f"{rid} holds it in state group {g}")
                        continue
                    for offset in range(min(bs, computed[rid] - i * bs)):
                        need(block, offset, tuple(tokens[rid][: i * bs + offset + 1]), rid)
        for (key, g), (block, _) in index.items():
            prefix = prefix_of_key[key]
            if self.cfg.groups[g].kind == "mamba":
                freeze(block, None, f"indexed for the state of {prefix}")
                continue
            start = (len(prefix) - 1) // self.cfg.groups[g].block_size * self.cfg.groups[g].block_size
            for p in range(start, len(prefix)):
                need(block, p - start, prefix[: p + 1], f"the index entry of {prefix}")
        return guards

    def _check_write(self, guards, rid, block, offset, prefix):
        """A write of `rid` must not change what another request or the index expects of the block
        (offset None: a state write, which no other holder and no index entry may see)."""
        frozen, slots = guards.get(block, ([], {}))
        if offset is None:
            others = [why for who, why in frozen if who != rid]
            others += [f"{who} needs slot {o}" for o, needs in slots.items() for _, who in needs if who != rid]
            assert not others, f"{rid} writes the state after {len(prefix)} tokens into block {block}: {others}"
            return
        assert not frozen, f"{rid} writes position {len(prefix) - 1} into block {block}: {[why for _, why in frozen]}"
        for expected, who in slots.get(offset, ()):
            assert expected == prefix, (
                f"{rid} writes {prefix} into block {block} slot {offset}, which {who} needs to hold {expected}"
            )

    def step(self, tables, rows, guards=None):
        """One forward pass. tables: rid -> int32[G, M] (its block table); rows: (request id, tokens, n, k) per
        request of the step: n tokens computed before it (hits included), k computed by it. Writes are checked
        against `guards` (`Shadow.guards`).

        Order as in a model's layers: every state read before any state write; every K/V written before
        attention reads (a request admitted in the same step may read what an earlier row writes)."""
        groups, guards = self.cfg.groups, guards or {}
        for rid, tokens, n, k in rows:
            for g in self.state_groups:
                if k and n:  # n = 0: the state starts at zero, nothing is read
                    block = int(tables[rid][g, (n - 1) // groups[g].block_size])
                    held = self.content.get(block)
                    assert held == ("state", tuple(tokens[:n])), (
                        f"{rid}: resumes at n={n} from state block {block} (group {g}), which holds {held}; "
                        f"expected the state of {tuple(tokens[:n])}"
                    )
        for rid, tokens, n, k in rows:
            for g in self.attention_groups:
                bs = groups[g].block_size
                for p in range(n, n + k):
                    block, offset, prefix = int(tables[rid][g, p // bs]), p % bs, tuple(tokens[: p + 1])
                    assert block != NULL_BLOCK, f"{rid}: K/V of position {p} written to the null block"
                    self._check_write(guards, rid, block, offset, prefix)
                    kind, slots = self.content.get(block, (None, None))
                    slots = list(slots) if kind == "kv" else [None] * bs
                    slots[offset] = prefix
                    self.content[block] = ("kv", tuple(slots))
        for rid, tokens, n, k in rows:
            for g in self.state_groups:
                if k:
                    block = int(tables[rid][g, (n + k - 1) // groups[g].block_size])
                    assert block != NULL_BLOCK, f"{rid}: the state after {n + k} tokens goes to the null block"
                    self._check_write(guards, rid, block, None, tuple(tokens[: n + k]))
                    self.content[block] = ("state", tuple(tokens[: n + k]))
        for rid, tokens, n, k in rows:
            if not k:
                continue
            for g in self.attention_groups:
                bs = groups[g].block_size
                for p in range(n + k):
                    block = int(tables[rid][g, p // bs])
                    held = self._kv(block, p % bs)
                    assert held == tuple(tokens[: p + 1]), (
                        f"{rid}: attention reads position {p} from block {block} (group {g}), which holds "
                        f"{held}; expected {tuple(tokens[: p + 1])}"
                    )
            for g in self.state_groups:  # no other row of the step wrote over it
                block = int(tables[rid][g, (n + k - 1) // groups[g].block_size])
                assert self.content[block] == ("state", tuple(tokens[: n + k])), f"{rid}: state block {block} shared"

    def check_index(self, index, prefix_of_key):
        """Every indexed block holds what its key names: a state group's block the state after the key's prefix,
        an attention block its slots up to the key's end (a partial entry: from the block start to it)."""
        for (key, g), (block, _) in index.items():
            prefix = prefix_of_key[key]
            if self.cfg.groups[g].kind == "mamba":
                assert self.content.get(block) == ("state", prefix), f"indexed state block {block}: {prefix}"
                continue
            start = (len(prefix) - 1) // self.cfg.groups[g].block_size * self.cfg.groups[g].block_size
            for p in range(start, len(prefix)):
                assert self._kv(block, p - start) == prefix[: p + 1], f"indexed block {block} (group {g}), {p}"


def chunk(num_tokens, prompt_len, start, budget, *, block_size, unit):
    """Tokens to compute from `start` within `budget` as `examples/serving.py`'s `_chunk` schedules them (vLLM's
    align mode): a prefill chunk ends at the next block end, or earlier at the prompt tail p* = ⌊(P − 1) / u⌋·u."""
    end = min(num_tokens, start + budget)
    if end - start > 1:
        end = min(end, (start // block_size + 1) * block_size)
        tail = (prompt_len - 1) // unit * unit
        if start < tail < end:
            end = tail
    return end - start


class Driver:
    """A scheduler over one manager and the shadow: requests, their tokens, and their pending hits."""

    def __init__(self, cfg, unit, *, apply_copies=True, backend="jax"):
        self.cfg = cfg
        self.mgr = KVCacheManager(
            cfg, max_num_seqs=NUM_SEQS, prefix_match_unit=unit, debug_checks=True, backend=backend
        )
        self.unit = self.mgr.prefix_config.unit
        self.block_size = cfg.groups[0].block_size
        self.shadow = Shadow(cfg, apply_copies)
        self.running: list[str] = []  # admission order: the scheduling priority
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}  # tokens when (re-)added: its prompt tail is what the chunks align to
        self.hit: dict[str, int] = {}  # the last lookup of a request with nothing computed, claimed at its first call
        self.prefix_of_key: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.next_id = 0

    def _hashed(self, tokens):
        for i, key in enumerate(prompt_unit_hashes(tokens, self.unit)):
            self.prefix_of_key[tuple(int(w) for w in key)] = tuple(tokens[: (i + 1) * self.unit])

    def add(self, tokens, rid=None):
        """Adds a request (or re-adds a preempted one with its grown tokens) and looks it up."""
        if rid is None:
            rid, self.next_id = f"r{self.next_id}", self.next_id + 1
        self.mgr.add_request(rid, tokens)
        self.running.append(rid)
        self.tokens[rid], self.prompt_len[rid] = list(tokens), len(tokens)
        self._hashed(tokens)
        self.look_up(rid)
        return rid

    def look_up(self, rid):
        self.hit[rid] = self.mgr.get_computed_tokens(rid)
        assert 0 <= self.hit[rid] < len(self.tokens[rid])

    def append(self, rid, token):
        self.mgr.append_token_ids(rid, [token])  # says the request's last step ran
        self.tokens[rid].append(token)
        self._hashed(self.tokens[rid])

    def allocate(self, rids, ks, must_fit=False):
        """One allocation call; a row with nothing computed claims its pending hit. Returns, per row that fits,
        (rid, tokens, n, k) for the step; a row with nothing computed that does not fit looks up again."""
        computed = [self.mgr.num_computed_tokens(rid) for rid in rids]
        hits = [self.hit.pop(rid, 0) if n == 0 else 0 for rid, n in zip(rids, computed)]
        ok = self.mgr.allocate_slots_batch(rids, ks, hits, full_sequence_must_fit=must_fit)
        rows = []
        for rid, n, h, k, fits in zip(rids, computed, hits, ks, ok):
            if fits:
                assert self.mgr.num_computed_tokens(rid) == n + h + k
                rows.append((rid, self.tokens[rid], n + h, k))
            elif n == 0:
                self.look_up(rid)  # the hit may be gone (refused) or the pool full: try again later
        return rows

    def run(self, rows, *, ran=True):
        """Ends a step: its copies are applied, then the forward pass runs (`ran`) or not (aborted: its
        requests are freed, the manager not told the step ran)."""
        self.shadow.copy(self.mgr.take_block_copies())
        if not ran:
            return
        rows = [row for row in rows if row[3]]
        if rows:
            live = list(self.running)
            tables = dict(zip(live, np.asarray(self.mgr.block_tables(live)).transpose(1, 0, 2)))
            computed = {rid: self.mgr.num_computed_tokens(rid) for rid in live}
            index = index_entries(self.mgr.state.prefix.index)
            guards = self.shadow.guards(tables, computed, self.tokens, index, self.prefix_of_key)
            self.shadow.step(tables, rows, guards)

    def loop(self, rids, wanted, data):
        """A device loop over decoding requests (`hand_over`, `hand_back`): each computes some of the tokens its
        reservation has room for, one per step, from the tables the loop was handed; each gives the next token.
        Every write is checked against what the other requests and the index hold when the loop starts."""
        others = [rid for rid in self.running if rid not in rids]
        tables = dict(zip(others, np.asarray(self.mgr.block_tables(others)).transpose(1, 0, 2))) if others else {}
        computed = {rid: self.mgr.num_computed_tokens(rid) for rid in self.running}
        rows = self.mgr.hand_over(rids, wanted)
        self.shadow.copy(self.mgr.take_block_copies())
        if rows is None:
            return
        reserved = np.asarray(rows.num_reserved)[: len(rids)].tolist()
        tables.update(zip(rids, np.asarray(rows.state.block_tables).transpose(1, 0, 2)))
        index = index_entries(self.mgr._engine.to_state().prefix.index)  # the manager's reads wait for hand_back
        guards = self.shadow.guards(tables, computed, self.tokens, index, self.prefix_of_key)
        num_steps = [data.draw(st.integers(0, r), label="computed_in_loop") for r in reserved]
        produced = {rid: [] for rid in rids}
        for step in range(max(num_steps, default=0)):
            step_rows = [
                (rid, self.tokens[rid], computed[rid] + step, 1) for rid, k in zip(rids, num_steps) if step < k
            ]
            self.shadow.step(tables, step_rows, guards)
            for rid, *_ in step_rows:
                token = data.draw(st.sampled_from(ALPHABET), label="sampled_in_loop")
                self.tokens[rid].append(token)
                produced[rid].append(token)
        self.mgr.hand_back(rids, [produced[rid] for rid in rids])
        for rid in rids:
            assert self.mgr.num_computed_tokens(rid) == computed[rid] + len(produced[rid])
            self._hashed(self.tokens[rid])

    def free(self, rids, *, mark):
        if mark:  # the last step of each ran (every step did, or was aborted and its requests freed at once)
            self.mgr.mark_computed(rids)
        self.mgr.free_batch(rids)
        for rid in rids:
            self.running.remove(rid)
            self.hit.pop(rid, None)

    def finish(self):
        state = self.mgr.state  # pending frees and keys applied
        jaxkv.check_invariants(self.cfg, state, self.mgr.prefix_config)
        self.shadow.check_index(index_entries(state.prefix.index), self.prefix_of_key)


def draw_prompt(data, seen):
    """A prompt of the alphabet, often a prefix of an earlier one extended: shared prefixes of every length."""
    tokens = []
    if seen and data.draw(st.sampled_from([True, True, True, False]), label="extends_earlier"):
        base = data.draw(st.sampled_from(seen), label="earlier")
        shared = data.draw(st.one_of(st.just(len(base)), st.integers(len(base) // 2, len(base))), label="shared")
        tokens = list(base[:shared])
    size = MAX_PROMPT_LEN - len(tokens)
    tail = data.draw(st.lists(st.sampled_from(ALPHABET), min_size=min(size, 4), max_size=size), label="tail")
    return tokens + tail


def run_random_sequence(data, unit, backend="jax"):
    """Random adds, steps (running rows, then maybe a preemption or an admission; then the forward pass, or an
    abort), frees and preemptions, each through the manager (invariants checked after every call) and the shadow."""
    d = Driver(CFG, unit, backend=backend)
    seen: list[tuple[int, ...]] = []
    budget = CFG.max_num_batched_tokens
    for _ in range(data.draw(st.integers(8, 32), label="num_ops")):
        op = data.draw(
            st.sampled_from(["step", "step", "step", "step", "add", "free", "preempt", "loop", "loop"]), label="op"
        )
        if not d.running or (op == "step" and d.mgr.num_requests < 2 and data.draw(st.booleans(), label="add")):
            op = "add"
        if op == "add" and d.mgr.num_requests < NUM_SEQS:
            tokens = draw_prompt(data, seen)
            seen.append(tuple(tokens))
            d.add(tokens)
        elif op == "step" and d.running:
            # 1. Running requests in priority order: decodes (the token the last step sampled) and prefill chunks.
            scheduled = st.sampled_from([True, True, True, False])
            rids = [rid for rid in d.running if data.draw(scheduled, label="scheduled")] or d.running[:1]
            ks, left = [], budget
            for rid in rids:
                tokens = d.tokens[rid]
                if d.mgr.num_computed_tokens(rid) == len(tokens) and len(tokens) < CFG.max_model_len:
                    d.append(rid, data.draw(st.sampled_from(ALPHABET), label="sampled"))
                if rid in d.hit and data.draw(st.sampled_from([True, True, False]), label="look_up_again"):
                    d.look_up(rid)  # as a scheduler does when it admits; otherwise the hit may be stale
                start = d.mgr.num_computed_tokens(rid) or d.hit.get(rid, 0)
                limit = min(len(tokens) - start, left)
                if data.draw(st.sampled_from([True, True, False]), label="aligned"):
                    k = chunk(len(tokens), d.prompt_len[rid], start, left, block_size=d.block_size, unit=d.unit)
                else:
                    k = data.draw(st.integers(0, limit), label="num_new_tokens")
                ks.append(k)
                left -= k
            must_fit = [d.mgr.num_computed_tokens(rid) == 0 and data.draw(st.booleans(), label="fit") for rid in rids]
            rows = d.allocate(rids, ks, must_fit)
            step_rids = list(rids)
            preempted = len(rows) < len(rids) and data.draw(st.booleans(), label="preempt_in_step")
            if preempted:
                # As a scheduler makes room: the newest request goes, maybe with its allocation of this step,
                # whose forward pass will not run for it (so it is not marked); it comes back with its tokens.
                victim = d.running[-1]
                d.free([victim], mark=victim not in rids and data.draw(st.booleans(), label="mark_victim"))
                d.add(d.tokens[victim], rid=victim)
                rows = [row for row in rows if row[0] != victim]
                step_rids = [rid for rid in step_rids if rid != victim]
            # 2. Admission in the same step: its hit may cover blocks the rows above compute in this step.
            left = budget - sum(row[3] for row in rows)
            if not preempted and d.mgr.num_requests < NUM_SEQS and left > 0 and data.draw(st.booleans(), label="admit"):
                tokens = draw_prompt(data, seen)
                seen.append(tuple(tokens))
                rid = d.add(tokens)
                k = chunk(len(tokens), len(tokens), d.hit[rid], left, block_size=d.block_size, unit=d.unit)
                rows += d.allocate([rid], [k], data.draw(st.booleans(), label="admit_fit"))
                step_rids.append(rid)
            # 3. The forward pass runs, or the step is aborted: its requests are freed, never marked.
            ran = data.draw(st.sampled_from([True] * 5 + [False]), label="ran")
            d.run(rows, ran=ran)
            if not ran:
                d.free(step_rids, mark=False)
                continue
            if data.draw(st.booleans(), label="mark"):
                d.mgr.mark_computed([rid for rid, *_ in rows])
            if len(rows) < len(step_rids) and data.draw(st.booleans(), label="preempt_for_room"):
                op = "preempt"  # as a scheduler makes room when a request does not fit
        elif op == "free" and d.running:
            rids = data.draw(st.lists(st.sampled_from(d.running), min_size=1, unique=True), label="free")
            for rid in rids:  # a request that ends on a decode: its last token is appended (its step ran)
                tokens = d.tokens[rid]
                if 0 < d.mgr.num_computed_tokens(rid) == len(tokens) < CFG.max_model_len:
                    if data.draw(st.booleans(), label="append_last"):
                        d.append(rid, data.draw(st.sampled_from(ALPHABET), label="sampled"))
            d.free(rids, mark=data.draw(st.booleans(), label="mark_before_free"))
        elif op == "loop":
            # Decoding requests (all their tokens computed but the one the last step sampled) in a device loop.
            rids = []
            for rid in d.running:
                tokens, n = d.tokens[rid], d.mgr.num_computed_tokens(rid)
                if n and n >= len(tokens) - 1 and len(tokens) < CFG.max_model_len:
                    if n == len(tokens):
                        d.append(rid, data.draw(st.sampled_from(ALPHABET), label="sampled"))
                    rids.append(rid)
            if rids:
                d.loop(rids, [data.draw(st.integers(1, 6), label="wanted") for _ in rids], data)
        if op == "preempt" and d.running:
            rid = d.running[-1]  # the newest request loses its blocks and comes back with all its tokens
            d.free([rid], mark=data.draw(st.booleans(), label="mark_before_preempt"))
            d.add(d.tokens[rid], rid=rid)
    d.finish()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data())
def test_states_resumed_are_their_prefixes_jitted(data):
    # Unit 2 below the block size 4: hits inside blocks, copies, states moved at the prompt tail.
    run_random_sequence(data, 2)


@settings(max_examples=5, deadline=None, derandomize=True)
@given(data=st.data())
def test_states_resumed_are_their_prefixes_default_unit_jitted(data):
    # Unit 4 (the block size): hits at block ends only; each step runs a program compiled for its work.
    run_random_sequence(data, None)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(data=st.data())
def test_states_resumed_are_their_prefixes_host_backend(data):
    run_random_sequence(data, 2, backend="host")


@settings(max_examples=1, deadline=None, derandomize=True)
@given(data=st.data())
def test_states_resumed_are_their_prefixes_eager(data):
    with jax.disable_jit():
        run_random_sequence(data, 2)


# ---- the checks fire --------------------------------------------------------------------------


def saved_tail_then_next_chunk(apply_copies):
    # An 11-token prompt, unit 2: a chunk ends at its tail p* = 10 (inside block 2); the next call indexes the
    # state there and moves the request to a fresh block with a copy of it, from which its next step reads.
    d = Driver(CFG, 2, apply_copies=apply_copies)
    rid = d.add(list(range(100, 111)))
    d.run(d.allocate([rid], [10]))
    d.run(d.allocate([rid], [1]))


def test_a_copy_left_out_is_caught():
    saved_tail_then_next_chunk(apply_copies=True)
    with pytest.raises(AssertionError, match=r"r0: resumes at n=10 from state block \d+ \(group 0\), which holds None"):
        saved_tail_then_next_chunk(apply_copies=False)


def step_not_run_then_hit(mark):
    # A schedules its first 8 tokens (a block end: the state after 8 is saved once its step is known to have
    # run); the step never runs, and A is freed. B shares A's 8 tokens.
    d = Driver(CFG, 2)
    a = d.add([1, 2, 3, 1, 2, 3, 1, 2, 3])
    d.run(d.allocate([a], [8]), ran=False)
    d.free([a], mark=mark)  # mark=True: the caller says a step ran that did not
    b = d.add([1, 2, 3, 1, 2, 3, 1, 2, 2, 2])
    assert d.hit[b] == (8 if mark else 0)
    rows = d.allocate([b], [2])
    d.run(rows)


def test_a_step_marked_but_not_run_is_caught():
    step_not_run_then_hit(mark=False)  # told the truth: nothing of the step is found
    with pytest.raises(AssertionError, match="r1: resumes at n=8 from state block"):
        step_not_run_then_hit(mark=True)
