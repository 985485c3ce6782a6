"""Gemma 3 and gpt-oss text decoders in flax nnx, computing what transformers computes.

Dimensions: T tokens of the step, S sequence length (dense), D hidden size, F intermediate size,
N query heads, K KV heads, H head size, V vocabulary, E experts, k experts per token.

Parameters keep the checkpoint's names and layouts (`q_proj.weight` is [out, in], as PyTorch
stores it), so `checkpoint.load_model` maps every tensor by name. The two passes are those of
examples/model.py: `forward_dense` (no cache, explicit masks: the ground truth for `--check`) and
`forward_paged` (each layer's K/V go through `jaxkv.attend` with the step's metadata; the layer
names are those of `jaxkv.specs_from_hf_config`, so the plan and the model agree on every layer's
kind and window).

Where the math departs from the obvious, it follows transformers:
- Gemma's RMSNorm scales by (1 + w), computed in float32, then cast back;
  gpt-oss's multiplies by w in float32 before the cast.
- Gemma multiplies the embedding by sqrt(D) cast to the weight dtype first (bf16: sqrt(2560) is 50.5).
- Gemma's attention scale is query_pre_attn_scalar ** −0.5, not H ** −0.5.
- RoPE rotates halves (not pairs); cos and sin are computed in float32, scaled (YaRN) and then
  cast to the activations' dtype.
- gpt-oss's sinks: one logit per query head in the softmax's denominator only, never masked.
- gpt-oss's experts: gate and up are interleaved columns of gate_up_proj; gate is clamped above at
  the limit, up on both sides; out = (up + 1) · gate · sigmoid(α · gate); the router's softmax runs
  over the top-k logits only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hf_config import TextConfig
from jax import lax
from sharding import kernels

import jaxkv


def layer_name(layer_idx: int) -> str:
    """The attention layer's name in the plan (`jaxkv.specs_from_hf_config`'s)."""
    return f"model.layers.{layer_idx}.self_attn.attn"


class Linear(nnx.Module):
    """y = x Wᵀ + b with W [out, in], as PyTorch stores it."""

    def __init__(self, weight, bias=None):
        self.weight = nnx.Param(jnp.asarray(weight))
        self.bias = None if bias is None else nnx.Param(jnp.asarray(bias))

    def __call__(self, x):
        # float32 accumulation and one rounding, as PyTorch's bf16 matmul
        y = jnp.einsum("...i,oi->...o", x, self.weight[...], preferred_element_type=jnp.float32)
        return (y if self.bias is None else y + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    """x / rms(x) · (offset + w), in float32, cast back to x's dtype (Gemma: offset 1; gpt-oss: 0)."""

    def __init__(self, weight, eps: float, offset: float):
        self.weight = nnx.Param(jnp.asarray(weight))
        self.eps, self.offset = eps, offset

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, inv_freq, scaling: float) -> jax.Array:
    """x [T, N, H], positions [T] -> x rotated by position, halves rotated against each other."""
    angle = positions[:, None, None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [T, 1, H/2]
    cos, sin = (jnp.cos(angle) * scaling).astype(x.dtype), (jnp.sin(angle) * scaling).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def dense_attention(q, k, v, *, sm_scale, window, soft_cap, sinks):
    """q [S, N, H], k, v [S, K, H] -> [S, N, H]: causal, windowed, soft-capped, with sinks; no cache."""
    s, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.reshape(s, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("SKGH,TKH->KGST", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        logits = jnp.tanh(logits / soft_cap) * soft_cap
    pos = jnp.arange(s)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[:, None] - window < pos[None, :]
    logits = jnp.where(visible, logits, -jnp.inf)
    if sinks is not None:  # one more logit column per query head, dropped after the softmax
        sink = jnp.broadcast_to(sinks.reshape(num_kv_heads, -1, 1, 1).astype(jnp.float32), (*logits.shape[:3], 1))
        probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    else:
        probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("KGST,TKH->SKGH", probs.astype(v.dtype), v).reshape(s, num_heads, head_dim)


class Attention(nnx.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, w):
        """`w(name)` gives the tensor `model.layers.{i}.self_attn.{name}`."""
        self.cfg, self.name = cfg, layer_name(layer_idx)
        self.window = cfg.window_of(layer_idx)
        self.rope_cfg = cfg.rope_of(layer_idx)
        n, k, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        bias = cfg.attention_bias
        self.q_proj = Linear(w("q_proj.weight", (n * h, d)), w("q_proj.bias", (n * h,)) if bias else None)
        self.k_proj = Linear(w("k_proj.weight", (k * h, d)), w("k_proj.bias", (k * h,)) if bias else None)
        self.v_proj = Linear(w("v_proj.weight", (k * h, d)), w("v_proj.bias", (k * h,)) if bias else None)
        self.o_proj = Linear(w("o_proj.weight", (d, n * h)), w("o_proj.bias", (d,)) if bias else None)
        if cfg.is_gemma:  # per-head norms of q and k, before RoPE
            self.q_norm = RMSNorm(w("q_norm.weight", (h,)), cfg.rms_norm_eps, 1.0)
            self.k_norm = RMSNorm(w("k_norm.weight", (h,)), cfg.rms_norm_eps, 1.0)
            self.sinks = None
        else:
            self.sinks = nnx.Param(jnp.asarray(w("sinks", (n,))))

    def project(self, x, positions):
        """x [T, D] -> q [T, N, H], k [T, K, H], v [T, K, H] (normed, rotated)."""
        cfg = self.cfg
        q = self.q_proj(x).reshape(-1, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.is_gemma:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq, scaling = self.rope_cfg.inv_freq, self.rope_cfg.scaling
        return rope(q, positions, inv_freq, scaling), rope(k, positions, inv_freq, scaling), v

    def _sinks(self):
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

    def dense(self, x):
        q, k, v = self.project(x, jnp.arange(x.shape[0]))
        cfg = self.cfg
        out = dense_attention(
            q, k, v, sm_scale=cfg.sm_scale, window=self.window, soft_cap=cfg.attn_logit_softcapping, sinks=self._sinks()
        )
        return self.o_proj(out.reshape(x.shape[0], -1))

    def paged(self, x, cache, meta: jaxkv.StepMetadata, mesh=None):
        q, k, v = self.project(x, meta.positions)
        out, cache = jaxkv.attend(
            q,
            k,
            v,
            cache,
            meta,
            layer=self.name,
            sm_scale=self.cfg.sm_scale,
            logits_soft_cap=self.cfg.attn_logit_softcapping,
            sinks=self._sinks(),
            kernels=kernels(mesh),
        )
        return self.o_proj(out.astype(x.dtype).reshape(x.shape[0], -1)), cache


class GatedMLP(nnx.Module):
    """Gemma: down(gelu_tanh(gate(x)) · up(x))."""

    def __init__(self, cfg: TextConfig, w):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(w("gate_proj.weight", (f, d)))
        self.up_proj = Linear(w("up_proj.weight", (f, d)))
        self.down_proj = Linear(w("down_proj.weight", (d, f)))

    def __call__(self, x):
        return self.down_proj(jax.nn.gelu(self.gate_proj(x), approximate=True) * self.up_proj(x))


class Experts(nnx.Module):
    """gpt-oss's mixture of experts: top-k routing, each token through its k experts (grouped by
    expert with `lax.ragged_dot`), outputs summed with the router's weights."""

    def __init__(self, cfg: TextConfig, w):
        d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
        self.cfg = cfg
        self.router = Linear(w("router.weight", (e, d)), w("router.bias", (e,)))
        self.gate_up_proj = nnx.Param(jnp.asarray(w("experts.gate_up_proj", (e, d, 2 * f))))
        self.gate_up_proj_bias = nnx.Param(jnp.asarray(w("experts.gate_up_proj_bias", (e, 2 * f))))
        self.down_proj = nnx.Param(jnp.asarray(w("experts.down_proj", (e, f, d))))
        self.down_proj_bias = nnx.Param(jnp.asarray(w("experts.down_proj_bias", (e, d))))

    def __call__(self, x):
        """x [T, D] -> [T, D]."""
        cfg = self.cfg
        k = cfg.num_experts_per_tok
        top_logits, top_idx = lax.top_k(self.router(x), k)  # [T, k]
        weights = jax.nn.softmax(top_logits, axis=-1)  # over the chosen experts only
        expert = top_idx.reshape(-1)  # [T k]
        order = jnp.argsort(expert, stable=True)
        token = order // k  # the token of each (token, choice), grouped by expert
        sizes = jnp.bincount(expert, length=cfg.num_experts).astype(jnp.int32)
        chosen = expert[order]
        gate_up = lax.ragged_dot(x[token], self.gate_up_proj[...], sizes) + self.gate_up_proj_bias[...][chosen]
        gate = jnp.minimum(gate_up[:, ::2], cfg.swiglu_limit)
        up = jnp.clip(gate_up[:, 1::2], -cfg.swiglu_limit, cfg.swiglu_limit)
        glu = gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha)
        out = lax.ragged_dot((up + 1) * glu, self.down_proj[...], sizes) + self.down_proj_bias[...][chosen]
        out = out * weights.reshape(-1)[order][:, None]
        return jnp.zeros_like(x).at[token].add(out.astype(x.dtype))


class Block(nnx.Module):
    def __init__(self, cfg: TextConfig, layer_idx: int, w):
        """`w(name, shape)` gives the tensor `model.layers.{layer_idx}.{name}`."""
        eps, offset = cfg.rms_norm_eps, 1.0 if cfg.is_gemma else 0.0
        d = cfg.hidden_size

        def norm(name):
            return RMSNorm(w(f"{name}.weight", (d,)), eps, offset)

        self.self_attn = Attention(cfg, layer_idx, lambda name, shape: w(f"self_attn.{name}", shape))
        self.input_layernorm = norm("input_layernorm")
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.is_gemma = cfg.is_gemma
        if cfg.is_gemma:  # Gemma: norms before and after both the attention and the MLP
            self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
            self.post_feedforward_layernorm = norm("post_feedforward_layernorm")
            self.mlp = GatedMLP(cfg, lambda name, shape: w(f"mlp.{name}", shape))
        else:  # gpt-oss: post_attention_layernorm is the MLP's input norm
            self.mlp = Experts(cfg, lambda name, shape: w(f"mlp.{name}", shape))

    def residual_attn(self, x, attn_out):
        if self.is_gemma:
            return x + self.post_attention_layernorm(attn_out)
        return x + attn_out

    def residual_mlp(self, x):
        if self.is_gemma:
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nnx.Module):
    """A Gemma 3 or gpt-oss text decoder from a checkpoint's tensors (`checkpoint.load_model`)."""

    def __init__(self, cfg: TextConfig, w):
        """`w(name, shape)` gives the checkpoint tensor `name` (text model names, e.g.
        `model.layers.0.self_attn.q_proj.weight`), checked against `shape`."""
        self.cfg = cfg
        v, d = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = nnx.Param(jnp.asarray(w("model.embed_tokens.weight", (v, d))))
        self.layers = nnx.List(
            [
                Block(cfg, i, lambda name, shape, i=i: w(f"model.layers.{i}.{name}", shape))
                for i in range(cfg.num_layers)
            ]
        )
        self.norm = RMSNorm(w("model.norm.weight", (d,)), cfg.rms_norm_eps, 1.0 if cfg.is_gemma else 0.0)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(jnp.asarray(w("lm_head.weight", (v, d))))

    def embed(self, tokens):
        table = self.embed_tokens[...]
        x = table[tokens]
        if self.cfg.is_gemma:  # the scale is cast to the weight dtype before the product
            x = x * jnp.asarray(np.sqrt(self.cfg.hidden_size), jnp.float32).astype(table.dtype)
        return x

    def logits(self, x):
        head = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
        logits = jnp.einsum("TD,VD->TV", self.norm(x), head).astype(jnp.float32)
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else jnp.tanh(logits / cap) * cap

    def forward_dense(self, tokens: jax.Array) -> jax.Array:
        """tokens [S] -> logits [S, V], with no cache."""
        x = self.embed(tokens)
        for block in self.layers:
            x = block.residual_attn(x, block.self_attn.dense(block.input_layernorm(x)))
            x = block.residual_mlp(x)
        return self.logits(x)

    def forward_paged(self, tokens, cache, meta: jaxkv.StepMetadata, mesh=None, num_layers=None):
        """tokens [T] (packed as `meta` packs them), cache [B, L, K, N, 2H] -> (logits [T, V], cache')."""
        x = self.embed(tokens)
        for block in self.layers[:num_layers]:  # the first `num_layers` and the head: a draft model
            h, cache = block.self_attn.paged(block.input_layernorm(x), cache, meta, mesh)
            x = block.residual_mlp(block.residual_attn(x, h))
        return self.logits(x), cache
