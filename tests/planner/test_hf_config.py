"""specs_from_hf_config on the sample config.json files (written from public model cards)."""

import collections
import json
import pathlib
import re

import pytest

from jaxkv import (
    SUPPORTED_MODEL_TYPES,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    plan,
    specs_from_hf_config,
)

GiB = 1 << 30
CONFIGS = pathlib.Path(__file__).parents[1] / "configs"


def load(name):
    with open(CONFIGS / f"{name}.json") as f:
        return json.load(f)


def kinds(layers):
    """Count of (spec class, window) over layers that own a cache."""
    return collections.Counter(
        (type(s).__name__, getattr(s, "sliding_window", None) or getattr(s, "attention_chunk_size", None))
        for s in layers.values()
        if not isinstance(s, str)
    )


def test_gemma3_4b_config_leaves_transformers_defaults_out():
    # The published text_config names only sizes, layer count, rope_scaling and window: heads, head_dim
    # and the layer pattern are transformers' defaults (8 heads, 4 KV heads, head_dim 256, every sixth full).
    layers = specs_from_hf_config(load("gemma3_4b_it"))
    assert kinds(layers) == {("SlidingWindowSpec", 1024): 29, ("FullAttentionSpec", None): 5}
    spec = layers["model.layers.5.self_attn.attn"]
    assert (type(spec), spec.num_kv_heads, spec.head_size) == (FullAttentionSpec, 4, 256)


def test_gemma3_27b_every_sixth_layer_is_full():
    layers = specs_from_hf_config(load("gemma3_27b"))
    assert kinds(layers) == {("SlidingWindowSpec", 1024): 52, ("FullAttentionSpec", None): 10}
    assert [i for i, s in enumerate(layers.values()) if isinstance(s, FullAttentionSpec)] == list(range(5, 62, 6))
    spec = layers["model.layers.0.self_attn.attn"]
    assert (spec.block_size, spec.num_kv_heads, spec.head_size, spec.page_size_bytes) == (16, 16, 128, 131_072)


def test_gemma3_text_reads_layer_types():
    types = ["sliding_attention", "full_attention"] * 2
    config = {"model_type": "gemma3_text", "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 512,
              "sliding_window": 512, "layer_types": types}  # fmt: skip
    layers = specs_from_hf_config(config)
    assert [type(s) for s in layers.values()] == [SlidingWindowSpec, FullAttentionSpec] * 2
    assert layers["model.layers.0.self_attn.attn"].head_size == 256  # transformers' default head_dim, not 512 // 4


def test_gpt_oss_alternates_sliding_and_full():
    layers = specs_from_hf_config(load("gpt_oss_120b"))
    assert kinds(layers) == {("SlidingWindowSpec", 128): 18, ("FullAttentionSpec", None): 18}
    assert isinstance(layers["model.layers.0.self_attn.attn"], SlidingWindowSpec)
    assert layers["model.layers.1.self_attn.attn"].page_size_bytes == 16 * 8 * 128 * 2


def test_llama4_rope_layers_are_chunked_and_nope_layers_global():
    layers = specs_from_hf_config(load("llama4_scout"))
    assert kinds(layers) == {("ChunkedLocalAttentionSpec", 8192): 36, ("FullAttentionSpec", None): 12}
    assert [i for i, s in enumerate(layers.values()) if isinstance(s, FullAttentionSpec)] == list(range(3, 48, 4))
    text = {**load("llama4_scout")["text_config"], "num_hidden_layers": 3, "no_rope_layers": [0, 1, 1]}
    explicit = specs_from_hf_config({"model_type": "llama4", "text_config": text})
    assert [type(s) for s in explicit.values()] == [
        FullAttentionSpec,
        ChunkedLocalAttentionSpec,
        ChunkedLocalAttentionSpec,
    ]


def test_mistral_and_ministral():
    assert kinds(specs_from_hf_config(load("mistral_7b"))) == {("SlidingWindowSpec", 4096): 32}
    no_window = {**load("mistral_7b"), "sliding_window": None}
    assert kinds(specs_from_hf_config(no_window)) == {("FullAttentionSpec", None): 32}
    assert kinds(specs_from_hf_config(load("ministral_8b"))) == {
        ("SlidingWindowSpec", 32768): 27, ("FullAttentionSpec", None): 9}  # fmt: skip


