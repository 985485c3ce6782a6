"""Running examples/decode.py in a child process, for the example tests.

Each run is a child process: the example's imports are relative to examples/ and the
device count is fixed when JAX starts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parents[2] / "examples"
DECODE = [sys.executable, str(EXAMPLES / "decode.py")]
# Tiny model (window 8, block 4), a pool small enough to preempt, a shared system prompt.
TINY = [
    "--tiny",
    "--check",
    "--num-prompts",
    "8",
    "--max-prompt-len",
    "40",
    "--max-new-tokens",
    "16",
    "--block-size",
    "4",
    "--num-blocks",
    "70",
    "--system-prompt-len",
    "12",
    "--max-num-batched-tokens",
    "16",
]
DIGEST = re.compile(r"generated tokens digest (\w+)")


def decode_env(**extra: str) -> dict[str, str]:
    """The child's environment: the CPU, and what the tests' conftest set (XLA's flags and the run's persistent
    compilation cache: each program compiles once for all runs and the test process, not once per run)."""
    return dict(os.environ, JAX_PLATFORMS="cpu", **extra)


def run_decode(*extra: str, timeout: int = 600) -> str:
    result = subprocess.run([*DECODE, *TINY, *extra], env=decode_env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return result.stdout
