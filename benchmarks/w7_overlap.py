"""W7: env stepping on the host overlapped with device decoding (AgentLoop pipeline_groups).

Workload: a small Qwen2-shaped decoder (byte vocabulary 259, hidden 128, 4 layers, random
N(0, 0.3) weights, float32) plays ``--episodes`` episodes for ``--turns`` turns of
``--tokens`` sampled tokens (temperature 1, no early stop but the end-of-turn token), in
an EnvPool of ``--workers`` processes, against two envs (``--envs``):

- ``busy``: ``testing/busy``, each step a SHA-256 chain of ``--work`` hashes: a
  CPU-bound env. On a CPU-only machine the "device" is the same cores, so overlap can
  only use cores that would otherwise idle.
- ``latency``: each step waits ``--latency-ms`` (sleeps: a tool call, a simulated user,
  a remote service) and then hashes like ``busy`` with ``--latency-work``: an env whose
  cost is mostly waiting, which overlaps with decoding even on a saturated CPU.

The defaults make a batch's env step take about as long as its decode.

Modes, timed interleaved (1 2 1 2 ...) after one warm-up round (compilations):
  pipeline_groups=1   decode all live rows, step them all, append, repeat
  pipeline_groups=N   N sub-batches pipelined: the envs step one while the device decodes
                      the next (see jaxagent/rollout/pipelined_loop.py)

Figures, medians over ``--repeats``: rollout seconds; the host's time per phase
(``decode_wait_s``: blocked on a decode; ``env_wait_s``: blocked on the pool; ``append_s``;
``dispatch_s``; ``submit_s``; ``host_s`` the rest: tokenizing, bookkeeping); device busy /
idle seconds and the fraction of the rollout the device is idle, and idle while the host
waits for the envs (the device counts as busy from a chain's first dispatch until its
decode is ready, so the idle figures are lower bounds). ``same_trajectories``: the modes'
tokens, rewards and ends are equal (log-probs to float32 rounding: ``max_logp_diff``).

    python benchmarks/w7_overlap.py [--quick] [--repeats 5] [--out benchmarks/results/w7_overlap.jsonl]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _jsonl import emit  # noqa: E402

import envs  # noqa: E402
from envs.testing import BusyEnv  # noqa: E402
from jaxagent import models as M  # noqa: E402
from jaxagent.models import tiny_config  # noqa: E402
from jaxagent.models.byte_tokenizer import byte_chat_tokenizer  # noqa: E402
from jaxagent.rollout import AgentLoop, AgentLoopConfig, SamplingConfig  # noqa: E402

PHASES = (
    "rollout_s",
    "decode_wait_s",
    "env_wait_s",
    "append_s",
    "dispatch_s",
    "submit_s",
    "host_s",
    "device_busy_s",
    "device_idle_s",
    "device_idle_env_wait_s",
)


class LatencyEnv(BusyEnv):
    """`testing/busy` whose step first waits `latency_s` without using the CPU."""

    def __init__(self, latency_s: float, work: int):
        super().__init__(work=work)
        self.latency_s = latency_s

    def _step(self, action: str):
        time.sleep(self.latency_s)
        return super()._step(action)


def same_trajectories(a, b) -> tuple[bool, float]:
    (ta, ea), (tb, eb) = a, b
    exact = all(
        np.array_equal(np.asarray(getattr(ta, f)), np.asarray(getattr(tb, f)))
        for f in ("tokens", "loss_mask", "turn_ids", "rewards", "done", "truncated", "failed", "lengths")
    )
    exact = exact and [e.end_reason for e in ea] == [e.end_reason for e in eb]
    diff = float(np.max(np.abs(np.asarray(ta.rollout_logp) - np.asarray(tb.rollout_logp))))
    return exact, diff


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32, help="max tokens per turn")
    ap.add_argument("--work", type=int, default=20000, help="SHA-256 hashes per env step")
    ap.add_argument("--latency-ms", type=float, default=10.0, help="wait per step of the latency env")
    ap.add_argument("--latency-work", type=int, default=400, help="hashes per step of the latency env")
    ap.add_argument("--envs", nargs="+", default=["busy", "latency"], choices=["busy", "latency"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--groups", type=int, default=2, help="pipeline_groups of the overlapped mode")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="4 episodes x 2 turns, tiny model, 1 repeat: a smoke run")
    ap.add_argument("--out", default=None, help="append JSON lines to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.episodes, args.turns, args.tokens, args.work, args.hidden, args.layers = 4, 2, 4, 50, 32, 2
        args.latency_ms, args.latency_work = 1.0, 50
    repeats = args.repeats or (1 if args.quick else 5)

    tok = byte_chat_tokenizer()
    cfg = tiny_config(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=args.hidden // 4,
    )
    params = M.init_params(jax.random.key(0), cfg, std=0.3)
    base = AgentLoopConfig(
        max_turns=args.turns, max_tokens_per_turn=args.tokens, max_context=512, sampling=SamplingConfig(1.0), seed=1
    )
    modes = {
        g: AgentLoop(params, cfg, tok, dataclasses.replace(base, pipeline_groups=g), profile=True)
        for g in (1, args.groups)
    }
    env_fns = {
        "busy": functools.partial(envs.make, "testing/busy", work=args.work),
        "latency": functools.partial(LatencyEnv, args.latency_ms / 1e3, args.latency_work),
    }
    seeds = list(range(args.episodes))
    common = {
        "workload": "W7",
        "episodes": args.episodes,
        "turns": args.turns,
        "tokens_per_turn": args.tokens,
        "workers": args.workers,
        "hidden": args.hidden,
        "layers": args.layers,
        "repeats": repeats,
        "quick": args.quick,
        "jax": jax.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    for env_name in args.envs:
        env_desc = (
            {"env": "testing/busy", "work": args.work}
            if env_name == "busy"
            else {"env": "latency", "latency_ms": args.latency_ms, "work": args.latency_work}
        )
        timings = {g: [] for g in modes}
        outs = {}
        with envs.EnvPool([env_fns[env_name]] * args.episodes, num_workers=args.workers) as pool:
            for rep in range(repeats + 1):  # round 0: warm-up (compilations, worker start-up)
                for g, loop in modes.items():
                    out = loop.run(pool, seeds)
                    if rep == 0:
                        outs[g] = out
                    else:
                        timings[g].append(dict(loop.timings))
        exact, diff = same_trajectories(outs[1], outs[args.groups])
        load = round(os.getloadavg()[0], 2)
        base_s = statistics.median(t["rollout_s"] for t in timings[1])
        for g, ts in timings.items():
            med = {k: round(statistics.median(t[k] for t in ts), 4) for k in PHASES}
            rec = {
                **common,
                **env_desc,
                "pipeline_groups": g,
                **med,
                "all_rollout_s": [round(t["rollout_s"], 4) for t in ts],
                "device_idle_frac": round(med["device_idle_s"] / med["rollout_s"], 3),
                "device_idle_env_wait_frac": round(med["device_idle_env_wait_s"] / med["rollout_s"], 3),
                "speedup_vs_groups_1": round(base_s / med["rollout_s"], 3),
                "same_trajectories": exact,
                "max_logp_diff": diff,
                "compilations": dict(modes[g].sampler.trace_counts),
                "load_avg_1m": load,
            }
            emit(rec, args.out)


if __name__ == "__main__":
    main()