def test_qwen3_next_state_layers_beside_full_attention_share_one_page():
    layers = specs_from_hf_config(load("qwen3_next_80b"))
    assert kinds(layers) == {("MambaSpec", None): 36, ("FullAttentionSpec", None): 12}
    state, attn = layers["model.layers.0.linear_attn"], layers["model.layers.3.self_attn.attn"]
    # Conv state (3, 2·16·128 + 32·128) and recurrent state (32, 128, 128), bfloat16.
    assert state.real_page_size_bytes == (3 * 8192 + 32 * 128 * 128) * 2 == 1_097_728
    # Attention block: the smallest multiple of 16 whose page (2 heads × 512 B × 2) covers the state.
    assert attn.block_size == 544 and attn.page_size_bytes == 544 * 2048 == state.page_size_bytes
    cfg = plan(layers, 40 * GiB, max_model_len=32_768, grouping="vllm")
    assert [(g.kind, len(g.layer_names)) for g in cfg.groups] == [("mamba", 12)] * 3 + [("full", 12)]
    assert cfg.blocks_per_request == (1, 1, 1, 61)


def test_qwen3_next_recurrent_state_in_float32_beside_bfloat16():
    # transformers keeps the recurrent state in float32 (vLLM: --mamba-ssm-cache-dtype float32): the state page
    # grows to (3 · 8192 · 2 + 32 · 128 · 128 · 4) B, and the attention block with it.
    layers = specs_from_hf_config(load("qwen3_next_80b"), mamba_ssm_dtype="float32")
    state, attn = layers["model.layers.0.linear_attn"], layers["model.layers.3.self_attn.attn"]
    assert state.dtypes == ("bfloat16", "float32") and attn.dtype == "bfloat16"
    assert state.real_page_size_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 4 == 2_146_304
    assert attn.block_size == 1056 and attn.page_size_bytes == 1056 * 2048 == state.page_size_bytes
    with pytest.raises(ValueError, match="model_type='llama' has no recurrent state"):
        specs_from_hf_config(load("llama3_8b"), mamba_ssm_dtype="float32")


def test_deepseek_v32_latent_and_indexer_share_one_block_table():
    layers = specs_from_hf_config(load("deepseek_v32"))
    mla, idx = layers["model.layers.0.self_attn.attn"], layers["model.layers.0.self_attn.indexer.k_cache"]
    assert all(isinstance(s, MLAAttentionSpec) for s in layers.values()) and len(layers) == 122
    assert (mla.row_bytes, idx.row_bytes, mla.block_size) == (656, 132, 64)
    assert (mla.page_size_bytes, idx.page_size_bytes) == (41_984, 8_448)
    cfg = plan(layers, 40 * GiB, max_model_len=32_768)
    assert len(cfg.groups) == 1 and cfg.bytes_per_block == 61 * (41_984 + 8_448)
    latent, indexer = cfg.tensors
    assert (latent.offset, latent.layer_stride, latent.block_stride) == (0, 41_984, cfg.bytes_per_block)
    assert (indexer.offset, indexer.layer_stride, len(indexer.layers)) == (61 * 41_984, 8_448, 61)


def test_gemma3n_shared_layers_reuse_the_last_earlier_layer_of_their_type():
    layers = specs_from_hf_config(load("gemma3n_e2b"))
    shared = {name: owner for name, owner in layers.items() if isinstance(owner, str)}
    assert len(shared) == 10
    assert shared["model.layers.20.self_attn.attn"] == "model.layers.18.self_attn.attn"  # sliding
    assert shared["model.layers.24.self_attn.attn"] == "model.layers.19.self_attn.attn"  # full
    cfg = plan(layers, 4 * GiB, max_model_len=32_768)
    owners_only = plan({k: v for k, v in layers.items() if k not in shared}, 4 * GiB, max_model_len=32_768)
    assert (cfg.bytes_per_block, cfg.num_blocks) == (owners_only.bytes_per_block, owners_only.num_blocks)


