"""Launching a group of local `jax.distributed` processes for the multi-host tests."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_process_group(script, num_processes: int, args_for, log_dir: Path, timeout_s: float) -> None:
    """Runs `python script *args_for(process_id, port)` as `num_processes` processes
    (JAX_/XLA_ variables of this process removed, the repo on PYTHONPATH, cwd the repo).
    The first failure (or the timeout) kills the others at once, and the failing
    process's log is in the test failure."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    procs, logs = [], []
    try:
        for pid in range(num_processes):
            log = open(log_dir / f"log_{pid}.txt", "w+")
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), *map(str, args_for(pid, port))],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
            if p.poll() != 0:
                log.seek(0)
                why = "timed out" if p.returncode is None else f"exited {p.returncode}"
                pytest.fail(f"process {i} of {num_processes} {why}:\n{log.read()[-4000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
