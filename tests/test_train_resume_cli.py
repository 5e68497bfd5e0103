"""Resuming as users do it: `--resume RUN_DIR` without --config, `--step N`, a missing or
empty run dir (named, nothing created), a damaged newest checkpoint (named, the run falls
back to the one before), and the config history of a resumed run."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxagent.dataclass_yaml import load_config
from jaxagent.train.config import TrainerConfig
from jaxagent.train.rundir import DamagedCheckpointError, checkpoint_steps, describe_damage
from jaxagent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_countdown_grpo.yaml"
VARIED = ["env.name=testing/faulty", "env.kwargs={horizon: 2}", "rollout.max_context=256", "env.num_workers=0"]


def config(run_dir, *overrides) -> TrainerConfig:
    return load_config(TrainerConfig, CONFIG, [f"run_dir={run_dir}", *VARIED, *overrides])


def cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "jaxagent", "train", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 3-iteration run with a checkpoint after every iteration."""
    run = tmp_path_factory.mktemp("resume") / "run"
    Trainer(config(run, "iterations=3", "checkpoint_every=1", "keep_checkpoints=3"), log=lambda *_: None).run()
    return run


def test_resume_a_missing_or_empty_run_dir_names_it_and_creates_nothing(tmp_path):
    missing = tmp_path / "nope"
    out = cli("--resume", missing)
    assert out.returncode == 2
    assert f"the run directory {missing} does not exist" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    assert not missing.exists()
    # with a config whose run_dir holds no checkpoints: named as such, nothing written
    empty = tmp_path / "empty"
    empty.mkdir()
    out = cli("--config", CONFIG, f"run_dir={empty}", "--resume")
    assert out.returncode == 2 and "holds no checkpoint to resume from" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and list(empty.iterdir()) == []
    # a directory that is not a run
    out = cli("--resume", empty)
    assert out.returncode == 2 and "config.yaml is missing" in out.stderr, out.stderr
    # --step without --resume
    out = cli("--config", CONFIG, "--step", "2")
    assert out.returncode == 2 and "--step" in out.stderr and "needs --resume" in out.stderr


@pytest.mark.slow  # ~15-30 s on 2 cores: `make test-slow`
def test_resume_run_dir_alone_uses_its_config_and_follows_a_copy(finished, tmp_path):
    copy = tmp_path / "copied"
    shutil.copytree(finished, copy)  # its config.yaml still names the original run_dir
    out = cli("--resume", copy, "iterations=4")
    assert out.returncode == 0, out.stderr
    assert f"resumed from {copy.absolute() / 'checkpoints' / '3'} at iteration 3" in out.stdout
    lines = read_jsonl(copy / "metrics.jsonl")
    assert [m["iteration"] for m in lines] == [1, 2, 3, 4]
    assert read_jsonl(finished / "metrics.jsonl") == lines[:3]  # the original is untouched
    # the history of configs: the fresh start's and the resume's; config.yaml is the latest
    first = load_config(TrainerConfig, copy / "config.0.yaml")
    latest = load_config(TrainerConfig, copy / "config.yaml")
    assert first.iterations == 3 and first.run_dir == str(finished)
    assert latest == load_config(TrainerConfig, copy / "config.1.yaml")
    assert latest.iterations == 4 and latest.run_dir == str(copy)
    # an override that changes what a run must keep is still refused
    out = cli("--resume", copy, "iterations=5", "env.seed=9")
    assert out.returncode == 2 and "env.seed: checkpoint 0, this run 9" in out.stderr, out.stderr
    # and --resume RUN_DIR with a conflicting run_dir override
    out = cli("--resume", copy, f"run_dir={tmp_path / 'other'}")
    assert out.returncode == 2 and "name different runs" in out.stderr


