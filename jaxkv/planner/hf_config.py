"""Layer specs from a Hugging Face `config.json`, for the model types users run.

`specs_from_hf_config(config_dict)` returns the mapping `plan()` takes: layer name →
spec, or → the name of the layer whose cache it reuses (KV sharing). Layer names
follow vLLM's: `model.layers.{i}.self_attn.attn` for attention,
`model.layers.{i}.linear_attn` for Qwen3-Next's linear-attention (state) layers,
`model.layers.{i}.self_attn.indexer.k_cache` for DeepSeek-V3.2's indexer cache.
Multimodal configs (gemma3, gemma3n, llama4) are read from their `text_config`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

from jaxkv.planner.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)

Layers = dict[str, KVCacheSpec | str]

DEFAULT_BLOCK_SIZE = 16
DEEPSEEK_SPARSE_MLA_BLOCK_SIZE = 64
"""DeepSeek-V3.2's sparse MLA kernels (FlashMLA) read 64-token blocks."""


_GEMMA3_TEXT = dict(
    vocab_size=262208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    sliding_window=4096,
    sliding_window_pattern=6,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    max_position_embeddings=131072,
)
TRANSFORMERS_DEFAULTS: dict[str, dict] = {
    "gemma3_text": _GEMMA3_TEXT,
    "gemma3": _GEMMA3_TEXT,
    "gpt_oss": dict(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=36,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        rms_norm_eps=1e-5,
        num_local_experts=128,
        num_experts_per_tok=4,
        swiglu_limit=7.0,
        attention_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=131072,
        rope_theta=150000.0,
        rope_scaling=dict(
            rope_type="yarn",
            factor=32.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=4096,
        ),
    ),
    "qwen3_next": dict(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
        partial_rotary_factor=0.25,
        full_attention_interval=4,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        norm_topk_prob=True,
        decoder_sparse_step=1,
    ),
}
"""transformers' config-class defaults of the fields read here (transformers 5.24). Published configs leave
out what equals them: google/gemma-3-4b-it's text_config names only its sizes, layer count, rope_scaling and
window."""


def text_fields(config_dict: Mapping) -> dict:
    """The text model's fields of a parsed `config.json`: its `text_config` (multimodal configs) or the config
    itself, with transformers' defaults (`TRANSFORMERS_DEFAULTS`) for the fields it leaves out."""
    text = config_dict.get("text_config") or config_dict
    if not isinstance(text, Mapping):
        raise ValueError(f"config.json: text_config={text!r} must be a JSON object of the text model's fields")
    return {**TRANSFORMERS_DEFAULTS.get(config_dict.get("model_type"), {}), **text}


def specs_from_hf_config(
    config_dict: Mapping, *, dtype="bfloat16", block_size: int | None = None, mamba_ssm_dtype=None
) -> Layers:
    """Layer name → spec (or shared layer's owner name) for a Hugging Face config.

    Args:
      config_dict: the parsed `config.json`.
      dtype: the KV cache dtype (name or numpy/JAX dtype). DeepSeek-V3.2 keeps its
        latent and indexer caches in their FP8-with-scales byte format whatever it is.
      block_size: tokens per block; None means 16 (64 for DeepSeek-V3.2). Qwen3-Next
        raises its attention block size to a multiple of it whose page covers one
        linear-attention state, and pads the state to that page, as vLLM does.
      mamba_ssm_dtype: the dtype of Qwen3-Next's recurrent state; None means `dtype` (vLLM's
        "auto"). transformers keeps that state in float32 whatever the weights: "float32" matches
        it (vLLM's `--mamba-ssm-cache-dtype float32`). The conv state keeps `dtype`.
    """
    if not isinstance(config_dict, Mapping):
        raise ValueError(f"config.json must be a JSON object of the model's fields, not a {type(config_dict).__name__}")
    if block_size is not None and (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0):
        raise ValueError(f"block_size={block_size!r} must be a positive integer (or None for the model's default)")
    model_type = config_dict.get("model_type")
    builder = _BUILDERS.get(model_type) if isinstance(model_type, str) else None
    if mamba_ssm_dtype is not None:
        if model_type != "qwen3_next":
            raise ValueError(
                f"mamba_ssm_dtype={mamba_ssm_dtype!r} given, but model_type={model_type!r} has no recurrent state; "
                "drop it"
            )
        builder = functools.partial(_qwen3_next, ssm_dtype=mamba_ssm_dtype)
    if builder is None:
        raise ValueError(
            f"model_type={model_type!r} is not supported by specs_from_hf_config; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}. For another model, describe its layers by hand and pass them "
            "to jaxkv.plan: {'model.layers.0.self_attn.attn': jaxkv.FullAttentionSpec(block_size=16, "
            "num_kv_heads=8, head_size=128, dtype='bfloat16'), 'model.layers.1.self_attn.attn': "
            "jaxkv.SlidingWindowSpec(..., sliding_window=4096), ...}"
        )
    return builder(_Config(text_fields(config_dict), model_type), dtype, block_size)


