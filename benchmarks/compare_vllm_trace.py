#!/usr/bin/env python3
"""Compares a jaxkv serving-workload trace with vLLM's, step by step.

    python benchmarks/serving_workload.py --workload W --num-blocks N --trace /tmp/jaxkv.jsonl
    $PY ../shared/peers/vllm/workload.py --load-workload W --no-async-scheduling --num-blocks N \\
        --no-enable-prefix-caching --trace /tmp/vllm.jsonl
    python benchmarks/compare_vllm_trace.py /tmp/jaxkv.jsonl /tmp/vllm.jsonl

Per step: the requests scheduled (in order, with their token counts), the requests preempted and
the free blocks after the step's last allocation. Prefix caching must be off on the vLLM side
until jaxkv's lands (issue 4): hits change what is scheduled. Exits 1 at the first difference.
"""

import json
import sys


def vllm_steps(path: str) -> list[dict]:
    steps: dict[int, dict] = {}
    for line in open(path):
        rec = json.loads(line)
        step = steps.setdefault(rec["step"], {"scheduled": [], "preempted": [], "free_blocks": None})
        idx = int(rec["req"].rsplit("-", 1)[1])
        if rec["op"] == "allocate_slots":
            step["free_blocks"] = rec["free_blocks"]
            if rec["ok"]:
                step["scheduled"].append([idx, rec["num_new_tokens"]])
        elif rec["op"] == "preempt_free":
            step["preempted"].append(idx)
    return [steps[s] for s in sorted(steps)]


def main(argv=None) -> int:
    ours_path, vllm_path = (argv or sys.argv[1:])[:2]
    ours = [json.loads(line) for line in open(ours_path)]
    theirs = vllm_steps(vllm_path)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for key in ("scheduled", "preempted", "free_blocks"):
            if a[key] != b[key]:
                print(f"step {step}: {key} differs\n  jaxkv: {a[key]}\n  vllm:  {b[key]}")
                return 1
    if len(ours) != len(theirs):
        print(
            f"identical for {min(len(ours), len(theirs))} steps, then jaxkv has {len(ours)} steps, vLLM {len(theirs)}"
        )
        return 1
    print(
        f"identical: {len(ours)} steps, {sum(len(s['scheduled']) for s in ours)} allocations, "
        f"{sum(len(s['preempted']) for s in ours)} preemptions, free blocks after every step"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
