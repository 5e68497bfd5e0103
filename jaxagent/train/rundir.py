"""The run directory: what a run writes and what a resumed run reads back.

    <run_dir>/config.yaml        the config the run was started (or resumed) with
    <run_dir>/metrics.jsonl      one JSON line per RL iteration
    <run_dir>/summary.json       warm start and held-out evaluations before / after RL
    <run_dir>/warm_start.jsonl   the SFT warm start's progress
    <run_dir>/checkpoints/N/     orbax checkpoints: the `TrainState` and `Progress`
    <run_dir>/reference/         the KL reference after a warm start (orbax)
    <run_dir>/tokenizer/         the trained "bpe" tokenizer

Only the primary process writes files; every process takes part in orbax saves and
restores. Every file is written to a temporary name and renamed (atomic), checkpoints
by orbax's own atomic commit. A fresh run refuses a directory that holds checkpoints.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax

from jaxagent.config import dump_yaml, to_dict
from jaxagent.train.checkpoint import CheckpointManager, IncompatibleCheckpointError
from jaxagent.train.config import RESUME_FIXED


@dataclasses.dataclass
class Progress:
    """How far a run is, saved with every checkpoint."""

    iteration: int = 0                 # RL iterations completed
    task_position: int = 0             # tasks of the stream consumed
    history: list = dataclasses.field(default_factory=list)   # one metrics dict per iteration
    summary: dict = dataclasses.field(default_factory=dict)   # warm start and evaluations


class RunDir:
    """Reads and writes one run directory (module docstring). `primary`: this process
    writes the files."""

    def __init__(self, path, *, primary: bool = True):
        self.path = Path(path)
        self.primary = primary
        self.metrics_path = self.path / "metrics.jsonl"
        self.summary_path = self.path / "summary.json"
        self.reference_dir = (self.path / "reference").absolute()
        self.tokenizer_dir = self.path / "tokenizer"

    def checkpoints(self, keep: int) -> CheckpointManager:
        self.path.mkdir(parents=True, exist_ok=True)
        return CheckpointManager(self.path / "checkpoints", max_to_keep=keep)

    # ------------------------------------------------------------------ a fresh run
    def start(self, ckpt: CheckpointManager, config, tokenizer=None) -> None:
        """A fresh run: `FileExistsError` when the directory holds checkpoints; an empty
        metrics file, the trained tokenizer (when given)."""
        if ckpt.latest_step() is not None:
            raise FileExistsError(f"{ckpt.directory} already holds checkpoints (latest "
                                  f"{ckpt.latest_step()}); resume, or choose another run_dir")
        if not self.primary:
            return
        self.metrics_path.write_text("")
        if tokenizer is not None:
            from jaxagent.train.warmstart import save_tokenizer

            save_tokenizer(tokenizer, self.tokenizer_dir)

    def write_config(self, config) -> None:
        self._write(self.path / "config.yaml", dump_yaml(config))

    def append_metrics(self, metrics: dict) -> None:
        if self.primary:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(metrics) + "\n")

    def write_metrics(self, history: list[dict]) -> None:
        self._write(self.metrics_path, "".join(json.dumps(m) + "\n" for m in history))

    def write_summary(self, summary: dict) -> None:
        self._write(self.summary_path, json.dumps(summary, indent=1) + "\n")

    def write_warm_start(self, lines: list[dict]) -> None:
        self._write(self.path / "warm_start.jsonl", "".join(json.dumps(x) + "\n" for x in lines))

    def _write(self, path: Path, text: str) -> None:
        if not self.primary:
            return
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    # ------------------------------------------------------------------ checkpoints
    def save(self, ckpt: CheckpointManager, state, progress: Progress, config) -> None:
        ckpt.save(progress.iteration, state, extras={
            "iteration": progress.iteration, "task_position": progress.task_position,
            "history": progress.history, "config": to_dict(config), "summary": progress.summary})

    def restore(self, ckpt: CheckpointManager, state, config, step: int | None = None):
        """`(state, progress)` of the latest checkpoint (or `step`), checked against
        `config` (`check_resumable`). `FileNotFoundError` when there is none."""
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
        if step is not None and step not in ckpt.all_steps():
            raise ValueError(f"no checkpoint at step {step} in {ckpt.directory}; steps: {ckpt.all_steps()}")
        where = ckpt.directory / str(step if step is not None else ckpt.latest_step())
        state, extras = ckpt.restore(state, step)  # all processes, with the state's shardings
        check_resumable(extras.get("config"), to_dict(config), where)
        progress = Progress(iteration=int(extras["iteration"]), task_position=int(extras["task_position"]),
                            history=list(extras.get("history", [])), summary=dict(extras.get("summary", {})))
        if self.summary_path.exists():  # the evaluation after RL is written after the last checkpoint
            on_disk = json.loads(self.summary_path.read_text())
            if on_disk.get("iterations_at_eval") == progress.iteration and "success_after_rl" in on_disk:
                progress.summary = on_disk
        return state, progress

    # ------------------------------------------------------------------ the KL reference
    def save_reference(self, params) -> None:
        """The KL reference after a warm start, for resumed runs (orbax, atomic)."""
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(self.reference_dir, params, force=True)
            ckptr.wait_until_finished()

    def restore_reference(self, like):
        """The saved KL reference, laid out like `like`."""
        import orbax.checkpoint as ocp

        if not self.reference_dir.is_dir():
            raise FileNotFoundError(f"--resume: the warm-started KL reference {self.reference_dir} is missing")
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(self.reference_dir, jax.tree.map(ocp.utils.to_shape_dtype_struct, like))


def check_resumable(saved: dict | None, current: dict, where) -> None:
    """`IncompatibleCheckpointError` naming every `RESUME_FIXED` key in which the config
    `current` differs from the checkpoint's `saved` (both as `to_dict` gives them)."""
    if saved is None:
        return
    diffs = []
    for key in RESUME_FIXED:
        a, b = saved, current
        for part in key.split("."):
            a, b = (a or {}).get(part), (b or {}).get(part)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += [f"{key}.{k}: checkpoint {a.get(k)!r}, this run {b.get(k)!r}"
                      for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            diffs.append(f"{key}: checkpoint {a!r}, this run {b!r}")
    if diffs:
        raise IncompatibleCheckpointError(
            f"cannot resume from {where}: the config changed keys a run must keep:\n  " + "\n  ".join(diffs))
