"""Kernel accuracy against the references, and blocks read per decode (CPU).

    python benchmarks/kernels.py --json

prints one JSON line:
  max_rel_err             per kernel and case: max |kernel - reference| / max |reference|
                          (bit-exact scatter gives 0.0)
  sw_decode_blocks_read   blocks one sliding-window decode (window 1024, block 16)
                          reads, counted by the kernel's own loop, per context length
  full_decode_blocks_read the same for a full-attention decode

Every cache slot the kernels must not read is NaN (see
tests/pallas_kernels/kernel_cases.py), so a stray read shows up as NaN here.
Runs interpreted on CPU (a few tens of seconds); on a GPU or TPU host it runs
the compiled kernels instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "pallas_kernels"))
import kernel_cases  # noqa: E402
from kernel_cases import AttentionCase  # noqa: E402

from pallas_kernels._common import mosaic_gpu_supported  # noqa: E402
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference  # noqa: E402
from pallas_kernels.paged_scatter import paged_scatter, paged_scatter_reference  # noqa: E402

WINDOW = 1024
BLOCK_SIZE = 16
CONTEXTS = (1024, 4096, 16384, 65536)

ATTENTION_CASES = {
    "full-f32": AttentionCase(block_size=16, q_lens=(13, 1, 0, 1), seq_lens=(40, 33, 9, 1)),
    "window-f32": AttentionCase(block_size=8, q_lens=(9, 1, 1), seq_lens=(30, 31, 5), sliding_window=11),
    "chunk-f32": AttentionCase(block_size=4, q_lens=(10, 1), seq_lens=(25, 14), max_blocks=7, attention_chunk_size=9),
    "softcap-gqa8-f32": AttentionCase(
        block_size=32,
        group_size=8,
        num_kv_heads=1,
        q_lens=(5, 1),
        seq_lens=(50, 20),
        max_blocks=2,
        logits_soft_cap=5.0,
    ),
    "window-gqa4-bf16": AttentionCase(
        block_size=16,
        group_size=4,
        head_size=32,
        head_size_v=32,
        q_lens=(17, 1, 3),
        seq_lens=(40, 33, 3),
        max_blocks=3,
        sliding_window=20,
        dtype="bfloat16",
    ),
    "layer-outer-f32": AttentionCase(block_size=8, q_lens=(6, 1), seq_lens=(20, 12), sliding_window=9, layout="LBHNC"),
    # Speculative verification: 5 queries a row (the last token and 4 drafts), a window shorter than them.
    "verify-k4-window-f32": AttentionCase(
        block_size=4, q_lens=(5, 5, 5, 5), seq_lens=(5, 10, 13, 26), max_blocks=7, sliding_window=6
    ),
    # gpt-oss: a sink logit per query head, GQA, a short window.
    "sinks-window-gqa4-f32": AttentionCase(
        block_size=16,
        group_size=4,
        q_lens=(17, 1, 3),
        seq_lens=(40, 33, 3),
        max_blocks=3,
        sliding_window=20,
        sinks=True,
    ),
}


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return float("nan")
    scale = np.abs(ref).max()
    return float(np.abs(out - ref).max() / (scale if scale > 0 else 1.0))


def _attention_error(case: AttentionCase, seed: int, **kernel_options) -> float:
    rng = np.random.default_rng(seed)
    q, cache, qsl, seq_lens, tables = kernel_cases.build_attention_inputs(case, rng)
    args = (jnp.asarray(q), jnp.asarray(cache), qsl, seq_lens, tables, case.layer_idx)
    options = dict(
        sliding_window=case.sliding_window,
        attention_chunk_size=case.attention_chunk_size,
        logits_soft_cap=case.logits_soft_cap,
        sinks=kernel_cases.build_sinks(case, rng),
        layout=case.layout,
    )
    return _rel_err(
        paged_attention(*args, **options, **kernel_options),
        paged_attention_reference(*args, **options),
    )


def _scatter_error(dtype: str, row_width: int, layout: str, seed: int, **kernel_options) -> float:
    rng = np.random.default_rng(seed)
    num_blocks, num_layers, num_heads, block_size, num_tokens = 9, 2, 2, 8, 20
    scale, shift = (40.0, 128.0) if dtype == "uint8" else (1.0, 0.0)
    canonical = rng.normal(size=(num_blocks, num_layers, num_heads, block_size, row_width))
    cache = kernel_cases.to_layout(canonical * scale + shift, layout).astype(dtype)
    rows = (rng.normal(size=(num_tokens, num_heads, row_width)) * scale + shift).astype(dtype)
    slots = rng.permutation(num_blocks * block_size)[:num_tokens].astype(np.int32)
    slots[rng.random(num_tokens) < 0.2] = -1
    ref = paged_scatter_reference(jnp.asarray(cache), rows, slots, 1, layout=layout)
    out = paged_scatter(jnp.asarray(cache), jnp.asarray(rows), slots, 1, layout=layout, **kernel_options)
    return _rel_err(out, ref)


def _decode_blocks_read(window: int | None) -> dict[str, int]:
    """One decode per context; the count is the kernel's loop iterations."""
    case = AttentionCase(
        block_size=BLOCK_SIZE,
        num_kv_heads=1,
        group_size=1,
        head_size=8,
        head_size_v=8,
        q_lens=(1,) * len(CONTEXTS),
        seq_lens=CONTEXTS,
        max_blocks=max(CONTEXTS) // BLOCK_SIZE,
        num_layers=1,
        layer_idx=0,
        num_padding_tokens=0,
        sliding_window=window,
    )
    q, cache, qsl, seq_lens, tables = kernel_cases.build_attention_inputs(case, np.random.default_rng(0))
    out, blocks_read = paged_attention(
        jnp.asarray(q),
        jnp.asarray(cache),
        qsl,
        seq_lens,
        tables,
        sliding_window=window,
        return_blocks_read=True,
    )
    if not np.isfinite(np.asarray(out)).all():
        raise AssertionError("a decode read a poisoned slot")
    return {str(c): int(n) for c, n in zip(CONTEXTS, np.asarray(blocks_read)[:, 0])}


