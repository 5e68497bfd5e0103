"""W12 a group's shared prompt (tiny-qwen2): prefilled once per group vs once per row.

Workload (benchmarks/README.md, W12): the W1 model (Qwen2, vocab 4096, hidden 256, 4
layers, random N(0, 0.02) weights, float32). 4 groups of 8 episodes; each group's 8
episodes start from one 1,024-token prompt (a system prompt and tool list: fixed random
ids per group); then 4 turns of 64 generated tokens, with a 64-token observation (random
ids per episode and turn) appended between turns. No early stop.

Systems, same weights, prompts and observations, timed alternately:
  per_row   `append(init_state(32), prompts)`: every row prefills its own copy of its
            group's prompt (the loop with `share_prompts: false`)
  shared    `Sampler.prefill`: each distinct prompt prefilled once (4 rows), its cache
            rows copied to the group's 8 (the loop's default)
Figures: the prompt's prefill seconds (median; the state waited for), and policy
tokens/s of the whole rollout = 32 * 4 * 64 / median rollout seconds. Greedy rollouts of
the two must produce the same tokens (`greedy_tokens_agree`).

    python benchmarks/w12_shared_prompt.py [--quick] [--repeats 5] [--out benchmarks/results/w12_shared_prompt.jsonl]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from w1_generate import W1, emit  # noqa: E402
from w3_multiturn import live_turns  # noqa: E402

from jaxagent import models as M  # noqa: E402
from jaxagent.rollout import Sampler  # noqa: E402


def workload(groups, size, P, obs_len, turns):
    rng = np.random.RandomState(0)
    prompts = np.repeat(rng.randint(1, W1.vocab_size, (groups, P)), size, axis=0).astype(np.int32)
    obs = rng.randint(1, W1.vocab_size, (turns - 1, groups * size, obs_len)).astype(np.int32)
    return prompts, obs


def rollout(sampler: Sampler, prompts, obs, G, turns, mode, seed, shared: bool):
    """`(prefill seconds, rollout seconds, tokens)`: the prompt prefilled (shared or per
    row), then per turn G tokens decoded and the observation appended."""
    t0 = time.perf_counter()
    if shared:
        state = sampler.prefill(prompts.tolist(), seed)
    else:
        state = sampler.append(sampler.init_state(len(prompts), seed), prompts.tolist())
    jax.block_until_ready(state)
    prefill = time.perf_counter() - t0
    tokens = live_turns(sampler, state, obs, G, turns, mode)
    return prefill, time.perf_counter() - t0, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 groups of 4, a 256-token prompt, 2 turns: a smoke run")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--modes", default="greedy,temperature_1.0")
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    args = ap.parse_args()
    groups, size, P, G, obs_len, turns = (2, 4, 256, 16, 16, 2) if args.quick else (4, 8, 1024, 64, 64, 4)
    repeats = args.repeats or (2 if args.quick else 5)
    B = groups * size
    common = {
        "workload": "W12",
        "groups": groups,
        "group_size": size,
        "prompt_len": P,
        "tokens_per_turn": G,
        "obs_len": obs_len,
        "turns": turns,
        "quick": args.quick,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "jax": jax.__version__,
        "cpus": len(os.sched_getaffinity(0)),
    }
    params = M.init_params(jax.random.key(0), W1, std=0.02)
    prompts, obs = workload(groups, size, P, obs_len, turns)
    sampler = Sampler(params, W1, max_len=P + turns * G + (turns - 1) * obs_len, min_bucket=32)
    systems = {"per_row": False, "shared": True}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        first, prefill_s, total_s, toks = {}, {k: [] for k in systems}, {k: [] for k in systems}, {}
        for name, shared in systems.items():  # compilations
            t = time.perf_counter()
            toks[name] = rollout(sampler, prompts, obs, G, turns, mode, 0, shared)[2]
            first[name] = time.perf_counter() - t
        for r in range(repeats):
            for name, shared in systems.items():
                p, tot, _ = rollout(sampler, prompts, obs, G, turns, mode, r + 1, shared)
                prefill_s[name].append(p)
                total_s[name].append(tot)
        med = {k: (statistics.median(prefill_s[k]), statistics.median(total_s[k])) for k in systems}
        for name in systems:
            emit(
                {
                    **common,
                    "system": "jaxagent",
                    "variant": name,
                    "mode": mode,
                    "prefill_s": round(med[name][0], 4),
                    "rollout_s": round(med[name][1], 4),
                    "tokens_per_s": round(B * turns * G / med[name][1], 1),
                    "first_call_s": round(first[name], 2),
                    "prefill_speedup": round(med["per_row"][0] / med[name][0], 2),
                    "rollout_speedup": round(med["per_row"][1] / med[name][1], 2),
                    "greedy_tokens_agree": bool(np.array_equal(toks["per_row"], toks["shared"]))
                    if mode == "greedy"
                    else None,
                },
                args.out,
            )


if __name__ == "__main__":
    main()
