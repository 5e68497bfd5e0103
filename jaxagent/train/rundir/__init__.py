"""The run directory: what a run writes and what a resumed run reads back.

    <run_dir>/config.yaml        the config the run was last started or resumed with
    <run_dir>/config.<n>.yaml    the config of each start: 0 the fresh run, n the n-th resume
    <run_dir>/metrics.jsonl      one JSON line per RL iteration
    <run_dir>/summary.json       warm start and held-out evaluations before / after RL
    <run_dir>/warm_start.jsonl   the SFT warm start's progress
    <run_dir>/checkpoints/N/     orbax checkpoints: the `TrainState` and `Progress`
    <run_dir>/reference/         the KL reference after a warm start (orbax)
    <run_dir>/tokenizer/         the trained "bpe" tokenizer

Only the primary process writes files; every process takes part in orbax saves and
restores. Every file is written to a temporary name and renamed (atomic), checkpoints
by orbax's own atomic commit. A fresh run refuses a directory that holds checkpoints.
A resume whose newest checkpoint cannot be read names the file at fault, moves the step to
`<run_dir>/damaged-checkpoints/` (so the run can save that step again) and continues from
the newest readable one; a resume from a chosen older step moves the newer ones to
`<run_dir>/superseded-checkpoints/`. Nothing is deleted.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import re
import shutil
from pathlib import Path
from typing import Any

import jax

from jaxagent.dataclass_yaml import dump_yaml, to_dict
from jaxagent.train.config import RESUME_FIXED
from jaxagent.train.rundir.checkpoint import CheckpointManager, IncompatibleCheckpointError

#: the errors of a write that found no room: the disk or the quota is full, or a file-size limit
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


class DiskFullError(OSError):
    """A run's write found no room (`DISK_FULL_ERRNOS`): the run stops at the end of the
    iteration, its newest complete checkpoint intact, and continues with `--resume` once
    there is space (`jaxagent train` exits with status 4)."""

    def __str__(self) -> str:
        return str(self.strerror)


def disk_full(err: BaseException, path) -> DiskFullError | None:
    """`err` as a `DiskFullError` naming `path` and the free space on its file system, or
    None when `err` is not a full disk (nor wraps one, as a checkpoint writer's error may)."""
    cause: BaseException | None = err
    while cause is not None and not (isinstance(cause, OSError) and cause.errno in DISK_FULL_ERRNOS):
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, OSError):  # None: the loop stops only there or at an OSError
        return None
    path = Path(path)
    where = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    try:
        free = f"{shutil.disk_usage(where).free / 2**20:.1f} MiB free on its file system"
    except OSError:
        free = "free space unknown"
    return DiskFullError(
        cause.errno,
        f"{path}: {cause.strerror or cause} ({free}); free space, then continue with jaxagent train --resume",
    )


@dataclasses.dataclass
class Progress:
    """How far a run is, saved with every checkpoint."""

    iteration: int = 0  # RL iterations completed
    task_position: int = 0  # tasks of the stream consumed
    history: list = dataclasses.field(default_factory=list)  # one metrics dict per iteration
    summary: dict = dataclasses.field(default_factory=dict)  # warm start and evaluations


class DamagedCheckpointError(RuntimeError):
    """A checkpoint whose files cannot be read (garbled, truncated or missing)."""


def checkpoint_steps(run_dir) -> list[int]:
    """The committed checkpoint steps of a run directory, oldest first, read without
    creating or changing anything (a step directory with orbax's commit marker)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit() and (p / "commit_success.txt").exists()
    )


def require_checkpoints(run_dir) -> list[int]:
    """`FileNotFoundError` unless `run_dir` holds a committed checkpoint to resume from."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"--resume: the run directory {run_dir} does not exist")
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise FileNotFoundError(
            f"--resume: {run_dir} holds no checkpoint to resume from (no committed {run_dir / 'checkpoints'}/<step>/)"
        )
    return steps


def describe_damage(step_dir: Path, err: BaseException) -> str:
    """Which file of checkpoint `step_dir` is at fault and what is wrong, as far as it can
    be told: the JSON items are parsed here; otherwise the file the reader's error names."""
    step_dir = Path(step_dir)
    for item in ("_CHECKPOINT_METADATA", "extras/metadata", "meta/metadata", "state/_METADATA"):
        path = step_dir / item
        if not path.exists():
            return f"{path}: missing"
        try:
            json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError) as bad:
            return f"{path}: not valid JSON ({bad})"
    text = str(err)
    named = re.findall(r"(?:file://)?(/[^\s\"',:]+)", text)
    inside = [n for n in named if str(step_dir) in n]
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    where = inside[0] if inside else str(step_dir / "state")
    return f"{where}: cannot be read ({type(err).__name__}: {first[:300]})"


