"""Serve a hybrid model with jaxkv (a small Gemma-3-style toy, or a Hugging Face checkpoint), and
check it against a cache-free forward pass.

    python examples/decode.py                 # serve a batch of prompts, print the figures
    python examples/decode.py --check         # also compare every logit with a dense forward pass
    python examples/decode.py --check --tp 4  # the same, the cache and kernels sharded over 4 devices

    # A Gemma 3, gpt-oss or Qwen3-Next checkpoint directory (config.json, model.safetensors, tokenizer.json):
    python examples/decode.py --checkpoint DIR --prompt "Why is the sky blue?" --max-new-tokens 64
    # Qwen3-Next's state layers enlarge the blocks; a finer unit lets hits end inside one:
    python examples/decode.py --checkpoint DIR --prompt-tokens prompts.json --prefix-match-unit 8
    # Token ids in, greedy tokens and every computed logit out (row p predicts token p + 1):
    python examples/decode.py --checkpoint DIR --prompt-tokens prompts.json --ignore-eos --logits-out out.npz

    # The same over 2 processes of 2 CPU devices each (one command per process, same port):
    python examples/decode.py --check --tp 4 --coordinator localhost:8476 --num-processes 2 --process-id 0
    python examples/decode.py --check --tp 4 --coordinator localhost:8476 --num-processes 2 --process-id 1

The prompts share a system prompt (prefix reuse), some are several windows long,
and the pool is small enough that requests are preempted and resumed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys


class _OneLineErrors(argparse.ArgumentParser):
    """argparse's errors as one line naming the option (as `python -m jaxkv`'s; that module would load jax)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv=None):
    p = _OneLineErrors(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--checkpoint", metavar="DIR", help="serve this Hugging Face checkpoint (Gemma 3, gpt-oss, Qwen3-Next)"
    )
    given = p.add_mutually_exclusive_group()
    given.add_argument("--prompt", action="append", help="a prompt's text (with --checkpoint); repeat for more")
    given.add_argument("--prompt-tokens", metavar="FILE.json", help="prompts as token ids: a JSON list of lists")
    p.add_argument(
        "--dtype", choices=("bfloat16", "float32"), help="weights, activations and cache (default: the checkpoint's)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-new-tokens tokens")
    p.add_argument(
        "--logits-out",
        metavar="OUT.npz",
        help="write tokens_i int32[N] and logits_i float32[L + N - 1, V] per prompt i (NaN: a row never computed)",
    )
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--system-prompt-len", type=int, default=48)
    p.add_argument("--max-prompt-len", type=int, default=220, help="longest user part of a prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--num-blocks",
        type=int,
        help="KV pool size, null block included (default: 100 for the toy model; with --checkpoint, enough for "
        "--max-num-seqs requests at once)",
    )
    p.add_argument(
        "--prefix-match-unit",
        type=int,
        help="tokens per prefix-cache hash unit (default: the block size); finer lets hits end inside a block",
    )
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=64)
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps per on-device loop")
    p.add_argument("--tiny", action="store_true", help="a 6-layer model with window 8 (for CI)")
    p.add_argument("--check", action="store_true", help="compare with a dense forward pass; exit 1 on mismatch")
    p.add_argument("--tp", type=int, default=1, help="shard KV heads over this many devices")
    p.add_argument(
        "--speculate",
        metavar="ngram:K|draft:K",
        help="speculative decoding, verified greedily: ngram:K proposes K tokens by prompt lookup, draft:K by K "
        "passes of the target's first --draft-layers layers and its head",
    )
    p.add_argument("--draft-layers", type=int, help="layers of the draft model (default: half the target's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="run as one of --num-processes JAX processes (jax.distributed.initialize) whose "
        "coordinator, process 0, listens at HOST:PORT; the --tp devices are split evenly "
        "among the processes",
    )
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    return p.parse_args(argv)


# The least value of each integer option (None, an option's absence, is its default).
MIN_VALUES = {
    "--num-prompts": 1,
    "--max-new-tokens": 1,
    "--system-prompt-len": 0,
    "--max-prompt-len": 1,
    "--block-size": 1,
    "--num-blocks": 2,
    "--prefix-match-unit": 1,
    "--max-num-seqs": 1,
    "--max-num-batched-tokens": 1,
    "--decode-steps": 1,
    "--tp": 1,
    "--draft-layers": 1,
    "--seed": 0,
    "--num-processes": 1,
    "--process-id": 0,
}


