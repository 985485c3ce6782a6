"""On one GPU: the compiled kernels against the references, then decode timings.

    bash benchmarks/device_check.sh          # the wrapper sets paths and a time limit

1. Correctness: every case of benchmarks/kernels.py (NaN-poisoned caches) with
   the compiled Triton kernels, plus a Gemma-like shape (head 128, GQA 4,
   bf16, block 16) at a few contexts, and the blocks one sliding-window
   decode reads; paged_scatter's Mosaic GPU body beside its Triton one (a
   failure is reported as NaN with its message, the other stages still run).
2. Decode at batch 64 (32 query heads, 8 KV heads, head 128, bf16, block 16),
   contexts 1k-128k, window 1024 and full attention. Achieved bandwidth is the
   K/V bytes the kernel's loops load (its own block count x bytes per block)
   over the time of one `paged_attention` call, as a fraction of a jitted
   device-to-device copy's (read + write) bandwidth measured in the same run.

Prints progress lines, then one JSON line; with --out DIR also writes
DIR/device_check.json and DIR/device_check.md. Each stage catches its own
failure so that a partial run still reports.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels as cpu_bench  # noqa: E402  (benchmarks/kernels.py)
from kernel_cases import AttentionCase  # noqa: E402  (put on the path by kernels.py)

from pallas_kernels.paged_attention import paged_attention  # noqa: E402

BATCH = 64
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE = 32, 8, 128
BLOCK_SIZE = 16
WINDOW = 1024
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def log(*parts) -> None:
    print(*parts, flush=True)


def _timed(fn, *args, iters: int) -> float:
    """Seconds per call, after a compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def correctness(smoke: bool) -> dict:
    errors = {}
    compiled = {} if smoke else {"interpret": False}  # Never interpret silently on the GPU.
    cases = list(cpu_bench.ATTENTION_CASES.items())[: 1 if smoke else None]
    for seed, (name, case) in enumerate(cases):
        errors[f"paged_attention/{name}"] = cpu_bench._attention_error(case, seed, **compiled)
        log(f"  {name}: {errors[f'paged_attention/{name}']:.2e}")
    for context in (1, 40) if smoke else (1, 1000, 1025, 4097):
        case = AttentionCase(
            block_size=BLOCK_SIZE,
            num_kv_heads=2,
            group_size=4,
            head_size=HEAD_SIZE,
            head_size_v=HEAD_SIZE,
            q_lens=(1, min(context, 40), 1),
            seq_lens=(context, context, max(1, context // 3)),
            max_blocks=-(-context // BLOCK_SIZE),
            sliding_window=WINDOW,
            logits_soft_cap=50.0,
            dtype="bfloat16",
        )
        name = f"paged_attention/gemma-like-window-bf16-ctx{context}"
        errors[name] = cpu_bench._attention_error(case, context, **compiled)
        log(f"  {name}: {errors[name]:.2e}")
    for layout, dtype, row_width in (
        ("BLHNC", "bfloat16", 256),
        ("BLHNC", "uint8", 656),
        ("LBNHC", "float32", 64),
    ):
        name = f"paged_scatter/{layout}-{dtype}-{row_width}"
        errors[name] = cpu_bench._scatter_error(dtype, row_width, layout, seed=1, **compiled)
        log(f"  {name}: {errors[name]:.2e}")
        try:  # The Mosaic GPU body has not run on a GPU before: its failure must not hide the rest.
            errors[f"{name}-mosaic_gpu"] = cpu_bench._scatter_error(
                dtype, row_width, layout, seed=1, backend="mosaic_gpu", **compiled
            )
            log(f"  {name}-mosaic_gpu: {errors[f'{name}-mosaic_gpu']:.2e}")
        except Exception as error:  # reported, not raised
            errors[f"{name}-mosaic_gpu"] = float("nan")
            log(f"  {name}-mosaic_gpu: failed: {type(error).__name__}: {str(error)[:300]}")
    return errors


def copy_bandwidth(num_bytes: int = 8 << 30) -> float:
    """Bytes per second of a jitted device-to-device copy, reads plus writes."""
    x = jnp.zeros((num_bytes // 2,), jnp.bfloat16)
    seconds = _timed(jax.jit(jnp.copy), x, iters=10)
    del x
    return 2 * num_bytes / seconds


def decode_timings(copy_bytes_per_s: float, contexts: tuple[int, ...], batch: int) -> list[dict]:
    max_blocks = contexts[-1] // BLOCK_SIZE
    num_blocks = batch * max_blocks + 1  # The null block included.
    row_width = 2 * HEAD_SIZE
    shape = (num_blocks, 1, NUM_KV_HEADS, BLOCK_SIZE, row_width)  # BLHNC
    # Values do not matter for timing; a cheap fill avoids generating 34 GB of randoms.
    cache = jax.jit(lambda: (lax.broadcasted_iota(jnp.int32, shape, 4) % 17 - 8).astype(jnp.bfloat16) * 0.05)()
    # Every request's blocks scattered over the pool, as paging leaves them.
    tables = jax.random.permutation(jax.random.key(0), num_blocks - 1) + 1
    tables = tables.reshape(batch, max_blocks).astype(jnp.int32)
    q = jax.random.normal(jax.random.key(1), (batch, NUM_Q_HEADS, HEAD_SIZE), jnp.bfloat16)
    query_start_loc = jnp.arange(batch + 1, dtype=jnp.int32)
    bytes_per_block = BLOCK_SIZE * row_width * 2
    rows = []
    for window in (WINDOW, None):
        attend = jax.jit(lambda q, c, s, t, w=window: paged_attention(q, c, query_start_loc, s, t, sliding_window=w))
        count = jax.jit(
            lambda q, c, s, t, w=window: paged_attention(
                q, c, query_start_loc, s, t, sliding_window=w, return_blocks_read=True
            )[1]
        )
        for context in contexts:
            seq_lens = jnp.full((batch,), context, jnp.int32)
            blocks = int(jnp.sum(count(q, cache, seq_lens, tables)))  # Over requests and heads.
            seconds = _timed(attend, q, cache, seq_lens, tables, iters=10)
            bandwidth = blocks * bytes_per_block / seconds
            row = {
                "window": window,
                "context": context,
                "us": round(seconds * 1e6, 1),
                "batch": batch,
                "blocks_read_per_request_head": blocks / (batch * NUM_KV_HEADS),
                "GB_per_s": round(bandwidth / 1e9, 1),
                "fraction_of_copy": round(bandwidth / copy_bytes_per_s, 3),
            }
            rows.append(row)
            log(f"  {row}")
    return rows


def _markdown(result: dict) -> str:
    lines = [
        f"device: {result.get('device')}, jax {result.get('jax')}",
        f"copy bandwidth (read + write): {result.get('copy_GB_per_s')} GB/s",
        "",
        "| window | batch | context | time (us) | blocks/request/head | GB/s | of copy |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in result.get("decode", []):
        lines.append(
            f"| {row['window'] or 'full'} | {row['batch']} | {row['context']} | {row['us']} | "
            f"{row['blocks_read_per_request_head']:g} | {row['GB_per_s']} | {row['fraction_of_copy']} |"
        )
    errors = result.get("max_rel_err", {})
    if errors:
        lines += ["", f"worst max_rel_err: {max(errors.values()):.2e} over {len(errors)} cases"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="folder for the JSON and table")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the script itself on CPU")
    args = parser.parse_args()
    contexts = (256, 1024) if args.smoke else CONTEXTS
    result = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind)}
    stages = (
        ("max_rel_err", lambda: correctness(args.smoke)),
        ("sw_decode_blocks_read", lambda: cpu_bench._decode_blocks_read(WINDOW)),
        ("copy_GB_per_s", lambda: round(copy_bandwidth(1 << 24 if args.smoke else 8 << 30) / 1e9, 1)),
    )
    for key, stage in stages:
        log(f"{key} ...")
        try:
            result[key] = stage()
        except Exception:  # A failed stage is reported, the others still run.
            result[f"{key}_error"] = traceback.format_exc(limit=4)
            log(result[f"{key}_error"])
    if "copy_GB_per_s" in result:
        log("decode ...")
        try:
            result["decode"] = decode_timings(result["copy_GB_per_s"] * 1e9, contexts, batch=2 if args.smoke else BATCH)
        except Exception:
            result["decode_error"] = traceback.format_exc(limit=4)
            log(result["decode_error"])
    print(json.dumps(result), flush=True)
    print(_markdown(result), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "device_check.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "device_check.md").write_text(_markdown(result))


if __name__ == "__main__":
    main()
