"""Scripted walkers on FrozenLake's held-out maps: what a policy that ignores the holes can
reach, and what one that reads them reaches, to read a trained policy's success against.

    python examples/frozenlake_baselines.py [--size 3] [--hole-prob 0.2] [--seed 2000000]
                                            [--episodes 64] [--max-turns 6]

The defaults are `configs/smollm2_frozenlake.yaml`'s map and held-out seeds (its
`eval.seed`, `eval.episodes`, `rollout.max_turns`). Prints one markdown row per walker:
success, the share of episodes that end in a hole, and the share that step into a hole
when a move toward G was safe (`FrozenLake.summarize`). The walkers:

- `right, right, down, down` and `down, down, right, right`: fixed walks, blind to holes;
- `best hole-blind`: the best of all walkers whose move (right or down) depends only on
  the position (2**4 of them on 3x3: the edge cells have one move toward G), picked on
  these very maps, so an upper bound for any hole-blind policy that heads for G;
- `local`: at each cell, a move toward G that is not onto a visible hole (a coin flip
  between two), blind to anything further;
- `expert`: value iteration (`FrozenLake.expert_action`).
"""

from __future__ import annotations

import argparse
import itertools
import random

import envs
from envs.frozenlake import moves_toward_goal, step_on


def play(env, seed: int, policy, max_turns: int) -> dict:
    env.reset(seed=seed)
    actions, info, reward = [], {}, 0.0
    for t in range(max_turns):
        actions.append(f"<action>{policy(env, t)}</action>")
        _, reward, term, trunc, info = env.step(actions[-1])
        if term or trunc:
            break
    return {"seed": seed, "success": reward == 1.0, "actions": actions, "info": info}


def toward(env) -> list[str]:
    return moves_toward_goal(env.pos, env.size) or ["right"]


def position_policy(choice: dict):
    return lambda env, t: choice.get(env.pos, toward(env)[0])


def local(env, t):
    cells = {d: step_on(env.pos, d, env.size) for d in toward(env)}
    safe = [d for d, (r, c) in cells.items() if env.rows[r][c] != "H"]
    opts = safe or toward(env)
    r, c = env.pos
    return opts[random.Random(f"{env.rows}|{r},{c}").randrange(len(opts))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=3)
    ap.add_argument("--hole-prob", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=2_000_000, help="first held-out seed (the config's eval.seed)")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--max-turns", type=int, default=6)
    args = ap.parse_args(argv)
    env = envs.make("frozenlake", size=args.size, hole_prob=args.hole_prob)
    seeds = range(args.seed, args.seed + args.episodes)

    def row(name, policy):
        eps = [play(env, s, policy, args.max_turns) for s in seeds]
        summary = env.summarize(eps)
        success = sum(e["success"] for e in eps) / len(eps)
        print(f"| {name} | {success:.3f} | {summary['hole_rate']:.3f} | {summary['avoidable_hole_rate']:.3f} |")

    n = args.size
    first, last = ["right"] * (n - 1) + ["down"] * (n - 1), ["down"] * (n - 1) + ["right"] * (n - 1)
    print("| walker | success | ends in a hole | steps into a hole a safe move avoided |\n|---|---|---|---|")
    row(", ".join(first), lambda env, t: (first + ["right"] * args.max_turns)[t])
    row(", ".join(last), lambda env, t: (last + ["down"] * args.max_turns)[t])
    inner = [(r, c) for r in range(n) for c in range(n) if r < n - 1 and c < n - 1]
    if len(inner) <= 16:
        scored = []
        for choice in itertools.product(("right", "down"), repeat=len(inner)):
            policy = position_policy(dict(zip(inner, choice, strict=True)))
            scored.append((sum(play(env, s, policy, args.max_turns)["success"] for s in seeds), choice))
        best = max(scored)[1]
        row("best hole-blind (picked on these maps)", position_policy(dict(zip(inner, best, strict=True))))
    row("local (refuses a visible hole next to it)", local)
    row("expert", lambda env, t: env.expert_action()[len("<action>") : -len("</action>")])


if __name__ == "__main__":
    main()
