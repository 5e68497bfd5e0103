"""W9: episodes of uneven latency: continuous scheduling vs turn-synchronous vs pipeline_groups.

Workload (benchmarks/README.md, W9): the tiny-qwen2 model (W1's weights) plays 64
episodes (8 groups of 8; each episode has its own env seed, or with `--shared-seeds`
the 8 episodes of a group share one) with a
64-token first prompt, 16 sampled tokens a turn (temperature 1.0) and 16-token
observations. The env (`envs.testing.UnevenEnv`, "testing/uneven") decides each episode's length from its seed
(uniform 2-8 turns) and each step's latency from a log-normal distribution (median
20 ms, sigma 1.0, capped at 1 s) seeded by (episode seed, turn), spent sleeping, as a
remote tool or a simulated user would. The tokenizer is a word-level one made here
(ChatML template; the 4,096 ids of the model's vocabulary), so that a prompt or an
observation is an exact number of tokens: the script prints the counts it measured.

Variants, timed interleaved after a warm-up round (compilations, worker start-up), on
one `EnvPool` of `--workers` processes (the same pool for every variant; each worker
runs its slots' steps one after another):

  sync         turn-synchronous: every live episode decodes, then every env steps
  groups=2     `pipeline_groups=2`: two halves pipelined against each other
  slots=S      continuous scheduling (`AgentLoopConfig.slots`) with S sampler rows

Figures, medians over `--repeats` (default 5): episodes/s of the whole rollout, its
seconds, and the fraction of its wall time the device was idle (`AgentLoop(profile=True)`:
the device counts as busy from a chain's first dispatch until its decode is ready, so
idle is a lower bound). `same_trajectories`: each variant's tokens, rewards and ends
equal the turn-synchronous ones (log-probs to float32 rounding: `max_logp_diff`).

    python benchmarks/w9_uneven.py [--quick] [--repeats 5] [--workers 16] [--out benchmarks/results/w9_uneven.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from _jsonl import emit  # noqa: E402

import envs  # noqa: E402  (light: the env workers, spawned, import this script again, so
from envs.testing import UnevenEnv  # noqa: E402  JAX and the model are imported in main())

#: the template's own words, then one word per remaining id of the vocabulary
ROLE_WORDS = ("system", "user", "assistant")
SPECIALS = 3  # <|endoftext|>, <|im_start|>, <|im_end|> (added after the words)


def word_tokenizer(vocab_size: int):
    """A word-level ChatML tokenizer with exactly `vocab_size` ids: the role words,
    `w0`, `w1`, ... and the three ChatML specials (the last three ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jaxagent.models.byte_tokenizer import chatml_tokenizer

    words = list(ROLE_WORDS) + [f"w{i}" for i in range(vocab_size - len(ROLE_WORDS) - SPECIALS)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = chatml_tokenizer(tok)
    assert len(out) == vocab_size, len(out)
    return out


def same_trajectories(a, b) -> tuple[bool, float]:
    import numpy as np

    (ta, ea), (tb, eb) = a, b
    exact = all(
        np.array_equal(np.asarray(getattr(ta, f)), np.asarray(getattr(tb, f)))
        for f in ("tokens", "loss_mask", "turn_ids", "rewards", "done", "truncated", "failed", "lengths")
    )
    exact = exact and [e.end_reason for e in ea] == [e.end_reason for e in eb]
    exact = exact and [e.observations for e in ea] == [e.observations for e in eb]
    diff = float(np.max(np.abs(np.asarray(ta.rollout_logp) - np.asarray(tb.rollout_logp))))
    return exact, diff


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=8, help="tasks (env seeds)")
    ap.add_argument("--group-size", type=int, default=8, help="episodes per task")
    ap.add_argument("--workers", type=int, default=16, help="EnvPool worker processes (every variant)")
    ap.add_argument("--slots", default="64", help="comma list: continuous variants' sampler rows")
    ap.add_argument("--median-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument(
        "--quick",
        action="store_true",
        help="2 groups of 4, 2-3 turns, 4 tokens, 2 ms latency, a 2-layer hidden-64 model, 1 repeat: a smoke run",
    )
    ap.add_argument(
        "--shared-seeds",
        action="store_true",
        help="the episodes of a group share their env seed (length and latencies)",
    )
    ap.add_argument(
        "--small-model",
        action="store_true",
        help="a 2-layer hidden-64 model of the same vocabulary (decode rounds about 10x cheaper: "
        "the ratio of decode to env latency of a faster device)",
    )
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    args = ap.parse_args(argv)
    import jax
    import numpy as np
    from w1_generate import W1

    from jaxagent import models as M
    from jaxagent.rollout import AgentLoop, AgentLoopConfig, SamplingConfig

    tokens = 16
    env_kw = {"median_ms": args.median_ms}
    if args.quick:
        args.groups, args.group_size, args.workers, tokens = 2, 4, 2, 4
        env_kw.update(min_turns=2, max_turns=3, median_ms=2.0)
        args.slots = "4"
    repeats = args.repeats or (1 if args.quick else 5)
    slots = [int(s) for s in args.slots.split(",") if s.strip()]
    if any(s < 1 for s in slots):
        ap.error("--slots: each must be >= 1")
    B = args.groups * args.group_size

    model = W1
    if args.quick or args.small_model:  # the same vocabulary, the same code paths, cheaper decodes
        model = dataclasses.replace(W1, hidden_size=64, intermediate_size=128, num_layers=2, head_dim=16)
    tok = word_tokenizer(model.vocab_size)
    params = M.init_params(jax.random.key(0), model, std=0.02)
    env_fn = functools.partial(UnevenEnv, **env_kw)
    probe = env_fn()
    obs0, info0 = probe.reset(seed=0)
    base = AgentLoopConfig(
        max_turns=probe.max_turns, max_tokens_per_turn=tokens, max_context=512, sampling=SamplingConfig(1.0), seed=1
    )
    variants = {"sync": base, "groups=2": dataclasses.replace(base, pipeline_groups=2)}
    variants.update({f"slots={s}": dataclasses.replace(base, slots=s) for s in slots})
    loops = {name: AgentLoop(params, model, tok, cfg, profile=True) for name, cfg in variants.items()}
    chat = loops["sync"].chat
    prompt_tokens = len(chat.prompt_tokens(probe.system_prompt, obs0))
    obs_tokens = len(chat.observation_tokens(probe._words(probe.obs_words, 1), after_end_of_turn=False))
    # each episode its own env seed (so its own length and latencies), unless --shared-seeds:
    # a rollout does not need a group's episodes to play one task, and with one seed a
    # group's episodes would wait exactly alike
    seeds = [g for g in range(args.groups) for _ in range(args.group_size)] if args.shared_seeds else list(range(B))
    group_ids = [i // args.group_size for i in range(B)]
    lengths = [random.Random(f"length-{s}").randint(probe.min_turns, probe.max_turns) for s in seeds]
    common = {
        "workload": "W9",
        "episodes": B,
        "groups": args.groups,
        "group_size": args.group_size,
        "prompt_tokens": prompt_tokens,
        "obs_tokens": obs_tokens,
        "tokens_per_turn": tokens,
        "median_ms": env_kw["median_ms"],
        "workers": args.workers,
        "repeats": repeats,
        "model": "tiny-qwen2" if model is W1 else "small (2 layers, hidden 64)",
        "shared_seeds": args.shared_seeds,
        "turns_total": sum(lengths),
        "turns_max": max(lengths),
        "quick": args.quick,
        "jax": jax.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(
        f"W9: {B} episodes, prompt {prompt_tokens} tokens, observations {obs_tokens} tokens, "
        f"{sum(lengths)} env steps (longest episode {max(lengths)}), {args.workers} workers",
        file=sys.stderr,
    )
    timings = {name: [] for name in loops}
    outs = {}
    with envs.EnvPool([env_fn] * B, num_workers=args.workers, step_timeout=30.0) as pool:
        for rep in range(repeats + 1):  # round 0: warm-up
            for name, loop in loops.items():
                out = loop.run(pool, seeds, group_ids)
                if rep == 0:
                    outs[name] = out
                else:
                    timings[name].append(dict(loop.timings))
            print(
                f"W9: round {rep}/{repeats} " + " ".join(f"{n} {loops[n].timings['rollout_s']:.2f}s" for n in loops),
                file=sys.stderr,
            )
    load = round(os.getloadavg()[0], 2)
    sync_s = statistics.median(t["rollout_s"] for t in timings["sync"])
    gen_tokens = [sum(len(t) for k, t in e.segments if k == "policy") for e in outs["sync"][1]]
    for name, ts in timings.items():
        exact, diff = same_trajectories(outs["sync"], outs[name])
        med = {
            k: round(statistics.median(t[k] for t in ts), 4)
            for k in ("rollout_s", "decode_wait_s", "env_wait_s", "append_s", "device_busy_s", "device_idle_s")
        }
        emit(
            {
                **common,
                "variant": name,
                "slots": variants[name].slots,
                "pipeline_groups": variants[name].pipeline_groups,
                "episodes_per_s": round(B / med["rollout_s"], 2),
                **med,
                "all_rollout_s": [round(t["rollout_s"], 4) for t in ts],
                "device_idle_frac": round(med["device_idle_s"] / med["rollout_s"], 3),
                "speedup_vs_sync": round(sync_s / statistics.median(t["rollout_s"] for t in ts), 3),
                "generated_tokens_mean": round(float(np.mean(gen_tokens)), 1),
                "same_trajectories": exact,
                "max_logp_diff": diff,
                "compilations": dict(loops[name].sampler.trace_counts),
                "load_avg_1m": load,
            },
            args.out,
        )


if __name__ == "__main__":
    main()
