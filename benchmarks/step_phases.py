#!/usr/bin/env python3
"""Where a serving step's allocation time goes: per program, the thunks and µs of each phase.

Replays the first requests of a workload (as benchmarks/serving_workload.py, prefix caching on)
once untimed, then once under `jax.profiler` (its Python tracer off). Every thunk XLA:CPU runs is
named in the trace; the program's compiled HLO text gives each thunk's instruction, whose metadata
carries its phase (`jax.named_scope` in `jaxkv.core.step.allocate_step`). Per program (work signature
`jaxkv.core.step.StepWork`, rows R, and whether pending frees ride along: the common step kinds), prints
how many steps ran it, the µs of the whole call (`allocate_slots_batch`), of the jitted call
(dispatch and run) and of its thunks, and per phase the thunks' µs per call and how many ran. A
loop's thunk counts only its own time (its body's thunks are events of their own). Thunk µs are
summed over XLA's threads (CPU time, not wall time). Run it without JAX's persistent compilation
cache: a cached executable may carry an older program's metadata.

The compiled text is compiled again here, so keep --max-programs well under MAX_PROGRAMS: each
program's kernels take memory maps (see `jaxkv.manager.jax_engine.MAX_PROGRAMS`).

    python benchmarks/step_phases.py --workload /tmp/workload.json --num-requests 200 --max-programs 12 --json
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

import jax
import serving_workload as sw
from jax.profiler import ProfileData

from jaxkv.manager import KVCacheManager
from jaxkv.manager import jax_engine as manager_module

PHASES = (
    "sync_counts",
    "free_requests",
    "store_keys",
    "register_finished_states",
    "claim_hits",
    "gate_rows",
    "unclaim_failed",
    "release_behind_windows",
    "take_blocks",
    "place_tails",
    "index_filled_blocks",
)
_OP = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name=\"([^\"]*)\"")


def op_phases(hlo_text: str) -> dict[str, tuple[str, str]]:
    """{HLO instruction -> (phase ("other" outside every phase), its op name and result shape)} of a
    compiled program's text."""
    names = {}
    for line in hlo_text.splitlines():
        m = _OP.match(line)
        if m:
            phase = next((p for p in PHASES if f"/{p}/" in m.group(2) or m.group(2).endswith(f"/{p}")), "other")
            names[m.group(1)] = (phase, line.split(" = ", 1)[1].split("(", 1)[0] + " " + m.group(2).split("/")[-1])
    return names


def exclusive_times(events):
    """[(start ns, thunk, µs)] from [(start ns, duration ns, thread, thunk)]: a loop or conditional's
    thunk runs its body's thunks, which are events too; each event keeps only its own time."""
    out, stacks = [], {}
    for start, duration, thread, name in sorted(events):
        stack = stacks.setdefault(thread, [])
        while stack and stack[-1][0] + stack[-1][1] <= start:
            stack.pop()
        if stack:
            stack[-1][3][0] -= duration  # the parent's own time
        entry = [start, duration, name, [duration]]
        stack.append(entry)
        out.append(entry)
    return [(start, name, own[0] / 1e3) for start, _, name, own in out]


