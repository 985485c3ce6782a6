"""Plan a hybrid KV cache on the host: groups, one page size, the pool size, buffer views.

Static and pure Python. `plan()` turns a mapping of layer name → spec (or → the
name of the layer whose cache it shares) and a byte budget into a frozen
`KVCacheConfig`.

Steps for `grouping="vllm"` (vLLM 0.33's planner, as a CUDA engine resolves it):

1. One group if every layer has the same spec, or if all layers keep the same
   blocks (same kind, block size and window; pages may differ: DeepSeek-V3.2's
   latent and indexer caches).
2. Otherwise unify page sizes: the largest page P wins; an attention page p
   that divides P multiplies its block size by P/p; a state page, or an
   attention page that does not divide P, is padded up to P.
3. Bucket layers by spec in order of first appearance. Group size = the
   largest bucket's length if below 1.5× the smallest's, else the smallest's;
   each bucket splits into n = cdiv(len, size) interleaved groups
   (bucket[i::n]). Every block id costs the largest group's page, so a group
   with fewer layers leaves padding.

`grouping="auto"` starts from vLLM's grouping and takes an alternative only when
it gives more capacity (at least `AUTO_MIN_GAIN` more if it has more groups), or
as much with fewer groups, so it is never worse. The alternatives: every group
size from 1 to the largest bucket (at most `max_groups` groups), on vLLM's page
unification and on an lcm unification (every attention block size scaled so its
page reaches the least common multiple of the attention pages, raised to cover
any state page; no attention page is padded).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from fractions import Fraction

from jaxkv.planner.config import LAYOUTS, KVCacheConfig, KVCacheGroup, KVCacheTensor
from jaxkv.planner.specs import AttentionSpec, FullAttentionSpec, KVCacheSpec, MambaSpec, MLAAttentionSpec, cdiv

GROUPINGS = ("auto", "vllm")

# Capacity gain "auto" needs before it takes a grouping with more groups (each costs a block table and per-step work).
AUTO_MIN_GAIN = 0.01

# Slots (`block_id * block_size + offset`) are int32: num_blocks * block_size may not pass this.
MAX_SLOTS = 2**31

Groups = tuple[KVCacheGroup, ...]


def plan(
    layers: Mapping[str, KVCacheSpec | str],
    available_bytes: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int = 2048,
    hybrid: bool = True,
    grouping: str = "auto",
    layout: str = "BLHNC",
    max_groups: int = 16,
) -> KVCacheConfig:
    """Plan the KV cache of `layers` in `available_bytes` bytes.

    Args:
      layers: layer name → spec, or → the name of another layer whose cache it
        reuses (KV sharing; chains resolve to the final owner).
      available_bytes: bytes for the whole cache; `num_blocks` is this divided by
        the bytes of one block id, null block included; slots are int32, so
        num_blocks × block size may not pass `MAX_SLOTS` (else ValueError).
      max_model_len: the longest request; one request of it must fit besides the
        null block, else ValueError states the longest that fits.
      max_num_batched_tokens: tokens one step schedules (synchronous); sizes what
        windowed layers hold during a step.
      hybrid: False plans every attention layer as full attention (the model
        still computes with its window; the spec carries it).
      grouping: "vllm" reproduces vLLM 0.33; "auto" never gives less capacity.
      layout: memory order of [L, B, H, N, C] for `tensors`; "B..." block-outer
        (a block packs all layers of a group), "L..." layer-outer.
      max_groups: most groups "auto" may create (vLLM's own grouping is always
        a candidate, whatever its number of groups).
    """
    if not layers:
        raise ValueError("layers is empty: give at least one layer name → spec")
    _check_int(available_bytes=available_bytes, max_model_len=max_model_len)
    _check_int(max_num_batched_tokens=max_num_batched_tokens, max_groups=max_groups)
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping={grouping!r} is not one of {GROUPINGS}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not one of {LAYOUTS}")
    specs, shared = resolve_kv_sharing(layers)
    if not hybrid:
        specs = as_full_attention(specs)

    def concurrency(groups: Groups) -> Fraction:
        num_blocks = available_bytes // max(g.page_bytes for g in groups)
        return Fraction(num_blocks, sum(g.blocks_per_request(max_model_len, max_num_batched_tokens) for g in groups))

    vllm = groups = vllm_groups(specs)
    if grouping == "auto":
        for candidate in sorted(auto_candidates(specs, max_groups), key=len):
            gain = 1 + AUTO_MIN_GAIN if len(candidate) > len(groups) else 1
            better = concurrency(candidate) > concurrency(groups) * Fraction(gain)
            if better or (len(candidate) < len(groups) and concurrency(candidate) == concurrency(groups)):
                groups = candidate
    _check_fits(groups, available_bytes, max_model_len, max_num_batched_tokens)
    _check_slots_fit_int32(groups, available_bytes)

    all_full = None
    if hybrid and any(isinstance(s, AttentionSpec) and not isinstance(s, FullAttentionSpec) for s in specs.values()):
        try:
            all_full = plan(
                layers,
                available_bytes,
                max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens,
                hybrid=False,
                grouping="vllm",
                layout=layout,
            )
        except ValueError:
            pass  # all full attention does not fit this budget: nothing to compare with

    def config(groups: Groups, **extra) -> KVCacheConfig:
        num_blocks = available_bytes // max(g.page_bytes for g in groups)
        return KVCacheConfig(
            num_blocks=num_blocks,
            groups=groups,
            tensors=buffer_views(groups, num_blocks, layout),
            max_model_len=max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            layout=layout,
            available_bytes=available_bytes,
            shared_layers=tuple(shared.items()),
            **extra,
        )

    return config(groups, all_full=all_full, vllm_grouping=None if groups == vllm else config(vllm))


def resolve_kv_sharing(layers: Mapping[str, KVCacheSpec | str]) -> tuple[dict[str, KVCacheSpec], dict[str, str]]:
    """Split `layers` into (layer → spec for layers with a cache, sharing layer → final owner)."""
    specs = {name: v for name, v in layers.items() if not isinstance(v, str)}
    shared = {}
    for name, value in layers.items():
        if not isinstance(value, str):
            continue
        chain = [name]
        while isinstance(value, str):
            if value not in layers:
                raise ValueError(
                    f"layer {name!r} shares the cache of {value!r}, which is not a layer; "
                    "name an existing layer (the one whose cache it reuses)"
                )
            if value in chain:
                raise ValueError(f"KV sharing cycle: {' -> '.join([*chain, value])}; one layer of it must own a spec")
            chain.append(value)
            value = layers[value]
        shared[name] = chain[-1]
    return specs, shared


def as_full_attention(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Every attention layer as a FullAttentionSpec carrying its window (state layers unchanged).

    Like vLLM, a promoted layer takes the block size of the full-attention layers
    when they all have one.
    """
    full_block_sizes = {s.block_size for s in specs.values() if isinstance(s, FullAttentionSpec)}
    block_size = next(iter(full_block_sizes)) if len(full_block_sizes) == 1 else None
    out = {}
    for name, s in specs.items():
        if isinstance(s, AttentionSpec) and not isinstance(s, FullAttentionSpec):
            bs = block_size or s.block_size
            padded = None if s.page_size_padded is None else max(s.page_size_padded, s.row_bytes * bs)
            out[name] = FullAttentionSpec(
                block_size=bs,
                num_kv_heads=s.num_kv_heads,
                head_size=s.head_size,
                head_size_v=s.head_size_v,
                dtype=s.dtype,
                page_size_padded=padded,
                sliding_window=getattr(s, "sliding_window", None),
                attention_chunk_size=getattr(s, "attention_chunk_size", None),
            )
        else:
            out[name] = s
    return out


