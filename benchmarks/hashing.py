"""Prefix hashing on the host: ns per token for both digest modes.

    python benchmarks/hashing.py [--repeats 20]

Prompts arrive as lists of Python ints (as a server receives them); each figure
is the median over repeats of `prompt_unit_hashes` (digests and uint32[U, 4]
index keys). The "decode" column appends generated tokens one at a time to a
running `UnitHasher` (ns per appended token, unit hashes included).
"""

import argparse
import functools
import platform
import statistics
import time

import numpy as np

from jaxkv.prefix.hashing import UnitHasher, prompt_unit_hashes

PROMPT_LENS = (512, 1024, 2048, 4096)
UNITS = (16, 64)
MODES = ("jaxkv", "vllm")


def ns_per_token(fn, num_tokens: int, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / num_tokens * 1e9


def decode_ns_per_token(unit: int, mode: str, tokens: list[int], repeats: int) -> float:
    def run():
        hasher = UnitHasher(unit, mode=mode)
        for token in tokens:
            hasher.extend([token])

    return ns_per_token(run, len(tokens), repeats)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print("| mode | unit | " + " | ".join(f"{n} tokens" for n in PROMPT_LENS) + " | decode |")
    print("|---|---|" + "---|" * (len(PROMPT_LENS) + 1))
    for mode in MODES:
        for unit in UNITS:
            row = []
            for prompt_len in PROMPT_LENS:
                tokens = rng.integers(0, 150_000, prompt_len).tolist()
                row.append(
                    ns_per_token(
                        functools.partial(prompt_unit_hashes, tokens, unit, mode=mode), prompt_len, args.repeats
                    )
                )
            decode = decode_ns_per_token(unit, mode, rng.integers(0, 150_000, 512).tolist(), args.repeats)
            print(f"| {mode} | {unit} | " + " | ".join(f"{x:.1f}" for x in row) + f" | {decode:.0f} |")
    print("ns per token, median of", args.repeats, "runs")


if __name__ == "__main__":
    main()
