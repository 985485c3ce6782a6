"""One style across the repository: ruff's linter and formatter (configured in pyproject.toml) find nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_finds_nothing(command):
    run = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"ruff {' '.join(command)} . (fix with: ruff check --fix . && ruff format .)\n" + (
        run.stdout + run.stderr
    )