def record_allocations(calls: list):
    """Makes every manager's allocation program append (work, program key, argument shapes) to `calls`."""
    real = manager_module._jitted

    def jitted(cfg, prefix):
        allocate, *rest = real(cfg, prefix)

        def recording(*args, work):
            shapes = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
            key = (work, args[1].shape, args[3] is None, args[5] is None)
            calls.append(
                {"work": work, "key": key, "shapes": shapes, "step": recording.in_step, "lower": allocate.lower}
            )
            return allocate(*args, work=work)

        recording.in_step = False
        return (recording, *rest)

    manager_module._jitted = jitted


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True)
    p.add_argument("--num-requests", type=int, default=256, help="the workload's first requests")
    p.add_argument("--num-blocks", type=int, default=32768)
    p.add_argument("--json", action="store_true")
    p.add_argument("--top", type=int, default=0, help="also list each program's N costliest thunks")
    p.add_argument(
        "--max-programs",
        type=int,
        default=manager_module.MAX_PROGRAMS,
        help="specialised programs compiled (later steps: the full program)",
    )
    args = p.parse_args(argv)
    manager_module.MAX_PROGRAMS = args.max_programs
    sw.sync_cpu_dispatch()
    workload = json.load(open(args.workload))
    workload["requests"] = workload["requests"][: args.num_requests]
    ns = argparse.Namespace(
        workload=args.workload,
        num_blocks=args.num_blocks,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=32768,
        no_prefix_caching=False,
        backend="jax",
    )
    sw.replay(ns, workload)  # compiles and runs every program once

    calls: list[dict] = []
    record_allocations(calls)
    call_us: list[float] = []  # allocate_slots_batch calls that dispatched, in order
    original = KVCacheManager.allocate_slots_batch

    def timed(self, *a, **kw):
        self._engine._allocate_fn.in_step = True
        t = time.perf_counter()
        out = original(self, *a, **kw)
        dt = time.perf_counter() - t
        self._engine._allocate_fn.in_step = False
        if self.last_work is not None:
            call_us.append(dt * 1e6)
        return out

    KVCacheManager.allocate_slots_batch = timed
    trace_dir = tempfile.mkdtemp(prefix="jaxkv-trace-")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python calls untraced: the calls' host time stays as it is
    jax.profiler.start_trace(trace_dir, profiler_options=options)
    sw.replay(ns, workload)
    jax.profiler.stop_trace()
    KVCacheManager.allocate_slots_batch = original

    data = ProfileData.from_file(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0])
    runs = collections.defaultdict(list)  # run id -> [(start ns, thunk, µs)]
    jit_events = []  # (start ns, µs) of the jitted allocation calls
    for plane in data.planes:
        for line in plane.lines:
            for event in line.events:
                if event.name.startswith("PjitFunction(_allocate_packed"):
                    jit_events.append((event.start_ns, event.duration_ns / 1e3))
                    continue
                stats = dict(event.stats)
                if stats.get("hlo_module") == "jit__allocate_packed":
                    runs[stats["run_id"]].append((event.start_ns, event.duration_ns, line.name, event.name))
    ordered_runs = [exclusive_times(events) for events in sorted(runs.values(), key=min)]
    outer, end = [], 0  # each call shows up as nested events: keep the outer one
    for start, us in sorted(jit_events):
        if start >= end:
            outer.append((start, us))
            end = start + us * 1e3
    jit_events = outer
    if not len(calls) == len(ordered_runs) == len(jit_events):
        print(
            f"{len(calls)} calls, {len(jit_events)} jitted calls and {len(ordered_runs)} runs traced: cannot pair them",
            file=sys.stderr,
        )
        return 1
    phases_of = {}  # program key -> {thunk -> phase}
    table = {}
    step_calls = iter(call_us)
    for call, (_, jit_us), thunks in zip(calls, jit_events, ordered_runs):
        if not call["step"]:
            continue
        key = call["key"]
        if key not in phases_of:
            phases_of[key] = op_phases(call["lower"](*call["shapes"], work=call["work"]).compile().as_text())
        work, (_, num_rows), no_frees, _ = key
        name = f"{work} R={num_rows}{'' if no_frees else ' +frees'}"
        row = table.setdefault(
            name,
            {
                "steps": 0,
                "call_us": 0.0,
                "jit_us": 0.0,
                "phase_us": collections.Counter(),
                "phase_ops": collections.Counter(),
                "thunk_us": collections.Counter(),
            },
        )
        row["steps"] += 1
        row["call_us"] += next(step_calls)
        row["jit_us"] += jit_us
        ops = collections.Counter()
        for _, name, us in thunks:
            phase, what = phases_of[key].get(name, ("other", ""))
            row["phase_us"][phase] += us
            row["thunk_us"][f"{phase}: {name} {what}"] += us
            ops[phase] += 1
        row["phase_ops"] = ops
    out = []
    for work, row in sorted(table.items(), key=lambda item: -item[1]["steps"]):
        n = row["steps"]
        out.append(
            {
                "work": work,
                "steps": n,
                "call_us": row["call_us"] / n,
                "jit_us": row["jit_us"] / n,
                "thunk_us": sum(row["phase_us"].values()) / n,
                "phases": {
                    ph: [round(row["phase_us"][ph] / n, 1), row["phase_ops"][ph]]
                    for ph in PHASES + ("other",)
                    if row["phase_ops"][ph]
                },
                "top_thunks": [[what, round(us / n, 1)] for what, us in row["thunk_us"].most_common(args.top)],
            }
        )
    result = {
        "jax_version": jax.__version__,
        "num_blocks": args.num_blocks,
        "num_requests": args.num_requests,
        "dispatching_calls": len(call_us),
        "signatures": out,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for row in out:
            print(
                f"{row['work']}: {row['steps']} steps, call {row['call_us']:.0f} µs, jit {row['jit_us']:.0f}, "
                f"thunks {row['thunk_us']:.0f}"
            )
            for ph, (us, n) in row["phases"].items():
                print(f"    {ph:26s} {us:8.1f} µs {n:6d} thunks run")
            for what, us in row["top_thunks"]:
                print(f"      {us:8.1f} µs  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
