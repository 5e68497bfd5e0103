"""The reverse affine recurrence behind GAE, discounted returns and REINFORCE++.

Every masked return/advantage recurrence here has the form, per row,

    y[t] = a[t]·y[t+1] + b[t],   y[T] = 0,

which is linear in ``y``, so it can be run either as a reverse ``lax.scan`` (T
sequential steps, one row-vector each) or as ``lax.associative_scan`` (O(log T)
depth) with the composition ``(a1, b1) ∘ (a2, b2) = (a1·a2, a1·b2 + b1)``.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

METHODS = ("scan", "associative")
_UNROLL = 1


def reverse_affine(a_BxT, b_BxT, method: str = "scan"):
    """Solve ``y[t] = a[t]·y[t+1] + b[t]`` backwards along axis 1 (``y[T] = 0``)."""
    if method == "scan":

        def step(y_B, ab):
            a_B, b_B = ab
            y_B = a_B * y_B + b_B
            return y_B, y_B

        init = jnp.zeros_like(b_BxT[:, 0])  # inherits the rows' sharding
        # Time-major so each step reads one contiguous row-vector.
        _, y_TxB = lax.scan(step, init, (a_BxT.T, b_BxT.T), reverse=True, unroll=_UNROLL)
        return y_TxB.T
    if method == "associative":

        def compose(later, earlier):
            # With reverse=True the scan runs from t = T-1 down; `later` holds the
            # accumulated suffix (t+1 ...), `earlier` the new element.
            a_l, b_l = later
            a_e, b_e = earlier
            return a_e * a_l, a_e * b_l + b_e

        _, y = lax.associative_scan(compose, (a_BxT, b_BxT), reverse=True, axis=1)
        return y
    raise ValueError(f"unknown method {method!r}; expected one of {list(METHODS)}")


def discounted_returns(r_BxT, valid_BxT, gamma, method: str = "scan"):
    """``R[t] = r[t] + γ·R[t+1]`` over valid steps; masked steps carry ``R`` across."""
    a = jnp.where(valid_BxT, jnp.asarray(gamma, jnp.float32), 1.0)
    b = jnp.where(valid_BxT, r_BxT, 0.0)
    return reverse_affine(a, b, method)


def gae_raw(r_BxT, v_BxT, valid_BxT, gamma, lam, method: str = "scan"):
    """Un-whitened GAE with masked steps skipped (bootstrap and accumulator jump them)."""
    gamma = jnp.asarray(gamma, jnp.float32)
    lam = jnp.asarray(lam, jnp.float32)
    if method == "scan":
        # One fused scan carrying (next valid value, running advantage).
        def step(carry, x):
            nextvalue_B, lastgae_B = carry
            r_B, v_B, m_B = x
            delta_B = r_B + gamma * nextvalue_B - v_B
            gae_B = delta_B + gamma * lam * lastgae_B
            nextvalue_B = jnp.where(m_B, v_B, nextvalue_B)
            lastgae_B = jnp.where(m_B, gae_B, lastgae_B)
            return (nextvalue_B, lastgae_B), lastgae_B

        zeros = jnp.zeros_like(r_BxT[:, 0])  # inherits the rows' sharding
        _, adv_TxB = lax.scan(step, (zeros, zeros), (r_BxT.T, v_BxT.T, valid_BxT.T), reverse=True, unroll=_UNROLL)
        return adv_TxB.T
    if method == "associative":
        # nextvalue[t] = value at the first valid step after t (0 if none).
        carried_v = reverse_affine(jnp.where(valid_BxT, 0.0, 1.0), jnp.where(valid_BxT, v_BxT, 0.0), "associative")
        nextvalue = jnp.concatenate([carried_v[:, 1:], jnp.zeros_like(carried_v[:, :1])], axis=1)
        delta = r_BxT + gamma * nextvalue - v_BxT
        return reverse_affine(jnp.where(valid_BxT, gamma * lam, 1.0), jnp.where(valid_BxT, delta, 0.0), "associative")
    raise ValueError(f"unknown method {method!r}; expected one of {list(METHODS)}")


__all__ = ["METHODS", "reverse_affine", "discounted_returns", "gae_raw"]
