"""W5: environment-pool throughput and overhead (see benchmarks/README.md).

64 envs x 1000 steps each, stepped in batches (one action per env per call) by an
EnvPool with 1 and 2 worker processes, and sequentially in this process (a plain loop
over the env objects: no pool at all); ``workers=0`` is the pool run in-process (its
bookkeeping without any IPC). Three envs:

- ``busy``: ``testing/busy`` with ``work=400``: each step is a fixed ~0.1 ms of CPU (a
  SHA-256 chain over the action) and returns a short text: the CPU-bound text env
  that shows how the pool scales with workers.
- ``sokoban``: the built-in Sokoban (procedural 7x7 levels, 2 boxes), random moves,
  100-step episodes; finished episodes are reset with a new seed, and the level
  generation and solving that a reset does is counted as env work. A real env whose
  steps are cheap (~10 us), so the pool's overhead shows.
- ``null``: ``testing/null``, whose step does nothing; the pool's time minus the
  in-process time, divided by the steps, is the pool's own overhead per env step
  (IPC, pickling, bookkeeping).

Modes are interleaved (A B C A B C ...) after one warm-up round; figures are medians
over ``--repeats``. Worker start-up is timed separately. One JSON object per line on
stdout; ``--out PATH`` also appends them to a JSONL file.

    python benchmarks/w5_envpool.py --out benchmarks/results/w5_envpool.jsonl
    python benchmarks/w5_envpool.py --quick     # smoke run, < 20 s
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import envs  # noqa: E402

MOVES = ("<action>up</action>", "<action>down</action>", "<action>left</action>", "<action>right</action>")
ENV_FNS = {
    "busy": functools.partial(envs.make, "testing/busy", work=400),
    "sokoban": functools.partial(envs.make, "sokoban", max_steps=100),
    "null": functools.partial(envs.make, "testing/null"),
}


def _actions(num_envs: int, steps: int, seed: int = 0) -> list[list[str]]:
    rng = random.Random(seed)
    return [[rng.choice(MOVES) for _ in range(num_envs)] for _ in range(steps)]


def run_inprocess(env_name: str, num_envs: int, actions: list[list[str]]) -> float:
    """Seconds to play the workload with a plain loop over env objects."""
    fn = ENV_FNS[env_name]
    es = [fn() for _ in range(num_envs)]
    next_seed = num_envs
    t0 = time.perf_counter()
    for i, e in enumerate(es):
        e.reset(i)
    for batch in actions:
        for e, a in zip(es, batch, strict=True):
            if e.done:
                e.reset(next_seed)
                next_seed += 1
            e.step(a)
    return time.perf_counter() - t0


def run_pool(pool: envs.EnvPool, actions: list[list[str]]) -> float:
    """Seconds to play the workload through a started pool (resets included)."""
    n = len(pool)
    next_seed = n
    t0 = time.perf_counter()
    pool.reset(list(range(n)))
    for batch in actions:
        done = [i for i in range(n) if pool.status(i) != "running"]
        if done:
            seeds = [None] * n
            for i in done:
                seeds[i] = next_seed
                next_seed += 1
            pool.reset(seeds)
        pool.step(batch)
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-envs", type=int, default=64)
    p.add_argument("--steps", type=int, default=1000, help="steps per env")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--envs", nargs="+", default=["busy", "sokoban", "null"], choices=sorted(ENV_FNS))
    p.add_argument("--quick", action="store_true", help="8 envs x 50 steps, 2 repeats: a smoke run")
    p.add_argument("--out", help="append the JSON lines to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.num_envs, args.steps, args.repeats = 8, 50, 2
    total_steps = args.num_envs * args.steps
    common = {
        "workload": "W5",
        "num_envs": args.num_envs,
        "steps_per_env": args.steps,
        "repeats": args.repeats,
        "quick": args.quick,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    records = []

    def emit(rec):
        rec = {**common, **rec}
        records.append(rec)
        print(json.dumps(rec), flush=True)

    for env_name in args.envs:
        actions = _actions(args.num_envs, args.steps)
        pools, startup = {}, {}
        try:
            for w in [0] + args.workers:
                t0 = time.perf_counter()
                pools[w] = envs.EnvPool([ENV_FNS[env_name]] * args.num_envs, num_workers=w)
                pools[w].reset(list(range(args.num_envs)))  # workers up and envs built
                startup[w] = time.perf_counter() - t0
            modes = ["in-process", "workers=0"] + [f"workers={w}" for w in args.workers]
            times = {m: [] for m in modes}
            for rep in range(args.repeats + 1):  # round 0 is the warm-up
                for m in modes:
                    if m == "in-process":
                        dt = run_inprocess(env_name, args.num_envs, actions)
                    else:
                        dt = run_pool(pools[int(m.split("=")[1])], actions)
                    if rep > 0:
                        times[m].append(dt)
            base = statistics.median(times["in-process"])
            for m in modes:
                med = statistics.median(times[m])
                rec = {
                    "env": env_name,
                    "mode": m,
                    "median_s": round(med, 4),
                    "steps_per_s": round(total_steps / med, 1),
                    "all_s": [round(t, 4) for t in times[m]],
                    "speedup_vs_in_process": round(base / med, 3),
                }
                if m != "in-process":
                    w = int(m.split("=")[1])
                    rec["startup_s"] = round(startup[w], 3)
                    rec["pool_overhead_us_per_step"] = round((med - base) / total_steps * 1e6, 2)
                    rec["pool_overhead_ms_per_batch"] = round((med - base) / args.steps * 1e3, 3)
                emit(rec)
        finally:
            for pool in pools.values():
                pool.close()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "a") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
