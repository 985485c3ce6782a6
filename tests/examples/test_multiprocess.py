"""Two JAX processes on this machine serve the example model with the cache sharded across both.

Each process is started as a user would start one host of a multi-host job: the same
command with its own `--process-id`, joined through `jax.distributed.initialize` at a
localhost coordinator. Each has 2 CPU devices; the 4 devices of the "model" axis span
both processes, so every step's collectives cross processes (gloo over TCP).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time

from decode_runs import DECODE, DIGEST, TINY, decode_env

NUM_PROCESSES = 2
TIMEOUT_S = 900  # for both processes together; then every process still running is killed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(tmp_path, *extra: str) -> list[tuple[int | None, str]]:
    """(returncode, output) of each process; None for one still running at the deadline (killed).

    Output goes to files, not pipes, so that no process blocks on a full pipe while
    the test waits for the other.
    """
    env = decode_env(XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip())
    coordinator = f"localhost:{_free_port()}"
    logs = [tmp_path / f"process{i}.log" for i in range(NUM_PROCESSES)]
    procs, killed = [], set()
    try:
        for i, log in enumerate(logs):
            with log.open("w") as f:
                procs.append(
                    subprocess.Popen(
                        [
                            *DECODE,
                            *TINY,
                            *extra,
                            "--coordinator",
                            coordinator,
                            "--num-processes",
                            str(NUM_PROCESSES),
                            "--process-id",
                            str(i),
                        ],
                        env=env,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                break
    finally:
        for i, p in enumerate(procs):
            if p.poll() is None:
                killed.add(i)
                p.kill()
                p.wait()
    return [(None if i in killed else p.returncode, log.read_text()) for i, (p, log) in enumerate(zip(procs, logs))]


def test_two_processes_give_the_tokens_of_one_device(one_device, tmp_path):
    results = run_processes(tmp_path, "--tp", "4")
    for i, (returncode, out) in enumerate(results):
        assert returncode is not None, f"process {i} was killed after {TIMEOUT_S} s:\n{out[-3000:]}"
        assert returncode == 0, f"process {i}:\n{out[-3000:]}"
        assert f"devices: 4 (cpu, process {i} of 2, 2 devices here)" in out
        assert "sharded as P(None, None, 'model')" in out
        assert re.search(r"; 0 mismatching requests", out)
        assert DIGEST.search(out).group(1) == DIGEST.search(one_device).group(1)
