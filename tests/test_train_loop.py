"""End-to-end runs of the training loop (`jaxagent.train.trainer`) on a tiny config.

Each run is short (2-3 iterations of a 2-layer model on 8 episodes) and checks what a
user relies on: finite metrics, one JSONL line per iteration, checkpoints on disk,
parameters that moved, exact resume from a fresh process, and config errors that name
their key through the CLI.
"""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxagent.dataclass_yaml import ConfigError, load_config
from jaxagent.train.config import TrainerConfig
from jaxagent.train.evaluate import evaluate_run
from jaxagent.train.rundir.checkpoint import CheckpointManager, IncompatibleCheckpointError
from jaxagent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_countdown_grpo.yaml"
#: a multi-turn env whose reward is a deterministic function of the seed and the action
#: text, so even a random policy's episodes differ and group advantages are non-zero.
VARIED = ["env.name=testing/faulty", "env.kwargs={horizon: 2}", "rollout.max_context=256"]
#: metrics that measure time, not learning
TIMING = ("tokens_per_s",)


def config(run_dir, *overrides) -> TrainerConfig:
    return load_config(TrainerConfig, CONFIG, [f"run_dir={run_dir}", *overrides])


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


def learning_metrics(history) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith("time_") and k not in TIMING} for m in history]


def check_run(trainer: Trainer, history: list[dict], iterations: int):
    """Finite metrics, one JSONL line per iteration, the last checkpoint on disk."""
    assert [m["iteration"] for m in history] == list(range(1, iterations + 1))
    for m in history:
        for key, value in m.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), (key, value)
        for key in (
            "reward_mean",
            "success_rate",
            "entropy",
            "clipfrac",
            "approx_kl",
            "tokens_per_s",
            "time_rollout_s",
            "time_update_s",
        ):
            assert key in m, key
        assert m["skipped_updates"] == 0
        # every played turn samples 1 .. max_tokens_per_turn policy tokens
        turns = round(m["turns_mean"] * trainer.config.env.batch_size)
        assert turns > 0 and turns <= m["policy_tokens"] <= turns * trainer.config.rollout.max_tokens_per_turn, m
        # the trainer's log-probs of the trajectory are the sampler's: it learns from what was sampled
        assert m["rollout_logp_gap"] < 1e-4
    assert read_jsonl(trainer.metrics_path) == history
    with CheckpointManager(trainer.run_dir / "checkpoints") as ckpt:
        assert ckpt.latest_step() == iterations


def params_moved(before, after) -> bool:
    return any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))


def test_grpo_run_learns_from_group_advantages(tmp_path):
    trainer = Trainer(config(tmp_path / "run", *VARIED, "loss.entropy_coef=0.0"), log=lambda *_: None)
    before = jax.device_get(trainer.state.params)
    history = trainer.run()
    check_run(trainer, history, 2)
    # rewards differ within groups, so the policy gradient itself (no entropy bonus) moves the params
    assert all(m["advantage_abs_mean"] > 0 for m in history)
    assert params_moved(before, jax.device_get(trainer.state.params))
    assert history[-1]["step"] == 2 * trainer.config.update.mini_batches


def test_sampler_old_logprobs_skip_the_pass_and_update_as_the_recomputed_ones(tmp_path):
    """update.old_logprobs=sampler: the same episodes (same seeds), one update each, from the
    same initial params; the sampler's log-probs equal the recomputed ones to float
    rounding, so the updated params agree to that rounding, and no log-prob pass runs."""
    runs, passes = {}, {}
    for mode in ("recompute", "sampler"):
        trainer = Trainer(
            config(tmp_path / mode, *VARIED, "iterations=1", f"update.old_logprobs={mode}"), log=lambda *_: None
        )
        passes[mode], logprobs = 0, trainer.placement.logprobs

        def counted(*args, _f=logprobs, _mode=mode, **kwargs):
            passes[_mode] += 1
            return _f(*args, **kwargs)

        trainer.placement.logprobs = counted
        before = jax.device_get(trainer.state.params)  # the same initial params in both modes
        history = trainer.run()
        runs[mode] = (jax.device_get(trainer.state.params), history[0])
    assert passes == {"recompute": 1, "sampler": 0}
    (p_re, m_re), (p_sa, m_sa) = runs["recompute"], runs["sampler"]
    assert "rollout_logp_gap" in m_re and "rollout_logp_gap" not in m_sa
    assert m_re["rollout_logp_gap"] < 1e-4
    assert m_sa["reward_mean"] == m_re["reward_mean"] and m_sa["policy_tokens"] == m_re["policy_tokens"]
    assert m_sa["loss"] == pytest.approx(m_re["loss"], abs=1e-4)
    for a, b in zip(jax.tree.leaves(p_sa), jax.tree.leaves(p_re), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=0, atol=1e-5)
    assert params_moved(before, p_sa)


