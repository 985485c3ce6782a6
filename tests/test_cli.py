"""The command line: `python -m jaxkv plan ...` on every sample config."""

import argparse
import glob
import json
import pathlib
import subprocess
import sys

import pytest

from jaxkv.cli import main, parse_bytes

ROOT = pathlib.Path(__file__).parent.parent
CONFIGS = sorted(glob.glob(str(ROOT / "tests/configs/*.json")))
GEMMA, LLAMA = str(ROOT / "tests/configs/gemma3_27b.json"), str(ROOT / "tests/configs/llama3_8b.json")
PLAN = ["plan", "--memory", "4GiB", "--max-model-len", "1024"]


def llama(**changes) -> str:
    """llama3_8b's config.json with `changes`, as file text."""
    return json.dumps({**json.loads(pathlib.Path(LLAMA).read_text()), **changes})


def test_parse_bytes():
    assert parse_bytes("40GiB") == 40 << 30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("4096MiB") == 4 << 30
    assert parse_bytes("123456") == 123_456
    with pytest.raises(argparse.ArgumentTypeError, match="'40 parsecs' is not a size"):
        parse_bytes("40 parsecs")


@pytest.mark.parametrize("path", CONFIGS)
def test_plan_runs_on_every_sample_config(path, capsys):
    assert main(["plan", "--hf-config", path, "--memory", "40GiB", "--max-model-len", "32768"]) == 0
    out = capsys.readouterr().out
    assert "KV cache size:" in out and "Maximum concurrency for 32,768 tokens per request" in out


@pytest.mark.parametrize("path", CONFIGS)
def test_plan_json_on_every_sample_config(path, capsys):
    argv = ["plan", "--hf-config", path, "--memory", "40GiB", "--max-model-len", "32768", "--json"]
    assert main([*argv, "--grouping", "vllm", "--layout", "LBNHC"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capacity_tokens"] == int(out["max_concurrency"] * 32768)
    assert out["layout"] == "LBNHC" and len(out["tensors"]) >= len(out["groups"]) >= 1


def test_readme_command_prints_gemma3_27b_summary():
    cmd = [sys.executable, "-m", "jaxkv", "plan", "--hf-config", GEMMA,
           "--memory", "40GiB", "--max-model-len", "32768", "--grouping", "vllm"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "KV cache size: 334,916 tokens" in out and "All full attention: KV cache size: 84,560 tokens" in out


def test_too_small_budget_exits_2_saying_what_fits(capsys):
    argv = ["plan", "--hf-config", LLAMA, "--memory", "4GiB", "--max-model-len", "65536"]
    assert main(argv) == 2
    assert "longest max_model_len that fits is 32,752" in capsys.readouterr().err


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "gemma.png"
    argv = ["plan", "--hf-config", GEMMA, "--memory", "40GiB", "--max-model-len", "4096"]
    assert main([*argv, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    argv = ["plan", "--hf-config", LLAMA, "--memory", "4GiB", "--max-model-len", "1024"]
    with pytest.raises(SystemExit, match=r"pip install 'jaxkv\[plot\]'"):
        main([*argv, "--plot", str(tmp_path / "x.png")])


@pytest.mark.parametrize(
    "argv, text, named",
    [
        pytest.param([*PLAN, "--hf-config"], "[1, 2]", "{path}: expected a JSON object", id="config-is-a-list"),
        pytest.param([*PLAN, "--hf-config"], "garbage{", "{path}: not a JSON file", id="config-not-json"),
        pytest.param(
            [*PLAN, "--hf-config"],
            llama(num_hidden_layers="sixty"),
            "config.json: num_hidden_layers='sixty' must be a positive integer",
            id="count-is-a-string",
        ),
        pytest.param([*PLAN, "--hf-config"], llama(num_hidden_layers=2.5), "num_hidden_layers=2.5", id="count-float"),
        pytest.param([*PLAN, "--hf-config"], llama(num_attention_heads="32"), "num_attention_heads='32'", id="heads"),
        pytest.param([*PLAN, "--hf-config"], llama(head_dim=0), "config.json: head_dim=0 must be", id="head-dim-0"),
        pytest.param([*PLAN, "--hf-config"], llama(text_config=[1]), "text_config=[1]", id="text-config-list"),
        pytest.param(
            ["plan", "--memory", "99999999999TiB", "--max-model-len", "1024", "--hf-config"],
            llama(),
            "int32 slots address (134,217,728 blocks); give at most 281,474,976,710,656 B (a smaller --memory",
            id="memory-beyond-int32-slots",
        ),
        pytest.param(["layout", "--specs"], "[1]", "{path}: expected a JSON object", id="specs-is-a-list"),
        pytest.param(["layout", "--specs"], '{"a": 5}', "layer 'a': expected {'spec'", id="spec-is-a-number"),
        pytest.param(
            ["layout", "--specs"],
            '{"a": {"spec": "FullAttentionSpec", "block_size": 16, "bogus": 1}}',
            "layer 'a': FullAttentionSpec.__init__() got an unexpected keyword argument 'bogus'",
            id="spec-field-unknown",
        ),
        pytest.param(["layout", "--hf-config"], "garbage{", "{path}: not a JSON file", id="layout-config-not-json"),
        pytest.param(["layout", "--block-table", "a,b", "--hf-config"], llama(), "--block-table 'a,b'", id="table"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_it(argv, text, named, tmp_path, capsys):
    path = tmp_path / "input.json"
    path.write_text(text)
    assert main([*argv, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert named.replace("{path}", str(path)) in err


@pytest.mark.parametrize(
    "command, option, value",
    [
        *[("plan", o, v) for o in ("--max-model-len", "--max-num-batched-tokens", "--max-groups") for v in ("0", "-1")],
        ("plan", "--block-size", "0"),
        ("plan", "--block-size", "-3"),
        ("plan", "--memory", "0"),
        ("layout", "--num-layers", "0"),
        ("layout", "--block-size", "0"),
        ("layout", "--max-model-len", "-1"),
    ],
)
def test_non_positive_option_is_refused_by_argparse_naming_it(command, option, value, capsys):
    # argparse's own error, as one line naming the option; exit status 2.
    argv = {"plan": PLAN, "layout": ["layout"]}[command]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--hf-config", LLAMA, f"{option}={value}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"error: argument {option}: '{value}' is " in err
