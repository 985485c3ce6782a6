"""plan(): vLLM 0.33's figures exactly, the auto grouping, KV sharing, budget errors, buffer views.

vLLM's own figures: synchronous scheduling, max_num_batched_tokens=2048, block 16,
8 KV heads × 128, bfloat16, max_model_len=32768, grouping="vllm" unless stated.
"""

import glob
import json
import pathlib
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    plan,
    resolve_kv_sharing,
    specs_from_hf_config,
)
from jaxkv.planner.planning import unify_page_sizes

GiB, MiB = 1 << 30, 1 << 20
ATTN = dict(block_size=16, num_kv_heads=8, head_size=128, dtype="bfloat16")
VLLM = dict(max_model_len=32_768, max_num_batched_tokens=2048, grouping="vllm")


def full(**kw):
    return FullAttentionSpec(**{**ATTN, **kw})


def sliding(window, **kw):
    return SlidingWindowSpec(**{**ATTN, **kw}, sliding_window=window)


def gemma3_like():
    """62 layers, layer i full when i % 6 == 5, window 1024, 16 KV heads."""
    return {
        f"model.layers.{i}": full(num_kv_heads=16) if i % 6 == 5 else sliding(1024, num_kv_heads=16) for i in range(62)
    }


def sizes(cfg):
    return [len(g.layer_names) for g in cfg.groups]


def test_full_sliding_sliding_x10():
    layers = {}
    for i in range(10):
        layers |= {f"f{i}": full(), f"s{i}a": sliding(1024), f"s{i}b": sliding(1024)}
    cfg = plan(layers, 4 * GiB, **VLLM)
    assert (sizes(cfg), cfg.num_blocks, cfg.capacity_tokens) == ([10, 10, 10], 6553, 88_220)
    assert [g.kind for g in cfg.groups] == ["full", "sliding_window", "sliding_window"]
    # hybrid=False: one full-attention group; the spec still carries the window.
    cfg = plan(layers, 4 * GiB, **VLLM, hybrid=False)
    assert (sizes(cfg), cfg.num_blocks, cfg.capacity_tokens) == ([30], 2184, 34_944)
    assert type(cfg.groups[0].spec) is FullAttentionSpec and cfg.groups[0].spec.sliding_window == 1024
    # ... and each layer keeps its own: the model computes global layers without a window.
    per_layer = dict(zip(cfg.groups[0].layer_names, cfg.groups[0].specs))
    assert all(type(s) is FullAttentionSpec for s in per_layer.values())
    assert [per_layer[n].sliding_window for n in ("f0", "s0a", "s0b")] == [None, 1024, 1024]
    assert len(cfg.tensors) == 1  # one view: the window does not shape the page


def test_13_full_then_12_sliding():
    layers = {f"f{i}": full() for i in range(13)} | {f"s{i}": sliding(128) for i in range(12)}
    cfg = plan(layers, 4 * GiB, **VLLM)
    assert (sizes(cfg), cfg.num_blocks, cfg.capacity_tokens) == ([13, 12], 5041, 75_598)


def test_2_full_then_5_sliding_interleaves_the_sliding_bucket():
    layers = {f"f{i}": full() for i in range(2)} | {f"s{i}": sliding(128) for i in range(5)}
    cfg = plan(layers, 4 * GiB, **VLLM)
    assert [g.layer_names for g in cfg.groups] == [("f0", "f1"), ("s0", "s3"), ("s1", "s4"), ("s2",)]
    assert (cfg.num_blocks, cfg.capacity_tokens) == (32_768, 436_657)


def test_gemma3_like_at_40_gib():
    cfg = plan(gemma3_like(), 40 * GiB, **VLLM)
    assert [(g.kind, len(g.layer_names)) for g in cfg.groups] == [("sliding_window", n) for n in (9, 9, 9, 9, 8, 8)] + [
        ("full", 10)
    ]
    assert (cfg.num_blocks, cfg.capacity_tokens) == (32_768, 334_916)
    assert cfg.max_concurrency == 32_768 / (6 * 193 + 2048)


