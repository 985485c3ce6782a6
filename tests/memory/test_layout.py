"""The physical cache: buffer shapes, bytes written through views land at the plan's addresses.

Every write test compares the whole raw buffer with a numpy model built from
`KVCacheTensor.address`, so a byte written anywhere else fails it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import (
    LAYOUTS,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    plan,
)
from jaxkv.memory.layout import (
    DSA_INDEXER_FIELDS,
    DSA_LATENT_FIELDS,
    RowField,
    allocate_cache,
    buffer_spec,
    copy_blocks,
    find_layer,
    is_typed,
    locate_token,
    read_rows,
    state_fields,
    typed_view,
    whole_row,
    with_layout,
    write_rows,
)
from pallas_kernels.paged_scatter import paged_scatter_reference

DSA_BLOCK = 100_864
MLA = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=656, dtype="uint8")
IDX = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype="uint8")
ATTN = dict(block_size=4, num_kv_heads=2, head_size=8)


def dsa(layout="BLHNC", num_blocks=8):
    """DeepSeek-V3.2's sparse attention, 2 layers: one group, [MLA L0 | MLA L1 | IDX L0 | IDX L1] per block."""
    layers = {"l0.attn": MLA, "l0.idx": IDX, "l1.attn": MLA, "l1.idx": IDX}
    return plan(layers, num_blocks * DSA_BLOCK, max_model_len=256, layout=layout)


def gemma_like(layout):
    """9 sliding-window layers and 2 full ones, one row shape: a typed cache of 2 layer slots
    per block, which the 1-layer sliding group fills only half."""
    layers = {f"s{i}": SlidingWindowSpec(**ATTN, dtype="bfloat16", sliding_window=6) for i in range(9)}
    layers |= {"f9": FullAttentionSpec(**ATTN, dtype="bfloat16"), "f10": FullAttentionSpec(**ATTN, dtype="bfloat16")}
    layers["f11"] = "f10"  # shares f10's cache
    return plan(layers, 128 * 512, max_model_len=32, max_num_batched_tokens=8, layout=layout, grouping="vllm")


def hybrid_mamba(layout):
    """Qwen3-Next-like: state layers (float32 + bfloat16 state, padded) beside float32 attention pages."""
    state = MambaSpec(block_size=4, shapes=((2, 8), (2, 4, 4)), dtypes=("float32", "bfloat16"))
    layers = {f"s{i}": state for i in range(6)} | {f"a{i}": FullAttentionSpec(**ATTN, dtype="float32") for i in (6, 7)}
    return plan(layers, 64 * 1024, max_model_len=32, layout=layout, grouping="vllm")


def padded_attention(layout):
    """Sliding-window pages padded up to the full-attention pages of another head size."""
    full = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=12, dtype="bfloat16")
    window = SlidingWindowSpec(block_size=4, num_kv_heads=2, head_size=10, dtype="bfloat16", sliding_window=8)
    layers = {"f0": full, "w1": window, "f2": full, "w3": window}
    return plan(layers, 64 * 1024, max_model_len=32, layout=layout, grouping="vllm")


CONFIGS = {"dsa": dsa, "gemma_like": gemma_like, "hybrid_mamba": hybrid_mamba, "padded_attention": padded_attention}


def raw_bytes(cache) -> np.ndarray:
    """The buffer as its bytes, in memory order."""
    return np.asarray(cache).view(np.uint8).reshape(-1)


def random_values(rng, shape, dtype) -> np.ndarray:
    if np.dtype(dtype) == np.uint8:
        return rng.integers(0, 256, shape, dtype=np.uint8)
    return rng.normal(size=shape).astype(dtype)


def test_deepseek_v32_example():
    cfg = dsa()
    mla, idx = cfg.tensors
    assert cfg.bytes_per_block == DSA_BLOCK and not is_typed(cfg)
    assert (mla.offset, mla.layer_stride, mla.block_stride, mla.row_bytes) == (0, 41_984, DSA_BLOCK, 656)
    assert (idx.offset, idx.layer_stride, idx.block_stride, idx.row_bytes) == (83_968, 8_448, DSA_BLOCK, 132)
    assert [mla.address(0, 0), mla.address(1, 0), idx.address(0, 0), idx.address(1, 0)] == [0, 41_984, 83_968, 92_416]

    loc = locate_token(cfg, 0, 130, [3, 1, 5])  # token 130: logical block 2, block_table[2] = 5
    assert (loc.logical_block, loc.block_id, loc.position_in_block, loc.slot) == (2, 5, 2, 322)
    assert loc.address("l1.attn") == 41_984 + 5 * 100_864 + 2 * 656
    assert loc.address("l1.idx") == 83_968 + 8_448 + 5 * 100_864 + 2 * 132

    # Real bytes through both views at slot 322 of layer 1, read back from the raw buffer.
    rng = np.random.default_rng(0)
    latent, key = random_values(rng, (1, 1, 656), np.uint8), random_values(rng, (1, 1, 132), np.uint8)
    cache = allocate_cache(cfg)
    cache = write_rows(cache, jnp.asarray(latent), jnp.array([loc.slot]), 1, cfg=cfg, tensor_idx=0)
    cache = write_rows(cache, jnp.asarray(key), jnp.array([loc.slot]), 1, cfg=cfg, tensor_idx=1)
    raw = raw_bytes(cache)
    np.testing.assert_array_equal(raw[loc.address("l1.attn") :][:656], latent[0, 0])
    np.testing.assert_array_equal(raw[loc.address("l1.idx") :][:132], key[0, 0])
    assert np.count_nonzero(raw) == np.count_nonzero(latent) + np.count_nonzero(key)  # nothing else written


