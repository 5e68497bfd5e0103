"""Experiment trackers (`jaxagent.train.rundir.trackers`): MLflow's local file store and W&B's
offline mode, each read back after a real training run and after a resume; a failing
tracker is switched off, and a missing one is a config error naming its extra."""

import sys
import time
import types
import warnings

import pytest
from test_train_loop import VARIED, config

from jaxagent.dataclass_yaml import ConfigError, flatten
from jaxagent.train.rundir.runlog import RunLogger
from jaxagent.train.rundir.trackers import MlflowTracker, WandbTracker, check_available


def test_flatten_gives_dotted_keys():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}, "f": None}) == {
        "a.b": 1,
        "a.c.d": [1, 2],
        "e": {},
        "f": None,
    }


def test_mlflow_records_a_run_and_its_resume(tmp_path):
    from jaxagent.train.trainer import Trainer

    run = tmp_path / "run"
    # what a start killed before its first checkpoint left: a fresh start does not carry it over
    run.mkdir()
    (run / "mlflow_run_id").write_text("0123456789abcdef\n")
    (run / "episodes").mkdir()
    (run / "episodes" / "iter_000007.jsonl").write_text("{}\n")
    Trainer(config(run, *VARIED, "iterations=1", "logging.trackers=[mlflow]"), log=lambda *_: None).run()
    assert (run / "mlflow_run_id").read_text().strip() != "0123456789abcdef"
    assert sorted(p.name for p in (run / "episodes").glob("iter_*")) == ["iter_000001.jsonl"]
    Trainer(config(run, *VARIED, "iterations=2", "logging.trackers=[mlflow]"), resume=True, log=lambda *_: None).run()
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    run_id = (run / "mlflow_run_id").read_text().strip()
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert got.data.params["optim.lr"] == "0.001" and got.data.params["env.name"] == "testing/faulty"
    history = client.get_metric_history(run_id, "train/success_rate")
    import json

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted((m.step, m.value) for m in history) == [
        (m["iteration"], pytest.approx(m["success_rate"])) for m in metrics
    ]
    assert len(client.search_runs([got.info.experiment_id])) == 1  # the resume continued the same run


class _FakeRun:
    def __init__(self, calls):
        self.calls = calls

    def log(self, data, step):
        self.calls.append(("log", step, dict(data)))

    def finish(self, exit_code=0):
        self.calls.append(("finish", exit_code))


def test_wandb_tracker_calls_and_a_real_offline_run(tmp_path, monkeypatch):
    # what the tracker asks of wandb (a stand-in module records it) ...
    calls = []
    fake = types.SimpleNamespace(
        init=lambda **kw: (calls.append(("init", kw)), _FakeRun(calls))[1], Settings=lambda **kw: kw
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    t = WandbTracker(tmp_path / "a", config={"optim.lr": 1e-3})
    t.scalars(3, [("train/x", 1.5)])
    t.close()
    init = calls[0][1]
    run_id = (tmp_path / "a" / "wandb_run_id").read_text().strip()
    assert init["mode"] == "offline" and init["id"] == run_id and len(run_id) == 8 and init["resume"] == "allow"
    assert init["config"] == {"optim.lr": 1e-3} and init["dir"] == str(tmp_path / "a")
    assert calls[1:] == [("log", 3, {"train/x": 1.5}), ("finish", 0)]
    # a second tracker of the same run dir (a resume) continues the same W&B run
    WandbTracker(tmp_path / "a", config={}).close()
    assert calls[3][1]["id"] == run_id


def test_wandb_offline_run_as_run_logger_drives_it(tmp_path, monkeypatch):
    """The real package in offline mode: a run's files, no network."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    tracker = WandbTracker(run, config={"optim.lr": 1e-3, "env.name": "sokoban"})
    with RunLogger(run, total_iterations=2, tensorboard=False, progress=False, trackers=[tracker]) as log:
        for i in (1, 2):
            log.log_iteration({"iteration": i, "success_rate": 0.25 * i})
        assert log.trackers == [tracker]  # nothing failed
    run_id = (run / "wandb_run_id").read_text().strip()
    (offline,) = list((run / "wandb").glob(f"offline-run-*-{run_id}"))
    data = offline / f"run-{run_id}.wandb"
    # W&B's service process writes the file just after `finish` returns
    for _ in range(300):
        if b"train/success_rate" in data.read_bytes():
            break
        time.sleep(0.1)
    assert b"train/success_rate" in data.read_bytes() and b"sokoban" in data.read_bytes()


def test_a_failing_tracker_is_switched_off_with_one_warning(tmp_path):
    class Broken:
        name = "broken"
        closed = False

        def scalars(self, step, items):
            raise OSError("disk full")

        def close(self, failed=False):
            Broken.closed = failed

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RunLogger(tmp_path, total_iterations=3, tensorboard=False, progress=False, trackers=[Broken()]) as log:
            for i in (1, 2, 3):
                log.log_iteration({"iteration": i, "reward_mean": 1.0})
            assert log.trackers == []
    msgs = [str(w.message) for w in caught if "broken" in str(w.message)]
    assert len(msgs) == 1 and "disk full" in msgs[0] and "switched off" in msgs[0] and Broken.closed


def test_tracker_config_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown tracker 'neptune'"):
        config(tmp_path, "logging.trackers=[neptune]")
    with pytest.raises(ValueError, match="names a tracker twice"):
        config(tmp_path, "logging.trackers=[mlflow, mlflow]")
    with pytest.raises(ValueError, match="wandb_mode"):
        config(tmp_path, "logging.wandb_mode=cloud")
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'jaxagent\[wandb\]'"):
        check_available(["wandb"])
    from jaxagent.train.trainer import Trainer

    with pytest.raises(ConfigError, match=r"logging.trackers: .*jaxagent\[wandb\]"):
        Trainer(config(tmp_path / "run", *VARIED, "logging.trackers=[wandb]"), log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_cannot_start_is_left_out_with_a_warning(tmp_path, monkeypatch):
    """No network, no key, a server that does not answer: a warning, and the run's
    logger gets the trackers that did start (training is never stopped by one)."""
    import mlflow.tracking

    from jaxagent.train import build

    def refuse(*args, **kwargs):
        raise ConnectionError("the tracking server does not answer")

    monkeypatch.setattr(mlflow.tracking.MlflowClient, "create_experiment", refuse)
    monkeypatch.setattr(mlflow.tracking.MlflowClient, "get_experiment_by_name", refuse)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(tmp_path / "run", *VARIED, "logging.trackers=[wandb, mlflow]")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = build.trackers(cfg, tmp_path / "run")
    assert [t.name for t in got] == ["wandb"]
    for t in got:
        t.close()
    msgs = [str(w.message) for w in caught if "mlflow could not start" in str(w.message)]
    assert len(msgs) == 1 and "does not answer" in msgs[0] and "training continues" in msgs[0]


def test_a_crash_marks_the_tracker_run_failed(tmp_path):
    from mlflow.tracking import MlflowClient

    tracker = MlflowTracker(tmp_path, config={"a": 1})
    with pytest.raises(RuntimeError):
        with RunLogger(tmp_path, total_iterations=2, tensorboard=False, progress=False, trackers=[tracker]) as log:
            log.log_iteration({"iteration": 1, "success_rate": 0.5})
            raise RuntimeError("the update blew up")
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    assert client.get_run(tracker.run_id).info.status == "FAILED"
