"""Specs: page sizes, blocks per request, blocks held, validation."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)

ATTN = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")


def test_attention_page_is_block_heads_k_plus_v_dtype():
    # 16 tokens × 8 heads × (128 K + 128 V) × 2 B
    assert FullAttentionSpec(**ATTN).page_size_bytes == 16 * 8 * 256 * 2 == 65_536
    assert FullAttentionSpec(**{**ATTN, "head_size_v": 64}).page_size_bytes == 16 * 8 * 192 * 2
    assert FullAttentionSpec(**{**ATTN, "dtype": "float32"}).page_size_bytes == 131_072


def test_dtype_accepts_string_numpy_and_jax_dtypes():
    names = {
        FullAttentionSpec(**{**ATTN, "dtype": d}).dtype for d in ("bfloat16", jnp.bfloat16, np.dtype(jnp.bfloat16))
    }
    assert names == {"bfloat16"}


def test_mla_page_has_no_separate_v():
    # DeepSeek-V3.2's FP8 latent: 656 B per token, 64-token blocks.
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=656, dtype="uint8")
    assert spec.page_size_bytes == 64 * 656 == 41_984


def test_mamba_page_is_sum_of_state_bytes():
    spec = MambaSpec(block_size=16, shapes=((2, 512), (3, 32, 32)), dtypes=("float32", "float32"))
    assert spec.page_size_bytes == (2 * 512 + 3 * 32 * 32) * 4 == 16_384


def test_page_size_padded_only_pads():
    spec = FullAttentionSpec(**ATTN, page_size_padded=100_000)
    assert (spec.page_size_bytes, spec.real_page_size_bytes) == (100_000, 65_536)
    with pytest.raises(ValueError, match="only pad"):
        FullAttentionSpec(**ATTN, page_size_padded=1)


def test_specs_are_frozen_hashable_keyword_only_and_distinct():
    a, b = SlidingWindowSpec(**ATTN, sliding_window=1024), SlidingWindowSpec(**ATTN, sliding_window=1024)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.block_size = 32
    with pytest.raises(TypeError):
        FullAttentionSpec(16, 8, 128)
    assert not isinstance(a, FullAttentionSpec)
    assert not isinstance(ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=8192), FullAttentionSpec)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({**ATTN, "block_size": 0}, "block_size=0"),
        ({**ATTN, "block_size": True}, "block_size=True"),
        ({**ATTN, "num_kv_heads": -1}, "num_kv_heads=-1"),
        ({**ATTN, "dtype": "not-a-dtype"}, "is not a dtype"),
        ({**ATTN, "sliding_window": 1, "attention_chunk_size": 2}, "not both"),
    ],
)
def test_bad_spec_values_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FullAttentionSpec(**kwargs)


def test_mamba_needs_one_dtype_per_shape():
    with pytest.raises(ValueError, match="one dtype per state shape"):
        MambaSpec(block_size=16, shapes=((2, 3),), dtypes=("float32", "float32"))
    with pytest.raises(ValueError, match="positive sizes"):
        MambaSpec(block_size=16, shapes=((2, 0),), dtypes=("float32",))


def test_blocks_per_request_rules():
    mml, mnbt = 32_768, 2048
    assert FullAttentionSpec(**ATTN).blocks_per_request(mml, mnbt) == 2048
    # Sliding window W: cdiv(min(W − 1 + mnbt, mml), block) + 1.
    assert SlidingWindowSpec(**ATTN, sliding_window=1024).blocks_per_request(mml, mnbt) == cdiv(3071, 16) + 1 == 193
    assert SlidingWindowSpec(**ATTN, sliding_window=1024).blocks_per_request(1000, mnbt) == cdiv(1000, 16) + 1
    # Chunked C: cdiv(min(C + mnbt, mml), block).
    assert ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=8192).blocks_per_request(mml, mnbt) == 640
    assert ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=8192).blocks_per_request(4096, mnbt) == 256
    assert MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",)).blocks_per_request(mml, mnbt) == 1


def test_blocks_held_while_the_last_token_is_computed():
    sliding = SlidingWindowSpec(**ATTN, sliding_window=1024)
    assert sliding.blocks_held(0) == 0
    assert sliding.blocks_held(512) == 32  # positions 0..511: all still in the window
    assert sliding.blocks_held(32_000) == 64  # positions 30,976..31,999
    assert sliding.blocks_held(1025) == 65  # positions 1..1024 span blocks 0..64
    chunked = ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=64)
    assert [chunked.blocks_held(n) for n in (1, 16, 17, 64, 65, 100)] == [1, 1, 2, 4, 1, 3]
    assert FullAttentionSpec(**ATTN).blocks_held(33) == 3
    assert MambaSpec(block_size=16, shapes=((4,),), dtypes=("float32",)).blocks_held(10_000) == 1
