"""Timing helpers of the update benchmarks: interleaved repeats, and the machine's
achievable float32 matmul rate measured in the same run."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def median_seconds(fn, repeats: int) -> float:
    """Median wall seconds of `repeats` calls of `fn` (the caller warms it up first)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_peak_gflops(n: int = 2048, repeats: int = 7) -> float:
    """GFLOP/s of a jitted `n x n` float32 matmul: the median of `repeats` timed calls
    after one warm-up call (the yardstick the update benchmarks report achieved FLOPs
    against)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    return 2 * n**3 / median_seconds(lambda: f(a).block_until_ready(), repeats) / 1e9


def time_interleaved(systems: dict, repeats: int) -> tuple[dict, dict, dict]:
    """`(second, times, cpu)` of calling each of `systems` (name -> no-argument function):
    one more warm-up call each (its seconds in `second`), then `repeats` rounds that call
    every system in turn (A B C A B C ...), recording each call's wall seconds (`times`)
    and process CPU seconds (`cpu`). The first call, which compiles, is the caller's."""
    second = {}
    for name, fn in systems.items():
        t = time.perf_counter()
        fn()
        second[name] = time.perf_counter() - t
    times, cpu = {k: [] for k in systems}, {k: [] for k in systems}
    for _ in range(repeats):
        for name, fn in systems.items():
            c, t = time.process_time(), time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return second, times, cpu