@pytest.mark.parametrize(
    "override, why",
    [
        ("rollout.top_p=0.9", "top_p"),
        ("rollout.top_k=5", "top_k"),
        ("loss.tis_cap=2.0", "tis_cap"),
        ("rollout.temperature=0", "temperature is 0"),
    ],
)
def test_sampler_old_logprobs_need_the_untruncated_sampling_distribution(tmp_path, override, why):
    with pytest.raises(ConfigError, match=why):
        config(tmp_path / "run", "update.old_logprobs=sampler", override)
    with pytest.raises(ConfigError, match="old_logprobs"):
        config(tmp_path / "run", "update.old_logprobs=rollout")


def test_a_kl_term_on_the_last_turn_reaches_the_update(tmp_path):
    """`loss.kl_turns=last`: every update's batch carries a KL mask that covers, in each
    row, the policy tokens after all its other ones (the episode's last turn), and only
    those; the step itself refuses a batch without it (test_train_step)."""
    trainer = Trainer(
        config(tmp_path / "run", *VARIED, "loss.kl_coef=0.05", "loss.kl_turns=last", "iterations=1"),
        log=lambda *_: None,
    )
    seen, update = [], trainer._update

    def spy(state, mini):
        seen.append(jax.device_get((mini.loss_mask, mini.kl_mask)))
        return update(state, mini)

    trainer._update = spy
    history = trainer.run()
    assert seen and all("kl" in m for m in history)
    for loss_mask, kl_mask in seen:
        assert kl_mask is not None
        policy, covered = loss_mask > 0, kl_mask > 0
        assert not (covered & ~policy).any() and covered.sum() < policy.sum()  # a part of the policy tokens
        for row_policy, row_covered in zip(policy, covered, strict=True):
            if row_policy.any():
                rest = np.flatnonzero(row_policy & ~row_covered)
                kl_at = np.flatnonzero(row_covered)
                assert kl_at.size and (rest.size == 0 or kl_at.min() > rest.max())


# ~24 s on idle cores (suite budget; test_train_configs' frozenlake_ppo run trains a critic by default)
@pytest.mark.slow
def test_ppo_with_critic_run(tmp_path):
    trainer = Trainer(config(tmp_path / "run", "algo.advantage=gae", "algo.lam=0.95"), log=lambda *_: None)
    before = jax.device_get((trainer.state.params, trainer.state.critic_params))
    history = trainer.run()
    check_run(trainer, history, 2)
    for m in history:
        assert "value_loss" in m and "explained_variance" in m
    after = jax.device_get((trainer.state.params, trainer.state.critic_params))
    assert params_moved(before[0], after[0]) and params_moved(before[1], after[1])


@pytest.mark.slow
@pytest.mark.parametrize("advantage", ["rloo", "reinforce_pp_baseline", "gigpo", "dr_grpo", "reinforce_pp"])
def test_other_estimators_run(tmp_path, advantage):
    trainer = Trainer(
        config(tmp_path / "run", *VARIED, f"algo.advantage={advantage}", "loss.entropy_coef=0.0", "loss.kl_coef=0.01"),
        log=lambda *_: None,
    )
    before = jax.device_get(trainer.state.params)
    history = trainer.run()
    check_run(trainer, history, 2)
    assert all("kl" in m for m in history)
    assert params_moved(before, jax.device_get(trainer.state.params))


@pytest.mark.slow  # ~15-30 s on 2 cores: `make test-slow`
def test_resume_continues_the_stream_from_a_fresh_process(tmp_path):
    run = tmp_path / "run"
    trainer = Trainer(config(run, *VARIED), log=lambda *_: None)
    first = trainer.run()
    assert len(first) == 2
    out = cli("--config", CONFIG, f"run_dir={run}", *VARIED, "iterations=3", "--resume")
    assert out.returncode == 0, out.stderr
    assert "resumed" in out.stdout
    lines = read_jsonl(run / "metrics.jsonl")
    assert [m["iteration"] for m in lines] == [1, 2, 3]
    assert lines[:2] == first
    assert lines[2]["tasks_seen"] == 3 * trainer.config.env.tasks_per_iteration
    assert lines[2]["step"] == 3 * trainer.config.update.mini_batches
    with CheckpointManager(run / "checkpoints") as ckpt:
        assert ckpt.latest_step() == 3
    # a different task stream cannot continue this run
    with pytest.raises(IncompatibleCheckpointError, match=r"env\.seed: checkpoint 0, this run 5"):
        Trainer(config(run, *VARIED, "iterations=4", "env.seed=5"), resume=True, log=lambda *_: None).run()
    # nor can a fresh start overwrite it
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        Trainer(config(run, *VARIED, "iterations=4"), log=lambda *_: None).run()
    assert read_jsonl(run / "metrics.jsonl") == lines


@pytest.mark.slow  # ~21 s; exact resume is also checked by the full-disk tests (test_train_diskfull)
def test_resume_after_a_lost_iteration_replays_it_exactly(tmp_path):
    """A run that died after logging iteration 3 but before checkpointing it: resuming
    drops the orphan metrics line and plays iteration 3 again, with the same numbers."""
    run = tmp_path / "run"
    trainer = Trainer(config(run, *VARIED, "iterations=3", "checkpoint_every=2"), log=lambda *_: None)
    original = trainer.run()
    shutil.rmtree(run / "checkpoints" / "3")  # as if killed before the save of iteration 3
    resumed = Trainer(config(run, *VARIED, "iterations=3", "checkpoint_every=2"), resume=True, log=lambda *_: None)
    assert resumed.run()[:2] == original[:2]
    lines = read_jsonl(run / "metrics.jsonl")
    assert [m["iteration"] for m in lines] == [1, 2, 3]
    assert learning_metrics(lines) == learning_metrics(original)


@pytest.mark.slow
def test_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """2 iterations + resume 1 (each in a fresh process) == 3 iterations in one (CPU)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for args in (
        [f"run_dir={a}", "iterations=2"],
        [f"run_dir={a}", "iterations=3", "--resume"],
        [f"run_dir={b}", "iterations=3"],
    ):
        out = cli("--config", CONFIG, *VARIED, *args)
        assert out.returncode == 0, out.stderr
    resumed, straight = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert len(resumed) == len(straight) == 3
    assert learning_metrics(resumed) == learning_metrics(straight)


@pytest.mark.slow  # ~18 s on idle cores (suite budget; the replayed-resume test stays)
def test_a_finished_run_resumed_for_more_iterations_evaluates_again(tmp_path):
    """The summary's after-RL evaluation is of the final policy, also after a resume that
    extends a finished run; the extended run's evaluation equals an uninterrupted run's."""
    ev = ["eval.episodes=4", "eval.seed=700000", "env.num_workers=0"]
    a, b = tmp_path / "a", tmp_path / "b"
    Trainer(config(a, *VARIED, *ev, "iterations=1"), log=lambda *_: None).run()
    first = json.loads((a / "summary.json").read_text())
    assert first["iterations_at_eval"] == 1
    lines = []
    Trainer(config(a, *VARIED, *ev, "iterations=2"), resume=True, log=lines.append).run()
    Trainer(config(b, *VARIED, *ev, "iterations=2"), log=lambda *_: None).run()
    extended, straight = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert extended["iterations_at_eval"] == straight["iterations_at_eval"] == 2
    for key in ("success_after_rl", "eval_after_rl"):
        want = {k: v for k, v in straight[key].items() if k != "seconds"} if key == "eval_after_rl" else straight[key]
        got = {k: v for k, v in extended[key].items() if k != "seconds"} if key == "eval_after_rl" else extended[key]
        assert got == want, key
    assert json.loads(lines[-1])["iterations"] == 2  # the final line is the new evaluation's


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Trainer(config(tmp_path / "run"), resume=True, log=lambda *_: None).run()
    assert not (tmp_path / "run").exists()  # nothing created
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer(config(tmp_path / "run"), resume=True, log=lambda *_: None).run()


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(TrainerConfig, path)
    assert cfg.run_dir.startswith("runs/")  # ignored by git


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("tiny_*.yaml")), ids=lambda p: p.name)
def test_every_tiny_config_trains_through_the_cli(tmp_path, path):
    out = cli("--config", path, f"run_dir={tmp_path / 'run'}")
    assert out.returncode == 0, out.stderr
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(lines) == load_config(TrainerConfig, path).iterations
    assert all(math.isfinite(m["loss"]) and m["skipped_updates"] == 0 for m in lines)


@pytest.mark.parametrize(
    "override, names",
    [
        ("optim.lrr=0.1", "optim.lrr"),
        ("env.group_size=two", "env.group_size"),
        ("algo.advantage=nonsense", "advantage"),
        ("update.mini_batches=3", "mini_batches"),
    ],
)
def test_config_errors_name_the_key(tmp_path, override, names):
    with pytest.raises(ConfigError, match=names.replace(".", r"\.")):
        config(tmp_path / "run", override)


def test_config_error_through_the_cli_exits_2(tmp_path):
    out = cli("--config", CONFIG, f"run_dir={tmp_path / 'run'}", "optim.lrr=0.1", timeout=120)
    assert out.returncode == 2
    assert "optim.lrr" in out.stderr and "did you mean 'lr'" in out.stderr
    assert not (tmp_path / "run").exists()


def test_train_without_config_runs_the_embedded_demo_and_ends_with_its_json_line(tmp_path):
    # configs/default.yaml shrunk by overrides: warm start, evaluations, RL, then the JSON line
    small = [
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.head_dim=8",
        "warm_start.episodes=16",
        "warm_start.epochs=1",
        "warm_start.batch_size=8",
        "eval.episodes=8",
        "env.tasks_per_iteration=1",
        "env.group_size=4",
        "iterations=1",
        "rollout.max_turns=3",
        "update.mini_batches=1",
        "env.num_workers=0",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "jaxagent", "train", f"run_dir={tmp_path / 'run'}", *small],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(last) >= {"success_before_rl", "success_after_rl"}
    assert last["lift_points"] == round(100 * (last["success_after_rl"] - last["success_before_rl"]), 2)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # each rate is a share of the 8 held-out episodes (eval.episodes=8)
    before = last["success_before_rl"]
    assert before == summary["success_before_rl"] and before * 8 == round(before * 8)
    # after RL: the share the env reported won, of the same evaluation replayed from the
    # last checkpoint (the one it ran with), which lists the episodes
    lines = tmp_path / "eval.jsonl"
    evaluate_run(tmp_path / "run", out=lines, log=lambda *_: None)
    episodes = [json.loads(x) for x in lines.read_text().splitlines()][:-1]
    assert [e["seed"] for e in episodes] == list(range(2_000_000, 2_000_008))  # default.yaml's eval.seed
    won = sum(e["info"].get("success") is True for e in episodes)
    assert last["success_after_rl"] == summary["success_after_rl"] == won / 8
    assert load_config(TrainerConfig, tmp_path / "run" / "config.yaml").env.name == "frozenlake"
