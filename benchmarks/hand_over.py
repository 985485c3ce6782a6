#!/usr/bin/env python3
"""What a device loop's hand-over costs beside one host step's bookkeeping, on the default (host) manager.

Model: Gemma-3-27B-like (`serving_workload.gemma3_27b_config`: 6 sliding-window groups, window 1024, one full
group, block 16), max_model_len 32,768. `--num-requests` decoding requests (seeded prompts of 64 to
`--max-prompt-len` tokens, computed, each with its sampled token appended), prefix caching on. Side by side,
in alternating rounds, on the same manager state:

- host step: one decode step's bookkeeping, every manager call it makes: `allocate_slots_batch` (1 token
  each) and `append_token_ids_batch` (the token each sampled);
- hand-over: `hand_over` (the loop's `--steps` tokens reserved per request, the requests' tables and counts
  handed over as numpy arrays), their transfer to the device (a jitted call that reads them, less the same
  call with them already there: what the loop's own call adds) and `hand_back` (the rest of the reservation
  given back and the filled blocks indexed, in the next loop's allocation), without the appends of the loop's
  tokens, which `hand_back` makes and which every step makes in any design ("the loop's appends": the
  `--steps` tokens of each request checked and hashed, timed inside `hand_back`);
- take/adopt: `take_state` plus `adopt_state`, the whole state to a jitted loop and back (what the example did
  before `hand_over`; its appends came after, not counted here, nor the loop's own allocations).

Each round makes `--calls` calls of each case in a row (a loop's hand-back settles in the next loop's
`hand_over`, as back-to-back loops do); prints the median over `--rounds` rounds of the µs per call, per pool,
and the bytes the hand-over transfers.

    python benchmarks/hand_over.py --num-blocks 32768 131072
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from serving_workload import gemma3_27b_config, sync_cpu_dispatch  # noqa: E402

from jaxkv import KVCacheManager, validation  # noqa: E402


def decoding_manager(num_blocks: int, num_requests: int, max_prompt_len: int, seed: int = 0):
    """A host manager holding `num_requests` decoding requests, and their ids."""
    cfg = gemma3_27b_config(num_blocks, 32768, 8192)
    mgr = KVCacheManager(cfg, max_num_seqs=256)
    rng = np.random.default_rng(seed)
    ids = list(range(num_requests))
    for rid in ids:
        prompt = rng.integers(0, 32000, int(rng.integers(64, max_prompt_len + 1))).tolist()
        mgr.add_request(rid, prompt)
        assert mgr.allocate_slots(rid, len(prompt)), "the pool cannot hold the requests: fewer or shorter"
    mgr.mark_computed()
    mgr.append_token_ids_batch(ids, [[1]] * num_requests)
    return mgr, ids


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def measure(num_blocks: int, args) -> dict:
    mgr, ids = decoding_manager(num_blocks, args.num_requests, args.max_prompt_len)
    n = len(ids)
    token = iter(range(2, 1 << 30))
    read = jax.jit(lambda rows: sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(rows)))  # needs every byte
    append_us = []  # the appends inside hand_back (their tokens' checks and hashing), timed apart
    for module, name in ((validation, "token_lists"), (mgr, "_append")):
        setattr(module, name, functools.partial(timed_call, getattr(module, name), append_us))
    parts = {}

    def host_step():
        assert mgr.allocate_slots_batch(ids, [1] * n).all()
        mgr.append_token_ids_batch(ids, [[next(token)] for _ in ids])

    def hand_over():
        produced = [[next(token) for _ in range(args.steps)] for _ in ids]  # what the loop samples
        start = time.perf_counter()
        rows = mgr.hand_over(ids, [args.steps] * n)  # one row per request (the default)
        reserved = time.perf_counter()
        assert rows is not None, "the pool ran dry: fewer requests or rounds"
        # The transfer: the loop's call with the rows as numpy arrays, less the same call with them on device.
        on_device = jax.block_until_ready(jax.device_put(rows))
        transfer = timed(lambda: jax.block_until_ready(read(rows))) - timed(
            lambda: jax.block_until_ready(read(on_device))
        )
        append_us.clear()
        back = timed(lambda: mgr.hand_back(ids, produced))
        parts["bytes"] = sum(x.nbytes for x in jax.tree_util.tree_leaves(rows))
        parts.setdefault("transfer", []).append(transfer)
        parts.setdefault("appends", []).append(sum(append_us))
        return (reserved - start) * 1e6 + max(transfer, 0.0) + back - sum(append_us)

    def take_adopt():
        state = mgr.take_state()
        jax.block_until_ready(state)
        mgr.adopt_state(state, ids)

    cases = {"host step": lambda: timed(host_step), "hand-over": hand_over, "take/adopt": lambda: timed(take_adopt)}
    times = {name: [] for name in cases}
    for _ in range(args.rounds + 1):  # the first round compiles (numba's cache, jax's programs): not counted
        for name, fn in cases.items():  # each `--calls` times in a row: back-to-back loops settle in the next one
            times[name].append(statistics.mean(fn() for _ in range(args.calls)))
    out = {"num_blocks": num_blocks, "num_requests": n, "steps": args.steps}
    out.update({f"{name} us": round(statistics.median(t[1:]), 1) for name, t in times.items()})
    for name in ("transfer", "appends"):
        out[f"{name} us"] = round(statistics.median(parts[name][args.calls :]), 1)
    out["hand-over / host step"] = round(out["hand-over us"] / out["host step us"], 2)
    out["take/adopt / host step"] = round(out["take/adopt us"] / out["host step us"], 2)
    out["transferred bytes"] = parts["bytes"]
    return out


def timed_call(fn, record: list, *args):
    start = time.perf_counter()
    result = fn(*args)
    record.append((time.perf_counter() - start) * 1e6)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-blocks", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--max-prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8, help="decode steps of one device loop")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--calls", type=int, default=4, help="calls of each case in a row, per round")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    sync_cpu_dispatch()
    rows = [measure(b, args) for b in args.num_blocks]
    if args.json:
        print(json.dumps({"jax": jax.__version__, "rows": rows}))
        return 0
    print(f"jax {jax.__version__}; {args.num_requests} decoding requests, loops of {args.steps} steps; median µs")
    print(
        "| pool | host step | hand-over | of which transfer | take/adopt | hand-over / host step "
        "| take/adopt / host step | the loop's appends | transferred |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['num_blocks']:,} | {r['host step us']:,} | {r['hand-over us']:,} | {r['transfer us']:,} "
            f"| {r['take/adopt us']:,} | {r['hand-over / host step']} | {r['take/adopt / host step']} "
            f"| {r['appends us']:,} | {r['transferred bytes']:,} B |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
