"""The planner's output: KV cache groups, buffer views and the pool size.

Frozen, hashable dataclasses, passed to jit as static configuration. `plan()` in
`jaxkv.planner.planning` builds them; the figures a person reads (capacity, concurrency,
bytes per request, padding waste, `summary()`) are derived here.

Memory picture (block-outer layout, 2 groups of 2 layers, page p):

    block id:      0 (null)        1               2        ...
    bytes:     | L0 p | L1 p | L0 p | L1 p | L0 p | L1 p | ...
    group 0 view: offset 0, layer_stride p, block_stride 2p (layers A, B)
    group 1 view: offset 0, layer_stride p, block_stride 2p (layers C, D)

Both groups alias the same bytes and draw disjoint block ids from one pool, so
block b means the same offset for every layer.
"""

from __future__ import annotations

import dataclasses
import re

from jaxkv.planner.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

_frozen = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)

LAYOUTS = ("BLHNC", "BLNHC", "LBHNC", "LBNHC")
"""Memory orders of a layer's logical [L, B, H, N, C]; block-outer ones start with B."""

GiB = 1 << 30


@_frozen
class KVCacheGroup:
    """Layers that share one block table per request (same rule for which blocks they keep).

    `spec` is the group's spec (the first layer's when layers differ in page size,
    e.g. DeepSeek-V3.2's latent and indexer caches). `layer_specs`, when given, holds
    one spec per layer; all of them keep the same blocks.
    """

    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    layer_specs: tuple[KVCacheSpec, ...] | None = None

    def __post_init__(self):
        if not self.layer_names:
            raise ValueError("a KV cache group needs at least one layer")
        if self.layer_specs is not None and len(self.layer_specs) != len(self.layer_names):
            raise ValueError(
                f"layer_specs has {len(self.layer_specs)} specs for {len(self.layer_names)} layers; give one per layer"
            )

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def kind(self) -> str:
        """One of "full", "sliding_window", "chunked_local", "mamba" (how blocks are kept)."""
        if isinstance(self.spec, SlidingWindowSpec):
            return "sliding_window"
        if isinstance(self.spec, ChunkedLocalAttentionSpec):
            return "chunked_local"
        if isinstance(self.spec, MambaSpec):
            return "mamba"
        return "full"

    @property
    def specs(self) -> tuple[KVCacheSpec, ...]:
        """One spec per layer, in `layer_names` order."""
        return self.layer_specs or (self.spec,) * len(self.layer_names)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block id across the group's layers (padded pages included)."""
        return sum(s.page_size_bytes for s in self.specs)

    @property
    def real_page_bytes(self) -> int:
        """Bytes of one block id across the group's layers that hold cache data."""
        return sum(s.real_page_size_bytes for s in self.specs)

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return max(s.blocks_per_request(max_model_len, max_num_batched_tokens) for s in self.specs)

    def blocks_held(self, num_tokens: int) -> int:
        return max(s.blocks_held(num_tokens) for s in self.specs)

    def describe(self) -> str:
        """E.g. "sliding_window(1024)", "full", "chunked_local(8192)", "mamba"."""
        if isinstance(self.spec, SlidingWindowSpec):
            return f"sliding_window({self.spec.sliding_window})"
        if isinstance(self.spec, ChunkedLocalAttentionSpec):
            return f"chunked_local({self.spec.attention_chunk_size})"
        kinds = sorted({"mla" if isinstance(s, MLAAttentionSpec) else self.kind for s in self.specs})
        return "+".join(kinds)


