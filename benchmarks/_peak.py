"""The machine's achievable float32 matmul rate, measured in the benchmark's own run."""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def matmul_peak_gflops(n: int = 2048, repeats: int = 7) -> float:
    """GFLOP/s of a jitted `n x n` float32 matmul: the median of `repeats` timed calls
    after one warm-up call (the yardstick the update benchmarks report achieved FLOPs
    against)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9
