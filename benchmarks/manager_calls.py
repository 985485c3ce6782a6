#!/usr/bin/env python3
"""Where a jitted allocation's time goes: dispatch, the transition's fixed cost, and its cost per block.

For the Gemma-3-27B-like config of serving_workload.py (7 groups, block 16) at two pool sizes, with prefix
caching off and on, times (best of 5 × 30 calls, µs per call, result on the host):
  dispatch   a jitted function that takes the ManagerState (donated) and returns it untouched;
  noop       `KVCacheManager.allocate_slots_batch` of R decode rows that need no new block;
  new_block  R rows that each need one new block per group (7·R new entries);
  prefill    2 rows of 4,096 new tokens (2 × 7 × 256 = 3,584 new blocks), R − 2 decode rows;
  release    R rows of one new block per group, after R/8 rows were prefilled to 1,536 tokens:
             their 6 sliding groups each release 32 blocks (R/8 × 192 entries).
With caching on, every refill gives the rows prompts not seen before (no hits, nothing indexed twice):
the calls index every block they fill, as a serving step does.
Each case also reports the work signature of its timed call (`jaxkv.core.step.StepWork`; None: no dispatch)
and the HLO instructions of that program. `--program both` measures the default manager (specialised
steps) beside `specialize_steps=False` (every step the full program with every row) in one run.

    python benchmarks/manager_calls.py --json
    python benchmarks/manager_calls.py --pools 32768 --caching on --json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from serving_workload import gemma3_27b_config, sync_cpu_dispatch  # noqa: E402

from jaxkv.manager import KVCacheManager  # noqa: E402
from jaxkv.manager.jax_engine import UPLOAD_ROWS  # noqa: E402
from jaxkv.prefix.state import UPLOAD_WORDS  # noqa: E402

BLOCK = 16


def program_ops(mgr: KVCacheManager, work, num_rows: int) -> int:
    """HLO instructions of the compiled allocation program of signature `work` for `num_rows` rows."""
    rows = np.zeros((5, num_rows), np.int32)
    uploads = None
    if mgr.prefix_config is not None:
        uploads = np.zeros((UPLOAD_ROWS, UPLOAD_WORDS), np.uint32)
    text = (
        mgr._engine._allocate_fn.lower(
            mgr._engine._state, rows, mgr._engine._device_counts(), None, uploads, None, work=work
        )
        .compile()
        .as_text()
    )
    return sum(1 for line in text.splitlines() if re.match(r"\s+(ROOT )?\S+ = ", line))


def best_us(fn, setup, repeats=5, calls=30):
    """Best mean over `repeats` of `calls` calls of fn(); setup() before each call, untimed."""
    best = float("inf")
    for _ in range(repeats):
        total = 0.0
        for _ in range(calls):
            setup()
            t = time.perf_counter()
            fn()
            total += time.perf_counter() - t
        best = min(best, total / calls)
    return best * 1e6


def measure(num_blocks: int, num_rows: int, caching: bool, specialize: bool) -> dict:
    cfg = gemma3_27b_config(num_blocks, 32768, 8192)
    out, programs = {}, {}
    mgr = KVCacheManager(
        cfg, max_num_seqs=256, enable_prefix_caching=caching, specialize_steps=specialize, backend="jax"
    )
    if not specialize:
        mgr.warm_up()  # specialised signatures compile on first use, outside the best of 5
    passthrough = jax.jit(lambda state, x: (state, x + 1), donate_argnums=0)
    holder = {"state": mgr.take_state()}

    def dispatch():
        holder["state"], x = passthrough(holder["state"], np.int32(0))
        np.asarray(x)

    out["dispatch"] = best_us(dispatch, lambda: None)
    mgr.adopt_state(holder["state"], [])

    ids = list(range(num_rows))
    counter = {"n": 0, "prompts": 0}

    def add_all():
        """Adds every row with a prompt not seen before (token ids apart from every earlier one's)."""
        for i in ids:
            counter["prompts"] += 1
            mgr.add_request(i, [counter["prompts"]] * 9000)

    add_all()

    def fresh(prefill_tokens):
        """Frees everything, then prefills every row to `prefill_tokens` (untimed)."""
        mgr.mark_computed()  # the steps ran: their blocks stay cached, as in serving
        mgr.free_batch(ids)
        add_all()
        mgr.allocate_slots_batch(ids, prefill_tokens)
        _ = mgr.num_free_blocks  # reading it applies the pending frees

    # noop: rows at 1 token into a block decode one more token (no block boundary).
    fresh([BLOCK + 1] * num_rows)
    out["noop"] = best_us(lambda: mgr.allocate_slots_batch(ids, [1] * num_rows), lambda: None, calls=10)
    programs["noop"] = mgr.last_work

    def at_boundary():
        if counter["n"] % 10 == 0:
            fresh([BLOCK * 2] * num_rows)
        counter["n"] += 1

    def one_each():
        mgr.allocate_slots_batch(ids, [BLOCK] * num_rows)  # one new block per group per row

    out["new_block"] = best_us(one_each, at_boundary, calls=9)
    programs["new_block"] = mgr.last_work

    def prefill_setup():
        fresh([BLOCK + 1] * num_rows)

    out["prefill"] = best_us(
        lambda: mgr.allocate_slots_batch(ids, [4096, 4096] + [1] * (num_rows - 2)), prefill_setup, calls=5
    )
    programs["prefill"] = mgr.last_work

    eighth = max(num_rows // 8, 1)

    def release_setup():
        fresh([1536] * eighth + [BLOCK] * (num_rows - eighth))

    out["release"] = best_us(lambda: mgr.allocate_slots_batch(ids, [BLOCK] * num_rows), release_setup, calls=5)
    programs["release"] = mgr.last_work
    out = {k: round(v, 1) for k, v in out.items()}
    for case, work in programs.items():  # the signature of each case's timed call and its program's size
        out[f"{case}_work"] = None if work is None else str(work)
        out[f"{case}_ops"] = 0 if work is None else program_ops(mgr, work, mgr._engine._num_rows(num_rows))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--pools", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 256])
    p.add_argument("--caching", choices=["on", "off", "both"], default="both")
    p.add_argument(
        "--program",
        choices=["specialised", "full", "both"],
        default="both",
        help="specialised: each step's own work signature (the default manager); full: "
        "specialize_steps=False, every step the full program with every row",
    )
    args = p.parse_args(argv)
    sync_cpu_dispatch()
    cachings = {"on": [True], "off": [False], "both": [False, True]}[args.caching]
    programs = {"specialised": [True], "full": [False], "both": [True, False]}[args.program]
    results = {
        f"{num_blocks}/R={num_rows}/caching {'on' if caching else 'off'}/"
        f"{'specialised' if specialize else 'full'}": measure(num_blocks, num_rows, caching, specialize)
        for num_blocks in args.pools
        for num_rows in args.rows
        for caching in cachings
        for specialize in programs
    }
    if args.json:
        print(json.dumps(results))
    else:
        for key, row in results.items():
            print(key, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