def run() -> dict:
    max_rel_err = {}
    for seed, (name, case) in enumerate(ATTENTION_CASES.items()):
        max_rel_err[f"paged_attention/{name}"] = _attention_error(case, seed)
    max_rel_err["paged_attention/window-f32-mosaic-interpret"] = _attention_error(
        ATTENTION_CASES["window-f32"], 0, backend="mosaic", interpret=True
    )
    max_rel_err["paged_attention/sinks-window-gqa4-f32-mosaic-interpret"] = _attention_error(
        ATTENTION_CASES["sinks-window-gqa4-f32"], 0, backend="mosaic", interpret=True
    )
    for layout, dtype, row_width in (
        ("BLHNC", "float32", 64),
        ("BLHNC", "bfloat16", 256),
        ("BLHNC", "uint8", 656),
        ("LBNHC", "float32", 64),
    ):
        max_rel_err[f"paged_scatter/{layout}-{dtype}-{row_width}"] = _scatter_error(dtype, row_width, layout, seed=1)
    max_rel_err["paged_scatter/BLHNC-float32-64-mosaic-interpret"] = _scatter_error(
        "float32", 64, "BLHNC", seed=1, backend="mosaic", interpret=True
    )
    if mosaic_gpu_supported():  # jax >= 0.11
        for layout, dtype, row_width in (("BLHNC", "bfloat16", 256), ("BLHNC", "uint8", 656)):
            max_rel_err[f"paged_scatter/{layout}-{dtype}-{row_width}-mosaic_gpu-interpret"] = _scatter_error(
                dtype, row_width, layout, seed=1, backend="mosaic_gpu", interpret=True
            )
    return {
        "max_rel_err": max_rel_err,
        "sw_decode_blocks_read": _decode_blocks_read(WINDOW),
        "full_decode_blocks_read": _decode_blocks_read(None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args()
    result = run()
    if args.json:
        print(json.dumps(result))
        return
    for name, err in result["max_rel_err"].items():
        print(f"{name:55s} max rel err {err:.2e}")
    bound = -(-(WINDOW - 1) // BLOCK_SIZE) + 1
    print(f"\ndecode blocks read (window {WINDOW}, block {BLOCK_SIZE}, bound {bound}):")
    for c in result["sw_decode_blocks_read"]:
        print(
            f"  context {c:>6}: window {result['sw_decode_blocks_read'][c]:>5}   "
            f"full {result['full_decode_blocks_read'][c]:>5}"
        )


if __name__ == "__main__":
    main()
