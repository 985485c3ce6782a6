#!/usr/bin/env python3
"""Paired A/B of the host backend: one replay of a serving workload in which every manager call runs on two
managers, the working tree's jaxkv (A) and a git revision's (B), alternating which goes first.

This VM's speed drifts by up to ±30% between runs, which hides a 10% change in single runs; timing both
managers call by call, in one process, cancels the drift. The B package is the revision's `jaxkv/` copied
as `jaxkv_base` (imports rewritten). Both managers get the same requests, keys (each its own package's
`UnitHasher`) and calls; their results are compared after every call (AssertionError if they differ), so
the run also checks that A decides as B does.

    python benchmarks/host_ab.py --workload /tmp/workload.json --num-blocks 32768 --base HEAD

Prints µs per engine step by call, A, B and A/B. `--base HEAD` with a clean tree is an A/A run: its ratios
show the harness's own noise.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import benchmarks.serving_workload as sw  # noqa: E402

_IMPORTS = re.compile(r"\b(from|import) jaxkv\b")


def load_revision(rev: str, into: Path) -> types.ModuleType:
    """The revision's jaxkv package, imported as `jaxkv_base` from `into`."""
    tar = subprocess.run(["git", "archive", rev, "jaxkv"], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(into, filter="data")
    (into / "jaxkv").rename(into / "jaxkv_base")
    for path in (into / "jaxkv_base").rglob("*.py"):
        path.write_text(_IMPORTS.sub(r"\1 jaxkv_base", path.read_text()))
    sys.path.insert(0, str(into))
    return importlib.import_module("jaxkv_base")


class PairedManager:
    """Forwards every call to manager A and manager B, timing each into `seconds[tag][method]`."""

    def __init__(self, a, b, hasher_b):
        self.a, self.b, self.hasher_b, self._b_first = a, b, hasher_b, False
        self.seconds = {"A": defaultdict(float), "B": defaultdict(float)}
        self.calls = defaultdict(int)

    def __getattr__(self, name):
        method_a, method_b = getattr(self.a, name), getattr(self.b, name)
        if not callable(method_a):
            return method_a

        def call(*args, **kw):
            kw_b = dict(kw)
            if kw.get("unit_hasher") is not None:  # B's own hasher (the same keys)
                kw_b["unit_hasher"] = self.hasher_b(self.b.prefix_config.unit)
                kw_b["unit_hasher"].extend(args[1])
            runs = [("A", method_a, kw), ("B", method_b, kw_b)]
            self._b_first = not self._b_first
            out = {}
            for tag, method, kwargs in runs[::-1] if self._b_first else runs:
                t = time.perf_counter()
                out[tag] = method(*args, **kwargs)
                self.seconds[tag][name] += time.perf_counter() - t
            self.calls[name] += 1
            if isinstance(out["A"], np.ndarray) and not np.array_equal(out["A"], out["B"]):
                raise AssertionError(f"call {self.calls[name]} of {name}{args}: A gave {out['A']}, B {out['B']}")
            return out["A"]

        return call


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, help="JSON file from ../shared/workloads/serving_workload.py")
    p.add_argument("--num-blocks", type=int, default=32768, help="pool size, the null block included")
    p.add_argument("--base", default="HEAD", help="the git revision B runs")
    a = p.parse_args(argv)
    args = sw.argument_parser().parse_args(
        ["--workload", a.workload, "--num-blocks", str(a.num_blocks), "--backend", "host", "--warmup-replays", "0"]
    )
    with tempfile.TemporaryDirectory() as tmp:
        base = load_revision(a.base, Path(tmp))
        base_manager = importlib.import_module("jaxkv_base.manager").KVCacheManager
        plan_a, make_a = sw.gemma3_27b_config, sw.KVCacheManager
        pairs = []

        def paired(cfg, **kw):  # B's config from its own classes, planned the same way
            names = ("FullAttentionSpec", "SlidingWindowSpec", "plan")
            saved = [getattr(sw, name) for name in names]
            for name in names:
                setattr(sw, name, getattr(base, name))
            try:
                cfg_b = plan_a(args.num_blocks, args.max_model_len, args.max_num_batched_tokens)
            finally:
                for name, value in zip(names, saved):
                    setattr(sw, name, value)
            pairs.append(PairedManager(make_a(cfg, **kw), base_manager(cfg_b, **kw), base.UnitHasher))
            return pairs[-1]

        sw.KVCacheManager = paired
        out = sw.replay(args, json.load(open(a.workload)))
    pair, steps = pairs[0], out["steps"]
    print(f"{steps} steps, {out['prefix_hit_tokens']} hit tokens; µs per step, A = working tree, B = {a.base}")
    print(f"  {'call':28s} {'A':>8s} {'B':>8s}   A/B")
    totals = np.zeros(2)
    for name in sorted(pair.calls, key=lambda n: -pair.seconds["B"][n]):
        us = np.array([pair.seconds[tag][name] for tag in "AB"]) / steps * 1e6
        totals += us
        if us[1] >= 1:  # calls of no weight (warm_up) are left out of the table, not of the total
            print(f"  {name:28s} {us[0]:8.0f} {us[1]:8.0f}  {us[0] / us[1]:5.2f}  ({pair.calls[name]} calls)")
    print(f"  {'all':28s} {totals[0]:8.0f} {totals[1]:8.0f}  {totals[0] / totals[1]:5.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
