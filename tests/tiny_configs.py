"""Tiny specs (one KV head of size 4, block sizes of 2 to 16) and configs built from them by hand, without
planning, for the tests of the state, the step, the prefix cache and the manager."""

from jaxkv import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
)


def full(bs):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=4)


def sliding(bs, window):
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=4, sliding_window=window)


def chunked(bs, chunk):
    return ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=1, head_size=4, attention_chunk_size=chunk)


def mamba(bs):
    return MambaSpec(block_size=bs, shapes=((4,),), dtypes=("float32",))


def make_cfg(num_blocks, *specs, max_model_len=24, max_num_batched_tokens=8):
    groups = tuple(KVCacheGroup(layer_names=(f"layer{i}",), spec=spec) for i, spec in enumerate(specs))
    return KVCacheConfig(
        num_blocks=num_blocks,
        groups=groups,
        tensors=(),
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )
