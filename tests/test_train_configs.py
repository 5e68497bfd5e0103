"""The shipped training configs (`configs/*.yaml`): each loads, names a real env whose
kwargs it accepts, fits its first prompt in the context, and the env x algorithm
configs each run one iteration end to end; a slow test runs every config exactly as
shipped for one iteration.

Every YAML in `configs/` is covered by the glob, so a new config is checked as soon as
it lands. The end-to-end runs use the config as shipped (model, env kwargs, algorithm,
loss, optimizer) and shrink only the batch, turns, tokens and context, so each is a few
seconds; one run per algorithm family (GRPO, PPO with a critic, GiGPO) on FrozenLake is
in the default suite, the other nine are marked slow.
"""

import dataclasses
import json
import math
from pathlib import Path

import jax
import pytest

import envs
from jaxagent.dataclass_yaml import load_config
from jaxagent.train.build import build_tokenizer
from jaxagent.train.config import TrainerConfig
from jaxagent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
BUILTIN_ENVS = ("frozenlake", "sokoban", "countdown", "toolmath")
ALGOS = ("grpo", "ppo", "gigpo")
#: the env x algorithm configs, with the estimator each must select
ENV_ALGO = [(env, algo) for env in BUILTIN_ENVS for algo in ALGOS]
ESTIMATOR = {"grpo": "grpo", "ppo": "gae", "gigpo": "gigpo"}
#: the cheap env whose runs stay in the default suite (one per algorithm family)
FAST_ENV = "frozenlake"
#: overrides that make one iteration a few seconds: 2 episodes of one task, 2 turns of
#: 8 tokens, a context that still holds every shipped env's first prompt (< 700 byte tokens)
SHRINK = [
    "iterations=1",
    "env.group_size=2",
    "env.tasks_per_iteration=1",
    "update.mini_batches=1",
    "update.micro_batches=1",
    "update.epochs=1",
    "rollout.max_turns=2",
    "rollout.max_tokens_per_turn=8",
    "rollout.max_context=1024",
    "checkpoint_every=1",
    "env.num_workers=0",
    "update.logprob_rows=null",
    "warm_start.episodes=0",
    "eval.episodes=0",
]


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def test_the_env_algo_configs_are_all_there():
    names = {p.name for p in CONFIGS}
    missing = [f"{env}_{algo}.yaml" for env, algo in ENV_ALGO if f"{env}_{algo}.yaml" not in names]
    assert not missing, missing
    assert {"intake_grpo.yaml", "smollm2_countdown_grpo.yaml", "gpu_countdown_grpo.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads_and_its_env_exists(path):
    cfg = load_config(TrainerConfig, path)
    assert cfg.run_dir.startswith("runs/")  # ignored by git
    assert path.read_text().startswith("#"), "a config starts with a comment saying what it is for"
    if cfg.agent.program is not None:  # an agent program's run has tasks, not an env
        from jaxagent.gateway.program import TaskSource, load_program

        load_program(cfg.agent.program, cfg.agent.imports)
        assert isinstance(TaskSource(cfg.agent.tasks, cfg.agent.imports).task(cfg.env.seed), dict)
        return
    assert envs.is_known(cfg.env.name), cfg.env.name
    assert cfg.env.name in envs.known_envs()
    assert path.read_text().startswith("#"), "a config starts with a comment saying what it is for"


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name != "default.yaml"], ids=lambda p: p.name)
def test_config_env_accepts_its_kwargs_and_the_prompt_fits(path):
    """The env kwargs are valid (load_config cannot know them) and the first prompt of a
    few tasks leaves room for at least one full turn in `rollout.max_context`."""
    from jaxagent.rollout.chat import ChatFormat

    cfg = load_config(TrainerConfig, path)
    if cfg.agent.program is not None:
        pytest.skip("an agent program's config: no env (its program and tasks load in the test above)")
    if cfg.model.path is not None:
        from jaxagent.models.hf import resolve_model_path

        try:
            resolve_model_path(cfg.model.path)
        except FileNotFoundError as err:
            pytest.skip(str(err))
    # a "bpe" tokenizer is trained at the start of a run; its merges within words only
    # shorten the byte tokenizer's sequences, so the byte count is an upper bound. Merges
    # across words (tokenizer_pieces: lines) are what make a long prompt fit: that one is
    # trained here as the run trains it
    if cfg.model.tokenizer == "bpe" and cfg.model.tokenizer_pieces != "words":
        from jaxagent.train.build import rollout_source, run_tokenizer

        chat = ChatFormat(run_tokenizer(cfg, rollout_source(cfg), Path("/nonexistent"), resume=False))
    else:
        model = dataclasses.replace(cfg.model, tokenizer="byte") if cfg.model.tokenizer == "bpe" else cfg.model
        chat = ChatFormat(build_tokenizer(model))
    env = envs.make(cfg.env.name, **cfg.env.kwargs)
    try:
        for k in range(4):
            obs, info = env.reset(seed=cfg.env.seed + k)
            prompt = chat.prompt_tokens(info.get("system_prompt", env.system_prompt), obs)
            assert len(prompt) + cfg.rollout.max_tokens_per_turn <= cfg.rollout.max_context, (path.name, k, len(prompt))
    finally:
        env.close()


@pytest.mark.parametrize("env, algo", ENV_ALGO, ids=[f"{e}_{a}" for e, a in ENV_ALGO])
def test_env_algo_config_names_its_env_and_estimator(env, algo):
    cfg = load_config(TrainerConfig, ROOT / "configs" / f"{env}_{algo}.yaml")
    assert cfg.env.name == env
    assert cfg.algo.advantage == ESTIMATOR[algo]
    assert cfg.algo.uses_critic == (algo == "ppo")
    assert cfg.model.path is None and cfg.model.tokenizer in (None, "byte", "bpe")  # tiny from-scratch models


def _one_iteration(tmp_path, env, algo):
    path = ROOT / "configs" / f"{env}_{algo}.yaml"
    run_dir = tmp_path / "run"
    cfg = load_config(TrainerConfig, path, [f"run_dir={run_dir}", *SHRINK])
    Trainer(cfg, log=lambda *_: None).run()
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["iteration"] for m in lines] == [1]
    m = lines[0]
    assert math.isfinite(m["loss"]), m
    # (an update is skipped only when it has nothing to learn: two episodes of one task that tie)
    assert (m["skipped_updates"] == 0 or m["advantage_abs_mean"] == 0) and m["failed_episodes"] == 0
    # every played turn samples 1 .. max_tokens_per_turn policy tokens
    turns = round(m["turns_mean"] * cfg.env.batch_size)
    assert turns > 0 and turns <= m["policy_tokens"] <= turns * cfg.rollout.max_tokens_per_turn, m
    assert m["rollout_logp_gap"] < 1e-4
    if algo == "ppo":
        assert math.isfinite(m["value_loss"]) and math.isfinite(m["explained_variance"])
    assert (run_dir / "checkpoints" / "1").is_dir()


def _params(fast: bool):
    out = []
    for env, algo in ENV_ALGO:
        if (env == FAST_ENV) == fast:
            marks = () if fast else (pytest.mark.slow,)
            out.append(pytest.param(env, algo, id=f"{env}_{algo}", marks=marks))
    return out


@pytest.mark.parametrize("env, algo", _params(fast=True))
def test_env_algo_config_runs_one_iteration(tmp_path, env, algo):
    _one_iteration(tmp_path, env, algo)


@pytest.mark.parametrize("env, algo", _params(fast=False))
def test_env_algo_config_runs_one_iteration_slow(tmp_path, env, algo):
    _one_iteration(tmp_path, env, algo)


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_runs_one_iteration_as_shipped(tmp_path, path):
    """Exactly as shipped (batch, context, warm start, evaluation, workers, memory
    settings), one iteration: the memory estimate lets it start and it does not run out."""
    cfg = load_config(TrainerConfig, path, [f"run_dir={tmp_path / 'run'}", "iterations=1"])
    if path.stem.startswith("gpu_") and jax.default_backend() == "cpu":
        # 128 episodes of SmolLM2 at 256 tokens, 16 times smollm2_countdown_grpo's batch
        # (about 2 minutes an iteration on 2 cores). Its programs are compiled at these
        # shapes by tests/test_train_compiled.py (slow), and a mixed-precision run by
        # tests/test_train_mixed_precision.py
        pytest.skip("an accelerator recipe, sized for a GPU")
    if cfg.model.path is not None:
        from jaxagent.models.hf import resolve_model_path

        try:
            resolve_model_path(cfg.model.path)
        except FileNotFoundError as err:
            pytest.skip(str(err))
    # in a fresh process, as a user runs it: the memory check compares with the host's
    # available RAM, which an earlier big config in this process would still hold
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxagent",
            "train",
            "--config",
            str(path),
            f"run_dir={tmp_path / 'run'}",
            "iterations=1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (m,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert math.isfinite(m["loss"]) and m["failed_episodes"] == 0
