"""A small Gemma-3-style decoder in flax nnx, with a dense and a paged forward pass.

Dimensions: T tokens of the step, S sequence length (dense), D model width,
N query heads, K KV heads, H head size, V vocabulary, R requests, G groups,
M max blocks per request, B blocks.

The dense pass (`forward_dense`) attends with explicit causal and sliding-window
masks and no cache: it is the ground truth. The paged pass (`forward_paged`)
gives each layer's K/V to `jaxkv.attend` with the step's `jaxkv.StepMetadata`: it
writes them into the block-outer cache at the layer's KV cache group and attends
through that group's block table, with the window of the layer's spec in the plan.
The cache is threaded as data, `logits, cache = model.forward_paged(...)`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from sharding import kernels

import jaxkv


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    vocab_size: int = 512
    num_layers: int = 12
    embed_dim: int = 128
    hidden_dim: int = 256
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    sliding_window: int = 64
    sliding_window_pattern: int = 6  # layer i is global when (i + 1) % pattern == 0
    local_base_frequency: float = 10_000.0
    global_base_frequency: float = 1_000_000.0
    dtype: str = "float32"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be divisible by {self.num_kv_heads=}")

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A configuration for CI: 6 layers (5 sliding + 1 global), window 8."""
        return cls(
            vocab_size=64,
            num_layers=6,
            embed_dim=32,
            hidden_dim=64,
            num_heads=8,
            num_kv_heads=4,
            head_dim=8,
            sliding_window=8,
        )

    def is_global(self, layer_idx: int) -> bool:
        return (layer_idx + 1) % self.sliding_window_pattern == 0

    def layer_name(self, layer_idx: int) -> str:
        return f"layers.{layer_idx}.attn"

    def kv_cache_specs(self, block_size: int) -> dict[str, jaxkv.FullAttentionSpec | jaxkv.SlidingWindowSpec]:
        """The layer → KV cache spec mapping that `jaxkv.plan` takes."""
        common = dict(block_size=block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_dim, dtype=self.dtype)
        return {
            self.layer_name(i): jaxkv.FullAttentionSpec(**common)
            if self.is_global(i)
            else jaxkv.SlidingWindowSpec(**common, sliding_window=self.sliding_window)
            for i in range(self.num_layers)
        }


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """x [T, N, H], positions [T] -> x rotated by position (half-split RoPE)."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None, None].astype(jnp.float32) * freq  # [T, 1, H/2]
    x1, x2 = x[..., :half], x[..., half:]
    sin, cos = jnp.sin(angle), jnp.cos(angle)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.name = cfg.layer_name(layer_idx)  # the layer's name in the plan
        self.window = None if cfg.is_global(layer_idx) else cfg.sliding_window
        self.base = cfg.global_base_frequency if cfg.is_global(layer_idx) else cfg.local_base_frequency
        d, n, k, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = nnx.Linear(d, n * h, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(d, 2 * k * h, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(n * h, d, use_bias=False, rngs=rngs)
        self.q_norm = nnx.RMSNorm(h, rngs=rngs)
        self.k_norm = nnx.RMSNorm(h, rngs=rngs)

    def project(self, x: jax.Array, positions: jax.Array):
        """x [T, D] -> q [T, N, H], k [T, K, H], v [T, K, H] (normed, rotated)."""
        cfg = self.cfg
        q = self.q(x).reshape(-1, cfg.num_heads, cfg.head_dim)
        k, v = jnp.split(self.kv(x).reshape(-1, cfg.num_kv_heads, 2 * cfg.head_dim), 2, axis=-1)
        q = rope(self.q_norm(q), positions, self.base)
        k = rope(self.k_norm(k), positions, self.base)
        return q, k, v

    def dense(self, x: jax.Array) -> jax.Array:
        """x [S, D] -> [S, D]: causal attention over the whole sequence, window masked."""
        cfg = self.cfg
        s = x.shape[0]
        positions = jnp.arange(s)
        q, k, v = self.project(x, positions)
        q = q.reshape(s, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
        logits = jnp.einsum("SKGH,TKH->KGST", q, k) * cfg.head_dim**-0.5
        qpos, kpos = positions[:, None], positions[None, :]
        visible = kpos <= qpos
        if self.window is not None:
            visible &= qpos - self.window < kpos
        logits = jnp.where(visible, logits, -jnp.inf)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        attn = jnp.einsum("KGST,TKH->SKGH", probs, v).reshape(s, -1)
        return self.out(attn)

    def paged(self, x, cache, meta: jaxkv.StepMetadata, mesh=None):
        """x [T, D], cache [B, L, K, N, 2H] -> ([T, D], cache'): write this step's K/V, attend over the cache."""
        q, k, v = self.project(x, meta.positions)
        attn, cache = jaxkv.attend(
            q, k, v, cache, meta, layer=self.name, sm_scale=self.cfg.head_dim**-0.5, kernels=kernels(mesh)
        )
        return self.out(attn.reshape(x.shape[0], -1)), cache


class FeedForward(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(cfg.embed_dim, 2 * cfg.hidden_dim, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.hidden_dim, cfg.embed_dim, use_bias=False, rngs=rngs)

    def __call__(self, x):
        gate, up = jnp.split(self.gate(x), 2, axis=-1)
        return self.down(jax.nn.gelu(gate) * up)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, *, rngs: nnx.Rngs):
        self.attn = Attention(cfg, layer_idx, rngs=rngs)
        self.ffw = FeedForward(cfg, rngs=rngs)
        self.pre_attn_norm = nnx.RMSNorm(cfg.embed_dim, rngs=rngs)
        self.post_attn_norm = nnx.RMSNorm(cfg.embed_dim, rngs=rngs)
        self.pre_ffw_norm = nnx.RMSNorm(cfg.embed_dim, rngs=rngs)
        self.post_ffw_norm = nnx.RMSNorm(cfg.embed_dim, rngs=rngs)

    def mlp(self, x):
        return x + self.post_ffw_norm(self.ffw(self.pre_ffw_norm(x)))


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.embed_dim, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, i, rngs=rngs) for i in range(cfg.num_layers)])
        self.final_norm = nnx.RMSNorm(cfg.embed_dim, rngs=rngs)

    def logits(self, x):
        return self.embed.attend(self.final_norm(x)).astype(jnp.float32)

    def forward_dense(self, tokens: jax.Array) -> jax.Array:
        """tokens [S] -> logits [S, V], with no cache."""
        x = self.embed(tokens) * self.cfg.embed_dim**0.5
        for block in self.blocks:
            x = x + block.post_attn_norm(block.attn.dense(block.pre_attn_norm(x)))
            x = block.mlp(x)
        return self.logits(x)

    def forward_paged(self, tokens, cache, meta: jaxkv.StepMetadata, mesh=None, num_layers=None):
        """tokens [T] (packed as `meta` packs them), cache [B, L, K, N, 2H] -> (logits [T, V], cache').

        With a `mesh`, the cache is sharded over KV heads and the kernels run per shard.
        """
        x = self.embed(tokens) * self.cfg.embed_dim**0.5
        for block in self.blocks[:num_layers]:  # the first `num_layers` and the head: a draft model
            h, cache = block.attn.paged(block.pre_attn_norm(x), cache, meta, mesh)
            x = block.mlp(x + block.post_attn_norm(h))
        return self.logits(x), cache