def vllm_groups(specs: dict[str, KVCacheSpec]) -> Groups:
    """vLLM 0.33's grouping of `specs` (see the module docstring)."""
    single = _single_group(specs)
    if single is not None:
        return single
    unified = unify_page_sizes(specs)
    buckets = _buckets(unified)
    sizes = [len(b) for b in buckets]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    return _split(buckets, unified, group_size)


def auto_candidates(specs: dict[str, KVCacheSpec], max_groups: int) -> list[Groups]:
    """Groupings "auto" compares with vLLM's: every group size, on both page unifications."""
    if _single_group(specs) is not None:
        return []
    out = []
    for unified in (unify_page_sizes(specs), _unify_lcm(specs)):
        if unified is None:
            continue
        buckets = _buckets(unified)
        for size in range(1, max(len(b) for b in buckets) + 1):
            if sum(cdiv(len(b), size) for b in buckets) <= max_groups:
                out.append(_split(buckets, unified, size))
    return out


def unify_page_sizes(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """vLLM's rule: the largest page P wins; scale attention blocks whose page divides P, pad the rest."""
    big = max(s.page_size_bytes for s in specs.values())
    out = {}
    for name, s in specs.items():
        page = s.page_size_bytes
        if page == big:
            out[name] = s
        elif isinstance(s, MambaSpec):
            out[name] = dataclasses.replace(s, page_size_padded=big)
        elif big % page == 0:
            out[name] = dataclasses.replace(s, block_size=s.block_size * (big // page))
        elif isinstance(s, AttentionSpec) and not isinstance(s, MLAAttentionSpec):
            out[name] = dataclasses.replace(s, page_size_padded=big)
        else:
            raise ValueError(
                f"layer {name!r}: its MLA page of {page} B does not divide the largest page ({big} B) and an MLA "
                "page cannot be padded; choose block sizes whose pages divide each other"
            )
    return out


def buffer_views(groups: Groups, num_blocks: int, layout: str) -> tuple[KVCacheTensor, ...]:
    """One view per (group, spec) over the single pool buffer.

    Block-outer: block b of layer j of every group lives at the same offset;
    block_stride = bytes_per_block, layer_stride = page, and a group whose layers
    differ in page size packs its specs one after the other inside the block
    (DeepSeek-V3.2: [MLA L0 | MLA L1 | IDX L0 | IDX L1]). Layer-outer: each layer
    owns num_blocks × page contiguous bytes; block_stride = page.
    """
    bytes_per_block = max(g.page_bytes for g in groups)
    size = num_blocks * bytes_per_block
    views = []
    for gi, g in enumerate(groups):
        by_spec: dict[KVCacheSpec, list[str]] = {}
        for name, s in zip(g.layer_names, g.specs):
            by_spec.setdefault(_page_spec(s), []).append(name)
        offset = 0
        for s, names in by_spec.items():
            page = s.page_size_bytes
            if layout.startswith("B"):
                layer_stride, block_stride = page, bytes_per_block
            else:
                layer_stride, block_stride = num_blocks * page, page
            views.append(
                KVCacheTensor(
                    size=size,
                    layers=tuple(names),
                    layer_stride=layer_stride,
                    block_stride=block_stride,
                    offset=offset,
                    group_idx=gi,
                    spec=s,
                    layout=layout,
                )
            )
            offset += len(names) * layer_stride
    return tuple(views)


def _page_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The spec with what does not shape its page (a full-attention layer's window) dropped."""
    if isinstance(spec, FullAttentionSpec):
        return dataclasses.replace(spec, sliding_window=None, attention_chunk_size=None)
    return spec


def longest_max_model_len(groups: Groups, available_bytes: int, max_num_batched_tokens: int, upper: int) -> int:
    """The longest max_model_len ≤ `upper` whose one request fits besides the null block (0: none)."""
    bytes_per_block = max(g.page_bytes for g in groups)
    usable_blocks = available_bytes // bytes_per_block - 1

    def fits(n: int) -> bool:
        return sum(g.blocks_per_request(n, max_num_batched_tokens) for g in groups) <= usable_blocks

    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _check_fits(groups: Groups, available_bytes: int, max_model_len: int, mnbt: int) -> None:
    bytes_per_block = max(g.page_bytes for g in groups)
    needed = sum(g.blocks_per_request(max_model_len, mnbt) for g in groups) * bytes_per_block
    if needed + bytes_per_block <= available_bytes:
        return
    longest = longest_max_model_len(groups, available_bytes, mnbt, max_model_len)
    hint = f"the longest max_model_len that fits is {longest:,}" if longest else "not even a 1-token request fits"
    raise ValueError(
        f"available_bytes={available_bytes:,} cannot hold one request of max_model_len={max_model_len:,}: it needs "
        f"{needed:,} B plus the null block ({bytes_per_block:,} B); {hint}. "
        "Lower max_model_len or raise the budget."
    )


def _check_slots_fit_int32(groups: Groups, available_bytes: int) -> None:
    """Block ids and slots (`block_id * block_size + offset`) are int32: every slot of the pool must be one."""
    bytes_per_block = max(g.page_bytes for g in groups)
    block_size = max(g.block_size for g in groups)
    max_blocks = MAX_SLOTS // block_size
    if available_bytes // bytes_per_block <= max_blocks:
        return
    raise ValueError(
        f"available_bytes={available_bytes:,} gives {available_bytes // bytes_per_block:,} blocks of {block_size} "
        f"tokens, more than int32 slots address ({max_blocks:,} blocks); give at most "
        f"{max_blocks * bytes_per_block:,} B (a smaller --memory / available_bytes)"
    )


def _single_group(specs: dict[str, KVCacheSpec]) -> Groups | None:
    """vLLM's one-group cases: all specs merge into one, or all layers keep the same blocks."""
    names = tuple(specs)
    values = list(specs.values())
    merged = _merge(values)
    if merged is not None:
        return (_merged_group(names, values, merged),)
    if _same_blocks(values):
        return (KVCacheGroup(layer_names=names, spec=values[0], layer_specs=tuple(values)),)
    return None


def _merge(specs: list[KVCacheSpec]) -> KVCacheSpec | None:
    """vLLM's spec merge: equal specs, or full-attention specs differing only in a window."""
    first = specs[0]
    if all(s == first for s in specs):
        return first
    if type(first) is not FullAttentionSpec or any(type(s) is not FullAttentionSpec for s in specs):
        return None
    base = {"sliding_window": None, "attention_chunk_size": None}
    if any(dataclasses.replace(s, **base) != dataclasses.replace(first, **base) for s in specs):
        return None
    windows = {s.sliding_window for s in specs} - {None}
    chunks = {s.attention_chunk_size for s in specs} - {None}
    if len(windows) > 1 or len(chunks) > 1 or (windows and chunks):
        return None
    return dataclasses.replace(
        first, sliding_window=next(iter(windows), None), attention_chunk_size=next(iter(chunks), None)
    )


def _same_blocks(specs: list[KVCacheSpec]) -> bool:
    """All layers keep the same blocks (vLLM's "uniform type"): same block size and rule."""
    first = specs[0]
    if len({s.block_size for s in specs}) > 1:
        return False
    if isinstance(first, FullAttentionSpec):
        return all(isinstance(s, FullAttentionSpec) for s in specs)
    if isinstance(first, MambaSpec):
        return all(isinstance(s, MambaSpec) and s.page_size_bytes == first.page_size_bytes for s in specs)
    window = "sliding_window" if hasattr(first, "sliding_window") else "attention_chunk_size"
    return all(type(s) is type(first) and getattr(s, window) == getattr(first, window) for s in specs)


def _buckets(specs: dict[str, KVCacheSpec]) -> list[list[str]]:
    """Layers bucketed by identical spec in order of first appearance; mergeable buckets join."""
    same: dict[KVCacheSpec, list[str]] = {}
    for name, s in specs.items():
        same.setdefault(s, []).append(name)
    buckets: list[tuple[list[str], list[KVCacheSpec]]] = []
    for s, names in same.items():
        for bucket_names, bucket_specs in buckets:
            if _merge([*bucket_specs, s]) is not None:
                bucket_names.extend(names)
                bucket_specs.append(s)
                break
        else:
            buckets.append((list(names), [s]))
    return [names for names, _ in buckets]


def _split(buckets: list[list[str]], specs: dict[str, KVCacheSpec], group_size: int) -> Groups:
    groups = []
    for names in buckets:
        n = cdiv(len(names), group_size)
        for i in range(n):
            members = tuple(names[i::n])
            member_specs = [specs[m] for m in members]
            groups.append(_merged_group(members, member_specs, _merge(member_specs)))
    return tuple(groups)


def _merged_group(names: tuple[str, ...], specs: list[KVCacheSpec], merged: KVCacheSpec) -> KVCacheGroup:
    """A group under vLLM's merged spec that keeps each layer's own spec where they differ
    (full-attention layers planned with hybrid=False keep their window for the model)."""
    differ = any(s != merged for s in specs)
    return KVCacheGroup(layer_names=names, spec=merged, layer_specs=tuple(specs) if differ else None)


def _unify_lcm(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec] | None:
    """Scale every attention block so all attention pages equal P = lcm(pages) (raised to cover
    state pages); pad state pages to P. None when it equals vLLM's unification or cannot apply."""
    attn = [s for s in specs.values() if isinstance(s, AttentionSpec)]
    if not attn or any(s.page_size_padded is not None for s in attn):
        return None
    lcm = math.lcm(*(s.page_size_bytes for s in attn))
    state = max((s.page_size_bytes for s in specs.values() if isinstance(s, MambaSpec)), default=lcm)
    big = lcm * cdiv(state, lcm)
    out = {}
    for name, s in specs.items():
        if isinstance(s, MambaSpec):
            out[name] = s if s.page_size_bytes == big else dataclasses.replace(s, page_size_padded=big)
        else:
            out[name] = dataclasses.replace(s, block_size=s.block_size * (big // s.page_size_bytes))
    return None if out == unify_page_sizes(specs) else out


def _check_int(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")
