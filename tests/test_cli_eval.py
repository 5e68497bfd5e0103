"""`jaxagent eval RUN_DIR`: a trained run's checkpoint on held-out seeds, JSONL out."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxagent.dataclass_yaml import load_config
from jaxagent.train.config import TrainerConfig
from jaxagent.train.evaluate import evaluate_run
from jaxagent.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def eval_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "jaxagent", "eval", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow  # ~28 s on idle cores (suite budget): `make test-slow`
def test_eval_plays_held_out_seeds_and_writes_jsonl(tmp_path):
    run = tmp_path / "run"
    cfg = load_config(
        TrainerConfig,
        ROOT / "configs" / "tiny_frozenlake_gigpo.yaml",
        [f"run_dir={run}", "iterations=1", "eval.episodes=6", "eval.seed=500000"],
    )
    Trainer(cfg, log=lambda *_: None).run()
    out = tmp_path / "eval.jsonl"
    done = eval_cli(run, "--episodes", 5, "--temperature", 0, "--out", out)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 6 and lines[-1] == summary
    episodes = lines[:-1]
    assert [e["seed"] for e in episodes] == [500000 + i for i in range(5)]  # the config's held-out seeds
    assert summary["episodes"] == 5 and summary["iteration"] == 1 and summary["temperature"] == 0.0
    assert summary["success_rate"] == sum(e["success"] for e in episodes) / 5
    # an episode's success is the env's own report on its last step (FrozenLake: reached the goal)
    assert [e["success"] for e in episodes] == [e["info"].get("success") is True for e in episodes]
    assert all("info" in e and "end_reason" in e for e in episodes)
    assert all(len(e["actions"]) == e["turns"] and all(isinstance(a, str) for a in e["actions"]) for e in episodes)
    # greedy evaluation of the same checkpoint is reproducible, in process too
    again = evaluate_run(run, episodes=5, temperature=0.0, log=lambda *_: None)
    assert again["success_rate"] == summary["success_rate"] and again["return_mean"] == summary["return_mean"]


def test_eval_errors_exit_2(tmp_path):
    done = eval_cli(tmp_path)
    assert done.returncode == 2 and "config.yaml is missing" in done.stderr


@pytest.mark.slow
def test_export_writes_a_directory_transformers_loads_with_the_same_policy(tmp_path):
    """`jaxagent export RUN_DIR OUT_DIR`: the checkpoint's policy, with the run's trained
    "bpe" tokenizer and chat template, loads in transformers with the same logits, and
    its generation config stops at the end of a turn."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers

    from jaxagent.models import Model
    from jaxagent.train.runtools import restore_run, run_config

    run = tmp_path / "run"
    cfg = load_config(
        TrainerConfig,
        ROOT / "configs" / "default.yaml",
        [
            f"run_dir={run}",
            "iterations=1",
            "warm_start.episodes=16",
            "warm_start.epochs=1",
            "eval.episodes=0",
            "env.tasks_per_iteration=2",
            "env.num_workers=0",
        ],
    )
    Trainer(cfg, log=lambda *_: None).run()
    out = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "jaxagent", "export", str(run), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(out)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    ids = tok(text)["input_ids"]
    _, state, _ = restore_run(run_config(run), log=lambda *_: None)
    ours = np.asarray(Model(params=state.params, config=state.model_config)(jnp.asarray([ids], jnp.int32)))
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    assert np.max(np.abs(ours - theirs)) < 1e-4
    end = tok.convert_tokens_to_ids("<|im_end|>")
    gen = transformers.GenerationConfig.from_pretrained(str(out))
    assert end in (gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id])
    # a second export into the same directory is refused unless overwrite=True (--overwrite)
    from jaxagent.train.runtools import export_run

    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export_run(run, out, log=lambda *_: None)


@pytest.mark.slow  # ~15-30 s on 2 cores: `make test-slow`
def test_eval_on_other_env_settings_and_the_warm_started_step(tmp_path):
    """`jaxagent eval RUN_DIR --step 0 env.kwargs.cases=adversarial`: the warm-started
    policy (step 0 is kept whatever keep_checkpoints says) on the adversarial intake
    cases; the last line holds the env's own summary (rubric, triage rates)."""
    run = tmp_path / "run"
    cfg = load_config(
        TrainerConfig,
        ROOT / "configs" / "tiny_countdown_grpo.yaml",
        [
            f"run_dir={run}",
            "env.name=intake",
            "env.kwargs={max_turns: 2}",
            "iterations=2",
            "checkpoint_every=1",
            "keep_checkpoints=1",
            "env.group_size=2",
            "env.tasks_per_iteration=1",
            "update.mini_batches=1",
            "rollout.max_turns=2",
            "rollout.max_tokens_per_turn=8",
            "rollout.max_context=2048",
            "env.num_workers=0",
            "warm_start.episodes=2",
            "warm_start.batch_size=2",
        ],
    )
    Trainer(cfg, log=lambda *_: None).run()
    from jaxagent.train.rundir import checkpoint_steps

    assert checkpoint_steps(run) == [0, 2]
    done = eval_cli(run, "--step", 0, "--episodes", 3, "env.kwargs.cases=adversarial", "env.kwargs.max_turns=2")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["iteration"] == 0 and summary["episodes"] == 3
    assert summary["overrides"] == ["env.kwargs.cases=adversarial", "env.kwargs.max_turns=2"]
    env = summary["env_summary"]
    for key in ("rubric_mean", "components", "under_triage_rate", "over_triage_rate", "assessment_rate"):
        assert key in env, key
    assert 0 <= env["under_triage_rate"] <= 1 and set(env["components"]) >= {"triage", "history"}
    # the run's own model cannot be overridden, and a bad env setting is named
    from jaxagent.dataclass_yaml import ConfigError

    with pytest.raises(ConfigError, match=r"eval overrides may set env\.\*, rollout\.\*, eval\.\* only"):
        evaluate_run(run, overrides=["model.hidden_size=8"], log=lambda *_: None)
    with pytest.raises(ConfigError, match="cases"):
        evaluate_run(run, episodes=2, overrides=["env.kwargs.cases=nonsense"], log=lambda *_: None)
