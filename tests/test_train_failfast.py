"""Broken envs fail fast: bad env kwargs are named before anything is compiled, a run whose
episodes all fail stops with the first failure, and envs of user modules (`env.imports`)
train from the command line, their workers importing the module too."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxagent.dataclass_yaml import ConfigError, load_config
from jaxagent.train.config import TrainerConfig
from jaxagent.train.trainer import EnvFailureError, Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_countdown_grpo.yaml"


def config(run_dir, *overrides) -> TrainerConfig:
    return load_config(TrainerConfig, CONFIG, [f"run_dir={run_dir}", "rollout.max_context=256", *overrides])


def cli(*args, cwd=ROOT, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "jaxagent", "train", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_a_mistyped_env_kwarg_is_named_before_anything_is_built(tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"env 'frozenlake' with kwargs \{'sise': 4\} cannot be built.*sise"):
        Trainer(config(tmp_path / "run", "env.name=frozenlake", "env.kwargs={sise: 4}"), log=lambda *_: None)
    assert time.perf_counter() - t0 < 10
    assert not (tmp_path / "run").exists()
    out = cli("--config", CONFIG, f"run_dir={tmp_path / 'run'}", "env.name=sokoban")  # countdown's kwargs
    assert out.returncode == 2, out.stderr
    assert "config error: env 'sokoban' with kwargs" in out.stderr and "Traceback" not in out.stderr


def test_a_run_whose_episodes_all_fail_stops_with_the_first_failure(tmp_path):
    run = tmp_path / "run"
    broken = [
        "env.name=testing/faulty",
        "env.kwargs={fault: raise, at_step: 1, horizon: 2}",
        "iterations=5",
        "env.max_failed_iterations=2",
        "env.num_workers=1",
    ]
    with pytest.raises(
        EnvFailureError,
        match=r"(?s)every episode of the last 2 iterations failed.*"
        r"the first failure: raised: .*Traceback",
    ):
        Trainer(config(run, *broken), log=lambda *_: None).run()
    lines = read_jsonl(run / "metrics.jsonl")
    assert [m["iteration"] for m in lines] == [1, 2]  # stopped, with what it had written
    assert all(m["failed_frac"] == 1.0 and m["failed_episodes"] == 8 for m in lines)
    # a run where only some episodes fail goes on, and says how many failed
    some = [
        "env.name=testing/faulty",
        "env.kwargs={fault: raise, at_step: 1, horizon: 2, fault_seeds: [0]}",
        "iterations=3",
        "env.num_workers=0",
    ]
    history = Trainer(config(tmp_path / "some", *some), log=lambda *_: None).run()
    assert len(history) == 3 and history[0]["failed_frac"] == 0.5  # task 0's group of 4 of 8


@pytest.mark.slow  # ~15-30 s on 2 cores: `make test-slow`
def test_an_env_of_a_user_module_trains_from_the_cli(tmp_path):
    """The README's example env, imported by name from the config, also in the env
    worker (a spawned process): no episode fails."""
    run = tmp_path / "run"
    out = cli(
        "--config",
        CONFIG,
        f"run_dir={run}",
        "env.imports=[examples.guess_env]",
        "env.name=guess",
        "env.kwargs={high: 8}",
        "env.num_workers=1",
        "rollout.max_turns=3",
        "rollout.max_context=256",
        "iterations=1",
    )
    assert out.returncode == 0, out.stderr
    (m,) = read_jsonl(run / "metrics.jsonl")
    assert m["failed_episodes"] == 0 and m["turns_mean"] >= 1
    # without the import the env is unknown, and a module that does not exist is named
    out = cli("--config", CONFIG, f"run_dir={run}2", "env.name=guess")
    assert out.returncode == 2 and "unknown env 'guess'" in out.stderr
    out = cli("--config", CONFIG, f"run_dir={run}3", "env.imports=[no_such_envs_mod]", "env.name=guess")
    assert out.returncode == 2 and "cannot import 'no_such_envs_mod'" in out.stderr


@pytest.mark.slow
def test_the_command_line_exits_3_when_every_episode_fails(tmp_path):
    broken = [
        "env.name=testing/faulty",
        "env.kwargs={fault: raise, at_step: 1, horizon: 2}",
        "iterations=5",
        "env.max_failed_iterations=2",
        "env.num_workers=1",
    ]
    out = cli(
        "--config", CONFIG, f"run_dir={tmp_path / 'cli'}", "rollout.max_context=256", *broken, "logging.progress=false"
    )
    assert out.returncode == 3, out.stderr
    assert "jaxagent train: stopped: every episode of the last 2 iterations failed" in out.stderr
    assert "failed 100%" in out.stdout  # on the iteration line
