#!/usr/bin/env python3
"""Prefix-cache hits on a Mamba hybrid whose blocks page-size unification enlarged: block-granular vs a finer unit.

Model: Qwen3-Next-80B-like, planned by `jaxkv.plan` from tests/configs/qwen3_next_80b.json
(20 GiB, max_model_len 32,768): three linear-attention (state) groups and one full-attention
group, every block 544 tokens. Workload (seeded): multi-turn conversations whose first prompts
are shorter than a block; each turn's prompt is the previous prompt, the assistant's answer
and a new user message. Replayed through `KVCacheManager` with `prefix_match_unit` None (the
block size) and a finer unit (16 by default):

* a few conversations at a time, one `allocate_slots_batch` per step: prefill chunks end at
  block ends and at the prompt tail's final unit boundary (vLLM's "align" mode, which saves a
  state there), then one decode token per step; a finished turn is freed and the
  conversation's next turn arrives, looked up (`get_computed_tokens`) and claimed;
* block copies are taken every step (`take_block_copies`) and counted (no model runs here);
* the step's sampled tokens are appended in one call (`append_token_ids_batch`), finished turns freed in one.

The replay runs on each engine (`--backends`, both by default; the jitted one's programs compiled by a first
replay, kept out of the figures): every manager call a step makes is timed, and a digest of every step's hits,
ok flags and copies shows whether the engines' outcomes are identical.

With `--serve` the model runs: the tiny Qwen3-Next checkpoint of tests/fixtures/hf/qwen3_next (5 layers, 4 of
them Gated DeltaNet; random weights, float32), planned with the same 544-token blocks and as many blocks as the
80B plan, serves the same conversations (token ids taken modulo its vocabulary, in both modes) through
examples/serving.py's loop: continuous batching with a shared token budget (`--max-chunk` tokens a step), chunks
aligned as above, block copies applied before each step, states read and written in the pool, a conversation's
next turn arriving as its previous one finishes (the answer's tokens are the workload's; the model's own
are decoded but not kept). Compilation is kept out of the served times (a warm-up turn per unit first).

    python benchmarks/mamba_prefix.py
    python benchmarks/mamba_prefix.py --units 16 64 --conversations 48
    python benchmarks/mamba_prefix.py --serve --conversations 8

Prints one table row per unit and engine: requests, prompt tokens, hit tokens, hit rate, copies, bookkeeping
µs per step and the outcomes' digest, then each unit's ratio of the engines' times; with `--serve` also
the tokens the model computed and wall time per turn.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import random
import sys
import tempfile
import time

import jax
import numpy as np

from jaxkv import plan, specs_from_hf_config
from jaxkv.manager import KVCacheManager

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "configs" / "qwen3_next_80b.json"
CHECKPOINT = ROOT / "tests" / "fixtures" / "hf" / "qwen3_next"


def make_conversations(num: int, turns: int, seed: int) -> list[list[tuple[list[int], int]]]:
    """Per conversation, per turn: (prompt tokens, answer tokens to decode).

    A shared system prompt (one of 4, 150-350 tokens) and a first user message (40-200) make
    first prompts shorter than a 544-token block; answers have 30-150 tokens, later messages 40-200.
    """
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 50000) for _ in range(rng.randint(150, 350))] for _ in range(4)]
    conversations = []
    for _ in range(num):
        history = list(rng.choice(systems))
        conv = []
        for _ in range(turns):
            history += [rng.randrange(1000, 50000) for _ in range(rng.randint(40, 200))]
            answer = rng.randint(30, 150)
            conv.append((list(history), answer))
            history += [rng.randrange(1000, 50000) for _ in range(answer)]
        conversations.append(conv)
    return conversations


def replay(cfg, conversations, unit: int | None, concurrency: int, max_chunk: int, backend: str = "host") -> dict:
    """The counted replay (see the module docstring) on one engine: its counts, the manager's time per step
    (every call a step makes, token appends included) and a digest of every outcome (hits, ok flags, copies)."""
    mgr = KVCacheManager(cfg, max_num_seqs=concurrency, prefix_match_unit=unit, backend=backend)
    block = cfg.groups[0].block_size
    hash_unit = mgr.prefix_config.unit
    waiting = [(c, 0) for c in range(len(conversations))]  # (conversation, turn) ready to arrive
    active = {}  # request id -> dict(prompt_len, answer, decoded, computed, hit)
    stats = dict(requests=0, prompt_tokens=0, hit_tokens=0, copies=0, steps=0)
    digest = hashlib.sha256()
    clock = time.perf_counter
    bookkeeping = 0.0
    start = clock()
    while waiting or active:
        # Arrivals: look up and admit with the hit.
        new_rows = {}
        while waiting and len(active) < concurrency:
            conv, turn = waiting.pop(0)
            prompt, answer = conversations[conv][turn]
            rid = (conv, turn)
            t = clock()
            mgr.add_request(rid, prompt)
            hit = mgr.get_computed_tokens(rid)
            bookkeeping += clock() - t
            active[rid] = dict(prompt_len=len(prompt), answer=answer, decoded=0, computed=0, hit=hit)
            new_rows[rid] = hit
            stats["requests"] += 1
            stats["prompt_tokens"] += len(prompt)
        ids, num_new, hits = [], [], []
        for rid, r in active.items():
            n = r["computed"] + new_rows.get(rid, 0)
            if n < r["prompt_len"]:
                # Align: end the chunk at the next block end or at the prompt tail's unit boundary.
                tail = (r["prompt_len"] - 1) // hash_unit * hash_unit
                end = min(r["prompt_len"], (n // block + 1) * block, n + max_chunk)
                if n < tail < end:
                    end = tail
                k = end - n
            else:
                k = 1  # decode the token appended after the previous step
            ids.append(rid)
            num_new.append(k)
            hits.append(new_rows.get(rid, 0))
        t = clock()
        ok = mgr.allocate_slots_batch(ids, num_new, hits)
        copies = mgr.take_block_copies()
        mgr.mark_computed()  # the step's forward pass ran
        bookkeeping += clock() - t
        if not ok.all():
            raise RuntimeError("the pool is too small for the replay's concurrency; lower --concurrency")
        digest.update(np.asarray(hits, np.int64).tobytes() + ok.tobytes() + copies.tobytes())
        stats["copies"] += len(copies)
        stats["steps"] += 1
        finished, sampled = [], []
        for rid, k, h in zip(ids, num_new, hits):
            r = active[rid]
            stats["hit_tokens"] += h
            r["computed"] += h + k
            if r["computed"] >= r["prompt_len"]:
                if r["decoded"] == r["answer"]:
                    finished.append(rid)
                    del active[rid]
                    conv, turn = rid
                    if turn + 1 < len(conversations[conv]):
                        waiting.append((conv, turn + 1))
                    continue
                sampled.append(rid)  # its sampled token, scheduled next step
                r["decoded"] += 1
        t = clock()
        mgr.free_batch(finished)
        mgr.append_token_ids_batch(sampled, [[7]] * len(sampled))
        bookkeeping += clock() - t
    stats["seconds"] = round(clock() - start, 1)
    stats["us_per_step"] = round(1e6 * bookkeeping / stats["steps"], 1)
    stats["digest"] = digest.hexdigest()[:16]
    stats["unit"] = hash_unit
    stats["backend"] = backend
    return stats


def serve(conversations, unit: int | None, concurrency: int, max_chunk: int, num_blocks: int, block_size: int):
    """The conversations served by the tiny Qwen3-Next checkpoint (see the module docstring)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from checkpoint import load_model, open_checkpoint
    from serving import ServingLoop

    checkpoint = open_checkpoint(CHECKPOINT)
    specs = specs_from_hf_config(checkpoint.config, dtype="float32", block_size=block_size)
    max_model_len = max(len(prompt) + answer for conv in conversations for prompt, answer in conv)
    probe = plan(specs, 1 << 30, max_model_len=max_model_len, max_num_batched_tokens=max_chunk)
    cfg = plan(specs, num_blocks * probe.bytes_per_block, max_model_len=max_model_len, max_num_batched_tokens=max_chunk)
    assert {g.block_size for g in cfg.groups} == {block_size}, cfg.summary()
    loop = ServingLoop(
        load_model(checkpoint, "float32"),
        cfg,
        max_num_seqs=concurrency,
        max_num_batched_tokens=max_chunk,
        prefix_match_unit=unit,
    )
    turn_of = {}  # request id -> (conversation, turn)

    def follow_up(request):
        conv, turn = turn_of[request.request_id]
        if turn + 1 == len(conversations[conv]):
            return None
        turn_of[len(turn_of)] = (conv, turn + 1)
        return conversations[conv][turn + 1]

    firsts = [conv[0] for conv in conversations]
    turn_of.update((i, (c, 0)) for c, i in enumerate(range(len(firsts))))
    requests = loop.generate([p for p, _ in firsts], [a for _, a in firsts], follow_up=follow_up)
    stats = loop.stats
    return dict(
        unit=loop.mgr.prefix_config.unit,
        requests=len(requests),
        prompt_tokens=stats.prompt_tokens,
        hit_tokens=stats.prefix_hit_tokens,
        computed=stats.tokens_computed,
        copies=stats.block_copies,
        steps=stats.steps,
        preemptions=stats.preemptions,
        seconds=round(stats.seconds, 1),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, nargs="+", default=[16])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-chunk", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--serve", action="store_true", help="also serve them with the tiny Qwen3-Next model")
    parser.add_argument(
        "--backends", nargs="+", default=["host", "jax"], choices=["host", "jax"], help="the engines that replay"
    )
    args = parser.parse_args()
    cfg = plan(specs_from_hf_config(json.loads(CONFIG.read_text())), 20 * 2**30, max_model_len=32768)
    conversations = make_conversations(args.conversations, args.turns, args.seed)
    if args.serve:  # the tiny model's vocabulary, in both modes
        vocab = json.loads((CHECKPOINT / "config.json").read_text())["vocab_size"]
        conversations = [[([t % vocab for t in p], a) for p, a in conv] for conv in conversations]
    rows = []
    for unit in [None, *args.units]:
        for backend in args.backends:
            if backend == "jax":  # its programs compiled by a first replay, kept out of the figures
                replay(cfg, conversations, unit, args.concurrency, args.max_chunk, backend)
            rows.append(replay(cfg, conversations, unit, args.concurrency, args.max_chunk, backend))
    served = []
    if args.serve:
        # Compilations stay out of the figures: a throwaway loop serves one turn first, and the compiled programs
        # are reused from JAX's persistent cache by the measured loops.
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        block = cfg.groups[0].block_size
        for unit in [None, *args.units]:
            serve([conversations[0][:1]], unit, args.concurrency, args.max_chunk, cfg.num_blocks, block)
        served = [
            serve(conversations, unit, args.concurrency, args.max_chunk, cfg.num_blocks, block)
            for unit in [None, *args.units]
        ]
    if args.json:
        print(json.dumps(rows + served))
        return
    kinds = ", ".join(f"{g.kind} {g.block_size}" for g in cfg.groups)
    print(f"groups: {kinds}; {cfg.num_blocks:,} blocks; {args.conversations} conversations x {args.turns} turns")
    print(
        "| prefix_match_unit | requests | prompt tokens | hit tokens | hit rate | block copies | steps | engine "
        "| bookkeeping µs/step | outcomes' digest |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---|")

    def hits(r):  # the cells both tables start with
        label = f"{r['unit']} (block size)" if r["unit"] == cfg.groups[0].block_size else str(r["unit"])
        return (
            f"| {label} | {r['requests']} | {r['prompt_tokens']:,} | {r['hit_tokens']:,} | "
            f"{r['hit_tokens'] / r['prompt_tokens']:.1%} |"
        )

    for r in rows:
        print(f"{hits(r)} {r['copies']} | {r['steps']} | {r['backend']} | {r['us_per_step']:,} | {r['digest']} |")
    by_unit = {}
    for r in rows:
        by_unit.setdefault(r["unit"], {})[r["backend"]] = r
    for unit, engines in by_unit.items():
        if len(engines) == 2:
            host, jitted = engines["host"], engines["jax"]
            same = "identical" if host["digest"] == jitted["digest"] else "DIFFERENT"
            ratio = jitted["us_per_step"] / host["us_per_step"]
            print(f"unit {unit}: the host engine {ratio:.1f}x faster per step than the jitted one; {same} outcomes")
    if served:
        print("\nserved by the tiny Qwen3-Next model (the same blocks and pool size):")
        print(
            "| prefix_match_unit | requests | prompt tokens | hit tokens | hit rate | tokens computed | block copies "
            "| steps | preemptions | s | s per turn |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in served:
            print(
                f"{hits(r)} {r['computed']:,} | {r['copies']} | {r['steps']} | {r['preemptions']} | {r['seconds']} | "
                f"{r['seconds'] / r['requests']:.2f} |"
            )


if __name__ == "__main__":
    main()
