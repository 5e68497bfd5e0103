"""Experiment trackers behind one interface: TensorBoard, Weights & Biases, MLflow.

    trackers = make_trackers(["wandb", "mlflow"], run_dir, config=flat_config, options=...)
    for t in trackers:
        t.scalars(iteration, [("train/success_rate", 0.4), ...])
    t.close()

Every tracker has `name`, `scalars(step, items)` and `close()`; `RunLogger` calls them,
and a tracker that raises is reported once and switched off for the run (logging
never stops training). The tags are `RunLogger`'s (`train/...`, `eval/...`, `time/...`).

- `tensorboard`: event files in `<run_dir>/tensorboard/`, in tensorboardX's record format,
  written and flushed synchronously with every iteration by its `EventsWriter` (the
  writer `SummaryWriter` uses underneath). tensorboardX's public `SummaryWriter` and
  `FileWriter` hand events to a background thread: their `flush` returns before the
  thread has written the event (so a file is an iteration behind and a killed run loses
  its last points), and if that thread dies on a write error its bounded queue fills and
  the next call blocks training. On a resume with event files already there, the new
  file starts with a `SessionLog.START` at the first iteration logged, so TensorBoard
  drops the old run's points from there on.
- `wandb`: one W&B run per training run. `mode` is `offline` by default (files in
  `<run_dir>/wandb/`, uploaded later with `wandb sync`; no network, no account) or
  `online`. The run's id is kept in `<run_dir>/wandb_run_id` and a resumed training run
  asks W&B to resume that id (`resume="allow"`); online, W&B continues the run (it drops
  points at steps it already has, so a replayed iteration keeps its first values);
  offline, each start writes its own directory under `<run_dir>/wandb/` with that id,
  to be synced in order. The run config is the flattened training config.
- `mlflow`: one MLflow run per training run, in `tracking_uri` (default: the local file
  store `<run_dir>/mlruns`, which MLflow 3 keeps in maintenance mode; `MLFLOW_ALLOW_FILE_STORE`
  is set for it) under experiment `experiment`. Its id is kept in `<run_dir>/mlflow_run_id`
  (resume continues it; a replayed iteration adds a second value at its step); params
  are the flattened training config (values cut at 500 characters).

A fresh run (not a resume) starts new tracker runs: `RunDir.start` removes the saved ids
of an abandoned earlier start in the same directory. `close(failed=True)` marks the
tracker run failed (MLflow `FAILED`, W&B exit code 1).

W&B and MLflow are optional (`pip install 'jaxagent[wandb]'` / `'jaxagent[mlflow]'`); a
tracker whose package is missing is a config error naming the extra.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient
    from wandb import Run

KNOWN = ("tensorboard", "wandb", "mlflow")
EXTRAS = {"wandb": ("wandb", "jaxagent[wandb]"), "mlflow": ("mlflow", "jaxagent[mlflow]")}


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir):
        self.dir = Path(run_dir) / "tensorboard"
        self._writer = None

    def _event(self, step: int, **fields):
        from tensorboardX.proto.event_pb2 import Event  # type: ignore[import-untyped]  # tensorboardX ships no py.typed marker

        self._writer.write_event(Event(wall_time=time.time(), step=int(step), **fields))

    def scalars(self, step: int, items: Iterable[tuple[str, float]]) -> None:
        from tensorboardX.event_file_writer import EventsWriter  # type: ignore[import-untyped]  # tensorboardX ships no py.typed marker
        from tensorboardX.proto.event_pb2 import SessionLog
        from tensorboardX.proto.summary_pb2 import Summary  # type: ignore[import-untyped]  # tensorboardX ships no py.typed marker

        if self._writer is None:
            existing = self.dir.is_dir() and any(self.dir.glob("*tfevents*"))
            self.dir.mkdir(parents=True, exist_ok=True)
            # a unique suffix: EventsWriter names files by the second and opens them "wb"
            self._writer = EventsWriter(str(self.dir / "events"), f".{os.getpid()}.{time.time_ns()}")
            if existing:
                self._event(step, session_log=SessionLog(status=SessionLog.START))
        self._event(step, summary=Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in items]))
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _saved_id(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def _save_id(path: Path, run_id: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id + "\n")
    tmp.replace(path)


class WandbTracker:
    name = "wandb"

    def __init__(
        self,
        run_dir,
        *,
        config: dict,
        project: str = "jaxagent",
        mode: Literal["offline", "online"] = "offline",
        run_name: str | None = None,
    ):
        import wandb

        run_dir = Path(run_dir)
        id_path = run_dir / "wandb_run_id"
        run_id = _saved_id(id_path) or uuid.uuid4().hex[:8]  # W&B's ids: 8 lowercase alphanumerics
        run_dir.mkdir(parents=True, exist_ok=True)
        self._run: Run | None = wandb.init(
            project=project,
            dir=str(run_dir),
            mode=mode,
            id=run_id,
            resume="allow",
            name=run_name or run_dir.name,
            config=config,
            settings=wandb.Settings(silent=True, console="off"),
        )
        _save_id(id_path, run_id)
        self.run_id = run_id

    def scalars(self, step: int, items: Iterable[tuple[str, float]]) -> None:
        if self._run is None:
            raise RuntimeError("the W&B tracker is closed")
        self._run.log(dict(items), step=int(step))

    def close(self, failed: bool = False) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None


def _mlflow_key(tag: str) -> str:
    """MLflow metric names: alphanumerics, `_ - . space : /` only."""
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in tag)


class MlflowTracker:
    name = "mlflow"

    def __init__(
        self,
        run_dir,
        *,
        config: dict,
        tracking_uri: str | None = None,
        experiment: str = "jaxagent",
        run_name: str | None = None,
    ):
        run_dir = Path(run_dir).resolve()
        if tracking_uri is None:
            tracking_uri = (run_dir / "mlruns").as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client: MlflowClient | None = MlflowClient(tracking_uri=tracking_uri)
        id_path = run_dir / "mlflow_run_id"
        run_id = _saved_id(id_path)
        if run_id is None:
            exp = self._client.get_experiment_by_name(experiment)
            exp_id = exp.experiment_id if exp is not None else self._client.create_experiment(experiment)
            run = self._client.create_run(exp_id, run_name=run_name or run_dir.name)
            run_id = run.info.run_id
            run_dir.mkdir(parents=True, exist_ok=True)
            _save_id(id_path, run_id)
            params = [(k[:250], str(v)[:500]) for k, v in config.items()]
            from mlflow.entities import Param

            for i in range(0, len(params), 100):
                self._client.log_batch(run_id, params=[Param(k, v) for k, v in params[i : i + 100]])
        else:
            self._client.update_run(run_id, status="RUNNING")
        self.run_id, self.tracking_uri = run_id, tracking_uri

    def scalars(self, step: int, items: Iterable[tuple[str, float]]) -> None:
        from mlflow.entities import Metric

        if self._client is None:
            raise RuntimeError("the MLflow tracker is closed")
        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(tag), float(v), now, int(step)) for tag, v in items]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def close(self, failed: bool = False) -> None:
        if self._client is not None:
            self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
            self._client = None


#: what `make_trackers` makes
Tracker = TensorBoardTracker | WandbTracker | MlflowTracker


def check_available(names: Iterable[str]) -> None:
    """ValueError naming the tracker and the extra to install when a package is missing."""
    import importlib.util

    for name in names:
        if name not in KNOWN:
            raise ValueError(f"unknown tracker {name!r}; known: {', '.join(KNOWN)}")
        if name in EXTRAS and importlib.util.find_spec(EXTRAS[name][0]) is None:
            module, extra = EXTRAS[name]
            raise ValueError(f"tracker {name!r} needs the {module} package: pip install '{extra}'")


def make_trackers(names: Iterable[str], run_dir, *, config: dict, options: dict | None = None, on_error=None) -> list:
    """The trackers `names` of a run (module docstring); `options[name]` are keyword
    arguments of that tracker (e.g. `{"wandb": {"project": "p", "mode": "online"}}`).
    A tracker that cannot start (no network, no API key, a server that does not answer)
    is left out and reported with `on_error(name, exception)` (None: raise)."""
    names = list(names)
    check_available(names)
    options = options or {}
    makers: dict[str, Callable[[dict], Tracker]] = {
        "tensorboard": lambda kw: TensorBoardTracker(run_dir),
        "wandb": lambda kw: WandbTracker(run_dir, config=config, **kw),
        "mlflow": lambda kw: MlflowTracker(run_dir, config=config, **kw),
    }
    out: list[Tracker] = []
    for name in names:
        try:
            out.append(makers[name](dict(options.get(name, {}))))
        except Exception as err:
            if on_error is None:
                for t in out:
                    t.close(failed=True)
                raise
            on_error(name, err)
    return out


#: files a tracker keeps in the run directory to continue its run on a resume
ID_FILES = ("wandb_run_id", "mlflow_run_id")