@pytest.mark.parametrize(
    "name, layout",
    [(name, layout) for name in ("dsa", "gemma_like", "hybrid_mamba") for layout in LAYOUTS]
    + [("padded_attention", "BLNHC"), ("padded_attention", "LBHNC")],
)
def test_rows_written_through_views_land_at_the_plan_addresses(name, layout):
    cfg = CONFIGS[name](layout)
    rng = np.random.default_rng(1)
    cache = allocate_cache(cfg)
    spec = buffer_spec(cfg)
    assert (cache.shape, cache.dtype) == (spec.shape, spec.dtype)
    expected = np.zeros(cfg.tensors[0].size, np.uint8)
    num_groups = len(cfg.groups)
    num_views = len(cfg.tensors)
    reads = []
    # Every view when there are few (else the first two and last two: each compiles its own write).
    for i in sorted({0, 1, num_views - 2, num_views - 1} & set(range(num_views))):
        t = cfg.tensors[i]
        # Groups draw disjoint block ids: here block b belongs to group b % num_groups.
        blocks = np.arange(1, cfg.num_blocks)
        blocks = blocks[blocks % num_groups == t.group_idx % num_groups]
        slots = (blocks[:, None] * t.tokens_per_block + np.arange(t.tokens_per_block)).reshape(-1)
        field = whole_row(t)
        for j in range(len(t.layers)):
            chosen = rng.choice(slots, size=min(5, len(slots)), replace=False).astype(np.int32)
            rows = random_values(rng, (len(chosen), t.num_heads, *field.shape), field.dtype)
            cache = write_rows(cache, jnp.asarray(rows), jnp.asarray(chosen), j, cfg=cfg, tensor_idx=i)
            for slot, row in zip(chosen, rows):
                block, position = divmod(int(slot), t.tokens_per_block)
                for h in range(t.num_heads):
                    start = t.address(j, block, position, h)
                    expected[start : start + t.head_bytes] = row[h].view(np.uint8)
            reads.append((i, j, chosen, rows))
    np.testing.assert_array_equal(raw_bytes(cache), expected)
    for i, j, chosen, rows in (reads[0], reads[-1]):
        t = cfg.tensors[i]
        np.testing.assert_array_equal(np.asarray(read_rows(cache, jnp.asarray(chosen), j, cfg=cfg, tensor_idx=i)), rows)
        # typed_view holds the same row at [block, layer, head, position] in layout order.
        view = np.asarray(typed_view(cache, cfg, i))
        block, position = divmod(int(chosen[0]), t.tokens_per_block)
        where = {"B": block, "L": j, "H": slice(None), "N": position}
        np.testing.assert_array_equal(view[tuple(where[a] for a in cfg.layout[:4])], rows[0])


