"""Shared data generators and assertions for the ``jaxagent.algos`` tests.

Shapes are kept to a handful (mostly B=6, T=9) so each kernel compiles once or
twice for the whole suite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

B, T = 6, 9  # default token-level batch
S = 5  # default number of turns / env steps

RTOL, ATOL = 1e-5, 1e-5  # float32 rounding
WRTOL, WATOL = 1e-4, 1e-4  # whitened outputs (divide by a float32 std)

POISON = (np.nan, np.inf, -np.inf)


def rng_for(seed):
    return np.random.default_rng(seed)


def multiturn_mask(rng, b=B, t=T, empty_rows=()):
    """Ragged 0/1 masks shaped like multi-turn agent episodes.

    Each non-empty row alternates policy spans (1) with observation spans (0,
    the interior holes), then may end in padding; rows in ``empty_rows`` are
    fully masked.  Every other row has at least one valid token.
    """
    m = np.zeros((b, t), np.float32)
    for i in range(b):
        if i in empty_rows:
            continue
        pos = int(rng.integers(0, 2))
        while pos < t:
            span = int(rng.integers(1, 4))
            m[i, pos : pos + span] = 1
            pos += span + int(rng.integers(1, 4))
            if rng.random() < 0.25:
                break
        if m[i].sum() == 0:
            m[i, int(rng.integers(0, t))] = 1
    return m


def turn_ids_from_mask(rng, mask):
    """Turn index of each token: one turn per maximal policy span; -1 elsewhere.

    A few masked tokens inside a turn keep the turn's id (mask decides), so
    both conditions of turns_to_tokens are exercised.
    """
    b, t = mask.shape
    tid = -np.ones((b, t), np.int32)
    n_turns = np.zeros(b, np.int32)
    for i in range(b):
        k = -1
        prev = 0
        for j in range(t):
            if mask[i, j] and not prev:
                k += 1
            if mask[i, j]:
                tid[i, j] = k
            elif k >= 0 and rng.random() < 0.2:
                tid[i, j] = k  # masked token that still belongs to the turn
            prev = mask[i, j]
        n_turns[i] = k + 1
    return tid, n_turns


def poison(x, mask, rng=None):
    """Copy of x with NaN / +inf / -inf written at every masked position."""
    x = np.array(x, dtype=np.float32, copy=True)
    idx = np.argwhere(np.asarray(mask) == 0)
    for n, ij in enumerate(idx):
        x[tuple(ij)] = POISON[n % 3]
    return x


def randn(rng, shape=(B, T), scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def group_ids_noncontig(rng, b=B):
    """Non-contiguous groups: half the time a permutation of a layout with a
    singleton (e.g. [0 1 0 2 1 0]), otherwise random ids in [0, 4)."""
    if rng.random() < 0.5:
        return rng.integers(0, 4, size=b).astype(np.int32)
    base = np.array([0, 1, 0, 2, 1, 0, 3, 1, 3, 2, 0, 4][:b], np.int32)
    return base[rng.permutation(b)]


def assert_close(actual, expected, mask=None, rtol=RTOL, atol=ATOL, err=""):
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, (a.shape, e.shape, err)
    if mask is not None:
        sel = np.broadcast_to(np.asarray(mask) != 0, a.shape)
        a, e = a[sel], e[sel]
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=err)


def assert_zero_where_masked(x, mask, err=""):
    x = np.asarray(x)
    sel = np.asarray(mask) == 0
    bad = x[sel]
    assert np.all(bad == 0), f"{err}: nonzero at masked positions: {bad[bad != 0]}"


def assert_f32(x, err=""):
    assert jnp.asarray(x).dtype == jnp.float32, f"{err}: dtype {jnp.asarray(x).dtype}"


def assert_finite(x, err=""):
    assert np.all(np.isfinite(np.asarray(x, np.float64))), f"{err}: non-finite values"


@functools.cache
def jitted(fn, **static):
    """jax.jit(fn) with static keyword args closed over, cached per config."""
    return jax.jit(functools.partial(fn, **static))