def read_prompts(args, checkpoint, vocab_size: int) -> list[list[int]]:
    """--prompt-tokens, else --prompt (tokenized), else the toy's random prompts with a shared system prompt."""
    import numpy as np

    if args.prompt_tokens is not None:
        try:
            with open(args.prompt_tokens) as f:
                prompts = json.load(f)
        except (OSError, ValueError) as e:  # ValueError: not JSON, or not text
            raise SystemExit(f"--prompt-tokens {args.prompt_tokens}: {e}") from None
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p for p in prompts)):
            raise SystemExit(f"--prompt-tokens {args.prompt_tokens}: expected a JSON list of non-empty lists of ids")
        bad = [t for p in prompts for t in p if not (isinstance(t, int) and 0 <= t < vocab_size)]
        if bad:
            raise SystemExit(f"--prompt-tokens {args.prompt_tokens}: token {bad[0]!r} is not an id below {vocab_size}")
        return prompts
    if args.prompt:
        if checkpoint is None:
            raise SystemExit("--prompt needs --checkpoint (its tokenizer); give the toy model --prompt-tokens")
        return [checkpoint.encode(text) for text in args.prompt]
    if checkpoint is not None:
        raise SystemExit("--checkpoint needs --prompt or --prompt-tokens")
    rng = np.random.default_rng(args.seed)
    system = rng.integers(0, vocab_size, args.system_prompt_len).tolist()
    return [
        system + rng.integers(0, vocab_size, int(n)).tolist()
        for n in rng.integers(1, args.max_prompt_len + 1, args.num_prompts)
    ]


def write_logits(path: str, requests, vocab_size: int) -> None:
    """tokens_i int32[N] and logits_i float32[L + N - 1, V] per request i; rows never computed are NaN,
    a row computed twice (after a preemption) holds its last computation."""
    import numpy as np

    out = {}
    for r in requests:
        logits = np.full((len(r.tokens) - 1, vocab_size), np.nan, np.float32)
        for position, row in r.logits.items():
            logits[position] = row
        out[f"tokens_{r.request_id}"] = np.asarray(r.output, np.int32)
        out[f"logits_{r.request_id}"] = logits
    np.savez(path, **out)


