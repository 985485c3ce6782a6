"""The kernels lower for GPU (Pallas Triton, Mosaic GPU) and TPU (Mosaic) with no device attached.

Lowering runs Pallas' own lowering to Triton IR / Mosaic MLIR / Mosaic GPU MLIR and checks
shapes, block specs and every primitive the kernel bodies use (for Mosaic GPU also the TMA
copies' limits: at most 256 elements per dimension, strides in 16-byte units); compiling that
IR to machine code needs the device and is left to benchmarks/device_check.sh.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from mosaic_gpu_marks import needs_mosaic_gpu

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_scatter import paged_scatter

S = jax.ShapeDtypeStruct


# The devices the kernels are lowered for. Mosaic reads the chip's parameters
# from the device, and jax >= 0.11's Triton lowering reads the GPU's compute
# capability from it (jax 0.10 assumes 9.0 when no GPU is attached); an
# abstract device stands in for each. An H100 is compute capability 9.0 with
# 132 streaming multiprocessors.
_ABSTRACT_DEVICES = {
    "cuda": AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu"),
    "tpu": AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu"),
}


def _lower(fn, platform, *args, backend=None, **kwargs) -> str:
    """The StableHLO text of `fn` lowered for `platform` ("cuda" or "tpu"), with `backend` (default: Triton on
    "cuda", Mosaic on "tpu")."""
    backend = backend or {"cuda": "triton", "tpu": "mosaic"}[platform]
    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=_ABSTRACT_DEVICES[platform])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # No warning may escape, deprecations included.
        with jax.sharding.use_abstract_mesh(mesh):
            traced = fn.trace(*args, **kwargs, backend=backend, interpret=False)
            return traced.lower(lowering_platforms=(platform,)).as_text()


_KERNEL_CALL = {"cuda": re.compile(r"custom_call @\S*triton"), "tpu": re.compile(r"tpu_custom_call")}


def _cache(layout, *, dtype, block_size=16, num_heads=2, row_width=256):
    dims = {"B": 64, "L": 3, "H": num_heads, "N": block_size, "C": row_width}
    return S(tuple(dims[axis] for axis in layout), dtype)


def _small_decode(block_size=16):
    """paged_attention's arguments: 4 tokens of 2 query heads (head 64) over a bf16 cache of 2 KV heads, layer 0."""
    return (
        S((4, 2, 64), jnp.bfloat16),
        _cache("BLHNC", dtype=jnp.bfloat16, block_size=block_size, row_width=128),
        S((5,), jnp.int32),
        S((4,), jnp.int32),
        S((4, 32), jnp.int32),
        0,
    )


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize(
    "layout,dtype,row_width",
    [("BLHNC", jnp.bfloat16, 256), ("LBNHC", jnp.float32, 256), ("BLHNC", jnp.uint8, 656)],
)
def test_paged_scatter_lowers_in_place(platform, layout, dtype, row_width):
    text = _lower(
        paged_scatter,
        platform,
        _cache(layout, dtype=dtype, row_width=row_width),
        S((40, 2, row_width), dtype),
        S((40,), jnp.int32),
        jnp.int32(1),
        layout=layout,
    )
    assert _KERNEL_CALL[platform].search(text)
    assert "output_operand_aliases" in text  # The kernel writes into its input.
    assert "tf.aliasing_output = 0" in text  # The jit donates the cache.


@needs_mosaic_gpu
@pytest.mark.parametrize(
    "layout,dtype,row_width",
    [("BLHNC", jnp.bfloat16, 256), ("LBNHC", jnp.float32, 256), ("BLHNC", jnp.uint8, 656)],
)
def test_paged_scatter_mosaic_gpu_body_lowers_in_place(layout, dtype, row_width):
    # 656 uint8 channels (an MLA row) go as three TMA pieces (256, 256, 144); 40 tokens as one tile of 64.
    text = _lower(
        paged_scatter,
        "cuda",
        _cache(layout, dtype=dtype, row_width=row_width),
        S((40, 2, row_width), dtype),
        S((40,), jnp.int32),
        jnp.int32(1),
        layout=layout,
        backend="mosaic_gpu",
    )
    assert re.search(r"custom_call @mosaic_gpu", text)
    assert "output_operand_aliases" in text  # The kernel writes into its input.
    assert "tf.aliasing_output = 0" in text  # The jit donates the cache.