@pytest.mark.parametrize("layout", ["BLHNC", "LBNHC"])
def test_deepseek_v32_row_fields(layout):
    """FP8 latent + float32 scales + bfloat16 RoPE part in one 656 B row; FP8 key + scale in a 132 B row."""
    cfg = dsa(layout)
    rng = np.random.default_rng(2)
    slots = np.array([322, 65, 130], np.int32)
    cache = allocate_cache(cfg)
    values = {}
    for i, fields in enumerate((DSA_LATENT_FIELDS, DSA_INDEXER_FIELDS)):
        for f in fields:
            v = rng.normal(size=(len(slots), 1, *f.shape)).astype(f.dtype)
            cache = write_rows(cache, jnp.asarray(v), jnp.asarray(slots), 1, cfg=cfg, tensor_idx=i, field=f)
            values[i, f] = v
    raw = raw_bytes(cache)
    for (i, f), v in values.items():
        t = cfg.tensors[i]
        for slot, row in zip(slots, v):
            start = t.address(1, slot // 64, slot % 64) + f.offset
            np.testing.assert_array_equal(raw[start : start + f.num_bytes].view(jnp.dtype(f.dtype)), row[0].reshape(-1))
        got = read_rows(cache, jnp.asarray(slots), 1, cfg=cfg, tensor_idx=i, field=f)
        assert got.dtype == jnp.dtype(f.dtype)
        np.testing.assert_array_equal(np.asarray(got), v)
    scales = np.asarray(typed_view(cache, cfg, 0, DSA_LATENT_FIELDS[1]))  # float32 [.., 4]
    where = {"B": 5, "L": 1, "H": 0, "N": 2}
    expected = values[0, DSA_LATENT_FIELDS[1]][0, 0]  # slot 322 = block 5, position 2
    np.testing.assert_array_equal(scales[tuple(where[a] for a in cfg.layout[:4])], expected)


@pytest.mark.parametrize("layout", ["BLHNC", "LBNHC"])
def test_mamba_state_fields_beside_attention_pages(layout):
    cfg = hybrid_mamba(layout)
    state_view = next(i for i, t in enumerate(cfg.tensors) if isinstance(t.spec, MambaSpec))
    t = cfg.tensors[state_view]
    assert t.page_bytes > t.spec.real_page_size_bytes  # padded to the attention page
    rng = np.random.default_rng(3)
    block = next(b for b in range(1, cfg.num_blocks) if b % len(cfg.groups) == t.group_idx)
    cache = allocate_cache(cfg)
    raw_before = raw_bytes(cache).copy()
    for f in state_fields(t.spec):
        v = rng.normal(size=(1, 1, *f.shape)).astype(f.dtype)
        cache = write_rows(cache, jnp.asarray(v), jnp.array([block]), 1, cfg=cfg, tensor_idx=state_view, field=f)
        start = t.address(1, block) + f.offset
        written = raw_bytes(cache)[start : start + f.num_bytes].view(jnp.dtype(f.dtype))
        np.testing.assert_array_equal(written, v.reshape(-1))
        np.testing.assert_array_equal(np.asarray(typed_view(cache, cfg, state_view, f))[
            (block, 1) if layout.startswith("B") else (1, block)][0, 0], v[0, 0])  # fmt: skip
    changed = np.flatnonzero(raw_bytes(cache) != raw_before)
    assert changed.min() >= t.address(1, block) and changed.max() < t.address(1, block) + t.spec.real_page_size_bytes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_typed_cache_is_what_the_kernels_take(layout):
    cfg = gemma_like(layout)
    assert is_typed(cfg) and len(cfg.groups) > 1
    t = cfg.tensors[0]
    dims = {"B": cfg.num_blocks, "L": cfg.bytes_per_block // t.page_bytes, "H": 2, "N": 4, "C": 16}
    assert buffer_spec(cfg).shape == tuple(dims[a] for a in layout)
    rng = np.random.default_rng(4)
    cache = jnp.asarray(rng.normal(size=buffer_spec(cfg).shape), jnp.bfloat16)
    assert typed_view(cache, cfg, 0) is cache  # no copy, no op
    rows = jnp.asarray(rng.normal(size=(6, 2, 16)), jnp.bfloat16)
    slots = jnp.array([5, 9, -1, 4 * cfg.num_blocks - 1, 12, 30], jnp.int32)
    expected = paged_scatter_reference(cache, rows, slots, 1, layout=layout)
    got = write_rows(jnp.array(cache), rows, slots, 1, cfg=cfg, tensor_idx=0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    # A field of whole channels: V of each head, channels [8, 16).
    v = RowField(name="v", dtype="bfloat16", shape=(8,), offset=16)
    got_v = read_rows(got, slots, 1, cfg=cfg, field=v)
    np.testing.assert_array_equal(np.asarray(got_v[:2]), np.asarray(rows[:2, :, 8:]))


@pytest.mark.parametrize("name", ["dsa", "gemma_like"])
def test_out_of_range_slots_and_layers_write_nothing(name):
    cfg = CONFIGS[name]("BLHNC")
    t = cfg.tensors[0]
    field = whole_row(t)
    before = allocate_cache(cfg)
    bad = [(-1, 0), (cfg.num_blocks * t.tokens_per_block, 0), (5, len(t.layers)), (5, -1)]
    for slot, layer in bad:
        rows = jnp.ones((1, t.num_heads, *field.shape), field.dtype)
        after = write_rows(jnp.array(before), rows, jnp.array([slot]), layer, cfg=cfg)
        assert not raw_bytes(after).any(), (slot, layer)
        read = read_rows(jnp.ones_like(before), jnp.array([slot]), layer, cfg=cfg)
        assert not np.asarray(read).any(), (slot, layer)


def test_write_is_in_place_and_view_gathers_fuse():
    """XLA aliases the donated cache and moves only the rows; a gather from a typed view of bytes
    reads the buffer directly instead of materialising the view."""
    cfg = dsa(num_blocks=64)
    cache = allocate_cache(cfg)
    rows, slots = jnp.zeros((3, 1, 656), jnp.uint8), jnp.array([64, 65, 66], jnp.int32)
    compiled = write_rows.lower(cache, rows, slots, 1, cfg=cfg).compile()
    stats = compiled.memory_analysis()
    assert stats.alias_size_in_bytes == cache.nbytes and stats.temp_size_in_bytes < cache.nbytes // 100
    rope = DSA_LATENT_FIELDS[2]
    gather = jax.jit(lambda c, b: typed_view(c, cfg, 0, rope)[b]).lower(cache, jnp.array([1, 2])).compile()
    assert gather.memory_analysis().temp_size_in_bytes < typed_view(cache, cfg, 0, rope).nbytes // 100


def test_buffer_shapes_keep_indices_in_int32():
    assert buffer_spec(dsa("BLHNC")).shape == (8, DSA_BLOCK)  # a row per block
    assert buffer_spec(dsa("LBNHC")).shape == (8 * DSA_BLOCK // 256, 256)  # gcd(41,984, 8,448) = 256
    assert buffer_spec(dsa("LBNHC")).dtype == jnp.uint8


def test_find_layer_and_locate_token_errors():
    cfg = gemma_like("BLHNC")
    i, j = find_layer(cfg, "f11")  # shares f10's cache
    assert cfg.tensors[i].layers[j] == "f10"
    with pytest.raises(ValueError, match="'nope' is not in this plan"):
        find_layer(cfg, "nope")
    cfg = dsa()
    with pytest.raises(ValueError, match=r"block_table\[1\] = 0: the null block"):
        locate_token(cfg, 0, 70, [3, 0])
    with pytest.raises(ValueError, match="past the block table"):
        locate_token(cfg, 0, 130, [3, 1])
    with pytest.raises(ValueError, match="not a block id of this pool"):
        locate_token(cfg, 0, 0, [cfg.num_blocks])


def test_bad_rows_and_fields_name_the_fix():
    cfg = dsa()
    cache = allocate_cache(cfg)
    with pytest.raises(ValueError, match=r"must be \[T, H, \*field.shape\] = \(1, 1, 656\) of uint8"):
        write_rows(cache, jnp.zeros((1, 1, 600), jnp.uint8), jnp.array([1]), 0, cfg=cfg)
    too_long = RowField(name="x", dtype="float32", shape=(40,), offset=0)
    with pytest.raises(ValueError, match="choose a field inside the row"):
        read_rows(cache, jnp.array([1]), 0, cfg=cfg, tensor_idx=1, field=too_long)
    typed = gemma_like("BLHNC")
    odd = RowField(name="odd", dtype="uint8", shape=(3,), offset=1)
    with pytest.raises(ValueError, match="align it to 2 B"):
        read_rows(allocate_cache(typed), jnp.array([1]), 0, cfg=typed, field=odd)


def test_with_layout_matches_planning_in_that_layout():
    for layout in LAYOUTS:
        assert with_layout(gemma_like("BLHNC"), layout) == gemma_like(layout)
        assert with_layout(dsa("LBNHC"), layout) == dsa(layout)


@pytest.mark.parametrize(
    "name, layout", [(name, layout) for name in ("gemma_like", "hybrid_mamba") for layout in LAYOUTS]
)
def test_copy_blocks_copies_every_page_of_the_block_and_nothing_else(name, layout):
    # Copy-on-write copies (prefix hits inside a block): whole blocks, all views, donated cache.
    cfg = CONFIGS[name](layout)
    spec = buffer_spec(cfg)
    rng = np.random.default_rng(0)
    cache = jnp.asarray(random_values(rng, spec.shape, spec.dtype))
    before = raw_bytes(cache).copy()
    copies = np.asarray([[3, 5, 2], [3, 6, 1], [0, 7, 0], [2, 0, 0], [1, 4, 3]], np.int32)  # NULL rows: no-ops
    after = raw_bytes(copy_blocks(cache, copies, cfg=cfg))
    expected = before.copy()
    for src, dst, _ in copies:
        if not src or not dst:
            continue
        if layout.startswith("B"):
            regions = [(0, cfg.bytes_per_block)]
        else:
            regions = [
                (t.offset + layer * t.layer_stride, t.block_stride)
                for t in cfg.tensors
                for layer in range(len(t.layers))
            ]
        for start, size in regions:
            stride = cfg.bytes_per_block if layout.startswith("B") else next(t.block_stride for t in cfg.tensors)
            expected[start + dst * stride : start + dst * stride + size] = before[
                start + src * stride : start + src * stride + size
            ]
    np.testing.assert_array_equal(after, expected)