def test_gemma3_27b_layer_tokens_per_request():
    # Bytes per request in layer-tokens (one token of one layer: 16 heads × 256 × 2 B).
    cfg = plan(gemma3_like(), 40 * GiB, **VLLM)
    row = 16 * 256 * 2
    assert cfg.all_full.bytes_per_request(32_000) // row == 62 * 32_000 == 1_984_000
    assert cfg.bytes_per_request(32_000) // row == 381_440  # vLLM's grouping, padding included
    assert sum(len(g.layer_names) * g.blocks_held(32_000) * g.block_size for g in cfg.groups) == 373_248
    # Short requests: the hybrid plan is worse (padding, partial blocks).
    assert (cfg.bytes_per_request(512) // row, cfg.all_full.bytes_per_request(512) // row) == (35_840, 31_744)


def test_mamba_and_attention_pages_unify_to_the_largest():
    state = MambaSpec(block_size=16, shapes=((2, 512), (3, 32, 32)), dtypes=("float32", "float32"))
    assert state.page_size_bytes == 16_384
    layers = {
        "big": full(num_kv_heads=4),  # 16 × 4 × 256 × 2 = 32,768 B
        "state": state,  # padded to 32,768
        "small": sliding(128, num_kv_heads=2),  # 16,384 B divides: block 16 → 32
        "odd": ChunkedLocalAttentionSpec(**{**ATTN, "num_kv_heads": 2, "block_size": 24}, attention_chunk_size=512),
    }
    assert layers["odd"].page_size_bytes == 24_576
    unified = unify_page_sizes(layers)
    assert {s.page_size_bytes for s in unified.values()} == {32_768}
    assert (unified["state"].real_page_size_bytes, unified["state"].page_size_padded) == (16_384, 32_768)
    assert (unified["small"].block_size, unified["small"].page_size_padded) == (32, None)
    assert (unified["odd"].block_size, unified["odd"].page_size_padded) == (24, 32_768)
    cfg = plan(layers, 4 * GiB, **VLLM)
    assert {g.spec.page_size_bytes for g in cfg.groups} == {32_768}
    assert cfg.padding_fraction > 0


def test_an_mla_page_that_does_not_divide_is_an_error():
    layers = {"mla": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=600, dtype="uint8"), "s": sliding(128)}
    with pytest.raises(ValueError, match="'mla'.*MLA page of 9600 B does not divide"):
        plan(layers, 4 * GiB, **VLLM)


def test_budget_error_states_the_longest_max_model_len_that_fits():
    layers = {f"l{i}": full() for i in range(32)}  # 2 MiB per block id
    with pytest.raises(ValueError, match="longest max_model_len that fits is 32,752"):
        plan(layers, 4 * GiB, **VLLM)  # 2048 blocks: the null block leaves 2047
    cfg = plan(layers, 4 * GiB + 2 * MiB, **VLLM)
    assert (cfg.num_blocks, cfg.capacity_tokens) == (2049, 32_784)
    with pytest.raises(ValueError, match="not even a 1-token request fits"):
        plan(layers, 3 * MiB, **VLLM)


def test_a_budget_beyond_int32_slots_is_refused_saying_the_most_that_fits():
    # Slots (block_id * 16 + offset) are int32: at most 2**31 / 16 = 2**27 blocks of 64 KiB, 8 TiB.
    layers = {"f": full()}
    assert plan(layers, 8 << 40, max_model_len=256).num_blocks == 2**27
    message = "gives 134,217,729 blocks of 16 tokens, more than int32 slots address (134,217,728 blocks); give at most "
    with pytest.raises(
        ValueError, match=re.escape(message + "8,796,093,022,208 B (a smaller --memory / available_bytes)")
    ):
        plan(layers, (8 << 40) + 64 * 1024, max_model_len=256)


def test_kv_sharing_layers_add_nothing():
    owners = {f"l{i}": sliding(512) if i % 5 != 4 else full() for i in range(20)}
    # Gemma-3n-like: the last 10 layers reuse the last earlier layer of their type.
    shared = {f"l{i}": ("l19" if i % 5 == 4 else "l18") for i in range(20, 30)}
    with_sharing = plan(owners | shared, 4 * GiB, **VLLM)
    alone = plan(owners, 4 * GiB, **VLLM)
    assert with_sharing.bytes_per_block == alone.bytes_per_block
    assert (with_sharing.groups, with_sharing.num_blocks) == (alone.groups, alone.num_blocks)
    assert dict(with_sharing.shared_layers) == shared


def test_kv_sharing_chains_resolve_and_cycles_or_unknown_names_are_errors():
    specs, shared = resolve_kv_sharing({"a": "b", "b": "c", "c": full()})
    assert (list(specs), shared) == (["c"], {"a": "c", "b": "c"})
    with pytest.raises(ValueError, match="cycle: a -> b -> a"):
        resolve_kv_sharing({"a": "b", "b": "a", "c": full()})
    with pytest.raises(ValueError, match="'a' shares the cache of 'nope'"):
        resolve_kv_sharing({"a": "nope", "c": full()})
    with pytest.raises(ValueError, match="cycle: a -> a"):
        plan({"a": "a"}, GiB, max_model_len=16)