@needs_mosaic_gpu
def test_mosaic_gpu_body_refuses_rows_the_tma_cannot_copy():
    with pytest.raises(ValueError, match="C=82 uint8 channels is 82 bytes"):
        _lower(
            paged_scatter,
            "cuda",
            _cache("BLHNC", dtype=jnp.uint8, row_width=82),
            S((40, 2, 82), jnp.uint8),
            S((40,), jnp.int32),
            jnp.int32(1),
            backend="mosaic_gpu",
        )


@needs_mosaic_gpu
def test_paged_attention_names_the_body_it_lacks():
    with pytest.raises(ValueError, match="no Mosaic GPU body yet: use backend='triton'"):
        _lower(
            paged_attention,
            "cuda",
            *_small_decode(),
            backend="mosaic_gpu",
        )


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize(
    "options",
    [
        dict(dtype=jnp.bfloat16),
        dict(dtype=jnp.float32, sliding_window=1000, layout="LBNHC"),
        dict(dtype=jnp.bfloat16, attention_chunk_size=64, logits_soft_cap=30.0, block_size=8),
        dict(dtype=jnp.bfloat16, sliding_window=128, sinks=S((8,), jnp.float32)),
        dict(dtype=jnp.float32, sinks=S((8,), jnp.float32), layout="LBNHC"),
    ],
    ids=["full-bf16", "window-f32-LBNHC", "chunk-capped-bf16-block8", "window-sinks-bf16", "sinks-f32-LBNHC"],
)
def test_paged_attention_lowers(platform, options):
    options = dict(options)
    dtype = options.pop("dtype")
    layout = options.get("layout", "BLHNC")
    block_size = options.pop("block_size", 16)
    num_requests, num_tokens = 8, 40
    text = _lower(
        paged_attention,
        platform,
        S((num_tokens, 8, 128), dtype),  # GQA 4
        _cache(layout, dtype=dtype, block_size=block_size),
        S((num_requests + 1,), jnp.int32),
        S((num_requests,), jnp.int32),
        S((num_requests, 32), jnp.int32),
        jnp.int32(2),
        **options,
    )
    assert _KERNEL_CALL[platform].search(text)


@pytest.mark.parametrize("sinks", [None, S((2,), jnp.float32)], ids=["no-sinks", "sinks"])
def test_block_count_output_lowers_for_cuda(sinks):
    text = _lower(
        paged_attention,
        "cuda",
        *_small_decode(),
        sliding_window=100,
        sinks=sinks,
        return_blocks_read=True,
    )
    assert _KERNEL_CALL["cuda"].search(text)


def test_triton_rejects_shapes_it_cannot_tile():
    with pytest.raises(ValueError, match="block_size=12 must be a power of 2"):
        _lower(
            paged_attention,
            "cuda",
            *_small_decode(block_size=12),
        )


def test_triton_deprecation_warning_is_filtered():
    # jax >= 0.11 warns at every Triton lowering, after the entry has returned;
    # the filter installed at trace time must outlive the call and win over an
    # "error" filter set around it.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paged_attention.trace(
            *_small_decode(),
            backend="triton",
            interpret=False,
        )
        warnings.warn(
            "The Pallas Triton backend is deprecated and will be removed in a future JAX version.",
            DeprecationWarning,
            stacklevel=2,
        )
        with pytest.raises(DeprecationWarning):
            warnings.warn("something else is deprecated", DeprecationWarning, stacklevel=2)