class _Config:
    """Field access with errors that name the model type and the missing field."""

    def __init__(self, fields: Mapping, model_type: str):
        self.fields = fields
        self.model_type = model_type

    def __getitem__(self, key: str):
        if self.fields.get(key) is None:
            raise ValueError(
                f"config.json (model_type={self.model_type!r}) has no {key!r}, which this model type needs"
            )
        return self.fields[key]

    def __contains__(self, key: str) -> bool:
        return self.fields.get(key) is not None

    def get(self, key: str, default=None):
        value = self.fields.get(key)
        return default if value is None else value

    def count(self, key: str, default: int | None = None, *, low: int = 1) -> int:
        """The integer field `key`, at least `low`; `default` when the field is absent or null (None: required)."""
        value = self[key] if default is None else self.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            kind = "a positive integer" if low == 1 else f"an integer ≥ {low}"
            raise ValueError(f"config.json: {key}={value!r} must be {kind}")
        return value

    @property
    def num_layers(self) -> int:
        return self.count("num_hidden_layers")

    def attention(self, dtype, block_size: int) -> dict:
        """Spec fields of a standard attention layer; head_dim defaults to hidden_size // num_attention_heads."""
        heads = self.count("num_attention_heads")
        head_dim = self.count("head_dim") if "head_dim" in self else self.count("hidden_size") // heads
        return dict(
            block_size=block_size,
            num_kv_heads=self.count("num_key_value_heads", heads),
            head_size=head_dim,
            dtype=dtype,
        )

    def per_layer(self, key: str, default: Callable[[int], object]) -> list:
        """The list field `key` (`layer_types`, `no_rope_layers`) when given, else `default(i)` for each layer."""
        values = self.get(key) or [default(i) for i in range(self.num_layers)]
        if not isinstance(values, list) or len(values) != self.num_layers:
            given = f"{len(values)} {key}" if isinstance(values, list) else f"{key}={values!r}"
            raise ValueError(
                f"config.json (model_type={self.model_type!r}) has {given} for {self.num_layers} layers; "
                "give a list of one per layer"
            )
        return values


def _name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _full_or_sliding(cfg: _Config, types: list[str], dtype, block_size: int) -> Layers:
    attn = cfg.attention(dtype, block_size)
    window = cfg.count("sliding_window") if "sliding_window" in cfg else None
    out: Layers = {}
    for i, t in enumerate(types):
        if t == "sliding_attention" and window is not None:
            out[_name(i)] = SlidingWindowSpec(**attn, sliding_window=window)
        elif t in ("sliding_attention", "full_attention"):
            out[_name(i)] = FullAttentionSpec(**attn)
        else:
            raise ValueError(f"layer {i} has layer type {t!r}; expected 'full_attention' or 'sliding_attention'")
    return out


def _gemma3(cfg: _Config, dtype, block_size) -> Layers:
    pattern = cfg.count("sliding_window_pattern", 6)
    types = cfg.per_layer("layer_types", lambda i: "full_attention" if (i + 1) % pattern == 0 else "sliding_attention")
    return _full_or_sliding(cfg, types, dtype, block_size or DEFAULT_BLOCK_SIZE)


def _gpt_oss(cfg: _Config, dtype, block_size) -> Layers:
    types = cfg.per_layer("layer_types", lambda i: "sliding_attention" if i % 2 == 0 else "full_attention")
    return _full_or_sliding(cfg, types, dtype, block_size or DEFAULT_BLOCK_SIZE)


def _mistral(cfg: _Config, dtype, block_size) -> Layers:
    kind = "sliding_attention" if cfg.get("sliding_window") is not None else "full_attention"
    return _full_or_sliding(cfg, cfg.per_layer("layer_types", lambda i: kind), dtype, block_size or DEFAULT_BLOCK_SIZE)


def _llama(cfg: _Config, dtype, block_size) -> Layers:
    attn = cfg.attention(dtype, block_size or DEFAULT_BLOCK_SIZE)
    return {_name(i): FullAttentionSpec(**attn) for i in range(cfg.num_layers)}


