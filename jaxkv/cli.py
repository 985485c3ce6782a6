"""Command line: `python -m jaxkv plan --hf-config config.json --memory 40GiB --max-model-len 32768`.

Subcommands register themselves in `main()`'s parser; each has a `_cmd_*` function.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from jaxkv.memory.layout_html import add_layout_parser
from jaxkv.planner.config import LAYOUTS
from jaxkv.planner.hf_config import specs_from_hf_config
from jaxkv.planner.planning import GROUPINGS, plan

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """'40GiB', '1.5 GB', '4096MiB', '123456' → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m[2].lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 40GiB, 1.5GB, 4096MiB or a byte count")
    num_bytes = int(float(m[1]) * _UNITS[m[2].lower()])
    if num_bytes < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte")
    return num_bytes


def positive_int(text: str) -> int:
    """An argparse type: '16' → 16; anything but a positive integer is refused (argparse names the option)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def read_json(path: str) -> dict:
    """The JSON object in file `path`; ValueError naming the file when it holds anything else."""
    with open(path) as f:
        try:
            value = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object ({{...}}), not a {type(value).__name__}")
    return value


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan a KV cache for a Hugging Face config.json and print the summary")
    p.add_argument("--hf-config", required=True, metavar="PATH", help="the model's config.json")
    p.add_argument("--memory", required=True, type=parse_bytes, help="KV cache budget, e.g. 40GiB")
    p.add_argument("--max-model-len", required=True, type=positive_int)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--dtype", default="bfloat16", help="KV cache dtype (default bfloat16)")
    p.add_argument(
        "--block-size", type=positive_int, default=None, help="tokens per block (default: 16, 64 for DeepSeek-V3.2)"
    )
    p.add_argument("--grouping", choices=GROUPINGS, default="auto")
    p.add_argument("--max-groups", type=positive_int, default=16, help="most groups grouping=auto may create")
    p.add_argument("--layout", choices=LAYOUTS, default="BLHNC")
    p.add_argument("--no-hybrid", action="store_true", help="allocate every attention layer as full attention")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="draw KV bytes per request against request length")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args) -> None:
    config = read_json(args.hf_config)
    layers = specs_from_hf_config(config, dtype=args.dtype, block_size=args.block_size)
    cfg = plan(
        layers,
        args.memory,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        hybrid=not args.no_hybrid,
        grouping=args.grouping,
        layout=args.layout,
        max_groups=args.max_groups,
    )
    if args.json:
        print(json.dumps(cfg.to_dict(), indent=2))
    else:
        print(cfg.summary())
    if args.plot:
        plot_bytes_per_request(cfg, args.plot, title=config.get("model_type", ""))
        print(f"wrote {args.plot}", file=sys.stderr)


def plot_bytes_per_request(cfg, path: str, *, title: str = "", num_points: int = 512) -> None:
    """KV bytes one request holds against its length, for `cfg` and for all-full attention."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install 'jaxkv[plot]'") from e
    step = max(1, cfg.max_model_len // num_points)
    lengths = list(range(1, cfg.max_model_len + 1, step)) + [cfg.max_model_len]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(lengths, [cfg.bytes_per_request(n) / 2**20 for n in lengths], label="this plan")
    if cfg.all_full is not None:
        full = cfg.all_full
        ax.plot(lengths, [full.bytes_per_request(n) / 2**20 for n in lengths], label="all full attention")
    ax.set_xlabel("request length (tokens)")
    ax.set_ylabel("KV cache per request (MiB)")
    ax.set_title(f"{title} KV bytes per request".strip())
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


class OneLineErrors(argparse.ArgumentParser):
    """An argument parser whose errors are one line naming the option (`--help` shows the usage), exit status 2;
    its subcommands' parsers are of the same class."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrors(prog="python -m jaxkv", description="jaxkv: paged KV caches for hybrid models")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plan_parser(sub)
    add_layout_parser(sub, parse_bytes, positive_int, read_json)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
