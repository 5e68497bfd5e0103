"""One-step off-policy overlap (`overlap.off_policy`): the rollout of iteration n+1 is
collected in a background thread with the params before update n, and the update
corrects the one-step lag with truncated importance sampling (`loss.tis_cap`)."""

import math
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxagent.dataclass_yaml import ConfigError, load_config
from jaxagent.train.config import TrainerConfig
from jaxagent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_countdown_grpo.yaml"
VARIED = ["env.name=testing/faulty", "env.kwargs={horizon: 2}", "rollout.max_context=256"]


def config(run_dir, *overrides) -> TrainerConfig:
    return load_config(TrainerConfig, CONFIG, [f"run_dir={run_dir}", *VARIED, *overrides])


def test_off_policy_run_reports_staleness_tis_and_idle_time(tmp_path):
    trainer = Trainer(
        config(tmp_path / "run", "iterations=3", "overlap.off_policy=true", "loss.tis_cap=2.0"), log=lambda *_: None
    )
    before = jax.device_get(trainer.state.params)
    history = trainer.run()
    assert [m["iteration"] for m in history] == [1, 2, 3]
    # the first batch is on-policy, every later one was sampled before the previous update
    assert [m["staleness"] for m in history] == [0, 1, 1]
    # the first rollout starts only when the first iteration waits for it: the wait
    # covers the whole rollout (later ones ran during the previous update)
    assert history[0]["time_rollout_wait_s"] >= history[0]["time_rollout_s"]
    for m in history:
        for key in ("tis_weight", "device_idle_frac", "time_rollout_s", "time_rollout_wait_s", "time_update_s"):
            assert key in m and math.isfinite(m[key]), key
        # the idle share is the main thread's wait for the rollout over the iteration, and
        # the main thread's phases, one after another, fit in the iteration
        assert m["device_idle_frac"] == pytest.approx(m["time_rollout_wait_s"] / m["time_iteration_s"], rel=1e-9)
        main_thread = sum(m[f"time_{k}_s"] for k in ("rollout_wait", "logprobs", "advantages", "update"))
        assert 0 < main_thread <= m["time_iteration_s"], m
        assert 0 < m["tis_weight"] <= 2.0
        assert m["skipped_updates"] == 0
    # on-policy, the trainer's log-probs are the sampler's; one update later they are not
    assert history[0]["rollout_logp_gap"] < 1e-4
    assert history[1]["rollout_logp_gap"] > 1e-4
    # the stream advanced by exactly the batches trained on (none lost, none twice)
    assert [m["tasks_seen"] for m in history] == [2, 4, 6]
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(trainer.state.params)), strict=True)
    )


def test_off_policy_needs_a_tis_cap(tmp_path):
    with pytest.raises(ConfigError, match="overlap.off_policy needs loss.tis_cap"):
        config(tmp_path / "run", "overlap.off_policy=true")
    with pytest.raises(ConfigError, match="max_staleness"):
        config(tmp_path / "run", "overlap.max_staleness=2")


@pytest.mark.slow  # ~32 s on idle cores (suite budget; test_rollout_overlap's continuous equality test stays)
def test_continuous_scheduling_trains_on_the_same_episodes(tmp_path):
    """`rollout.slots`: the trainer's rollouts with 3 sampler rows for a batch of 4 (rows
    are reused as episodes end) are the turn-synchronous ones, so the run is too."""
    runs = {}
    for name, extra in (("sync", []), ("continuous", ["rollout.slots=3"])):
        trainer = Trainer(
            config(tmp_path / name, "iterations=2", "env.kwargs={horizon: 3}", "rollout.max_turns=3", *extra),
            log=lambda *_: None,
        )
        runs[name] = trainer.run()
        assert trainer.config.rollout.slots == (3 if extra else 0)
    for a, b in zip(runs["sync"], runs["continuous"], strict=True):
        for key in ("reward_mean", "success_rate", "turns_mean", "episode_tokens_mean", "tasks_seen"):
            assert a[key] == b[key], key
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
    with pytest.raises(ConfigError, match="slots"):
        config(tmp_path / "bad", "rollout.slots=2", "rollout.pipeline_groups=2")
