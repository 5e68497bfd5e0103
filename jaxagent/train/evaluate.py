"""`jaxagent eval`: a trained run's policy on held-out seeds.

    evaluate_run("runs/default", episodes=256, out="eval.jsonl")

loads `<run_dir>/config.yaml` (the config the run was trained with), restores a
checkpoint (the latest, or `step`), and plays `episodes` episodes on seeds `seed,
seed + 1, ...` (default: the config's `eval` section) with the run's env, limits and
sampling (`temperature` overrides it; 0 = greedy). Returns the summary (success rate,
mean return and turns); with `out`, writes one JSON line per episode (seed, success,
return, turns, end reason, the env's last info: e.g. `intake`'s rubric components)
followed by the summary line.
"""
from __future__ import annotations

import json
from pathlib import Path


def evaluate_run(run_dir: str | Path, *, step: int | None = None, episodes: int | None = None,
                 seed: int | None = None, temperature: float | None = None, out: str | Path | None = None,
                 num_workers: int | None = None, log=print) -> dict:
    import envs
    from jaxagent.config import load_config
    from jaxagent.train.checkpoint import CheckpointManager
    from jaxagent.train.trainer import Trainer, TrainerConfig, _env_factory

    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a training run directory: {config_path} is missing")
    overrides = [f"run_dir={run_dir}"]
    if num_workers is not None:
        overrides.append(f"env.num_workers={num_workers}")
    config = load_config(TrainerConfig, config_path, overrides)
    episodes = config.eval.episodes if episodes is None else episodes
    if not isinstance(episodes, int) or episodes < 1:
        raise ValueError(f"episodes must be a positive int (the run's eval.episodes is {config.eval.episodes}), "
                         f"got {episodes!r}")
    seed = config.eval.seed if seed is None else seed
    trainer = Trainer(config, resume=True, log=log)
    with CheckpointManager(run_dir / "checkpoints") as ckpt:
        if ckpt.latest_step() is None:
            raise FileNotFoundError(f"no checkpoint in {ckpt.directory}")
        if step is not None and step not in ckpt.all_steps():
            raise ValueError(f"no checkpoint at step {step} in {ckpt.directory}; steps: {ckpt.all_steps()}")
        trainer.state, extras = ckpt.restore(trainer.state, step)
    used = step if step is not None else extras.get("iteration")
    loop = trainer._agent_loop()
    factory = _env_factory(config.env.name, config.env.kwargs)
    with envs.EnvPool([factory] * config.env.batch_size, num_workers=config.env.num_workers,
                      step_timeout=config.env.step_timeout) as pool:
        result = trainer.evaluate(loop, pool, episodes=episodes, first_seed=seed, temperature=temperature,
                                  details=True)
    per_episode = result.pop("per_episode")
    result.update(run_dir=str(run_dir), iteration=int(extras.get("iteration", used or 0)), first_seed=seed)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in per_episode) + json.dumps(result) + "\n")
        tmp.replace(out)
    return result
