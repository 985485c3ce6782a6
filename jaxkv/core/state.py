"""ManagerState: the block pool and per-request block tables, updated by jitted pure functions.

Dimensions: R requests in one call, G KV cache groups, S request slots
(`max_num_seqs`), M max blocks per request (`cdiv(max_model_len, smallest
block size)`), N blocks, T scheduled tokens, K table entries handled per loop
step.

A request lives in a slot chosen by the host (`KVCacheManager` maps ids to
slots). Per slot and group, the block table maps logical block index j (tokens
`j × block_size` to `(j + 1) × block_size − 1`) to a block id:

    group kind       holds NULL_BLOCK below logical index        (n: tokens computed)
    full             0
    sliding window W max(0, n − W + 1) // block_size
    chunked local C  (n // C) × C // block_size
    mamba            max(0, n − 1) // block_size; it holds one state block, at the
                     last index, plus the previous one until the next call

The rule is applied at the start of `allocate`, by the tokens computed before
the call (vLLM's rule), so during a step the blocks the step's attention reads
are still held. `first_live_idx` is where it was last applied.

Every transition is `new_state, result = f(state, ...)`, jitted with the
config (and chunk sizes) static and the state donated: after a call, use only
the returned state.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxkv.core.pool import NOT_CACHED, PoolState, cumsum, init_pool, pop, release
from jaxkv.core.ranges import in_chunks as _in_chunks
from jaxkv.core.ranges import range_chunk as _range_chunk
from jaxkv.core.ranges import range_layout as _range_layout
from jaxkv.core.ranges import table_ranges as _table_ranges
from jaxkv.planner.config import KVCacheConfig
from jaxkv.planner.specs import NULL_BLOCK, cdiv
from jaxkv.prefix import state as ps
from jaxkv.prefix import tails as pt
from jaxkv.prefix.index import remove
from jaxkv.prefix.lookup import lookup as prefix_lookup

FULL, SLIDING_WINDOW, CHUNKED_LOCAL, MAMBA = 0, 1, 2, 3
_KIND_CODES = {"full": FULL, "sliding_window": SLIDING_WINDOW, "chunked_local": CHUNKED_LOCAL, "mamba": MAMBA}


@dataclasses.dataclass(frozen=True)
class ManagerState:
    """The whole runtime state of the cache manager; a pytree of arrays.

    pool:           PoolState     reference counts, free order, cached-block hashes
    block_tables:   int32[G, S, M] physical block per group, slot, logical block index
    first_live_idx: int32[G, S]   logical index below which the table holds NULL_BLOCK
    num_computed:   int32[S]      tokens given slots so far, this step's included (0: slot unused)
    prefix:         PrefixState or None (prefix caching off): index, unit keys, cache progress
    """

    pool: PoolState
    block_tables: jax.Array
    first_live_idx: jax.Array
    num_computed: jax.Array
    prefix: ps.PrefixState | None = None


jax.tree_util.register_dataclass(
    ManagerState, data_fields=[f.name for f in dataclasses.fields(ManagerState)], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class AllocateResult:
    """ok: bool[R] (padding rows False); num_free_blocks: int32[] after the call;
    num_hit_tokens: int32[] prefix-cache hit tokens the ok rows claimed;
    copies: int32[R, G, 3] block copies the call made (source, destination, valid tokens of the
    block; zeros: none): apply them before the forward pass, then release them in a later call
    (`jaxkv.prefix.tails`)."""

    ok: jax.Array
    num_free_blocks: jax.Array
    num_hit_tokens: jax.Array
    copies: jax.Array


jax.tree_util.register_dataclass(
    AllocateResult, data_fields=["ok", "num_free_blocks", "num_hit_tokens", "copies"], meta_fields=[]
)


@dataclasses.dataclass(frozen=True)
class GroupRules:
    """Static per-group constants, int32[G] numpy arrays (window/chunk are 1 where unused).

    keep_*: `keep_from_idx` in one formula for every kind, max(n + offset, 0) // unit · scale // div:
    sliding window (1 − window, block, 1, 1), chunked (0, chunk, chunk, block), state (−1, block, 1, 1),
    full attention (0, 1, 0, 1).
    """

    block_size: np.ndarray
    kind: np.ndarray
    window: np.ndarray
    chunk: np.ndarray
    max_blocks: np.ndarray  # blocks one request may hold (vLLM's admission cap)
    keep_offset: np.ndarray
    keep_unit: np.ndarray
    keep_scale: np.ndarray
    keep_div: np.ndarray

    @property
    def num_groups(self) -> int:
        return len(self.block_size)


@functools.cache
def group_rules(cfg: KVCacheConfig) -> GroupRules:
    def column(values):
        return np.asarray(values, np.int32)

    groups = cfg.groups
    block_size = column([g.block_size for g in groups])
    kind = column([_KIND_CODES[g.kind] for g in groups])
    window = column([g.spec.sliding_window if g.kind == "sliding_window" else 1 for g in groups])
    chunk = column([g.spec.attention_chunk_size if g.kind == "chunked_local" else 1 for g in groups])
    chunked, full = kind == CHUNKED_LOCAL, kind == FULL
    return GroupRules(
        block_size=block_size,
        kind=kind,
        window=window,
        chunk=chunk,
        max_blocks=column([g.spec.blocks_per_request(cfg.max_model_len, cfg.max_num_batched_tokens) for g in groups]),
        keep_offset=np.where(kind == SLIDING_WINDOW, 1 - window, np.where(kind == MAMBA, -1, 0)).astype(np.int32),
        keep_unit=np.where(chunked, chunk, np.where(full, 1, block_size)).astype(np.int32),
        keep_scale=np.where(chunked, chunk, np.where(full, 0, 1)).astype(np.int32),
        keep_div=np.where(chunked, block_size, 1).astype(np.int32),
    )


def max_blocks_per_request(cfg: KVCacheConfig) -> int:
    """M: table width, enough for max_model_len tokens in the group of smallest blocks."""
    return cdiv(cfg.max_model_len, min(g.block_size for g in cfg.groups))


def default_chunk_sizes(cfg: KVCacheConfig, num_requests: int) -> tuple[int, ...]:
    """K choices for a call over R requests: 512, 2048, ... (× 4) up to the entries one engine
    step of R requests can touch.

    Each loop takes the smallest that covers its total in one step (the largest, in several,
    otherwise): decode steps touch a few entries, prefill-heavy ones thousands.
    """
    rules = group_rules(cfg)
    per_step = rules.num_groups * (cdiv(cfg.max_num_batched_tokens, int(rules.block_size.min())) + num_requests)
    full = int(min(1 << (per_step - 1).bit_length(), rules.num_groups * num_requests * max_blocks_per_request(cfg)))
    sizes = [full]
    while sizes[-1] > 512:
        sizes.append(max(sizes[-1] // 4, 512))
    return tuple(reversed(sizes))


def init_state(cfg: KVCacheConfig, max_num_seqs: int, prefix: ps.PrefixCacheConfig | None = None) -> ManagerState:
    """Every block free, every slot empty; with `prefix`, an empty prefix cache (pass the same
    `prefix` to the transitions)."""
    if not cfg.groups:
        raise ValueError("the config has no KV cache groups")
    if max_num_seqs <= 0:
        raise ValueError(f"{max_num_seqs=} must be positive")
    shape = (len(cfg.groups), max_num_seqs, max_blocks_per_request(cfg))
    return ManagerState(
        pool=init_pool(cfg.num_blocks),
        block_tables=jnp.full(shape, NULL_BLOCK, jnp.int32),
        first_live_idx=jnp.zeros(shape[:2], jnp.int32),
        num_computed=jnp.zeros(max_num_seqs, jnp.int32),
        prefix=None if prefix is None else ps.init_prefix_state(cfg, prefix, max_num_seqs),
    )


def keep_from_idx(num_computed, rules: GroupRules, xp=jnp):
    """int[R, G]: the first logical index each group still needs after `num_computed` [R, 1] tokens.

    `xp` is jax.numpy on device or numpy on the host (the manager mirrors the counts).
    Sliding window: past the window; chunked: before the current chunk; state: the last
    token's block; full attention: 0 (`GroupRules` holds the one formula's constants).
    """
    return xp.maximum(num_computed + rules.keep_offset, 0) // rules.keep_unit * rules.keep_scale // rules.keep_div


def allocation_ranges(num_computed, num_new_tokens, first_live, rules: GroupRules, xp=jnp):
    """The table ranges one allocation touches, per row and group.

    num_computed, num_new_tokens: int[R, 1]; first_live: int[R, G].
    Returns int[R, G] arrays (keep, num_released, first_new, need): entries
    [first_live, keep) are released (a state group: only its old block, so at
    most 1), then [first_new, first_new + need) get new blocks; keep is the new
    first_live. A state group takes only the block of the last new token.
    """
    n, is_mamba = num_computed, rules.kind == MAMBA
    table_len = -(-n // rules.block_size)
    keep = xp.maximum(first_live, xp.minimum(keep_from_idx(n, rules, xp), table_len))
    num_released = xp.where(is_mamba, xp.minimum(keep - first_live, 1), keep - first_live)
    new_len = -(-(n + num_new_tokens) // rules.block_size)
    first_new = xp.where(is_mamba, xp.maximum(table_len, new_len - 1), table_len)
    return keep, num_released, first_new, new_len - first_new


def held_ranges(num_computed, first_live, rules: GroupRules, xp=jnp):
    """The table entries a request holds, per group: `start + i × stride`, i in [0, count).

    num_computed: int[R, 1]; first_live: int[R, G]. Returns int[R, G] arrays
    (start, count, stride). A state group holds at most two blocks: at first_live
    and at the last index (entries may be NULL_BLOCK where nothing was taken).
    """
    table_len = -(-num_computed // rules.block_size)
    start = xp.minimum(first_live, table_len)
    last_idx = table_len - 1
    is_mamba = rules.kind == MAMBA
    count = xp.where(is_mamba, xp.where(table_len == 0, 0, xp.where(last_idx > start, 2, 1)), table_len - start)
    stride = xp.where(is_mamba, xp.maximum(last_idx - start, 1), 1)
    return start, count, stride


def _release_ranges(state: ManagerState, ranges, chunk_sizes, evict_from=None, uncache_from=None) -> ManagerState:
    """Releases the table entries of `ranges` (from `_table_ranges`), each range tail first.

    NULL entries are skipped; released entries become NULL. `evict_from` int32[Q] or None:
    per range, the cached blocks at table indices from it on go to the head of the free
    order, as uncached ones do (`pool.release`'s evict_first). `uncache_from` int32[Q] or
    None (prefix caching): per range, the cached blocks at table indices from it on leave
    the index first (`jaxkv.prefix.state.uncache_blocks`): their content is not known.
    """
    count, first, step = ranges
    shape = state.block_tables.shape
    out_of_range = shape[0] * shape[1] * shape[2]
    layout = _range_layout(count, max_entries=count.shape[0] * shape[2])
    extra = [c for c in (evict_from, uncache_from) if c is not None]
    attrs = jnp.stack([first, step, count, *extra], axis=1)  # one gather per entry instead of several

    def release_body(size):
        def release_chunk(chunk_idx, state):
            in_range, range_id, offset = _range_chunk(layout, chunk_idx, size)
            entry_attrs = attrs[range_id].T
            first_idx, idx_step, n = entry_attrs[:3]
            idx = jnp.where(in_range, first_idx + (n - 1 - offset) * idx_step, out_of_range)
            tables = state.block_tables.reshape(-1)
            block = tables.at[idx].get(mode="fill", fill_value=NULL_BLOCK)
            # The written value depends on the read one (ids are ≥ 0), so XLA orders the
            # read first and writes in place instead of copying the tables.
            null = jnp.where(block < 0, block, NULL_BLOCK)
            evict_first = None if evict_from is None else idx % shape[2] >= entry_attrs[3]
            if uncache_from is not None:
                unknown = (block != NULL_BLOCK) & (idx % shape[2] >= entry_attrs[-1])
                state = ps.uncache_blocks(state, block, unknown & (state.pool.block_group[block] != NOT_CACHED))
            return dataclasses.replace(
                state,
                pool=release(state.pool, block, block != NULL_BLOCK, evict_first),
                block_tables=tables.at[idx].set(null, mode="drop").reshape(shape),
            )

        return release_chunk

    return _in_chunks(layout[-1], chunk_sizes, release_body, state)


def _fill_ranges(state: ManagerState, ranges, chunk_sizes) -> ManagerState:
    """Gives the table entries of `ranges` (from `_table_ranges`, step 1) new blocks, in order.

    A popped block that was cached is evicted: its index entry goes in the same step.
    """
    count, first, _ = ranges
    shape = state.block_tables.shape
    out_of_range = shape[0] * shape[1] * shape[2]
    layout = _range_layout(count, max_entries=count.shape[0] * shape[2])
    total = layout[-1]

    def fill_body(size):
        def fill_chunk(chunk_idx, state):
            in_range, range_id, offset = _range_chunk(layout, chunk_idx, size)
            pool, blocks = pop(state.pool, jnp.minimum(size, total - chunk_idx * size), size)
            idx = jnp.where(in_range, first[range_id] + offset, out_of_range)
            tables = state.block_tables.reshape(-1).at[idx].set(blocks, mode="drop").reshape(shape)
            prefix = state.prefix
            if prefix is not None:
                prefix = dataclasses.replace(prefix, index=remove(prefix.index, blocks, blocks != NULL_BLOCK))
            return dataclasses.replace(state, pool=pool, block_tables=tables, prefix=prefix)

        return fill_chunk

    return _in_chunks(total, chunk_sizes, fill_body, state)


def _rows(state: ManagerState, req_slots):
    """(row bool[R]: not padding, slots for gathers [R], slots for scatters [R] (S on padding))."""
    num_slots = state.num_computed.shape[0]
    row = (req_slots >= 0) & (req_slots < num_slots)
    return row, jnp.where(row, req_slots, 0), jnp.where(row, req_slots, num_slots)


def _forget_rows(state: ManagerState, req_slots, rules: GroupRules):
    """Empties the slots of requests being freed.

    Returns the state, the table ranges they held (for `_release_ranges`) and int32[] the
    blocks that holds (exact without shared blocks; an overestimate with them).
    """
    row, slots, scatter_slots = _rows(state, req_slots)
    shape = state.block_tables.shape
    n = jnp.where(row, state.num_computed[slots], 0)[:, None]
    start, count, stride = held_ranges(n, state.first_live_idx[:, slots].T, rules)
    count = jnp.where(row[:, None], count, 0)
    # Attention ranges hold a block at every entry; a state group's two entries may be NULL.
    group = jnp.arange(shape[0])[None, :]
    first_block = state.block_tables[group, slots[:, None], jnp.minimum(start, shape[2] - 1)]
    last_block = state.block_tables[group, slots[:, None], jnp.minimum(start + stride, shape[2] - 1)]
    # int32: a sum of two bool arrays would be their OR, and a state group's two blocks would count as one.
    state_blocks = ((count > 0) & (first_block != NULL_BLOCK)).astype(jnp.int32) + (
        (count > 1) & (last_block != NULL_BLOCK)
    ).astype(jnp.int32)
    num_blocks = jnp.sum(jnp.where(rules.kind == MAMBA, state_blocks, count))
    ranges = _table_ranges(shape, slots, start, count, stride)
    state = dataclasses.replace(
        state,
        first_live_idx=state.first_live_idx.at[:, scatter_slots].set(0, mode="drop"),
        num_computed=state.num_computed.at[scatter_slots].set(0, mode="drop"),
    )
    return state, ranges, num_blocks


def _allocate(
    state: ManagerState,
    req_slots,
    num_new_tokens,
    num_full_tokens=None,
    free_slots=None,
    num_hit_tokens=None,
    hash_uploads=None,
    num_prompt_tokens=None,
    released_copies=None,
    num_shared_tokens=None,
    free_num_written=None,
    num_rejected_tokens=None,
    *,
    cfg: KVCacheConfig,
    chunk_sizes: tuple[int, ...] | None = None,
    prefix: ps.PrefixCacheConfig | None = None,
) -> tuple[ManagerState, AllocateResult]:
    """Makes room for `num_new_tokens` int32[R] more tokens of each request `req_slots` int32[R],
    in priority order: `jaxkv.core.step.allocate_step` with the parts of its `StepBatch` given as
    arguments (same names and meanings) and every walk sized at run time. Jitted as `allocate`
    (config, chunk sizes and prefix config static, state donated)."""
    from jaxkv.core.step import StepBatch, allocate_step  # the step is built from this module's pieces

    batch = StepBatch(
        req_slots=req_slots,
        num_new_tokens=num_new_tokens,
        num_full_tokens=num_full_tokens,
        num_hit_tokens=num_hit_tokens,
        num_shared_tokens=num_shared_tokens,
        num_prompt_tokens=num_prompt_tokens,
        free_slots=free_slots,
        free_num_written=free_num_written,
        hash_uploads=hash_uploads,
        released_copies=released_copies,
        num_rejected_tokens=num_rejected_tokens,
    )
    return allocate_step(state, batch, cfg=cfg, prefix=prefix, chunk_sizes=chunk_sizes)


def _partial_groups(rules: GroupRules, prefix: ps.PrefixCacheConfig):
    """(bool[G] mask, full-attention groups, state groups) where hits may end inside a block (static)."""
    mask = ((rules.kind == FULL) | (rules.kind == MAMBA)) & (rules.block_size > prefix.unit)
    return (
        mask,
        tuple(int(g) for g in np.flatnonzero(mask & (rules.kind == FULL))),
        tuple(int(g) for g in np.flatnonzero(mask & (rules.kind == MAMBA))),
    )


def _free_cached(
    state: ManagerState, req_slots, rules: GroupRules, prefix: ps.PrefixCacheConfig, sizes, num_written=None
):
    """`_free` with a prefix cache: the state blocks the requests' last step ended on, and their
    prompt-tail blocks (`jaxkv.prefix.tails.register_tails`), become findable first; the slots' keys and
    cache progress are forgotten. Pinned copies stay pinned.

    `num_written` int32[R] or None (all): the tokens of each request a forward pass is known to have
    written. A request with fewer than it computed (its last allocation's step may not have run) makes
    nothing findable, and its attention blocks from index num_written // b on leave the index (an
    allocation indexes the blocks it fills before their step runs)."""
    row, slots, scatter_slots = _rows(state, req_slots)
    num_computed = jnp.where(row, state.num_computed[slots], 0)
    uncache_from = None
    if num_written is not None:
        ran = num_written >= num_computed
        unknown_from = jnp.maximum(num_written, 0)[:, None] // rules.block_size[None, :]  # [R, G]
        keep_all = ran[:, None] | (rules.kind == MAMBA)[None, :]  # a state block is never indexed while written
        uncache_from = jnp.where(keep_all, state.block_tables.shape[2], unknown_from).reshape(-1)
        num_computed = jnp.where(ran, num_computed, 0)  # nothing of its last step becomes findable
    state = ps.cache_state_blocks(
        state,
        scatter_slots,
        num_computed,
        state_groups=tuple(int(g) for g in np.flatnonzero(rules.kind == MAMBA)),
        rules=rules,
        prefix=prefix,
    )
    partial_mask, full_partial, state_partial = _partial_groups(rules, prefix)
    if partial_mask.any():
        state, _ = pt.register_tails(
            state,
            scatter_slots,
            num_computed,
            block_size=rules.block_size,
            unit=prefix.unit,
            full_groups=full_partial,
            state_groups=state_partial,
            move=False,
        )
    state, ranges, _ = _forget_rows(state, req_slots, rules)
    state = dataclasses.replace(state, prefix=ps.forget_slots(state.prefix, scatter_slots))
    return _release_ranges(state, ranges, sizes, uncache_from=uncache_from)


def _free(
    state: ManagerState,
    req_slots,
    num_written=None,
    *,
    cfg: KVCacheConfig,
    chunk_sizes: tuple[int, ...] | None = None,
    prefix: ps.PrefixCacheConfig | None = None,
) -> ManagerState:
    """Frees requests: every block they hold loses a reference; the slots become empty.

    req_slots: int32[R] distinct slots; S marks a padding row. Per request the
    blocks are freed group by group, each group tail first (vLLM's order), so
    that among cached blocks a shared prefix is evicted after the tails.
    num_written: int32[R] or None (prefix caching): the tokens of each request
    that a forward pass is known to have written; None: every token it computed
    (its last allocation's step ran). The blocks an allocation cached before its
    step ran, and the states that step would have written, stay findable only
    for a request whose step is known to have run (`_free_cached`). Jitted as
    `free` (config, chunk sizes and prefix config static, state donated).
    """
    rules = group_rules(cfg)
    sizes = chunk_sizes or default_chunk_sizes(cfg, req_slots.shape[0])
    if state.prefix is not None:
        prefix = ps.check_prefix_config(cfg, state.prefix, prefix)
        return _free_cached(state, req_slots, rules, prefix, sizes, num_written)
    state, ranges, _ = _forget_rows(state, req_slots, rules)
    return _release_ranges(state, ranges, sizes)


def _slot_mappings(
    state: ManagerState, req_slots, num_new_tokens, num_lookahead_tokens=None, *, cfg: KVCacheConfig, num_tokens: int
):
    """int32[G, T]: `block_id × block_size + offset` of each scheduled token, per group.

    Call after `allocate` with the same rows: row r's tokens are positions
    [end − num_new_tokens, end), end = num_computed − num_lookahead_tokens (int32[R] or None: 0;
    lookahead slots reserved after the scheduled tokens), packed in row order into T =
    `num_tokens` entries; padding entries and state (mamba) groups hold −1 (a
    state layer reads and writes the block at `(num_computed − 1) // block_size`).
    """
    rules = group_rules(cfg)
    num_groups, num_slots, max_blocks = state.block_tables.shape
    row = (req_slots >= 0) & (req_slots < num_slots)
    k = jnp.where(row, num_new_tokens, 0)
    ends = cumsum(k)
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    r = jnp.minimum(jnp.searchsorted(ends, token, side="right"), k.shape[0] - 1)
    slot = jnp.where(row[r], req_slots[r], 0)
    end = state.num_computed[slot] - (0 if num_lookahead_tokens is None else num_lookahead_tokens[r])
    pos = end - ends[r] + token  # [T]
    bs = rules.block_size[:, None]  # [G, 1]
    idx = pos[None, :] // bs
    block = state.block_tables[jnp.arange(num_groups)[:, None], slot[None, :], jnp.minimum(idx, max_blocks - 1)]
    valid = (token < ends[-1])[None, :] & (block != NULL_BLOCK) & (rules.kind != MAMBA)[:, None]
    return jnp.where(valid, block * bs + pos[None, :] % bs, -1)


def _block_tables(state: ManagerState, req_slots):
    """int32[G, R, M]: the rows' block tables as kernels take them (padding rows: NULL_BLOCK)."""
    return state.block_tables.at[:, req_slots, :].get(mode="fill", fill_value=NULL_BLOCK)


def _decode_steps(
    state: ManagerState,
    req_slots,
    *,
    cfg: KVCacheConfig,
    num_steps: int,
    chunk_sizes: tuple[int, ...] | None = None,
    prefix: ps.PrefixCacheConfig | None = None,
):
    """Runs `num_steps` decode steps on device: each allocates one token per row.

    req_slots: int32[R]. A row that does not fit in a step stalls for that step
    (allocate's batch rule applies per step). Returns the state, ok bool[num_steps, R]
    and each step's slot mappings int32[num_steps, G, R] (the ok rows' tokens packed in row
    order, −1 after them). Equals `num_steps` calls of `allocate` + `slot_mappings`. Jitted
    as `decode_steps`.
    The loop returns no block copies: with hits inside blocks (`jaxkv.prefix.tails`), a row
    whose last step ended at its prompt tail inside a state block must take its next call
    through `allocate` (that call moves it to a copy of the block).
    """
    row = (req_slots >= 0) & (req_slots < state.num_computed.shape[0])

    def step(state, _):
        state, result = _allocate(
            state, req_slots, row.astype(jnp.int32), cfg=cfg, chunk_sizes=chunk_sizes, prefix=prefix
        )
        ok = result.ok.astype(jnp.int32)
        return state, (result.ok, _slot_mappings(state, req_slots, ok, cfg=cfg, num_tokens=req_slots.shape[0]))

    state, (ok, slot_mapping) = lax.scan(step, state, None, length=num_steps)
    return state, ok, slot_mapping


def _lookup(
    state: ManagerState,
    keys,
    num_keys,
    num_tokens,
    *,
    cfg: KVCacheConfig,
    prefix: ps.PrefixCacheConfig | None = None,
    chunk_sizes: tuple[int, ...] | None = None,
    drop_last_block: bool = False,
):
    """The longest prefix-cache hit of each request, valid for every group; changes nothing.

    keys: uint32[R, X, 4] the requests' unit keys; num_keys: int32[R] (0: padding row);
    num_tokens: int32[R]. Returns (hit_len int32[R], shared_len int32[R], PrefixStats). See
    `jaxkv.prefix.state.lookup` (`drop_last_block`: the EAGLE rule). Jitted as `lookup` (config,
    prefix config, chunk sizes and the rule static).
    """
    if state.prefix is None:
        raise ValueError("lookup needs a state with a prefix cache (init_state(..., prefix=...))")
    prefix = ps.check_prefix_config(cfg, state.prefix, prefix)
    sizes = chunk_sizes or default_chunk_sizes(cfg, keys.shape[0])
    return prefix_lookup(
        state.prefix.index,
        keys,
        num_keys,
        num_tokens,
        cfg=cfg,
        prefix=prefix,
        chunk_sizes=sizes,
        drop_last_block=drop_last_block,
    )


allocate = jax.jit(_allocate, static_argnames=("cfg", "chunk_sizes", "prefix"), donate_argnames=("state",))
free = jax.jit(_free, static_argnames=("cfg", "chunk_sizes", "prefix"), donate_argnames=("state",))
lookup = jax.jit(_lookup, static_argnames=("cfg", "prefix", "chunk_sizes", "drop_last_block"))
slot_mappings = jax.jit(_slot_mappings, static_argnames=("cfg", "num_tokens"))
block_tables = jax.jit(_block_tables)
decode_steps = jax.jit(
    _decode_steps, static_argnames=("cfg", "num_steps", "chunk_sizes", "prefix"), donate_argnames=("state",)
)
