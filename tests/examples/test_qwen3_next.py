"""The Qwen3-Next port (examples/qwen3_next.py, examples/gated_deltanet.py) computes what transformers computes.

The fixture (tests/fixtures/hf/qwen3_next/) is a tiny random checkpoint with transformers' float32 logits
(tests/fixtures/hf/make_fixtures.py): 5 layers (linear, linear, linear, full, linear), 2 key heads and 4 value
heads in the linear attention, prompts of 111, 64, 131 and 14 tokens with the fed-back greedy tokens, so that the
chunked delta rule (chunks of 64) spans one to three chunks. No torch here.

Every sequence is padded at its end to PADDED_LEN, so that each pass compiles once for all prompts: the model is
causal, so padding after a sequence leaves its logits as they were.

Served through jaxkv's pool (examples/serving.py, its state layers in state groups of 32-token blocks, hits at every
8 tokens): transformers' multi-turn conversations (conversations.npz), whose later turns resume from states saved at
block ends and at prompt tails inside a block; a pool that preempts; device decode loops; and the same conversation
with its block copies dropped, which must show in the logits.
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


# ---- served through jaxkv's pool (examples/serving.py) -------------------------------------------------------------

BLOCK_SIZE = 32  # page-size unification: one state page (5,632 B, padded to 8,192) = 32 tokens of K/V
UNIT = 8  # prefix_match_unit: hits may end inside a 32-token block


def serving_loop(model, num_blocks: int):
    """A loop over a plan of `num_blocks` blocks, 3 requests at a time, steps of 32 tokens, device loops of 4
    decode steps, hits at every 8 tokens; the pool starts as NaN, so a read of a block nothing wrote poisons
    the logits."""
    from flax import nnx
    from serving import ServingLoop

    import jaxkv

    specs = jaxkv.specs_from_hf_config(json.loads((FIXTURE / "config.json").read_text()), dtype="float32")
    probe = jaxkv.plan(specs, 1 << 30, max_model_len=200, max_num_batched_tokens=32)
    cfg = jaxkv.plan(specs, num_blocks * probe.bytes_per_block, max_model_len=200, max_num_batched_tokens=32)
    assert {g.block_size for g in cfg.groups} == {BLOCK_SIZE} and not jaxkv.is_typed(cfg)
    loop = ServingLoop(
        nnx.merge(*model),
        cfg,
        max_num_seqs=3,
        max_num_batched_tokens=32,
        decode_steps=4,
        record_logits=True,
        prefix_match_unit=UNIT,
    )
    loop.cache = jnp.full_like(loop.cache, 0xFF)  # every float32 in it NaN
    return loop


def served_logits(request, num_rows: int) -> np.ndarray:
    """[num_rows, V] logits the loop computed for `request` (NaN: a row a prefix hit spared)."""
    logits = np.full((num_rows, 384), np.nan, np.float32)
    for position, row in request.logits.items():
        logits[position] = row
    return logits


def serve_turns(loop, num_conversations: int) -> list[list[tuple[object, np.ndarray]]]:
    """Turn by turn, every conversation's prompt (`conversations.npz`) at once, 12 greedy tokens each.
    Returns per turn, per conversation (request, transformers' logits)."""
    ref = np.load(FIXTURE / "conversations.npz")
    turns = []
    for t in range(3):
        prompts = [ref[f"c{c}_t{t}_prompt"].tolist() for c in range(num_conversations)]
        requests = loop.generate(prompts, 12)
        for c, request in enumerate(requests):  # the next prompt continues this turn's greedy tokens
            assert request.output == ref[f"c{c}_t{t}_tokens"].tolist(), f"conversation {c} turn {t}: tokens"
        turns.append([(r, ref[f"c{c}_t{t}_logits"]) for c, r in enumerate(requests)])
    return turns


def test_conversations_served_through_the_pool_equal_transformers(model):
    # 3 conversations x 3 turns; each turn's prompt continues the previous one. Turn 1 resumes from the state
    # saved at the end of turn 0's prompt (a block end), turn 2 from the state saved at turn 1's prompt tail
    # (136: inside a block), copied to a fresh block before the step writes past it, or (conversation 2) from
    # the state its turn-1 decode saved at a block end (160, past its prompt tail 144): a device loop stops at
    # a state block's end, and the state there becomes findable once the loop hands its tokens back.
    loop = serving_loop(model, num_blocks=52)
    hits = []
    for t, turn in enumerate(serve_turns(loop, 3)):
        for c, (request, want) in enumerate(turn):
            got = served_logits(request, len(want))
            computed = ~np.isnan(got).any(axis=1)
            assert computed[len(request.prompt) - 1 :].all()  # the last prompt position and every generated one
            assert_close(got[computed], want[computed], f"conversation {c} turn {t}")
            hits.append(int(np.argmax(computed)))
    assert hits[3:6] == [96, 96, 96] and hits[6:] == [136, 136, 160]
    assert loop.stats.block_copies > 0 and loop.stats.device_loops > 0


def test_a_pool_that_preempts_resumes_from_saved_states(model):
    # reference.npz's prompts (111, 64, 131 and 14 tokens with the fed-back ones) in a 22-block pool: a request
    # is preempted and recomputes from its last saved state; the second prompt resumes from the first's.
    loop = serving_loop(model, num_blocks=22)
    ref = np.load(FIXTURE / "reference.npz")
    requests = loop.generate([ref[f"prompt_{i}"].tolist() for i in range(4)], 12)
    for i, request in enumerate(requests):
        want = ref[f"logits_{i}"]
        assert request.output == ref[f"tokens_{i}"].tolist(), f"prompt {i}: tokens"
        got = served_logits(request, len(want))
        computed = ~np.isnan(got).any(axis=1)
        assert_close(got[computed], want[computed], f"prompt {i}")
    assert loop.stats.preemptions >= 1 and loop.stats.prefix_hit_tokens > 0 and loop.stats.device_loops > 0


@pytest.mark.parametrize("apply_copies", [True, False])
def test_one_conversation_needs_its_block_copies(model, monkeypatch, apply_copies):
    # Conversation 0 alone: its last prompt token runs in a device loop, whose first allocation moves the
    # request to a copy of the state saved at its prompt tail (the loop applies it); turn 2 resumes inside
    # block 4 from a copy. With the copies dropped, a request reads a block that does not hold its state.
    import jaxkv

    if not apply_copies:
        monkeypatch.setattr(jaxkv, "copy_blocks", lambda cache, copies, cfg: cache)
    loop = serving_loop(model, num_blocks=52)
    ref = np.load(FIXTURE / "conversations.npz")
    worst, scale = 0.0, 0.0
    for t in range(3):
        (request,) = loop.generate([ref[f"c0_t{t}_prompt"].tolist()], 12)
        want = ref[f"c0_t{t}_logits"]
        positions = sorted(request.logits)  # rows the loop computed (NaN ones too: the pool starts as NaN)
        error = np.abs(served_logits(request, len(want))[positions] - want[positions])
        worst, scale = max(worst, float(np.nan_to_num(error, nan=np.inf).max())), max(scale, np.abs(want).max())
    assert loop.stats.block_copies > 0
    if apply_copies:
        assert worst <= F32_TOLERANCE * scale
    else:
        assert worst > 100 * F32_TOLERANCE * scale
