"""How the intake warm start's held-out rubric depends on the number of SFT steps.

Runs the recipe's warm start (`configs/intake.yaml`) in stages of `warm_start.epochs`
each, continuing from the previous stage's weights with a fresh SFT optimizer (a new
warm-up), and after each stage evaluates the policy on 64 held-out standard cases,
sampled and greedy. One JSON line per stage: the last SFT loss, the seconds so far, and
the env's summary (rubric, components, triage rates, monitors) at each temperature.

    python examples/intake_sft_steps.py [--stages 3] [--episodes 64] [KEY=VALUE ...]

A research simulation, not a clinical tool.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def main(argv=None) -> None:
    from jaxagent.dataclass_yaml import load_config
    from jaxagent.train import build
    from jaxagent.train.config import TrainerConfig
    from jaxagent.train.trainer import Trainer
    from jaxagent.train.warmstart import sft_warm_start

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("overrides", nargs="*", help="config overrides, KEY=VALUE")
    args = ap.parse_args(argv)
    run_dir = tempfile.mkdtemp(prefix="intake_sft_steps_")
    cfg = load_config(TrainerConfig, "configs/intake.yaml", [*args.overrides, f"run_dir={run_dir}"])
    trainer = Trainer(cfg, log=lambda *_: None)
    loop = trainer.episode_loop()
    t0 = time.time()
    with trainer.source.open_pools(len(trainer.placement.rows)) as pools:
        params = trainer.state.params
        for stage in range(1, args.stages + 1):
            params, lines, _ = sft_warm_start(
                cfg,
                params,
                trainer.model_config,
                trainer.tokenizer,
                trainer.demonstrations,
                trainer.placement,
                log=lambda *_: None,
            )
            trainer.state = build.rl_state(
                cfg,
                params,
                trainer.model_config,
                trainer.placement,
                critic_key=trainer._keys["critic"],
                rng_key=trainer._keys["rng"],
            )
            trainer.loop_params(loop)
            out = {
                "stage": stage,
                "sft_steps": lines[-1]["sft_step"] * stage,
                "sft_loss": lines[-1]["loss"],
                "seconds": round(time.time() - t0),
            }
            for name, temperature in (("sampled", 1.0), ("greedy", 0.0)):
                ev = trainer.evaluate(
                    loop, pools.held_out, episodes=args.episodes, temperature=temperature, progress=None
                )
                out[name] = ev["env_summary"]
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