def test_resume_from_a_chosen_step(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    lines = []
    Trainer(
        config(run, "iterations=3", "checkpoint_every=1", "keep_checkpoints=3"), resume=True, step=2, log=lines.append
    ).run()
    assert any(f"resumed from {run.absolute() / 'checkpoints' / '2'} at iteration 2" in x for x in lines), lines
    again, original = read_jsonl(run / "metrics.jsonl"), read_jsonl(finished / "metrics.jsonl")
    assert [m["iteration"] for m in again] == [1, 2, 3]

    def strip(ms):
        return [{k: v for k, v in m.items() if not k.startswith("time_") and k != "tokens_per_s"} for m in ms]

    assert strip(again) == strip(original)  # iteration 3 replayed exactly
    assert (run / "superseded-checkpoints" / "3").is_dir() and checkpoint_steps(run) == [1, 2, 3]
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at step 7 .*steps: \[1, 2, 3\]"):
        Trainer(config(run, "iterations=3"), resume=True, step=7, log=lambda *_: None).run()
    with pytest.raises(ValueError, match="needs resume=True"):
        Trainer(config(run), step=2)


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(0, len(data), 7):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("what", ["metadata", pytest.param("data", marks=pytest.mark.slow)])
def test_a_damaged_newest_checkpoint_is_named_and_the_run_falls_back(finished, tmp_path, what):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    step3 = run / "checkpoints" / "3"
    if what == "metadata":
        bad = step3 / "extras" / "metadata"
        bad.write_text('{"iteration": 3, "hist')
    else:  # every array file of the state
        files = [p for p in (step3 / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
        assert files
        for p in files:
            _garble(p)
        bad = step3 / "state"
    lines = []
    Trainer(
        config(run, "iterations=3", "checkpoint_every=1", "keep_checkpoints=3"), resume=True, log=lines.append
    ).run()
    text = "\n".join(lines)
    assert f"checkpoint {step3.absolute()} is damaged, trying an older one: " in text, text
    assert str(bad) in text or str(bad.absolute()) in text, text
    assert f"resumed from {(run / 'checkpoints' / '2').absolute()} at iteration 2" in text
    assert (run / "damaged-checkpoints" / "3").is_dir()  # kept, out of the way
    assert checkpoint_steps(run) == [1, 2, 3]  # iteration 3 played and saved again
    assert [m["iteration"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]


def test_a_chosen_damaged_step_is_an_error_naming_the_file(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "checkpoints" / "2" / "meta" / "metadata").write_text("not json")
    with pytest.raises(DamagedCheckpointError, match=r"checkpoints/2/meta/metadata: not valid JSON"):
        Trainer(config(run, "iterations=3"), resume=True, step=2, log=lambda *_: None).run()
    out = cli("--resume", run, "--step", "2")
    assert out.returncode == 2 and "checkpoints/2/meta/metadata: not valid JSON" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_describe_damage_names_a_missing_item(tmp_path):
    step = tmp_path / "5"
    (step / "extras").mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    assert describe_damage(step, RuntimeError("x")) == f"{step / 'extras' / 'metadata'}: missing"


def test_a_checkpoint_from_before_a_new_config_key_still_resumes():
    """A key the checkpoint's config does not have (added to the package later) is the
    default unless this run sets it; a changed recorded key is still refused."""
    from jaxagent.dataclass_yaml import to_dict
    from jaxagent.train.rundir import check_resumable
    from jaxagent.train.rundir.checkpoint import IncompatibleCheckpointError

    current = to_dict(load_config(TrainerConfig, CONFIG))
    saved = to_dict(load_config(TrainerConfig, CONFIG))
    del saved["model"]["remat"]  # as written before `model.remat` existed
    check_resumable(saved, current, "ckpt")
    current["model"]["remat"] = True  # this run changes it: refused
    with pytest.raises(IncompatibleCheckpointError, match=r"model\.remat: checkpoint None, this run True"):
        check_resumable(saved, current, "ckpt")
    current = to_dict(load_config(TrainerConfig, CONFIG, ["model.hidden_size=48"]))
    with pytest.raises(IncompatibleCheckpointError, match=r"model\.hidden_size"):
        check_resumable(saved, current, "ckpt")
