"""The example serving loop equals a dense, cache-free forward pass (examples/decode.py --check).

Each run is a child process: the example's imports are relative to examples/ and the
device count is fixed when JAX starts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[2] / "examples"
# Tiny model (window 8, block 4), a pool small enough to preempt, a shared system prompt.
TINY = ["--tiny", "--check", "--num-prompts", "8", "--max-prompt-len", "40", "--max-new-tokens", "16",
        "--block-size", "4", "--num-blocks", "70", "--system-prompt-len", "12", "--max-num-batched-tokens", "16"]


_COMPILATION_CACHE: list[str] = []  # one persistent compilation cache for the module's runs


@pytest.fixture(autouse=True, scope="module")
def _shared_compilation_cache(tmp_path_factory):
    """The runs share compiled programs (every allocation work signature compiles once, not once per run)."""
    _COMPILATION_CACHE.append(str(tmp_path_factory.mktemp("jax-compilation-cache")))
    yield
    _COMPILATION_CACHE.clear()


def run_decode(*extra: str, timeout: int = 600) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if _COMPILATION_CACHE:
        env["JAX_COMPILATION_CACHE_DIR"] = _COMPILATION_CACHE[0]
    result = subprocess.run([sys.executable, str(EXAMPLES / "decode.py"), *TINY, *extra], env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def one_device() -> str:
    return run_decode()


def test_paged_loop_matches_dense_forward(one_device):
    # Every logit row the loop computed (chunked prefill, windows, prefix hits, preemption and
    # resumption, device decode loops).
    assert re.search(r"check: \d+ logit rows of 8 requests .*; 0 mismatching requests", one_device)
    assert int(re.search(r"preemptions: (\d+)", one_device).group(1)) >= 1
    assert int(re.search(r"\((\d+) on-device loops", one_device).group(1)) >= 1
    assert int(re.search(r"prefix-hit rate: (\d+)/", one_device).group(1)) > 0  # the shared system prompt


def test_sharded_over_four_devices_gives_the_same_tokens(one_device):
    sharded = run_decode("--tp", "4")
    assert "sharded as P(None, None, 'model')" in sharded
    assert re.search(r"; 0 mismatching requests", sharded)
    digest = re.compile(r"generated tokens digest (\w+)")
    assert digest.search(sharded).group(1) == digest.search(one_device).group(1)


def test_pool_running_dry_inside_a_device_decode_loop_preempts():
    # Two long decodes in a 54-block pool: a device loop stalls, the host step preempts one.
    out = run_decode("--num-prompts", "2", "--max-prompt-len", "4", "--system-prompt-len", "2",
                     "--max-new-tokens", "60", "--num-blocks", "54")
    assert re.search(r"check: \d+ logit rows of 2 requests .*; 0 mismatching requests", out)
    assert int(re.search(r"preemptions: (\d+)", out).group(1)) >= 1
