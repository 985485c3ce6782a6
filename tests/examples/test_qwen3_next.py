"""The Qwen3-Next port (examples/qwen3_next.py, examples/gated_deltanet.py) computes what transformers computes.

The fixture (tests/fixtures/hf/qwen3_next/) is a tiny random checkpoint with transformers' float32 logits
(tests/fixtures/hf/make_fixtures.py): 5 layers (linear, linear, linear, full, linear), 2 key heads and 4 value
heads in the linear attention, prompts of 111, 64, 131 and 14 tokens with the fed-back greedy tokens, so that the
chunked delta rule (chunks of 64) spans one to three chunks. No torch here.

Every sequence is padded at its end to PADDED_LEN, so that each pass compiles once for all prompts: the model is
causal, so padding after a sequence leaves its logits as they were.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_runs import EXAMPLES

sys.path.insert(0, str(EXAMPLES))  # the example's modules

FIXTURE = EXAMPLES.parent / "tests" / "fixtures" / "hf" / "qwen3_next"
F32_TOLERANCE = 1e-4  # of the logits' scale (their largest magnitude)
PADDED_LEN = 144  # the longest sequence is 131 tokens
PREFILL_CHUNK = 72  # two chunks of a prefill, each spanning two chunks of the delta rule
DECODE_FROM = 2  # recurrent decode after a prefill of 2 tokens (fewer than the conv state's 3 rows)


def sequences() -> list[tuple[np.ndarray, np.ndarray]]:
    """Per prompt: (prompt + generated tokens[:-1] padded to PADDED_LEN, transformers' logits [L, V])."""
    ref = np.load(FIXTURE / "reference.npz")
    out = []
    for i in range(len([k for k in ref.files if k.startswith("prompt_")])):
        tokens = np.concatenate([ref[f"prompt_{i}"], ref[f"tokens_{i}"][:-1]])
        out.append((np.pad(tokens, (0, PADDED_LEN - len(tokens))).astype(np.int32), ref[f"logits_{i}"]))
    return out


def assert_close(got, want, what: str) -> None:
    err, scale = np.abs(np.asarray(got) - want).max(), np.abs(want).max()
    assert err <= F32_TOLERANCE * scale, f"{what}: max abs error {err:.3g} at logit scale {scale:.3g}"


@pytest.fixture(scope="module")
def model():
    from checkpoint import load_model, open_checkpoint
    from flax import nnx

    graphdef, params = nnx.split(load_model(open_checkpoint(FIXTURE), "float32"))
    return graphdef, params


@pytest.fixture(scope="module")
def dense(model) -> list[np.ndarray]:
    """The dense pass's logits [PADDED_LEN, V] per prompt."""
    from flax import nnx

    graphdef, params = model
    forward = jax.jit(lambda params, tokens: nnx.merge(graphdef, params).forward_dense(tokens))
    return [np.asarray(forward(params, tokens)) for tokens, _ in sequences()]


def test_tokenizer_gives_the_reference_prompts():
    from checkpoint import open_checkpoint

    checkpoint = open_checkpoint(FIXTURE)
    ref = np.load(FIXTURE / "reference.npz")
    for i, text in enumerate(json.loads((FIXTURE / "prompts.json").read_text())):
        assert checkpoint.encode(text) == ref[f"prompt_{i}"].tolist()


def test_dense_forward_equals_transformers(dense):
    for i, ((_, ref), got) in enumerate(zip(sequences(), dense)):
        assert_close(got[: len(ref)], ref, f"prompt {i}")


def test_chunked_prefill_equals_dense(model, dense):
    # The states after the first chunk (conv: its last 3 inputs; recurrent: S) start the second.
    from flax import nnx

    graphdef, params = model

    @jax.jit
    def chunk(params, tokens, start, cache):
        return nnx.merge(graphdef, params).forward_chunk(tokens, start, cache)

    cache0 = nnx.merge(graphdef, params).init_cache(PADDED_LEN, jnp.float32)
    for i, ((tokens, _), want) in enumerate(zip(sequences(), dense)):
        cache, rows = cache0, []
        for start in range(0, PADDED_LEN, PREFILL_CHUNK):
            logits, cache = chunk(params, tokens[start : start + PREFILL_CHUNK], jnp.int32(start), cache)
            rows.append(logits)
        assert_close(np.concatenate(rows), want, f"prompt {i}")


def test_recurrent_decode_equals_dense(model, dense):
    # A 2-token prefill, then one token at a time (the recurrent rule, the conv state shifted by one) in a scan.
    from flax import nnx

    graphdef, params = model

    @jax.jit
    def prefill_then_decode(params, tokens):
        model = nnx.merge(graphdef, params)
        first, cache = model.forward_chunk(tokens[:DECODE_FROM], 0, model.init_cache(PADDED_LEN, jnp.float32))

        def one_token(carry, token):
            position, cache = carry
            logits, cache = model.forward_chunk(token[None], position, cache)
            return (position + 1, cache), logits[0]

        _, rest = jax.lax.scan(one_token, (jnp.int32(DECODE_FROM), cache), tokens[DECODE_FROM:])
        return jnp.concatenate([first, rest])

    for i, ((tokens, _), want) in enumerate(zip(sequences(), dense)):
        assert_close(prefill_then_decode(params, tokens), want, f"prompt {i}")


def test_chunk_rule_equals_recurrent_rule():
    # 45 tokens in chunks of 16 (the last one padded) from a nonzero state, against the rule one token at a time.
    from gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule

    t, heads, dk, dv = 45, 3, 8, 4
    rng = np.random.default_rng(0)

    def unit(x):  # l2-normalised along the last axis
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    q = unit(rng.normal(size=(t, heads, dk))) * dk**-0.5
    k = unit(rng.normal(size=(t, heads, dk)))
    v = rng.normal(size=(t, heads, dv)).astype(np.float32)
    g = -rng.uniform(0, 0.5, size=(t, heads)).astype(np.float32)
    beta = rng.uniform(size=(t, heads)).astype(np.float32)
    state = rng.normal(size=(heads, dv, dk)).astype(np.float32)

    def one_token(s, xs):
        o, s = recurrent_gated_delta_rule(*xs, s)
        return s, o

    want_state, want = jax.jit(lambda *xs: jax.lax.scan(one_token, state, xs))(q, k, v, g, beta)
    got, got_state = jax.jit(chunk_gated_delta_rule, static_argnames="chunk_size")(
        q, k, v, g, beta, state, chunk_size=16
    )
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(got_state, want_state, rtol=0, atol=1e-5 * np.abs(want_state).max())


def test_planned_states_are_the_port_states(model):
    # jaxkv plans (W - 1, C) and (Hv, dv, dk) per linear-attention layer; the port's states have exactly these.
    from flax import nnx

    import jaxkv

    config = json.loads((FIXTURE / "config.json").read_text())
    specs = jaxkv.specs_from_hf_config(config, dtype="float32")
    cache = nnx.merge(*model).init_cache(8, jnp.float32)
    for i, layer_type in enumerate(config["layer_types"]):
        if layer_type == "linear_attention":
            spec = specs[f"model.layers.{i}.linear_attn"]
            assert isinstance(spec, jaxkv.MambaSpec)
            assert spec.shapes == tuple(s.shape for s in cache[i]) == ((3, 128), (4, 16, 16))
            assert spec.dtypes == tuple(s.dtype.name for s in cache[i])
        else:
            assert isinstance(specs[f"model.layers.{i}.self_attn.attn"], jaxkv.FullAttentionSpec)


def test_published_config_form_reads_the_same():
    # The published checkpoints give rope_theta, partial_rotary_factor and full_attention_interval instead of
    # rope_parameters and layer_types (interval 4 over 5 layers: the fixture's pattern).
    from qwen3_next import Qwen3NextConfig

    config = json.loads((FIXTURE / "config.json").read_text())
    rope = config["rope_parameters"]
    legacy = {
        **{k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")},
        "rope_theta": rope["rope_theta"],
        "partial_rotary_factor": rope["partial_rotary_factor"],
        "full_attention_interval": 4,
        "rope_scaling": None,
    }
    assert Qwen3NextConfig.from_hf(legacy) == Qwen3NextConfig.from_hf(config)
    assert Qwen3NextConfig.from_hf(config).inv_freq == pytest.approx((1.0, 0.01))  # 4 of 16 dims rotate


@pytest.mark.parametrize(
    "change, message",
    [
        ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]: dense MLPs"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type='yarn'"),
        ({"linear_num_value_heads": 3}, r"num_v=3 value heads must be a multiple of num_k=2"),
    ],
)
def test_unsupported_configs_are_refused(change, message):
    from qwen3_next import Qwen3NextConfig

    config = json.loads((FIXTURE / "config.json").read_text())
    with pytest.raises(ValueError, match=message):
        Qwen3NextConfig.from_hf({**config, **change})
