#!/usr/bin/env python3
"""Replays a serving workload through jaxkv's batched manager API (the default engine, or `--backend jax`) and times
the KV bookkeeping.

The workload file comes from ../shared/workloads/serving_workload.py; the
scheduler is the one of ../shared/workloads/serving-workload.md (synchronous
FCFS, chunked prefill, LIFO preemption, admission only when nothing was
preempted and only when the whole request fits). A step is one
`allocate_slots_batch` dispatch in the common case:

1+2. the running requests the budget reaches, in admission order, then the
   waiting requests admission would try (`add_request` first, host-only), with
   `full_sequence_must_fit` on the latter: the batch stops at the first row
   that does not fit, which is both scheduler rules at once (a failing running
   row fails every candidate: no admission after a preemption; a failing
   candidate stops admission). Candidates not admitted are dropped again
   (host-only). On a running failure, the most recently admitted running
   request is preempted (`free_batch`) and the batch retried from the failed
   row (one more dispatch per preemption);
3. model step: the manager is told it ran (`mark_computed`), computed counts
   advance, a request whose prompt is computed appends its next output token (`append_token_ids`, timed apart, as vLLM's
   peer times token appending apart), finished requests are freed
   (`free_batch`: recorded on the host, applied on the device at the start of
   the next step's dispatch).

Prefix caching is on (`--no-prefix-caching` turns it off): every prompt is hashed
when the replay starts (request arrival; timed apart, as vLLM's peer times
creating its requests), the admission candidates are looked up (`get_computed_tokens_batch`,
timed: in one dispatch, as many as the budget could take without hits, at most 8; with hits a
further lookup may follow) and their hits claimed in the batch.

Model: Gemma-3-27B-like, `plan(..., grouping="vllm")` (6 sliding-window groups of
9, 9, 9, 9, 8, 8 layers, window 1024, and one full-attention group of 10; block size 16). Prints one
JSON line; exits non-zero if a block is not back in the pool at the end.

    python benchmarks/serving_workload.py --workload /tmp/workload.json --json
    python benchmarks/serving_workload.py --workload /tmp/workload.json --num-blocks 32768 --json

`--speculate K`: speculative decoding with K drafts per decoding row (the rule of
benchmarks/vllm_workload_speculate.patch, vLLM's side): a running request whose last sampled token
is its only uncomputed one schedules it and d = min(K, outputs left − 1, budget − 1, room) drafts, of
which a = (id + outputs so far) mod (d + 1) are accepted: the step rejects d − a
(`reject_tokens_batch`, timed), the request advances by 1 + a and appends a + 1 tokens.

`--trace FILE` writes what each step scheduled, preempted and left free; with prefix
caching off on vLLM's side, `benchmarks/compare_vllm_trace.py` checks it against the
trace of ../shared/peers/vllm/workload.py step by step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import deque

import jax

from jaxkv import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec, UnitHasher, plan
from jaxkv.core.invariants import check_invariants
from jaxkv.manager import KVCacheManager

NUM_LAYERS, WINDOW, BLOCK_SIZE = 62, 1024, 16
LOOKUP_ROWS = 8  # admission candidates looked up in one dispatch (the manager's small batch)


def gemma3_27b_config(num_blocks: int, max_model_len: int, max_num_batched_tokens: int) -> KVCacheConfig:
    """Gemma-3-27B-like (layer i is full attention iff i % 6 == 5), planned with vLLM's grouping
    (6 sliding-window groups of 9, 9, 9, 9, 8, 8 layers and one full group of 10) for a pool
    of exactly `num_blocks` blocks."""
    kw = dict(block_size=BLOCK_SIZE, num_kv_heads=16, head_size=128, dtype="bfloat16")
    layers = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(**kw)
        if i % 6 == 5
        else SlidingWindowSpec(**kw, sliding_window=WINDOW)
        for i in range(NUM_LAYERS)
    }
    plan_args = dict(max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens, grouping="vllm")
    bytes_per_block = plan(layers, 1 << 40, **plan_args).bytes_per_block
    cfg = plan(layers, num_blocks * bytes_per_block, **plan_args)
    assert cfg.num_blocks == num_blocks, (cfg.num_blocks, num_blocks)
    return cfg


def sync_cpu_dispatch() -> None:
    """Runs CPU computations in the calling thread: each call returns a small result at once, and
    the thread hand-off of asynchronous dispatch (tens of µs) is not timed. Ignored where the
    option does not exist."""
    try:
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    except (AttributeError, KeyError):
        pass


def output_token(request_id: int, k: int, vocab: int) -> int:
    """The k-th token request `request_id` generates (as ../shared/workloads/serving_workload.py)."""
    return (1_000_003 * request_id + 7_919 * k + 17) % vocab


class Request:
    __slots__ = (
        "idx",
        "token_ids",
        "num_prompt",
        "output_len",
        "num_output",
        "num_computed",
        "num_preemptions",
        "hasher",
    )

    def __init__(self, doc):
        self.idx = doc["id"]
        self.token_ids = list(doc["prompt"])
        self.num_prompt = len(self.token_ids)
        self.output_len = doc["output_len"]
        self.num_output = 0
        self.num_computed = 0
        self.num_preemptions = 0
        self.hasher = None  # UnitHasher of the request's tokens (prefix caching)


def warm_up(mgr: KVCacheManager) -> float:
    """Compiles every shape the replay dispatches, outside the timing."""
    t0 = time.perf_counter()
    mgr.warm_up()
    return time.perf_counter() - t0


def replay(args, workload: dict, trace=None) -> dict:
    """Runs the workload once; `trace`, an open text file, gets one JSON line per step."""
    vocab = workload["vocab"]
    cfg = gemma3_27b_config(args.num_blocks, args.max_model_len, args.max_num_batched_tokens)
    caching = not args.no_prefix_caching
    mgr = KVCacheManager(
        cfg,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=caching,
        num_speculative_tokens=args.speculate,
        backend=args.backend,
    )
    compile_s = warm_up(mgr)
    total_blocks = cfg.num_blocks - 1

    waiting = deque(Request(doc) for doc in workload["requests"])
    t_hash = time.perf_counter()
    for req in waiting if caching else ():  # at arrival
        req.hasher = UnitHasher(mgr.prefix_config.unit)
        req.hasher.extend(req.token_ids)
    hash_s = time.perf_counter() - t_hash
    num_requests = len(waiting)
    running: list[Request] = []
    pc = time.perf_counter
    step_kv_us: list[float] = []  # lookups, allocations, frees, request arrivals
    step_all_us: list[float] = []  # every manager call of the step, token appends included
    call_us = {
        "allocate": 0.0,
        "add_request": 0.0,
        "lookup": 0.0,
        "free": 0.0,
        "mark": 0.0,
        "reject": 0.0,
        "append": 0.0,
    }
    calls = dict.fromkeys(call_us, 0)
    hit_tokens = peak_used = preemptions = admission_failures = admitted = finished = tokens_scheduled = 0
    resumed_hit_tokens = 0  # hits of requests admitted again after a preemption
    drafts_proposed = drafts_accepted = 0
    t_wall = pc()

    def timed(name, fn, *a, **kw):
        nonlocal kv_t, append_t
        t = pc()
        out = fn(*a, **kw)
        dt = pc() - t
        call_us[name] += dt * 1e6
        calls[name] += 1
        if name == "append":
            append_t += dt
        else:
            kv_t += dt
        return out

    while waiting or running:
        budget = args.max_num_batched_tokens
        kv_t = append_t = 0.0
        scheduled: list[tuple[Request, int]] = []
        preempted: list[int] = []
        hits: list[tuple[int, int]] = []  # (request, hit tokens) of the requests admitted

        # (1) Running requests in admission order, and (2) the waiting requests that admission
        # would try if nothing gets preempted, in one batch: running rows first, candidates after
        # with the full-sequence gate. The first failure stops the batch, which is both rules.
        batch = []
        for req in running:
            if budget <= 0:
                break
            n = min(len(req.token_ids) - req.num_computed, budget)
            if args.speculate and len(req.token_ids) - req.num_computed == 1:
                room = min(req.output_len - req.num_output, budget, args.max_model_len - len(req.token_ids) + 1)
                n += max(min(args.speculate, room - 1), 0)  # drafts
            batch.append((req, n))
            budget -= n
        # Candidates go in rounds: a candidate that may share a prefix with an earlier one of the
        # round (same first unit key) is looked up only after that one's blocks are allocated (and
        # cached), as vLLM's one-by-one admission would see them: a new round, another dispatch.
        added: set[int] = set()
        num_ok = len(batch)  # the running rows that got blocks
        admitting = True
        while admitting:
            candidates, first_keys, shares = [], set(), False
            queue = iter(waiting)
            while not shares and budget > 0:
                # The next candidates, looked up in one dispatch: as many as the budget would take
                # without hits (at most LOOKUP_ROWS; with hits, another lookup may follow).
                lookup, need = [], 0
                for req in queue:
                    if len(running) + len(candidates) + len(lookup) >= args.max_num_seqs:
                        break
                    first_key = req.hasher.digests[0] if caching and req.hasher.digests else None
                    if first_key is not None and first_key in first_keys:
                        shares = True
                        break
                    first_keys.add(first_key)
                    lookup.append(req)
                    need += len(req.token_ids)
                    if need >= budget or len(lookup) == LOOKUP_ROWS:
                        break
                if not lookup:
                    break
                for req in lookup:
                    if req.idx not in added:
                        timed("add_request", mgr.add_request, req.idx, req.token_ids, unit_hasher=req.hasher)
                        added.add(req.idx)
                found = (
                    timed("lookup", mgr.get_computed_tokens_batch, [r.idx for r in lookup]).tolist()
                    if caching
                    else [0] * len(lookup)
                )
                for req, hit in zip(lookup, found):
                    if budget <= 0:
                        break
                    n = min(len(req.token_ids) - hit, budget)
                    candidates.append((req, n, hit))
                    budget -= n
            shares = shares and budget > 0  # a shared first key, not the budget, ended the round
            rows = batch + [(req, n) for req, n, _ in candidates]
            if not rows:
                break
            must_fit = [False] * len(batch) + [True] * len(candidates)
            ok = timed(
                "allocate",
                mgr.allocate_slots_batch,
                [r.idx for r, _ in rows],
                [n for _, n in rows],
                [0] * len(batch) + [h for _, _, h in candidates],
                full_sequence_must_fit=must_fit,
            )
            num_ok = len(rows) if ok.all() else int(ok.argmin())
            scheduled += batch[:num_ok]
            for req, n, hit in candidates[: max(num_ok - len(batch), 0)]:
                waiting.popleft()
                added.discard(req.idx)
                running.append(req)
                req.num_computed = hit
                scheduled.append((req, n))
                hits.append((req.idx, hit))
                hit_tokens += hit
                resumed_hit_tokens += hit if req.num_preemptions else 0
                admitted += 1
            if len(batch) <= num_ok < len(rows):  # all running rows fit, a candidate did not
                admission_failures += 1
            admitting = num_ok == len(rows) and shares
            if admitting:
                batch = []  # the next round: candidates only
        if added:  # candidates not admitted hold no block: host-only
            timed("free", mgr.free_batch, sorted(added))
        batch = batch[min(num_ok, len(batch)) :]
        # A running request failed: preempt from the back and retry from it (more dispatches).
        while batch:
            failed = batch[0][0]
            victim = running.pop()
            timed("free", mgr.free_batch, [victim.idx])
            victim.num_computed = 0
            victim.num_preemptions += 1
            preemptions += 1
            preempted.append(victim.idx)
            waiting.appendleft(victim)
            if victim is failed:
                break
            batch = [(r, n) for r, n in batch if r is not victim]
            ok = timed("allocate", mgr.allocate_slots_batch, [r.idx for r, _ in batch], [n for _, n in batch])
            num_ok = len(batch) if ok.all() else int(ok.argmin())
            scheduled += batch[:num_ok]
            batch = batch[num_ok:]

        peak_used = max(peak_used, total_blocks - mgr.num_free_blocks)
        if trace is not None:
            trace.write(
                json.dumps(
                    {
                        "step": len(step_kv_us),
                        "scheduled": [[r.idx, n] for r, n in scheduled],
                        "preempted": preempted,
                        "admitted_hits": hits,
                        "free_blocks": mgr.num_free_blocks,
                    }
                )
                + "\n"
            )

        # (3) Model step; the manager is told it ran (what it wrote may be cached when its requests are freed).
        timed("mark", mgr.mark_computed)
        done, sampled, rejected = [], [], []
        for req, n in scheduled:
            tokens_scheduled += n
            num_drafts = req.num_computed + n - len(req.token_ids)
            num_emitted = 1
            if num_drafts > 0:  # verification: a deterministic number of drafts accepted
                accepted = (req.idx + req.num_output) % (num_drafts + 1)
                rejected.append((req, num_drafts - accepted))
                drafts_proposed += num_drafts
                drafts_accepted += accepted
                n -= num_drafts - accepted
                num_emitted += accepted
            req.num_computed += n
            if req.num_computed < len(req.token_ids):
                continue
            for _ in range(num_emitted):
                req.token_ids.append(output_token(req.idx, req.num_output, vocab))
                req.num_output += 1
            sampled.append((req, num_emitted))
            if req.num_output >= req.output_len:
                done.append(req)
        if rejected:
            timed("reject", mgr.reject_tokens_batch, [r.idx for r, _ in rejected], [k for _, k in rejected])
        if sampled:  # the step's sampled tokens, in one call
            timed(
                "append",
                mgr.append_token_ids_batch,
                [r.idx for r, _ in sampled],
                [r.token_ids[len(r.token_ids) - k :] for r, k in sampled],
            )
        if done:
            timed("free", mgr.free_batch, [r.idx for r in done])
            for req in done:
                running.remove(req)
            finished += len(done)
        step_kv_us.append(kv_t * 1e6)
        step_all_us.append((kv_t + append_t) * 1e6)

    wall_s = pc() - t_wall
    final_used = total_blocks - mgr.num_free_blocks
    check_invariants(cfg, mgr.state)
    ordered = sorted(step_kv_us)

    def pct(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "impl": "jaxkv",
        "jax_version": jax.__version__,
        "backend": jax.default_backend(),
        "state_backend": args.backend,
        "workload_file": args.workload,
        "num_blocks": cfg.num_blocks,
        "num_groups": len(cfg.groups),
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "steps": len(step_kv_us),
        "completed": finished == num_requests,
        "mean_all_us_per_step": statistics.fmean(step_all_us),
        "mean_kv_us_per_step": statistics.fmean(step_kv_us),
        "p50_kv_us_per_step": pct(0.50),
        "p99_kv_us_per_step": pct(0.99),
        "max_kv_us_per_step": ordered[-1],
        "kv_us_total_by_call": call_us,
        "kv_calls": calls,
        "mean_us_per_call": {k: call_us[k] / calls[k] if calls[k] else 0.0 for k in call_us},
        "compile_s": compile_s,
        "step_variants": len(mgr.step_variants),
        "steps_by_variant": {str(work): count for work, count in mgr.step_variants.items()},
        "prefix_hit_tokens": hit_tokens,
        "prefix_hit_tokens_first_admission": hit_tokens - resumed_hit_tokens,
        "prefix_hit_tokens_resumed": resumed_hit_tokens,
        "prefix_stats": mgr.prefix_stats,
        "prompt_hash_s": hash_s,
        "prompt_hash_ns_per_token": hash_s * 1e9 / max(1, sum(len(doc["prompt"]) for doc in workload["requests"])),
        "peak_blocks_used": peak_used,
        "admitted": admitted,
        "admission_failures": admission_failures,
        "preemptions": preemptions,
        "finished": finished,
        "tokens_scheduled": tokens_scheduled,
        "speculate": args.speculate,
        "drafts_proposed": drafts_proposed,
        "drafts_accepted": drafts_accepted,
        "final_blocks_used": final_used,
        "wall_s": wall_s,
    }


def argument_parser() -> argparse.ArgumentParser:
    """The command line's options; their defaults are the replay's."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, help="JSON file from ../shared/workloads/serving_workload.py")
    p.add_argument("--num-blocks", type=int, default=131072, help="pool size, the null block included")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--no-prefix-caching", action="store_true", help="run with prefix caching off")
    p.add_argument("--speculate", type=int, default=0, metavar="K", help="K drafts per decoding row (0: off)")
    p.add_argument("--backend", choices=("host", "jax"), default="host", help="the manager's engine")
    p.add_argument("--warmup-replays", type=int, default=1, help="untimed replays first (0: time the first one)")
    p.add_argument(
        "--trace",
        default=None,
        help="write each step's scheduled rows, preemptions and free "
        "blocks (JSONL), for benchmarks/compare_vllm_trace.py",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line (otherwise a short summary)")
    return p


def main(argv=None) -> int:
    args = argument_parser().parse_args(argv)
    sync_cpu_dispatch()
    workload = json.load(open(args.workload))
    warm_s, compile_s = 0.0, None
    for _ in range(args.warmup_replays):
        # XLA:CPU finishes preparing a kernel the first time it runs (about 1-30 ms), so an
        # untimed replay first runs every path; the managers share the compiled executables.
        warm = replay(args, workload)
        warm_s += warm["wall_s"]
        compile_s = compile_s if compile_s is not None else warm["compile_s"]
    with open(args.trace, "w") if args.trace else contextlib.nullcontext() as trace:
        out = replay(args, workload, trace)
    out["warmup_replays"], out["warmup_s"] = args.warmup_replays, warm_s
    if compile_s is not None:
        out["compile_s"] = compile_s  # the first manager's: later ones reuse its executables
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        print(
            f"{out['steps']} steps, {out['mean_all_us_per_step']:.0f} us/step KV bookkeeping "
            f"(p99 {out['p99_kv_us_per_step']:.0f}), peak {out['peak_blocks_used']} blocks, "
            f"{out['preemptions']} preemptions, {out['final_blocks_used']} blocks not returned"
        )
    return 0 if out["final_blocks_used"] == 0 and out["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
