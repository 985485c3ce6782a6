"""Qwen3-Next (`qwen3_next`) in flax nnx, computing what transformers computes: a hybrid of Gated DeltaNet layers
(gated_deltanet.py) and gated full attention, every layer's MLP a mixture of experts with a shared expert.

Dimensions: T tokens of the step, S cache length, D hidden size, N query heads, K KV heads, H head size, R rotated
dims (H · partial_rotary_factor), V vocabulary, E experts, k experts per token, F expert intermediate size.

Parameters keep the checkpoint's names (`checkpoint.load_model`), except the routed experts: the checkpoint stores
`mlp.experts.{j}.{gate,up,down}_proj.weight` per expert; the model stacks them, as transformers does, into
`mlp.experts.gate_up_proj` and `mlp.experts.down_proj` (here in the x @ w layout `lax.ragged_dot` takes).

Passes: `forward_dense` (no cache); `forward_chunk` (a chunk of one request from a cache that holds, per
linear-attention layer, its conv and recurrent states, and per attention layer a contiguous K/V buffer: the
shapes the paged pool holds, without the pool); `forward_paged` (a ragged batch through jaxkv's pool, see
`paged_linear_attention`). One-token chunks decode with the recurrent rule.

In the pool (a plan of `jaxkv.specs_from_hf_config`: one state group per linear-attention layer, one
full-attention group, all of one block size b, held as a byte buffer) a request with n computed tokens keeps
a layer's state in the block of its last token, table index (n − 1) // b. A step of k tokens reads the state
at index (n − 1) // b (zeros when n = 0) and writes the state after its tokens at (n + k − 1) // b: the same
block, or the fresh one the manager gave. After a prefix hit of h tokens the table holds, at (h − 1) // b, the
cached block of the state after h tokens (read-only) or a fresh block to which the caller copied it
(`KVCacheManager.take_block_copies`, `jaxkv.copy_blocks`) before the step.

Where the math departs from the obvious, it follows transformers:
- Qwen3-Next's RMSNorm scales by (1 + w) in float32 (the weights are stored zero-centred), q_norm and k_norm too;
  the gated norm inside the linear attention scales by w.
- q_proj gives, per head, the query (H) then an output gate (H); attention's output is multiplied by
  sigmoid(gate) before o_proj. The attention scale is H ** −0.5.
- RoPE rotates the first R dims of each head only (halves of those R against each other); the rest pass.
- the router's softmax runs over all E experts (float32), the top k are renormalised to sum to 1
  (norm_topk_prob); experts compute down(silu(gate) · up); the shared expert is scaled by
  sigmoid(shared_expert_gate(x)) and added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gated_deltanet import GatedDeltaNet
from hf_config import default_inv_freq
from hf_model import Linear, RMSNorm, rope
from jax import lax

import jaxkv
from jaxkv.planner.hf_config import text_fields
from pallas_kernels.paged_attention import paged_attention

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Qwen3NextConfig:
    """What the port reads from a `qwen3_next` config.json (frozen, hashable): `Qwen3NextConfig.from_hf(config)`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" or "full_attention"
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    inv_freq: tuple[float, ...]  # [R / 2], float32 values
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # mixture of experts
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    model_type: str = "qwen3_next"

    @property
    def conv_dim(self) -> int:
        """Channels of the linear attention's conv: q and k (Hk dk each) and v (Hv dv)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.linear_num_value_heads * (
            self.linear_value_head_dim
        )

    @classmethod
    def from_hf(cls, config: Mapping) -> Qwen3NextConfig:
        """Reads a parsed `config.json` (transformers ≥ 5's `rope_parameters` and `layer_types`, or the published
        checkpoints' `rope_theta`, `partial_rotary_factor` and `full_attention_interval`); raises ValueError
        naming what is missing or not supported."""
        config = text_fields(config)  # with transformers' defaults for what the file leaves out

        def need(key):
            if config.get(key) is None:
                raise ValueError(f"config.json (qwen3_next) has no {key!r}, which the model needs")
            return config[key]

        def refuse(key, value, allowed, why):
            if value not in allowed:
                raise ValueError(f"config.json (qwen3_next) sets {key}={value!r}: {why}")

        if config.get("model_type") != "qwen3_next":
            raise ValueError(f"config.json has model_type={config.get('model_type')!r}; expected 'qwen3_next'")
        refuse("hidden_act", config.get("hidden_act", "silu"), ("silu",), "the port computes SiLU only")
        refuse("attention_bias", config.get("attention_bias", False), (False,), "attention biases are not supported")
        if need("num_experts") <= 0:
            raise ValueError("config.json (qwen3_next) sets num_experts=0: the port serves the MoE model only")
        refuse("decoder_sparse_step", config.get("decoder_sparse_step", 1), (1,), "dense MLP layers are not supported")
        refuse("mlp_only_layers", list(config.get("mlp_only_layers") or []), ([],), "dense MLPs are not supported")
        num_layers = need("num_hidden_layers")
        interval = config.get("full_attention_interval", 4)
        default_types = ("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers))
        types = tuple(config.get("layer_types") or default_types)
        if len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
            raise ValueError(
                f"config.json (qwen3_next) has layer_types={list(types)}; expected one of {LAYER_TYPES} per layer "
                f"for its {num_layers} layers"
            )
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        refuse("rope_type", params.get("rope_type", params.get("type", "default")), ("default",), "only 'default'")
        theta = params.get("rope_theta", config.get("rope_theta", 10_000.0))
        factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
        head_dim = config.get("head_dim") or need("hidden_size") // need("num_attention_heads")
        num_k, num_v = need("linear_num_key_heads"), need("linear_num_value_heads")
        if num_v % num_k:
            raise ValueError(f"config.json (qwen3_next): {num_v=} value heads must be a multiple of {num_k=} key heads")
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            num_layers=num_layers,
            layer_types=types,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            num_heads=need("num_attention_heads"),
            num_kv_heads=need("num_key_value_heads"),
            head_dim=head_dim,
            inv_freq=tuple(default_inv_freq(int(head_dim * factor), theta).tolist()),
            linear_num_key_heads=num_k,
            linear_num_value_heads=num_v,
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=need("linear_conv_kernel_dim"),
            num_experts=need("num_experts"),
            num_experts_per_tok=need("num_experts_per_tok"),
            moe_intermediate_size=need("moe_intermediate_size"),
            shared_expert_intermediate_size=need("shared_expert_intermediate_size"),
            norm_topk_prob=config.get("norm_topk_prob", True),
        )


def attention(q, k, v, q_positions, sm_scale):
    """q [T, N, H] at q_positions [T]; k, v [S, K, H] of positions 0..S-1 -> [T, N, H]: causal, no window."""
    t, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    qg = q.reshape(t, num_kv_heads, num_heads // num_kv_heads, head_dim)
    logits = jnp.einsum("TKGH,SKH->KGTS", qg, k, preferred_element_type=jnp.float32) * sm_scale
    visible = jnp.arange(k.shape[0])[None, :] <= q_positions[:, None]  # [T, S]
    probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    return jnp.einsum("KGTS,SKH->TKGH", probs.astype(v.dtype), v).reshape(t, num_heads, head_dim)


class GatedAttention(nnx.Module):
    def __init__(self, cfg: Qwen3NextConfig, w):
        """`w(name, shape)` gives `model.layers.{i}.self_attn.{name}`."""
        self.cfg = cfg
        n, kv, h, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = Linear(w("q_proj.weight", (2 * n * h, d)))
        self.k_proj = Linear(w("k_proj.weight", (kv * h, d)))
        self.v_proj = Linear(w("v_proj.weight", (kv * h, d)))
        self.o_proj = Linear(w("o_proj.weight", (d, n * h)))
        self.q_norm = RMSNorm(w("q_norm.weight", (h,)), cfg.rms_norm_eps, 1.0)
        self.k_norm = RMSNorm(w("k_norm.weight", (h,)), cfg.rms_norm_eps, 1.0)

    def project(self, x, positions):
        """x [T, D], positions [T] -> q [T, N, H], k, v [T, K, H] (normed, rotated), gate [T, N H]."""
        cfg, t = self.cfg, x.shape[0]
        q, gate = jnp.split(self.q_proj(x).reshape(t, cfg.num_heads, 2 * cfg.head_dim), 2, axis=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).reshape(t, cfg.num_kv_heads, cfg.head_dim))
        v = self.v_proj(x).reshape(t, cfg.num_kv_heads, cfg.head_dim)
        rotated = 2 * len(cfg.inv_freq)

        def partial_rope(y):
            return jnp.concatenate([rope(y[..., :rotated], positions, cfg.inv_freq, 1.0), y[..., rotated:]], axis=-1)

        return partial_rope(q), partial_rope(k), v, gate.reshape(t, -1)

    def output(self, out, gate):
        """out [T, N, H], gate [T, N H] -> [T, D]."""
        return self.o_proj(out.reshape(gate.shape) * jax.nn.sigmoid(gate))

    def dense(self, x):
        positions = jnp.arange(x.shape[0])
        q, k, v, gate = self.project(x, positions)
        return self.output(attention(q, k, v, positions, self.cfg.head_dim**-0.5), gate)

    def chunk(self, x, start, kv):
        """x [T, D] at positions start.., kv (k, v [S, K, H]) holding positions < start -> (y [T, D], kv').
        Needs start + T <= S: a traced start past it would be clamped by the update (and overwrite earlier K/V)."""
        if isinstance(start, int) and start + x.shape[0] > kv[0].shape[0]:
            raise ValueError(
                f"a chunk of {x.shape[0]} tokens at {start=} does not fit the {kv[0].shape[0]}-token cache"
            )
        positions = start + jnp.arange(x.shape[0])
        q, k, v, gate = self.project(x, positions)
        k_all, v_all = (lax.dynamic_update_slice_in_dim(c, new, start, axis=0) for c, new in zip(kv, (k, v)))
        out = attention(q, k_all, v_all, positions, self.cfg.head_dim**-0.5)
        return self.output(out, gate), (k_all, v_all)


def paged_gated_attention(attn: GatedAttention, x, cache, meta: jaxkv.StepMetadata, name: str):
    """x [T, D] packed as `meta` packs the rows -> (y [T, D], cache'): writes the step's K/V rows into the byte
    buffer at the layer's slots (`jaxkv.write_rows`) and attends through its group's block tables
    (`paged_attention`). The kernel takes a typed cache: it gets the blocks of the rows' tables [R M], gathered
    from the layer's typed view of the bytes (XLA reads just those blocks; the whole view would be copied)."""
    cfg = meta.cfg
    tensor_idx, layer_idx = jaxkv.find_layer(cfg, name)
    view = cfg.tensors[tensor_idx]
    q, k, v, gate = attn.project(x, meta.positions)
    rows = jnp.concatenate([k, v], axis=-1).astype(view.spec.dtype)  # [T, K, 2H]
    cache = jaxkv.write_rows(cache, rows, meta.slot_mapping[view.group_idx], layer_idx, cfg=cfg, tensor_idx=tensor_idx)
    tables = meta.block_tables[view.group_idx]  # [R, M]
    blocks = jnp.take(jaxkv.typed_view(cache, cfg, tensor_idx), tables.reshape(-1), axis=cfg.layout.index("B"))
    out = paged_attention(
        q.astype(view.spec.dtype),
        blocks,  # [R M, L, K, N, 2H] in BLHNC
        meta.query_start_loc,
        meta.seq_lens,
        jnp.arange(tables.size, dtype=jnp.int32).reshape(tables.shape),  # row r's blocks, in table order
        layer_idx,
        sm_scale=attn.cfg.head_dim**-0.5,
        layout=cfg.layout,
    )
    return attn.output(out.astype(x.dtype), gate), cache


def state_blocks(meta: jaxkv.StepMetadata, group_idx: int):
    """Per row (R): (src, dst, fresh): the block holding the state before the step (NULL_BLOCK when
    `fresh`: nothing computed yet, the state is zero), the block that takes the state after it (−1: the
    row has no tokens, nothing is written). See the module docstring."""
    block_size = meta.cfg.groups[group_idx].spec.block_size
    num_new = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    start, end = meta.seq_lens - num_new, meta.seq_lens
    table = meta.block_tables[group_idx]  # [R, M]
    rows = jnp.arange(table.shape[0])
    src = jnp.where(start > 0, table[rows, jnp.maximum(start - 1, 0) // block_size], jaxkv.NULL_BLOCK)
    dst = jnp.where(num_new > 0, table[rows, jnp.maximum(end - 1, 0) // block_size], -1)
    return src, dst, start == 0


def paged_linear_attention(layer: GatedDeltaNet, x, cache, meta: jaxkv.StepMetadata, name: str):
    """x [T, D] packed as `meta` packs the rows -> (y [T, D], cache'): each row's conv and recurrent states
    read from its state block, stepped over its tokens, written to the block that holds them next
    (`state_blocks`). A step whose rows have at most one token each (decode) runs the recurrent rule, any
    other the chunked rule per row (the rows' tokens gathered into [R, T], padded)."""
    cfg = meta.cfg
    tensor_idx, layer_idx = jaxkv.find_layer(cfg, name)
    view = cfg.tensors[tensor_idx]
    conv_field, rec_field = jaxkv.state_fields(view.spec)
    src, dst, fresh = state_blocks(meta, view.group_idx)
    states = []
    for field in (conv_field, rec_field):  # [R, ...], zero for a row with nothing computed
        state = jaxkv.read_rows(cache, src, layer_idx, cfg=cfg, tensor_idx=tensor_idx, field=field)[:, 0]
        states.append(jnp.where(fresh.reshape(-1, *[1] * (state.ndim - 1)), 0, state))
    num_tokens = x.shape[0]
    first = meta.query_start_loc[:-1]
    num_new = meta.query_start_loc[1:] - first

    def decode(conv, rec):
        y, conv, rec = jax.vmap(layer.step)(x[jnp.minimum(first, num_tokens - 1)], conv, rec)
        return jnp.zeros_like(x).at[jnp.where(num_new > 0, first, num_tokens)].set(y, mode="drop"), conv, rec

    def prefill(conv, rec):
        idx = first[:, None] + jnp.arange(num_tokens)[None, :]  # [R, T]
        real = jnp.arange(num_tokens)[None, :] < num_new[:, None]
        y, conv, rec = jax.vmap(layer.prefill)(x[jnp.minimum(idx, num_tokens - 1)], conv, rec, num_new)
        return jnp.zeros_like(x).at[jnp.where(real, idx, num_tokens)].set(y, mode="drop"), conv, rec

    y, *states = lax.cond(jnp.max(num_new) <= 1, decode, prefill, *states)
    for field, state in zip((conv_field, rec_field), states):
        rows = state[:, None].astype(field.dtype)  # [R, 1, ...]: a state view has one "head"
        cache = jaxkv.write_rows(cache, rows, dst, layer_idx, cfg=cfg, tensor_idx=tensor_idx, field=field)
    return y, cache


class MLP(nnx.Module):
    """down(silu(gate(x)) · up(x)): the shared expert."""

    def __init__(self, d: int, f: int, w):
        self.gate_proj = Linear(w("gate_proj.weight", (f, d)))
        self.up_proj = Linear(w("up_proj.weight", (f, d)))
        self.down_proj = Linear(w("down_proj.weight", (d, f)))

    def __call__(self, x):
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nnx.Module):
    """The routed experts, stacked from the checkpoint's per-expert tensors into the x @ w layout."""

    def __init__(self, cfg: Qwen3NextConfig, w):
        d, f, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts

        def stacked(name, shape):  # [E, in, out] from E tensors [out, in]
            return np.stack([w(f"{j}.{name}.weight", shape).T for j in range(e)])

        gate_up = np.concatenate([stacked("gate_proj", (f, d)), stacked("up_proj", (f, d))], axis=-1)
        self.gate_up_proj = nnx.Param(jnp.asarray(gate_up))  # [E, D, 2F]: gate columns, then up
        self.down_proj = nnx.Param(jnp.asarray(stacked("down_proj", (d, f))))  # [E, F, D]

    def __call__(self, x, top_idx, top_weights):
        """x [T, D], top_idx [T, k], top_weights [T, k] -> [T, D]: each token through its k experts (grouped by
        expert for `lax.ragged_dot`), summed with its weights."""
        k, num_experts = top_idx.shape[1], self.gate_up_proj.shape[0]
        expert = top_idx.reshape(-1)  # [T k]
        order = jnp.argsort(expert, stable=True)
        token = order // k  # the token of each (token, choice), grouped by expert
        sizes = jnp.bincount(expert, length=num_experts).astype(jnp.int32)
        gate, up = jnp.split(lax.ragged_dot(x[token], self.gate_up_proj[...], sizes), 2, axis=-1)
        out = lax.ragged_dot(jax.nn.silu(gate) * up, self.down_proj[...], sizes)
        out = out * top_weights.reshape(-1)[order][:, None]
        return jnp.zeros_like(x).at[token].add(out.astype(x.dtype))


class SparseMoeBlock(nnx.Module):
    def __init__(self, cfg: Qwen3NextConfig, w):
        """`w(name, shape)` gives `model.layers.{i}.mlp.{name}`."""
        d, self.cfg = cfg.hidden_size, cfg
        self.gate = Linear(w("gate.weight", (cfg.num_experts, d)))  # the router
        self.experts = Experts(cfg, lambda name, shape: w(f"experts.{name}", shape))
        self.shared_expert = MLP(
            d, cfg.shared_expert_intermediate_size, lambda name, shape: w(f"shared_expert.{name}", shape)
        )
        self.shared_expert_gate = Linear(w("shared_expert_gate.weight", (1, d)))

    def __call__(self, x):
        """x [T, D] -> [T, D]."""
        logits = self.gate(x)  # [T, E]
        top_probs, top_idx = lax.top_k(
            jax.nn.softmax(logits.astype(jnp.float32), axis=-1), self.cfg.num_experts_per_tok
        )
        if self.cfg.norm_topk_prob:
            top_probs = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
        routed = self.experts(x, top_idx, top_probs.astype(logits.dtype))
        return routed + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3NextConfig, layer_idx: int, w):
        """`w(name, shape)` gives `model.layers.{layer_idx}.{name}`."""
        d = cfg.hidden_size
        self.layer_type = cfg.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, lambda name, shape: w(f"linear_attn.{name}", shape))
        else:
            self.self_attn = GatedAttention(cfg, lambda name, shape: w(f"self_attn.{name}", shape))
        self.mlp = SparseMoeBlock(cfg, lambda name, shape: w(f"mlp.{name}", shape))
        self.input_layernorm = RMSNorm(w("input_layernorm.weight", (d,)), cfg.rms_norm_eps, 1.0)
        self.post_attention_layernorm = RMSNorm(w("post_attention_layernorm.weight", (d,)), cfg.rms_norm_eps, 1.0)

    def mlp_residual(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nnx.Module):
    """A Qwen3-Next decoder from a checkpoint's tensors (`checkpoint.load_model`)."""

    typed_cache = False  # forward_paged reads the plan's byte buffer (state pages beside K/V pages)

    def __init__(self, cfg: Qwen3NextConfig, w):
        """`w(name, shape)` gives the checkpoint tensor `name`, checked against `shape`."""
        self.cfg = cfg
        v, d = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = nnx.Param(jnp.asarray(w("model.embed_tokens.weight", (v, d))))
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, i, lambda name, shape, i=i: w(f"model.layers.{i}.{name}", shape))
                for i in range(cfg.num_layers)
            ]
        )
        self.norm = RMSNorm(w("model.norm.weight", (d,)), cfg.rms_norm_eps, 1.0)
        self.lm_head = None if cfg.tie_word_embeddings else nnx.Param(jnp.asarray(w("lm_head.weight", (v, d))))

    def logits(self, x):
        head = self.embed_tokens[...] if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("TD,VD->TV", self.norm(x), head).astype(jnp.float32)

    def forward_dense(self, tokens: jax.Array) -> jax.Array:
        """tokens [S] -> logits [S, V], with no cache."""
        x = self.embed_tokens[...][tokens]
        for layer in self.layers:
            h = layer.input_layernorm(x)
            h = layer.linear_attn.dense(h) if layer.layer_type == "linear_attention" else layer.self_attn.dense(h)
            x = layer.mlp_residual(x + h)
        return self.logits(x)

    def init_cache(self, max_len: int, dtype) -> tuple[tuple[jax.Array, jax.Array], ...]:
        """Per layer: linear attention (conv_state [W - 1, C], recurrent_state [Hv, dv, dk]), zero; full attention
        (k, v [max_len, K, H]), zero."""
        cfg = self.cfg
        kv_shape = (max_len, cfg.num_kv_heads, cfg.head_dim)
        return tuple(
            layer.linear_attn.init_state(dtype)
            if layer.layer_type == "linear_attention"
            else (jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype))
            for layer in self.layers
        )

    def forward_paged(self, tokens, cache, meta: jaxkv.StepMetadata, mesh=None):
        """tokens [T] (packed as `meta` packs them), cache (the plan's byte buffer, `jaxkv.allocate_cache`)
        -> (logits [T, V], cache'); every layer named as `jaxkv.specs_from_hf_config` names it."""
        if mesh is not None:
            raise ValueError("the Qwen3-Next example runs on one device (no --tp): its state layers are not sharded")
        x = self.embed_tokens[...][tokens]
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if layer.layer_type == "linear_attention":
                h, cache = paged_linear_attention(layer.linear_attn, h, cache, meta, f"model.layers.{i}.linear_attn")
            else:
                h, cache = paged_gated_attention(layer.self_attn, h, cache, meta, f"model.layers.{i}.self_attn.attn")
            x = layer.mlp_residual(x + h)
        return self.logits(x), cache

    def forward_chunk(self, tokens: jax.Array, start, cache):
        """tokens [T] of one request at positions start.. (an int, or an int32 scalar that may be traced), cache
        (`init_cache`'s) after its first `start` tokens -> (logits [T, V], cache'). A chunk of one token steps the
        linear layers with the recurrent rule."""
        x = self.embed_tokens[...][tokens]
        new_cache = []
        for layer, state in zip(self.layers, cache):
            h = layer.input_layernorm(x)
            if layer.layer_type == "full_attention":
                h, state = layer.self_attn.chunk(h, start, state)
            elif tokens.shape[0] == 1:
                h, *state = layer.linear_attn.step(h[0], *state)
                h = h[None]
            else:
                h, *state = layer.linear_attn.prefill(h, *state)
            x = layer.mlp_residual(x + h)
            new_cache.append(tuple(state))
        return self.logits(x), tuple(new_cache)
