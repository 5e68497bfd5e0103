"""W3 multi-turn rollout (tiny-qwen2): live KV-cache continuation vs re-encoding the history.

Workload (benchmarks/README.md, W3): the W1 model (Qwen2, vocab 4096, hidden 256,
4 layers, random N(0, 0.02) weights, float32). 32 episodes x 5 turns: a 64-token first
prompt, then each turn 24 generated tokens, followed (between turns) by a 32-token
observation (fixed random ids per episode and turn). No early stop.
Figure: policy tokens/s = 32 * 5 * 24 / median whole-rollout seconds, and the
rollout's seconds; the first rollout's seconds (compilations) separately.

Systems / modes, same weights and observations, timed alternately:
  jaxagent / live      jaxagent.rollout.Sampler: prefill once, then each observation is
                       appended to the live cache (`append`) and decoding continues.
  jaxagent / reencode  the ablation: every turn starts from an empty cache and prefills
                       the whole history (prompt + earlier actions + observations), as a
                       trainer that re-renders the chat each turn does.
  tunix / reencode     (with --systems ...,tunix) Tunix's sampler called once per turn on
                       the whole history (how Tunix's multi-turn rollout drives it).
Each is run greedy and at temperature 1.0 (`mode` = greedy / temperature_1.0; the
`variant` field says live or reencode). Greedy live and re-encoded rollouts must
produce the same tokens (`greedy_agree_live_vs_reencode`).

    python benchmarks/w3_multiturn.py [--quick] [--repeats 5] [--out benchmarks/results/w3_multiturn.jsonl]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from w1_generate import MODES, W1, emit, tunix_system  # noqa: E402

from jaxagent import models as M  # noqa: E402
from jaxagent.rollout import Sampler  # noqa: E402


def workload(B, P, G, obs_len, turns):
    rng = np.random.RandomState(0)
    prompts = rng.randint(1, W1.vocab_size, (B, P)).astype(np.int32)
    obs = rng.randint(1, W1.vocab_size, (turns - 1, B, obs_len)).astype(np.int32)
    return prompts, obs


def live_rollout(sampler: Sampler, prompts, obs, G, turns, mode, seed):
    """Prefill once; per turn decode G tokens, then append the observation to the live cache."""
    return live_turns(
        sampler, sampler.append(sampler.init_state(len(prompts), seed), prompts.tolist()), obs, G, turns, mode
    )


def live_turns(sampler: Sampler, state, obs, G, turns, mode):
    """From a prefilled `state`: per turn decode G tokens, then append the observation
    `obs[k]` to the live cache; the decoded tokens `[B, turns * G]`."""
    out = []
    for k in range(turns):
        state, gen = sampler.decode(state, max_new_tokens=G, sampling=MODES[mode])
        out.append(np.asarray(gen.tokens_BxN))
        if k + 1 < turns:
            state = sampler.append(state, obs[k].tolist())
    return np.concatenate(out, axis=1)


def reencode_rollout(sampler: Sampler, prompts, obs, G, turns, mode, seed):
    """Per turn: a fresh cache, prefill of the whole history so far, decode G tokens."""
    hist = prompts
    out = []
    for k in range(turns):
        state = sampler.append(sampler.init_state(len(prompts), seed), hist.tolist())
        _, gen = sampler.decode(state, max_new_tokens=G, sampling=MODES[mode])
        toks = np.asarray(gen.tokens_BxN)
        out.append(toks)
        if k + 1 < turns:
            hist = np.concatenate([hist, toks, obs[k]], axis=1)
    return np.concatenate(out, axis=1)


def tunix_reencode(params, prompts, obs, G, turns, tmp: Path):
    """Tunix's sampler per turn on the whole history (its cache must hold history + G)."""
    total = prompts.shape[1] + turns * G + (turns - 1) * obs.shape[2]
    max_prompt = 1 << (total - G - 1).bit_length()
    run_turn = tunix_system(params, np.zeros((1, max_prompt), np.int32), G, tmp, variable_prompts=True)

    def run(mode, seed):
        hist = prompts
        out = []
        for k in range(turns):
            toks = run_turn(mode, seed, hist)
            out.append(toks)
            if k + 1 < turns:
                hist = np.concatenate([hist, toks, obs[k]], axis=1)
        return np.concatenate(out, axis=1)

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="8 episodes x 3 turns, 2 repeats: a smoke run")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--systems", default="jaxagent", help="comma list: jaxagent[,tunix]")
    ap.add_argument("--modes", default="greedy,temperature_1.0")
    ap.add_argument("--settle", type=float, default=0.5, help="idle seconds before each timed rollout")
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    args = ap.parse_args()
    B, P, G, obs_len, turns = (8, 64, 24, 32, 3) if args.quick else (32, 64, 24, 32, 5)
    repeats = args.repeats or (2 if args.quick else 5)
    common = {
        "workload": "W3",
        "episodes": B,
        "turns": turns,
        "prompt_len": P,
        "tokens_per_turn": G,
        "obs_len": obs_len,
        "quick": args.quick,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "jax": jax.__version__,
        "cpus": len(os.sched_getaffinity(0)),
    }
    params = M.init_params(jax.random.key(0), W1, std=0.02)
    prompts, obs = workload(B, P, G, obs_len, turns)
    max_len = P + turns * G + (turns - 1) * obs_len
    sampler = Sampler(params, W1, max_len=max_len, min_bucket=32)
    runs = {
        ("jaxagent", "live"): lambda m, s: live_rollout(sampler, prompts, obs, G, turns, m, s),
        ("jaxagent", "reencode"): lambda m, s: reencode_rollout(sampler, prompts, obs, G, turns, m, s),
    }
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        if "tunix" in wanted:
            try:
                runs[("tunix", "reencode")] = tunix_reencode(params, prompts, obs, G, turns, Path(tmp))
            except ImportError as e:
                emit({**common, "system": "tunix", "skipped": f"not installed: {e}"}, args.out)
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            first, times, outs = {}, {k: [] for k in runs}, {}
            for k, run in runs.items():
                t = time.perf_counter()
                outs[k] = run(mode, 0)
                first[k] = time.perf_counter() - t
            for r in range(repeats):
                for k, run in runs.items():
                    time.sleep(args.settle)
                    t = time.perf_counter()
                    run(mode, r + 1)
                    times[k].append(time.perf_counter() - t)
            rates = {k: B * turns * G / statistics.median(ts) for k, ts in times.items()}
            live = outs[("jaxagent", "live")]
            for (system, variant), ts in times.items():
                rec = {
                    **common,
                    "system": system,
                    "mode": mode,
                    "variant": variant,
                    "tokens_per_s": round(rates[(system, variant)], 1),
                    "rollout_s": round(statistics.median(ts), 4),
                    "first_rollout_s": round(first[(system, variant)], 3),
                    "repeats": repeats,
                    "load_avg_1m": round(os.getloadavg()[0], 2),
                }
                if mode == "greedy":
                    rec["greedy_agree_live_vs_reencode"] = round(float(np.mean(outs[(system, variant)] == live)), 5)
                if (system, variant) == ("jaxagent", "live"):
                    for k in runs:
                        if k != ("jaxagent", "live"):
                            rec[f"ratio_vs_{k[0]}_{k[1]}"] = round(rates[("jaxagent", "live")] / rates[k], 2)
                    rec["compilations"] = dict(sampler.trace_counts)
                emit(rec, args.out)


if __name__ == "__main__":
    main()
