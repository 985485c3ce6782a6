"""The example serves Hugging Face checkpoints and computes what transformers computes.

The fixtures (tests/fixtures/hf/<name>/) are tiny random checkpoints with their reference logits,
made by transformers' own PyTorch models (tests/fixtures/hf/make_fixtures.py; versions in
versions.json); these tests need neither torch nor transformers. Each served run goes through the
whole loop: chunked prefill, prefix hits on the prompts' shared prefix, a pool small enough to
preempt and resume, and on-device decode loops.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from decode_runs import DECODE, EXAMPLES, decode_env

sys.path.insert(0, str(EXAMPLES))  # the example's modules, for the in-process tests

FIXTURES = EXAMPLES.parent / "tests" / "fixtures" / "hf"
NAMES = ("gemma3_text", "gemma3", "gpt_oss")
F32_TOLERANCE = 1e-4  # of the logits' scale (their largest magnitude)
BF16_TOLERANCE = 0.05  # bf16 weights, activations and cache against transformers' float32


def load_reference(name: str) -> list[dict[str, np.ndarray]]:
    ref = np.load(FIXTURES / name / "reference.npz")
    count = len([k for k in ref.files if k.startswith("prompt_")])
    return [{key: ref[f"{key}_{i}"] for key in ("prompt", "tokens", "logits")} for i in range(count)]


def serve(name: str, tmp_path, prompts: list[list[int]] | None, max_new_tokens: int, num_blocks: int, *extra: str):
    """Runs examples/decode.py on fixture `name` with these prompts (None: give `--prompt` in `extra`)
    and a pool of `num_blocks`; returns (stdout, per prompt its greedy tokens and logits)."""
    out = tmp_path / "out.npz"
    args = ["--checkpoint", str(FIXTURES / name), "--max-new-tokens", str(max_new_tokens), "--ignore-eos"]
    args += ["--logits-out", str(out), "--block-size", "4", "--max-num-seqs", "3", "--max-num-batched-tokens", "16"]
    args += ["--decode-steps", "4", "--num-blocks", str(num_blocks)]
    if prompts is not None:
        (tmp_path / "prompts.json").write_text(json.dumps(prompts))
        args += ["--prompt-tokens", str(tmp_path / "prompts.json")]
    result = subprocess.run([*DECODE, *args, *extra], env=decode_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    served = np.load(out)
    count = len([k for k in served.files if k.startswith("tokens_")])
    return result.stdout, [{k: served[f"{k}_{i}"] for k in ("tokens", "logits")} for i in range(count)]


def assert_logits_close(ref_logits, got_logits, tolerance: float, what: str) -> int:
    """Every computed row within `tolerance` of the logits' scale (their largest magnitude); returns
    how many rows a prefix hit spared."""
    computed = ~np.isnan(got_logits).any(axis=1)
    scale = np.abs(ref_logits).max()
    err = np.abs(got_logits[computed] - ref_logits[computed]).max()
    assert err <= tolerance * scale, f"{what}: max abs error {err:.3g} at logit scale {scale:.3g}"
    return int((~computed).sum())


def assert_served_as_transformers(name: str, stdout: str, served) -> None:
    """Greedy tokens and float32 logits equal transformers', through preemption, prefix hits and
    on-device decode loops."""
    spared = 0
    for i, (ref, got) in enumerate(zip(load_reference(name), served, strict=True)):
        assert got["tokens"].tolist() == ref["tokens"].tolist(), f"prompt {i}: greedy tokens differ"
        assert got["logits"].shape == ref["logits"].shape
        # The last prompt position and every generated one are always computed.
        assert not np.isnan(got["logits"][len(ref["prompt"]) - 1 :]).any()
        spared += assert_logits_close(ref["logits"], got["logits"], F32_TOLERANCE, f"prompt {i}")
    assert spared > 0 and figure(r"prefix-hit rate: (\d+)/", stdout) > 0  # the shared prefix hit
    assert figure(r"preemptions: (\d+)", stdout) >= 1
    assert figure(r"\((\d+) on-device loops", stdout) >= 1


def figure(pattern: str, stdout: str) -> int:
    return int(re.search(pattern, stdout).group(1))


@pytest.mark.parametrize("name", ["gemma3_text", "gemma3"])
def test_gemma3_served_logits_equal_transformers(name, tmp_path):
    ref = load_reference(name)
    stdout, served = serve(name, tmp_path, [r["prompt"].tolist() for r in ref], 12, 54, "--dtype", "float32")
    assert_served_as_transformers(name, stdout, served)


def test_gpt_oss_text_prompts_served_over_two_devices(tmp_path):
    # 2 KV heads: the cache, the kernels and the sinks split over 2 devices. The prompts go in as text.
    texts = json.loads((FIXTURES / "gpt_oss" / "prompts.json").read_text())
    stdout, served = serve(
        "gpt_oss", tmp_path, None, 12, 48, "--dtype", "float32", "--tp", "2", *sum((["--prompt", t] for t in texts), [])
    )
    assert "sharded as P(None, None, 'model')" in stdout
    assert_served_as_transformers("gpt_oss", stdout, served)
    assert re.search(r"^\[0\] '.+' -> '.+'$", stdout, re.MULTILINE)  # text out


def test_bf16_checkpoint_served_as_stored(tmp_path):
    # bf16 weights, activations and cache, as the checkpoint stores them. bf16 rounding moves the
    # logits by about 2% of their scale, enough to flip a close greedy choice: the reference's
    # tokens are fed as the prompt (teacher forcing), so every position is compared.
    ref = load_reference("gemma3")
    prompts = [np.concatenate([r["prompt"], r["tokens"][:-1]]).tolist() for r in ref]
    stdout, served = serve("gemma3", tmp_path, prompts, 1, 48)
    assert "bfloat16 sharded as" in stdout
    for i, (r, got) in enumerate(zip(ref, served, strict=True)):
        assert_logits_close(r["logits"], got["logits"], BF16_TOLERANCE, f"prompt {i}")


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_gives_the_reference_prompts(name):
    from checkpoint import open_checkpoint

    checkpoint = open_checkpoint(FIXTURES / name)
    texts = json.loads((FIXTURES / name / "prompts.json").read_text())
    for text, ref in zip(texts, load_reference(name)):
        assert checkpoint.encode(text) == ref["prompt"].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_dense_forward_equals_transformers(name):
    import jax.numpy as jnp
    from checkpoint import load_model, open_checkpoint

    model = load_model(open_checkpoint(FIXTURES / name), "float32")
    for ref in load_reference(name):
        tokens = np.concatenate([ref["prompt"], ref["tokens"][:-1]])
        got = np.asarray(model.forward_dense(jnp.asarray(tokens)))
        assert np.abs(got - ref["logits"]).max() <= F32_TOLERANCE * np.abs(ref["logits"]).max()


# ---- bad checkpoints: errors that name the file and the key ---------------------------------


def _copy(name: str, tmp_path):
    return shutil.copytree(FIXTURES / name, tmp_path / name)


def _rewrite_weights(path, edit):
    """Applies `edit(tensors)` to a single-file checkpoint's tensors and writes them back."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def _load(path):
    from checkpoint import load_model, open_checkpoint

    return load_model(open_checkpoint(path))


