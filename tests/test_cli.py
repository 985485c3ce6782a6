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