def main(argv=None) -> int:
    args = parse_args(argv)
    for option, low in MIN_VALUES.items():
        value = getattr(args, option.removeprefix("--").replace("-", "_"))
        if value is not None and value < low:
            raise SystemExit(f"{option} {value}: must be at least {low}")
    if args.checkpoint is not None and args.tiny:
        raise SystemExit("--tiny picks the toy model; with --checkpoint the checkpoint is the model")
    if args.checkpoint is not None and args.check and args.dtype != "float32":
        raise SystemExit(
            "--check compares with a float32 tolerance; with --checkpoint add --dtype float32 (bf16 rounding moves "
            "logits by about 2% of their scale)"
        )
    if args.tp % args.num_processes:
        raise SystemExit(f"--tp {args.tp} must be a multiple of --num-processes {args.num_processes}")
    local_devices = args.tp // args.num_processes
    if local_devices > 1 and "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local_devices}".strip()

    import jax

    if args.coordinator is not None:
        from sharding import initialize_processes

        initialize_processes(args.coordinator, args.num_processes, args.process_id)
    from serving import ServingLoop
    from sharding import model_mesh

    import jaxkv

    checkpoint = None
    if args.checkpoint is not None:
        from checkpoint import load_model, open_checkpoint

        try:
            checkpoint = open_checkpoint(args.checkpoint)
        except ValueError as e:
            raise SystemExit(f"--checkpoint {args.checkpoint}: {e}") from None
        if checkpoint.text.model_type == "qwen3_next" and args.tp > 1:
            raise SystemExit(f"{args.checkpoint}: the Qwen3-Next example runs on one device; drop --tp {args.tp}")
        model = load_model(checkpoint, args.dtype)
        # Qwen3-Next's recurrent state stays float32 whatever the weights, as transformers keeps it.
        ssm = {"mamba_ssm_dtype": "float32"} if checkpoint.text.model_type == "qwen3_next" else {}
        specs = jaxkv.specs_from_hf_config(
            checkpoint.config, dtype=model.embed_tokens[...].dtype, block_size=args.block_size, **ssm
        )
        eos_token_ids = () if args.ignore_eos else checkpoint.eos_token_ids
        vocab_size = checkpoint.text.vocab_size
    else:
        from flax import nnx
        from model import Decoder, ModelConfig

        model_cfg = ModelConfig.tiny() if args.tiny else ModelConfig()
        model = Decoder(model_cfg, rngs=nnx.Rngs(args.seed))
        specs = model_cfg.kv_cache_specs(args.block_size)
        eos_token_ids = ()
        vocab_size = model_cfg.vocab_size
    prompts = read_prompts(args, checkpoint, vocab_size)
    max_model_len = max(map(len, prompts)) + args.max_new_tokens
    # The block's bytes only (vLLM's grouping depends on neither budget nor length): one 1-token request in 2 GiB,
    # which every model fits and which int32 slots address (a page holds at least a byte per token).
    probe = jaxkv.plan(
        specs, 1 << 31, max_model_len=1, max_num_batched_tokens=args.max_num_batched_tokens, grouping="vllm"
    )
    if args.num_blocks is not None:
        budget = args.num_blocks * probe.bytes_per_block
    elif checkpoint is None:
        budget = 100 * probe.bytes_per_block
    else:
        budget = args.max_num_seqs * probe.bytes_per_request(max_model_len) + probe.bytes_per_block
    try:
        kv_cfg = jaxkv.plan(
            specs,
            budget,
            max_model_len=max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            grouping="vllm",
        )
    except ValueError as e:  # a --num-blocks too small for one request
        pool = f"--num-blocks {args.num_blocks}" if args.num_blocks is not None else "the default pool"
        raise SystemExit(f"{pool}: {e}") from None
    mesh = model_mesh(args.tp) if args.tp > 1 else None
    proposer = None
    if args.speculate is not None:
        from serving import DraftModel, ngram_proposer

        kind, _, num = args.speculate.partition(":")
        if kind not in ("ngram", "draft") or not num.isdigit() or int(num) < 1:
            raise SystemExit(f"--speculate {args.speculate}: expected ngram:K or draft:K with K ≥ 1 (e.g. ngram:4)")
        if checkpoint is not None and checkpoint.text.model_type == "qwen3_next":
            raise SystemExit(
                f"--speculate {args.speculate}: Qwen3-Next's linear-attention layers keep one state per request, "
                "which a rejected draft would overwrite; serve it without speculative decoding"
            )
        num_layers = len(model.blocks if hasattr(model, "blocks") else model.layers)
        draft_layers = args.draft_layers or max(1, num_layers // 2)
        if not 1 <= draft_layers <= num_layers:
            raise SystemExit(f"--draft-layers {draft_layers}: the target has {num_layers} layers")
        proposer = ngram_proposer(int(num)) if kind == "ngram" else DraftModel(int(num), draft_layers)
    loop = ServingLoop(
        model,
        kv_cfg,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_steps=args.decode_steps,
        record_logits=args.check or args.logits_out is not None,
        mesh=mesh,
        prefix_match_unit=args.prefix_match_unit,
        proposer=proposer,
    )
    requests = loop.generate(prompts, args.max_new_tokens, eos_token_ids, progress=True)
    s = loop.stats
    digest = hashlib.sha256(repr([r.output for r in requests]).encode()).hexdigest()[:16]
    full = kv_cfg.all_full
    where = jax.default_backend()
    if jax.process_count() > 1:
        where += f", process {jax.process_index()} of {jax.process_count()}, {jax.local_device_count()} devices here"
    print(
        f"devices: {args.tp} ({where}), {len(requests)} requests, {s.tokens_generated} tokens "
        f"generated in {s.seconds:.2f} s: {s.tokens_generated / s.seconds:.1f} tokens/s "
        f"({s.tokens_computed / s.seconds:.1f} tokens/s computed incl. prefill)"
    )
    print(
        f"cache {tuple(loop.cache.shape)} {loop.cache.dtype} sharded as "
        f"{loop.cache.sharding.spec if args.tp > 1 else 'one device'}; "
        f"generated tokens digest {digest}"
    )
    print(
        f"engine steps: {s.steps} ({s.device_loops} on-device loops of {args.decode_steps} decode steps), "
        f"preemptions: {s.preemptions}, block copies: {s.block_copies}, "
        f"allocation programs (work signatures): {len(loop.mgr.step_variants)}"
    )
    if proposer is not None:
        print(
            f"speculative decoding ({args.speculate}): {s.drafts_accepted}/{s.drafts_proposed} drafts accepted "
            f"({100 * s.drafts_accepted / max(s.drafts_proposed, 1):.1f}%), "
            f"{s.tokens_generated / max(s.steps, 1):.2f} tokens generated per target forward pass"
        )
    print(
        f"prefix-hit rate: {s.prefix_hit_tokens}/{s.prompt_tokens} prompt tokens "
        f"({100 * s.prefix_hit_tokens / max(s.prompt_tokens, 1):.1f}%)"
    )
    print(
        "peak KV blocks in use per group: "
        + ", ".join(f"{g.describe()}×{len(g.layer_names)}: {n}" for g, n in zip(kv_cfg.groups, s.peak_blocks_per_group))
    )
    line = (
        f"KV cache: {kv_cfg.num_blocks} blocks of {kv_cfg.bytes_per_block} B; holds {kv_cfg.capacity_tokens} tokens "
        f"of {max_model_len}-token requests, {kv_cfg.bytes_per_request(max_model_len):,} B per request"
    )
    if full is not None:
        line += (
            f"; an all-full-attention cache in the same memory holds {full.capacity_tokens} "
            f"({kv_cfg.capacity_tokens / full.capacity_tokens:.2f}×), {full.bytes_per_request(max_model_len):,} B "
            "per request"
        )
    elif any(g.kind in ("sliding_window", "chunked_local") for g in kv_cfg.groups):
        line += "; an all-full-attention cache in the same memory could not hold one request"
    print(line)
    if checkpoint is not None:
        for r in requests:
            print(f"[{r.request_id}] {checkpoint.decode(r.prompt)!r} -> {checkpoint.decode(r.output)!r}")
    if args.logits_out is not None:
        write_logits(args.logits_out, requests, vocab_size)
    if not args.check:
        return 0
    from check import compare_with_dense

    worst, mismatches = compare_with_dense(model, requests)
    print(
        f"check: {sum(len(r.logits) for r in requests)} logit rows of {len(requests)} requests against a dense "
        f"forward pass (no cache, window masks): max abs error {worst:.2e}; "
        f"{mismatches} mismatching requests"
    )
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