def _llama4(cfg: _Config, dtype, block_size) -> Layers:
    """Layers with RoPE (no_rope_layers[i] == 1) attend within `attention_chunk_size`; NoPE layers are global."""
    attn = cfg.attention(dtype, block_size or DEFAULT_BLOCK_SIZE)
    interval = cfg.count("no_rope_layer_interval", 4)
    rope = cfg.per_layer("no_rope_layers", lambda i: int((i + 1) % interval != 0))
    chunk = cfg.count("attention_chunk_size") if "attention_chunk_size" in cfg else None
    return {
        _name(i): ChunkedLocalAttentionSpec(**attn, attention_chunk_size=chunk)
        if rope[i] and chunk
        else FullAttentionSpec(**attn)
        for i in range(cfg.num_layers)
    }


def _qwen3_next(cfg: _Config, dtype, block_size, ssm_dtype=None) -> Layers:
    """Gated DeltaNet layers hold a conv state and a recurrent state (of `ssm_dtype`, default `dtype`); every
    4th layer is full attention."""
    interval = cfg.count("full_attention_interval", 4)
    types = cfg.per_layer("layer_types", lambda i: "full_attention" if (i + 1) % interval == 0 else "linear_attention")
    num_k, num_v = cfg.count("linear_num_key_heads"), cfg.count("linear_num_value_heads")
    head_k, head_v = cfg.count("linear_key_head_dim"), cfg.count("linear_value_head_dim")
    conv_dim = 2 * num_k * head_k + num_v * head_v
    state = MambaSpec(
        block_size=1,
        shapes=((cfg.count("linear_conv_kernel_dim", low=2) - 1, conv_dim), (num_v, head_v, head_k)),
        dtypes=(dtype, dtype if ssm_dtype is None else ssm_dtype),
    )
    align = block_size or DEFAULT_BLOCK_SIZE
    one_token = FullAttentionSpec(**cfg.attention(dtype, 1)).page_size_bytes
    attn_block = align * cdiv(state.page_size_bytes, align * one_token)
    attn = FullAttentionSpec(**cfg.attention(dtype, attn_block))
    padded = attn.page_size_bytes if attn.page_size_bytes != state.page_size_bytes else None
    state = MambaSpec(block_size=attn_block, shapes=state.shapes, dtypes=state.dtypes, page_size_padded=padded)
    out: Layers = {}
    for i, t in enumerate(types):
        if t == "full_attention":
            out[_name(i)] = attn
        elif t == "linear_attention":
            out[f"model.layers.{i}.linear_attn"] = state
        else:
            raise ValueError(f"layer {i} has layer type {t!r}; expected 'full_attention' or 'linear_attention'")
    return out


def _deepseek_v32(cfg: _Config, dtype, block_size) -> Layers:
    """MLA latent in FP8 with scales (DeepSeek's fp8_ds_mla: 512 FP8 + 4 float32 scales + 64 bf16 RoPE
    = 656 B/token) and the indexer's FP8 key with one float32 scale per 128 (132 B/token), one block table."""
    block_size = block_size or DEEPSEEK_SPARSE_MLA_BLOCK_SIZE
    rank = cfg.count("kv_lora_rank")
    latent = rank + rank // 128 * 4 + cfg.count("qk_rope_head_dim") * 2
    index_dim = cfg.count("index_head_dim")
    indexer = index_dim + index_dim // 128 * 4
    mla = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=latent, dtype="uint8")
    idx = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=indexer, dtype="uint8")
    out: Layers = {}
    for i in range(cfg.num_layers):
        out[_name(i)] = mla
        out[f"model.layers.{i}.self_attn.indexer.k_cache"] = idx
    return out


def _gemma3n(cfg: _Config, dtype, block_size) -> Layers:
    """The last `num_kv_shared_layers` layers reuse the cache of the last earlier layer of their type."""
    types = cfg.per_layer("layer_types", lambda i: "full_attention" if (i + 1) % 5 == 0 else "sliding_attention")
    out = _full_or_sliding(cfg, types, dtype, block_size or DEFAULT_BLOCK_SIZE)
    first_shared = cfg.num_layers - cfg.count("num_kv_shared_layers", 0, low=0)
    for i in range(first_shared, cfg.num_layers):
        owners = [j for j in range(first_shared) if types[j] == types[i]]
        if not owners:
            raise ValueError(f"shared layer {i} ({types[i]}) has no earlier layer of its type to share with")
        out[_name(i)] = _name(owners[-1])
    return out


_BUILDERS = {
    "deepseek_v32": _deepseek_v32,
    "gemma3": _gemma3,
    "gemma3_text": _gemma3,
    "gemma3n": _gemma3n,
    "gemma3n_text": _gemma3n,
    "gpt_oss": _gpt_oss,
    "llama": _llama,
    "llama4": _llama4,
    "llama4_text": _llama4,
    "ministral": _mistral,
    "mistral": _mistral,
    "qwen3_next": _qwen3_next,
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_BUILDERS))