def test_llama_is_plain_full_attention_and_dtype_and_block_size_apply():
    layers = specs_from_hf_config(load("llama3_8b"), dtype="float32", block_size=32)
    assert kinds(layers) == {("FullAttentionSpec", None): 32}
    spec = layers["model.layers.0.self_attn.attn"]
    assert (spec.dtype, spec.block_size, spec.page_size_bytes) == ("float32", 32, 32 * 8 * 256 * 4)


def test_unknown_model_type_names_the_supported_ones_and_the_manual_route():
    with pytest.raises(ValueError) as e:
        specs_from_hf_config({"model_type": "bert"})
    assert "model_type='bert'" in str(e.value) and "jaxkv.plan" in str(e.value)
    assert all(t in str(e.value) for t in SUPPORTED_MODEL_TYPES)


def test_a_missing_field_is_named():
    with pytest.raises(ValueError, match="has no 'num_hidden_layers'"):
        specs_from_hf_config({"model_type": "llama", "num_attention_heads": 8, "hidden_size": 1024})
    with pytest.raises(ValueError, match="3 layer_types for 4 layers"):
        specs_from_hf_config({"model_type": "gpt_oss", "num_hidden_layers": 4, "num_attention_heads": 8,
                              "hidden_size": 1024, "layer_types": ["full_attention"] * 3})  # fmt: skip


@pytest.mark.parametrize(
    "name, changes, message",
    [
        (
            "llama3_8b",
            {"num_hidden_layers": "sixty"},
            "config.json: num_hidden_layers='sixty' must be a positive integer",
        ),
        ("llama3_8b", {"num_hidden_layers": 2.5}, "config.json: num_hidden_layers=2.5 must be a positive"),
        ("llama3_8b", {"num_attention_heads": "32"}, "config.json: num_attention_heads='32' must be a positive"),
        ("llama3_8b", {"head_dim": 0}, "config.json: head_dim=0 must be a positive integer"),
        ("llama3_8b", {"head_dim": -64}, "config.json: head_dim=-64 must be a positive"),
        ("llama3_8b", {"num_key_value_heads": True}, "config.json: num_key_value_heads=True must be a positive"),
        ("gemma3_27b", {"text_config": [1]}, "config.json: text_config=[1] must be a JSON object"),
        ("gemma3_27b", {"sliding_window_pattern": 0}, "config.json: sliding_window_pattern=0 must be a positive"),
        ("qwen3_next_80b", {"full_attention_interval": 0}, "config.json: full_attention_interval=0 must be a positive"),
        (
            "qwen3_next_80b",
            {"linear_conv_kernel_dim": 1},
            "config.json: linear_conv_kernel_dim=1 must be an integer ≥ 2",
        ),
        ("gemma3n_e2b", {"num_kv_shared_layers": -1}, "config.json: num_kv_shared_layers=-1 must be an integer ≥ 0"),
        ("llama4_scout", {"no_rope_layers": [1, 0]}, "has 2 no_rope_layers for 48 layers"),
    ],
)
def test_a_wrong_typed_or_non_positive_field_is_named(name, changes, message):
    config = load(name)
    text = config if "text_config" in changes else config.get("text_config", config)  # multimodal: the text model's
    text.update(changes)
    with pytest.raises(ValueError, match=re.escape(message)):
        specs_from_hf_config(config)


def test_block_size_zero_is_refused_and_a_null_head_dim_keeps_its_default():
    with pytest.raises(ValueError, match=re.escape("block_size=0 must be a positive integer")):
        specs_from_hf_config(load("llama3_8b"), block_size=0)
    with pytest.raises(ValueError, match="config.json must be a JSON object of the model's fields, not a list"):
        specs_from_hf_config([1, 2])
    spec = specs_from_hf_config({**load("llama3_8b"), "head_dim": None})["model.layers.0.self_attn.attn"]
    assert spec.head_size == 4096 // 32  # hidden_size // num_attention_heads
