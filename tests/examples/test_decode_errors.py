"""examples/decode.py refuses a bad option or checkpoint directory with one line naming it, and no traceback."""

from __future__ import annotations

import subprocess

import pytest
from decode_runs import DECODE, decode_env


def refusal(*args: str) -> str:
    """Runs the example with `args`; asserts it fails with a one-line message on stderr, and returns it."""
    result = subprocess.run([*DECODE, *args], env=decode_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "option, value, low",
    [
        ("--num-blocks", "0", 2),
        ("--num-blocks", "-5", 2),
        ("--num-prompts", "0", 1),
        ("--max-new-tokens", "0", 1),
        ("--block-size", "0", 1),
        ("--max-num-seqs", "0", 1),
        ("--max-num-batched-tokens", "-1", 1),
        ("--decode-steps", "0", 1),
        ("--system-prompt-len", "-1", 0),
        ("--max-prompt-len", "0", 1),
        ("--prefix-match-unit", "0", 1),
        ("--draft-layers", "0", 1),
        ("--tp", "0", 1),
        ("--num-processes", "0", 1),
    ],
)
def test_an_integer_option_below_its_least_value_is_refused_before_jax_starts(option, value, low):
    assert refusal("--tiny", f"{option}={value}") == f"{option} {value}: must be at least {low}"


@pytest.mark.parametrize(
    "config, why",
    [
        (None, "is missing; a checkpoint directory holds config.json"),
        ("garbage{", "is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        ("[1, 2]", "holds a JSON list; expected an object ({...})"),
    ],
)
def test_a_checkpoint_without_a_readable_config_is_refused(config, why, tmp_path):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    line = refusal("--checkpoint", str(tmp_path), "--prompt", "Hi")
    assert line.startswith(f"--checkpoint {tmp_path}: {tmp_path / 'config.json'} {why}")


def test_a_pool_too_small_for_one_request_or_a_garbage_prompt_file_is_refused(tmp_path):
    # Both found once the toy model is built (its pages size the pool), before anything compiles.
    line = refusal("--tiny", "--num-blocks", "3")
    assert line.startswith("--num-blocks 3: available_bytes=") and "not even a 1-token request fits" in line
    (tmp_path / "prompts.json").write_text("garbage{")
    line = refusal("--tiny", "--prompt-tokens", str(tmp_path / "prompts.json"))
    assert line == f"--prompt-tokens {tmp_path / 'prompts.json'}: Expecting value: line 1 column 1 (char 0)"


def test_an_option_argparse_cannot_read_is_one_line():
    assert refusal("--tiny", "--num-blocks", "abc") == (
        "decode.py: error: argument --num-blocks: invalid int value: 'abc' (see --help)"
    )