def test_a_missing_tensor_is_named(tmp_path):
    path = _copy("gemma3_text", tmp_path)
    _rewrite_weights(path, lambda t: t.pop("model.layers.3.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"no tensor 'model\.layers\.3\.self_attn\.k_norm\.weight'"):
        _load(path)


def test_a_tensor_of_the_wrong_shape_is_named(tmp_path):
    path = _copy("gemma3_text", tmp_path)

    def widen(t):
        t["model.layers.0.mlp.up_proj.weight"] = np.zeros((3, 64), t["model.layers.0.mlp.up_proj.weight"].dtype)

    _rewrite_weights(path, widen)
    with pytest.raises(
        ValueError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.up_proj\.weight' has shape"
    ):
        _load(path)


def test_a_missing_shard_is_named(tmp_path):
    path = _copy("gpt_oss", tmp_path)
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ValueError, match=re.escape(shard.name)):
        _load(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, r"model_type='llama'; the example serves"),
        ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=True: bidirectional"),
        ({"attention_bias": True}, r"attention_bias=True"),
        ({"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0}}}, r"rope_type='dynamic'"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path, change, message):
    path = _copy("gemma3_text", tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ValueError, match=message):
        _load(path)


def test_missing_config_is_named(tmp_path):
    path = _copy("gemma3_text", tmp_path)
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json is missing"):
        _load(path)


# ---- config forms and stored formats ----------------------------------------------------------


def test_legacy_gemma3_config_reads_as_the_new_form():
    # Published Gemma 3 configs give rope_theta, rope_local_base_freq, rope_scaling and
    # sliding_window_pattern instead of rope_parameters per layer type and layer_types.
    from hf_config import TextConfig

    config = json.loads((FIXTURES / "gemma3_text" / "config.json").read_text())
    rope = config["rope_parameters"]
    legacy = {
        **{k: v for k, v in config.items() if k != "rope_parameters"},
        "rope_theta": rope["full_attention"]["rope_theta"],
        "rope_local_base_freq": rope["sliding_attention"]["rope_theta"],
        "rope_scaling": {"rope_type": "linear", "factor": rope["full_attention"]["factor"]},
        "sliding_window_pattern": 3,
        "layer_types": None,
    }
    new, old = TextConfig.from_hf(config), TextConfig.from_hf(legacy)
    assert old.rope == new.rope
    assert old.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2 + ("sliding_attention",)


def test_mxfp4_experts_are_dequantized_as_transformers_does():
    from checkpoint import dequantize_mxfp4

    blocks = np.zeros((1, 2, 1, 16), np.uint8)  # [E, out, groups, 16 bytes]
    blocks[0, 0, 0, 0] = 0x21  # low nibble first: codes 1 (0.5) then 2 (1.0)
    blocks[0, 1, 0, 15] = 0xF7  # codes 7 (6.0) then 15 (-6.0)
    scales = np.array([[[128], [125]]], np.uint8)  # 2^(128-127) and 2^(125-127)
    w = dequantize_mxfp4(blocks, scales)  # [E, in, out]
    assert w.shape == (1, 32, 2)
    assert w[0, :2, 0].tolist() == [1.0, 2.0] and not w[0, 2:, 0].any()
    assert w[0, 30:, 1].tolist() == [1.5, -1.5] and not w[0, :30, 1].any()


def test_published_gemma3_4b_config_reads_with_transformers_defaults():
    from hf_config import TextConfig

    config = json.loads((EXAMPLES.parent / "tests" / "configs" / "gemma3_4b_it.json").read_text())
    text = TextConfig.from_hf(config)
    assert (text.num_heads, text.num_kv_heads, text.head_dim, text.vocab_size) == (8, 4, 256, 262208)
    assert text.sm_scale == 256**-0.5  # query_pre_attn_scalar's default
    assert text.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    full, local = dict(text.rope)["full_attention"], dict(text.rope)["sliding_attention"]
    assert full.inv_freq[0] == 1 / 8 and local.inv_freq[0] == 1  # linear factor 8 on full layers only
    assert full.inv_freq[1] == pytest.approx(1e6 ** (-2 / 256) / 8)


def test_only_the_text_only_gemma3_applies_the_final_softcap():
    # transformers' Gemma3ForConditionalGeneration ignores text_config.final_logit_softcapping;
    # Gemma3ForCausalLM applies it.
    from hf_config import TextConfig

    multimodal = json.loads((FIXTURES / "gemma3" / "config.json").read_text())
    multimodal["text_config"]["final_logit_softcapping"] = 30.0
    assert TextConfig.from_hf(multimodal).final_logit_softcapping is None
    text_only = json.loads((FIXTURES / "gemma3_text" / "config.json").read_text())
    assert TextConfig.from_hf(text_only).final_logit_softcapping == 30.0


def test_qwen3_next_checkpoint_served_by_decode(tmp_path):
    # Its state layers make every block 24 tokens (--block-size 4 aligns them); a unit of 4 lets hits and saved
    # prompt-tail states fall inside a block. Tests in test_qwen3_next.py serve conversations and preemption.
    ref = load_reference("qwen3_next")
    stdout, served = serve(
        "qwen3_next",
        tmp_path,
        [r["prompt"].tolist() for r in ref],
        12,
        24,
        "--dtype",
        "float32",
        "--prefix-match-unit",
        "4",
    )
    for i, (want, got) in enumerate(zip(ref, served, strict=True)):
        assert got["tokens"].tolist() == want["tokens"].tolist(), f"prompt {i}: greedy tokens differ"
        assert_logits_close(want["logits"], got["logits"], F32_TOLERANCE, f"prompt {i}")
    assert figure(r"block copies: (\d+)", stdout) > 0 and figure(r"\((\d+) on-device loops", stdout) >= 1


def _mxfp4(w: np.ndarray):
    """An independent MXFP4 encoding of w [E, in, out] whose groups of 32 inputs are exact in it: (blocks
    [E, out, in / 32, 16], scales [E, out, in / 32], the values it encodes [E, in, out])."""
    fp4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    rows = w.astype(np.float32).transpose(0, 2, 1).reshape(*w.shape[0:1], w.shape[2], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(rows).max(-1, keepdims=True), 1e-30) / 6)).astype(np.int32)
    codes = np.abs(rows[..., None] / 2.0 ** exponent[..., None] - fp4).argmin(-1).astype(np.uint8)
    values = fp4[codes] * 2.0**exponent
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = np.ascontiguousarray(exponent[..., 0] + 127, np.uint8)  # safetensors writes strided arrays wrong
    return blocks, scales, values.reshape(rows.shape[:2] + (-1,)).transpose(0, 2, 1)


def test_mxfp4_experts_load_end_to_end(tmp_path):
    # gpt-oss as published: expert matrices as *_blocks and *_scales in one file.
    from checkpoint import Weights
    from safetensors.numpy import save_file

    path = shutil.copytree(FIXTURES / "gpt_oss", tmp_path / "gpt_oss")
    source = Weights(path)
    tensors, expected = {}, {}
    for key in source.files:
        array = source.read(key)
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, expected[key] = _mxfp4(array)
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
        else:
            tensors[key] = array
    for shard in [*path.glob("model-*.safetensors"), path / "model.safetensors.index.json"]:
        shard.unlink()
    save_file(tensors, path / "model.safetensors")
    weights = Weights(path)
    for key, values in expected.items():
        np.testing.assert_array_equal(weights.get(key, values.shape), values)
    model = _load(path)
    assert model.layers[0].mlp.gate_up_proj[...].dtype == model.embed_tokens[...].dtype  # one dtype, as stored
