"""Held-out evaluation: a policy on seeds never trained on, with or without a `Trainer`.

    evaluate_policy(loop, pool, params, episodes=256, first_seed=2_000_000, temperature=0.0)

plays `episodes` episodes on seeds `first_seed, first_seed + 1, ...` in chunks of the
pool's size (the last chunk padded with repeats that are dropped), chunk `c` sampling
with seed `sampling_seed + c * len(pool)`, so two evaluations differ only by the policy.
`evaluate(config, loop, pool, params)` takes the defaults from the config's `eval` and
`rollout` sections (what the trainer runs before and after RL), and adds the env's own
summary when it has one (`env_summary`, and its numbers flat as `env_<key>`: for intake
`env_rubric_mean`, `env_components_history`, `env_under_triage_rate`, ...).

`jaxagent eval`: `evaluate_run("runs/default", episodes=256, out="eval.jsonl")` loads
`<run_dir>/config.yaml` (the config the run was trained with), restores a checkpoint
(the latest, or `step`), and plays `episodes` episodes on seeds `seed, seed + 1, ...`
(default: the config's `eval` section) with the run's env, limits and sampling
(`temperature` overrides it; 0 = greedy). Returns the summary (success rate, mean return
and turns, the fractions of actions that were malformed, `invalid_action_frac`, or
changed nothing, `noop_action_frac`); with `out`, writes one JSON line per episode (seed,
success, return, turns, end reason, the actions taken, the env's last info: e.g. `intake`'s
rubric components) followed by the summary line.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxagent.train.metrics import jsonable
from jaxagent.train.rundir.runlog import is_terminal
from jaxagent.train.runtools import restore_run, run_config


def evaluate_policy(
    loop,
    pool,
    params,
    *,
    episodes: int,
    first_seed: int,
    temperature: float,
    sampling_seed: int = 0,
    details: bool = False,
    progress=None,
) -> dict:
    """Success rate, mean return and turns of `params` (module docstring). With
    `details`, `per_episode` lists each episode's seed, success, return, turns, end
    reason, actions (the text of each turn's action) and the env's last info.
    `progress(done, episodes)` is called after each chunk (and with 0 before the first).
    Episodes score with the env's own reward: a judge the loop trains with (`reward_fn`)
    is not called."""
    if not isinstance(episodes, int) or isinstance(episodes, bool) or episodes < 1:
        raise ValueError(f"evaluate_policy: episodes must be a positive int, got {episodes!r}")
    t0 = time.perf_counter()
    loop.set_params(params)
    reward_fn, loop.reward_fn = loop.reward_fn, None  # held out: the env's own reward, never a judge's
    try:
        return _evaluate(loop, pool, episodes, first_seed, temperature, sampling_seed, details, progress, t0)
    finally:
        loop.reward_fn = reward_fn


def _evaluate(loop, pool, episodes, first_seed, temperature, sampling_seed, details, progress, t0) -> dict:
    sampling = dataclasses.replace(loop.config.sampling, temperature=float(temperature))
    B = len(pool)
    played = []
    if progress is not None:
        progress(0, episodes)
    for start in range(0, episodes, B):
        seeds = list(range(first_seed + start, first_seed + min(start + B, episodes)))
        k = len(seeds)
        seeds += [seeds[-1]] * (B - k)  # padding slots, dropped below
        _, eps = loop.run(pool, seeds, list(range(B)), seed=sampling_seed + start, sampling=sampling)
        played += eps[:k]
        if progress is not None:
            progress(len(played), episodes)
    ok = np.array([ep.success for ep in played])
    turns = max(sum(len(ep.rewards) for ep in played), 1)
    out = {
        "episodes": episodes,
        "success_rate": float(ok.mean()),
        "return_mean": float(np.mean([sum(ep.rewards) for ep in played])),
        "turns_mean": float(np.mean([len(ep.rewards) for ep in played])),
        "failed_episodes": int(sum(ep.failed for ep in played)),
        "invalid_action_frac": sum(ep.invalid_actions for ep in played) / turns,
        "noop_action_frac": sum(ep.noop_actions for ep in played) / turns,
        "temperature": float(temperature),
        "seconds": time.perf_counter() - t0,
    }
    if details:
        out["per_episode"] = [
            {
                "seed": int(ep.seed),
                "success": bool(ep.success),
                "return": float(sum(ep.rewards)),
                "turns": len(ep.rewards),
                "failed": bool(ep.failed),
                "done": bool(ep.done),
                "end_reason": ep.end_reason,
                "actions": list(ep.actions),
                "info": jsonable(ep.info),
            }
            for ep in played
        ]
    return out


class EvalProgress:
    """`progress` for `evaluate_policy` on a terminal: a tqdm bar of episodes on `stream`
    (stderr), removed when done; off a terminal it shows nothing. `label` names the
    evaluation (e.g. "held-out evaluation before RL, greedy")."""

    def __init__(self, label: str, stream=None):
        import sys

        self.label, self.stream = label, sys.stderr if stream is None else stream
        self._bar: Any = None  # the tqdm bar (made on the first call)
        self.enabled = is_terminal(self.stream)

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm import tqdm  # type: ignore[import-untyped]  # no stubs installed (types-tqdm is not a dependency)

            self._bar = tqdm(
                total=total, desc=self.label, unit="episode", file=self.stream, leave=False, dynamic_ncols=True
            )
        self._bar.update(done - self._bar.n)
        if done >= total:
            self._bar.close()
            self._bar = None


def evaluate(
    config,
    loop,
    pool,
    params,
    *,
    episodes: int | None = None,
    first_seed: int | None = None,
    temperature: float | None = None,
    details: bool = False,
    progress=None,
    summarize=None,
) -> dict:
    """`evaluate_policy` with the `TrainerConfig`'s defaults: its `eval` section's
    episodes, seeds and temperature (else `rollout.temperature`), sampling seed
    `config.seed * 7919`. `summarize`: the rollout source's summary of the episodes
    (`RolloutSource.summarizer`: an env's `summarize`), or None."""
    episodes = config.eval.episodes if episodes is None else episodes
    first_seed = config.eval.seed if first_seed is None else first_seed
    if temperature is None:
        temperature = config.rollout.temperature if config.eval.temperature is None else config.eval.temperature
    out = evaluate_policy(
        loop,
        pool,
        params,
        episodes=episodes,
        first_seed=first_seed,
        temperature=temperature,
        sampling_seed=config.seed * 7919,
        details=details or summarize is not None,
        progress=progress,
    )
    if summarize is not None:
        out["env_summary"] = summary = summarize(out["per_episode"])
        out.update(flat_env_summary(summary))
        if not details:
            del out["per_episode"]
    return out


def flat_env_summary(summary: dict) -> dict[str, float]:
    """The numbers of an env summary as flat `env_<key>` (nested: `env_<key>_<sub>`)
    entries, the form metrics and `summary.json`'s evaluations keep them in."""
    out = {}
    for k, v in summary.items():
        if isinstance(v, dict):
            out.update(
                {
                    f"env_{k}_{kk}": float(vv)
                    for kk, vv in v.items()
                    if isinstance(vv, (int, float)) and not isinstance(vv, bool)
                }
            )
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"env_{k}"] = float(v)
    return out


#: the sections `jaxagent eval` may override (the env's settings, episode limits and the
#: evaluation); the model and everything a checkpoint must match come from the run
EVAL_OVERRIDABLE = ("env.", "rollout.", "eval.")


def evaluate_run(
    run_dir: str | Path,
    *,
    step: int | None = None,
    episodes: int | None = None,
    seed: int | None = None,
    temperature: float | None = None,
    out: str | Path | None = None,
    num_workers: int | None = None,
    overrides=(),
    log=print,
) -> dict:
    """`jaxagent eval` (module docstring). `overrides`: `key=value` for `EVAL_OVERRIDABLE`
    keys (e.g. `env.kwargs.cases=adversarial`): the checkpoint is restored with the run's
    own config and evaluated on the overridden env. The summary holds the env's own
    summary (`summarize`, e.g. intake's rubric and triage rates) under `env_summary`."""
    from jaxagent.dataclass_yaml import ConfigError
    from jaxagent.train import build

    run_dir = Path(run_dir)
    bad = [o for o in overrides if not o.split("=", 1)[0].startswith(EVAL_OVERRIDABLE)]
    if bad:
        raise ConfigError(f"eval overrides may set {', '.join(k + '*' for k in EVAL_OVERRIDABLE)} only, got {bad[0]!r}")
    workers = [] if num_workers is None else [f"env.num_workers={num_workers}"]
    trained = run_config(run_dir, workers)
    config = run_config(run_dir, [*workers, *overrides])
    episodes = config.eval.episodes if episodes is None else episodes
    if not isinstance(episodes, int) or episodes < 1:
        raise ValueError(
            f"episodes must be a positive int (the run's eval.episodes is {config.eval.episodes}), got {episodes!r}"
        )
    seed = config.eval.seed if seed is None else seed
    run, state, progress = restore_run(trained, step, log=log)
    source = build.rollout_source(config)
    source.check()
    with (
        build.episode_loop(source, run.tokenizer, run.model_config, run.placement, state) as loop,
        source.open_pools(config.env.batch_size) as pools,
    ):
        result = evaluate(
            config,
            loop,
            pools.held_out,
            run.placement.sampler_params(state),
            episodes=episodes,
            first_seed=seed,
            temperature=temperature,
            details=True,
            progress=EvalProgress(f"evaluating {run_dir.name}"),
            summarize=source.summarizer(),
        )
    per_episode = result.pop("per_episode")
    result = {k: v for k, v in result.items() if not k.startswith("env_") or k == "env_summary"}
    result.update(run_dir=str(run_dir), iteration=progress.iteration, first_seed=seed, overrides=list(overrides))
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in per_episode) + json.dumps(result) + "\n")
        tmp.replace(out)
    return result
