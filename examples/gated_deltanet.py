"""Qwen3-Next's Gated DeltaNet (linear attention) layer in flax nnx, computing what transformers computes.

Dimensions: T tokens, D hidden size, C conv channels (2 Hk dk + Hv dv), W conv kernel width, Hk key heads,
Hv value heads (a multiple of Hk), dk and dv key and value head sizes, N chunks of L tokens.

A layer's state, per request, is the two arrays jaxkv plans for `model.layers.{i}.linear_attn`
(`jaxkv.specs_from_hf_config` gives `MambaSpec(shapes=((W - 1, C), (Hv, dv, dk)))`); zeros before the first token:
  conv_state [W - 1, C]       the last W − 1 inputs of the conv (q, k, v projected, before the conv), oldest first.
                              transformers keeps the last W, channel-major: [C, W].
  recurrent_state [Hv, dv, dk] S, with o = S q: transformers' [Hv, dk, dv] transposed (current vLLM's layout).
The rule, per value head and token: S ← exp(g) S;  S ← S + β (v − S k) kᵀ;  o = S q, with q and k l2-normalised and
q scaled by dk^−½. `prefill` runs it chunk-parallel (`chunk_gated_delta_rule`, as transformers' torch fallback
for prompts), `step` one token at a time (`recurrent_gated_delta_rule`, as its fallback for cached decode); both
take a state and return the next, so a chunked prefill or a paged pool can carry it between calls.

Where the math departs from the obvious, it follows transformers:
- in_proj_qkvz's rows are grouped by key head: per key head q (dk), k (dk), v (r dv), z (r dv) with r = Hv / Hk;
  in_proj_ba's likewise b (r), a (r). Value head j reads key head j // r (repeat_interleave, not tile).
- the conv runs over the concatenation q | k | v (all heads of q, then of k, then of v), SiLU after it.
- g = −exp(A_log) · softplus(a + dt_bias) is the log of the per-token decay; β = sigmoid(b).
- the output norm scales by w (not 1 + w) and multiplies by silu(z), z taken per value head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from hf_model import Linear
from jax import lax

CHUNK_SIZE = 64  # transformers' torch_chunk_gated_delta_rule


def causal_conv1d(x: jax.Array, weight: jax.Array, conv_state: jax.Array, length=None) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv and SiLU. x [T, C], weight [C, W], conv_state [W - 1, C] -> (y [T, C], conv_state').
    `length` (an int32 scalar, default T): only x[:length] are real; conv_state' holds the last W − 1 inputs
    before it."""
    width, t = weight.shape[-1], x.shape[0]
    full = jnp.concatenate([conv_state.astype(jnp.float32), x.astype(jnp.float32)])  # [W - 1 + T, C]
    w32 = weight.astype(jnp.float32)
    y = sum(full[j : j + t] * w32[:, j] for j in range(width))  # PyTorch's conv1d is a cross-correlation
    state = full[t:] if length is None else lax.dynamic_slice_in_dim(full, length, width - 1)
    return jax.nn.silu(y).astype(x.dtype), state.astype(conv_state.dtype)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x · rsqrt(Σx² + eps) over the last axis (FLA's and transformers' form: eps inside the root)."""
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """One token. q, k [Hv, dk] (normalised, q scaled), v [Hv, dv], g, beta [Hv], state [Hv, dv, dk], all float32
    -> (o [Hv, dv], state')."""
    state = state * jnp.exp(g)[:, None, None]
    delta = (v - jnp.einsum("HVK,HK->HV", state, k)) * beta[:, None]
    state = state + jnp.einsum("HV,HK->HVK", delta, k)
    return jnp.einsum("HVK,HK->HV", state, q), state


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE):
    """The same rule over T tokens, chunk-parallel. q, k [T, Hv, dk] (normalised, q scaled), v [T, Hv, dv],
    g, beta [T, Hv], state [Hv, dv, dk], all float32 -> (o [T, Hv, dv], state').

    Within a chunk the T sequential rank-one updates become one lower-triangular solve (the UT transform); across
    chunks a `lax.scan` carries S. The tail is padded with tokens of k = v = β = g = 0, which leave S unchanged.
    """
    t, num_heads, head_v = v.shape
    pad = -t % chunk_size
    n = (t + pad) // chunk_size

    def chunks(x):  # [T, Hv, ...] -> [N, Hv, L, ...]
        x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
        return jnp.moveaxis(x.reshape(n, chunk_size, *x.shape[1:]), 2, 1)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    cum = jnp.cumsum(g, axis=-1)  # [N, Hv, L]: log decay from the chunk's start through each token
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [N, Hv, L, L]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + strictly_lower((β k) kᵀ ∘ decay)) [u | w] = [β v | β k exp(cum)]
    a = jnp.einsum("NHLK,NHMK->NHLM", k_beta, k) * decay
    a = jnp.where(jnp.tril(causal, -1), a, 0.0) + jnp.eye(chunk_size, dtype=a.dtype)
    solve = lax.linalg.triangular_solve
    u = solve(a, v_beta, left_side=True, lower=True, unit_diagonal=True)  # [N, Hv, L, dv]
    w = solve(a, k_beta * jnp.exp(cum)[..., None], left_side=True, lower=True, unit_diagonal=True)  # [N, Hv, L, dk]
    intra = jnp.einsum("NHLK,NHMK->NHLM", q, k) * decay  # [N, Hv, L, L]
    q_decayed = q * jnp.exp(cum)[..., None]  # reads S as it was at the chunk's start
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]  # written into S as of the chunk's end
    chunk_decay = jnp.exp(cum[..., -1])  # [N, Hv]

    def one_chunk(s, xs):  # s [Hv, dv, dk]
        u, w, q_decayed, k_decayed, intra, chunk_decay = xs
        v_new = u - jnp.einsum("HLK,HVK->HLV", w, s)
        o = jnp.einsum("HLK,HVK->HLV", q_decayed, s) + jnp.einsum("HLM,HMV->HLV", intra, v_new)
        s = s * chunk_decay[:, None, None] + jnp.einsum("HLK,HLV->HVK", k_decayed, v_new)
        return s, o

    state, o = lax.scan(one_chunk, state, (u, w, q_decayed, k_decayed, intra, chunk_decay))  # o [N, Hv, L, dv]
    return jnp.moveaxis(o, 1, 2).reshape(n * chunk_size, num_heads, head_v)[:t], state


