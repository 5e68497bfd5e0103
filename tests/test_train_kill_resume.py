"""A training run SIGKILLed mid-training, twice, and resumed ends exactly where an
uninterrupted run ends.

`jaxagent train` runs in a subprocess on the tiny Countdown config (saving every
iteration, asynchronously) and is killed with SIGKILL twice:

1. once its metrics.jsonl shows two iterations, at the first moment a checkpoint save
   is in flight (orbax's temporary step directory is on disk), so the kill cuts a save
   off; if no save is caught in flight within a few iterations (timing), it is killed
   wherever it is then;
2. after resuming, once the first new iteration's checkpoint is complete: in the middle
   of the next iteration.

Each `--resume` continues from the newest *complete* checkpoint (orbax renames a step
directory into place only once it is fully written, and deletes temporary ones when
the next manager opens the directory), drops the metrics lines of iterations after it,
and replays them. The per-iteration metrics of the whole resumed run must equal
those of a run that was never interrupted, exactly: on CPU every iteration is a pure
function of the checkpointed state (params, optimizer state, `state.rng`, task stream
position), and XLA's CPU kernels are deterministic from one process to the next. Only
the timings (`time_*_s`, `tokens_per_s`) may differ.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_countdown_grpo.yaml"
ITERATIONS = 8
#: smaller than the config's batch: each iteration ~0.5-1 s once compiled, so the run is
#: still well inside its iterations when the test sees two of them and kills it
SMALL = [
    f"iterations={ITERATIONS}",
    "checkpoint_every=1",
    "keep_checkpoints=3",
    "env.group_size=2",
    "env.tasks_per_iteration=2",
    "update.mini_batches=2",
    "rollout.max_tokens_per_turn=8",
    "rollout.max_context=448",
]
TIMING = ("tokens_per_s",)
POLL_S = 0.02
DEADLINE_S = 240


def train_cmd(run_dir, *extra):
    return [sys.executable, "-m", "jaxagent", "train", "--config", str(CONFIG), *SMALL, f"run_dir={run_dir}", *extra]


def read_jsonl(path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def learning_metrics(history) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time_") and k not in TIMING} for m in history]


def complete_steps(run_dir) -> list[int]:
    """Steps whose checkpoint directory is in place (orbax's temporary ones are not numbers)."""
    ckpt = Path(run_dir) / "checkpoints"
    if not ckpt.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt.iterdir() if p.is_dir() and p.name.isdigit())


def count_lines(path) -> int:
    try:
        return sum(1 for line in Path(path).read_text().splitlines() if line.strip())
    except FileNotFoundError:
        return 0


def partial_steps(run_dir) -> list[str]:
    """Orbax's temporary (in-flight or cut-off) step directories."""
    ckpt = Path(run_dir) / "checkpoints"
    if not ckpt.is_dir():
        return []
    return sorted(p.name for p in ckpt.iterdir() if not p.name.isdigit())


def kill_when(proc, log_path, ready, deadline_s=DEADLINE_S) -> None:
    """Poll until `ready()`, then SIGKILL `proc`; fails if it ends first."""
    deadline = time.monotonic() + deadline_s
    try:
        while not ready():
            assert proc.poll() is None, (
                f"the run ended (rc {proc.returncode}) before it could be killed:\n" + log_path.read_text()[-3000:]
            )
            assert time.monotonic() < deadline, "the kill point was not reached within the deadline"
            time.sleep(POLL_S)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL, proc.returncode


def resumed_at(log_path) -> int:
    match = re.search(r"resumed from \S+ at iteration (\d+)", Path(log_path).read_text())
    assert match, Path(log_path).read_text()[-3000:]
    return int(match.group(1))


@pytest.mark.slow
def test_sigkilled_run_resumes_to_the_metrics_of_an_uninterrupted_run(tmp_path):
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    metrics = killed / "metrics.jsonl"
    logs = [tmp_path / f"killed{i}.log" for i in range(3)]

    def start(run_dir, log_path, *extra):
        with open(log_path, "w") as log:
            return subprocess.Popen(train_cmd(run_dir, *extra), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)

    # the reference run goes on in parallel (its own process; CPU results do not depend on load)
    reference = start(straight, tmp_path / "straight.log")

    # ---- kill 1: during a checkpoint save, once two iterations are logged
    def in_a_save():
        n = count_lines(metrics)
        if n < 2 or not complete_steps(killed):
            return False
        return bool(partial_steps(killed)) or n >= ITERATIONS - 3  # fallback: kill wherever it is

    kill_when(start(killed, logs[0]), logs[0], in_a_save)
    kills = [(count_lines(metrics), complete_steps(killed), partial_steps(killed))]

    # ---- kill 2: mid-iteration, once the resumed run has checkpointed a new iteration
    second = start(killed, logs[1], "--resume")

    def after_a_new_checkpoint():
        steps = complete_steps(killed)
        return bool(steps) and steps[-1] > max(kills[0][1]) and steps[-1] >= count_lines(metrics)

    kill_when(second, logs[1], after_a_new_checkpoint)
    kills.append((count_lines(metrics), complete_steps(killed), partial_steps(killed)))
    where = "; ".join(
        f"kill {i + 1}: after {n} logged iterations, checkpoints {c}, partial {p}" for i, (n, c, p) in enumerate(kills)
    )
    print(where)
    for n, complete, _ in kills:
        assert 2 <= n < ITERATIONS, "killed mid-training, not after the last iteration: " + where
        assert complete and max(complete) <= n, where

    # ---- resume to the end
    with open(logs[2], "w") as log:
        final = subprocess.run(
            train_cmd(killed, "--resume"), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=DEADLINE_S
        )
    assert final.returncode == 0, logs[2].read_text()[-3000:]
    # each resume continued from the newest complete checkpoint on disk after the kill (a
    # save cut off by the kill left at most a temporary directory, which does not count)
    resumed = [resumed_at(logs[1]), resumed_at(logs[2])]
    assert resumed == [max(kills[0][1]), max(kills[1][1])], (where, resumed)

    assert reference.wait(timeout=DEADLINE_S) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    after_resume, uninterrupted = read_jsonl(metrics), read_jsonl(straight / "metrics.jsonl")
    assert [m["iteration"] for m in after_resume] == list(range(1, ITERATIONS + 1))
    assert [m["iteration"] for m in uninterrupted] == list(range(1, ITERATIONS + 1))
    for i, (a, b) in enumerate(zip(learning_metrics(after_resume), learning_metrics(uninterrupted), strict=True), 1):
        assert a == b, f"iteration {i} differs ({where}; resumed at {resumed}):\n{a}\n{b}"
    assert complete_steps(killed)[-1] == ITERATIONS
    assert not partial_steps(killed), "a partial checkpoint was left behind"
