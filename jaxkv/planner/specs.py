"""KV cache specs: what one layer needs from the cache.

Specs are frozen, slotted, keyword-only dataclasses; they are hashable and are
passed to jit as static configuration. `page_size_bytes` is the bytes of one
block of one layer (padded when the planner unified page sizes);
`blocks_per_request` is how many blocks one request of `max_model_len` tokens
can hold at once in a layer of this kind; `blocks_held(n)` is how many a request
of n tokens holds while its last token is computed.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

NULL_BLOCK = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dtype_name(dtype) -> str:
    try:
        return jnp.dtype(dtype).name
    except TypeError as e:
        raise ValueError(f"{dtype=} is not a dtype; pass a name like 'bfloat16' or a numpy/JAX dtype") from e


def dtype_bytes(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize


def _check_positive(**values) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive integer")


_spec = dataclasses.dataclass(frozen=True, slots=True, kw_only=True)


@_spec
class AttentionSpec:
    """Common fields of the attention specs.

    Page = block_size × num_kv_heads × (head_size + head_size_v) × dtype bytes.
    `page_size_padded` is set by the planner when this page is padded up to the
    pool's page size.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str = "bfloat16"
    head_size_v: int | None = None
    page_size_padded: int | None = None

    def __post_init__(self):
        _check_positive(block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size)
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        _check_positive(head_size_v=self.head_size_v)
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded={self.page_size_padded} is smaller than the real page "
                f"({self.real_page_size_bytes} B); it may only pad"
            )

    @property
    def row_bytes(self) -> int:
        """Bytes of one slot (one token of one layer)."""
        return self.num_kv_heads * (self.head_size + self.head_size_v) * dtype_bytes(self.dtype)

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.row_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.real_page_size_bytes

    def tokens_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return max_model_len

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(max_model_len, self.block_size)

    def blocks_held(self, num_tokens: int) -> int:
        """Non-null blocks of a request of `num_tokens` tokens while its last token is computed."""
        return cdiv(num_tokens, self.block_size)


@_spec
class FullAttentionSpec(AttentionSpec):
    """Every token stays in the cache.

    `sliding_window` / `attention_chunk_size` are carried when a windowed layer
    is planned as full attention (`plan(..., hybrid=False)`): the cache keeps
    every token, the model still computes with its window.
    """

    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self):
        AttentionSpec.__post_init__(self)
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise ValueError("a layer has either sliding_window or attention_chunk_size, not both")


@_spec
class SlidingWindowSpec(AttentionSpec):
    """The key at position k is visible to the query at q iff q − W < k ≤ q.

    A request holds at most the window plus one step's tokens, rounded out to
    blocks, plus one block for misalignment:
    cdiv(min(W − 1 + max_num_batched_tokens, max_model_len), block) + 1.
    """

    sliding_window: int

    def __post_init__(self):
        AttentionSpec.__post_init__(self)
        _check_positive(sliding_window=self.sliding_window)

    def tokens_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(self.tokens_per_request(max_model_len, max_num_batched_tokens), self.block_size) + 1

    def blocks_held(self, num_tokens: int) -> int:
        """Blocks covering positions [n − W, n − 1] while token n − 1 is computed (n = `num_tokens`)."""
        if num_tokens <= 0:
            return 0
        return (num_tokens - 1) // self.block_size - max(0, num_tokens - self.sliding_window) // self.block_size + 1


@_spec
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Queries see keys of their own chunk of `attention_chunk_size` tokens."""

    attention_chunk_size: int

    def __post_init__(self):
        AttentionSpec.__post_init__(self)
        _check_positive(attention_chunk_size=self.attention_chunk_size)

    def tokens_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return cdiv(self.tokens_per_request(max_model_len, max_num_batched_tokens), self.block_size)

    def blocks_held(self, num_tokens: int) -> int:
        """Blocks of the current chunk while token n − 1 is computed (n = `num_tokens`)."""
        if num_tokens <= 0:
            return 0
        last = num_tokens - 1
        return (
            last // self.block_size
            - (last // self.attention_chunk_size * self.attention_chunk_size) // self.block_size
            + 1
        )


@_spec
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent row per token, no separate V.

    Page = block_size × num_kv_heads × head_size × dtype bytes (`head_size` is the
    latent width in elements; for DeepSeek-V3.2's FP8 latent, 656 uint8 bytes).
    """

    @property
    def row_bytes(self) -> int:
        return self.num_kv_heads * self.head_size * dtype_bytes(self.dtype)


@_spec
class MambaSpec:
    """A state-space / linear-attention layer: one state block per request.

    Page = Σ prod(shape) × dtype bytes over the state tensors. `block_size` is
    the token granularity at which states can be saved (for prefix caching).
    """

    block_size: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    page_size_padded: int | None = None

    def __post_init__(self):
        _check_positive(block_size=self.block_size)
        shapes = tuple(tuple(int(d) for d in s) for s in self.shapes)
        dtypes = tuple(_dtype_name(d) for d in self.dtypes)
        if not shapes or len(shapes) != len(dtypes):
            raise ValueError(f"MambaSpec needs one dtype per state shape: {shapes=}, {dtypes=}")
        if any(d <= 0 for shape in shapes for d in shape):
            raise ValueError(f"MambaSpec state shapes must have positive sizes, got {shapes=}")
        object.__setattr__(self, "shapes", shapes)
        object.__setattr__(self, "dtypes", dtypes)
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ValueError(
                f"page_size_padded={self.page_size_padded} is smaller than the real page "
                f"({self.real_page_size_bytes} B); it may only pad"
            )

    @property
    def real_page_size_bytes(self) -> int:
        return sum(math.prod(s) * dtype_bytes(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded or self.real_page_size_bytes

    def tokens_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return self.block_size

    def blocks_per_request(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        return 1

    def blocks_held(self, num_tokens: int) -> int:
        return 1 if num_tokens > 0 else 0


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | MLAAttentionSpec | MambaSpec
