"""Group statistics for ids that need not be contiguous or small.

Rows are sorted by their key(s) (O(N log N), jittable, no [N, N] comparison
matrix), each run of equal keys becomes a dense segment id, and per-group sums go
through ``jax.ops.segment_*`` with a static upper bound of N segments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._checks import gathered


def segment_ids(*keys):
    """Dense segment id per element: equal key tuples share an id (ids < N).

    ``keys`` are 1-D integer arrays of equal length N; the last key is the primary
    sort key (as in ``jnp.lexsort``).
    """
    keys = tuple(gathered(k) for k in keys)
    n = keys[0].shape[0]
    order = jnp.lexsort(keys)
    starts = jnp.zeros((n,), jnp.bool_).at[0].set(True)
    for k in keys:
        k_sorted = k[order]
        starts = starts.at[1:].set(starts[1:] | (k_sorted[1:] != k_sorted[:-1]))
    seg_sorted = jnp.cumsum(starts.astype(jnp.int32)) - 1
    return jnp.zeros((n,), jnp.int32).at[order].set(seg_sorted)


class GroupStats:
    """Per-element group count, deviation from the group mean, and unbiased std.

    The mean is taken after shifting each group by its minimum, so a group whose
    values are all equal has deviations of exactly 0 (the reference's float32 mean
    can miss the common value by an ulp, which std-normalisation then blows up).
    """

    def __init__(self, x_N, seg_N, weight_N=None):
        x_N = gathered(x_N)
        n = x_N.shape[0]
        w = jnp.ones((n,), jnp.float32) if weight_N is None else gathered(weight_N).astype(jnp.float32)
        big = jnp.finfo(jnp.float32).max
        count = jax.ops.segment_sum(w, seg_N, num_segments=n)
        low = jax.ops.segment_min(jnp.where(w > 0, x_N, big), seg_N, num_segments=n)
        shifted = jnp.where(w > 0, x_N - low[seg_N], 0.0)
        mean_shift = jax.ops.segment_sum(shifted, seg_N, num_segments=n) / jnp.maximum(count, 1.0)
        dev = jnp.where(w > 0, shifted - mean_shift[seg_N], 0.0)
        sq = jax.ops.segment_sum(dev * dev, seg_N, num_segments=n)
        var = sq / jnp.maximum(count - 1.0, 1.0)
        self.count = count[seg_N]
        self.deviation = dev  # x - group mean
        # sqrt has an infinite slope at 0: keep gradients finite for equal-valued groups.
        positive = var > 0
        self.std = jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)[seg_N]
