"""SIGTERM (what clusters send before preemption) and SIGINT (Ctrl-C) stop a run cleanly:
the iteration in progress ends, a checkpoint is saved, the env workers are closed, and the
command exits with one line and status 128 + the signal number. A second signal abandons
the iteration at once. A run stopped by SIGTERM and resumed ends exactly where an
uninterrupted run ends."""

import os
import signal
import subprocess
import time

import pytest
from test_train_kill_resume import ITERATIONS, complete_steps, count_lines, learning_metrics, read_jsonl, train_cmd

DEADLINE_S = 240


def start(run_dir, log_path, *extra):
    log = open(log_path, "w")
    return subprocess.Popen(
        train_cmd(run_dir, "logging.progress=false", *extra),
        stdout=log,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_lines(proc, metrics, n):
    deadline = time.monotonic() + DEADLINE_S
    while count_lines(metrics) < n:
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) first: {proc.stderr.read()[-3000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.02)


def children_of(pid) -> list[int]:
    try:
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [int(x) for x in out.split()]


def stop(proc, *signals, gap=0.0):
    """Sends `signals` to the run's process group (as a terminal or a cluster does)."""
    workers = children_of(proc.pid)
    for s in signals:
        os.killpg(proc.pid, s)
        time.sleep(gap)
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return err, workers


def no_orphans(workers):
    time.sleep(0.5)
    alive = [w for w in workers if os.path.exists(f"/proc/{w}") and open(f"/proc/{w}/stat").read().split()[2] != "Z"]
    assert not alive, f"env workers left running: {alive}"


def test_sigterm_ends_the_iteration_saves_and_exits_143(tmp_path):
    run = tmp_path / "run"
    proc = start(run, tmp_path / "log", "checkpoint_every=100")  # no periodic checkpoint after iteration 0
    metrics = run / "metrics.jsonl"
    wait_for_lines(proc, metrics, 2)
    err, workers = stop(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    stopped = count_lines(metrics)
    assert last == (
        f"jaxagent train: stopped by SIGTERM after iteration {stopped}, checkpoint saved; "
        f"continue with jaxagent train --resume {run}"
    ), err
    assert stopped < ITERATIONS and complete_steps(run)[-1] == stopped
    no_orphans(workers)


@pytest.mark.slow
def test_a_second_sigint_abandons_the_iteration(tmp_path):
    run = tmp_path / "run"
    proc = start(run, tmp_path / "log")
    wait_for_lines(proc, run / "metrics.jsonl", 1)
    err, workers = stop(proc, signal.SIGINT, signal.SIGINT, gap=0.05)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("jaxagent train: stopped by SIGINT") and "--resume" in last, err
    no_orphans(workers)


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_resumes_exactly(tmp_path):
    run, straight = tmp_path / "run", tmp_path / "straight"
    proc = start(run, tmp_path / "log1", "checkpoint_every=100")
    wait_for_lines(proc, run / "metrics.jsonl", 3)
    stop(proc, signal.SIGTERM)
    assert proc.returncode == 128 + signal.SIGTERM
    for args, where in ((("--resume",), run), ((), straight)):
        out = subprocess.run(train_cmd(where, "checkpoint_every=100", *args), capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    resumed, uninterrupted = read_jsonl(run / "metrics.jsonl"), read_jsonl(straight / "metrics.jsonl")
    assert [m["iteration"] for m in resumed] == list(range(1, ITERATIONS + 1))
    assert learning_metrics(resumed) == learning_metrics(uninterrupted)
