"""Memory table for the model zoo: KV bytes per request and capacity, all-full vs vLLM's grouping vs jaxkv's.

    python benchmarks/memory_table.py [--memory 40GiB] [--max-model-len 32768]

Prints Markdown. Bytes per request: the pool bytes one request of n tokens holds
while its last token is computed (`KVCacheConfig.bytes_per_request`), for plans
made with max_model_len 131,072 (so 128,000 tokens fit); padding included. Capacity:
"KV cache size: N tokens" at the stated budget and max_model_len.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from jaxkv import plan, specs_from_hf_config
from jaxkv.cli import parse_bytes

CONFIGS = pathlib.Path(__file__).parent.parent / "tests" / "configs"
ZOO = ["gemma3_27b", "gemma3n_e2b", "gpt_oss_120b", "llama4_scout", "mistral_7b", "ministral_8b",
       "qwen3_next_80b", "deepseek_v32", "llama3_8b"]  # fmt: skip
LENGTHS = (512, 2_000, 8_000, 32_000, 128_000)
TABLE_MAX_MODEL_LEN = 131_072
MiB = 1 << 20


def three_plans(layers, budget: int, max_model_len: int, mnbt: int):
    """(all-full, vLLM's grouping, jaxkv's default grouping)."""
    kw = dict(max_model_len=max_model_len, max_num_batched_tokens=mnbt)
    return (
        plan(layers, budget, hybrid=False, grouping="vllm", **kw),
        plan(layers, budget, grouping="vllm", **kw),
        plan(layers, budget, **kw),
    )


def bytes_table(mnbt: int) -> list[str]:
    head = " | ".join(f"{n:,}" for n in LENGTHS)
    rows = [
        f"| model | plan | {head} |",
        "|---|---|" + "---:|" * len(LENGTHS),
    ]
    for name in ZOO:
        layers = specs_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()))
        plans = three_plans(layers, 1 << 40, TABLE_MAX_MODEL_LEN, mnbt)
        for label, cfg in zip(("all full", "vllm", "auto"), plans):
            cells = " | ".join(f"{cfg.bytes_per_request(n) / MiB:,.1f}" for n in LENGTHS)
            groups = f"{len(cfg.groups)} group{'s' * (len(cfg.groups) != 1)}"
            rows.append(f"| {name if label == 'all full' else ''} | {label} ({groups}) | {cells} |")
    return rows


def capacity_table(budget: int, max_model_len: int, mnbt: int) -> list[str]:
    rows = [
        "| model | all full: tokens | vllm: groups | vllm: tokens | vllm: concurrency | auto: groups "
        "| auto: tokens | auto: concurrency | auto vs vllm | hybrid vs all full |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in ZOO:
        layers = specs_from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()))
        full, vllm, auto = three_plans(layers, budget, max_model_len, mnbt)
        rows.append(
            f"| {name} | {full.capacity_tokens:,} | {len(vllm.groups)} | {vllm.capacity_tokens:,} "
            f"| {vllm.max_concurrency:.2f}x | {len(auto.groups)} | {auto.capacity_tokens:,} "
            f"| {auto.max_concurrency:.2f}x | {auto.capacity_tokens / vllm.capacity_tokens - 1:+.2%} "
            f"| {auto.capacity_tokens / full.capacity_tokens:.2f}x |"
        )
    return rows


def gemma3_27b_figures(mnbt: int) -> list[str]:
    """Gemma-3-27B in layer-tokens (one token of one layer, 16 heads × 256 × 2 B = 8 KiB)."""
    layers = specs_from_hf_config(json.loads((CONFIGS / "gemma3_27b.json").read_text()))
    full, vllm, _ = three_plans(layers, 40 << 30, 32_768, mnbt)
    row = 16 * 256 * 2
    exact = sum(len(g.layer_names) * g.blocks_held(32_000) * g.block_size for g in vllm.groups)
    return [
        "| Gemma-3-27B, layer-tokens | 32,000 tokens | 512 tokens |",
        "|---|---:|---:|",
        f"| all full | {full.bytes_per_request(32_000) // row:,} | {full.bytes_per_request(512) // row:,} |",
        f"| vllm grouping (padding, block rounding) | {vllm.bytes_per_request(32_000) // row:,} "
        f"| {vllm.bytes_per_request(512) // row:,} |",
        f"| windows honoured, no padding | {exact:,} | |",
        f"| all full / vllm | {full.bytes_per_request(32_000) / vllm.bytes_per_request(32_000):.1f}x "
        f"| {full.bytes_per_request(512) / vllm.bytes_per_request(512):.2f}x |",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", type=parse_bytes, default=parse_bytes("40GiB"))
    p.add_argument("--max-model-len", type=int, default=32_768)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args()
    mnbt = args.max_num_batched_tokens
    print(f"KV MiB per request (plans for max_model_len {TABLE_MAX_MODEL_LEN:,}, max_num_batched_tokens {mnbt}):\n")
    print("\n".join(bytes_table(mnbt)))
    print(f"\nCapacity at {args.memory / (1 << 30):g} GiB, max_model_len {args.max_model_len:,}, "
          f"max_num_batched_tokens {mnbt}:\n")  # fmt: skip
    print("\n".join(capacity_table(args.memory, args.max_model_len, mnbt)))
    print("\nGemma-3-27B known figures (window 1024, block 16):\n")
    print("\n".join(gemma3_27b_figures(mnbt)))


if __name__ == "__main__":
    main()