@pytest.mark.parametrize("path", sorted(glob.glob(str(pathlib.Path(__file__).parents[1] / "configs/*.json"))))
def test_auto_is_never_worse_than_vllm_on_the_zoo(path):
    with open(path) as f:
        layers = specs_from_hf_config(json.load(f))
    auto = plan(layers, 40 * GiB, max_model_len=32_768)
    vllm = plan(layers, 40 * GiB, max_model_len=32_768, grouping="vllm")
    assert auto.capacity_tokens >= vllm.capacity_tokens


def test_auto_removes_gemma3_padding_under_the_group_cap():
    vllm = plan(gemma3_like(), 40 * GiB, **VLLM)
    auto = plan(gemma3_like(), 40 * GiB, max_model_len=32_768)
    assert auto.capacity_tokens > vllm.capacity_tokens * 1.03  # 345,310 against 334,916
    assert len(auto.groups) <= 16 and auto.padding_fraction < vllm.padding_fraction
    assert auto.vllm_grouping.capacity_tokens == vllm.capacity_tokens
    capped = plan(gemma3_like(), 40 * GiB, max_model_len=32_768, max_groups=7)
    assert capped.groups == vllm.groups and capped.vllm_grouping is None


def test_auto_avoids_padding_small_attention_pages_to_a_state_page():
    state = MambaSpec(block_size=16, shapes=((3, 8192), (32, 128, 128)), dtypes=("bfloat16", "bfloat16"))
    layers = {f"l{i}": full() if i % 4 == 3 else state for i in range(8)}
    vllm = plan(layers, 40 * GiB, **VLLM)
    auto = plan(layers, 40 * GiB, max_model_len=32_768)
    assert vllm.groups[-1].spec.page_size_padded == state.page_size_bytes  # 65,536 B padded to 1,097,728 B
    assert auto.groups[-1].spec.page_size_padded is None and auto.groups[-1].block_size > 16
    assert auto.capacity_tokens > 10 * vllm.capacity_tokens


_kinds = st.sampled_from(["full", "sliding", "chunked", "mamba"])


@settings(max_examples=40, deadline=None)
@given(
    kinds=st.lists(_kinds, min_size=1, max_size=12),
    heads=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=12, max_size=12),
    max_model_len=st.sampled_from([256, 4096, 32_768]),
    budget_mib=st.sampled_from([64, 1024, 40_960]),
)
def test_every_layer_lands_in_one_group_and_auto_never_loses(kinds, heads, max_model_len, budget_mib):
    state = MambaSpec(block_size=16, shapes=((4, 1000),), dtypes=("float32",))
    make = {
        "full": lambda h: full(num_kv_heads=h),
        "sliding": lambda h: sliding(128, num_kv_heads=h),
        "chunked": lambda h: ChunkedLocalAttentionSpec(**{**ATTN, "num_kv_heads": h}, attention_chunk_size=512),
        "mamba": lambda h: state,
    }
    layers = {f"l{i}": make[k](h) for i, (k, h) in enumerate(zip(kinds, heads))}
    plans = {}
    for grouping in ("vllm", "auto"):
        try:
            plans[grouping] = plan(layers, budget_mib * MiB, max_model_len=max_model_len, grouping=grouping)
        except ValueError as e:
            assert "longest max_model_len that fits" in str(e) or "not even" in str(e)
    if "vllm" in plans:
        assert plans["auto"].capacity_tokens >= plans["vllm"].capacity_tokens
    for cfg in plans.values():
        assert sorted(n for g in cfg.groups for n in g.layer_names) == sorted(layers)
        assert all(g.page_bytes <= cfg.bytes_per_block for g in cfg.groups)
        assert cfg.num_blocks == budget_mib * MiB // cfg.bytes_per_block
        assert cfg.num_blocks - 1 >= sum(cfg.blocks_per_request)  # one request fits besides the null block
        assert cfg.capacity_tokens == int(cfg.num_blocks / sum(cfg.blocks_per_request) * max_model_len)


def test_block_outer_views_put_block_b_of_layer_j_at_one_offset_for_every_group():
    cfg = plan(gemma3_like(), 40 * GiB, **VLLM)
    page, block = 131_072, 10 * 131_072
    assert cfg.bytes_per_block == block and len(cfg.tensors) == len(cfg.groups)
    for t in cfg.tensors:
        assert (t.size, t.offset, t.layer_stride, t.block_stride) == (cfg.num_blocks * block, 0, page, block)
        assert t.address(2, 7) == 7 * block + 2 * page


