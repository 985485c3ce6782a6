"""paged_scatter against its reference, and the in-place (aliased, donated) write."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import kernel_cases
import numpy as np
import pytest
from mosaic_gpu_marks import needs_mosaic_gpu, no_races_found

from pallas_kernels.paged_scatter import kernel as scatter_kernel
from pallas_kernels.paged_scatter import paged_scatter, paged_scatter_reference


def _cache_and_rows(
    rng, *, layout, dtype, num_blocks=7, num_layers=2, num_heads=2, block_size=4, row_width=24, num_tokens=11
):
    canonical = rng.normal(size=(num_blocks, num_layers, num_heads, block_size, row_width))
    rows = rng.normal(size=(num_tokens, num_heads, row_width))
    if dtype == "uint8":
        canonical, rows = canonical * 40 + 128, rows * 40 + 128
    cache = kernel_cases.to_layout(canonical, layout).astype(dtype)
    # A prefill chunk at consecutive slots, three decodes elsewhere, padding (-1).
    slots = rng.permutation(np.arange(block_size, num_blocks * block_size))[:3].tolist()
    chunk = list(range(2 * block_size + 1, 2 * block_size + 1 + num_tokens - 5))
    slots = [s for s in slots if s not in chunk][:3]
    slots = chunk + slots + [-1] * (num_tokens - len(chunk) - len(slots))
    rng.shuffle(slots)
    return cache, rows.astype(dtype), np.asarray(slots, np.int32)


@pytest.mark.parametrize(
    "layout,dtype,row_width",
    [
        ("BLHNC", "float32", 24),
        ("BLHNC", "bfloat16", 32),
        ("BLHNC", "uint8", 656 // 8),  # MLA-like latent row, not a power of 2
        ("BLNHC", "float32", 24),
        ("LBHNC", "float32", 24),
        ("LBNHC", "bfloat16", 16),
    ],
)
def test_matches_reference(layout, dtype, row_width):
    cache, rows, slots = _cache_and_rows(np.random.default_rng(0), layout=layout, dtype=dtype, row_width=row_width)
    ref = paged_scatter_reference(jnp.asarray(cache), rows, slots, 1, layout=layout)
    out = paged_scatter(jnp.asarray(cache), jnp.asarray(rows), jnp.asarray(slots), 1, layout=layout)
    # Bit-exact, so layer 0, padding tokens and every slot not named are untouched.
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_mosaic_body_in_tpu_interpreter():
    cache, rows, slots = _cache_and_rows(np.random.default_rng(1), layout="BLHNC", dtype="float32")
    ref = paged_scatter_reference(jnp.asarray(cache), rows, slots, 0)
    out = paged_scatter(jnp.asarray(cache), jnp.asarray(rows), jnp.asarray(slots), 0, backend="mosaic", interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@needs_mosaic_gpu
@pytest.mark.parametrize(
    "layout,dtype,row_width,max_tile",
    [
        ("BLHNC", "float32", 24, 128),
        ("BLHNC", "bfloat16", 32, 4),  # 11 tokens in three programs of 4
        ("BLHNC", "uint8", 656, 128),  # an MLA row: TMA pieces of 256, 256 and 144 channels
        ("BLNHC", "float32", 24, 128),
        ("LBHNC", "float32", 24, 4),
        ("LBNHC", "bfloat16", 16, 128),
    ],
)
def test_mosaic_gpu_body_matches_reference(monkeypatch, layout, dtype, row_width, max_tile):
    monkeypatch.setattr(scatter_kernel, "_MGPU_MAX_TILE", max_tile)
    cache, rows, slots = _cache_and_rows(np.random.default_rng(5), layout=layout, dtype=dtype, row_width=row_width)
    if dtype != "uint8":  # NaN in the null block and in every block no slot names: a stray write would show
        named = np.zeros(cache.shape[layout.index("B")], bool)
        named[[slot // 4 for slot in slots if slot >= 0]] = True  # block size 4
        np.moveaxis(cache, layout.index("B"), 0)[~named] = np.nan
    ref = paged_scatter_reference(jnp.asarray(cache), rows, slots, 1, layout=layout)
    out = paged_scatter(
        jnp.asarray(cache), jnp.asarray(rows), jnp.asarray(slots), 1, layout=layout, backend="mosaic_gpu"
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert no_races_found()


@pytest.mark.parametrize("backend", ["triton", "mosaic", pytest.param("mosaic_gpu", marks=needs_mosaic_gpu)])
@pytest.mark.parametrize("layer", [0, 2, -1])
def test_out_of_range_slots_and_layers_write_nothing(backend, layer):
    # Slots past the pool (B * N and beyond) are dropped, never clamped onto the last block;
    # a layer outside [0, L) writes nothing at all.
    cache, rows, slots = _cache_and_rows(np.random.default_rng(2), layout="BLHNC", dtype="float32")
    num_slots = cache.shape[0] * cache.shape[3]
    slots[:3] = [num_slots, num_slots + 1, num_slots + 5]
    ref = paged_scatter_reference(jnp.asarray(cache), rows, slots, layer)
    out = paged_scatter(
        jnp.asarray(cache), jnp.asarray(rows), jnp.asarray(slots), layer, backend=backend, interpret=True
    )
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    if layer != 0:
        np.testing.assert_array_equal(np.asarray(out), cache)


def test_cache_is_donated_and_aliased():
    cache, rows, slots = _cache_and_rows(np.random.default_rng(2), layout="BLHNC", dtype="float32")
    cache = jnp.asarray(cache)
    # The lowered module aliases the cache parameter to the output...
    lowered = paged_scatter.lower(cache, rows, slots, 0).as_text()
    assert "tf.aliasing_output = 0" in lowered
    # ...and the call consumes the caller's buffer instead of copying it.
    out = paged_scatter(cache, jnp.asarray(rows), jnp.asarray(slots), 0)
    assert cache.is_deleted()
    assert not out.is_deleted()


def test_outer_jit_donating_the_cache_aliases_it_through():
    # A model step writes every layer inside one jit; donating the cache there
    # makes the compiled step update it in place.
    cache, rows, slots = _cache_and_rows(np.random.default_rng(3), layout="BLHNC", dtype="float32")

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache, rows, slots):
        def write_layer(layer, cache):
            return paged_scatter(cache, rows + layer, slots, layer)

        return jax.lax.fori_loop(0, cache.shape[1], write_layer, cache)

    expected = jnp.asarray(cache)
    for layer in range(cache.shape[1]):
        expected = paged_scatter_reference(expected, rows + layer, slots, layer)
    compiled = step.lower(jnp.asarray(cache), rows, slots).compile().as_text()
    assert "input_output_alias" in compiled
    out = step(jnp.asarray(cache), jnp.asarray(rows), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(expected))


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(rows_heads=3), r"must match the cache's H=2"),
        (dict(rows_dtype="bfloat16"), "must equal cache.dtype"),
        (dict(num_slots=4), "one slot per token"),
    ],
)
def test_trace_time_errors_name_the_value(change, message):
    cache = jnp.zeros((3, 2, 2, 4, 8), jnp.float32)
    rows = jnp.zeros((5, change.get("rows_heads", 2), 8), change.get("rows_dtype", "float32"))
    slots = jnp.zeros((change.get("num_slots", 5),), jnp.int32)
    with pytest.raises(ValueError, match=message):
        paged_scatter(cache, rows, slots, 0)


def test_reference_matches_a_plain_loop():
    cache, rows, slots = _cache_and_rows(np.random.default_rng(4), layout="BLNHC", dtype="float32")
    expected = cache.transpose(0, 1, 3, 2, 4).copy()  # [B, L, H, N, C]
    for token, slot in enumerate(slots):
        if slot >= 0:
            expected[slot // 4, 1, :, slot % 4] = rows[token]
    ref = paged_scatter_reference(jnp.asarray(cache), rows, slots, 1, layout="BLNHC")
    np.testing.assert_array_equal(np.asarray(ref), expected.transpose(0, 1, 3, 2, 4))
