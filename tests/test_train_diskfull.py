"""A full disk: a run whose metrics line, checkpoint or transcript write finds no room
(ENOSPC, EFBIG, EDQUOT) stops at the end of that iteration with one line naming the file
and the free space, exit status 4, its newest complete checkpoint intact; `--resume`
once there is room continues exactly (the same metrics as an uninterrupted run). The
trackers (TensorBoard's events included), which are optional, are switched off with a
warning instead. The writes are made to fail here by a patched writer that raises the
OSError a full disk gives, after writing part of its line."""

import errno
import json

import pytest
from test_train_kill_resume import CONFIG, complete_steps, learning_metrics

from jaxagent.cli import main
from jaxagent.train.rundir import DiskFullError, RunDir
from jaxagent.train.rundir.plot import read_metrics
from jaxagent.train.rundir.runlog import RunLogger

SMALL = [
    "iterations=4",
    "checkpoint_every=1",
    "keep_checkpoints=3",
    "env.group_size=2",
    "env.tasks_per_iteration=2",
    "update.mini_batches=2",
    "rollout.max_tokens_per_turn=8",
    "rollout.max_context=448",
]


def train(run_dir, *extra) -> int:
    return main(["train", "--config", str(CONFIG), *SMALL, f"run_dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The metrics of the same run, never interrupted."""
    run = tmp_path_factory.mktemp("ref") / "run"
    assert train(run) == 0
    return read_metrics(run / "metrics.jsonl")


def _metrics_without_room(append):
    def full_at_3(self, metrics):
        if metrics["iteration"] == 3:  # the disk fills in the middle of the line
            with self.metrics_path.open("a") as f:
                f.write(json.dumps(metrics)[:40])
            raise OSError(errno.ENOSPC, "No space left on device")
        append(self, metrics)

    return full_at_3


def _checkpoint_without_room(save):
    def full_at_3(self, ckpt, state, progress, config):
        if progress.iteration == 3:  # a writer that wraps the OSError, as a checkpoint library may
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError as err:
                raise RuntimeError("saving step 3 failed") from err
        save(self, ckpt, state, progress, config)

    return full_at_3


@pytest.mark.parametrize("where", ["metrics", "checkpoint"])
def test_a_full_disk_stops_the_run_and_resume_continues_exactly(where, reference, tmp_path, monkeypatch, capsys):
    name, patch, file = {
        "metrics": ("append_metrics", _metrics_without_room, "metrics.jsonl"),
        "checkpoint": ("save", _checkpoint_without_room, "checkpoints"),
    }[where]
    original = getattr(RunDir, name)
    monkeypatch.setattr(RunDir, name, patch(original))
    run = tmp_path / "run"
    assert train(run) == 4
    err = capsys.readouterr().err
    assert f"{run / file}: No space left on device" in err and "MiB free on its file system" in err
    assert f"jaxagent train --resume {run}" in err and "Traceback" not in err
    assert complete_steps(run) == [1, 2]  # iteration 3 was not checkpointed
    # a torn metrics line is left out by the readers; the resume rewrites the file
    assert [m["iteration"] for m in read_metrics(run / "metrics.jsonl")][:2] == [1, 2]

    monkeypatch.setattr(RunDir, name, original)  # room again
    assert main(["train", "--resume", str(run)]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert learning_metrics(read_metrics(run / "metrics.jsonl")) == learning_metrics(reference)


def test_a_transcript_without_room_stops_and_a_tracker_is_switched_off(tmp_path):
    class Tracker:
        name = "tensorboard"

        def scalars(self, step, items):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self, failed=False):
            pass

    log = RunLogger(
        tmp_path,
        total_iterations=2,
        tensorboard=False,
        progress=False,
        transcripts_every=1,
        transcripts_per_iteration=1,
        trackers=[Tracker()],
    )

    def no_room(*_):
        raise OSError(errno.EFBIG, "File too large")

    log._write_transcripts = no_room
    with pytest.warns(RuntimeWarning, match="tensorboard logging failed.*switched off"):
        log.log_iteration({"iteration": 1, "reward_mean": 0.0}, episodes=[object()])
    assert log.trackers == []
    assert isinstance(log.disk_full, DiskFullError)
    assert str(log.disk_full).startswith(f"{tmp_path / 'transcripts'}: File too large (")
    log.close()