@_frozen
class KVCacheTensor:
    """A view of the pool buffer: how the layers of one spec in one group are addressed.

    `address = offset + layer × layer_stride + block × block_stride + position × row_width`
    (bytes from the buffer start), where `layer` is the index of a layer in `layers`.
    That holds for token-major pages (`...NHC`); head-major pages (`...HNC`) place
    head h of position n at `h × head_stride + n × token_stride` within the page,
    which `address()` computes for every layout. `size` is the bytes of the whole
    buffer the view lives in: all views of a plan alias one buffer of
    `num_blocks × bytes_per_block` bytes, at disjoint block ids.
    """

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0
    group_idx: int = 0
    spec: KVCacheSpec | None = None
    layout: str = "BLHNC"

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r} is not one of {LAYOUTS}")

    @property
    def num_heads(self) -> int:
        """H of the logical page (1 for a state layer)."""
        return self.spec.num_kv_heads if isinstance(self.spec, AttentionSpec) else 1

    @property
    def tokens_per_block(self) -> int:
        """N of the logical page (1 for a state layer, which holds one state per block)."""
        return self.spec.block_size if isinstance(self.spec, AttentionSpec) else 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot (one token, all heads; a whole state for a state layer)."""
        if isinstance(self.spec, AttentionSpec):
            return self.spec.row_bytes
        return self.spec.real_page_size_bytes

    @property
    def head_bytes(self) -> int:
        """C in bytes: one head of one token (K then V channels; the latent for MLA)."""
        return self.row_bytes // self.num_heads

    @property
    def page_bytes(self) -> int:
        """Bytes reserved for one layer per block (padding included)."""
        return self.spec.page_size_bytes

    @property
    def token_stride(self) -> int:
        return self.head_bytes if self.layout.endswith("HNC") else self.row_bytes

    @property
    def head_stride(self) -> int:
        return self.tokens_per_block * self.head_bytes if self.layout.endswith("HNC") else self.head_bytes

    def address(self, layer_idx: int, block_id: int, position: int = 0, head: int = 0) -> int:
        """Byte address of (layer, block, position in block, head) in the buffer."""
        return (
            self.offset
            + layer_idx * self.layer_stride
            + block_id * self.block_stride
            + position * self.token_stride
            + head * self.head_stride
        )


@_frozen
class KVCacheConfig:
    """A plan: groups drawing equal-size blocks from one pool of `num_blocks` blocks.

    `num_blocks` counts the null block (id 0), which is never allocated.
    `shared_layers` holds (layer, owner) pairs: layers that reuse their owner's
    cache and allocate nothing. For comparison: `all_full` is the same layers
    planned with `hybrid=False` (every attention layer keeping every token), None
    when no layer is windowed or when it does not fit the budget; `vllm_grouping`
    is vLLM's grouping of the same layers when `grouping="auto"` chose another.
    """

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]
    tensors: tuple[KVCacheTensor, ...]
    max_model_len: int
    max_num_batched_tokens: int
    layout: str = "BLHNC"
    available_bytes: int | None = None
    shared_layers: tuple[tuple[str, str], ...] = ()
    all_full: KVCacheConfig | None = None
    vllm_grouping: KVCacheConfig | None = None

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id in the pool: the largest group page (smaller groups leave padding)."""
        return max(g.page_bytes for g in self.groups)

    @property
    def blocks_per_request(self) -> tuple[int, ...]:
        """Per group: the most blocks one request of `max_model_len` tokens holds at once."""
        return tuple(g.blocks_per_request(self.max_model_len, self.max_num_batched_tokens) for g in self.groups)

    @property
    def max_concurrency(self) -> float:
        """Requests of `max_model_len` tokens that fit at once: num_blocks / Σ blocks per request.

        vLLM's formula: the null block is counted in `num_blocks`.
        """
        return self.num_blocks / sum(self.blocks_per_request)

    @property
    def capacity_tokens(self) -> int:
        """Group-aware "KV cache size: N tokens" = int(max_concurrency × max_model_len)."""
        return int(self.max_concurrency * self.max_model_len)

    @property
    def padding_fraction(self) -> float:
        """Share of a `max_model_len` request's blocks that holds no cache (padding layers and pages)."""
        bpr = self.blocks_per_request
        used = sum(n * g.real_page_bytes for n, g in zip(bpr, self.groups))
        return 1.0 - used / (sum(bpr) * self.bytes_per_block)

    @property
    def num_layers(self) -> int:
        """Layers with a cache of their own (KV-sharing layers not counted)."""
        return sum(len(g.layer_names) for g in self.groups)

    def bytes_per_request(self, num_tokens: int) -> int:
        """Pool bytes one request of `num_tokens` tokens holds while its last token is computed."""
        return sum(g.blocks_held(num_tokens) for g in self.groups) * self.bytes_per_block

    def to_dict(self) -> dict:
        """The plan's figures as plain JSON-ready values."""
        out = {
            "num_blocks": self.num_blocks,
            "bytes_per_block": self.bytes_per_block,
            "capacity_tokens": self.capacity_tokens,
            "max_concurrency": self.max_concurrency,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "available_bytes": self.available_bytes,
            "layout": self.layout,
            "padding_fraction": self.padding_fraction,
            "groups": [
                {
                    "kind": g.kind,
                    "describe": g.describe(),
                    "block_size": g.block_size,
                    "num_layers": len(g.layer_names),
                    "layer_names": list(g.layer_names),
                    "page_bytes": g.page_bytes,
                    "real_page_bytes": g.real_page_bytes,
                    "blocks_per_request": n,
                }
                for g, n in zip(self.groups, self.blocks_per_request)
            ],
            "tensors": [
                {
                    "group_idx": t.group_idx,
                    "layers": list(t.layers),
                    "size": t.size,
                    "offset": t.offset,
                    "layer_stride": t.layer_stride,
                    "block_stride": t.block_stride,
                    "row_bytes": t.row_bytes,
                    "page_bytes": t.page_bytes,
                }
                for t in self.tensors
            ],
            "shared_layers": dict(self.shared_layers),
        }
        for name in ("all_full", "vllm_grouping"):
            other = getattr(self, name)
            if other is not None:
                out[name] = {
                    "num_groups": len(other.groups),
                    "num_blocks": other.num_blocks,
                    "capacity_tokens": other.capacity_tokens,
                    "max_concurrency": other.max_concurrency,
                }
        return out

    def summary(self) -> str:
        """The startup lines a person reads."""
        num_groups = len(self.groups)
        lines = [
            f"KV cache plan: {self.num_layers} layers in {num_groups} group{'s' * (num_groups != 1)}, "
            f"one pool of {self.bytes_per_block:,} B blocks, layout {self.layout}"
            + (f", budget {_human_bytes(self.available_bytes)}" if self.available_bytes is not None else "")
        ]
        for i, (g, n) in enumerate(zip(self.groups, self.blocks_per_request)):
            pages = sorted({s.page_size_bytes for s in g.specs})
            lines.append(
                f"  group {i}: {g.describe()}, {len(g.layer_names)} layers, block {g.block_size} tokens, "
                f"page {'+'.join(f'{p:,}' for p in pages)} B, {n:,} blocks per request: "
                f"{_abbreviate(g.layer_names)}"
            )
        if self.shared_layers:
            lines.append(f"  KV sharing: {len(self.shared_layers)} layers reuse another layer's cache and add nothing")
        lines.append(f"Padding waste: {self.padding_fraction:.2%} of a {self.max_model_len:,}-token request's blocks")
        lines.append(f"num_blocks: {self.num_blocks:,} (null block included)")
        lines.append(f"KV cache size: {self.capacity_tokens:,} tokens")
        lines.append(f"Maximum concurrency for {self.max_model_len:,} tokens per request: {self.max_concurrency:.2f}x")
        if self.vllm_grouping is not None:
            vllm = self.vllm_grouping
            lines.append(
                f"vLLM's grouping: {len(vllm.groups)} groups, KV cache size: {vllm.capacity_tokens:,} tokens "
                f"(this plan: {self.capacity_tokens / max(vllm.capacity_tokens, 1) - 1:+.2%})"
            )
        if self.all_full is not None:
            full = self.all_full
            lines.append(
                f"All full attention: KV cache size: {full.capacity_tokens:,} tokens, maximum concurrency "
                f"{full.max_concurrency:.2f}x (this plan holds {self.capacity_tokens / full.capacity_tokens:.2f}x more)"
                if full.capacity_tokens
                else "All full attention: KV cache size: 0 tokens"
            )
        elif any(g.kind in ("sliding_window", "chunked_local") for g in self.groups):
            lines.append("All full attention: one request of max_model_len does not fit this budget")
        return "\n".join(lines)


def _human_bytes(num_bytes: int) -> str:
    """E.g. "40.00 GiB", "64.00 MiB", "512 B"."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"


def _abbreviate(names: tuple[str, ...], limit: int = 12) -> str:
    """ "model.layers.{0,6,12}.self_attn.attn" when names differ in one number, else a short list."""
    parts = [re.fullmatch(r"(.*?)(\d+)(\D*)", n) for n in names]
    if all(parts) and len({(m[1], m[3]) for m in parts}) == 1:
        nums = [m[2] for m in parts]
        shown = ",".join(nums[:limit]) + (",…" if len(nums) > limit else "")
        return f"{parts[0][1]}{{{shown}}}{parts[0][3]}"
    return ", ".join(names[:limit]) + (", …" if len(names) > limit else "")
