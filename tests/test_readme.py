"""The README's example of planning + manager + kernels in a user's own loop runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

README = Path(__file__).parents[1] / "README.md"


def test_readme_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)
    assert "KV cache size:" in capsys.readouterr().out
    assert namespace["out"].shape == (128, 4, 64)
    assert np.isfinite(np.asarray(namespace["out"])).all()
    assert namespace["mgr"].num_computed_tokens("a") == 103  # 100, then 3 in the device loop
    assert np.asarray(namespace["loop"].num_reserved).tolist() == [8]
