"""What the example's Hugging Face models need from a `config.json`: `TextConfig.from_hf(config)`.

Two architectures are served: Gemma 3 (`gemma3_text`, and the text part of `gemma3`) and gpt-oss
(`gpt_oss`). Options the port does not implement are refused with an error that names them, so a
checkpoint is never served as a model it is not.

RoPE frequencies are computed as transformers computes them (float32, the same formulas), per
layer type: Gemma 3 gives sliding and full layers their own base, and full layers a linear
scaling; gpt-oss uses YaRN on every layer.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from jaxkv.planner.hf_config import text_fields

SUPPORTED = ("gemma3_text", "gemma3", "gpt_oss")
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Rope:
    """One layer type's rotary embedding: angle = position × inv_freq; cos and sin × `scaling`."""

    inv_freq: tuple[float, ...]  # [H / 2], float32 values
    scaling: float = 1.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TextConfig:
    """The text decoder of a checkpoint, as the example's model computes it (frozen, hashable)."""

    model_type: str  # "gemma3_text" (also for gemma3's text part) or "gpt_oss"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # per layer: "sliding_attention" or "full_attention"
    sliding_window: int
    rms_norm_eps: float
    sm_scale: float  # the attention logits' scale
    rope: tuple[tuple[str, Rope], ...]  # layer type -> Rope
    attention_bias: bool
    tie_word_embeddings: bool
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # gpt-oss's mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"config.json: {self.num_heads=} must be divisible by {self.num_kv_heads=}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"config.json: {self.num_experts_per_tok=} must not exceed {self.num_experts=}")

    @property
    def is_gemma(self) -> bool:
        return self.model_type == "gemma3_text"

    def rope_of(self, layer_idx: int) -> Rope:
        return dict(self.rope)[self.layer_types[layer_idx]]

    def window_of(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @classmethod
    def from_hf(cls, config: Mapping) -> TextConfig:
        """Reads a parsed `config.json`; raises ValueError naming what is missing or not supported."""
        model_type = config.get("model_type")
        if model_type not in SUPPORTED:
            raise ValueError(f"config.json has model_type={model_type!r}; the example serves {', '.join(SUPPORTED)}")
        fields = text_fields(config)  # with transformers' defaults for what the file leaves out
        if model_type == "gemma3":
            if "text_config" not in config:
                raise ValueError("config.json (model_type='gemma3') has no 'text_config'")
            # Gemma3ForConditionalGeneration applies no final logit softcap, whatever text_config says.
            return dataclasses.replace(_gemma3(_Fields(fields, "gemma3.text_config")), final_logit_softcapping=None)
        if model_type == "gemma3_text":
            return _gemma3(_Fields(fields, model_type))
        return _gpt_oss(_Fields(fields, model_type))


class _Fields:
    """Field access with errors that name the config and the field."""

    def __init__(self, fields: Mapping, where: str):
        self.fields, self.where = fields, where

    def __getitem__(self, key: str):
        if self.fields.get(key) is None:
            raise ValueError(f"config.json ({self.where}) has no {key!r}, which the model needs")
        return self.fields[key]

    def get(self, key: str, default=None):
        value = self.fields.get(key)
        return default if value is None else value

    def refuse(self, key: str, why: str, allowed=(None, False)):
        if self.fields.get(key) not in allowed:
            raise ValueError(f"config.json ({self.where}) sets {key}={self.fields[key]!r}: {why}")

    def common(self) -> dict:
        heads = self["num_attention_heads"]
        num_layers = self["num_hidden_layers"]
        return dict(
            vocab_size=self["vocab_size"],
            hidden_size=self["hidden_size"],
            intermediate_size=self["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=self.get("num_key_value_heads", heads),
            head_dim=self.get("head_dim") or self["hidden_size"] // heads,
            sliding_window=self["sliding_window"],
            rms_norm_eps=self.get("rms_norm_eps", 1e-6),
        )

    def layer_types(self, default) -> tuple[str, ...]:
        n = self["num_hidden_layers"]
        types = tuple(self.get("layer_types") or (default(i) for i in range(n)))
        if len(types) != n or not set(types) <= set(LAYER_TYPES):
            raise ValueError(
                f"config.json ({self.where}) has layer_types={list(types)}; expected one of {LAYER_TYPES} per layer "
                f"for its {n} layers"
            )
        return types


def default_inv_freq(head_dim: int, base: float) -> np.ndarray:
    """1 / base^(2i / H), i < H / 2, in float32 as transformers computes it."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    return (1.0 / (np.float32(base) ** exponent)).astype(np.float32)


def yarn_rope(head_dim: int, base: float, params: Mapping, max_position_embeddings: int) -> Rope:
    """YaRN: inverse frequencies blended between interpolation (/ factor) and extrapolation by a
    linear ramp over dimensions; cos and sin scaled by the attention factor."""
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ValueError(f"config.json's YaRN rope parameters {dict(params)} lack 'original_max_position_embeddings'")
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations):
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = np.float32(base) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = 1 - ramp  # the extrapolation's share
    inv_freq = (interpolation * (1 - keep) + extrapolation * keep).astype(np.float32)
    return Rope(inv_freq=tuple(inv_freq.tolist()), scaling=float(attention_factor))


def _gemma_rope(f: _Fields, head_dim: int) -> tuple[tuple[str, Rope], ...]:
    """Per layer type. transformers ≥ 5 writes `rope_parameters` per layer type; older configs
    (and the published Gemma 3 checkpoints) give rope_theta, rope_local_base_freq and rope_scaling."""
    params = f.get("rope_parameters")
    if params is None or "full_attention" not in params:
        params = {
            "full_attention": {
                "rope_type": "default",
                **(f.get("rope_scaling") or {}),
                "rope_theta": f.get("rope_theta", 1e6),
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": f.get("rope_local_base_freq", 1e4)},
        }
    out = []
    for layer_type in LAYER_TYPES:
        p = params.get(layer_type) or {"rope_type": "default"}
        kind = p.get("rope_type", p.get("type", "default"))
        inv_freq = default_inv_freq(head_dim, p.get("rope_theta", 1e6 if layer_type == "full_attention" else 1e4))
        if kind == "linear":
            inv_freq = (inv_freq / np.float32(p["factor"])).astype(np.float32)
        elif kind != "default":
            raise ValueError(
                f"config.json ({f.where}) gives {layer_type} layers rope_type={kind!r}; the Gemma 3 port supports "
                "'default' and 'linear'"
            )
        out.append((layer_type, Rope(inv_freq=tuple(inv_freq.tolist()))))
    return tuple(out)


def _gemma3(f: _Fields) -> TextConfig:
    f.refuse("use_bidirectional_attention", "bidirectional attention is not supported (causal decoding only)")
    f.refuse("attention_bias", "attention biases are not part of Gemma 3 and not supported")
    common = f.common()
    pattern = f.get("sliding_window_pattern", 6)
    activation = f.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"config.json ({f.where}) has hidden_activation={activation!r}; expected 'gelu_pytorch_tanh'")
    return TextConfig(
        model_type="gemma3_text",
        **common,
        layer_types=f.layer_types(lambda i: "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"),
        sm_scale=f.get("query_pre_attn_scalar", common["head_dim"]) ** -0.5,
        rope=_gemma_rope(f, common["head_dim"]),
        attention_bias=False,
        tie_word_embeddings=f.get("tie_word_embeddings", True),
        attn_logit_softcapping=f.get("attn_logit_softcapping"),
        final_logit_softcapping=f.get("final_logit_softcapping"),
    )


def _gpt_oss(f: _Fields) -> TextConfig:
    common = f.common()
    params = dict(f.get("rope_parameters") or f.get("rope_scaling") or {})
    params.setdefault("rope_theta", f.get("rope_theta", 150000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "yarn":
        rope = yarn_rope(common["head_dim"], params["rope_theta"], params, f.get("max_position_embeddings", 131072))
    elif kind == "default":
        rope = Rope(inv_freq=tuple(default_inv_freq(common["head_dim"], params["rope_theta"]).tolist()))
    else:
        raise ValueError(f"config.json ({f.where}) has rope_type={kind!r}; the gpt-oss port supports 'yarn', 'default'")
    if f.get("quantization_config") not in (None, {}) and f["quantization_config"].get("quant_method") != "mxfp4":
        raise ValueError(f"config.json ({f.where}) has quantization_config={f['quantization_config']!r}; only mxfp4")
    return TextConfig(
        model_type="gpt_oss",
        **common,
        layer_types=f.layer_types(lambda i: "sliding_attention" if i % 2 == 0 else "full_attention"),
        sm_scale=common["head_dim"] ** -0.5,
        rope=tuple((t, rope) for t in LAYER_TYPES),
        attention_bias=f.get("attention_bias", True),
        tie_word_embeddings=f.get("tie_word_embeddings", False),
        num_experts=f["num_local_experts"],
        num_experts_per_tok=f["num_experts_per_tok"],
        swiglu_limit=f.get("swiglu_limit", 7.0),
        swiglu_alpha=f.get("swiglu_alpha", 1.702),
    )
