"""SIGKILL in the middle of a write (issue 49, "fail closed"): a training run killed at
chosen points of its checkpoint, metrics, episode store, summary, config, TensorBoard
and transcript writes always resumes to exactly the run that was never killed.

How the kill lands where it should, deterministically: `jaxagent train` runs in a
subprocess through `_driver` (this module), which wraps the writes the run makes under
its run directory (`open` for writing, `os.rename` / `os.replace`, `shutil.rmtree`)
before calling `jaxagent.cli.main`. A kill point names one kind of operation, a regular
expression on the path relative to the run directory and which matching call (the n-th;
empty writes are not counted); at that call the driver writes only the first `cut` of
the data (a fraction: a torn line, a half file), or renames before or after, or deletes
the first files of a tree, and then SIGKILLs its own process (from whichever thread is
writing: orbax saves in a background thread). A point may also stall its thread instead
(a save held in flight while the run goes on to the kill). No hook is in the product.

After each kill, before the resume:
- `jaxagent plot` and `jaxagent view` (their CLI entry point, in this process) read the
  killed run, whose metrics.jsonl may end in a torn line;
then `jaxagent train --resume` (the CLI) must
- log "resumed from ... at iteration k", k the newest *complete* checkpoint on disk
  (a step directory with orbax's commit marker);
- at that moment (recorded by the driver right after `Trainer._restore`) hold a
  metrics.jsonl of exactly iterations 1..k, whole lines, and no episode store
  iteration past k;
and once a run has been resumed to its end, its metrics.jsonl has every iteration
exactly once, whole lines, with the learning metrics (all but timings) of an
uninterrupted run of the same config; its episode store (thinned by its bound at
iteration 4), transcripts, summary.json and TensorBoard scalars (read by TensorBoard's
own reader) are the uninterrupted run's; no temporary file or checkpoint directory is
left behind. A kill before the first checkpoint leaves nothing to resume: `--resume`
says so (status 2) and a fresh start replaces the run.

The default suite runs an in-process check of a fresh start over a killed one. `-m slow`
kills one run once in the middle of a metrics line while a checkpoint's save is in
flight (one of its files half written) and resumes it (about 40 s of `jaxagent train`
on 2 cores), and sweeps every kind of write (`SWEEP`).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_countdown_grpo.yaml"
ITERATIONS = 4
#: the tiny Countdown run of tests/test_train_kill_resume.py, shorter; a checkpoint after
#: every iteration (keep 2, plus step 0 after the evaluation before RL, so step 1 is
#: deleted when step 3 is committed), an episode store, transcripts, TensorBoard, and a
#: held-out evaluation of 2 episodes before and after RL (summary.json). The store's
#: bound (~22.5 KiB; an iteration's file is ~6.5 KiB) is reached at iteration 4, which
#: thins it to every 2nd iteration: iterations 2 and 4 are kept.
OVERRIDES = [
    f"iterations={ITERATIONS}",
    "checkpoint_every=1",
    "keep_checkpoints=2",
    "env.group_size=2",
    "env.tasks_per_iteration=2",
    "env.num_workers=0",
    "update.mini_batches=2",
    "rollout.max_tokens_per_turn=8",
    "rollout.max_context=448",
    "eval.episodes=2",
    "logging.episodes_per_iteration=2",
    "logging.episodes_max_mb=0.022",
    "logging.transcripts_every=1",
    "logging.tensorboard=true",
]
TIMING = ("tokens_per_s",)
DEADLINE_S = 300
SPEC_ENV = "JAXAGENT_TEST_KILL_SPEC"
CKPT_TMP = r"\.orbax-checkpoint-tmp"
#: how long a stalled write waits (the kill elsewhere comes within seconds)
STALL_S = 120
#: what `killed_and_resumed` reports of a resume killed before the restore logged its step
KILLED_IN_RESTORE = "killed in the restore"


# ----------------------------------------------------------------------------- the driver (subprocess side)
def _driver() -> None:
    """`jaxagent` (argv) with the run directory's writes wrapped (module docstring); the
    spec is JSON in $JAXAGENT_TEST_KILL_SPEC: run_dir, points (what to do where: `then`
    "kill", or "stall": that thread waits, up to STALL_S, and the run goes on around it),
    fired (the file that records a kill), snapshot (where to record the state right after
    the restore)."""
    import builtins
    import io
    import threading

    spec = json.loads(os.environ[SPEC_ENV])
    run = os.path.realpath(spec["run_dir"])
    points = spec.get("points", [])
    lock = threading.Lock()
    seen = [0] * len(points)
    real_open, real_rename, real_replace, real_rmtree = builtins.open, os.rename, os.replace, shutil.rmtree

    def rel(path) -> str | None:
        if isinstance(path, int):
            return None
        try:
            p = os.path.realpath(os.fspath(path))
        except TypeError:
            return None
        return os.path.relpath(p, run) if p.startswith(run + os.sep) else None

    def due(op: str, name: str | None) -> dict | None:
        """The point whose call this is (each point counts its matching calls)."""
        if name is None:
            return None
        with lock:
            for i, point in enumerate(points):
                if point["op"] == op and re.search(point["path"], name):
                    seen[i] += 1
                    if seen[i] == point["nth"]:
                        return point
        return None

    def then(point: dict, what: str) -> None:
        if point.get("then") == "stall":
            threading.Event().wait(STALL_S)
            return
        with real_open(spec["fired"], "a") as f:
            f.write(what + "\n")
        os.kill(os.getpid(), signal.SIGKILL)

    class Hooked:
        """A file opened for writing under the run directory."""

        def __init__(self, f, name):
            self._f, self._name = f, name

        def write(self, data):
            point = due("write", self._name) if len(data) else None
            if point is None:
                return self._f.write(data)
            cut = point["cut"]
            n = len(data) if cut >= 1 else min(max(int(len(data) * cut), 1), len(data) - 1)
            self._f.write(data[:n])
            self._f.flush()
            then(point, f"write {self._name}: {n} of {len(data)}")
            return self._f.write(data[n:])

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            self._f.__enter__()
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

        def __iter__(self):
            return iter(self._f)

    def hooked_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        name = rel(file)
        if name is not None and any(c in mode for c in "wax+"):
            return Hooked(f, name)
        return f

    def renamer(real):
        def rename(src, dst, *args, **kwargs):
            name = rel(src)
            point = due("rename", name)
            if point is None:
                return real(src, dst, *args, **kwargs)
            if point["when"] == "after":
                real(src, dst, *args, **kwargs)
            then(point, f"rename {name} ({point['when']})")
            if point["when"] != "after":
                real(src, dst, *args, **kwargs)

        return rename

    def rmtree(path, *args, **kwargs):
        name = rel(path)
        point = due("rmtree", name)
        if point is not None:
            files = sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
            for f in files[: point["files"]]:  # a deletion cut off after its first files
                os.unlink(f)
            then(point, f"rmtree {name}: {point['files']} of {len(files)} files removed")
        return real_rmtree(path, *args, **kwargs)

    builtins.open = io.open = hooked_open
    os.rename, os.replace = renamer(real_rename), renamer(real_replace)
    shutil.rmtree = rmtree
    if spec.get("snapshot"):
        from jaxagent.train.trainer import Trainer

        restore = Trainer._restore

        def recorded(self, ckpt):
            restore(self, ckpt)
            metrics = Path(run, "metrics.jsonl")
            store = sorted(int(p.stem[5:]) for p in Path(run, "episodes").glob("iter_*.jsonl"))
            with real_open(spec["snapshot"], "w") as f:
                json.dump(
                    {
                        "iteration": self.iteration,
                        "store": store,
                        "metrics": metrics.read_text() if metrics.exists() else None,
                    },
                    f,
                )

        Trainer._restore = recorded
    from jaxagent.cli import main

    sys.exit(main(sys.argv[1:]))


# ----------------------------------------------------------------------------- the test side
def train_args(run_dir, *extra) -> list[str]:
    return ["train", "--config", str(CONFIG), *OVERRIDES, f"run_dir={run_dir}", *extra]


def run_driver(run_dir, log_path, spec: dict, *extra) -> int:
    """The return code of `jaxagent train` run through `_driver`."""
    env = {**os.environ, SPEC_ENV: json.dumps({"run_dir": str(run_dir), **spec})}
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import {Path(__file__).stem} as t; t._driver()"
    )
    with open(log_path, "w") as log:
        return subprocess.run(
            [sys.executable, "-c", code, *train_args(run_dir, *extra)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=DEADLINE_S,
        ).returncode


def complete_steps(run_dir) -> list[int]:
    from jaxagent.train.rundir import checkpoint_steps

    return checkpoint_steps(run_dir)


def learning_metrics(history) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time_") and k not in TIMING} for m in history]


def whole_lines(text: str, where) -> list[dict]:
    """The records of a JSON-lines text that must have no torn line (every line ends
    with a newline and parses)."""
    assert text == "" or text.endswith("\n"), f"{where}: a torn last line: {text[-200:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def untimed(x):
    """`x` without the timings (keys ending in `_s`, `seconds`, `time_*`, `tokens_per_s`)."""
    if isinstance(x, dict):
        return {
            k: untimed(v)
            for k, v in x.items()
            if not (k.endswith("_s") or k.startswith("time_") or "seconds" in k or k in TIMING)
        }
    if isinstance(x, list):
        return [untimed(v) for v in x]
    return x


def store(run_dir) -> dict[int, list[dict]]:
    from jaxagent.train.rundir.episodes import read_store

    out: dict[int, list[dict]] = {}
    for rec in read_store(run_dir):
        out.setdefault(rec["iteration"], []).append(rec)
    return out


def transcripts(run_dir) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((Path(run_dir) / "transcripts").glob("*"))}


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard itself reads the run's event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(Path(run_dir) / "tensorboard"))
    acc.Reload()
    return {
        tag: [(e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
        if not tag.startswith("time/") and tag.split("/")[-1] not in TIMING
    }


def leftovers(run_dir) -> list[str]:
    """Temporary files and checkpoint directories still in the run directory."""
    return sorted(
        str(p.relative_to(run_dir))
        for p in Path(run_dir).rglob("*")
        if p.name.endswith(".tmp") or re.search(CKPT_TMP, p.name)
    )


def read_killed_run(run_dir, tmp_path) -> None:
    """`jaxagent plot` and `jaxagent view` read a killed run: the records they see are
    exactly the whole lines of metrics.jsonl (a torn last line is left out)."""
    from jaxagent.cli import main
    from jaxagent.train.rundir.plot import read_metrics, read_run
    from jaxagent.view import ViewError
    from jaxagent.view import read_run as view_run

    text = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
    *lines, last = text.split("\n")
    whole = [json.loads(line)["iteration"] for line in lines if line.strip()]
    try:  # a last line cut just before its newline is a whole record to the non-live reader
        whole_json = whole + [json.loads(last)["iteration"]]
    except (ValueError, KeyError, TypeError):
        whole_json = whole
    tmp_path.mkdir(parents=True, exist_ok=True)
    if not whole and not (run_dir / "config.yaml").exists():  # killed before it logged or said anything
        with pytest.raises(ViewError, match="neither metrics.jsonl nor an episode store"):
            view_run(run_dir)
        assert main(["view", str(run_dir), "--out", str(tmp_path / "site")]) == 2
        return
    run, _ = view_run(run_dir)
    assert [m["iteration"] for m in run["metrics"]] == whole
    assert main(["view", str(run_dir), "--out", str(tmp_path / "site")]) == 0
    if whole_json and (run_dir / "config.yaml").exists():
        assert [m["iteration"] for m in read_metrics(run_dir / "metrics.jsonl")] == whole_json
        read_run(run_dir)
        assert main(["plot", str(run_dir), "--out", str(tmp_path / "curves.png")]) == 0


class Reference:
    """The uninterrupted run, started in the background (one per module)."""

    def __init__(self, root: Path):
        self.run_dir, self.log = root / "straight", root / "straight.log"
        with open(self.log, "w") as log:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "jaxagent", *train_args(self.run_dir)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def done(self) -> Path:
        assert self._proc.wait(timeout=DEADLINE_S) == 0, self.log.read_text()[-3000:]
        return self.run_dir


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ref = Reference(tmp_path_factory.mktemp("reference"))
    yield ref
    if ref._proc.poll() is None:
        ref._proc.kill()
        ref._proc.wait()


def write(path: str, nth: int = 1, cut: float = 0.5) -> dict:
    """Killed at the nth non-empty write to a file matching `path`, `cut` of it written."""
    return {"op": "write", "path": path, "nth": nth, "cut": cut}


def rename(path: str, when: str, nth: int = 1) -> dict:
    """Killed just before or after the nth rename / replace of a path matching `path`."""
    return {"op": "rename", "path": path, "nth": nth, "when": when}


def rmtree(path: str, files: int) -> dict:
    """Killed in the first recursive delete of a path matching `path`, once `files` files
    are gone."""
    return {"op": "rmtree", "path": path, "nth": 1, "files": files}


def stalled(point: dict) -> dict:
    """`point`, where the writing thread waits instead of dying (a save held in flight)."""
    return {**point, "then": "stall"}


def killed_and_resumed(tmp_path, reference: Reference | None, kills: list) -> list[int | None]:
    """Runs the run, kills it at `kills[0]` (a point, or a list of points of which one
    kills), resumes it and kills it at `kills[1]` ..., then resumes it to the end, checking
    everything the module docstring says (`reference` None: all but the comparison with
    the uninterrupted run; a copy of the run as each kill left it is in `killed<i>`).
    Returns the iterations resumed from (None: a fresh start, there was nothing to
    resume)."""
    run_dir = tmp_path / "run"
    fired = tmp_path / "fired.txt"
    resumed_at = []
    stages = [*kills, None]
    for i, kill in enumerate(stages):
        log = tmp_path / f"stage{i}.log"
        snapshot = tmp_path / f"snapshot{i}.json"
        points = [] if kill is None else kill if isinstance(kill, list) else [kill]
        spec = {"points": points, "fired": str(fired), "snapshot": str(snapshot)}
        steps = complete_steps(run_dir) if i else []
        if i:
            shutil.copytree(run_dir, tmp_path / f"killed{i - 1}")
            read_killed_run(run_dir, tmp_path / f"read{i}")
        if i and not steps:  # killed before the first checkpoint: nothing to resume
            rc = run_driver(run_dir, log, {"fired": str(fired)}, "--resume")
            assert rc == 2 and "no checkpoint to resume from" in log.read_text(), log.read_text()[-3000:]
            resumed_at.append(None)
            rc = run_driver(run_dir, log, spec)
        else:
            rc = run_driver(run_dir, log, spec, *(["--resume"] if i else []))
        text = log.read_text()
        if kill is None:
            assert rc == 0, text[-3000:]
        else:
            assert rc == -signal.SIGKILL, f"stage {i} ({kill}) was not killed (rc {rc}):\n{text[-3000:]}"
            assert fired.exists() and len(fired.read_text().splitlines()) == i + 1, (kill, text[-3000:])
        if i and steps:
            got = re.search(r"resumed from \S+/(\d+) at iteration (\d+)", text)
            if got is None:  # killed in the restore, before it said where it resumed from
                assert kill is not None and not snapshot.exists(), text[-3000:]
                resumed_at.append(KILLED_IN_RESTORE)
                continue
            k = int(got.group(2))
            assert int(got.group(1)) == k == max(steps), (kill, steps, text[-3000:])
            resumed_at.append(k)
            at_resume = json.loads(snapshot.read_text())
            assert at_resume["iteration"] == k
            assert all(s <= k for s in at_resume["store"]), f"store iterations past {k}: {at_resume['store']}"
            lines = whole_lines(at_resume["metrics"], "metrics.jsonl at the resume")
            assert [m["iteration"] for m in lines] == list(range(1, k + 1))
    where = f"kills: {fired.read_text() if fired.exists() else '-'}; resumed at {resumed_at}"

    metrics = whole_lines((run_dir / "metrics.jsonl").read_text(), where)
    assert [m["iteration"] for m in metrics] == list(range(1, ITERATIONS + 1)), where
    assert leftovers(run_dir) == [], where
    if reference is None:
        return resumed_at
    straight = reference.done()
    expected = whole_lines((straight / "metrics.jsonl").read_text(), "the uninterrupted run")
    for i, (a, b) in enumerate(zip(learning_metrics(metrics), learning_metrics(expected), strict=True), 1):
        assert a == b, f"iteration {i} differs ({where}):\n{a}\n{b}"
    assert sorted(store(straight)) == [2, 4], (
        "the store's bound no longer thins it at iteration 4 "
        f"(store {sorted(store(straight))}): adjust logging.episodes_max_mb in OVERRIDES"
    )
    assert store(run_dir) == store(straight), where
    assert (run_dir / "episodes" / "stride").read_text() == (straight / "episodes" / "stride").read_text(), where
    assert transcripts(run_dir) == transcripts(straight), where
    assert untimed(json.loads((run_dir / "summary.json").read_text())) == untimed(
        json.loads((straight / "summary.json").read_text())
    ), where
    assert tensorboard_scalars(run_dir) == tensorboard_scalars(straight), where
    assert complete_steps(run_dir) == complete_steps(straight), where
    assert sorted(os.listdir(run_dir / "checkpoints")) == sorted(os.listdir(straight / "checkpoints")), where
    return resumed_at


# ----------------------------------------------------------------------------- the mid-line kill (slow)
@pytest.mark.slow  # ~40 s (a real run killed, then resumed); the default suite keeps the full-disk resume
# (test_train_diskfull) and SIGTERM's checkpoint (test_train_signals)
def test_killed_mid_line_while_a_save_is_in_flight(tmp_path):
    """One kill, two writes cut off: checkpoint 3's save is held in flight with its extras
    file half written (its thread stalls there), and the run is killed in the middle of
    iteration 4's metrics line (the store was thinned to {2, 4} just before). The resume
    continues from checkpoint 2 and replays 3 and 4.

    Checked against the killed run itself rather than an uninterrupted one (that is the
    sweep's, and costs a third `jaxagent train` here): the replayed iterations give what
    the killed run wrote of them, iteration 3's metrics line, the store's iteration 4
    (its tokens, rewards and per-token signals), iteration 3's transcript and TensorBoard
    points, and iteration 4's metrics line up to where the kill cut it (before its
    timings)."""
    resumed = killed_and_resumed(
        tmp_path,
        None,
        [[stalled(write(rf"^checkpoints/3{CKPT_TMP}/extras{CKPT_TMP}/metadata$")), write(r"^metrics\.jsonl$", nth=4)]],
    )
    assert resumed == [2]
    run, killed = tmp_path / "run", tmp_path / "killed0"
    assert complete_steps(killed) == [0, 1, 2] and (killed / "checkpoints" / "3.orbax-checkpoint-tmp").is_dir()
    *before, torn = (killed / "metrics.jsonl").read_text().split("\n")
    after = (run / "metrics.jsonl").read_text().splitlines()
    assert learning_metrics(map(json.loads, after[:3])) == learning_metrics(map(json.loads, before))
    cut = min([torn.find(k) for k in ('"tokens_per_s"', '"time_') if k in torn] or [len(torn)])
    assert 100 < cut and after[3][:cut] == torn[:cut], (torn, after[3])
    assert sorted(store(killed)) == [2, 4] and store(run) == store(killed)
    assert transcripts(run) == transcripts(killed) | {"iter_000004.txt": transcripts(run)["iter_000004.txt"]}
    scalars, killed_scalars = tensorboard_scalars(run), tensorboard_scalars(killed)
    assert scalars.keys() == killed_scalars.keys() and "train/reward_mean" in scalars
    for tag, points in scalars.items():
        assert [step for step, _ in points] == [1, 2, 3, 4] and points[:3] == killed_scalars[tag], tag
    assert complete_steps(run) == [0, 3, 4]
    summary, killed_summary = (json.loads((d / "summary.json").read_text()) for d in (run, killed))
    assert "success_after_rl" in summary and untimed(summary) | untimed(killed_summary) == untimed(summary)


def test_a_fresh_start_over_a_killed_run_starts_its_records_over(tmp_path):
    """A run killed before its first checkpoint (nothing to resume), its episode store
    already thinned (stride 2 on disk), its config and summary written: the fresh start in
    the same directory (`RunDir.start`) removes its store, summary.json and config history,
    so that config.0.yaml is the fresh run's, the plot shows no evaluation the fresh run
    did not make, and the store the trainer built before the start (as `Trainer.__init__`
    does) stores every iteration again rather than going on with the old stride."""
    import types

    from jaxagent.dataclass_yaml import dump_yaml, load_config
    from jaxagent.train.config import TrainerConfig
    from jaxagent.train.rundir import RunDir
    from jaxagent.train.rundir.checkpoint import CheckpointManager
    from jaxagent.train.rundir.episodes import EpisodeStore

    class Tok:
        def decode(self, ids):
            return "".join(chr(65 + i % 26) for i in ids)

    ep = types.SimpleNamespace(
        index=0,
        seed=1,
        group_id=0,
        rewards=[1.0],
        success=True,
        done=True,
        truncated=False,
        failed=False,
        end_reason="terminated",
        failure="",
        failure_kind="",
        invalid_actions=0,
        noop_actions=0,
        info={},
        system_prompt=None,
        segments=[("prompt", [1]), ("policy", [2])],
    )
    killed = EpisodeStore(tmp_path, per_iteration=1)
    assert killed.write(1, [ep], Tok())
    killed.max_bytes = killed.used_bytes() + 10
    assert killed.write(2, [ep], Tok()) and killed.stride == 2  # thinned: 1 deleted, then killed
    rundir = RunDir(tmp_path)
    rundir.write_config(load_config(TrainerConfig, CONFIG, [f"run_dir={tmp_path}", "iterations=3"]))
    rundir.write_summary({"success_before_rl": 0.5})
    store = EpisodeStore(tmp_path, per_iteration=1)
    assert store.stride == 2
    fresh = load_config(TrainerConfig, CONFIG, [f"run_dir={tmp_path}", "iterations=5"])
    with CheckpointManager(tmp_path / "checkpoints") as ckpt:
        rundir.start(ckpt, fresh)
    rundir.write_config(fresh)
    assert not (tmp_path / "episodes").exists() and not (tmp_path / "summary.json").exists()
    assert sorted(p.name for p in tmp_path.glob("config*.yaml")) == ["config.0.yaml", "config.yaml"]
    assert (tmp_path / "config.0.yaml").read_text() == dump_yaml(fresh) == (tmp_path / "config.yaml").read_text()
    assert store.stride == 1 and store.write(1, [ep], Tok()) and sorted(store._stored()) == [1]


# ----------------------------------------------------------------------------- the sweep
def either(*k) -> tuple:
    """Resumed from any of `k`: a kill in iteration i before its save, where save i - 1 may
    (rarely: it takes tens of ms, the iteration about a second) still be in flight."""
    return k


#: (name, kills, the iterations the resumes continue from: None = nothing to resume, a
#: fresh start; a tuple = any of these). A save starts once the one before is complete,
#: so a kill in step i's save resumes from i - 1 exactly.
SWEEP = [
    # metrics.jsonl: a line cut after its first byte, one byte short (its newline), whole
    ("metrics-first-byte", [write(r"^metrics\.jsonl$", nth=2, cut=0.0001)], [either(0, 1)]),
    ("metrics-one-short", [write(r"^metrics\.jsonl$", nth=2, cut=0.9999)], [either(0, 1)]),
    ("metrics-whole-line", [write(r"^metrics\.jsonl$", nth=2, cut=1)], [either(0, 1)]),
    ("metrics-iteration-1", [write(r"^metrics\.jsonl$", nth=1)], [0]),
    # the resume's rewrite of metrics.jsonl (to the checkpoint's history), cut off
    (
        "metrics-rewrite",
        [write(r"^metrics\.jsonl$", nth=3), write(r"^metrics\.jsonl\.tmp$")],
        [KILLED_IN_RESTORE, either(1, 2)],
    ),
    # the episode store: a file half written, written but not renamed, renamed
    ("store-mid-file", [write(r"^episodes/iter_000003\.jsonl\.tmp$")], [either(1, 2)]),
    ("store-before-rename", [rename(r"^episodes/iter_000003\.jsonl\.tmp$", "before")], [either(1, 2)]),
    ("store-after-rename", [rename(r"^episodes/iter_000003\.jsonl\.tmp$", "after")], [either(1, 2)]),
    # the store's thinning at iteration 4: cut off between writing the new stride and
    # deleting the iterations it no longer keeps; then the whole thinned store written
    ("store-thinning-cut-off", [rename(r"^episodes/stride\.tmp$", "after")], [either(2, 3)]),
    ("store-thinned", [rename(r"^episodes/iter_000004\.jsonl\.tmp$", "after")], [either(2, 3)]),
    # a checkpoint: its first file, the array metadata, the commit marker, before and after
    # the step directory's rename, step 0's save, and the deletion of an old step (keep-N)
    ("ckpt-first-file", [write(rf"^checkpoints/3{CKPT_TMP}/_CHECKPOINT_METADATA$")], [2]),
    ("ckpt-state-metadata", [write(rf"^checkpoints/3{CKPT_TMP}/state{CKPT_TMP}/_METADATA$")], [2]),
    ("ckpt-commit-marker", [write(rf"^checkpoints/3{CKPT_TMP}/commit_success\.txt$")], [2]),
    ("ckpt-before-rename", [rename(rf"^checkpoints/3{CKPT_TMP}$", "before")], [2]),
    ("ckpt-after-rename", [rename(rf"^checkpoints/3{CKPT_TMP}$", "after")], [3]),
    ("ckpt-step-0", [write(rf"^checkpoints/0{CKPT_TMP}/extras{CKPT_TMP}/metadata$")], [None]),
    ("ckpt-old-step-deleted", [rmtree(r"^checkpoints/1$", files=3)], [3]),
    # summary.json before RL (no checkpoint yet) and after RL (the last checkpoint is complete)
    ("summary-before-rl", [write(r"^summary\.json\.tmp$", nth=1)], [None]),
    ("summary-after-rl", [write(r"^summary\.json\.tmp$", nth=2)], [ITERATIONS]),
    ("summary-after-rl-not-renamed", [rename(r"^summary\.json\.tmp$", "before", nth=2)], [ITERATIONS]),
    # config.yaml and config.<n>.yaml: of a fresh start (nothing to resume), of a resume
    ("config-fresh", [write(r"^config\.yaml\.tmp$")], [None]),
    ("config-resume", [write(r"^metrics\.jsonl$", nth=3), write(r"^config\.yaml\.tmp$")], [either(1, 2), either(1, 2)]),
    (
        "config-n-resume",
        [write(r"^metrics\.jsonl$", nth=3), write(r"^config\.1\.yaml\.tmp$")],
        [either(1, 2), either(1, 2)],
    ),
    # TensorBoard: iteration 3's event record cut in its data (each event is 4 writes: its
    # length, the length's CRC, the data, its CRC; the file version's event first), and
    # just after its length
    ("tensorboard-mid-record", [write(r"^tensorboard/events\.out\.tfevents", nth=4 * 3 + 3)], [either(1, 2)]),
    ("tensorboard-after-length", [write(r"^tensorboard/events\.out\.tfevents", nth=4 * 3 + 1, cut=1)], [either(1, 2)]),
    # a transcript half written
    ("transcript-mid-file", [write(r"^transcripts/iter_000003\.txt\.tmp$")], [either(1, 2)]),
    # killed again and again: mid-line, mid-save on the resume, mid-store on the next
    (
        "three-kills",
        [
            write(r"^metrics\.jsonl$", nth=2),
            write(rf"^checkpoints/3{CKPT_TMP}/commit_success\.txt$"),
            write(r"^episodes/iter_000004\.jsonl\.tmp$"),
        ],
        [either(0, 1), 2, either(2, 3)],
    ),
]


def matches(resumed: list, expected: list) -> bool:
    return len(resumed) == len(expected) and all(
        r in e if isinstance(e, tuple) else r == e for r, e in zip(resumed, expected, strict=True)
    )


# slow: each case is two to four `jaxagent train` processes of ~10-15 s each on 2 cores
# (imports, tracing and the first iteration's compilation, then a few iterations), and
# there are 27 cases: ~7 min with -n 2 on 2 cores
@pytest.mark.slow
@pytest.mark.parametrize("kills, resumed", [pytest.param(k, r, id=name) for name, k, r in SWEEP])
def test_killed_at_every_kind_of_write(tmp_path, reference, kills, resumed):
    got = killed_and_resumed(tmp_path, reference, kills)
    assert matches(got, resumed), (got, resumed)