# ---------------------------------------------------------------------- reading its files
class RunFileError(ValueError):
    """A file of a run directory that cannot be read back (truncated, garbled, not what the
    run writes). The message is one line naming the file and, where it makes sense, the
    line and column; the commands that read runs exit with status 2 on it."""


def _position(data: bytes, offset: int) -> tuple[int, int]:
    """(line, column), from 1, of byte `offset` of `data` (the column counts bytes)."""
    start = data.rfind(b"\n", 0, offset) + 1
    return data.count(b"\n", 0, offset) + 1, offset - start + 1


def read_text(path) -> str:
    """A run directory's text file, as UTF-8 (what the run writes): `RunFileError` naming
    the line and column of the first byte that is not, `FileNotFoundError` if missing."""
    path = Path(path)
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line, column = _position(data, err.start)
        raise RunFileError(
            f"{path}, line {line}, column {column}: not UTF-8 text (byte 0x{data[err.start]:02x}): the file is garbled"
        ) from None


def read_json(path):
    """A run directory's JSON file (`read_text`); `RunFileError` naming the line and column
    where it stops being valid JSON."""
    path = Path(path)
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise RunFileError(f"{path}: not valid JSON at line {err.lineno}, column {err.colno} ({err.msg})") from None


def read_config(path) -> dict:
    """A run's `config.yaml` as a mapping, checked for damage (`RunFileError`): not UTF-8,
    not valid YAML (line and column), or cut off: it ends mid-line, without its newline,
    part of the way through the newest `config.<n>.yaml` (the copy the run wrote with it;
    the line where it stops)."""
    from jaxagent.dataclass_yaml import ConfigError, read_yaml

    path = Path(path)
    text = read_text(path)
    history = [p for p in path.parent.glob("config.[0-9]*.yaml") if p.name.split(".")[1].isdigit()]
    if path.name == "config.yaml" and history and not text.endswith("\n"):
        newest = max(history, key=lambda p: int(p.name.split(".")[1]))
        whole = newest.read_bytes().decode("utf-8", errors="replace")
        if whole.startswith(text) and whole[len(text) :].strip():
            line = text.count("\n") + 1
            raise RunFileError(
                f"{path}, line {line}: truncated (it ends mid-line, part of the way through "
                f"{newest.name}, the copy the run wrote with it)"
            )
    try:
        return read_yaml(path)
    except ConfigError as err:
        raise RunFileError(str(err)) from None