class Conv1d(nnx.Module):
    def __init__(self, weight):
        self.weight = nnx.Param(jnp.asarray(weight))  # [C, 1, W], as PyTorch's depthwise Conv1d stores it


class GatedRMSNorm(nnx.Module):
    """x / rms(x) · w · silu(z): the normalised x is cast back to x's dtype before the product with w (not 1 + w);
    silu(z) is taken in float32."""

    def __init__(self, weight, eps: float):
        self.weight = nnx.Param(jnp.asarray(weight))
        self.eps = eps

    def __call__(self, x, z):
        x32 = x.astype(jnp.float32)
        normed = (x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        return (self.weight[...] * normed * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg, w):
        """`cfg`: a `qwen3_next.Qwen3NextConfig`; `w(name, shape)` gives `model.layers.{i}.linear_attn.{name}`."""
        self.cfg = cfg
        d, hk, hv = cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.in_proj_qkvz = Linear(w("in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, d)))
        self.in_proj_ba = Linear(w("in_proj_ba.weight", (2 * hv, d)))
        self.conv1d = Conv1d(w("conv1d.weight", (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim)))
        self.dt_bias = nnx.Param(jnp.asarray(w("dt_bias", (hv,))))
        self.A_log = nnx.Param(jnp.asarray(w("A_log", (hv,))))
        self.norm = GatedRMSNorm(w("norm.weight", (dv,)), cfg.rms_norm_eps)
        self.out_proj = Linear(w("out_proj.weight", (d, hv * dv)))

    def init_state(self, dtype) -> tuple[jax.Array, jax.Array]:
        """Zero conv_state [W - 1, C] and recurrent_state [Hv, dv, dk]: the state before the first token."""
        cfg = self.cfg
        return (
            jnp.zeros((cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), dtype),
            jnp.zeros((cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim), dtype),
        )

    def _project(self, x):
        """x [T, D] -> (conv input q | k | v [T, C], z [T, Hv, dv], b [T, Hv], a [T, Hv])."""
        cfg, t = self.cfg, x.shape[0]
        hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        r = cfg.linear_num_value_heads // hk  # value heads per key head
        q, k, v, z = jnp.split(self.in_proj_qkvz(x).reshape(t, hk, -1), [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
        b, a = jnp.split(self.in_proj_ba(x).reshape(t, hk, 2 * r), 2, axis=-1)
        mixed = jnp.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=-1)
        return mixed, z.reshape(t, -1, dv), b.reshape(t, -1), a.reshape(t, -1)

    def _rule_inputs(self, mixed, b, a):
        """Conv output [T, C] -> q, k [T, Hv, dk], v [T, Hv, dv], g, beta [T, Hv], all float32."""
        cfg, t = self.cfg, mixed.shape[0]
        r = cfg.linear_num_value_heads // cfg.linear_num_key_heads
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        q, k, v = jnp.split(mixed.astype(jnp.float32), [key_dim, 2 * key_dim], axis=-1)
        q, k = (jnp.repeat(x.reshape(t, -1, cfg.linear_key_head_dim), r, axis=1) for x in (q, k))
        q = l2norm(q) * cfg.linear_key_head_dim**-0.5
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + self.dt_bias[...])
        beta = jax.nn.sigmoid(b).astype(jnp.float32)
        return q, l2norm(k), v.reshape(t, -1, cfg.linear_value_head_dim), g, beta

    def _output(self, o, z, dtype):
        """o [T, Hv, dv] float32, z [T, Hv, dv] -> [T, D]."""
        return self.out_proj(self.norm(o.astype(dtype), z).reshape(o.shape[0], -1))

    def prefill(self, x, conv_state, recurrent_state, length=None, chunk_size: int = CHUNK_SIZE):
        """x [T, D] of one request, its conv_state [W - 1, C] and recurrent_state [Hv, dv, dk] before the first
        token -> (y [T, D], conv_state', recurrent_state'), the states in their input dtypes. `length` (an int32
        scalar, default T): only x[:length] are the request's; the rest is padding (g = β = 0 there: the
        rule leaves S as it is), whose outputs are meaningless."""
        mixed, z, b, a = self._project(x)
        mixed, conv_state = causal_conv1d(mixed, self.conv1d.weight[...][:, 0], conv_state, length)
        q, k, v, g, beta = self._rule_inputs(mixed, b, a)
        if length is not None:
            real = (jnp.arange(x.shape[0]) < length)[:, None]
            g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)
        o, state = chunk_gated_delta_rule(q, k, v, g, beta, recurrent_state.astype(jnp.float32), chunk_size)
        return self._output(o, z, x.dtype), conv_state, state.astype(recurrent_state.dtype)

    def step(self, x, conv_state, recurrent_state):
        """One token: x [D] and one request's states -> (y [D], conv_state', recurrent_state'). `jax.vmap` it over
        requests for a decode batch."""
        mixed, z, b, a = self._project(x[None])
        mixed, conv_state = causal_conv1d(mixed, self.conv1d.weight[...][:, 0], conv_state)
        q, k, v, g, beta = (y[0] for y in self._rule_inputs(mixed, b, a))
        o, state = recurrent_gated_delta_rule(q, k, v, g, beta, recurrent_state.astype(jnp.float32))
        return self._output(o[None], z, x.dtype)[0], conv_state, state.astype(recurrent_state.dtype)

    def dense(self, x):
        """x [T, D] from the first token -> y [T, D] (no cache: `prefill` from zero states)."""
        return self.prefill(x, *self.init_state(jnp.float32))[0]