def test_layer_outer_views_give_each_layer_a_contiguous_region():
    cfg = plan(gemma3_like(), 40 * GiB, **VLLM, layout="LBNHC")
    for t in cfg.tensors:
        assert (t.offset, t.layer_stride, t.block_stride) == (0, cfg.num_blocks * 131_072, 131_072)
    assert cfg.groups == plan(gemma3_like(), 40 * GiB, **VLLM).groups


@pytest.mark.parametrize("layout", ["BLHNC", "BLNHC", "LBHNC", "LBNHC"])
def test_views_never_overlap_at_disjoint_block_ids(layout):
    layers = {"f0": full(), "s0": sliding(64), "s1": sliding(64), "s2": sliding(64), "f1": full()}
    cfg = plan(layers, 8 * MiB, max_model_len=256, grouping="vllm", layout=layout)
    spans = []
    for t in cfg.tensors:
        for j in range(len(t.layers)):
            for b in range(t.group_idx, cfg.num_blocks, len(cfg.groups)):  # each block id used by one group
                start = t.address(j, b)
                end = t.address(j, b, t.tokens_per_block - 1, t.num_heads - 1) + t.head_bytes
                assert 0 <= start < end <= t.size and end - start == t.spec.real_page_size_bytes
                spans.append((start, end))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_head_major_and_token_major_pages():
    cfg = plan({"f": full()}, GiB, max_model_len=256, layout="BLHNC")
    hnc = cfg.tensors[0]
    assert (hnc.head_bytes, hnc.token_stride, hnc.head_stride) == (512, 512, 16 * 512)
    nhc = plan({"f": full()}, GiB, max_model_len=256, layout="BLNHC").tensors[0]
    assert (nhc.row_bytes, nhc.token_stride, nhc.head_stride) == (8 * 512, 8 * 512, 512)


def test_deepseek_v32_packs_latent_and_indexer_pages_in_one_block():
    mla = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=656, dtype="uint8")
    idx = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=132, dtype="uint8")
    cfg = plan({"l0.attn": mla, "l0.idx": idx, "l1.attn": mla, "l1.idx": idx}, GiB, max_model_len=4096)
    assert len(cfg.groups) == 1 and cfg.groups[0].kind == "full"
    assert cfg.bytes_per_block == 100_864
    latent, indexer = cfg.tensors
    assert (latent.layers, latent.offset, latent.layer_stride, latent.block_stride, latent.row_bytes) == (
        ("l0.attn", "l1.attn"), 0, 41_984, 100_864, 656)  # fmt: skip
    assert (indexer.layers, indexer.offset, indexer.layer_stride, indexer.row_bytes) == (
        ("l0.idx", "l1.idx"), 83_968, 8_448, 132)  # fmt: skip
    # [MLA L0 | MLA L1 | IDX L0 | IDX L1]
    assert [latent.address(0, 0), latent.address(1, 0), indexer.address(0, 0), indexer.address(1, 0)] == [
        0, 41_984, 83_968, 92_416]  # fmt: skip


def test_summary_shows_groups_waste_capacity_and_all_full_figures():
    text = plan(gemma3_like(), 40 * GiB, **VLLM).summary()
    assert "group 0: sliding_window(1024), 9 layers, block 16 tokens, page 131,072 B" in text
    assert "group 6: full, 10 layers" in text and "model.layers.{5,11,17,23,29,35,41,47,53,59}" in text
    for line in (
        "Padding waste: 4.82%",
        "num_blocks: 32,768",
        "KV cache size: 334,916 tokens",
        "Maximum concurrency for 32,768 tokens per request: 10.22x",
        "All full attention: KV cache size: 84,560 tokens",
    ):
        assert line in text
    assert "vLLM's grouping: 7 groups" in plan(gemma3_like(), 40 * GiB, max_model_len=32_768).summary()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(grouping="greedy"), "grouping='greedy'"),
        (dict(layout="HBLNC"), "layout='HBLNC'"),
        (dict(max_model_len=0), "max_model_len=0"),
        (dict(max_groups=0), "max_groups=0"),
    ],
)
def test_bad_arguments_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan({"f": full()}, GiB, **{"max_model_len": 256, **kwargs})
    with pytest.raises(ValueError, match="layers is empty"):
        plan({}, GiB, max_model_len=256)