def check_tokenizer_files(directory) -> None:
    """Reads back a run's saved tokenizer (`<run_dir>/tokenizer/`) before it is loaded, so
    that damage is named rather than raised from inside `tokenizers` or at the first chat
    template use: `FileNotFoundError` without tokenizer.json, `RunFileError` for a JSON file
    that is not UTF-8 or not valid JSON (line and column), a tokenizer.json the `tokenizers`
    library cannot read, or a chat template that does not compile (its line)."""
    directory = Path(directory)
    main = directory / "tokenizer.json"
    if not main.is_file():
        raise FileNotFoundError(f"the run's trained tokenizer {main} is missing")
    for path in sorted(directory.glob("*.json")):
        read_json(path)
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(read_text(main))
    except Exception as err:  # noqa: BLE001 - the library's own error for a structure it cannot read
        what = " ".join(str(err).split())[:300]
        raise RunFileError(f"{main}: not a tokenizer the tokenizers library reads ({what})") from None
    template = directory / "chat_template.jinja"
    if template.is_file():
        text = read_text(template)
        import jinja2

        try:  # compiled as transformers compiles it at the template's first use
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:  # a transformers without it: the template is checked at its first use
            return
        try:
            _compile_jinja_template(text)
        except jinja2.TemplateSyntaxError as err:
            raise RunFileError(f"{template}, line {err.lineno}: not a valid chat template ({err.message})") from None


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
        metrics file, the trained tokenizer (when given). What an abandoned earlier start
        left (one killed before its first checkpoint) does not carry over: its episode
        store is removed, and so are its trackers' run ids (new tracker runs start), its
        summary.json (its evaluation before RL) and its config history (config.0.yaml is
        this start's)."""
        if ckpt.latest_step() is not None:
            raise FileExistsError(
                f"{ckpt.directory} already holds checkpoints (latest "
                f"{ckpt.latest_step()}); resume, or choose another run_dir"
            )
        if not self.primary:
            return
        from jaxagent.train.rundir.trackers import ID_FILES

        for name in ID_FILES:
            (self.path / name).unlink(missing_ok=True)
        for path in (self.summary_path, self.path / "config.yaml", *self.path.glob("config.[0-9]*.yaml")):
            path.unlink(missing_ok=True)
        if (self.path / "episodes").is_dir():
            shutil.rmtree(self.path / "episodes")
        self.metrics_path.write_text("")
        if tokenizer is not None:
            from jaxagent.models.tokenizer_training import save_tokenizer

            save_tokenizer(tokenizer, self.tokenizer_dir)

    def write_config(self, config) -> None:
        """`config.yaml` (the latest start's) and `config.<n>.yaml` for this start (n = 0 for
        the fresh run, 1 for the first resume, ...): a resume never loses the history."""
        if not self.primary:
            return
        text = dump_yaml(config)
        n = len(list(self.path.glob("config.[0-9]*.yaml")))
        latest = self.path / "config.yaml"
        if n == 0 and latest.exists():  # a run from before the history was kept
            self._write(self.path / "config.0.yaml", latest.read_text())
            n = 1
        self._write(self.path / f"config.{n}.yaml", text)
        self._write(latest, text)

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
        ckpt.save(
            progress.iteration,
            state,
            extras={
                "iteration": progress.iteration,
                "task_position": progress.task_position,
                "history": progress.history,
                "config": to_dict(config),
                "summary": progress.summary,
            },
        )

    def restore(self, ckpt: CheckpointManager, state, config, step: int | None = None, log=print):
        """`(state, progress, step)` of the newest readable checkpoint (or of `step`), checked
        against `config` (`check_resumable`). `FileNotFoundError` when there is none; a
        damaged newest checkpoint is reported through `log` and moved aside, and the next
        older one is tried; `DamagedCheckpointError` when `step` (or every step) is damaged."""
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
        if step is not None and step not in steps:
            raise FileNotFoundError(f"no checkpoint at step {step} in {ckpt.directory}; steps: {steps}")
        template, damaged = state, []
        for candidate in [step] if step is not None else steps[::-1]:
            where = ckpt.directory / str(candidate)
            try:
                state, extras = ckpt.restore(template, candidate)  # all processes, the state's shardings
                break
            except IncompatibleCheckpointError:
                raise
            except Exception as err:  # noqa: BLE001 - orbax/TensorStore/JSON errors of damaged files
                what = describe_damage(where, err)
                damaged.append(what)
                if step is not None:
                    raise DamagedCheckpointError(f"checkpoint {where} is damaged: {what}") from None
                log(f"checkpoint {where} is damaged, trying an older one: {what}")
        else:
            raise DamagedCheckpointError(f"every checkpoint in {ckpt.directory} is damaged:\n  " + "\n  ".join(damaged))
        newer = [s for s in steps if s > candidate]
        if newer and self.primary:  # out of the way (not deleted), so that the run can save these steps again
            aside = self.path / ("damaged-checkpoints" if damaged else "superseded-checkpoints")
            aside.mkdir(exist_ok=True)
            for s in newer:
                target = aside / str(s)
                if target.exists():
                    shutil.rmtree(target)
                shutil.move(str(ckpt.directory / str(s)), str(target))
            log(f"checkpoints {newer} moved to {aside}")
            ckpt.reload()
        check_resumable(extras.get("config"), to_dict(config), where)
        progress = Progress(
            iteration=int(extras["iteration"]),
            task_position=int(extras["task_position"]),
            history=list(extras.get("history", [])),
            summary=dict(extras.get("summary", {})),
        )
        if self.summary_path.exists():  # the evaluation after RL is written after the last checkpoint
            on_disk = read_json(self.summary_path)
            if not isinstance(on_disk, dict):
                raise RunFileError(f"{self.summary_path}: expected a JSON object, got {type(on_disk).__name__}")
            if on_disk.get("iterations_at_eval") == progress.iteration and "success_after_rl" in on_disk:
                progress.summary = on_disk
        return state, progress, candidate

    # ------------------------------------------------------------------ the KL reference
    def save_reference(self, params) -> None:
        """The KL reference after a warm start, for resumed runs (orbax, atomic)."""
        import orbax.checkpoint as ocp  # type: ignore[import-untyped]  # orbax ships no py.typed marker

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
    from jaxagent.train.config import TrainerConfig

    defaults = to_dict(TrainerConfig())
    diffs = []
    for key in RESUME_FIXED:
        a: Any = saved  # a nested dict, a value at the key's end, or None where it is absent
        b: Any = current
        d: Any = defaults
        for part in key.split("."):
            a, b, d = (a or {}).get(part), (b or {}).get(part), (d or {}).get(part)
        if isinstance(a, dict) and isinstance(b, dict):
            # a key the checkpoint's version did not have was that version's behaviour: the
            # default, so only a non-default value in this run is a change
            diffs += [
                f"{key}.{k}: checkpoint {a.get(k)!r}, this run {b.get(k)!r}"
                for k in sorted(set(a) | set(b))
                if a.get(k) != b.get(k) and not (k not in a and isinstance(d, dict) and b.get(k) == d.get(k))
            ]
        elif a != b:
            diffs.append(f"{key}: checkpoint {a!r}, this run {b!r}")
    if diffs:
        raise IncompatibleCheckpointError(
            f"cannot resume from {where}: the config changed keys a run must keep:\n  " + "\n  ".join(diffs)
        )
