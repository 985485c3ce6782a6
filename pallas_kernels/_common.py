"""What the paged kernels share: backend choice, cache layouts, compiler params.

Dimension legend for cache arrays (see DESIGN.md, "Vocabulary"):
  B  blocks (physical block ids, the null block 0 included)
  L  layers sharing the buffer
  H  KV heads (a per-shard slice under shard_map)
  N  block size (tokens per block)
  C  row channels (attention: K then V concatenated; MLA: the latent)
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

# The memory order of a cache array's five logical axes. Block-outer layouts
# keep every layer of one block together; layer-outer ones give each layer a
# contiguous region.
LAYOUTS = ("BLHNC", "BLNHC", "LBHNC", "LBNHC")
DEFAULT_LAYOUT = "BLHNC"

BACKENDS = ("triton", "mosaic", "mosaic_gpu")
# Mosaic GPU bodies are entered through `plgpu.kernel` with the cache as a mutable ref (`jax.new_ref`), which
# jax 0.10's kernel entry does not accept.
MOSAIC_GPU_MIN_JAX = (0, 11)


def filter_triton_deprecation() -> None:
    """Ignores jax >= 0.11's "The Pallas Triton backend is deprecated ..." warning.

    It is raised when a Triton pallas_call is lowered, which is when the
    caller's outermost jit compiles, after the kernel's entry has returned, so a
    filter scoped to the call cannot see it. The entries call this at trace
    time: a process-wide filter for that message only, re-installed on every
    trace so that a `warnings.catch_warnings` block around the caller (pytest
    wraps each test in one) still gets it.
    """
    warnings.filterwarnings("ignore", message=r"(?is).*triton.*deprecat", category=Warning)


filter_triton_deprecation()


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} is not one of {LAYOUTS}.")


def cache_dims(cache_shape: Sequence[int], layout: str) -> dict[str, int]:
    """Maps each axis letter of `layout` to its size in `cache_shape`."""
    check_layout(layout)
    if len(cache_shape) != 5:
        raise ValueError(f"cache must have 5 dimensions ({layout}), got shape {tuple(cache_shape)}.")
    return dict(zip(layout, cache_shape))


def cache_index(layout: str, *, b, layer, h, n, c) -> tuple:
    """The index tuple, in `layout` order, of block b, layer l, head h, token n, channel c."""
    where = {"B": b, "L": layer, "H": h, "N": n, "C": c}
    return tuple(where[axis] for axis in layout)


def to_blhnc(cache: jax.Array, layout: str) -> jax.Array:
    """A [B, L, H, N, C] view (transposed copy) of a cache in any layout."""
    check_layout(layout)
    return cache.transpose(tuple(layout.index(axis) for axis in "BLHNC"))


def from_blhnc(cache: jax.Array, layout: str) -> jax.Array:
    """Inverse of `to_blhnc`."""
    check_layout(layout)
    return cache.transpose(tuple("BLHNC".index(axis) for axis in layout))


def mosaic_gpu_supported() -> bool:
    """Whether the installed jax runs the Mosaic GPU bodies (on a GPU, or in its interpreter)."""
    return tuple(int(part) for part in jax.__version__.split(".")[:2]) >= MOSAIC_GPU_MIN_JAX


def resolve_backend(backend: str | None, interpret: bool | None) -> tuple[str, bool]:
    """Fills in the defaults: Mosaic on TPU, Triton-style kernels elsewhere,
    interpreted unless a GPU or TPU is the default backend. "mosaic_gpu" is asked for by name."""
    platform = jax.default_backend()
    if backend is None:
        backend = "mosaic" if platform == "tpu" else "triton"
    if backend not in BACKENDS:
        raise ValueError(f"{backend=} is not one of {BACKENDS} (or None for the default).")
    if backend == "triton":
        filter_triton_deprecation()
    if backend == "mosaic_gpu" and not mosaic_gpu_supported():
        raise ValueError(
            f"backend='mosaic_gpu' needs jax >= {'.'.join(map(str, MOSAIC_GPU_MIN_JAX))} "
            f"(installed: {jax.__version__}); upgrade jax or use backend='triton'"
        )
    if interpret is None:
        interpret = platform not in ("gpu", "cuda", "rocm", "tpu")
    return backend, bool(interpret)


def interpret_arg(backend: str, interpret: bool):
    """pallas_call's (or `plgpu.kernel`'s) `interpret=`: Mosaic kernels use DMAs and
    semaphores, which only the TPU interpreter emulates; Mosaic GPU bodies run in the
    GPU interpreter (TMA copies, barriers), with its race detector on."""
    if not interpret:
        return False
    if backend == "mosaic":
        return pltpu.InterpretParams()
    if backend == "mosaic_gpu":
        return plmgpu.InterpretGPUParams(detect_races=True)
    return True


def triton_params(num_warps: int, num_stages: int):
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def mosaic_params(dimension_semantics: tuple[str, ...]):
    return pltpu.CompilerParams(dimension_semantics=dimension_semantics)


def is_power_of_2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def next_power_of_2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def power_of_2_pieces(width: int) -> tuple[tuple[int, int], ...]:
    """Splits [0, width) into (start, size) pieces of power-of-2 sizes, largest first.

    Triton tensors must have power-of-2 shapes, so a 656-byte MLA row is moved
    as 512 + 128 + 16.
    """
    pieces, start = [], 0
    for bit in reversed(range(width.bit_length())):
        size = 1 << bit
        if width & size:
            pieces.append((start, size))
            start += size
    return tuple(pieces)


ANY = pl.ANY
