"""Trace-time argument checks shared by the kernels.

Every check runs while tracing (shapes and dtypes are static), so a mistake raises
a ``ValueError``/``TypeError`` naming the argument before anything is compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def floats(name: str, x, ndim: int | None = None, shape: tuple | None = None):
    """``x`` as float32, after checking it is a floating array of the right shape."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")
    _shape(name, x, ndim, shape)
    return x.astype(jnp.float32)


def mask(name: str, m, shape: tuple):
    """A validity mask as bool; any non-zero entry counts as valid."""
    m = jnp.asarray(m)
    if not (m.dtype == jnp.bool_ or jnp.issubdtype(m.dtype, jnp.number)):
        raise TypeError(f"{name} must be a bool or numeric array, got dtype {m.dtype}")
    _shape(name, m, None, shape)
    return m if m.dtype == jnp.bool_ else m != 0


def ints(name: str, x, shape: tuple):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")
    _shape(name, x, None, shape)
    return x


def choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {sorted(allowed)}")


def _shape(name, x, ndim, shape) -> None:
    if ndim is not None and x.ndim != ndim:
        dims = {1: "[B]", 2: "[B, T]"}.get(ndim, f"{ndim} dimensions")
        raise ValueError(f"{name} must be {dims}, got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}")


def gathered(x):
    """``x`` replicated if it is explicitly sharded (sorts over a sharded axis are
    not allowed under explicit sharding); a no-op otherwise."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is not None and any(axis is not None for axis in spec):
        return jax.reshard(x, PartitionSpec())
    return x


def resharded_like(x, ref):
    """``x`` laid out like the leading axes of ``ref`` when ``ref`` is explicitly
    sharded (undoes :func:`gathered` for a result); a no-op otherwise."""
    sharding = getattr(jax.typeof(ref), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is not None and any(axis is not None for axis in spec):
        return jax.reshard(x, PartitionSpec(*tuple(spec)[: x.ndim]))
    return x
