"""The planner's output: KV cache groups, shared buffers and the pool size.

Frozen, hashable dataclasses, passed to jit as static configuration.
"""

from __future__ import annotations

import dataclasses

from jaxkv.specs import ChunkedLocalAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

_frozen = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)


@_frozen
class KVCacheGroup:
    """Layers that share one block table per request (same spec, same rule)."""

    layer_names: tuple[str, ...]
    spec: KVCacheSpec

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


@_frozen
class KVCacheTensor:
    """One shared buffer, and how the layers in it are addressed.

    `address = offset + layer × layer_stride + block × block_stride + position × row_width`,
    where `layer` is the index of a layer in `layers`.
    """

    size: int
    layers: tuple[str, ...]
    layer_stride: int
    block_stride: int
    offset: int = 0


@_frozen
class KVCacheConfig:
    """A plan: groups drawing equal group pages from one pool of `num_blocks` blocks.

    `num_blocks` counts the null block (id 0), which is never allocated.
    """

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]
    tensors: tuple[KVCacheTensor, ...]
    max_model_len: int
    max_num_batched_tokens: int
